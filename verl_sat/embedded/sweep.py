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
"""``verl-sat sweep``: recipes x lags x seeds with the embedded engine, aggregated into the paper's Table 1 shape.

Each cell is one ``verl-sat train`` process (run name ``<sweep>/<recipe>-lag<L>-s<seed>`` under ``WORKDIR/runs``),
so a failing cell does not stop the others and a re-run skips finished cells and resumes unfinished ones. Output in
``WORKDIR/sweeps/<sweep>/``: ``results.md``, ``results.json``, ``results.csv``, ``curves_lag{L}.png``,
``mismatch.png`` and one log per cell under ``logs/``.
"""

import csv
import io
import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from verl_sat.embedded import run_files
from verl_sat.recipe_catalog import PAPER_TABLE_1


@dataclass(frozen=True)
class Cell:
    recipe: str
    lag: int
    seed: int

    @property
    def name(self) -> str:
        return f"{self.recipe}-lag{self.lag}-s{self.seed}"

    def overrides(self, sweep: str) -> list[str]:
        """The paper's lag L: ``+lag=sync`` / ``+lag=lag1`` / ``+lag=lag8``; any other L is lag1 with
        ``parameter_sync_step=L``."""
        lag = {0: ["+lag=sync"], 1: ["+lag=lag1"], 8: ["+lag=lag8"]}.get(self.lag) or [
            "+lag=lag1",
            f"trainer.v1.separate_async.parameter_sync_step={self.lag}",
        ]
        return [
            f"+recipe={self.recipe}",
            *lag,
            f"data.seed={self.seed}",
            f"trainer.experiment_name={sweep}/{self.name}",
        ]


def run_dir(workdir: Path, sweep: str, cell: Cell) -> Path:
    return workdir / "runs" / sweep / cell.name


def finished(summary_path: Path) -> dict | None:
    """The summary of a finished run, else ``None``."""
    if not summary_path.is_file():
        return None
    summary = json.loads(summary_path.read_text())
    return summary if summary["steps_done"] >= summary["total_steps"] else None


def run_cell(workdir: Path, sweep: str, cell: Cell, overrides: list[str], threads: int) -> tuple[Cell, dict | None]:
    """Run (or resume) one cell in its own ``verl-sat train`` process; returns its summary (``None`` if it failed)."""
    summary = finished(run_dir(workdir, sweep, cell) / "summary.json")
    if summary is not None:
        return cell, summary
    logs = workdir / "sweeps" / sweep / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TQDM_MININTERVAL": "30"}
    command = [sys.executable, "-m", "verl_sat.cli", "train", "--workdir", str(workdir), *cell.overrides(sweep),
               *overrides]  # fmt: skip
    with (logs / f"{cell.name}.log").open("w") as log:
        log.write(" ".join(command) + "\n")
        log.flush()
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, check=False)
    return cell, finished(run_dir(workdir, sweep, cell) / "summary.json")


def sweep(workdir: str | Path, recipes: list[str], lags: list[int], seeds: list[int], overrides: list[str],
          name: str = "default", jobs: int = 1, progress: bool = True) -> Path:  # fmt: skip
    """Run every cell (``jobs`` at a time), then write the results and plots; returns the sweep folder."""
    workdir = Path(workdir)
    out = workdir / "sweeps" / name
    out.mkdir(parents=True, exist_ok=True)
    cells = [Cell(r, lag, s) for s in seeds for r in recipes for lag in lags]  # seed by seed: early seeds finish first
    threads = max(1, (os.cpu_count() or 1) // jobs)
    failed, summaries = [], {}
    with ThreadPoolExecutor(max_workers=jobs) as pool, tqdm(total=len(cells), desc=f"sweep {name}", unit="cell",
                                                            disable=not progress) as bar:  # fmt: skip
        futures = [pool.submit(run_cell, workdir, name, cell, overrides, threads) for cell in cells]
        for future in futures:
            cell, summary = future.result()
            bar.update()
            if summary is None:
                failed.append(cell)
                bar.write(f"{cell.name}: FAILED, see {out / 'logs' / (cell.name + '.log')}")
            else:
                summaries[cell] = summary
                bar.write(f"{cell.name}: {cell_line(summary)}")
    runs = {c: run_files.read_metrics(run_dir(workdir, name, c) / "metrics.jsonl") for c in summaries}
    rows = aggregate(summaries)
    command = ["verl-sat sweep", f"--workdir {workdir}", f"--name {name}", f"--recipes {','.join(recipes)}",
               f"--lags {','.join(map(str, lags))}", f"--seeds {','.join(map(str, seeds))}", *overrides]  # fmt: skip
    write_results(out, rows, " ".join(command), lags, failed)
    plot_sweep(out, runs, rows, recipes, lags)
    return out


def cell_line(summary: dict) -> str:
    return (f"best {summary['best_accuracy']:.3f} (step {summary['best_step']}), last {summary['last_accuracy']:.3f}, "
            f"collapsed {summary['collapsed']}, mismatch {summary['last_epoch_mismatch']:.4f}")  # fmt: skip


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error (sample standard deviation / sqrt(n); 0 for one value)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def aggregate(summaries: dict[Cell, dict]) -> list[dict]:
    """One row per (recipe, lag): best / last accuracy mean and standard error over seeds, collapse count,
    mean last-epoch mismatch."""
    rows = []
    for recipe, lag in dict.fromkeys((c.recipe, c.lag) for c in summaries):
        group = [s for c, s in summaries.items() if (c.recipe, c.lag) == (recipe, lag)]
        best, best_se = mean_se([s["best_accuracy"] for s in group])
        last, last_se = mean_se([s["last_accuracy"] for s in group])
        rows.append({
            "recipe": recipe, "lag": lag, "seeds": len(group), "best_accuracy": best, "best_accuracy_se": best_se,
            "last_accuracy": last, "last_accuracy_se": last_se,
            "collapsed": sum(s["collapsed"] for s in group),
            "last_epoch_mismatch": sum(s["last_epoch_mismatch"] for s in group) / len(group),
        })  # fmt: skip
    return rows


def write_results(out: Path, rows: list[dict], command: str, lags: list[int], failed: list[Cell]) -> None:
    """``results.json``, ``results.csv`` and ``results.md`` (our table, then the paper's, never mixed)."""
    run_files.write_atomic(out / "results.json", json.dumps({"command": command, "rows": rows}, indent=2))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]) if rows else ["recipe"])
    writer.writeheader()
    writer.writerows(rows)
    run_files.write_atomic(out / "results.csv", buffer.getvalue())
    by_key = {(r["recipe"], r["lag"]): r for r in rows}
    recipes = list(dict.fromkeys(r["recipe"] for r in rows))
    header = "| recipe | " + " | ".join(
        f"lag {lag}: best acc | lag {lag}: last acc | lag {lag}: collapsed | lag {lag}: mismatch" for lag in lags
    )
    lines = [
        "# Sweep results", "", f"Command: `{command}`", "",
        "Accuracy: test avg@k, mean ± standard error over seeds (in %). Collapsed: runs whose last accuracy is below "
        f"{run_files.COLLAPSE_RATIO} x their best. Mismatch: mean |log_prob - old_log_prob| of the last training "
        f"epoch, averaged over the last {run_files.MISMATCH_TAIL:.0%} of steps.", "",
        header + " |", "|---" * (1 + 4 * len(lags)) + "|",
    ]  # fmt: skip
    for recipe in recipes:
        cells = []
        for lag in lags:
            r = by_key.get((recipe, lag))
            if r is None:
                cells += ["-"] * 4
                continue
            cells += [f"{100 * r['best_accuracy']:.1f} ± {100 * r['best_accuracy_se']:.1f}",
                      f"{100 * r['last_accuracy']:.1f} ± {100 * r['last_accuracy_se']:.1f}",
                      f"{r['collapsed']}/{r['seeds']}", f"{r['last_epoch_mismatch']:.4f}"]  # fmt: skip
        lines.append(f"| {recipe} | " + " | ".join(cells) + " |")
    if failed:
        lines += ["", "Failed cells (see logs/): " + ", ".join(c.name for c in failed)]
    lines += ["", "Paper, Table 1 (Qwen3-30B-A3B-Base, AIME24 avg@8, one seed; for reference only):", "",
              "| recipe | lag 1 | lag 8 |", "|---|---|---|"]  # fmt: skip
    lines += [f"| {recipe} | {PAPER_TABLE_1[recipe].lag1:.2f} | {PAPER_TABLE_1[recipe].lag8:.2f}"
              f"{' then collapse' if PAPER_TABLE_1[recipe].collapses_at_lag8 else ''} |"
              for recipe in recipes if recipe in PAPER_TABLE_1]  # fmt: skip
    run_files.write_atomic(out / "results.md", "\n".join(lines) + "\n")


def plot_sweep(out: Path, runs: dict[Cell, list[dict]], rows: list[dict], recipes: list[str], lags: list[int]) -> None:
    """``curves_lag{L}.png``: accuracy against step, mean over seeds with a min-max band, one line per recipe;
    ``mismatch.png``: last-epoch mismatch per recipe, one bar per lag."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for lag in lags:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for recipe in recipes:
            curves = [[(run_files.optimizer_step(r), r[run_files.ACCURACY]) for r in records if run_files.ACCURACY in r]
                      for cell, records in runs.items() if (cell.recipe, cell.lag) == (recipe, lag)]  # fmt: skip
            curves = [c for c in curves if c]
            if not curves:
                continue
            steps = sorted(set.intersection(*(set(s for s, _ in c) for c in curves)))
            values = [[dict(c)[s] for c in curves] for s in steps]
            mean = [100 * sum(v) / len(v) for v in values]
            line = ax.plot(steps, mean, label=f"{recipe} ({len(curves)} seeds)")[0]
            ax.fill_between(steps, [100 * min(v) for v in values], [100 * max(v) for v in values],
                            color=line.get_color(), alpha=0.15)  # fmt: skip
        ax.set(
            xlabel="optimizer step",
            ylabel="test accuracy, avg@k (%)",
            title=f"lag {lag}: mean over seeds, band = min-max",
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"curves_lag{lag}.png", dpi=110)
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(len(lags), 1)
    for i, lag in enumerate(lags):
        heights = [next((r["last_epoch_mismatch"] for r in rows if (r["recipe"], r["lag"]) == (recipe, lag)), 0.0)
                   for recipe in recipes]  # fmt: skip
        ax.bar([x + i * width for x in range(len(recipes))], heights, width, label=f"lag {lag}")
    ax.set_xticks([x + width * (len(lags) - 1) / 2 for x in range(len(recipes))], recipes, rotation=20)
    ax.set(ylabel="mean |log_prob - old_log_prob|", title="last-epoch mismatch (mean over seeds)")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(out / "mismatch.png", dpi=110)
    plt.close(fig)
