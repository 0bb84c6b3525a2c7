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
"""The staleness frontier view of a report (``verl-sat report``), from the cells' records only: where each row
(recipe) collapses as the paper's lag grows.

Per row and lag: best and last accuracy, the runs that collapsed (``run_files.collapse_step``) and where. Per row:
the lags at which it is stable (no seed collapsed) and its frontier, the largest lag up to which it is stable at every
lag run. Paired by seed, on last and on best accuracy: each row against its own family's base (per-token ratio rows
against ``grpo``, sequence-level rows against ``gspo``: ``FAMILY``) and against the other family's base, two-sided
paired t-tests with the Holm correction over the distinct tests the view reports (``_tested``). Written by
``report.write_report`` as a section of ``results.md`` and ``frontier.png`` (last accuracy against lag, one line per
row) when the records hold paper-lag rows at three lags or more.
"""

from pathlib import Path

from verl_sat.embedded import cell_stats
from verl_sat.embedded.cell_stats import aggregate, holm, num, paired_differences, pct

# row -> its family's base: the rows whose ratio is per token pair with grpo, sequence-level ratios with gspo
FAMILY = {"grpo": "grpo", "sat_grpo": "grpo", "sapo": "grpo", "cispo": "grpo", "dppo_kl": "grpo",
          "gspo": "gspo", "sat_gspo": "gspo", "sat_gspo_carried": "gspo", "sat_gspo_ratio_side": "gspo",
          "sat_gspo_token": "gspo", "geo_mean": "gspo", "gspo_icepop": "gspo", "gspo_seq_is_rs": "gspo"}  # fmt: skip
MIN_LAGS = 3  # the view needs rows at this many paper lags
NEAR_BEST = 0.01  # rows within this much last accuracy of a lag's best row run seeds 0-4 (the design's rule)
RISING_SEEDS = 2  # rows whose best evaluation is the last on this many seeds run longer (the design's rule)
METRICS = (("last_accuracy", "last_"), ("best_accuracy", ""))


def frontier_view(records: list[dict]) -> dict:
    """``{"rows": [...], "frontiers": [...], "tests": [...], "near_best": [...], "longer": [...]}`` for the paper-lag
    records of every settings with ``MIN_LAGS`` lags or more: a row per (recipe, lag, settings)
    (``cell_stats.aggregate`` plus ``collapse_steps`` and ``rising``), a frontier entry per (recipe, settings), one
    test per (row, comparison base, lag, metric) with its Holm-adjusted p-value, and per (lag, settings) the rows
    within ``NEAR_BEST`` of the best mean last accuracy (they run seeds 0-4) and the rows still rising on
    ``RISING_SEEDS`` seeds (they run longer), each with ``runs``: those rows and their family's bases. Empty lists
    when no settings has enough lags."""
    paper = [r for r in records if r["cell"]["regime"] == "paper" and r["cell"]["lag"] > 0]
    lags_by_settings: dict[tuple, set[int]] = {}
    for record in paper:
        lags_by_settings.setdefault(cell_stats.settings(record), set()).add(record["cell"]["lag"])
    chosen = [r for r in paper if len(lags_by_settings[cell_stats.settings(r)]) >= MIN_LAGS]
    if not chosen:
        return {"rows": [], "frontiers": [], "tests": [], "near_best": [], "longer": []}
    by_key: dict[tuple, dict[int, dict]] = {}
    for record in chosen:
        cell = record["cell"]
        by_key.setdefault((cell["recipe"], cell["lag"], cell_stats.settings(record)), {})[cell["seed"]] = record
    rows = aggregate(chosen)
    for row in rows:
        seeds = by_key[(row["recipe"], row["lag"], tuple(row["settings"]))]
        row["collapse_steps"] = [seeds[s]["summary"].get("collapse_step") for s in sorted(seeds)]
        # seeds whose best evaluation is the last: still rising when the run stopped
        row["rising"] = sum(seeds[s]["summary"]["best_step"] == seeds[s]["summary"]["last_step"] for s in seeds)
    frontiers = []
    for recipe, settings in dict.fromkeys((r["recipe"], tuple(r["settings"])) for r in rows):
        mine = sorted((r for r in rows if (r["recipe"], tuple(r["settings"])) == (recipe, settings)),
                      key=lambda r: r["lag"])  # fmt: skip
        stable = [r["lag"] for r in mine if r["collapsed"] == 0]
        frontier = None
        for r in mine:
            if r["collapsed"]:
                break
            frontier = r["lag"]
        frontiers.append({"recipe": recipe, "settings": list(settings), "lags": [r["lag"] for r in mine],
                          "stable_lags": stable, "frontier": frontier})  # fmt: skip
    tests = []
    for row in rows:
        family = FAMILY.get(row["recipe"])
        if family is None:
            continue
        for base in ("grpo", "gspo"):
            other = by_key.get((base, row["lag"], tuple(row["settings"])))
            if base == row["recipe"] or other is None:
                continue
            mine = by_key[(row["recipe"], row["lag"], tuple(row["settings"]))]
            seeds = sorted(set(mine) & set(other))
            if not seeds:
                continue
            diff = paired_differences([(mine[s]["summary"], other[s]["summary"]) for s in seeds])
            for metric, prefix in METRICS:
                tests.append({"recipe": row["recipe"], "base": base, "within_family": base == family,
                              "lag": row["lag"], "settings": row["settings"], "metric": metric, "seeds": seeds,
                              "mean_diff": diff[f"{prefix}mean_diff"], "diff_se": diff[f"{prefix}diff_se"],
                              "p_value": diff[f"{prefix}p_value"], "wins": diff[f"{prefix}wins"],
                              "losses": diff[f"{prefix}losses"]})  # fmt: skip
    # Holm over the distinct tests: grpo - gspo and gspo - grpo are one test
    distinct = {_test_key(t): t["p_value"] for t in tests}
    adjusted = dict(zip(distinct, holm(list(distinct.values())), strict=True))
    for test in tests:
        test["p_holm"] = adjusted[_test_key(test)]
    near_best, longer = [], []
    for lag, settings in dict.fromkeys((r["lag"], tuple(r["settings"])) for r in rows):
        mine = [r for r in rows if (r["lag"], tuple(r["settings"])) == (lag, settings)]
        best = max(r["last_accuracy"] for r in mine)
        near = [r["recipe"] for r in mine if r["last_accuracy"] >= best - NEAR_BEST]
        near_best.append({"lag": lag, "settings": list(settings), "best_last_accuracy": best, "recipes": near,
                          "runs": _with_bases(near)})  # fmt: skip
        still_rising = [r for r in mine if r["rising"] >= RISING_SEEDS]
        if still_rising:
            seeds = sorted({s for r in still_rising for s in r["seed_list"]})
            longer.append({"lag": lag, "settings": list(settings), "recipes": [r["recipe"] for r in still_rising],
                           "runs": _with_bases([r["recipe"] for r in still_rising]), "seeds": seeds})  # fmt: skip
    return {"rows": rows, "frontiers": frontiers, "tests": tests, "near_best": near_best, "longer": longer}


def _with_bases(recipes: list[str]) -> list[str]:
    """``recipes`` followed by their family's bases, each once: the rows to run so that every pair holds its seeds."""
    return list(dict.fromkeys([*recipes, *(FAMILY[r] for r in recipes if r in FAMILY)]))


def _test_key(test: dict) -> tuple:
    """One key per distinct test: the pair of rows unordered (a base against the other family's base is one test)."""
    return frozenset((test["recipe"], test["base"])), test["lag"], tuple(test["settings"]), test["metric"]


def _tested(tests: list[dict]) -> int:
    """How many distinct tests have a p-value (the count Holm adjusts over)."""
    return len({_test_key(t) for t in tests if t["p_value"] is not None})


def _steps(steps: list[int | None]) -> str:
    collapsed = [str(s) for s in steps if s is not None]
    return ", ".join(collapsed) or "-"


def frontier_markdown(view: dict) -> list[str]:
    """The view's tables: the frontier per row, then per lag the rows with their paired differences and how many
    seeds peaked at their last evaluation (still rising: such a row runs longer)."""
    if not view["rows"]:
        return []
    lags = sorted({r["lag"] for r in view["rows"]})
    lines = ["## The staleness frontier", "",
             f"Collapsed: runs whose accuracy stays below half of the best it had reached, from the step given on "
             f"(evaluations every few optimizer steps); a row is stable at a lag where none of its seeds collapsed, "
             f"and its frontier is the largest lag up to which it is stable at every lag run. Δ: row - base in "
             f"accuracy points, paired by seed; p: two-sided paired t-test ('-' where the seeds' differences do not "
             f"vary: no test); Holm: adjusted over the {_tested(view['tests'])} distinct tests of this section.", "",
             "| row | family | stable at lags | frontier | "
             + " | ".join(f"last / best acc, lag {n}" for n in lags) + " |",
             "|---" * (4 + len(lags)) + "|"]  # fmt: skip
    by_row = {(r["recipe"], r["lag"], tuple(r["settings"])): r for r in view["rows"]}
    for f in view["frontiers"]:
        cells = [by_row.get((f["recipe"], lag, tuple(f["settings"]))) for lag in lags]
        lasts = [f"{pct(c['last_accuracy'], c['last_accuracy_se'])} / {pct(c['best_accuracy'], c['best_accuracy_se'])}"
                 if c else "-" for c in cells]  # fmt: skip
        lines.append(f"| {f['recipe']} | {FAMILY.get(f['recipe'], '-')} | "
                     f"{', '.join(map(str, f['stable_lags'])) or 'none'} | {f['frontier'] or '-'} | "
                     f"{' | '.join(lasts)} |")  # fmt: skip
    lines.append("")
    tests = {(t["recipe"], t["base"], t["lag"], tuple(t["settings"]), t["metric"]): t for t in view["tests"]}

    def delta(row: dict, base: str, metric: str) -> str:
        t = tests.get((row["recipe"], base, row["lag"], tuple(row["settings"]), metric))
        if t is None:
            return "-"
        return (f"{100 * t['mean_diff']:+.1f} (p {num(t['p_value'], 3)}, Holm {num(t['p_holm'], 3)}, "
                f"{t['wins']}/{t['losses']})")  # fmt: skip

    near = {entry["lag"]: entry for entry in view["near_best"]}
    for lag in lags:
        lines += [f"### Paper lag {lag}", ""]
        if lag in near:
            lines += [f"Within {100 * NEAR_BEST:.0f} point of the best last accuracy "
                      f"({100 * near[lag]['best_last_accuracy']:.1f}), so run on seeds 0-4: "
                      f"{', '.join(near[lag]['recipes'])}.", ""]  # fmt: skip
        lines += ["| row | seeds | best acc | last acc | best at the last evaluation | collapsed (at step) | d̄π | "
                  "Δ last vs grpo | Δ last vs gspo | Δ best vs grpo | Δ best vs gspo | s / optimizer step |",
                  "|---" * 12 + "|"]  # fmt: skip
        for r in (r for r in view["rows"] if r["lag"] == lag):
            lines.append(f"| {r['recipe']} | {r['seeds']} | {pct(r['best_accuracy'], r['best_accuracy_se'])} | "
                         f"{pct(r['last_accuracy'], r['last_accuracy_se'])} | {r['rising']}/{r['seeds']} | "
                         f"{r['collapsed']}/{r['seeds']} "
                         f"({_steps(r['collapse_steps'])}) | {num(r['last_epoch_mismatch'])} | "
                         f"{delta(r, 'grpo', 'last_accuracy')} | {delta(r, 'gspo', 'last_accuracy')} | "
                         f"{delta(r, 'grpo', 'best_accuracy')} | {delta(r, 'gspo', 'best_accuracy')} | "
                         f"{num(r['seconds_per_optimizer_step'], 2)} |")  # fmt: skip
        lines.append("")
    return lines


def plot_frontier(out: Path, view: dict) -> None:
    """``frontier.png``: last accuracy at the end of the run against the paper's lag (log scale), mean ± standard
    error over seeds, one line per row; collapsed runs marked."""
    if not view["rows"]:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for i, f in enumerate(view["frontiers"]):
        mine = sorted((r for r in view["rows"] if (r["recipe"], r["settings"]) == (f["recipe"], f["settings"])),
                      key=lambda r: r["lag"])  # fmt: skip
        lags = [r["lag"] for r in mine]
        style = "-" if FAMILY.get(f["recipe"]) == "grpo" else "--"
        ax.errorbar(lags, [100 * r["last_accuracy"] for r in mine],
                    yerr=[100 * (r["last_accuracy_se"] or 0.0) for r in mine], linestyle=style, marker="o",
                    capsize=3, color=plt.cm.tab20(i % 20), label=f["recipe"])  # fmt: skip
        for r in mine:
            if r["collapsed"]:
                ax.annotate(f"{r['collapsed']}/{r['seeds']} collapsed", (r["lag"], 100 * r["last_accuracy"]),
                            fontsize=7, textcoords="offset points", xytext=(4, -10))  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set(xlabel="paper lag n (optimizer steps per weight broadcast)", ylabel="last test accuracy, avg@k (%)",
           title="the staleness frontier: accuracy at the end of the run against lag")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "frontier.png", dpi=110)
    plt.close(fig)
