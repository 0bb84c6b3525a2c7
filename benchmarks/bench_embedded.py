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
"""Embedded engine throughput and memory at the default config: lag 0, paper lag 1 and paper lag 8 side by side,
then the cost of each remedy row.

Each lag trains ``+recipe=sat_gspo_r3`` for the same number of optimizer steps (16 prompts x 8 responses each; a
paper-lag-8 trainer step holds 8 of them), without evaluation or checkpoints, in its own process so that its peak
resident memory is its own. Printed per lag: optimizer steps/s, trainer tokens/s, seconds of generation per batch,
peak RSS, and the cost of the staleness attribution (the no-grad forward of the sampling version's fp32 weights,
timed inside every step) as a share of the step. Then ``gspo``, ``sat_gspo`` and every remedy row at paper lag 8, the
same way, in ``--rounds`` rounds that each run every row once (so that a slow spell of the machine hits every row):
seconds per optimizer step, its median over the rounds with min..max, and the median's ratio to ``gspo``'s (the rows
in decoupled mode pay verl's extra ``old_log_prob`` forward per batch). Prepares ``--workdir`` first if needed.

    python benchmarks/bench_embedded.py [--workdir verl_sat_work] [--optimizer-steps 48] [--device cpu|cuda]
        [--rounds 3] [--no-remedies]
"""

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import time

from verl_sat.embedded import run_files
from verl_sat.embedded.prepare import WorkdirError, check_prepared, prepare
from verl_sat.embedded.run_config import compose_train_config
from verl_sat.embedded.train import train
from verl_sat.recipe_catalog import REMEDY_ROWS

LAGS = {"sync": "lag 0", "lag1": "paper lag 1", "lag8": "paper lag 8"}
LAG_RECIPE = "sat_gspo_r3"  # the recipe of the lag table
REMEDY_LAG = "lag8"  # the lag of the remedy table
REMEDY_TABLE = ("gspo", "sat_gspo", *REMEDY_ROWS)  # gspo first: the ratios' denominator


def timed_run(workdir: str, recipe: str, lag: str, optimizer_steps: int, device: str) -> dict:
    """Train one recipe and lag in this process; the measured row."""
    name = f"bench-{recipe}-{lag}"
    shutil.rmtree(f"{workdir}/runs/{name}", ignore_errors=True)
    overrides = [f"+recipe={recipe}", f"+lag={lag}", "trainer.test_freq=-1", "trainer.val_before_train=false",
                 "trainer.save_freq=-1", f"trainer.device={device}", f"trainer.experiment_name={name}"]  # fmt: skip
    per_step = compose_train_config(workdir, overrides)[1].schedule.sync_steps
    if optimizer_steps % per_step:
        raise SystemExit(f"--optimizer-steps={optimizer_steps} must be a multiple of {per_step} ({LAGS[lag]})")
    config, settings = compose_train_config(
        workdir, [*overrides, f"trainer.total_training_steps={optimizer_steps // per_step}"]
    )
    start = time.perf_counter()
    train(config, settings, progress=False)
    wall = time.perf_counter() - start
    records = [r for r in run_files.read_metrics(settings.run_dir / "metrics.jsonl") if r["step"] > 0]
    loop = sum(r["timing/step_s"] for r in records)  # trainer loop only: no loading, no final evaluation
    tokens = sum(r["perf/tokens_per_s"] * r["timing/step_s"] for r in records)
    shutil.rmtree(settings.run_dir)
    return {
        "recipe": recipe, "lag": lag, "trainer_steps": len(records), "wall_s": wall, "loop_s": loop,
        "optimizer_steps_per_s": optimizer_steps / loop, "tokens_per_s": tokens / loop,
        "gen_s_per_batch": sum(r["timing/gen_s"] for r in records) / len(records),
        "attribution_share": sum(r["timing/attribution_s"] for r in records) / loop,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="verl_sat_work")
    parser.add_argument("--optimizer-steps", type=int, default=48)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-remedies", action="store_true", help="skip the remedy rows' table")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the remedy rows (each row once per round)")
    parser.add_argument("--one", nargs=2, metavar=("RECIPE", "LAG"), help=argparse.SUPPRESS)  # a child process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(timed_run(args.workdir, *args.one, args.optimizer_steps, args.device)))
        return
    try:
        check_prepared(args.workdir)
    except WorkdirError:
        prepare(args.workdir)

    def measure(recipe: str, lag: str) -> dict:
        command = [sys.executable, __file__, "--workdir", args.workdir, "--optimizer-steps", str(args.optimizer_steps),
                   "--device", args.device, "--one", recipe, lag]  # fmt: skip
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    rows = [measure(LAG_RECIPE, lag) for lag in LAGS]
    print(f"embedded engine, {LAG_RECIPE}, default config, {args.optimizer_steps} optimizer steps of 16 x 8 sequences "
          f"per lag, device {args.device}")  # fmt: skip
    print(f"{'lag':<12} {'trainer steps':>13} {'opt steps/s':>11} {'tokens/s':>9} {'gen s/batch':>11} "
          f"{'peak RSS MB':>11} {'attribution':>11}")  # fmt: skip
    for r in rows:
        print(f"{LAGS[r['lag']]:<12} {r['trainer_steps']:>13} {r['optimizer_steps_per_s']:>11.2f} "
              f"{r['tokens_per_s']:>9.0f} {r['gen_s_per_batch']:>11.2f} {r['peak_rss_mb']:>11.0f} "
              f"{r['attribution_share']:>10.1%}")  # fmt: skip
    sync, lag1, lag8 = rows
    print(
        f"loop-time ratio lag 0 / paper lag 1 (same optimizer steps): {sync['loop_s'] / lag1['loop_s']:.2f}x; "
        f"lag 0 / paper lag 8: {sync['loop_s'] / lag8['loop_s']:.2f}x"
    )
    if args.no_remedies:
        return
    rounds = [[measure(recipe, REMEDY_LAG) for recipe in REMEDY_TABLE] for _ in range(args.rounds)]
    seconds = {
        recipe: [run[i]["loop_s"] / args.optimizer_steps for run in rounds] for i, recipe in enumerate(REMEDY_TABLE)
    }
    base = statistics.median(seconds[REMEDY_TABLE[0]])
    print(f"\nremedy rows, {LAGS[REMEDY_LAG]}, {args.optimizer_steps} optimizer steps each, {args.rounds} rounds")
    print(f"{'recipe':<16} {'s / opt step: median (min..max)':>31} {'x gspo':>7}")
    for recipe, values in seconds.items():
        spread = f"{statistics.median(values):.3f} ({min(values):.3f}..{max(values):.3f})"
        print(f"{recipe:<16} {spread:>31} {statistics.median(values) / base:>7.2f}")


if __name__ == "__main__":
    main()
