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
"""Statistics over sweep cell records (``verl_sat.embedded.sweep.make_record``), shared by the report's views (the
remedy comparison, ``remedy_view``; the staleness frontier), which import only this module, and by ``report``, which
assembles them (imports run one way: cell_stats <- views <- report): rows of seeds
(``aggregate``), paired per-seed differences with the paired t-test, the Holm correction over a family of tests,
and the tables' number formats."""

import json
import math
from pathlib import Path

import mpmath

from verl_sat.recipe_catalog import PAPER_TABLE_1

# row field -> summary key, averaged over seeds (None where the runs do not log it, e.g. SAT's metrics off SAT)
ROW_MEANS = {
    "last_epoch_mismatch": "last_epoch_mismatch",
    "intercepted_frac": "last_intercepted_frac",
    "gate_rate": "last_gate_rate",
    "q_over_radius": "last_q_over_radius",
    "policy_lag_abs_mean": "last_policy_lag",
    "engine_abs_mean": "last_engine_mismatch",
    "structurally_empty": "last_structurally_empty",
    "seqs_per_micro_batch": "last_seqs_per_micro_batch",
    # run means over every training step: what a remedy clips, masks or reweights, and its cost
    "clip_frac": "mean_clip_frac",
    "rs_masked_frac": "mean_rs_masked_frac",
    "is_out_of_bounds_frac": "mean_is_out_of_bounds_frac",
    "sat_intercepted_run_frac": "mean_sat_intercepted_frac",
    "seconds_per_optimizer_step": "seconds_per_optimizer_step",
}


def mean_se(values: list[float]) -> tuple[float, float | None]:
    """Mean and standard error (sample standard deviation / sqrt(n); ``None`` for one value)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def mean_or_none(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


_NO_SPREAD = 1e-9  # relative spread below which per-seed differences count as equal (float rounding, not seeds)


def paired_t_test(differences: list[float]) -> tuple[float | None, float | None]:
    """``(t, two-sided p)`` of the paired t-test on per-seed differences; ``(None, None)`` below two pairs. With no
    spread the test is undefined: ``p`` is 1 for a zero mean (the same results) and ``None`` otherwise (a few seeds
    with the same difference, which accuracies on a fixed test set make common, are no evidence of ``p = 0``). A
    spread within float rounding of the mean (differences of accuracies that are equal in exact arithmetic, such as
    0.45 - 0.40 and 0.75 - 0.70) counts as none."""
    n = len(differences)
    if n < 2:
        return None, None
    mean = sum(differences) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in differences) / (n - 1))
    if sd <= _NO_SPREAD * max(1.0, abs(mean)):
        return (0.0, 1.0) if mean == 0 else (math.copysign(math.inf, mean), None)
    t = mean / (sd / math.sqrt(n))
    df = n - 1
    return t, float(mpmath.betainc(df / 2, 0.5, 0, df / (df + t * t), regularized=True))


def settings(record: dict) -> tuple[str, ...]:
    """What a cell was run with beyond recipe, lag and seed: the sweep's overrides, and its ``--optimizer-steps``
    when it set them."""
    steps = record.get("optimizer_steps")
    return (*record["overrides"], *([f"--optimizer-steps {steps}"] if steps else []))


def select(records: list[dict], recipes: list[str] | None = None, lag_labels: list[str] | None = None) -> list[dict]:
    """The records of the given recipes and lag labels (``lag8``, ``fixed8``); ``None`` keeps all."""
    return [r for r in records if (recipes is None or r["cell"]["recipe"] in recipes)
            and (lag_labels is None or lag_label(r["cell"]["regime"], r["cell"]["lag"]) in lag_labels)]  # fmt: skip


def group_key(record: dict) -> tuple:
    cell = record["cell"]
    return cell["recipe"], cell["regime"], cell["lag"], settings(record)


def lag_label(regime: str, lag: int) -> str:
    return f"{'fixed' if regime == 'fixed' else 'lag'}{lag}"


def order(record: dict) -> tuple:
    """Table 1's row order, then lag (paper before fixed), settings and seed."""
    cell, rows = record["cell"], list(PAPER_TABLE_1)
    rank = rows.index(cell["recipe"]) if cell["recipe"] in rows else len(rows)
    return rank, cell["recipe"], cell["regime"] != "paper", cell["lag"], settings(record), cell["seed"]


def groups(records: list[dict]) -> dict[tuple, list[dict]]:
    """Records by (recipe, regime, lag, settings), in ``_order``."""
    groups: dict[tuple, list[dict]] = {}
    for record in sorted(records, key=order):
        groups.setdefault(group_key(record), []).append(record)
    return groups


def aggregate(records: list[dict]) -> list[dict]:
    """One row per (recipe, lag, settings): best / last accuracy mean and standard error over seeds, collapse
    count, and the seed means of the last-steps mismatch, its split and SAT's diagnostics."""
    rows = []
    for (recipe, regime, lag, settings_), group in groups(records).items():
        summaries = [r["summary"] for r in group]
        best, best_se = mean_se([s["best_accuracy"] for s in summaries])
        last, last_se = mean_se([s["last_accuracy"] for s in summaries])
        rows.append({
            "recipe": recipe, "lag": lag, "lag_regime": "sync" if lag == 0 else regime,
            "lag_label": lag_label(regime, lag), "settings": list(settings_),
            "seeds": len(group), "seed_list": [r["cell"]["seed"] for r in group],
            "best_accuracy": best, "best_accuracy_se": best_se, "last_accuracy": last, "last_accuracy_se": last_se,
            "collapsed": sum(bool(s["collapsed"]) for s in summaries),
            **{field: mean_or_none([s.get(key) for s in summaries]) for field, key in ROW_MEANS.items()},
        })  # fmt: skip
    return rows


def paired_differences(pairs: list[tuple[dict, dict]]) -> dict:
    """Summaries paired by seed, ``(a, b)``: for best and for last accuracy (``last_`` prefix) the mean per-seed
    difference ``a - b``, its standard error, the paired t-test's ``t`` and two-sided p-value, and a's wins and
    losses."""
    entry = {}
    for metric, prefix in (("best_accuracy", ""), ("last_accuracy", "last_")):
        diffs = [a[metric] - b[metric] for a, b in pairs]
        t, p = paired_t_test(diffs)
        entry |= {f"{prefix}mean_diff": sum(diffs) / len(diffs), f"{prefix}diff_se": mean_se(diffs)[1],
                  f"{prefix}t": t, f"{prefix}p_value": p,
                  f"{prefix}wins": sum(d > 0 for d in diffs), f"{prefix}losses": sum(d < 0 for d in diffs)}  # fmt: skip
    return entry


def pct(value: float | None, se: float | None = None) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.1f}" + ("" if se is None else f" ± {100 * se:.1f}")


def num(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def p_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def read_records(stores: list[str | Path]) -> list[dict]:
    """Every cell record (``*.json``) of the given store folders, in name order."""
    records = []
    for store in map(Path, stores):
        if not store.is_dir():
            raise FileNotFoundError(f"--store {store}: no such folder of cell records (made by verl-sat sweep --store)")
        records += [json.loads(p.read_text()) for p in sorted(store.glob("*.json"))]
    return records


def holm(p_values: list[float | None]) -> list[float | None]:
    """Holm's step-down adjustment of a family of p-values, in their given order: the i-th smallest of the m tested
    is multiplied by ``m - i`` (i from 0), made non-decreasing along that order and capped at 1. ``None`` (no test)
    stays ``None`` and does not count in m."""
    tested = sorted((p, i) for i, p in enumerate(p_values) if p is not None)
    m, running = len(tested), 0.0
    adjusted: list[float | None] = [None] * len(p_values)
    for rank, (p, i) in enumerate(tested):
        running = max(running, min(1.0, (m - rank) * p))
        adjusted[i] = running
    return adjusted


def holm_best_and_last(entries: list[dict]) -> None:
    """Set ``p_holm`` and ``last_p_holm`` of ``paired_differences`` entries: Holm over their best and last tests
    together."""
    adjusted = holm([e["p_value"] for e in entries] + [e["last_p_value"] for e in entries])
    for entry, best, last in zip(entries, adjusted[: len(entries)], adjusted[len(entries) :], strict=True):
        entry["p_holm"], entry["last_p_holm"] = best, last
