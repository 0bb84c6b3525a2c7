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
"""Embedded engine throughput at the default config, and what asynchrony buys on this machine.

Runs ``+recipe=sat_gspo_r3`` for the same number of steps synchronously (lag 0) and at lag 1, one after the other
in one process, without evaluation, and prints steps per minute, trainer tokens per second and the wall-time ratio
lag 0 / lag 1 (> 1: generation overlapped with training). Prepares ``--workdir`` first if needed.

    python benchmarks/bench_embedded.py [--workdir verl_sat_work] [--steps 30] [--device cpu|cuda]
"""

import argparse
import shutil
import time

from verl_sat.embedded import run_files
from verl_sat.embedded.prepare import WorkdirError, check_prepared, prepare
from verl_sat.embedded.run_config import compose_train_config
from verl_sat.embedded.train import train


def timed_run(workdir: str, lag: str, steps: int, device: str) -> dict:
    name = f"bench-{lag}"
    shutil.rmtree(f"{workdir}/runs/{name}", ignore_errors=True)
    config, settings = compose_train_config(workdir, [
        "+recipe=sat_gspo_r3", f"+lag={lag}", f"trainer.total_training_steps={steps}", "trainer.test_freq=-1",
        "trainer.val_before_train=false", "trainer.save_freq=-1", f"trainer.device={device}",
        f"trainer.experiment_name={name}",
    ])  # fmt: skip
    start = time.perf_counter()
    train(config, settings, progress=False)
    records = [r for r in run_files.read_metrics(settings.run_dir / "metrics.jsonl") if r["step"] > 0]
    loop = sum(r["timing/step_s"] for r in records)  # trainer loop only: no loading, no final evaluation
    tokens = sum(r["perf/tokens_per_s"] * r["timing/step_s"] for r in records)
    shutil.rmtree(settings.run_dir)
    return {"lag": lag, "wall_s": time.perf_counter() - start, "loop_s": loop, "steps_per_min": 60 * steps / loop,
            "tokens_per_s": tokens / loop, "gen_s": sum(r["timing/gen_s"] for r in records) / steps}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="verl_sat_work")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    try:
        check_prepared(args.workdir)
    except WorkdirError:
        prepare(args.workdir)
    rows = [timed_run(args.workdir, lag, args.steps, args.device) for lag in ("sync", "lag1")]
    print(f"embedded engine, sat_gspo_r3, default config, {args.steps} steps, device {args.device}")
    print(f"{'lag':<6} {'loop s':>8} {'steps/min':>10} {'tokens/s':>9} {'gen s/batch':>12}")
    for r in rows:
        print(f"{r['lag']:<6} {r['loop_s']:>8.1f} {r['steps_per_min']:>10.1f} {r['tokens_per_s']:>9.0f} "
              f"{r['gen_s']:>12.2f}")  # fmt: skip
    print(f"wall-time ratio lag 0 / lag 1 (same steps): {rows[0]['loop_s'] / rows[1]['loop_s']:.2f}x")


if __name__ == "__main__":
    main()
