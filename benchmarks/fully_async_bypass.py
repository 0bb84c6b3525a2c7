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
"""verl issue #7356 on this CPU: GSPO in bypass mode against SAT-GSPO on verl's fully-async trainer (docs/cpu.md).
Not in CI (about 15 minutes per run on 2 cores).

Both rows are the paper's Table 9 recipes (``+recipe=gspo``: GSPO with verl's rollout correction in bypass mode, the
rollout's log-probs as the old policy; ``+recipe=sat_gspo``: the same plus SAT) with GSPO's own clip radii
(``+radii=gspo``: 3e-4 / 4e-4, the issue's), at the paper's lag (``+lag=lag8``: 8 optimizer steps per weight
broadcast), through ``python -m verl_sat.main --config-name
fully_async_ppo_trainer ... trainer.device=cpu +cpu=e2e`` (verl's rollouter, message queue and trainer, vLLM's CPU
build), with the sizes of ``make e2e``'s fully-async run. verl's fully-async trainer logs once per weight version,
each metric aggregated over the version's 8 trainer steps (its ``MetricsAggregator``), keyed by the version's last
trainer step. Writes, per logged version and run, verl's ``actor/pg_clipfrac``, the reward, the mismatch d_pi
(Eq. 52), SAT's diagnostics and the staleness counts to ``OUT/steps.csv``, the side-by-side plot
``OUT/fully_async_bypass.png``, and prints a markdown table.

    python benchmarks/fully_async_bypass.py --workdir verl_sat_work --steps 480 --out docs/images/fully_async_bypass
"""

import argparse
import csv
import statistics
from pathlib import Path

from verl_sat.cpu.e2e import FULLY_ASYNC, REWARD_METRICS, SAT_METRICS, E2ERun, run_e2e
from verl_sat.embedded.prepare import check_prepared
from verl_sat.mismatch import MISMATCH_METRIC

RECIPES = ("gspo", "sat_gspo")  # GSPO in bypass mode (Table 9), and SAT-GSPO
LAG = "lag8"
RADII = "+radii=gspo"  # GSPO's clip radii 3e-4 / 4e-4, as in verl #7356
CLIP = "actor/pg_clipfrac"
REWARD = REWARD_METRICS[0]
STALE = "fully_async/count/stale_trajectory_processed"  # cumulative trajectories trained one version or more old
VERSION = "fully_async/count/current_param_version"
COLUMNS = (CLIP, REWARD, MISMATCH_METRIC, *SAT_METRICS[:3], STALE, VERSION)


def runs(steps: int) -> tuple[E2ERun, ...]:
    return tuple(
        E2ERun("fully_async", f"{recipe}-{LAG}-bypass", (*FULLY_ASYNC, f"+recipe={recipe}", f"+lag={LAG}", RADII),
               steps, False, (CLIP, REWARD, MISMATCH_METRIC, *(SAT_METRICS if recipe.startswith("sat_") else ())),
               staleness=None)
        for recipe in RECIPES
    )  # fmt: skip


def write_csv(path: Path, results: dict[str, dict]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["run", "step", *COLUMNS])
        for name, result in results.items():
            for step, metrics in sorted(result["steps"].items()):
                writer.writerow([name, step, *(metrics.get(key, "") for key in COLUMNS)])


def _mean(values: list[float]) -> str:
    return f"{statistics.fmean(values):.4f}" if values else "-"


def table(results: dict[str, dict]) -> str:
    """Per run: logged versions, wall time, and the mean of each column over the first and the second half of the
    logged versions, and its last value."""
    lines = ["| run | versions logged | wall time | metric | first half | second half | last |", "|---" * 7 + "|"]
    for name, result in results.items():
        steps = [result["steps"][s] for s in sorted(result["steps"])]
        half = len(steps) // 2
        for key in COLUMNS:
            values = [m[key] for m in steps if key in m]
            if not values:
                continue
            first = [m[key] for m in steps[:half] if key in m]
            second = [m[key] for m in steps[half:] if key in m]
            lines.append(f"| {name} | {len(steps)} | {result['seconds']:.0f} s | `{key}` | {_mean(first)} | "
                         f"{_mean(second)} | {values[-1]:.4f} |")  # fmt: skip
    return "\n".join(lines)


def plot(path: Path, results: dict[str, dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = ((CLIP, "actor/pg_clipfrac"), (REWARD, "reward (critic/score/mean)"),
              (MISMATCH_METRIC, "d̄π = mean |log π - log μ|"), (SAT_METRICS[0], "SAT gate rate"),
              (SAT_METRICS[2], "SAT intercepted fraction"))  # fmt: skip
    colors = {name: f"C{i}" for i, name in enumerate(results)}  # a run keeps its colour in every panel
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8))
    for ax, (key, title) in zip(axes, panels, strict=True):
        for name, result in results.items():
            points = [(step, m[key]) for step, m in sorted(result["steps"].items()) if key in m]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", markersize=2, label=name, color=colors[name])
        ax.set(title=title, xlabel="trainer step (= optimizer step; a point per weight version)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("verl fully-async trainer on the CPU, paper lag 8: GSPO in bypass mode against SAT-GSPO")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default="verl_sat_work", type=Path)
    parser.add_argument("--steps", default=480, type=int, help="trainer steps per run (one optimizer step each)")
    parser.add_argument(
        "--out", default=Path("fully_async_bypass"), type=Path, help="folder for steps.csv and the plot"
    )
    args = parser.parse_args()
    check_prepared(args.workdir)
    args.out.mkdir(parents=True, exist_ok=True)
    results = run_e2e(args.workdir, runs(args.steps), out=args.workdir / "fully_async_bypass")
    write_csv(args.out / "steps.csv", results)
    plot(args.out / "fully_async_bypass.png", results)
    print(table(results))


if __name__ == "__main__":
    main()
