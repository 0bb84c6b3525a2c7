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
"""R3 and SAT through verl's own FSDP engine (``verl_sat.cpu.engine_matrix``): two ranks over gloo build verl's actor
worker for an engine configuration, replay vLLM's routes in ``compute_log_prob`` and take one SAT-GSPO step, checked
against vLLM's log-probs and a one-rank unwrapped reference. ``test_engine_matrix_cell`` (verl's default FSDP1, LoRA
on verl's default target modules with the reference pass in the actor, Ulysses) runs in ``make e2e``, beside the
matrix's own command, which runs every cell; the rest here check the matrix's rules and the verl code they rest on."""

import inspect

import pytest
import torch
from verl.trainer.ppo.v1 import trainer_base
from verl.workers import engine_workers
from verl.workers.engine import base as engine_base
from verl.workers.engine.fsdp import transformer_impl

from verl_sat.cpu.engine_matrix import (
    BASELINE,
    CELLS,
    REPLAY_MARGIN,
    STALE_MEAN,
    STALE_PEAK,
    SUITE_CELLS,
    TOLERANCES,
    CellResult,
    cell_config,
    run_cell,
    shifted,
    staleness,
    write_adapter,
)


@pytest.mark.parametrize("cell", SUITE_CELLS)
def test_engine_matrix_cell(cell, tiny_workdir, vllm_float32):
    result = run_cell(cell, str(tiny_workdir / "model"), str(vllm_float32["samples"]))
    assert result.failures(num_moe_layers=2) == [], result
    assert result.r3_route_flip_frac == 1.0  # every shifted route differs from the trainer's native choice
    if cell.startswith("lora"):
        assert result.ref_pass_log_prob_diff is not None  # the adapters-off reference pass was checked


def test_every_cell_names_what_it_switches():
    """Each cell but verl's default states what its engine must show, in keys the engine is read for, so a switch
    verl ignores fails the cell; the bf16 cells read the dtype the engine computed in."""
    assert [name for name, cell in CELLS.items() if not cell.expected] == ["fsdp1"]
    assert all(set(cell.expected) <= set(BASELINE) for cell in CELLS.values())
    assert set(SUITE_CELLS) <= set(CELLS)
    for name, cell in CELLS.items():
        assert (cell.dtype == "bfloat16") == (cell.expected.get("compute_dtype") == "bfloat16"), name
    bf16 = {name for name, cell in CELLS.items() if cell.dtype == "bfloat16"}
    assert bf16 == {"fsdp1_bf16", "fsdp1_bf16_no_gc", "fsdp2_bf16", "fsdp2_bf16_no_gc"}


def test_bf16_cells_run_verls_default_mixed_precision():
    """The bf16 cells remove the CPU preset's float32 block, so verl's FSDP engine builds its default:
    parameters in bf16, reduction and buffers in float32 (pinned to verl's code)."""
    config = cell_config("fsdp1_bf16", "unused")
    assert config.actor_rollout_ref.actor.fsdp_config.mixed_precision is None
    assert cell_config("fsdp1", "unused").actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype == "fp32"
    source = inspect.getsource(transformer_impl.FSDPEngine._build_fsdp_module)
    assert (
        """        else:
            param_dtype = torch.bfloat16
            reduce_dtype = torch.float32
            buffer_dtype = torch.float32"""
        in source
    )


def test_pinned_verl_offload_takes_the_reload_branch_on_a_cpu():
    """Why the offload cells are "composition only on a CPU": verl's train and eval contexts call ``to(device)`` on
    entering a pass and ``to("cpu")`` on leaving it, and ``FSDPEngine.to`` reloads whenever the device is the
    accelerator's name, which on a CPU is ``cpu`` too; so verl's offload functions never run here."""
    switch = inspect.getsource(engine_base.BaseEngineCtx)
    assert "self._context_switch(get_device_name())" in switch and 'self._context_switch("cpu")' in switch
    to = inspect.getsource(transformer_impl.FSDPEngine.to)
    assert "if device == device_name:" in to and "load_fsdp_model_to_gpu(self.module)" in to
    assert to.index("load_fsdp_model_to_gpu") < to.index("offload_fsdp_model_to_cpu")


def _result(cell: str, **figures) -> CellResult:
    """A cell's figures that pass, with ``figures`` changed."""
    tol = TOLERANCES[CELLS[cell].dtype]
    defaults = dict(
        cell=cell, dtype=CELLS[cell].dtype, rollout_log_prob_diff=0.1, no_replay_log_prob_diff=0.9,
        vllm_reference_diff=0.1, reference_rollout_diff=0.0, shifted_log_prob_diff=0.0, ref_pass_log_prob_diff=None,
        adapter_effect=None, shift_effect=8.0, layers_replayed=[4.0, 4.0], update_micro_batches=[[2, 41], [2, 35]],
        grad_error=tol.grad / 2, grad_max=0.3, frozen_moved=0.0, evidence={**BASELINE, **CELLS[cell].expected},
        offload_calls={}, sat_gate_rate=0.08, sat_intercepted_frac=0.08, r3_route_flip_frac=1.0, seconds=1.0,
    )  # fmt: skip
    return CellResult(**{**defaults, **figures})


def test_cell_checks_fail_where_the_engine_did_not_act():
    assert _result("fsdp1").failures(4) == []
    # the bound is the reference's own difference from vLLM plus the tolerance
    assert len(_result("fsdp1", rollout_log_prob_diff=0.1 + 2 * TOLERANCES["float32"].log_prob).failures(4)) == 1
    # bf16: without replay within REPLAY_MARGIN x the bound, the replay check has no power: a warning, not a failure
    assert _result("fsdp1_bf16").failures(4) == [] and _result("fsdp1_bf16").warnings() == []
    bound = 0.1 + TOLERANCES["bfloat16"].log_prob
    weak = _result("fsdp1_bf16", no_replay_log_prob_diff=0.99 * REPLAY_MARGIN * bound)
    assert weak.failures(4) == [] and len(weak.warnings()) == 1 and "no power" in weak.warnings()[0]
    assert _result("fsdp1", no_replay_log_prob_diff=0.0).warnings() == []  # float32: vLLM's routes are the engine's
    # dynamic batching: more micro-batches than the static split, each within the budget, read from the engine
    packed = [[1, 19], [1, 22], [1, 20], [1, 15]]
    assert _result("dynamic_bsz", update_micro_batches=packed).failures(4) == []
    static = _result("dynamic_bsz", update_micro_batches=[[2, 41], [2, 35]]).failures(4)
    assert any("more micro-batches than the static 2" in f for f in static)
    assert any("within 32" in f for f in _result("dynamic_bsz", update_micro_batches=[[1, 40]] * 3).failures(4))
    assert any("static micro-batches" in f for f in _result("fsdp1", update_micro_batches=packed).failures(4))
    # LoRA: adapters that change nothing fail
    lora = _result("lora_fsdp2", ref_pass_log_prob_diff=0.0, adapter_effect=0.0).failures(4)
    assert len(lora) == 1 and "adapters change" in lora[0]


def test_lora_cells_load_non_zero_adapters(tiny_workdir, tmp_path):
    """The LoRA cells' adapter (verl's ``lora_adapter_path``) has every LoRA weight non-zero, so the adapters-on
    policy differs from the base model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = str(tiny_workdir / "model")
    write_adapter(model, cell_config("lora_fsdp2", model), str(tmp_path))
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    ids = torch.tensor([[3, 5, 7, 9]])
    with torch.no_grad():
        plain = base(ids).logits.clone()
        peft = PeftModel.from_pretrained(base, str(tmp_path))
        lora = {name: p for name, p in peft.named_parameters() if "lora_" in name}
        assert lora and all(bool((p != 0).all()) for p in lora.values())
        assert float((peft(ids).logits - plain).abs().max()) > 1e-3


def test_shifted_routes_keep_empty_rows_and_distinct_experts():
    routes = torch.tensor([[[0, 0], [3, 1]], [[2, 3], [0, 0]]], dtype=torch.int16)
    moved = shifted(routes, 4)
    assert moved.dtype == torch.int16
    assert moved.tolist() == [[[0, 0], [0, 2]], [[3, 0], [0, 0]]]


def test_staleness_puts_one_peak_per_sequence_and_keeps_the_ratio_in_the_band():
    current = -torch.rand(12, generator=torch.Generator().manual_seed(0))
    for sign in (1.0, -1.0):
        log_ratio = current - staleness(current, sign)
        assert torch.all(torch.sign(log_ratio) == sign)
        assert log_ratio.abs().max() == pytest.approx(STALE_PEAK) and int((log_ratio.abs() == STALE_PEAK).sum()) == 1
        assert float(log_ratio.mean()) == pytest.approx(sign * STALE_MEAN, abs=1e-6)
        assert 0.8 < float(torch.exp(log_ratio.mean())) < 1.2  # inside verl's clip band of 0.2


def test_pinned_verl_computes_the_lora_reference_in_the_actor():
    """Under LoRA verl's trainer asks the actor for the reference log-probs with the adapters off; that pass goes
    through the actor's ``compute_log_prob``, so the actor engine's routing replay replays it too (as verl's own
    Megatron R3 does, whose routing-replay flag ``compute_log_prob`` sets)."""
    ref = inspect.getsource(trainer_base.PPOTrainer._compute_ref_log_prob)
    assert 'metadata["no_lora_adapter"] = True' in ref
    assert "self.actor_rollout_wg.compute_log_prob(batch)" in ref
    infer = inspect.getsource(engine_workers.TrainingWorker.infer_batch)
    assert "self.engine.disable_adapter() if no_lora_adapter else nullcontext()" in infer
    assert "@_with_routing_replay_flag(enabled=True)" in inspect.getsource(engine_workers.ActorRolloutRefWorker)


def test_matrix_reads_the_engine_state_it_checks():
    """The attributes ``evidence`` reads off verl's FSDP engine exist in verl 0.9.1's code."""
    from verl.workers.engine.fsdp import transformer_impl

    source = inspect.getsource(transformer_impl.FSDPEngine)
    for attribute in ("self._uses_fsdp2_cpu_offload_policy = ", "self._is_offload_param = ",
                      "self._is_offload_optimizer = ", "self.ulysses_sequence_parallel_size = "):  # fmt: skip
        assert attribute in source
