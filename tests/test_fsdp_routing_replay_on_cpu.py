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
"""Routing replay under verl's FSDP engine: registration, the verl code it relies on (pinned), and the micro-batch
preparation (packing, pad rows, Ulysses slicing) with the tensors verl's engine hands it."""

import inspect
import os
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf
from tensordict import TensorDict
from test_routing_replay_on_cpu import TOP_K, ExpertsSpy, tiny_moe
from verl.utils import tensordict_utils as tu
from verl.utils.ulysses import set_ulysses_sequence_parallel_group, ulysses_pad_and_slice_inputs
from verl.workers.config import EngineRouterReplayConfig
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.utils.padding import left_right_2_no_padding

from verl_sat.fsdp_engine import RoutingReplayFSDPEngine, micro_batch_routes
from verl_sat.routing_replay import RoutingReplay


def _stdout_of_fresh_interpreter(*lines: str) -> list[str]:
    """Run ``lines`` in a fresh interpreter that selects engines as on a CUDA machine; return its stdout lines."""
    code = "\n".join(["import sys, warnings; warnings.simplefilter('ignore')", *lines])
    env = {**os.environ, "VERL_ENGINE_DEVICE": "cuda"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_import_verl_leaves_verls_engine_until_a_job_asks_for_r3():
    """``import verl`` (which loads the plugin) and importing verl's FSDP engine leave verl's classes in the registry;
    building the R3 router-replay config installs verl-sat's engine for language models only."""
    assert _stdout_of_fresh_interpreter(
        "import verl",
        "print('engine imported by import verl:', 'verl.workers.engine.fsdp.transformer_impl' in sys.modules)",
        "from verl.workers.engine import EngineRegistry",
        "import verl_sat.fsdp_engine  # importing the module registers nothing",
        "for backend in ('fsdp', 'fsdp2'):",
        "    print(backend, EngineRegistry.get_engine_cls('language_model', backend).__qualname__)",
        "from verl_sat.config import FSDPRouterReplayConfig",
        "FSDPRouterReplayConfig(mode='R3')",
        "for backend in ('fsdp', 'fsdp2'):",
        "    print(backend, EngineRegistry.get_engine_cls('language_model', backend).__qualname__)",
        "print('value', EngineRegistry.get_engine_cls('value_model', 'fsdp').__qualname__)",
    ) == [
        "engine imported by import verl: False",
        "fsdp FSDPEngineWithLMHead",
        "fsdp2 FSDPEngineWithLMHead",
        "fsdp RoutingReplayFSDPEngine",
        "fsdp2 RoutingReplayFSDPEngine",
        "value FSDPEngineWithValueHead",
    ]


def test_pinned_verl_fsdp_engine_code():
    """The integration relies on these facts of verl 0.9.1's FSDP engine; a change in verl must fail here first."""
    assert issubclass(RoutingReplayFSDPEngine, FSDPEngineWithLMHead)
    forward_step = inspect.getsource(FSDPEngineWithLMHead.forward_step)
    order = [
        forward_step.index(s) for s in ("self.prepare_model_inputs(", "self.module(", "self.prepare_model_outputs(")
    ]
    assert order == sorted(order), "forward_step must prepare inputs, run the module, then prepare outputs"
    assert '"metrics": metrics' in forward_step
    prepare = inspect.getsource(FSDPEngineWithLMHead.prepare_model_inputs)
    assert 'output_args["pad_size"] = static_pad_size + sp_pad_size' in prepare  # both pads sit at the tail
    assert "ulysses_pad_and_slice_inputs(" in prepare and "pad_packed_inputs(" in prepare
    assert "self.use_ulysses_sp = " in inspect.getsource(sys.modules[FSDPEngineWithLMHead.__module__])
    assert EngineRouterReplayConfig().mode == "disabled"
    padding = inspect.getsource(left_right_2_no_padding)
    assert 'routed_experts = data.get("routed_experts", None)' in padding


def _engine_micro_batch(model, lengths):
    """A padded batch with the routes a rollout engine would return, converted as verl's trainer converts it."""
    bs, seq = len(lengths), max(lengths) + 2
    attention_mask = (torch.arange(seq).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()
    input_ids = torch.randint(1, 64, (bs, seq), generator=torch.Generator().manual_seed(0)) * attention_mask
    rollout_rr = RoutingReplay.attach(model)
    routes = torch.zeros(bs, seq, model.config.num_hidden_layers, TOP_K, dtype=torch.int16)
    with torch.no_grad(), rollout_rr.record() as rec:
        for i, n in enumerate(lengths):  # the rollout engine generated each sequence on its own
            model(input_ids=input_ids[i : i + 1, :n])
            routes[i, :n] = rec.routed_experts[0]
    rollout_rr.detach()
    data = TensorDict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "response_mask": attention_mask[:, 1:],
            "routed_experts": routes,
        },
        batch_size=[bs],
    )
    return left_right_2_no_padding(data)


def _r3_engine(model) -> RoutingReplayFSDPEngine:
    engine = RoutingReplayFSDPEngine.__new__(RoutingReplayFSDPEngine)  # only what the R3 code path reads
    engine.engine_config = OmegaConf.create({"router_replay": {"mode": "R3"}})
    engine.module, engine.use_ulysses_sp = model, False
    return engine


def _armed_forward(engine, model, micro_batch, pad: int, packed_ids, position_ids) -> ExpertsSpy:
    """The engine arms ``micro_batch``'s routes, the model runs the packed forward; the experts each layer used."""
    spy = ExpertsSpy(model)
    engine._prepare_router_replay_inputs(micro_batch, {"pad_size": pad})
    with torch.no_grad():
        model(input_ids=packed_ids, position_ids=position_ids)
    engine._end_router_replay()
    spy.close()
    return spy


def test_micro_batch_routes_pad_rows_and_layout():
    model = tiny_moe("qwen3_moe").eval()
    micro_batch = _engine_micro_batch(model, [5, 7, 3])
    nested = micro_batch["routed_experts"]
    assert nested.is_nested
    targets = micro_batch_routes(nested, pad_size=4, sequence_parallel=False)
    assert targets.dtype == torch.int64 and targets.shape == (15 + 4, model.config.num_hidden_layers, TOP_K)
    assert torch.equal(targets[:15], nested.values().long())
    assert torch.all(targets[15:] == 0)  # pad rows route natively


def test_engine_replays_the_rollout_routes_on_the_packed_micro_batch():
    """The engine's own arming code on a real model with the packed micro-batch verl prepares (plus the engine's pad
    tokens): every MoE layer uses exactly the rollout's experts on real tokens and routes the pad rows natively."""
    model = tiny_moe("qwen3_moe").eval()
    lengths, pad = [5, 7, 3], 2
    micro_batch = _engine_micro_batch(model, lengths)
    engine = _r3_engine(model)
    packed_ids = torch.cat([micro_batch["input_ids"].values(), torch.zeros(pad, dtype=torch.long)]).unsqueeze(0)
    position_ids = torch.cat([torch.arange(n) for n in lengths] + [torch.arange(pad)]).unsqueeze(0)
    nnz = sum(lengths)

    native_spy = ExpertsSpy(model)
    with torch.no_grad():
        model(input_ids=packed_ids, position_ids=position_ids)
    native_spy.close()
    spy = _armed_forward(engine, model, micro_batch, pad, packed_ids, position_ids)

    rollout_routes = micro_batch["routed_experts"].values().long()
    for layer in (0, 2):  # layer 1 is dense
        used = spy.used[f"model.layers.{layer}.mlp.experts"]
        assert torch.equal(used[:nnz], rollout_routes[:, layer])
        assert torch.equal(used[nnz:], native_spy.used[f"model.layers.{layer}.mlp.experts"][nnz:])
    metrics = {}
    engine._add_router_replay_metrics(metrics)
    assert metrics["actor/r3_layers_replayed"] == 2.0
    assert metrics["actor/r3_route_flip_frac"] > 0  # packed attention differs from per-sequence rollout


def test_engine_honours_verls_per_call_routing_replay_flag():
    """verl's worker flags each call (``compute_ref_log_prob``: False): False keeps native routing even under R3, True
    replays, and where verl 0.9.1's worker sets no flag (it does so only for Megatron and VeOmni) R3 replays."""
    model = tiny_moe("qwen3_moe").eval()
    lengths, pad = [5, 7, 3], 2
    packed_ids = None
    outputs = {}
    for flag in (None, True, False):
        micro_batch = _engine_micro_batch(model, lengths)
        if flag is not None:
            tu.assign_non_tensor_data(micro_batch, "enable_routing_replay", flag)
        if packed_ids is None:
            packed_ids = torch.cat([micro_batch["input_ids"].values(), torch.zeros(pad, dtype=torch.long)])[None]
            position_ids = torch.cat([torch.arange(n) for n in lengths] + [torch.arange(pad)]).unsqueeze(0)
        engine = _r3_engine(model)
        spy = _armed_forward(engine, model, micro_batch, pad, packed_ids, position_ids)
        metrics = {}
        engine._add_router_replay_metrics(metrics)
        outputs[flag] = (spy.used["model.layers.0.mlp.experts"][: sum(lengths)], metrics)
        if engine._routing_replay is not None:
            engine._routing_replay.detach()
    rollout_routes = micro_batch["routed_experts"].values().long()[:, 0]
    for flag in (None, True):
        assert torch.equal(outputs[flag][0], rollout_routes) and outputs[flag][1]["actor/r3_layers_replayed"] == 2.0
    assert not torch.equal(outputs[False][0], rollout_routes) and outputs[False][1] == {}


def test_missing_routes_is_a_clear_error():
    model = tiny_moe("mixtral")
    micro_batch = _engine_micro_batch(model, [4, 4])
    del micro_batch["routed_experts"]
    engine = _r3_engine(model)
    try:
        engine._prepare_router_replay_inputs(micro_batch, {"pad_size": 0})
    except RuntimeError as err:
        assert "enable_rollout_routing_replay=True" in str(err)
    else:
        raise AssertionError("expected a RuntimeError")


def _sp_rank(rank: int, world: int, init_file: str, queue) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    set_ulysses_sequence_parallel_group(dist.group.WORLD)
    nnz, layers = 11, 3
    input_ids = torch.arange(1, nnz + 1).unsqueeze(0)  # token t has id t + 1
    routes = torch.stack([torch.arange(1, nnz + 1)] * layers, dim=1).unsqueeze(-1).repeat(1, 1, TOP_K)
    sliced_ids, _, pad_size = ulysses_pad_and_slice_inputs(input_ids, None, sp_size=world)
    targets = micro_batch_routes(routes, pad_size, sequence_parallel=True)
    queue.put((rank, sliced_ids[0].tolist(), targets[:, 0, 0].tolist()))
    dist.destroy_process_group()


def test_ulysses_slices_routes_like_input_ids(tmp_path):
    """Two sequence-parallel ranks over gloo: each rank's routes cover exactly the tokens verl gives it."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_sp_rank, args=(r, 2, str(tmp_path / "init"), queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for _, token_ids, route_ids in results:
        assert token_ids == route_ids  # the token's id equals its route id here; pad rows are 0 in both
    assert [len(r[1]) for r in results] == [6, 6]
