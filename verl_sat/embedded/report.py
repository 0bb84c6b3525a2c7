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
"""The report of a set of sweep cells (``verl-sat sweep``, ``verl-sat report``): rows, paired statistics, tables and
plots, computed only from the cells' records (``verl_sat.embedded.sweep.make_record``).

A row is one (recipe, lag, settings), settings being the sweep's overrides and ``--optimizer-steps``; a paired entry
compares a SAT recipe with its base recipe on the seeds both ran with the same lag and settings (two-sided paired
t-test on the per-seed difference). Output in ``OUT/``:
``results.json`` (``command``, ``rows``, ``paired``), ``results.csv``, ``results.md``, ``curves_<lag>.png``,
``mismatch.png``, ``attribution.png``, when there are paired entries ``regime_map.png``, when the rows differ in
sequences per micro-batch (``actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu``) ``micro_batch.png`` with its
table in ``results.md``, and when they hold remedy rows with their ``gspo`` ``remedies.png`` with its tables
(``verl_sat.embedded.remedy_view``), and when they hold paper-lag rows at three lags or more ``frontier.png`` and
``frontier.json`` with its tables (``verl_sat.embedded.frontier``).
"""

import csv
import functools
import io
import json
from collections import Counter
from importlib.resources import files
from pathlib import Path

from omegaconf import OmegaConf

from verl_sat.embedded import frontier, remedy_view, run_files
from verl_sat.embedded.cell_stats import (
    aggregate,
    groups,
    holm_best_and_last,
    lag_label,
    mean_or_none,
    num,
    p_text,
    paired_differences,
    pct,
)
from verl_sat.recipe_catalog import PAPER_TABLE_1

# SAT recipe -> the recipe it changes only by its loss
SAT_BASE = {"sat_grpo": "grpo", "sat_gspo": "gspo", "sat_grpo_r3": "grpo_r3", "sat_gspo_r3": "gspo_r3",
            "sat_gspo_token": "gspo", "sat_gspo_token_r3": "gspo_r3", "sat_gspo_ratio_side": "gspo",
            "sat_gspo_carried": "gspo"}  # fmt: skip
# overrides of these keys (SAT's knobs) change a SAT row only; its base row is the one without them
SAT_KEY_PREFIX = "actor_rollout_ref.actor.policy_loss.sat."
MICRO_BATCH_KEY = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"


def base_settings(settings_: tuple[str, ...]) -> tuple[str, ...]:
    """The settings a SAT row's base row is matched on: its own, less the SAT knobs (overrides of
    ``SAT_KEY_PREFIX`` keys), which the base recipe does not have."""
    return tuple(s for s in settings_ if not s.lstrip("+~").startswith(SAT_KEY_PREFIX))


def paired(records: list[dict]) -> list[dict]:
    """One entry per SAT recipe against its base recipe, per lag and settings (the base on ``base_settings``), on the
    seeds both have: the mean per-seed difference of best and of last accuracy, the paired t-test's p-value, its
    Holm adjustment over every entry's best and last test (``p_holm``, ``last_p_holm``), and SAT's wins."""
    by_key = groups(records)
    entries = []
    for (recipe, regime, lag, settings_), group in by_key.items():
        base_group = by_key.get((SAT_BASE.get(recipe), regime, lag, base_settings(settings_)))
        if base_group is None:
            continue
        base_by_seed = {r["cell"]["seed"]: r["summary"] for r in base_group}
        pairs = [(r["summary"], base_by_seed[r["cell"]["seed"]]) for r in group if r["cell"]["seed"] in base_by_seed]
        entry = {"recipe": recipe, "base": SAT_BASE[recipe], "lag": lag, "lag_regime": "sync" if lag == 0 else regime,
                 "lag_label": lag_label(regime, lag), "settings": list(settings_),
                 "seeds": sorted(r["cell"]["seed"] for r in group if r["cell"]["seed"] in base_by_seed),
                 **paired_differences(pairs)}  # fmt: skip
        entry["q_over_radius"] = mean_or_none([sat.get("last_q_over_radius") for sat, _ in pairs])
        entry["intercepted_frac"] = mean_or_none([sat.get("last_intercepted_frac") for sat, _ in pairs])
        entries.append(entry)
    holm_best_and_last(entries)
    return entries


def write_report(out: Path, records: list[dict], commands: list[str], failed: list[str] = ()) -> None:
    """Everything in the module docstring, from ``records``."""
    out.mkdir(parents=True, exist_ok=True)
    rows, pairs = aggregate(records), paired(records)
    results = {"command": commands, "rows": rows, "paired": pairs}
    run_files.write_atomic(out / "results.json", json.dumps(results, indent=2) + "\n")
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]) if rows else ["recipe"])
    writer.writeheader()
    writer.writerows(rows)
    run_files.write_atomic(out / "results.csv", buffer.getvalue())
    remedies = remedy_view.remedy_view(records)
    staleness = frontier.frontier_view(records)
    if staleness["rows"]:
        run_files.write_atomic(out / "frontier.json", json.dumps(staleness, indent=2) + "\n")
    markdown = results_markdown(rows, pairs, commands, failed, remedies, frontier.frontier_markdown(staleness),
                                model_lines(records))  # fmt: skip
    run_files.write_atomic(out / "results.md", markdown)
    plot_report(out, records, rows, pairs)
    plot_micro_batch(out, rows, pairs)
    remedy_view.plot_remedies(out, remedies)
    frontier.plot_frontier(out, staleness)


def model_lines(records: list[dict]) -> list[str]:
    """The prepared models that trained the cells (``model_sha256``, 16 hex digits) and their cell counts; nothing
    where no record names its model (records made before they did)."""
    counts = Counter(record.get("model_sha256") for record in records)
    if set(counts) <= {None}:
        return []
    parts = [f"`{model[:16]}` ({_cells(n)})" for model, n in sorted((m, n) for m, n in counts.items() if m)]
    if None in counts:
        parts.append(f"not named ({_cells(counts[None])}, made before records named their model)")
    return [f"Prepared model (`model_sha256` of `verl-sat prepare`): {', '.join(parts)}.", ""]


def _cells(n: int) -> str:
    return f"{n} cell" if n == 1 else f"{n} cells"


def results_markdown(rows: list[dict], pairs: list[dict], commands: list[str], failed: list[str] = (),
                     remedies: list[dict] = (), frontier_lines: list[str] = (),
                     models: list[str] = ()) -> str:  # fmt: skip
    """Our table (one per lag and settings), the paired comparisons, the micro-batch, remedy and staleness-frontier
    views where the rows have them, then the paper's Table 1, never mixed; ``models``: ``model_lines``."""
    lines = ["# Sweep results", "", "Commands:", "", "```bash", *commands, "```", "", *models,
             "Accuracy: test avg@k, mean ± standard error over seeds (in %). Collapsed: runs whose last accuracy is "
             f"below {run_files.COLLAPSE_RATIO} x their best. Every other column is the seed mean of the run's mean "
             f"over its last {run_files.MISMATCH_TAIL:.0%} of steps: d̄π = mean |log π - log μ| of the last training "
             "epoch (Eq. 52), gate = SAT's gate rate, intercepted = tokens SAT clips that the nominal interval "
             "would not, q/ε = SAT's tail quantile over the upper radius, Δπ and Δimpl = the mean absolute value of "
             "each part of the split of Eq. 2 (policy lag, engine). '-': not logged by the recipe (SAT's metrics) "
             "or not run.", ""]  # fmt: skip
    tables: dict[tuple, list[dict]] = {}
    for row in rows:
        tables.setdefault((row["lag_label"], tuple(row["settings"])), []).append(row)
    for (label, settings_), group in tables.items():
        extra = f", settings `{' '.join(settings_)}`" if settings_ else ""
        lines += [f"## {label} ({group[0]['lag_regime']} lag{extra})", "",
                  "| recipe | seeds | best acc | last acc | collapsed | d̄π | gate | intercepted | q/ε | Δπ | Δimpl |",
                  "|---" * 11 + "|"]  # fmt: skip
        lines += [f"| {r['recipe']} | {r['seeds']} | {pct(r['best_accuracy'], r['best_accuracy_se'])} | "
                  f"{pct(r['last_accuracy'], r['last_accuracy_se'])} | {r['collapsed']}/{r['seeds']} | "
                  f"{num(r['last_epoch_mismatch'])} | {num(r['gate_rate'], 3)} | {num(r['intercepted_frac'])} | "
                  f"{num(r['q_over_radius'], 3)} | {num(r['policy_lag_abs_mean'])} | {num(r['engine_abs_mean'])} |"
                  for r in group]  # fmt: skip
        lines.append("")
    if pairs:
        lines += ["## SAT against its base recipe, paired by seed", "",
                  "Difference SAT - base in accuracy points, mean over the seeds both ran; p: two-sided paired t-test "
                  "('-' where the seeds' differences do not vary: no test), then Holm-adjusted over every test of "
                  "this table (best and last of each row) in parentheses; "
                  "wins/losses: seeds where SAT is above/below.", "",
                  "| SAT recipe | base | lag | settings | seeds | Δ best | p (Holm) | wins/losses | Δ last | p (Holm) "
                  "| q/ε |",
                  "|---" * 11 + "|"]  # fmt: skip
        lines += [f"| {e['recipe']} | {e['base']} | {e['lag_label']} | {' '.join(e['settings']) or '-'} | "
                  f"{len(e['seeds'])} | {100 * e['mean_diff']:+.1f} | {p_text(e['p_value'])} ({p_text(e['p_holm'])}) | "
                  f"{e['wins']}/{e['losses']} | {100 * e['last_mean_diff']:+.1f} | {p_text(e['last_p_value'])} "
                  f"({p_text(e['last_p_holm'])}) | {num(e['q_over_radius'], 3)} |"
                  for e in pairs]  # fmt: skip
        lines.append("")
    lines += micro_batch_markdown(rows, pairs)
    lines += remedy_view.remedy_markdown(remedies)
    lines += frontier_lines
    if failed:
        lines += ["Failed cells (see the sweep's logs/): " + ", ".join(failed), ""]
    recipes = list(dict.fromkeys(r["recipe"] for r in rows))
    lines += ["## Paper, Table 1 (for reference only)", "",
              "Qwen3-30B-A3B-Base, AIME24 avg@8 best checkpoint, one seed per cell:", "",
              "| recipe | lag 1 | lag 8 |", "|---|---|---|"]  # fmt: skip
    lines += [f"| {recipe} | {PAPER_TABLE_1[recipe].lag1:.2f} | {PAPER_TABLE_1[recipe].lag8:.2f}"
              f"{' then collapse' if PAPER_TABLE_1[recipe].collapses_at_lag8 else ''} |"
              for recipe in recipes if recipe in PAPER_TABLE_1]  # fmt: skip
    return "\n".join(lines) + "\n"


@functools.cache
def default_micro_batch_size() -> int:
    """The embedded engine's ``ppo_micro_batch_size_per_gpu`` (``recipes/embedded/default.yaml``)."""
    preset = files("verl_sat.recipes").joinpath("embedded", "default.yaml").read_text()
    return int(OmegaConf.create(preset).actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu)


def micro_batch_size(settings_: list[str] | tuple[str, ...]) -> int:
    """Sequences per micro-batch of a row: its ``MICRO_BATCH_KEY`` override, else the engine's default."""
    for setting in settings_:
        key, _, value = setting.lstrip("+").partition("=")
        if key == MICRO_BATCH_KEY:
            return int(value)
    return default_micro_batch_size()


def _without_micro_batch(settings_) -> tuple[str, ...]:
    return tuple(s for s in settings_ if s.lstrip("+").partition("=")[0] != MICRO_BATCH_KEY)


def micro_batch_view(rows: list[dict], pairs: list[dict]) -> list[dict]:
    """When the rows span several micro-batch sizes: one entry per (lag, micro-batch size, row), the row's accuracy
    and SAT diagnostics with, for a SAT row, its paired difference to the base row at the same size; sorted by lag,
    size (largest first) and recipe. Empty otherwise."""
    if len({micro_batch_size(r["settings"]) for r in rows}) < 2:
        return []
    by_row = {(p["recipe"], p["lag_label"], tuple(p["settings"])): p for p in pairs}
    common = set.intersection(*(set(_without_micro_batch(r["settings"])) for r in rows))
    view = []
    for row in rows:
        pair = by_row.get((row["recipe"], row["lag_label"], tuple(row["settings"])))
        view.append({
            "lag_label": row["lag_label"], "micro_batch": micro_batch_size(row["settings"]),
            "label": _row_label((row["recipe"], _without_micro_batch(row["settings"])), common), "row": row,
            "pair": pair,
        })  # fmt: skip
    return sorted(view, key=lambda v: (v["lag_label"], -v["micro_batch"], v["row"]["recipe"], v["label"]))


def micro_batch_markdown(rows: list[dict], pairs: list[dict]) -> list[str]:
    """The table of ``micro_batch_view``, one per lag."""
    view = micro_batch_view(rows, pairs)
    lines = []
    for label in dict.fromkeys(v["lag_label"] for v in view):
        lines += [f"## Sequences per micro-batch ({label})", "",
                  "The optimizer step is the same at every size; only the sequences per forward/backward, and so per "
                  "SAT quantile, change. Δ: SAT row - base row at the same size, paired by seed (p: two-sided paired "
                  "t-test, '-' where the seeds' differences do not vary: no test; in brackets Holm-adjusted over "
                  "every test of the paired comparisons). empty: micro-batches whose gate could not act "
                  "(actor/sat_structurally_empty_frac).", "",
                  "| seqs / micro-batch | row | seeds | best acc | last acc | Δ best (p (Holm), wins/losses) "
                  "| Δ last (p (Holm)) "
                  "| gate | empty | intercepted | d̄π |", "|---" * 11 + "|"]  # fmt: skip
        for v in (v for v in view if v["lag_label"] == label):
            r, e = v["row"], v["pair"]
            delta = "-" if e is None else (f"{100 * e['mean_diff']:+.1f} ({p_text(e['p_value'])} "
                                           f"({p_text(e['p_holm'])}), {e['wins']}/{e['losses']})")  # fmt: skip
            delta_last = "-" if e is None else (f"{100 * e['last_mean_diff']:+.1f} ({p_text(e['last_p_value'])} "
                                                f"({p_text(e['last_p_holm'])}))")  # fmt: skip
            lines.append(f"| {v['micro_batch']} | {v['label']} | {r['seeds']} | "
                         f"{pct(r['best_accuracy'], r['best_accuracy_se'])} | "
                         f"{pct(r['last_accuracy'], r['last_accuracy_se'])} | {delta} | {delta_last} | "
                         f"{num(r['gate_rate'], 3)} | {num(r['structurally_empty'], 2)} | "
                         f"{num(r['intercepted_frac'])} | {num(r['last_epoch_mismatch'])} |")  # fmt: skip
        lines.append("")
    return lines


def _row_label(row_key: tuple, common: set[str]) -> str:
    """``recipe`` and its settings beyond ``common`` (those every row has), each override by its last key part:
    ``sat_grpo clip_ratio_low=0.05 clip_ratio_high=0.05``."""
    recipe, settings_ = row_key
    return " ".join([recipe, *(_short_override(s) for s in settings_ if s not in common)])


def _short_override(override: str) -> str:
    """``a.b.key=value`` -> ``key=value``; anything else (``--optimizer-steps 120``) as is."""
    key, equals, value = override.partition("=")
    return f"{key.rsplit('.', 1)[-1]}{equals}{value}"


def _mean_curve(curves: list[list[list]], column: int) -> tuple[list, list, list, list]:
    """Steps every curve has, and the mean, min and max of ``column`` over the curves at those steps."""
    tables = [{point[0]: point[column] for point in curve if point[column] is not None} for curve in curves]
    steps = sorted(set.intersection(*(set(t) for t in tables))) if tables else []
    values = [[t[s] for t in tables] for s in steps]
    return steps, [sum(v) / len(v) for v in values], [min(v) for v in values], [max(v) for v in values]


def _line_style(row_key: tuple) -> dict:
    """A SAT row solid and thicker, its base row dashed: the pair shares a hue (tab20's dark and light) and differs at
    a glance."""
    return {"linestyle": "-", "linewidth": 2.0} if row_key[0].startswith("sat_") else {"linestyle": "--"}


def plot_report(out: Path, records: list[dict], rows: list[dict], pairs: list[dict]) -> None:
    """``curves_<lag>.png`` (accuracy, mean over seeds, min-max band), ``mismatch.png`` (d̄π per row),
    ``attribution.png`` (|Δπ| and |Δimpl| over training) and ``regime_map.png`` (SAT's paired gain and intercepted
    fraction against q/ε)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    common = set.intersection(*(set(r["settings"]) for r in rows)) if rows else set()
    labels = list(dict.fromkeys(r["lag_label"] for r in rows))
    by_label: dict[str, dict[tuple, list[dict]]] = {}
    for (recipe, regime, lag, settings_), group in groups(records).items():
        by_label.setdefault(lag_label(regime, lag), {})[(recipe, settings_)] = group

    colors = {key: plt.cm.tab20(i % 20) for i, key in enumerate(dict.fromkeys((r["recipe"], tuple(r["settings"]))
                                                                            for r in rows))}  # fmt: skip

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)

    for label in labels:
        fig, ax = plt.subplots(figsize=(9, 5))
        for row_key, group in by_label.get(label, {}).items():
            steps, mean, low, high = _mean_curve([r["accuracy"] for r in group], 1)
            ax.plot(steps, [100 * v for v in mean], label=f"{_row_label(row_key, common)} ({len(group)})",
                    color=colors[row_key], **_line_style(row_key))  # fmt: skip
            ax.fill_between(steps, [100 * v for v in low], [100 * v for v in high], color=colors[row_key], alpha=0.1)
        ax.set(xlabel="optimizer step", ylabel="test accuracy, avg@k (%)",
               title=f"{label}: mean over seeds (count in brackets), band = min-max")  # fmt: skip
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        save(fig, f"curves_{label}.png")

    row_keys = list(dict.fromkeys((r["recipe"], tuple(r["settings"])) for r in rows))
    fig, ax = plt.subplots(figsize=(max(8, 0.7 * len(row_keys)), 4.5))
    width = 0.8 / max(len(labels), 1)
    for i, label in enumerate(labels):
        values = {(r["recipe"], tuple(r["settings"])): r["last_epoch_mismatch"] or 0.0 for r in rows
                  if r["lag_label"] == label}  # fmt: skip
        ax.bar([x + i * width for x in range(len(row_keys))], [values.get(k, 0.0) for k in row_keys], width,
               label=label)  # fmt: skip
    ax.set_xticks([x + width * (len(labels) - 1) / 2 for x in range(len(row_keys))],
                  [_row_label(k, common) for k in row_keys], rotation=30, ha="right", fontsize=8)  # fmt: skip
    ax.set(ylabel="d̄π = mean |log π - log μ|", title="last-epoch mismatch (mean over seeds)")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    save(fig, "mismatch.png")

    fig, axes = plt.subplots(2, len(labels), figsize=(max(8, 6 * len(labels)), 8), squeeze=False, sharey="row")
    for col, label in enumerate(labels):
        for row_key, group in by_label.get(label, {}).items():
            for ax_row, (column, part) in enumerate(((2, "|Δπ| policy lag"), (3, "|Δimpl| engine"))):
                steps, mean, _, _ = _mean_curve([r["split"] for r in group], column)
                axes[ax_row][col].plot(steps, mean, label=_row_label(row_key, common), color=colors[row_key],
                                       **_line_style(row_key))  # fmt: skip
                axes[ax_row][col].set(title=f"{label}: {part}", xlabel="optimizer step")
        for ax in axes[:, col]:
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.suptitle("staleness attribution d = Δπ + Δimpl (Eq. 2)\nmean |.| over the last epoch, mean over seeds")
    save(fig, "attribution.png")

    points = [e for e in pairs if e["q_over_radius"] is not None]
    if points:
        # one colour per row; with several settings, one per SAT recipe
        per_recipe = len({tuple(r["settings"]) for r in rows}) > 1
        sat_recipes = dict.fromkeys(e["recipe"] for e in points)
        recipe_colors = {recipe: plt.cm.tab10(i % 10) for i, recipe in enumerate(sat_recipes)}
        fig, (gain, frac) = plt.subplots(1, 2, figsize=(12, 4.5))
        for e in points:
            text = f"{_row_label((e['recipe'], e['settings']), common)} {e['lag_label']}"
            color = recipe_colors[e["recipe"]] if per_recipe else colors[(e["recipe"], tuple(e["settings"]))]
            for ax, y in ((gain, 100 * e["mean_diff"]), (frac, e["intercepted_frac"])):
                ax.scatter(e["q_over_radius"], y, color=color)
                ax.annotate(text, (e["q_over_radius"], y), fontsize=6)
        gain.axhline(0, color="gray", lw=0.8)
        gain.set(xlabel="q / ε (SAT's tail quantile over the radius)", ylabel="SAT - base, best accuracy (points)",
                 title="paired gain of SAT (mean over seeds)")  # fmt: skip
        frac.set(xlabel="q / ε", ylabel="intercepted fraction", title="tokens SAT clips and the interval would not")
        for ax in (gain, frac):
            ax.grid(alpha=0.3)
        if per_recipe:
            for recipe, color in recipe_colors.items():
                gain.scatter([], [], color=color, label=recipe)
            gain.legend(fontsize=8)
        save(fig, "regime_map.png")


def plot_micro_batch(out: Path, rows: list[dict], pairs: list[dict]) -> None:
    """``micro_batch.png``: per SAT row, its paired gain (best and last accuracy, mean ± standard error over seeds)
    and its gate rate and structurally empty fraction against sequences per micro-batch (log scale)."""
    view = [v for v in micro_batch_view(rows, pairs) if v["pair"] is not None]
    if not view:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (best, last, gate) = plt.subplots(1, 3, figsize=(15, 4.5))
    series = dict.fromkeys((v["lag_label"], v["label"]) for v in view)
    for i, key in enumerate(series):
        points = sorted((v for v in view if (v["lag_label"], v["label"]) == key), key=lambda v: v["micro_batch"])
        sizes = [v["micro_batch"] for v in points]
        color, text = plt.cm.tab10(i % 10), f"{key[1]} ({key[0]})"
        for ax, prefix in ((best, ""), (last, "last_")):
            ax.errorbar(sizes, [100 * v["pair"][f"{prefix}mean_diff"] for v in points],
                        yerr=[100 * (v["pair"][f"{prefix}diff_se"] or 0.0) for v in points], color=color,
                        marker="o", capsize=3, label=text)  # fmt: skip
        gate.plot(sizes, [v["row"]["gate_rate"] for v in points], color=color, marker="o", label=f"{text}: gate rate")
        empty = [(s, v["row"]["structurally_empty"]) for s, v in zip(sizes, points, strict=True)
                 if v["row"]["structurally_empty"] is not None]  # fmt: skip
        if empty:
            gate.plot(*zip(*empty, strict=True), color=color, marker="x", linestyle="--",
                      label=f"{text}: structurally empty")  # fmt: skip
    for ax, title in ((best, "SAT - base, best accuracy (points)"), (last, "SAT - base, last accuracy (points)"),
                      (gate, "gate rate / structurally empty micro-batches")):  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set(xlabel="sequences per micro-batch", title=title)
        ax.grid(alpha=0.3)
        if ax is not gate:
            ax.axhline(0, color="gray", lw=0.8)
    best.legend(fontsize=7)
    gate.legend(fontsize=6)
    fig.suptitle("SAT's paired gain against sequences per micro-batch (mean ± standard error over seeds)")
    fig.tight_layout()
    fig.savefig(out / "micro_batch.png", dpi=110)
    plt.close(fig)
