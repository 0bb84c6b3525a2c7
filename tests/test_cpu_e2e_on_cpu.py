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
"""verl's real entry point and v1 separate-async trainer on this CPU (``python -m verl_sat.main +recipe=sat_gspo_r3
+lag=lag1 r3=fsdp trainer.device=cpu +cpu=e2e``): Ray workers, verl's FSDP2 engine over gloo, verl's vLLM rollout
(``vLLMReplica``, ``vLLMHttpServer``, vLLM's CPU build) with R3 on vLLM's routes, the object-store weight sync into
verl's shared-memory transfer to vLLM, verl's transfer queue, replay buffer, agent and reward loops, two trainer steps
(the second on samples of the first update's weights) and verl's checkpoints. What it must show is read from verl's
own metrics. The resume from a checkpoint runs in ``make e2e`` (two vLLM start-ups would double this test's time)."""

import dataclasses
import math

import pytest

from verl_sat.cpu.e2e import (
    MISMATCH_METRICS,
    R3_METRICS,
    RUNS,
    SAT_METRICS,
    STALENESS_METRICS,
    E2EFailed,
    E2ERun,
    check_sat_acted,
    check_staleness,
    fresh_folder,
    run_e2e,
)


def test_verls_async_trainer_runs_sat_gspo_with_fsdp_routing_replay_on_vllm(tiny_workdir, tmp_path):
    base = next(run for run in RUNS if run.folder_name == "separate_async-sat_gspo_r3-lag1-fsdp1-bf16")
    run = E2ERun(base.trainer, base.name, base.recipe_args, steps=2, resume=False, required=base.required)
    result = run_e2e(tiny_workdir, (run,), out=tmp_path)[run.folder_name]  # raises, naming the log, on any failure
    steps = result["steps"]
    assert sorted(steps) == [1, 2]
    for metrics in steps.values():
        for key in (*SAT_METRICS, *R3_METRICS, *STALENESS_METRICS, *MISMATCH_METRICS, "critic/score/mean"):
            assert math.isfinite(metrics[key]), key
        assert metrics["actor/mismatch_abs_log_ratio"] > 0  # vLLM's bf16 kernels against the trainer's (Eq. 52)
        assert 0.0 <= metrics["actor/sat_gate_rate"] <= 0.1 + 1e-9  # at most 1 - alpha of the units (Eq. 14)
        # one rank, one token-budget micro-batch of 4 prompts x 4 responses: the sequence quantile can gate
        assert metrics["actor/sat_seqs_per_micro_batch"] == 16.0
        assert metrics["actor/sat_structurally_empty_frac"] == 0.0
        assert 0.0 <= metrics["actor/r3_route_flip_frac"] <= 1.0 and metrics["actor/r3_layers_replayed"] == 2.0
        assert 0.0 <= metrics["critic/score/mean"] <= 1.0  # verl's reward loop, GSM8K scorer
    assert steps[1]["training/off_policy/trajectory_staleness/max"] == 0  # the first batch: initial weights
    # vLLM started on dummy weights: only the first sync through verl-sat's worker extension made it the policy
    # (vLLM's bf16 against verl's bf16 mixed precision: a few 1e-3; a layout vLLM misreads gives nats)
    assert steps[1]["actor/mismatch_abs_log_ratio"] < 0.05
    checkpoints = tmp_path / run.folder_name / "checkpoints"
    assert (checkpoints / "global_step_1" / "actor").is_dir() and (checkpoints / "global_step_2" / "actor").is_dir()
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


def test_a_second_make_e2e_starts_each_run_clean(tmp_path):
    """A run's folder is emptied before it starts: the previous ``make e2e``'s ``global_step_3`` must not be resumed
    past the new run's step budget."""
    stale = tmp_path / "e2e" / "separate_async-sat_gspo_r3-lag1-fsdp1-bf16" / "checkpoints" / "global_step_3"
    stale.mkdir(parents=True)
    (stale.parent / "latest_checkpointed_iteration.txt").write_text("3")
    folder = fresh_folder(stale.parent.parent)
    assert folder.is_dir() and not any(folder.iterdir())


def _stale(*rows):
    """(max, mean, spans mean) per trainer step."""
    keys = ("training/off_policy/trajectory_staleness/max", "training/off_policy/trajectory_staleness/mean",
            "training/off_policy/trajectory_spans/mean")  # fmt: skip
    return {step: dict(zip(keys, row, strict=True)) for step, row in enumerate(rows, 1)}


def _fully_async(counts, versions):
    keys = ("fully_async/count/stale_trajectory_processed", "fully_async/count/current_param_version")
    return {step: dict(zip(keys, pair, strict=True)) for step, pair in enumerate(zip(counts, versions, strict=True), 1)}


def test_staleness_checks_accept_the_lag_and_name_a_departure(tmp_path):
    by_name = {run.folder_name: run for run in RUNS}
    v1, fully_async = by_name["colocate_async-sat_gspo_r3-lag1"], by_name["fully_async-sat_gspo_r3-lag1"]
    check_staleness(v1, _stale((0, 0, 1), (1, 1, 1), (1, 1, 1)), tmp_path)
    # one trajectory in 128 resumed across the broadcast (verl dates it by the newer version): still the lag
    check_staleness(v1, _stale((0, 0, 1), (1, 127 / 128, 1 + 1 / 128)), tmp_path)
    with pytest.raises(E2EFailed, match=r"step 2: trajectory staleness max 1, mean 0.5 with a share 0.0078"):
        check_staleness(v1, _stale((0, 0, 1), (1, 0.5, 1 + 1 / 128)), tmp_path)  # fresh ones not explained by it
    with pytest.raises(E2EFailed, match=r"step 3: trajectory staleness max 2"):
        check_staleness(v1, _stale((0, 0, 1), (1, 1, 1), (2, 1.5, 1)), tmp_path)
    # the first step of a resumed invocation: prompts in flight at the save regenerated by the restored weights
    check_staleness(v1, _stale((0, 0, 1), (1, 1, 1), (1, 0.75, 1)), tmp_path, first_steps={1, 3})
    check_staleness(fully_async, _fully_async([0, 16, 32], [0, 1, 2]), tmp_path)  # 4 prompts x 4 responses a step
    # generation slower than training: the groups unfinished at the broadcast come from the new weights
    check_staleness(fully_async, _fully_async([0, 12, 24], [0, 1, 2]), tmp_path)
    with pytest.raises(E2EFailed, match=r"expected 0 stale trajectories at the first step, then 1..16 more"):
        check_staleness(fully_async, _fully_async([0, 16, 16], [0, 1, 2]), tmp_path)  # a synchronous step
    with pytest.raises(E2EFailed, match=r"expected 0 stale"):
        check_staleness(fully_async, _fully_async([4, 20], [0, 1]), tmp_path)  # stale before any broadcast
    with pytest.raises(E2EFailed, match=r"one version per step"):
        check_staleness(fully_async, _fully_async([0, 16], [0, 2]), tmp_path)
    # staleness None (a benchmark at another lag, e.g. lag 8's 8 steps per logged version): measured, not checked
    check_staleness(dataclasses.replace(fully_async, staleness=None), _fully_async([0, 112, 240], [0, 1, 2]), tmp_path)


def test_a_sat_run_that_never_gated_fails_naming_the_structure(tmp_path):
    run = next(run for run in RUNS if run.folder_name == "colocate_async-sat_gspo_r3-lag1")
    gate, empty = "actor/sat_gate_rate", "actor/sat_structurally_empty_frac"
    check_sat_acted(run, {1: {gate: 0.0, empty: 1.0}, 2: {gate: 0.04, empty: 0.0}}, tmp_path)
    with pytest.raises(E2EFailed, match=r"SAT never gated .*\{1: 0.0, 2: 0.0\}.*\{1: 1.0, 2: 1.0\}"):
        check_sat_acted(run, {1: {gate: 0.0, empty: 1.0}, 2: {gate: 0.0, empty: 1.0}}, tmp_path)
    # not structural: the message says whether there was no mismatch (q 0) or a tie at the top (q above 0)
    q, d = "actor/sat_q", "actor/sat_abs_log_ratio_mean"
    with pytest.raises(E2EFailed, match=r"q \{1: 0.0, 2: 0.006\} .*mean \|d\| \{1: 0.0, 2: 0.002\}"):
        steps = {1: {gate: 0.0, empty: 0.0, q: 0.0, d: 0.0}, 2: {gate: 0.0, empty: 0.0, q: 0.006, d: 0.002}}
        check_sat_acted(run, steps, tmp_path)
    grpo = next(run for run in RUNS if run.folder_name == "separate_async-grpo-lag8")
    check_sat_acted(grpo, {1: {}, 2: {}}, tmp_path)  # no SAT in the recipe: nothing to act
