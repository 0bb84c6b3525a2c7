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
against vLLM's log-probs and a one-rank unwrapped reference. The suite runs verl's default (FSDP1), LoRA (verl's
default target modules, with the reference pass in the actor) and Ulysses; ``make e2e`` runs every cell."""

import inspect

import pytest
import torch
from verl.trainer.ppo.v1 import trainer_base
from verl.workers import engine_workers

from verl_sat.cpu.engine_matrix import (
    CELLS,
    EXPECTED,
    STALE_MEAN,
    STALE_PEAK,
    SUITE_CELLS,
    run_cell,
    shifted,
    staleness,
)


@pytest.mark.parametrize("cell", SUITE_CELLS)
def test_engine_matrix_cell(cell, tiny_workdir, vllm_float32):
    result = run_cell(cell, str(tiny_workdir / "model"), str(vllm_float32["samples"]))
    assert result.failures(num_moe_layers=2) == [], result
    assert result.r3_route_flip_frac == 1.0  # every shifted route differs from the trainer's native choice
    if cell.startswith("lora"):
        assert result.ref_pass_log_prob_diff is not None  # the adapters-off reference pass was checked


def test_every_cell_names_what_it_switches():
    """Each cell but verl's default states what its engine must show, so a switch verl ignores fails the cell."""
    assert set(CELLS) - set(EXPECTED) == {"fsdp1"} and set(EXPECTED) <= set(CELLS)
    assert set(SUITE_CELLS) <= set(CELLS)


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
