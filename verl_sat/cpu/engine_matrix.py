# Copyright 2026 The verl-sat Authors
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""R3 and SAT under the engine configurations verl users run, through verl's own FSDP engine on this CPU.

A cell is one engine configuration (``CELLS``): FSDP1 (verl's default) with ``use_orig_params`` false or true, FSDP2
with or without ``offload_policy``, param and optimizer offload, LoRA (non-zero adapters, loaded through verl's
``lora_adapter_path``), Ulysses sequence parallelism 2, dynamic batch size, hybrid sharding, their combinations
(LoRA with Ulysses, dynamic batching with Ulysses), and verl's default precision (bf16 mixed precision: parameters
cast to bf16 for the forward and backward, fp32 reduction) for FSDP1 and FSDP2 with and without gradient
checkpointing; the other cells compute in float32. Gradient checkpointing is verl's default, so cells turn it off.
For each cell two ranks over gloo build verl's ``ActorRolloutRefWorker`` from the composed config
(``+recipe=sat_gspo_r3 r3=fsdp``; verl's ``EngineRegistry`` picks the engine class), record what the engine built and
did (``evidence``: read off the engine, its module and the calls it made), and run, on samples that a rollout engine
drew together with its routes (vLLM's CPU build in the cell's precision, ``python -m verl_sat.cpu.vllm_r3 sample``):

1. ``compute_log_prob`` replaying the rollout's routes: it must reproduce the rollout's log-probs to the bound the
   reference sets (``reference``: the unwrapped model in the cell's precision on the same routes; the bound is the
   reference's own difference from vLLM plus the cell's tolerance), with every MoE layer replayed in every
   micro-batch; the same pass without replay (the call's ``enable_routing_replay`` flag off) is reported beside it,
   and under bf16, where vLLM's routes differ from the trainer's own, a miss by less than ``REPLAY_MARGIN`` is
   reported as a warning (``CellResult.warnings``: the replay check has no power on those samples);
2. ``compute_log_prob`` replaying *other* routes (each expert id shifted by one): it must equal the reference
   replaying the same routes, so the engine demonstrably used the routes it was given. Under LoRA the reference pass
   that verl computes in the actor with the adapters off is checked against the base model the same way, and must
   differ measurably from the adapters-on pass;
3. one ``update_actor`` step with SAT-GSPO (per-token gate, which acts at these micro-batch sizes) and plain SGD
   (lr 1, no clipping), on the shifted routes: the parameter change is minus the gradient, and it must equal the
   gradient of the reference computed with verl's ``ppo_loss`` on the very micro-batches verl's engine formed; the
   parameters LoRA freezes must not move. Under gradient checkpointing the routers run again in the backward,
   replaying the same routes: the gradient would differ otherwise.

Where a CPU cannot exercise a switch (offload moves nothing: every tensor is in host memory already), the cell says
"composition only on a CPU" (``Cell.cpu_note``) and checks what does run: verl's offload and reload calls, and replay
after them.

::

    python -m verl_sat.cpu.engine_matrix --model M --samples S32 --bf16-samples S16 [--cells fsdp1,lora_fsdp2]
"""

import argparse
import faulthandler
import functools
import os
import socket
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

WORLD = 2
LAYERS_KEY = "actor/r3_layers_replayed"


@dataclass(frozen=True)
class Tolerances:
    """What a cell of one precision must meet against its reference (the unwrapped model in that precision)."""

    log_prob: float  # max |engine - reference| log-prob (nats), on the rollout's and on shifted routes
    grad: float  # max |step - reference gradient|, relative to the largest reference gradient entry


# float32: 2^-15 nats (256 float32 units in the last place of a 1-nat log-prob), the engine's float32 sums in another
# order than one process's (sequence-parallel shards, and CPU kernels whose blocking differs between machines: the
# Ulysses cells measured 1.26e-5 on one machine, within 1e-5 on others), while a replay error moves a log-prob by
# nats; bfloat16: one unit in the last place of a 1-nat log-prob (2^-8), and a gradient within 1e-3 of its largest
# entry (the reference replays the very micro-batches the engine formed, so both measure far below:
# docs/routing_replay.md)
TOLERANCES = {"float32": Tolerances(log_prob=2**-15, grad=1e-5), "bfloat16": Tolerances(log_prob=2**-8, grad=1e-3)}
# bf16: without replay, max |engine - vLLM| at this many times the replayed bound gives the replay check power on the
# samples (a replay that fell back to the engine's own routes would fail it); below it, a warning says the samples'
# route flips move no log-prob beyond bf16's own noise, and the shifted-routes check alone proves the replay
REPLAY_MARGIN = 2.0
SHIFT_EFFECT = 1e-3  # shifted routes (and LoRA's adapters) must move some log-prob by more than this (nats)

# verl's actor defaults (strategy fsdp: FSDP1 with use_orig_params false; static micro-batches), on verl-sat's CPU
# preset in float32, with a plain SGD step (lr 1, no clipping: the step is minus the gradient) and SAT's per-token gate
BASE_OVERRIDES = [
    "+recipe=sat_gspo_r3", "r3=fsdp", "trainer.device=cpu", "+cpu=e2e", f"trainer.n_gpus_per_node={WORLD}",
    "actor_rollout_ref.actor.strategy=fsdp",
    "actor_rollout_ref.actor.use_dynamic_bsz=false",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.optim.optimizer=SGD",
    "actor_rollout_ref.actor.optim.lr=1.0",
    "actor_rollout_ref.actor.optim.weight_decay=0.0",
    "actor_rollout_ref.actor.optim.clip_grad=1.0e9",
    "actor_rollout_ref.actor.policy_loss.sat.granularity=token",
]  # fmt: skip
MICRO_BATCH = 2  # ppo_micro_batch_size_per_gpu above: the static cells' sequences per micro-batch
FSDP2 = "actor_rollout_ref.actor.strategy=fsdp2"
LORA = ("actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8")
ULYSSES = ("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
           # verl's Ulysses patch goes through flash-attention's packed interface: verl-sat's CPU stand-in for it
           "actor_rollout_ref.model.override_config.attn_implementation=packed_sdpa")  # fmt: skip
NO_GC = "actor_rollout_ref.model.enable_gradient_checkpointing=false"
# verl's default precision: no mixed_precision block (the CPU preset's float32 one removed), so verl's FSDP engine
# builds MixedPrecision(param_dtype=bf16, reduce_dtype=fp32, buffer_dtype=fp32)
BF16 = "actor_rollout_ref.actor.fsdp_config.mixed_precision=null"
OFFLOAD_NOTE = "composition only on a CPU: every tensor is in host memory, so offload moves nothing"


def dynamic(tokens_per_gpu: int) -> tuple[str, ...]:
    """verl's dynamic batching with a budget of ``tokens_per_gpu`` tokens per micro-batch and GPU."""
    return ("actor_rollout_ref.actor.use_dynamic_bsz=true",
            f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={tokens_per_gpu}")  # fmt: skip


@dataclass(frozen=True)
class Cell:
    """One engine configuration: its overrides on ``BASE_OVERRIDES``, what its engine must show beyond
    ``BASELINE`` (``evidence``), its precision, and what a CPU cannot show of it."""

    overrides: tuple[str, ...] = ()
    expected: dict = field(default_factory=dict)
    dtype: str = "float32"  # the samples it replays (vLLM's) and its reference run in this precision
    cpu_note: str = ""

    @property
    def token_budget(self) -> int | None:
        """Dynamic batching's tokens per micro-batch and GPU, if the cell packs by tokens."""
        budgets = [int(o.split("=")[1]) for o in self.overrides if o.startswith("actor_rollout_ref.actor.ppo_max_tok")]
        return budgets[-1] if budgets else None


# the cells (a cell sharded over ``WORLD`` ranks; under Ulysses both ranks hold one data-parallel shard). The
# dynamic budgets give more micro-batches than the static cells' (each sequence is 15-22 tokens): 32 per rank for 4
# sequences of about 76 tokens, 16 per GPU (32 per Ulysses group) for 8 of about 152
CELLS: dict[str, Cell] = {
    "fsdp1": Cell(),
    "fsdp1_orig_params": Cell(("actor_rollout_ref.actor.fsdp_config.use_orig_params=true",), {"use_orig_params": True}),
    "fsdp2": Cell((FSDP2,), {"fsdp_version": 2}),
    "fsdp2_offload_policy": Cell((FSDP2, "actor_rollout_ref.actor.fsdp_config.offload_policy=true"),
                                 {"fsdp_version": 2, "offload_policy": True}, cpu_note=OFFLOAD_NOTE),
    "param_optimizer_offload": Cell(("actor_rollout_ref.actor.fsdp_config.param_offload=true",
                                     "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"),
                                    {"param_offload": True, "optimizer_offload": True, "offload_calls": True},
                                    cpu_note=OFFLOAD_NOTE),
    # verl checkpoints by default (every other cell: the routers' recompute in the backward replays too)
    "no_gradient_checkpointing": Cell((NO_GC,), {"gradient_checkpointing": False, "routers_recomputed": False}),
    # verl's default target_modules (all-linear): PEFT adapts the routers' and the fused experts' weights too
    "lora_fsdp2": Cell((FSDP2, *LORA), {"fsdp_version": 2, "lora": True}),
    "lora_fsdp1_attention": Cell((*LORA, "actor_rollout_ref.model.target_modules=[q_proj,k_proj,v_proj,o_proj]"),
                                 {"lora": True}),
    "ulysses_sp2": Cell(ULYSSES, {"sequence_parallel": 2}),
    "dynamic_bsz": Cell(dynamic(32), {"dynamic_bsz": True}),
    # combinations users run
    # (LoRA on verl's default all-linear targets needs FSDP2: on FSDP1 PEFT's fused-expert adapters read a freed
    # flat parameter, "The tensor has a non-zero number of elements, but its data is not allocated yet")
    "lora_ulysses_sp2": Cell((FSDP2, *LORA, *ULYSSES), {"fsdp_version": 2, "lora": True, "sequence_parallel": 2}),
    "dynamic_bsz_ulysses_sp2": Cell((*dynamic(16), *ULYSSES), {"dynamic_bsz": True, "sequence_parallel": 2}),
    # hybrid sharding: shard groups of fsdp_size ranks, replicated across groups (with two ranks: groups of one). On
    # FSDP2: FSDP1's HYBRID_SHARD over gloo takes a step that is not the gradient (docs/routing_replay.md)
    "hybrid_shard_fsdp2": Cell((FSDP2, "actor_rollout_ref.actor.fsdp_config.fsdp_size=1"),
                               {"fsdp_version": 2, "mesh": [2, 1], "sharding_strategy": "HYBRID_SHARD"}),
    # verl's default precision
    "fsdp1_bf16": Cell((BF16,), {"compute_dtype": "bfloat16"}, dtype="bfloat16"),
    "fsdp1_bf16_no_gc": Cell((BF16, NO_GC), {"compute_dtype": "bfloat16", "gradient_checkpointing": False,
                                             "routers_recomputed": False}, dtype="bfloat16"),
    "fsdp2_bf16": Cell((FSDP2, BF16), {"fsdp_version": 2, "compute_dtype": "bfloat16"}, dtype="bfloat16"),
    "fsdp2_bf16_no_gc": Cell((FSDP2, BF16, NO_GC), {"fsdp_version": 2, "compute_dtype": "bfloat16",
                                                    "gradient_checkpointing": False, "routers_recomputed": False},
                             dtype="bfloat16"),
}  # fmt: skip
# what verl's default engine shows (``evidence``); a cell's ``expected`` overrides these keys
BASELINE = {"fsdp_version": 1, "use_orig_params": False, "offload_policy": False, "param_offload": False,
            "optimizer_offload": False, "offload_calls": False, "gradient_checkpointing": True,
            "routers_recomputed": True, "lora": False, "sequence_parallel": 1, "dynamic_bsz": False, "mesh": [2],
            "sharding_strategy": "FULL_SHARD", "compute_dtype": "float32"}  # fmt: skip
SUITE_CELLS = ("fsdp1", "lora_fsdp2", "ulysses_sp2")  # the pytest share (make e2e); the CLI runs every cell


@dataclass
class CellResult:
    """One cell's figures."""

    cell: str
    dtype: str
    rollout_log_prob_diff: float  # max |engine (LoRA: adapters off) - vLLM| on vLLM's routes, replayed
    no_replay_log_prob_diff: float  # the same without replay (the engine's own routes)
    vllm_reference_diff: float  # max |reference - vLLM|: vLLM's kernels against PyTorch's, no verl
    reference_rollout_diff: float  # max |engine - reference| on the rollout's routes
    shifted_log_prob_diff: float  # max |engine - reference| with the shifted routes
    ref_pass_log_prob_diff: float | None  # LoRA: the adapters-off pass against the base model, shifted routes
    adapter_effect: float | None  # LoRA: max |adapters-on - adapters-off| log-prob, shifted routes
    shift_effect: float  # max |log-prob with shifted routes - with the rollout's|: the routes matter
    layers_replayed: list[float]  # per replayed micro-batch (compute_log_prob and the update)
    update_micro_batches: list[list[int]]  # [sequences, tokens] of each micro-batch the update formed, first DP rank
    grad_error: float  # max |step - reference gradient| / max |reference gradient|
    grad_max: float
    frozen_moved: float  # max |step| over parameters the reference does not train (LoRA's base weights)
    evidence: dict  # what the engine built and did (``evidence``)
    offload_calls: dict  # verl's offload and reload calls the engine made, by function
    sat_gate_rate: float
    sat_intercepted_frac: float
    r3_route_flip_frac: float  # of the update: the trainer's native choice differs from the shifted route
    seconds: float

    @property
    def bound(self) -> float:
        """What the replayed log-probs must meet against vLLM: the reference's own difference plus the tolerance."""
        return self.vllm_reference_diff + TOLERANCES[self.dtype].log_prob

    def failures(self, num_moe_layers: int) -> list[str]:
        """What does not hold, in words (empty when the cell passes)."""
        cell = CELLS[self.cell]
        tol = TOLERANCES[self.dtype]
        expected = {**BASELINE, **cell.expected}
        checks = {
            f"rollout log-probs within {self.bound:.3g} of vLLM's (the reference's difference "
            f"{self.vllm_reference_diff:.3g} plus {tol.log_prob})": self.rollout_log_prob_diff <= self.bound,
            f"rollout-route log-probs within {tol.log_prob} of the reference": self.reference_rollout_diff
            <= tol.log_prob,
            f"shifted-route log-probs within {tol.log_prob} of the reference": self.shifted_log_prob_diff
            <= tol.log_prob,
            f"reference pass within {tol.log_prob} of the base model": self.ref_pass_log_prob_diff is None
            or self.ref_pass_log_prob_diff <= tol.log_prob,
            f"the adapters change the log-probs by more than {SHIFT_EFFECT}": self.adapter_effect is None
            or self.adapter_effect > SHIFT_EFFECT,
            f"shifted routes change the log-probs by more than {SHIFT_EFFECT}": self.shift_effect > SHIFT_EFFECT,
            f"all {num_moe_layers} MoE layers replayed in every micro-batch": bool(self.layers_replayed)
            and all(n == num_moe_layers for n in self.layers_replayed),
            f"step equals the reference gradient within {tol.grad} (relative)": self.grad_error <= tol.grad
            and self.grad_max > 0,
            "frozen parameters unchanged": self.frozen_moved == 0.0,
            "SAT gated and intercepted": self.sat_gate_rate > 0 and self.sat_intercepted_frac > 0,
            f"the engine built {expected}": self.evidence == expected,
        }
        checks.update(self.packing_failures())
        return [name for name, ok in checks.items() if not ok]

    def warnings(self) -> list[str]:
        """What the cell's samples could not show (empty when they show everything): under bf16, a replay check
        without power, where the engine's own routes land within ``REPLAY_MARGIN`` x the bound of vLLM's log-probs."""
        if self.dtype != "bfloat16" or self.no_replay_log_prob_diff >= REPLAY_MARGIN * self.bound:
            return []
        return [f"without replay {self.no_replay_log_prob_diff:.3g}, below {REPLAY_MARGIN}x the bound "
                f"{self.bound:.3g}: these samples' route flips move no log-prob beyond bf16's own noise, so the "
                "replay check has no power on them; the shifted-routes check proves the replay"]  # fmt: skip

    def packing_failures(self) -> dict[str, bool]:
        """How the update's micro-batches were formed, as verl's engine formed them: static cells hold
        ``MICRO_BATCH`` sequences each; dynamic cells more micro-batches than that, each within the token budget."""
        sequences = [n for n, _ in self.update_micro_batches]
        tokens = [t for _, t in self.update_micro_batches]
        budget = CELLS[self.cell].token_budget
        if budget is None:
            return {f"static micro-batches of {MICRO_BATCH}": bool(sequences) and set(sequences) == {MICRO_BATCH}}
        sp = self.evidence.get("sequence_parallel", 1)
        static = sum(sequences) // MICRO_BATCH
        return {
            f"more micro-batches than the static {static}": len(sequences) > static,
            f"every micro-batch within {budget} x {sp} tokens": bool(tokens) and max(tokens) <= budget * sp,
        }


def shifted(routes: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``routes`` with every recorded expert id moved to the next expert (``(e + 1) % num_experts``); all-zero rows
    ("no recorded route") stay zero. A top-k set of distinct experts stays distinct."""
    recorded = (routes != 0).any(dim=-1, keepdim=True)
    return torch.where(recorded, (routes.long() + 1) % num_experts, 0).to(routes.dtype)


STALE_PEAK = 1.0  # |log-ratio| of one token per sequence in the update batch: the micro-batch's SAT gate
STALE_MEAN = 0.15  # the sequence's mean log-ratio: GSPO's ratio exp(0.15) lies inside the clip band of 0.2


def staleness(log_probs: torch.Tensor, sign: float) -> torch.Tensor:
    """Old log-probs for one sequence whose current ones are ``log_probs`` (float32 ``[R]``, ``R >= 2``): every
    log-ratio has the advantage's ``sign``, the middle token's is ``STALE_PEAK`` and the others share the rest of a
    mean ``STALE_MEAN``. So in any micro-batch the peaks are the top tenth of SAT's per-token scores (gated; the others
    tie at the quantile), the sequence ratio exp(+-0.15) lies between SAT's contracted and verl's endpoint, and SAT
    changes the gradient of every gated token (intercepted)."""
    n = log_probs.numel()
    delta = torch.full_like(log_probs, (STALE_MEAN * n - STALE_PEAK) / (n - 1))
    delta[n // 2] = STALE_PEAK
    return log_probs - sign * delta


def training_batch(samples: list[dict], indices: list[int], num_experts: int | None = None,
                   current: list[torch.Tensor] | None = None):  # fmt: skip
    """Samples ``indices`` of ``samples`` as verl's trainer hands them to the actor: the rollout's routes (``shifted``
    when ``num_experts`` is given), advantages +1 and -1 in turn, ``old_log_probs`` built by ``staleness`` from the
    ``current`` log-probs of all samples (default: the rollout's), a reference log-prob for the KL loss (the rollout's
    minus 0.05), and ``sample_index`` (which micro-batch took which sample)."""
    from verl_sat.cpu.vllm_r3 import trainer_batch

    rollout = [s["log_probs"].float() for s in samples]
    current = rollout if current is None else current
    signs = [1.0 if i % 2 == 0 else -1.0 for i in range(len(samples))]

    def per_token(values: list[torch.Tensor]) -> torch.Tensor:
        return torch.nested.as_nested_tensor([values[i] for i in indices], layout=torch.jagged)

    data = trainer_batch([samples[i] for i in indices])
    if num_experts is not None:
        data["routed_experts"] = torch.nested.as_nested_tensor(
            [shifted(r, num_experts) for r in data["routed_experts"].unbind()], layout=torch.jagged
        )
    data["old_log_probs"] = per_token([staleness(lp, sign) for lp, sign in zip(current, signs, strict=True)])
    data["ref_log_prob"] = per_token([lp - 0.05 for lp in rollout])
    data["advantages"] = per_token([torch.full_like(lp, sign) for lp, sign in zip(rollout, signs, strict=True)])
    data["sample_index"] = torch.tensor(indices)
    return data


def cell_config(cell: str, model: str, adapter: str | None = None):
    """The composed job config of ``cell`` (as ``python -m verl_sat.main`` composes it); LoRA cells load the
    ``adapter`` folder through verl's ``lora_adapter_path``."""
    from verl_sat.main import compose_job, with_recipes_searchpath

    overrides = [*BASE_OVERRIDES, f"actor_rollout_ref.model.path={model}", *CELLS[cell].overrides]
    if adapter is not None:
        overrides.append(f"actor_rollout_ref.model.lora_adapter_path={adapter}")
    return compose_job(with_recipes_searchpath(overrides))[1]


def write_adapter(model: str, config, out: str, seed: int = 0) -> None:
    """A PEFT adapter for ``config``'s LoRA settings with every LoRA weight non-zero (A and B drawn from one seeded
    generator: PEFT's own init leaves B at zero, which makes the adapters-on and -off passes equal), saved to
    ``out`` for verl's ``lora_adapter_path``."""
    from peft import LoraConfig, TaskType, get_peft_model
    from transformers import AutoModelForCausalLM

    model_cfg = config.actor_rollout_ref.model
    target_modules = model_cfg.target_modules
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), LoraConfig(
        task_type=TaskType.CAUSAL_LM, r=model_cfg.lora_rank, lora_alpha=model_cfg.lora_alpha, bias="none",
        target_modules=target_modules if isinstance(target_modules, str) else list(target_modules),
    ))  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    peft.save_pretrained(out)


def full_state(module) -> dict[str, torch.Tensor]:
    """Every parameter of the engine's (FSDP1 or FSDP2) module, unsharded, as copies (torch's
    ``get_model_state_dict``; names as the unwrapped model's)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    return {name: tensor.detach().clone() for name, tensor in state.items()}


OFFLOAD_FUNCTIONS = ("offload_fsdp_model_to_cpu", "load_fsdp_model_to_gpu", "offload_fsdp_optimizer",
                     "load_fsdp_optimizer")  # fmt: skip


def count_offload_calls() -> dict[str, int]:
    """Count what verl's FSDP engine does to move its parameters and optimizer state: its ``FSDPEngine.to`` calls
    that move the model (``to(model)``) or the optimizer (``to(optimizer)``), which its train and eval contexts make
    on entering a pass (reload) and on leaving it (offload) under param and optimizer offload, and the offload and
    reload functions ``to`` calls (wrapped where the engine module looks them up; each still runs). On a CPU the
    device is ``cpu``, so ``to`` takes its reload branch both ways and the offload functions never run. Returns the
    live counts."""
    from verl.workers.engine.fsdp import transformer_impl

    counts = dict.fromkeys(("to(model)", "to(optimizer)", *OFFLOAD_FUNCTIONS), 0)

    def counted(name, function):
        @functools.wraps(function)
        def call(*args, **kwargs):
            counts[name] += 1
            return function(*args, **kwargs)

        return call

    for name in OFFLOAD_FUNCTIONS:
        setattr(transformer_impl, name, counted(name, getattr(transformer_impl, name)))
    engine_to = transformer_impl.FSDPEngine.to

    @functools.wraps(engine_to)
    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        counts["to(model)"] += int(model)
        counts["to(optimizer)"] += int(optimizer and self.optimizer is not None)
        return engine_to(self, device, model=model, optimizer=optimizer, grad=grad)

    transformer_impl.FSDPEngine.to = to
    return counts


def evidence(engine, routers_recomputed: bool, compute_dtypes: set, micro_batches: list, offload_calls: dict) -> dict:
    """What verl's engine built and did (keys as ``BASELINE``): read off the engine and its module, and from what it
    did in the passes (the dtype its language-model head computed in, the micro-batches it formed for the update,
    the offload and reload calls it made)."""
    from transformers import PreTrainedModel
    from verl.utils.fsdp_utils import fsdp_version

    hf = next(m for m in engine.module.modules() if isinstance(m, PreTrainedModel))
    version = fsdp_version(engine.module)
    mesh = list(engine.device_mesh.mesh.shape)
    if version == 1:
        strategy = engine.module.sharding_strategy.name
    else:  # FSDP2 shards over a 1-D mesh and replicates across the first dimension of a 2-D one (HSDP)
        strategy = "HYBRID_SHARD" if len(mesh) == 2 else "FULL_SHARD"
    sequences = [n for n, _ in micro_batches]
    return {
        "fsdp_version": version,
        "use_orig_params": bool(getattr(engine.module, "_use_orig_params", False)),
        "offload_policy": engine._uses_fsdp2_cpu_offload_policy,
        "param_offload": engine._is_offload_param,
        "optimizer_offload": engine._is_offload_optimizer,
        # the engine moved its model and optimizer in and out around the passes, through verl's reload functions
        "offload_calls": all(
            offload_calls[n] > 0
            for n in ("to(model)", "to(optimizer)", "load_fsdp_model_to_gpu", "load_fsdp_optimizer")
        ),
        "gradient_checkpointing": hf.is_gradient_checkpointing,
        "routers_recomputed": routers_recomputed,
        "lora": any("lora_" in name for name, _ in engine.module.named_parameters()),
        "sequence_parallel": engine.ulysses_sequence_parallel_size,
        "dynamic_bsz": bool(sequences) and set(sequences) != {MICRO_BATCH},
        "mesh": mesh,
        "sharding_strategy": strategy,
        "compute_dtype": "/".join(sorted(str(d).removeprefix("torch.") for d in compute_dtypes)),
    }


def _rank_main(rank: int, cell: str, model: str, samples_path: str, out_dir: str, port: int,
               adapter: str | None) -> None:  # fmt: skip
    """One rank of ``cell``: verl's actor worker, the passes; results to ``out_dir/rank{rank}.pt``."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    faulthandler.enable()
    from transformers import AutoConfig, PreTrainedModel
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine_workers import ActorRolloutRefWorker
    from verl.workers.utils.padding import response_from_nested

    from verl_sat.main import use_cpu

    config = cell_config(cell, model, adapter)
    use_cpu()
    offload_calls = count_offload_calls()
    worker = ActorRolloutRefWorker(config=config.actor_rollout_ref, role="actor")
    worker.init_model()
    engine = worker.actor.engine
    sp = config.actor_rollout_ref.actor.ulysses_sequence_parallel_size
    dp_rank, dp = rank // sp, WORLD // sp
    samples = torch.load(samples_path, weights_only=False)
    num_experts = AutoConfig.from_pretrained(model).num_experts
    indices = list(range(dp_rank * len(samples) // dp, (dp_rank + 1) * len(samples) // dp))
    compute_dtypes = set()
    hf = next(m for m in engine.module.modules() if isinstance(m, PreTrainedModel))
    head_hook = hf.get_output_embeddings().register_forward_hook(lambda m, a, out: compute_dtypes.add(out.dtype))
    recorded: dict[str, list] = {}  # the micro-batches verl's engine formed, by pass (the reference replays them)
    forward_step = engine.forward_step

    def recording_forward_step(micro_batch, loss_function, forward_only):
        recorded[current_pass].append(micro_batch.cpu().clone())
        return forward_step(micro_batch, loss_function, forward_only)

    engine.forward_step = recording_forward_step

    def infer(name: str, shift: bool, no_lora_adapter: bool = False, replay: bool = True) -> None:
        nonlocal current_pass
        current_pass, recorded[name] = name, []
        batch = training_batch(samples, indices, num_experts if shift else None)
        tu.assign_non_tensor(batch, calculate_entropy=False, compute_loss=False, temperature=1.0)
        if no_lora_adapter:  # as verl's trainer asks for the reference log-probs when the reference is the actor
            tu.assign_non_tensor(batch, no_lora_adapter=True)
        if not replay:  # verl's per-call flag, as its worker sets it for the reference policy
            tu.assign_non_tensor(batch, enable_routing_replay=False)
        out = worker.compute_log_prob(batch)
        if out is not None:  # only the first rank of a sequence-parallel group returns outputs
            results[name] = list(response_from_nested(out["log_probs"], batch["response_mask"]).unbind())
            results[f"{name}_metrics"] = tu.get(out, "metrics")

    current_pass = ""
    results = {"indices": indices if rank % sp == 0 else [], "dp": dp}
    infer("rollout", shift=False)
    infer("no_replay", shift=False, replay=False)
    infer("shifted", shift=True)
    if config.actor_rollout_ref.model.lora_rank > 0:
        infer("ref_pass", shift=True, no_lora_adapter=True)
        infer("base_rollout", shift=False, no_lora_adapter=True)
        infer("base_no_replay", shift=False, no_lora_adapter=True, replay=False)

    recomputed = []  # router forwards run inside a backward pass (gradient checkpointing's recompute)

    def count_recompute(module, args, output):
        if torch._C._current_graph_task_id() != -1:
            recomputed.append(module)

    hooks = [m.register_forward_hook(count_recompute) for m in engine.module.modules()
             if type(m).__name__.endswith("TopKRouter")]  # fmt: skip
    before = full_state(engine.module)
    current = torch.load(Path(out_dir, "shifted_reference.pt"), weights_only=False)
    batch = training_batch(samples, indices, num_experts, current)
    tu.assign_non_tensor(batch, calculate_entropy=False, global_batch_size=len(samples), mini_batch_size=len(samples),
                         epochs=1, seed=0, dataloader_kwargs={"shuffle": False}, temperature=1.0)  # fmt: skip
    current_pass, recorded["update"] = "update", []
    update = worker.update_actor(batch)
    engine.forward_step = forward_step
    for hook in [*hooks, head_hook]:
        hook.remove()
    after = full_state(engine.module)
    formed = [[int(mb["input_ids"].size(0)), int(mb["input_ids"].offsets()[-1])] for mb in recorded["update"]]
    results["evidence"] = evidence(engine, bool(recomputed), compute_dtypes, formed, offload_calls)
    results["offload_calls"] = dict(offload_calls)
    results["update_metrics"] = tu.get(update, "metrics") if update is not None else {}
    results["micro_batches"] = recorded if rank % sp == 0 else {}  # one copy per data-parallel group
    results["formed"] = formed
    if rank == 0:
        results["before"] = before
        results["step"] = {name: before[name] - after[name] for name in before}  # SGD, lr 1: the gradient
    torch.save(results, Path(out_dir, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def run_ranks(cell: str, model: str, samples_path: str, out_dir: str, adapter: str | None = None,
              timeout: float = 900) -> list[dict]:  # fmt: skip
    """Both ranks of ``cell`` in fresh processes; their results, by rank."""
    ctx = torch.multiprocessing.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank_main, args=(r, cell, model, samples_path, out_dir, port, adapter))
             for r in range(WORLD)]  # fmt: skip
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    codes = [p.exitcode for p in procs]
    if any(code != 0 for code in codes):
        raise RuntimeError(f"engine matrix cell {cell}: a rank failed (exit codes {codes}); its log is above")
    return [torch.load(Path(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]


def reference_model(model: str, config, dtype: str, before: dict[str, torch.Tensor] | None = None,
                    adapter: str | None = None):  # fmt: skip
    """The policy as one unwrapped Hugging Face model, on verl's attention implementation, with verl-sat's
    ``RoutingReplay`` attached: with the ``adapter`` (PEFT, as verl loads it) if given, with the engine's weights
    ``before`` if given (LoRA's adapters built from the same keys first); in ``dtype`` as verl's mixed precision
    computes (bfloat16: the parameters cast, the buffers such as the rotary frequencies kept in float32)."""
    from transformers import AutoModelForCausalLM

    from verl_sat.cpu import packed_attention
    from verl_sat.routing_replay import RoutingReplay

    model_cfg = config.actor_rollout_ref.model
    attn = model_cfg.get("override_config", {}).get("attn_implementation", "sdpa")
    if attn == packed_attention.NAME:
        packed_attention.register()
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation=attn)
    if adapter is not None:
        from peft import PeftModel

        hf = PeftModel.from_pretrained(hf, adapter, is_trainable=True)
    if before is not None:
        hf.load_state_dict(before, strict=True)
    if dtype == "bfloat16":
        for param in hf.parameters():
            param.data = param.data.to(torch.bfloat16)
    hf.train()
    return hf, RoutingReplay.attach(hf)


def packed_log_probs(hf, replay, micro_batch) -> torch.Tensor:
    """The unwrapped model's log-prob of each next token of a packed micro-batch (verl's nested layout), replaying
    its ``routed_experts``; nested ``[bs, j]`` like the engine's ``log_probs`` output."""
    from verl.utils.torch_functional import logprobs_from_logits

    input_ids = micro_batch["input_ids"].values().unsqueeze(0)
    position_ids = micro_batch["position_ids"].values().unsqueeze(0)
    with replay.replay(micro_batch["routed_experts"].values()):
        logits = hf(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits[0]
    log_probs = logprobs_from_logits(logits, torch.roll(input_ids[0], shifts=-1))
    return torch.nested.nested_tensor_from_jagged(log_probs, offsets=micro_batch["input_ids"].offsets())


def response_log_probs(hf, replay, batch) -> list[torch.Tensor]:
    """The unwrapped model's log-prob of each response token of ``batch`` (``training_batch``), replaying its routes."""
    from verl.workers.utils.padding import response_from_nested

    with torch.no_grad():
        return list(response_from_nested(packed_log_probs(hf, replay, batch), batch["response_mask"]).unbind())


def reference_gradient(hf, replay, micro_batches: list, dp: int, config) -> dict[str, torch.Tensor]:
    """The gradient of verl's ``ppo_loss`` over ``micro_batches`` (as verl's engine formed them, with the sizes it
    set), averaged over ``dp`` data-parallel ranks as FSDP reduces it: each micro-batch's gradient in the model's
    dtype, summed in float32 (FSDP's reduce dtype)."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.utils.losses import ppo_loss

    actor_config = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    total: dict[str, torch.Tensor] = {}
    for micro_batch in micro_batches:
        hf.zero_grad(set_to_none=True)
        loss, _ = ppo_loss(actor_config, {"log_probs": packed_log_probs(hf, replay, micro_batch)}, micro_batch)
        (loss / dp).backward()
        for name, p in hf.named_parameters():
            if p.grad is not None:
                total[name] = total.get(name, 0) + p.grad.float()
    return total


def _series(metrics: dict, key: str) -> list[float]:
    return [float(v) for v in torch.tensor(metrics.get(key, []), dtype=torch.float64).flatten()]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def reference_log_probs(hf, replay, micro_batches: list) -> dict[int, torch.Tensor]:
    """The unwrapped model's response log-probs on ``micro_batches`` as verl's engine formed them (the same packing
    and routes), by sample index."""
    from verl.workers.utils.padding import response_from_nested

    out = {}
    with torch.no_grad():
        for micro_batch in micro_batches:
            log_probs = response_from_nested(packed_log_probs(hf, replay, micro_batch), micro_batch["response_mask"])
            out.update(zip(micro_batch["sample_index"].tolist(), log_probs.unbind(), strict=True))
    return out


def run_cell(cell: str, model: str, samples_path: str) -> CellResult:
    """Run ``cell`` on two ranks (on ``samples_path``: vLLM's samples in the cell's precision) and compare it with
    vLLM and with the one-rank unwrapped reference in the cell's precision, on the micro-batches the engine formed."""
    start = time.perf_counter()
    dtype = CELLS[cell].dtype
    samples = torch.load(samples_path, weights_only=False)
    every = list(range(len(samples)))
    with tempfile.TemporaryDirectory() as out_dir:
        config = cell_config(cell, model)
        adapter = None
        if config.actor_rollout_ref.model.lora_rank > 0:
            adapter = str(Path(out_dir, "adapter"))
            write_adapter(model, config, adapter)
            config = cell_config(cell, model, adapter)
        base, base_replay = reference_model(model, config, dtype)
        policy, policy_replay = (base, base_replay) if adapter is None else \
            reference_model(model, config, dtype, adapter=adapter)  # fmt: skip
        num_experts = base.config.num_experts
        # the update's old log-probs build on the policy's current ones
        current = response_log_probs(policy, policy_replay, training_batch(samples, every, num_experts))
        torch.save(current, Path(out_dir, "shifted_reference.pt"))
        ranks = run_ranks(cell, model, samples_path, out_dir, adapter)

        def reference(name: str, lora_off: bool = False) -> dict[int, torch.Tensor]:
            micro_batches = [mb for result in ranks for mb in result["micro_batches"].get(name, [])]
            return reference_log_probs(*((base, base_replay) if lora_off else (policy, policy_replay)), micro_batches)

        at_rollout, at_shifted = reference("rollout"), reference("shifted")
        if adapter is not None:
            at_base_rollout, at_ref_pass = reference("base_rollout", lora_off=True), reference("ref_pass", True)
        # the gradient's reference: the engine's weights before the step (its LoRA adapters included)
        hf, replay = reference_model(model, config, dtype, before=ranks[0]["before"], adapter=adapter)

    # vLLM sampled the base model: with LoRA the engine's adapters-off passes are the ones to hold against it
    vllm_pass, no_replay_pass = ("rollout", "no_replay") if adapter is None else ("base_rollout", "base_no_replay")
    vllm_reference = at_rollout if adapter is None else at_base_rollout
    figures: dict[str, list[float]] = {key: [] for key in ("rollout", "no_replay", "floor", "reference", "shifted",
                                                             "ref_pass", "adapter", "effect")}  # fmt: skip
    layers = []
    for result in ranks:
        for i, index in enumerate(result["indices"]):
            vllm = samples[index]["log_probs"]
            figures["rollout"].append(max_diff(result[vllm_pass][i], vllm))
            figures["no_replay"].append(max_diff(result[no_replay_pass][i], vllm))
            figures["floor"].append(max_diff(vllm_reference[index], vllm))
            figures["reference"].append(max_diff(result["rollout"][i], at_rollout[index]))
            figures["shifted"].append(max_diff(result["shifted"][i], at_shifted[index]))
            figures["effect"].append(max_diff(result["shifted"][i], result["rollout"][i]))
            if adapter is not None:
                off = max(max_diff(result["ref_pass"][i], at_ref_pass[index]),
                          max_diff(result["base_rollout"][i], at_base_rollout[index]))  # fmt: skip
                figures["ref_pass"].append(off)
                figures["adapter"].append(max_diff(result["shifted"][i], result["ref_pass"][i]))
        for key in ("rollout_metrics", "shifted_metrics", "ref_pass_metrics", "base_rollout_metrics",
                    "update_metrics"):  # fmt: skip
            layers += _series(result.get(key, {}), LAYERS_KEY)
    micro_batches = [mb for result in ranks for mb in result["micro_batches"].get("update", [])]
    grads = reference_gradient(hf, replay, micro_batches, ranks[0]["dp"], config)
    frozen = [name for name, p in hf.named_parameters() if not p.requires_grad]
    step = ranks[0]["step"]
    grad_max = max(float(g.abs().max()) for g in grads.values())
    update = ranks[0]["update_metrics"]
    return CellResult(
        cell=cell,
        dtype=dtype,
        rollout_log_prob_diff=max(figures["rollout"]),
        no_replay_log_prob_diff=max(figures["no_replay"]),
        vllm_reference_diff=max(figures["floor"]),
        reference_rollout_diff=max(figures["reference"]),
        shifted_log_prob_diff=max(figures["shifted"]),
        ref_pass_log_prob_diff=max(figures["ref_pass"]) if adapter else None,
        adapter_effect=max(figures["adapter"]) if adapter else None,
        shift_effect=max(figures["effect"]),
        layers_replayed=layers,
        update_micro_batches=ranks[0]["formed"],
        grad_error=max(float((step[name] - g).abs().max()) for name, g in grads.items()) / grad_max,
        grad_max=grad_max,
        frozen_moved=max([float(step[name].abs().max()) for name in frozen], default=0.0),
        evidence=ranks[0]["evidence"],
        offload_calls=ranks[0]["offload_calls"],
        sat_gate_rate=max(_series(update, "actor/sat_gate_rate")),
        sat_intercepted_frac=max(_series(update, "actor/sat_intercepted_frac")),
        r3_route_flip_frac=max(_series(update, "actor/r3_route_flip_frac")),
        seconds=time.perf_counter() - start,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m verl_sat.cpu.engine_matrix", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face MoE model folder (verl-sat prepare's model)")
    parser.add_argument("--samples", required=True, help="python -m verl_sat.cpu.vllm_r3 sample's output, float32")
    parser.add_argument("--bf16-samples", help="the same in bfloat16 (needed by the bfloat16 cells)")
    parser.add_argument("--cells", default=",".join(CELLS), help=f"comma-separated, of: {', '.join(CELLS)}")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    cells = args.cells.split(",")
    unknown = [cell for cell in cells if cell not in CELLS]
    if unknown:
        parser.error(f"--cells: unknown {unknown}; choose from {', '.join(CELLS)}")
    if args.bf16_samples is None and any(CELLS[cell].dtype == "bfloat16" for cell in cells):
        parser.error("--bf16-samples: the bfloat16 cells replay vLLM's bfloat16 samples (vllm_r3 sample --dtype "
                     "bfloat16)")  # fmt: skip
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(args.model)
    moe_layers = sum(1 for i in range(hf_config.num_hidden_layers) if i not in (hf_config.mlp_only_layers or []))
    results, failed, warned = [], [], []
    print("| cell | dtype | max abs dlog-prob vs vLLM: replayed (bound) / not replayed | vs reference: vLLM's routes "
          "/ shifted | LoRA: adapters-off pass vs base (adapter effect) | grad error (rel) | update micro-batches "
          "(sequences) | SAT gate / intercepted | R3 layers | on a CPU | s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for cell in cells:
        result = run_cell(cell, args.model, args.bf16_samples if CELLS[cell].dtype == "bfloat16" else args.samples)
        results.append(result)
        lora = "-" if result.ref_pass_log_prob_diff is None else \
            f"{result.ref_pass_log_prob_diff:.2g} ({result.adapter_effect:.2g})"  # fmt: skip
        print(f"| {cell} | {result.dtype} | {result.rollout_log_prob_diff:.2g} ({result.bound:.2g}) / "
              f"{result.no_replay_log_prob_diff:.2g} | {result.reference_rollout_diff:.2g} / "
              f"{result.shifted_log_prob_diff:.2g} | {lora} | {result.grad_error:.2g} | "
              f"{len(result.update_micro_batches)} ({','.join(str(n) for n, _ in result.update_micro_batches)}) | "
              f"{result.sat_gate_rate:.3f} / {result.sat_intercepted_frac:.3f} | "
              f"{min(result.layers_replayed):.0f}-{max(result.layers_replayed):.0f} | "
              f"{CELLS[cell].cpu_note or 'runs as on a GPU'} | {result.seconds:.0f} |", flush=True)  # fmt: skip
        failed += [f"{cell}: {what}" for what in result.failures(moe_layers)]
        warned += [f"{cell}: {what}" for what in result.warnings()]
    if warned:
        print("engine matrix warnings:\n  " + "\n  ".join(warned))
    if args.out:
        import json

        Path(args.out).write_text(json.dumps([asdict(r) for r in results], indent=1))
    if failed:
        raise SystemExit("engine matrix failed:\n  " + "\n  ".join(failed))


if __name__ == "__main__":
    main()
