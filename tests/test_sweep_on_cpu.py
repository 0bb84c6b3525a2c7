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
"""``verl-sat sweep`` and ``verl-sat report``: a tiny real sweep writes the table and plots, aggregation and the
paired statistic match hand-computed values, a re-run re-uses finished cells, and a cell store carries finished cells
to another sweep without running them again."""

import csv
import json
import math
import shutil

import pytest

from verl_sat import cli
from verl_sat.embedded import frontier
from verl_sat.embedded import sweep as sweep_module
from verl_sat.embedded.cell_stats import aggregate, holm, mean_se, paired_t_test, read_records, select
from verl_sat.embedded.remedy_view import remedy_view
from verl_sat.embedded.report import (
    MICRO_BATCH_KEY,
    _row_label,
    base_settings,
    default_micro_batch_size,
    micro_batch_view,
    model_lines,
    paired,
    write_report,
)
from verl_sat.embedded.sweep import Cell, StoreMismatch, parse_lag, start_accuracies, sweep

TINY_RUN = ["data.train_batch_size=4", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.val_kwargs.n=1",
            "trainer.total_training_steps=2", "trainer.test_freq=1"]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_sweep(tiny_workdir):
    out = sweep(tiny_workdir, ["grpo", "sat_gspo"], [1, "fixed2"], [0], TINY_RUN, name="tiny", jobs=2,
                progress=False, store=tiny_workdir / "store")  # fmt: skip
    return tiny_workdir, out


def test_tiny_sweep_writes_table_and_plots(tiny_sweep):
    workdir, out = tiny_sweep
    results = json.loads((out / "results.json").read_text())
    assert sorted((r["recipe"], r["lag_label"], r["lag_regime"], r["seeds"]) for r in results["rows"]) == [
        ("grpo", "fixed2", "fixed", 1), ("grpo", "lag1", "paper", 1), ("sat_gspo", "fixed2", "fixed", 1),
        ("sat_gspo", "lag1", "paper", 1)]  # fmt: skip
    assert "--recipes grpo,sat_gspo --lags 1,fixed2 --seeds 0" in results["command"][0]
    for row in results["rows"]:  # the row is its cell's own summary (one seed; averaging over seeds: by hand below)
        cells = [json.loads((workdir / "runs" / "tiny" / f"{row['recipe']}-{row['lag_label']}-s{s}" / "summary.json")
                            .read_text()) for s in (0,)]  # fmt: skip
        assert row["best_accuracy"] == pytest.approx(cells[0]["best_accuracy"])
        assert row["collapsed"] == cells[0]["collapsed"]
        assert row["policy_lag_abs_mean"] == pytest.approx(cells[0]["last_policy_lag"])
        assert row["engine_abs_mean"] == pytest.approx(cells[0]["last_engine_mismatch"])
        sat_fields = ("intercepted_frac", "gate_rate", "q_over_radius")
        if row["recipe"] == "sat_gspo":  # SAT's diagnostics; q over the recipe's 0.2 radius
            assert all(row[f] is not None for f in sat_fields)
            q = cells[0]["last_q"]
            assert row["q_over_radius"] == pytest.approx(q / 0.2) and cells[0]["radius"] == 0.2
        else:
            assert all(row[f] is None for f in sat_fields)
    assert {(e["recipe"], e["base"], e["lag_label"], tuple(e["seeds"])) for e in results["paired"]} == {
        ("sat_gspo", "gspo", label, (0,)) for label in ()
    }  # gspo was not run: nothing to pair sat_gspo with
    table = (out / "results.md").read_text()
    assert "| grpo | 1 |" in table and "| sat_gspo | 1 |" in table and "## lag1 (paper lag" in table
    assert "## fixed2 (fixed lag" in table
    model = json.loads((workdir / "prepare.json").read_text())["model_sha256"]
    assert f"Prepared model (`model_sha256` of `verl-sat prepare`): `{model[:16]}` (4 cells)." in table
    assert "Paper, Table 1" in table and "| sat_gspo | 34.17 | 32.71 |" in table
    with (out / "results.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 4
    for plot in ("curves_lag1.png", "curves_fixed2.png", "mismatch.png", "attribution.png"):
        assert (out / plot).stat().st_size > 10_000
    lag1 = [json.loads(line) for line in (workdir / "runs" / "tiny" / "sat_gspo-lag1-s0" / "metrics.jsonl").open()]
    assert [r.get("rollout/version_gap") for r in lag1] == [None, 0, 1] and "actor/sat_gate_rate" in lag1[-1]


@pytest.fixture
def calls(monkeypatch):
    """The commands the sweep runs as ``verl-sat train`` processes, in order (each still runs)."""
    commands = []
    real_run = sweep_module.subprocess.run

    def counting_run(command, **kwargs):
        commands.append(command)
        return real_run(command, **kwargs)

    monkeypatch.setattr(sweep_module.subprocess, "run", counting_run)
    return commands


def test_rerun_reuses_finished_cells(tiny_sweep, calls):
    workdir, out = tiny_sweep
    (workdir / "runs" / "tiny" / "grpo-lag1-s0" / "summary.json").unlink()  # as if interrupted before the end
    (workdir / "store" / "grpo-lag1-s0.json").unlink()
    before = (out / "results.json").read_text()
    sweep(workdir, ["grpo", "sat_gspo"], [1, "fixed2"], [0], TINY_RUN, name="tiny", jobs=2, progress=False,
          store=workdir / "store")  # fmt: skip
    # the store's other cells name this workdir's model (no probe): the cell resumes
    assert len(calls) == 1 and "trainer.experiment_name=tiny/grpo-lag1-s0" in calls[0]
    assert (out / "results.json").read_text() == before  # the cell resumed from its final checkpoint, unchanged


def test_store_carries_cells_to_another_sweep(tiny_sweep, monkeypatch):
    """A fresh sweep (another name, as on another machine) takes every cell from the store without running it and
    writes the same rows; a store made with other overrides is refused before anything runs."""
    workdir, out = tiny_sweep

    def no_run(command, **kwargs):
        raise AssertionError(f"ran {command}")

    monkeypatch.setattr(sweep_module.subprocess, "run", no_run)
    again = sweep(workdir, ["grpo", "sat_gspo"], [1, "fixed2"], [0], TINY_RUN, name="elsewhere",
                  progress=False, store=workdir / "store")  # fmt: skip
    rows = json.loads((again / "results.json").read_text())["rows"]
    assert rows == json.loads((out / "results.json").read_text())["rows"]
    record = json.loads((workdir / "store" / "sat_gspo-lag1-s0.json").read_text())
    assert record["cell"] == {"recipe": "sat_gspo", "lag": 1, "seed": 0, "regime": "paper"}
    assert record["accuracy"][0][0] == 0 and record["split"] and record["overrides"] == TINY_RUN
    with pytest.raises(StoreMismatch, match="data.train_batch_size=4"):
        sweep(workdir, ["grpo"], [1], [0], TINY_RUN[1:], name="other", progress=False, store=workdir / "store")
    with pytest.raises(StoreMismatch, match="--optimizer-steps 7"):
        sweep(workdir, ["grpo"], [1], [0], TINY_RUN, name="other", progress=False, store=workdir / "store",
              optimizer_steps=7)  # fmt: skip
    assert cli.main(["report", "--store", str(workdir / "store"), "--out", str(workdir / "report")]) == 0
    assert json.loads((workdir / "report" / "results.json").read_text())["rows"] == rows


def test_longer_optimizer_steps_extend_a_finished_run_as_a_run_of_that_length(tiny_workdir, calls):
    """A sweep asking for more ``--optimizer-steps`` than a finished run holds extends that run from its final
    checkpoint (one process), and the longer cell equals the same cell run from scratch at that length; asking the
    extended folder for the shorter run again is refused before anything runs."""
    overrides = [o for o in TINY_RUN if not o.startswith("trainer.total_training_steps")]
    args = (tiny_workdir, ["grpo"], [1], [0], overrides)
    sweep(*args, name="extend", progress=False, optimizer_steps=1, store=tiny_workdir / "short")
    sweep(*args, name="extend", progress=False, optimizer_steps=2, store=tiny_workdir / "long")
    sweep(*args, name="scratch", progress=False, optimizer_steps=2, store=tiny_workdir / "scratch")
    assert len(calls) == 3 and "trainer.total_training_steps=2" in calls[1]
    short, extended, scratch = (json.loads((tiny_workdir / store / "grpo-lag1-s0.json").read_text())
                                for store in ("short", "long", "scratch"))  # fmt: skip
    assert short["summary"]["total_steps"] == 1 and extended["summary"]["steps_done"] == 2
    assert short["accuracy"] == extended["accuracy"][:2] and len(extended["accuracy"]) == 3
    timing = "seconds_per_optimizer_step"
    assert {k: v for k, v in extended["summary"].items() if k != timing} == {
        k: v for k, v in scratch["summary"].items() if k != timing}  # fmt: skip
    assert (extended["accuracy"], extended["split"]) == (scratch["accuracy"], scratch["split"])
    with pytest.raises(StoreMismatch, match="ran 2 trainer steps, more than the 1 asked for"):
        sweep(*args, name="extend", progress=False, optimizer_steps=1, store=tiny_workdir / "other")
    # an extension interrupted after its checkpoint, before its summary: the 1-step summary is no longer the run's
    summary = tiny_workdir / "runs" / "extend" / "grpo-lag1-s0" / "summary.json"
    summary.write_text(json.dumps(short["summary"]))
    with pytest.raises(StoreMismatch, match="ran 2 trainer steps, more than the 1 asked for"):
        sweep(*args, name="extend", progress=False, optimizer_steps=1, store=tiny_workdir / "other")
    assert len(calls) == 3
    # an extension interrupted before its first checkpoint logged steps past the summary: the record leaves them out
    runs = tiny_workdir / "runs"
    (runs / "interrupted").mkdir()
    shutil.copytree(runs / "extend" / "grpo-lag1-s0", runs / "interrupted" / "grpo-lag1-s0")
    (runs / "interrupted" / "grpo-lag1-s0" / "checkpoints" / "global_step_2.pt").unlink()
    summary = runs / "interrupted" / "grpo-lag1-s0" / "summary.json"
    summary.write_text(json.dumps(short["summary"]))
    sweep(*args, name="interrupted", progress=False, optimizer_steps=1, store=tiny_workdir / "interrupted")
    interrupted = json.loads((tiny_workdir / "interrupted" / "grpo-lag1-s0.json").read_text())
    assert len(calls) == 3 and interrupted["accuracy"] == short["accuracy"] and interrupted["split"] == short["split"]


def test_a_store_refuses_cells_from_another_prepared_model(tiny_workdir, calls):
    """A record names the prepared model that trained it (``prepare.json``'s ``model_sha256``): a store holding
    another model's cells is refused before anything runs. A record from before that field is checked by a one-step
    probe: a seed-0 record with another step-0 accuracy than this workdir's model gives seed 0 (as on a CPU where a
    native-floating-point prepare landed elsewhere) is refused; with the true accuracy the store takes the new
    cell."""
    store = tiny_workdir / "model_store"
    sweep(tiny_workdir, ["grpo"], [1], [0], TINY_RUN, name="model", progress=False, store=store)
    del calls[:]
    path = store / "grpo-lag1-s0.json"
    record_ = json.loads(path.read_text())
    model = json.loads((tiny_workdir / "prepare.json").read_text())["model_sha256"]
    assert record_["model_sha256"] == model and len(model) == 64
    path.write_text(json.dumps({**record_, "model_sha256": "f" * 64}))
    with pytest.raises(StoreMismatch, match=f"model_sha256 {model[:16]}.* is not the one .*\\(ffffffffffffffff\\)"):
        sweep(tiny_workdir, ["grpo", "sat_gspo"], [1], [0], TINY_RUN, name="model", progress=False, store=store)
    assert calls == [] and not (store / "sat_gspo-lag1-s0.json").exists()
    # a record without model_sha256 (made before it): the probe
    del record_["model_sha256"]
    start = record_["summary"]["initial_accuracy"]
    record_["summary"]["initial_accuracy"] = start + 0.125
    path.write_text(json.dumps(record_))
    with pytest.raises(StoreMismatch, match=f"starts from step-0 test accuracy {start} here, {start + 0.125} there"):
        sweep(tiny_workdir, ["grpo", "sat_gspo"], [1], [0], TINY_RUN, name="model", progress=False, store=store)
    assert len(calls) == 1 and "trainer.experiment_name=model-probe/sat_gspo-lag1-s0" in calls[0]
    assert "trainer.total_training_steps=1" in calls[0] and not (store / "sat_gspo-lag1-s0.json").exists()
    (store / "grpo-lag1-s1.json").write_text(json.dumps({**record_, "cell": {**record_["cell"], "seed": 1}}))
    record_["summary"]["initial_accuracy"] = start
    path.write_text(json.dumps(record_))
    sweep(tiny_workdir, ["grpo", "sat_gspo"], [1], [0], TINY_RUN, name="model", progress=False, store=store)
    assert len(calls) == 2 and (store / "sat_gspo-lag1-s0.json").is_file()  # the probe's run is reused
    assert json.loads((store / "sat_gspo-lag1-s0.json").read_text())["model_sha256"] == model
    legacy = {"a.json": record_, "b.json": {**record_, "cell": {**record_["cell"], "seed": 1}}}
    with pytest.raises(StoreMismatch, match="holds seed-1 cells from two prepared models"):
        start_accuracies(
            store, {**legacy, "c.json": {**legacy["b.json"], "summary": {"initial_accuracy": start + 0.125}}}
        )


def record(recipe, lag, seed, best, last, mismatch, regime="paper", **extra):
    return {"cell": {"recipe": recipe, "lag": lag, "seed": seed, "regime": regime}, "overrides": [],
            "summary": {"best_accuracy": best, "last_accuracy": last, "collapsed": last < 0.5 * best,
                        "last_epoch_mismatch": mismatch, "steps_done": 10, "total_steps": 10,
                        "best_step": 10 if last >= best else 5, "last_step": 10, **extra},
            "accuracy": [[0, 0.2], [10, best]], "split": [[10, mismatch, mismatch, 0.004]]}  # fmt: skip


def test_report_names_the_prepared_models():
    old = record("grpo", 8, 0, 0.4, 0.4, 0.01)
    named = [
        {**record("grpo", 8, s, 0.4, 0.4, 0.01), "model_sha256": m * 64} for s, m in ((1, "b"), (2, "a"), (3, "a"))
    ]
    assert model_lines([old]) == []
    assert model_lines([old, *named]) == [
        "Prepared model (`model_sha256` of `verl-sat prepare`): `aaaaaaaaaaaaaaaa` (2 cells), `bbbbbbbbbbbbbbbb` "
        "(1 cell), not named (1 cell, made before records named their model).", ""]  # fmt: skip


def test_aggregation_by_hand(tmp_path):
    records = [
        record("grpo", 8, 0, 0.30, 0.10, 0.2),  # collapsed
        record("grpo", 8, 1, 0.40, 0.35, 0.4),
        record("grpo", 8, 2, 0.20, 0.05, 0.3),  # collapsed
        record("sat_gspo_r3", 8, 0, 0.50, 0.45, 0.1, last_q=0.05, last_q_over_radius=0.25),
    ]
    grpo, sat = aggregate(records)
    assert grpo["best_accuracy"] == pytest.approx(0.30)
    assert grpo["best_accuracy_se"] == pytest.approx(math.sqrt(((0.0) ** 2 + 0.1**2 + 0.1**2) / 2 / 3))  # 0.0577
    assert grpo["last_accuracy"] == pytest.approx(0.50 / 3)
    assert grpo["collapsed"] == 2 and grpo["seeds"] == 3
    assert grpo["last_epoch_mismatch"] == pytest.approx(0.3) and grpo["q_over_radius"] is None
    assert (sat["best_accuracy"], sat["collapsed"], sat["q_over_radius"]) == (0.5, 0, 0.25)
    assert sat["best_accuracy_se"] is None  # one seed: no standard error
    assert mean_se([1.0, 2.0, 3.0, 4.0]) == pytest.approx((2.5, math.sqrt(5 / 3) / 2))
    (sync,) = aggregate([record("grpo", 0, 0, 0.3, 0.3, 0.01)])  # lag 0 is verl's synchronous mode
    assert (sync["lag_label"], sync["lag_regime"]) == ("lag0", "sync")
    write_report(tmp_path, records, ["verl-sat sweep ..."])
    table = (tmp_path / "results.md").read_text()
    assert "| grpo | 3 | 30.0 ± 5.8 | 16.7 ± 9.3 | 2/3 | 0.3000 | - | - | - |" in table
    assert "| sat_gspo_r3 | 1 | 50.0 | 45.0 | 0/1 | 0.1000 | - | - | 0.250 |" in table
    assert "| grpo | 31.25 | 30.17 then collapse |" in table


def test_paired_statistic_by_hand():
    """SAT minus base per seed, only on the seeds both ran; the t-test against the closed form for 2 degrees of
    freedom, p = 1 - t / sqrt(2 + t^2)."""
    records = [record("gspo", 8, s, b, b, 0.1) for s, b in ((0, 0.30), (1, 0.40), (2, 0.20), (3, 0.5))]
    records += [record("sat_gspo", 8, s, b, b - 0.1, 0.1) for s, b in ((0, 0.40), (1, 0.60), (2, 0.50), (4, 0.9))]
    records += [record("sat_gspo", 1, 0, 0.4, 0.4, 0.1)]  # no base at lag 1: no entry
    (entry,) = paired(records)
    assert (entry["recipe"], entry["base"], entry["lag_label"], entry["seeds"]) == (
        "sat_gspo",
        "gspo",
        "lag8",
        [0, 1, 2],
    )
    assert entry["mean_diff"] == pytest.approx(0.2) and (entry["wins"], entry["losses"]) == (3, 0)
    t = 0.2 / (0.1 / math.sqrt(3))
    assert entry["t"] == pytest.approx(t) and entry["p_value"] == pytest.approx(1 - t / math.sqrt(2 + t * t))
    assert entry["last_mean_diff"] == pytest.approx(0.1)
    assert paired_t_test([0.1]) == (None, None) and paired_t_test([0.0, 0.0]) == (0.0, 1.0)
    assert paired_t_test([0.005, 0.005]) == (math.inf, None)  # no spread: no test, not p = 0
    # the same difference of different accuracies, unequal only by float rounding: no spread either
    same = [0.45 - 0.40, 0.75 - 0.70, 0.20 - 0.15]
    assert len(set(same)) > 1 and paired_t_test(same) == (math.inf, None)
    assert paired_t_test([0.05, 0.05 + 1e-6])[1] is not None  # a real spread, however small, is tested
    assert paired_t_test([0.1, -0.1])[1] == pytest.approx(1.0)


def test_sat_knob_rows_pair_with_the_base_without_the_knob():
    """A row of SAT-only overrides (the knob ablation) pairs with the base row that lacks them; any other setting
    (radius, lr) must match on both sides."""
    knob, radius = "actor_rollout_ref.actor.policy_loss.sat.quantile=0.8", "actor_rollout_ref.actor.clip_ratio_low=0.1"
    base = [record("gspo_r3", 8, s, 0.3, 0.3, 0.1) for s in (0, 1)]
    sat = [record("sat_gspo_r3", 8, s, 0.4 + 0.1 * s, 0.4, 0.1) | {"overrides": [knob]} for s in (0, 1)]
    sat_radius = [record("sat_gspo_r3", 8, s, 0.4, 0.4, 0.1) | {"overrides": [knob, radius]} for s in (0, 1)]
    (entry,) = paired(base + sat + sat_radius)  # no gspo_r3 row at radius 0.1: no entry for it
    assert (entry["settings"], entry["seeds"], entry["mean_diff"]) == ([knob], [0, 1], pytest.approx(0.15))
    assert base_settings((f"+{knob}", radius, "--optimizer-steps 120")) == (radius, "--optimizer-steps 120")
    assert _row_label(("sat_gspo_r3", (knob, radius, "--optimizer-steps 120")), {radius}) == (
        "sat_gspo_r3 quantile=0.8 --optimizer-steps 120"
    )


def test_micro_batch_view_pairs_each_size_with_its_own_base(tmp_path):
    """Rows at several micro-batch sizes: each SAT row (the token knob too) pairs with the base row at its own size;
    the engine's default size (no override) is a size of its own; the table and micro_batch.png are written."""
    token = "actor_rollout_ref.actor.policy_loss.sat.granularity=token"
    records = []
    for size, gain in ((None, 0.10), (8, 0.0)):
        micro = [] if size is None else [f"{MICRO_BATCH_KEY}={size}"]
        for s in (0, 1, 2):
            records.append(record("gspo", 8, s, 0.3, 0.2, 0.1) | {"overrides": micro})
            records.append(record("sat_gspo", 8, s, 0.3 + gain + 0.01 * s, 0.3, 0.1, last_gate_rate=gain,
                                  last_structurally_empty=float(gain == 0)) | {"overrides": micro})  # fmt: skip
            records.append(record("sat_gspo", 8, s, 0.35 + 0.01 * s, 0.3, 0.1, last_gate_rate=0.1,
                                  last_structurally_empty=0.0) | {"overrides": [*micro, token]})  # fmt: skip
    view = micro_batch_view(aggregate(records), paired(records))
    default = default_micro_batch_size()
    assert [(v["micro_batch"], v["label"]) for v in view] == [
        (default, "gspo"), (default, "sat_gspo"), (default, "sat_gspo granularity=token"),
        (8, "gspo"), (8, "sat_gspo"), (8, "sat_gspo granularity=token")]  # fmt: skip
    gains = [None if v["pair"] is None else round(v["pair"]["mean_diff"], 6) for v in view]
    assert gains == [None, 0.11, 0.06, None, 0.01, 0.06]
    assert view[4]["pair"]["diff_se"] == pytest.approx(0.01 / math.sqrt(3))
    write_report(tmp_path, records, ["verl-sat sweep ..."])
    table = (tmp_path / "results.md").read_text()
    assert "## Sequences per micro-batch (lag8)" in table
    assert "| 8 | sat_gspo | 3 | 31.0 ± 0.6 | 30.0 ± 0.0 | +1.0 (" in table and "| 1.00 |" in table
    assert (tmp_path / "micro_batch.png").stat().st_size > 10_000
    assert micro_batch_view(aggregate(records[:3]), paired(records[:3])) == []  # one size: no view


def test_remedy_view_pairs_each_remedy_with_gspo_and_sat_gspo(tmp_path):
    """Each remedy row pairs with gspo (row - gspo) and sat_gspo pairs with it (sat_gspo - row), seed by seed at the
    same lag; the run means land in the table; a lag without gspo has no view; remedies.png is written."""
    records = []
    for s in (0, 1, 2):
        records.append(record("gspo", 8, s, 0.30, 0.20, 0.10, mean_clip_frac=0.02, seconds_per_optimizer_step=1.0))
        records.append(record("sat_gspo", 8, s, 0.36 + 0.01 * s, 0.35, 0.09, mean_sat_intercepted_frac=0.01))
        records.append(record("gspo_k3_rs", 8, s, 0.32, 0.30 - 0.01 * s, 0.04, mean_rs_masked_frac=0.2 + 0.1 * s))
        records.append(record("grpo", 8, s, 0.1, 0.1, 0.3))  # neither base, SAT row nor remedy: not in the view
    records.append(record("gspo_icepop", 1, 0, 0.3, 0.3, 0.01))  # lag 1 has no gspo: no view there
    view = remedy_view(records)
    assert [(v["row"]["recipe"], v["row"]["lag_label"]) for v in view] == [
        ("gspo", "lag8"), ("sat_gspo", "lag8"), ("gspo_k3_rs", "lag8")]  # fmt: skip
    gspo, sat, k3 = view
    assert gspo["vs_base"] is None and gspo["sat_vs"]["mean_diff"] == pytest.approx(0.07)
    assert sat["vs_base"]["mean_diff"] == pytest.approx(0.07) and sat["sat_vs"] is None
    assert k3["vs_base"]["mean_diff"] == pytest.approx(0.02) and k3["vs_base"]["last_mean_diff"] == pytest.approx(0.09)
    assert k3["sat_vs"]["mean_diff"] == pytest.approx(0.05) and (k3["sat_vs"]["wins"], k3["sat_vs"]["losses"]) == (3, 0)
    assert k3["row"]["rs_masked_frac"] == pytest.approx(0.3)
    # Holm over the distinct tests (sat_gspo - gspo once, k3 - gspo, sat_gspo - k3; best and last): 6 p-values
    assert gspo["sat_vs"] is sat["vs_base"]
    tests = [sat["vs_base"], k3["vs_base"], k3["sat_vs"]]
    ps = [t["p_value"] for t in tests] + [t["last_p_value"] for t in tests]
    assert [t["p_holm"] for t in tests] + [t["last_p_holm"] for t in tests] == pytest.approx(holm(ps))
    smallest = min(p for p in ps if p is not None)
    assert min(h for h in holm(ps) if h is not None) == pytest.approx(
        min(1.0, sum(p is not None for p in ps) * smallest)
    )
    write_report(tmp_path, records, ["verl-sat report ..."])
    table = (tmp_path / "results.md").read_text()
    assert "## Remedies under staleness (lag8)" in table and "Remedies under staleness (lag1" not in table
    assert "| gspo | 3 | 30.0 ± 0.0 | 20.0 ± 0.0 | 0/3 | 0.1000 | 0.0200 | - | - | - | 1.00 | - | - |" in table
    assert (
        "| gspo_k3_rs | 3 | 32.0 ± 0.0 | 29.0 ± 0.6 | 0/3 | 0.0400 | - | 0.3000 | - | - | - | +2.0 (-, Holm -, 3/0) |"
        in table
    )
    assert (tmp_path / "remedies.png").stat().st_size > 10_000
    assert remedy_view([r for r in records if r["cell"]["recipe"] != "gspo"]) == []


def test_report_selects_recipes_and_lags(tmp_path, capsys):
    store = tmp_path / "cells"
    store.mkdir()
    for rec in (record("grpo", 8, 0, 0.3, 0.3, 0.1), record("grpo", 1, 0, 0.3, 0.3, 0.1),
                record("gspo", 8, 0, 0.3, 0.3, 0.1), record("grpo", 8, 0, 0.3, 0.3, 0.1, regime="fixed")):  # fmt: skip
        cell = rec["cell"]
        (store / f"{cell['recipe']}-{cell['regime']}{cell['lag']}.json").write_text(json.dumps(rec))
    assert [(r["cell"]["recipe"], r["cell"]["lag"]) for r in select(read_records([store]), ["grpo"], ["lag8"])] == [
        ("grpo", 8)
    ]
    out = tmp_path / "out"
    assert (
        cli.main(["report", "--store", str(store), "--out", str(out), "--recipes", "grpo", "--lags", "8,fixed8"]) == 0
    )
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [(r["recipe"], r["lag_label"]) for r in rows] == [("grpo", "lag8"), ("grpo", "fixed8")]
    capsys.readouterr()
    assert cli.main(["report", "--store", str(store), "--out", str(out), "--recipes", "dppo"]) == 2
    err = capsys.readouterr().err
    assert "no cell records" in err and "--recipes dppo" in err


def test_lag_cells_map_onto_the_lag_files():
    assert Cell("grpo", 0, 3).overrides("s")[:3] == ["+recipe=grpo", "+lag=sync", "data.seed=3"]
    assert Cell("grpo", 8, 0).overrides("s")[1] == "+lag=lag8"
    assert Cell("grpo", 4, 0).overrides("s")[1:3] == ["+lag=lag1", "trainer.v1.separate_async.parameter_sync_step=4"]
    assert Cell("grpo", 8, 0, "fixed").overrides("s")[1:3] == ["+lag=fixed8", "data.seed=0"]
    assert Cell("grpo", 3, 0, "fixed").overrides("s")[1:4] == [
        "+lag=fixed8",
        "trainer.v1.separate_async.num_warmup_batches=3",
        "trainer.v1.sampler.max_off_policy_threshold=4",
    ]
    assert Cell("grpo", 8, 0, "fixed").name == "grpo-fixed8-s0" and Cell("grpo", 8, 0).name == "grpo-lag8-s0"
    # equal optimizer steps: 8 per trainer step at paper lag 8, 1 otherwise
    assert Cell("grpo", 8, 0).overrides("s", 200)[-1] == "trainer.total_training_steps=25"
    assert Cell("grpo", 8, 0, "fixed").overrides("s", 200)[-1] == "trainer.total_training_steps=200"
    assert (parse_lag("8"), parse_lag("fixed8")) == ((8, "paper"), (8, "fixed"))
    with pytest.raises(ValueError, match="fixedL"):
        parse_lag("fixed")


def test_sweep_checks_every_recipe_before_running(tiny_workdir, capsys):
    assert cli.main(["sweep", "--workdir", str(tiny_workdir), "--recipes", "grpo,nope", "--lags", "1"]) == 2
    assert "nope" in capsys.readouterr().err
    assert cli.main(["sweep", "--workdir", str(tiny_workdir), "--lags", "one"]) == 2
    assert "comma-separated integers or fixedL" in capsys.readouterr().err
    assert cli.main(["report", "--store", str(tiny_workdir / "nowhere"), "--out", str(tiny_workdir / "r")]) == 2
    assert "no such folder" in capsys.readouterr().err


def test_holm_adjusts_a_family_of_p_values():
    # m = 4 tests: 0.01 x 4, 0.02 x 3 = 0.06, 0.03 x 2 = 0.06, 0.5 x 1; None is no test
    adjusted = holm([0.03, None, 0.01, 0.5, 0.02])
    assert adjusted[1] is None
    assert adjusted[2] == pytest.approx(0.04) and adjusted[4] == pytest.approx(0.06)
    assert adjusted[0] == pytest.approx(0.06) and adjusted[3] == pytest.approx(0.5)
    assert holm([0.4, 0.3]) == pytest.approx([0.6, 0.6])  # 0.3 x 2, then max(0.6, 0.4 x 1): monotone
    assert holm([0.9, 0.8, 0.7]) == pytest.approx([1.0, 1.0, 1.0])  # capped


def test_frontier_view_locates_collapse_and_pairs_within_and_across_families(tmp_path):
    """Rows at three paper lags: a row is stable where no seed collapsed, its frontier the largest lag before the
    first collapse; each row pairs with grpo and with gspo by seed, Holm-adjusted over every test reported."""
    records = []
    for s in (0, 1, 2):
        for lag in (8, 32, 128):
            gspo_last = {8: 0.40, 32: 0.30, 128: 0.10 + 0.01 * s}[lag]  # collapses at lag 128 (0.10 < 0.5 x 0.4)
            records.append(record("gspo", lag, s, 0.40, gspo_last, 0.1,
                                  collapse_step=(96 if lag == 128 else None)))  # fmt: skip
            records.append(record("grpo", lag, s, 0.42, 0.41 - 0.01 * s, 0.05))
            records.append(record("sat_gspo", lag, s, 0.41, 0.40 + 0.01 * s, 0.08))
    records.append(record("grpo", 1, 0, 0.4, 0.4, 0.01))  # lag 1 too: three lags or more suffice
    view = frontier.frontier_view(records)
    frontiers = {f["recipe"]: f for f in view["frontiers"]}
    assert frontiers["gspo"]["stable_lags"] == [8, 32] and frontiers["gspo"]["frontier"] == 32
    assert frontiers["sat_gspo"]["frontier"] == 128 and frontiers["grpo"]["frontier"] == 128
    gspo128 = next(r for r in view["rows"] if (r["recipe"], r["lag"]) == ("gspo", 128))
    assert gspo128["collapsed"] == 3 and gspo128["collapse_steps"] == [96, 96, 96]
    near = {entry["lag"]: entry["recipes"] for entry in view["near_best"]}  # within a point of the best last accuracy
    assert sorted(near[128]) == ["grpo", "sat_gspo"] and sorted(near[8]) == ["grpo", "gspo", "sat_gspo"]
    rising = {(r["recipe"], r["lag"]): r["rising"] for r in view["rows"]}  # seeds whose best is the last evaluation
    assert (rising[("sat_gspo", 8)], rising[("grpo", 8)], rising[("gspo", 8)]) == (2, 0, 3)
    # rows still rising on 2 seeds or more run longer, with their family's base, on the seeds they ran
    longer = {entry["lag"]: entry for entry in view["longer"]}
    assert sorted(longer[8]["recipes"]) == ["gspo", "sat_gspo"] and sorted(longer[8]["runs"]) == ["gspo", "sat_gspo"]
    assert longer[32]["recipes"] == ["sat_gspo"] and longer[32]["runs"] == ["sat_gspo", "gspo"]
    assert longer[128]["seeds"] == [0, 1, 2] and set(longer) == {8, 32, 128}
    runs = {entry["lag"]: sorted(entry["runs"]) for entry in view["near_best"]}  # the rows and their bases
    assert runs[128] == ["grpo", "gspo", "sat_gspo"] and runs[8] == ["grpo", "gspo", "sat_gspo"]
    tests = {(t["recipe"], t["base"], t["lag"], t["metric"]): t for t in view["tests"]}
    t = tests[("sat_gspo", "gspo", 128, "last_accuracy")]
    assert t["within_family"] and t["mean_diff"] == pytest.approx(0.30) and (t["wins"], t["losses"]) == (3, 0)
    assert not tests[("sat_gspo", "grpo", 128, "last_accuracy")]["within_family"]
    assert ("gspo", "gspo", 8, "last_accuracy") not in tests and ("grpo", "gspo", 8, "best_accuracy") in tests

    # Holm over the distinct tests: grpo - gspo and gspo - grpo are one test (the same p), counted once
    def key(t):
        return frozenset((t["recipe"], t["base"])), t["lag"], t["metric"]

    distinct = {key(t): t["p_value"] for t in view["tests"]}
    assert len(distinct) == len(view["tests"]) - 6  # 3 lags x best and last
    adjusted = dict(zip(distinct, holm(list(distinct.values())), strict=True))
    assert all(t["p_holm"] == adjusted[key(t)] for t in view["tests"])
    assert (
        tests[("grpo", "gspo", 8, "last_accuracy")]["p_holm"] == tests[("gspo", "grpo", 8, "last_accuracy")]["p_holm"]
    )
    # best accuracy 0.42 against 0.40 on every seed: no spread, so no test (not p = 0) and out of Holm's count
    assert tests[("grpo", "gspo", 8, "best_accuracy")]["p_value"] is None
    assert all(t["p_holm"] is None or t["p_holm"] >= t["p_value"] for t in view["tests"])
    write_report(tmp_path, records, ["verl-sat report ..."])
    table = (tmp_path / "results.md").read_text()
    assert "## The staleness frontier" in table and "| gspo | gspo | 8, 32 | 32 |" in table
    assert "| gspo | 3 | 40.0 ± 0.0 | 11.0 ± 0.6 | 0/3 | 3/3 (96, 96, 96) |" in table
    assert "| sat_gspo | gspo | 8, 32, 128 | 128 | - | 41.0 ± 0.6 / 41.0 ± 0.0 |" in table  # no lag-1 cell
    assert "(41.0), so run on seeds 0-4: grpo, sat_gspo." in table
    assert (tmp_path / "frontier.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "frontier.json").read_text())["frontiers"]
    # two lags only: no frontier view
    assert frontier.frontier_view([r for r in records if r["cell"]["lag"] in (8, 32)])["rows"] == []
