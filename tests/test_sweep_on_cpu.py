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
"""``verl-sat sweep``: a tiny real sweep writes the table and plots, aggregation matches hand-computed values, and a
re-run re-uses finished cells."""

import csv
import json
import math

import pytest

from verl_sat import cli
from verl_sat.embedded import sweep as sweep_module
from verl_sat.embedded.sweep import Cell, aggregate, mean_se, sweep, write_results

TINY_RUN = ["data.train_batch_size=4", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.val_kwargs.n=1",
            "trainer.total_training_steps=2", "trainer.test_freq=1"]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_sweep(tiny_workdir):
    out = sweep(tiny_workdir, ["grpo", "sat_gspo"], [0, 1], [0, 1], TINY_RUN, name="tiny", jobs=2, progress=False)
    return tiny_workdir, out


def test_tiny_sweep_writes_table_and_plots(tiny_sweep):
    workdir, out = tiny_sweep
    results = json.loads((out / "results.json").read_text())
    assert [(r["recipe"], r["lag"], r["seeds"]) for r in results["rows"]] == [
        ("grpo", 0, 2), ("grpo", 1, 2), ("sat_gspo", 0, 2), ("sat_gspo", 1, 2)]  # fmt: skip
    assert "--recipes grpo,sat_gspo --lags 0,1 --seeds 0,1" in results["command"]
    for row in results["rows"]:  # the row is the aggregate of the cells' own summaries
        cells = [json.loads((workdir / "runs" / "tiny" / f"{row['recipe']}-lag{row['lag']}-s{s}" / "summary.json")
                            .read_text()) for s in (0, 1)]  # fmt: skip
        assert row["best_accuracy"] == pytest.approx(sum(c["best_accuracy"] for c in cells) / 2)
        assert row["collapsed"] == sum(c["collapsed"] for c in cells)
    table = (out / "results.md").read_text()
    assert "| grpo |" in table and "| sat_gspo |" in table and "lag 1: best acc" in table
    assert "Paper, Table 1" in table and "| sat_gspo | 34.17 | 32.71 |" in table
    with (out / "results.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 4
    for plot in ("curves_lag0.png", "curves_lag1.png", "mismatch.png"):
        assert (out / plot).stat().st_size > 10_000
    lag1 = [json.loads(line) for line in (workdir / "runs" / "tiny" / "sat_gspo-lag1-s1" / "metrics.jsonl").open()]
    assert [r.get("rollout/version_gap") for r in lag1] == [None, 0, 1] and "actor/sat_gate_rate" in lag1[-1]


def test_rerun_reuses_finished_cells(tiny_sweep, monkeypatch):
    workdir, out = tiny_sweep
    calls = []
    real_run = sweep_module.subprocess.run

    def counting_run(command, **kwargs):
        calls.append(command)
        return real_run(command, **kwargs)

    monkeypatch.setattr(sweep_module.subprocess, "run", counting_run)
    (workdir / "runs" / "tiny" / "grpo-lag1-s0" / "summary.json").unlink()  # as if interrupted before the end
    before = (out / "results.json").read_text()
    sweep(workdir, ["grpo", "sat_gspo"], [0, 1], [0, 1], TINY_RUN, name="tiny", jobs=2, progress=False)
    assert len(calls) == 1 and "trainer.experiment_name=tiny/grpo-lag1-s0" in calls[0]
    assert (out / "results.json").read_text() == before  # the cell resumed from its final checkpoint, unchanged


def summary(best, last, mismatch):
    return {"best_accuracy": best, "last_accuracy": last, "collapsed": last < 0.5 * best,
            "last_epoch_mismatch": mismatch, "steps_done": 10, "total_steps": 10}  # fmt: skip


def test_aggregation_by_hand(tmp_path):
    summaries = {
        Cell("grpo", 8, 0): summary(0.30, 0.10, 0.2),  # collapsed
        Cell("grpo", 8, 1): summary(0.40, 0.35, 0.4),
        Cell("grpo", 8, 2): summary(0.20, 0.05, 0.3),  # collapsed
        Cell("sat_gspo_r3", 8, 0): summary(0.50, 0.45, 0.1),
    }
    grpo, sat = aggregate(summaries)
    assert grpo["best_accuracy"] == pytest.approx(0.30)
    assert grpo["best_accuracy_se"] == pytest.approx(math.sqrt(((0.0) ** 2 + 0.1**2 + 0.1**2) / 2 / 3))  # 0.0577
    assert grpo["last_accuracy"] == pytest.approx(0.50 / 3)
    assert grpo["collapsed"] == 2 and grpo["seeds"] == 3
    assert grpo["last_epoch_mismatch"] == pytest.approx(0.3)
    assert (sat["best_accuracy"], sat["best_accuracy_se"], sat["collapsed"]) == (0.5, 0.0, 0)
    assert mean_se([1.0, 2.0, 3.0, 4.0]) == pytest.approx((2.5, math.sqrt(5 / 3) / 2))
    write_results(tmp_path, [grpo, sat], "verl-sat sweep ...", [8], [])
    table = (tmp_path / "results.md").read_text()
    assert "| grpo | 30.0 ± 5.8 | 16.7 ± 9.3 | 2/3 | 0.3000 |" in table
    assert "| sat_gspo_r3 | 50.0 ± 0.0 | 45.0 ± 0.0 | 0/1 | 0.1000 |" in table
    assert "| grpo | 31.25 | 30.17 then collapse |" in table


def test_lag_cells_map_onto_the_lag_files():
    assert Cell("grpo", 0, 3).overrides("s")[:3] == ["+recipe=grpo", "+lag=sync", "data.seed=3"]
    assert Cell("grpo", 8, 0).overrides("s")[1] == "+lag=lag8"
    assert Cell("grpo", 4, 0).overrides("s")[1:3] == ["+lag=lag1", "trainer.v1.separate_async.parameter_sync_step=4"]


def test_sweep_checks_every_recipe_before_running(tiny_workdir, capsys):
    assert cli.main(["sweep", "--workdir", str(tiny_workdir), "--recipes", "grpo,nope", "--lags", "1"]) == 2
    assert "nope" in capsys.readouterr().err
    assert cli.main(["sweep", "--workdir", str(tiny_workdir), "--lags", "one"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err
