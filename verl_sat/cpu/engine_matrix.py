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
"""R3 and SAT under every engine configuration verl builds, through verl's own FSDP engine on this CPU.

A cell is one engine configuration: FSDP1 (verl's default) with ``use_orig_params`` false or true, FSDP2 with or
without ``offload_policy``, param and optimizer offload, LoRA, Ulysses sequence parallelism 2, dynamic batch size;
gradient checkpointing is verl's default, so one cell turns it off. For each cell two ranks over gloo build verl's
``ActorRolloutRefWorker`` from the composed config (``+recipe=sat_gspo_r3 r3=fsdp``; verl's ``EngineRegistry`` picks
the engine class), check that the engine built what the cell asks for (``evidence``), and run, on samples that a
rollout engine drew together with its routes (vLLM's CPU build, ``python -m verl_sat.cpu.vllm_r3 sample``):

1. ``compute_log_prob`` replaying the rollout's routes: it must reproduce the rollout's log-probs (float32, at most
   ``LOG_PROB_TOL``), with every MoE layer replayed in every micro-batch;
2. ``compute_log_prob`` replaying *other* routes (each expert id shifted by one): it must equal a one-rank, unwrapped
   Hugging Face model replaying the same routes, so the engine demonstrably used the routes it was given (the
   rollout's routes are mostly the model's native ones). Under LoRA, the reference pass that verl computes in the
   actor with the adapters off is checked the same way: it replays too;
3. one ``update_actor`` step with SAT-GSPO (per-token gate, which acts at these micro-batch sizes) and plain SGD
   (lr 1, no clipping), on the shifted routes: the parameter change is minus the gradient, and it must equal the
   gradient of the unwrapped model computed with verl's ``ppo_loss`` on the very micro-batches verl's engine formed
   (at most ``GRAD_TOL`` of the largest entry); parameters LoRA freezes must not move. Under gradient checkpointing
   the routers run again in the backward, replaying the same routes: the gradient would differ otherwise.

::

    python -m verl_sat.cpu.engine_matrix --model M --samples samples.pt [--cells fsdp1,lora]
"""

import argparse
import faulthandler
import os
import socket
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

LOG_PROB_TOL = 1e-5
GRAD_TOL = 1e-5
WORLD = 2
LAYERS_KEY = "actor/r3_layers_replayed"

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
LORA = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8"]
# the cells, each a list of overrides on BASE_OVERRIDES
CELLS: dict[str, list[str]] = {
    "fsdp1": [],
    "fsdp1_orig_params": ["actor_rollout_ref.actor.fsdp_config.use_orig_params=true"],
    "fsdp2": ["actor_rollout_ref.actor.strategy=fsdp2"],
    "fsdp2_offload_policy": ["actor_rollout_ref.actor.strategy=fsdp2",
                             "actor_rollout_ref.actor.fsdp_config.offload_policy=true"],
    "param_optimizer_offload": ["actor_rollout_ref.actor.fsdp_config.param_offload=true",
                                "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"],
    # verl checkpoints by default (every other cell: the routers' recompute in the backward replays too)
    "no_gradient_checkpointing": ["actor_rollout_ref.model.enable_gradient_checkpointing=false"],
    # verl's default target_modules (all-linear): PEFT adapts the routers' and the fused experts' weights too
    "lora_fsdp2": ["actor_rollout_ref.actor.strategy=fsdp2", *LORA],
    "lora_fsdp1_attention": [*LORA, "actor_rollout_ref.model.target_modules=[q_proj,k_proj,v_proj,o_proj]"],
    # verl's Ulysses patch goes through flash-attention's packed interface: verl-sat's CPU stand-in for the kernel
    "ulysses_sp2": ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                    "actor_rollout_ref.model.override_config.attn_implementation=packed_sdpa"],
    "dynamic_bsz": ["actor_rollout_ref.actor.use_dynamic_bsz=true",
                    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=64"],
}  # fmt: skip
# what each cell's engine must show it built (``evidence``): verl's defaults (BASELINE) and the cell's switches
EXPECTED: dict[str, dict] = {
    "fsdp1_orig_params": {"use_orig_params": True},
    "fsdp2": {"fsdp_version": 2},
    "fsdp2_offload_policy": {"fsdp_version": 2, "offload_policy": True},
    "param_optimizer_offload": {"param_offload": True, "optimizer_offload": True},
    "no_gradient_checkpointing": {"gradient_checkpointing": False, "routers_recomputed": False},
    "lora_fsdp2": {"fsdp_version": 2, "lora": True},
    "lora_fsdp1_attention": {"lora": True},
    "ulysses_sp2": {"sequence_parallel": 2},
    "dynamic_bsz": {"dynamic_bsz": True},
}
BASELINE = {"fsdp_version": 1, "use_orig_params": False, "offload_policy": False, "param_offload": False,
            "optimizer_offload": False, "gradient_checkpointing": True, "routers_recomputed": True, "lora": False,
            "sequence_parallel": 1, "dynamic_bsz": False}  # fmt: skip
SUITE_CELLS = ("fsdp1", "lora_fsdp2", "ulysses_sp2")  # the suite's share; `make e2e` runs every cell


@dataclass
class CellResult:
    """One cell's figures."""

    cell: str
    rollout_log_prob_diff: float  # max |replayed log-prob - rollout log-prob| over the response tokens
    reference_rollout_diff: float  # max |replayed log-prob - unwrapped reference's| on the rollout's routes
    vllm_reference_diff: float  # max |unwrapped reference's - rollout's|: vLLM's kernels against PyTorch's, no verl
    shifted_log_prob_diff: float  # max |engine - unwrapped reference| with the shifted routes
    ref_pass_log_prob_diff: float | None  # LoRA: the same for the adapters-off reference pass
    shift_effect: float  # max |log-prob with shifted routes - with the rollout's|: the routes matter
    layers_replayed: list[float]  # per replayed micro-batch (compute_log_prob and the update)
    grad_error: float  # max |step - reference gradient| / max |reference gradient|
    grad_max: float
    frozen_moved: float  # max |step| over parameters the reference does not train (LoRA's base weights)
    evidence: dict  # what the engine built (``evidence``)
    sat_gate_rate: float
    sat_intercepted_frac: float
    r3_route_flip_frac: float  # of the update: the trainer's native choice differs from the shifted route
    seconds: float

    def failures(self, num_moe_layers: int) -> list[str]:
        """What does not hold, in words (empty when the cell passes)."""
        expected = {**BASELINE, **EXPECTED.get(self.cell, {})}
        checks = {
            f"rollout log-probs within {LOG_PROB_TOL} of vLLM's (or of vLLM's own difference from the unwrapped "
            f"reference, {self.vllm_reference_diff:.2g}, plus {LOG_PROB_TOL})": self.rollout_log_prob_diff
            <= max(LOG_PROB_TOL, self.vllm_reference_diff + LOG_PROB_TOL),
            f"rollout-route log-probs within {LOG_PROB_TOL} of the reference": self.reference_rollout_diff
            <= LOG_PROB_TOL,
            f"shifted-route log-probs within {LOG_PROB_TOL} of the reference": self.shifted_log_prob_diff
            <= LOG_PROB_TOL,
            f"reference pass within {LOG_PROB_TOL}": self.ref_pass_log_prob_diff is None
            or self.ref_pass_log_prob_diff <= LOG_PROB_TOL,
            "shifted routes change the log-probs": self.shift_effect > 100 * LOG_PROB_TOL,
            f"all {num_moe_layers} MoE layers replayed in every micro-batch": bool(self.layers_replayed)
            and all(n == num_moe_layers for n in self.layers_replayed),
            f"step equals the reference gradient within {GRAD_TOL}": self.grad_error <= GRAD_TOL and self.grad_max > 0,
            "frozen parameters unchanged": self.frozen_moved == 0.0,
            "SAT gated and intercepted": self.sat_gate_rate > 0 and self.sat_intercepted_frac > 0,
            f"the engine built {expected}": self.evidence == expected,
        }
        return [name for name, ok in checks.items() if not ok]


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


def cell_config(cell: str, model: str):
    """The composed job config of ``cell`` (as ``python -m verl_sat.main`` composes it)."""
    from verl_sat.main import compose_job, with_recipes_searchpath

    return compose_job(with_recipes_searchpath([*BASE_OVERRIDES, f"actor_rollout_ref.model.path={model}",
                                                *CELLS[cell]]))[1]  # fmt: skip


def full_state(module) -> dict[str, torch.Tensor]:
    """Every parameter of the engine's (FSDP1 or FSDP2) module, unsharded, as copies (torch's
    ``get_model_state_dict``; names as the unwrapped model's)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    return {name: tensor.detach().clone() for name, tensor in state.items()}


def evidence(engine, config, routers_recomputed: bool) -> dict:
    """What verl's engine built, read off the engine and its module (keys as ``BASELINE``)."""
    from transformers import PreTrainedModel
    from verl.utils.fsdp_utils import fsdp_version

    hf = next(m for m in engine.module.modules() if isinstance(m, PreTrainedModel))
    return {
        "fsdp_version": fsdp_version(engine.module),
        "use_orig_params": bool(getattr(engine.module, "_use_orig_params", False)),
        "offload_policy": engine._uses_fsdp2_cpu_offload_policy,
        "param_offload": engine._is_offload_param,
        "optimizer_offload": engine._is_offload_optimizer,
        "gradient_checkpointing": hf.is_gradient_checkpointing,
        "routers_recomputed": routers_recomputed,
        "lora": any("lora_" in name for name, _ in engine.module.named_parameters()),
        "sequence_parallel": engine.ulysses_sequence_parallel_size,
        "dynamic_bsz": bool(config.actor_rollout_ref.actor.use_dynamic_bsz),
    }


def _rank_main(rank: int, cell: str, model: str, samples_path: str, out_dir: str, port: int) -> None:
    """One rank of ``cell``: verl's actor worker, the three passes; results to ``out_dir/rank{rank}.pt``."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    faulthandler.enable()
    from transformers import AutoConfig
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine_workers import ActorRolloutRefWorker
    from verl.workers.utils.padding import response_from_nested

    from verl_sat.main import use_cpu

    config = cell_config(cell, model)
    use_cpu()
    worker = ActorRolloutRefWorker(config=config.actor_rollout_ref, role="actor")
    worker.init_model()
    engine = worker.actor.engine
    sp = config.actor_rollout_ref.actor.ulysses_sequence_parallel_size
    dp_rank, dp = rank // sp, WORLD // sp
    samples = torch.load(samples_path, weights_only=False)
    num_experts = AutoConfig.from_pretrained(model).num_experts
    indices = list(range(dp_rank * len(samples) // dp, (dp_rank + 1) * len(samples) // dp))

    def infer(shift: bool, no_lora_adapter: bool = False) -> tuple[list[torch.Tensor], dict]:
        batch = training_batch(samples, indices, num_experts if shift else None)
        tu.assign_non_tensor(batch, calculate_entropy=False, compute_loss=False, temperature=1.0)
        if no_lora_adapter:  # as verl's trainer asks for the reference log-probs when the reference is the actor
            tu.assign_non_tensor(batch, no_lora_adapter=True)
        out = worker.compute_log_prob(batch)
        if out is None:  # only the first rank of a sequence-parallel group returns outputs
            return [], {}
        return list(response_from_nested(out["log_probs"], batch["response_mask"]).unbind()), tu.get(out, "metrics")

    results = {"indices": indices if rank % sp == 0 else [], "dp": dp}
    results["rollout"], results["rollout_metrics"] = infer(shift=False)
    results["shifted"], results["shifted_metrics"] = infer(shift=True)
    if config.actor_rollout_ref.model.lora_rank > 0:
        results["ref_pass"], results["ref_pass_metrics"] = infer(shift=True, no_lora_adapter=True)

    micro_batches = []
    forward_step = engine.forward_step

    def recording_forward_step(micro_batch, loss_function, forward_only):
        micro_batches.append(micro_batch.cpu().clone())
        return forward_step(micro_batch, loss_function, forward_only)

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
    engine.forward_step = recording_forward_step
    update = worker.update_actor(batch)
    engine.forward_step = forward_step
    for hook in hooks:
        hook.remove()
    after = full_state(engine.module)
    results["evidence"] = evidence(engine, config, bool(recomputed))
    results["update_metrics"] = tu.get(update, "metrics") if update is not None else {}
    results["micro_batches"] = micro_batches if rank % sp == 0 else []  # one copy per data-parallel group
    if rank == 0:
        results["before"] = before
        results["step"] = {name: before[name] - after[name] for name in before}  # SGD, lr 1: the gradient
    torch.save(results, Path(out_dir, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def run_ranks(cell: str, model: str, samples_path: str, out_dir: str, timeout: float = 900) -> list[dict]:
    """Both ranks of ``cell`` in fresh processes; their results, by rank."""
    ctx = torch.multiprocessing.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank_main, args=(r, cell, model, samples_path, out_dir, port)) for r in range(WORLD)]
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


def reference_model(model: str, config, before: dict[str, torch.Tensor] | None = None):
    """The policy as one unwrapped Hugging Face model in float32, on verl's attention implementation, with
    verl-sat's ``RoutingReplay`` attached; given the engine's weights ``before``, with the engine's LoRA adapters
    (built from the same keys, then loaded with those weights, so the adapters' random init matches). Without, the
    model as saved, which is the engine's initial policy (LoRA's adapters start at zero)."""
    from transformers import AutoModelForCausalLM

    from verl_sat.cpu import packed_attention
    from verl_sat.routing_replay import RoutingReplay

    model_cfg = config.actor_rollout_ref.model
    attn = model_cfg.get("override_config", {}).get("attn_implementation", "sdpa")
    if attn == packed_attention.NAME:
        packed_attention.register()
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation=attn)
    if before is not None and model_cfg.lora_rank > 0:
        from peft import LoraConfig, TaskType, get_peft_model

        target_modules = model_cfg.target_modules
        hf = get_peft_model(hf, LoraConfig(
            task_type=TaskType.CAUSAL_LM, r=model_cfg.lora_rank, lora_alpha=model_cfg.lora_alpha, bias="none",
            target_modules=target_modules if isinstance(target_modules, str) else list(target_modules),
        ))  # fmt: skip
    if before is not None:
        hf.load_state_dict(before, strict=True)
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
    """The gradient of verl's ``ppo_loss`` summed over ``micro_batches`` (as verl's engine formed them, with the
    sizes it set), averaged over ``dp`` data-parallel ranks as FSDP reduces it."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.utils.losses import ppo_loss

    actor_config = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    hf.zero_grad(set_to_none=True)
    for micro_batch in micro_batches:
        loss, _ = ppo_loss(actor_config, {"log_probs": packed_log_probs(hf, replay, micro_batch)}, micro_batch)
        (loss / dp).backward()
    return {name: p.grad for name, p in hf.named_parameters() if p.grad is not None}


def _series(metrics: dict, key: str) -> list[float]:
    return [float(v) for v in torch.tensor(metrics.get(key, []), dtype=torch.float64).flatten()]


def run_cell(cell: str, model: str, samples_path: str) -> CellResult:
    """Run ``cell`` on two ranks and compare it with the rollout and with the one-rank unwrapped reference."""
    start = time.perf_counter()
    config = cell_config(cell, model)
    samples = torch.load(samples_path, weights_only=False)
    every = list(range(len(samples)))
    hf, replay = reference_model(model, config)  # the engine's initial policy
    num_experts = hf.config.num_experts
    at_rollout = response_log_probs(hf, replay, training_batch(samples, every))
    at_shifted = response_log_probs(hf, replay, training_batch(samples, every, num_experts))
    with tempfile.TemporaryDirectory() as out_dir:
        torch.save(at_shifted, Path(out_dir, "shifted_reference.pt"))  # the update's old log-probs build on them
        ranks = run_ranks(cell, model, samples_path, out_dir)

    def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.double() - b.double()).abs().max())

    rollout_diff, reference_diff, floor, shifted_diff, ref_diff, effect, layers = [], [], [], [], [], [], []
    for result in ranks:
        for i, index in enumerate(result["indices"]):
            vllm = samples[index]["log_probs"]
            rollout_diff.append(max_diff(result["rollout"][i], vllm))
            reference_diff.append(max_diff(result["rollout"][i], at_rollout[index]))
            floor.append(max_diff(at_rollout[index], vllm))
            shifted_diff.append(max_diff(result["shifted"][i], at_shifted[index]))
            effect.append(max_diff(result["shifted"][i], vllm))
            if "ref_pass" in result:
                ref_diff.append(max_diff(result["ref_pass"][i], at_shifted[index]))
        for key in ("rollout_metrics", "shifted_metrics", "ref_pass_metrics", "update_metrics"):
            layers += _series(result.get(key, {}), LAYERS_KEY)
    hf, replay = reference_model(model, config, ranks[0]["before"])  # with the engine's LoRA adapters
    micro_batches = [mb for result in ranks for mb in result["micro_batches"]]
    grads = reference_gradient(hf, replay, micro_batches, ranks[0]["dp"], config)
    frozen = [name for name, p in hf.named_parameters() if not p.requires_grad]
    step = ranks[0]["step"]
    grad_max = max(float(g.abs().max()) for g in grads.values())
    update = ranks[0]["update_metrics"]
    return CellResult(
        cell=cell,
        rollout_log_prob_diff=max(rollout_diff),
        reference_rollout_diff=max(reference_diff),
        vllm_reference_diff=max(floor),
        shifted_log_prob_diff=max(shifted_diff),
        ref_pass_log_prob_diff=max(ref_diff) if ref_diff else None,
        shift_effect=max(effect),
        layers_replayed=layers,
        grad_error=max(float((step[name] - g).abs().max()) for name, g in grads.items()) / grad_max,
        grad_max=grad_max,
        frozen_moved=max([float(step[name].abs().max()) for name in frozen], default=0.0),
        evidence=ranks[0]["evidence"],
        sat_gate_rate=max(_series(update, "actor/sat_gate_rate")),
        sat_intercepted_frac=max(_series(update, "actor/sat_intercepted_frac")),
        r3_route_flip_frac=max(_series(update, "actor/r3_route_flip_frac")),
        seconds=time.perf_counter() - start,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m verl_sat.cpu.engine_matrix", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face MoE model folder (verl-sat prepare's model)")
    parser.add_argument("--samples", required=True, help="python -m verl_sat.cpu.vllm_r3 sample's output (float32)")
    parser.add_argument("--cells", default=",".join(CELLS), help=f"comma-separated, of: {', '.join(CELLS)}")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(args.model)
    moe_layers = sum(1 for i in range(hf_config.num_hidden_layers) if i not in (hf_config.mlp_only_layers or []))
    results, failed = [], []
    print("| cell | max abs dlog-prob vs vLLM (vLLM vs reference) | vs reference, vLLM's routes | shifted routes | "
          "reference pass | grad error (rel) | SAT gate / intercepted | R3 layers | s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for cell in args.cells.split(","):
        result = run_cell(cell, args.model, args.samples)
        results.append(result)
        ref = "-" if result.ref_pass_log_prob_diff is None else f"{result.ref_pass_log_prob_diff:.2g}"
        print(f"| {cell} | {result.rollout_log_prob_diff:.2g} ({result.vllm_reference_diff:.2g}) | "
              f"{result.reference_rollout_diff:.2g} | {result.shifted_log_prob_diff:.2g} | {ref} | "
              f"{result.grad_error:.2g} | {result.sat_gate_rate:.3f} / {result.sat_intercepted_frac:.3f} | "
              f"{min(result.layers_replayed):.0f}-{max(result.layers_replayed):.0f} | {result.seconds:.0f} |",
              flush=True)  # fmt: skip
        failed += [f"{cell}: {what}" for what in result.failures(moe_layers)]
    if args.out:
        import json

        Path(args.out).write_text(json.dumps([asdict(r) for r in results], indent=1))
    if failed:
        raise SystemExit("engine matrix failed:\n  " + "\n  ".join(failed))


if __name__ == "__main__":
    main()
