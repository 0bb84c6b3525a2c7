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
"""The remedy comparison view of a report (``verl-sat report``): every remedy row (``REMEDY_ROWS``) next to its base
``gspo`` and to ``sat_gspo``, at each lag and settings, from the cells' records only.

Each row carries its accuracy, collapses, d̄π, what it clips, masks or reweights (run means over every training
step), its wall time per optimizer step, its paired difference to ``gspo`` and ``sat_gspo``'s paired difference to it
(``cell_stats.paired_differences``, two-sided paired t-test, then Holm-adjusted over every distinct test of the
view, best and last). Written by ``report.write_report`` as a section of
``results.md`` and ``remedies.png`` (best and last accuracy against d̄π, one panel per lag) when the records hold a
remedy row and ``gspo`` at the same lag and settings.
"""

from pathlib import Path

from verl_sat.embedded import cell_stats
from verl_sat.embedded.cell_stats import (
    aggregate,
    holm_best_and_last,
    lag_label,
    num,
    p_text,
    paired_differences,
    pct,
    select,
)
from verl_sat.recipe_catalog import REMEDY_ROWS

BASE, SAT = "gspo", "sat_gspo"  # every remedy row is gspo plus one remedy; sat_gspo is SAT's row on the same base


def remedy_view(records: list[dict]) -> list[dict]:
    """One entry per (lag, settings, row) for ``gspo``, ``sat_gspo`` and each remedy row there, where ``gspo`` ran at
    that lag and settings: ``{"row": aggregate row, "vs_base": row - gspo, "sat_vs": sat_gspo - row}`` (paired by
    seed; ``None`` for the row itself; ``p_holm`` and ``last_p_holm`` adjust over every distinct test of the view,
    ``sat_gspo - gspo`` counted once). In lag order (as in the records), then ``gspo``, ``sat_gspo``, the remedies in
    ``REMEDY_ROWS`` order. Empty when no remedy row has its ``gspo``."""
    names = (BASE, SAT, *REMEDY_ROWS)
    chosen = select(records, list(names))
    groups: dict[tuple, dict[int, dict]] = {}
    for record in chosen:
        cell = record["cell"]
        key = (cell["recipe"], lag_label(cell["regime"], cell["lag"]), cell_stats.settings(record))
        groups.setdefault(key, {})[cell["seed"]] = record["summary"]

    tests: dict[tuple, dict | None] = {}  # one entry per distinct test: sat_gspo - gspo is asked for twice

    def pair(a: str, b: str, label: str, settings: tuple) -> dict | None:
        if (a, b, label, settings) not in tests:
            first, second = groups.get((a, label, settings)), groups.get((b, label, settings))
            seeds = [] if a == b or first is None or second is None else sorted(set(first) & set(second))
            tests[(a, b, label, settings)] = (
                {"seeds": seeds, **paired_differences([(first[s], second[s]) for s in seeds])} if seeds else None
            )
        return tests[(a, b, label, settings)]

    rows = {(r["recipe"], r["lag_label"], tuple(r["settings"])): r for r in aggregate(chosen)}
    if not any((name, label, settings) in rows and (BASE, label, settings) in rows
               for name in REMEDY_ROWS for _, label, settings in rows):  # fmt: skip
        return []
    view = []
    for label, settings in dict.fromkeys((label, settings) for _, label, settings in rows):
        if (BASE, label, settings) not in rows:
            continue
        view += [{"row": rows[(name, label, settings)], "vs_base": pair(name, BASE, label, settings),
                  "sat_vs": pair(SAT, name, label, settings)}
                 for name in names if (name, label, settings) in rows]  # fmt: skip
    holm_best_and_last([test for test in tests.values() if test is not None])
    return view


def _diff(entry: dict | None, prefix: str = "") -> str:
    if entry is None:
        return "-"
    wins = f", {entry[f'{prefix}wins']}/{entry[f'{prefix}losses']}" if not prefix else ""
    p_values = f"{p_text(entry[f'{prefix}p_value'])}, Holm {p_text(entry[f'{prefix}p_holm'])}"
    return f"{100 * entry[f'{prefix}mean_diff']:+.1f} ({p_values}{wins})"


def remedy_markdown(view: list[dict]) -> list[str]:
    """The view's tables, one per lag and settings."""
    lines = []
    for label, settings in dict.fromkeys((v["row"]["lag_label"], tuple(v["row"]["settings"])) for v in view):
        extra = f", settings `{' '.join(settings)}`" if settings else ""
        lines += [f"## Remedies under staleness ({label}{extra})", "",
                  f"Every row is `{BASE}` plus one remedy (verl's defaults). Run means over every training step: "
                  "clipped = verl's `actor/pg_clipfrac`, masked = tokens rejection sampling masks "
                  "(`rollout_rs_masked_fraction`), IS out = tokens whose IS weight is out of its bounds (truncated, "
                  "or zeroed by IcePop), SAT = tokens SAT's contracted bound intercepts; s/step = wall time per "
                  "optimizer step (two cells at a time on 2 cores). Δ: paired by seed, in accuracy points "
                  "(p: two-sided paired t-test, '-' where the seeds' differences do not vary: no test; Holm: adjusted "
                  "over every distinct test of the remedy tables, every lag, best and last; wins/losses).", "",
                  f"| row | seeds | best acc | last acc | collapsed | d̄π | clipped | masked | IS out | SAT | s/step "
                  f"| Δ best vs {BASE} | Δ last vs {BASE} | {SAT} - row, best | {SAT} - row, last |",
                  "|---" * 15 + "|"]  # fmt: skip
        for v in view:
            r = v["row"]
            if (r["lag_label"], tuple(r["settings"])) != (label, settings):
                continue
            lines.append(f"| {r['recipe']} | {r['seeds']} | {pct(r['best_accuracy'], r['best_accuracy_se'])} | "
                         f"{pct(r['last_accuracy'], r['last_accuracy_se'])} | {r['collapsed']}/{r['seeds']} | "
                         f"{num(r['last_epoch_mismatch'])} | {num(r['clip_frac'])} | "
                         f"{num(r['rs_masked_frac'])} | {num(r['is_out_of_bounds_frac'])} | "
                         f"{num(r['sat_intercepted_run_frac'])} | "
                         f"{num(r['seconds_per_optimizer_step'], 2)} | {_diff(v['vs_base'])} | "
                         f"{_diff(v['vs_base'], 'last_')} | {_diff(v['sat_vs'])} | "
                         f"{_diff(v['sat_vs'], 'last_')} |")  # fmt: skip
        lines.append("")
    return lines


def plot_remedies(out: Path, view: list[dict]) -> None:
    """``remedies.png``: best (top) and last (bottom) accuracy against d̄π, mean ± standard error over seeds, one
    column per lag and settings, every row labelled."""
    if not view:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((v["row"]["lag_label"], tuple(v["row"]["settings"])) for v in view))
    names = list(dict.fromkeys(v["row"]["recipe"] for v in view))
    colors = {name: plt.cm.tab10(i % 10) for i, name in enumerate(names)}
    fig, axes = plt.subplots(2, len(panels), figsize=(6.5 * len(panels), 9), squeeze=False)
    for col, panel in enumerate(panels):
        for v in (v for v in view if (v["row"]["lag_label"], tuple(v["row"]["settings"])) == panel):
            r = v["row"]
            for ax, metric in ((axes[0][col], "best_accuracy"), (axes[1][col], "last_accuracy")):
                ax.errorbar(r["last_epoch_mismatch"], 100 * r[metric], yerr=100 * (r[f"{metric}_se"] or 0.0),
                            color=colors[r["recipe"]], marker="s" if r["recipe"] in (BASE, SAT) else "o",
                            capsize=3, label=r["recipe"])  # fmt: skip
                ax.annotate(r["recipe"], (r["last_epoch_mismatch"], 100 * r[metric]), fontsize=7,
                            textcoords="offset points", xytext=(4, 3))  # fmt: skip
        for ax, which in ((axes[0][col], "best"), (axes[1][col], "last")):
            ax.set(xlabel="d̄π = mean |log π - log μ| (last epoch)", ylabel=f"{which} test accuracy, avg@k (%)",
                   title=f"{panel[0]}{' ' + ' '.join(panel[1]) if panel[1] else ''}: {which} accuracy")  # fmt: skip
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"remedies against staleness: {BASE} plus one remedy each, mean ± standard error over seeds")
    fig.tight_layout()
    fig.savefig(out / "remedies.png", dpi=110)
    plt.close(fig)
