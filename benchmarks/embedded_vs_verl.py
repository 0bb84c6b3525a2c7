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
"""The embedded engine against verl's own separate-async trainer: the same recipe, paper lag, model, task and sizes
on both, one seed, and the regime quantities side by side (docs/cpu.md). Not in CI (a few minutes on 2 cores).

Both run ``+recipe=sat_gspo_r3 +lag=lag8`` (SAT-GSPO with routing replay, 8 optimizer steps per broadcast, rollout
one batch ahead) for ``--trainer-steps`` trainer steps of 4 prompts x 4 responses per optimizer step, at the
embedded engine's learning rate; verl with ``r3=fsdp trainer.device=cpu +cpu=e2e`` (verl's vLLM rollout on vLLM's
CPU build, verl's FSDP2 engine, transfer queue, agent and reward loops). Printed as a markdown table: the realised gap
distribution in optimizer steps, the mismatch d_pi (Eq. 52), SAT's gate rate, q / epsilon and intercepted fraction.

``--rollout-dtype`` sets ``actor_rollout_ref.rollout.dtype`` on both (verl's vLLM and the embedded engine's rollout
copy; ``float32`` leaves the policy lag and the sampled trajectories as the differences, not the bf16 kernels);
``--seeds`` runs the embedded engine once per data seed (its spread), verl once with the first.

    python benchmarks/embedded_vs_verl.py --workdir verl_sat_work [--trainer-steps 4] [--rollout-dtype float32]
        [--seeds 0,1,2]
"""

import argparse
import shutil
import statistics
from collections import Counter
from pathlib import Path

from verl_sat.cpu.e2e import E2ERun, run_e2e
from verl_sat.embedded import run_files
from verl_sat.embedded.prepare import check_prepared
from verl_sat.embedded.run_config import compose_train_config
from verl_sat.embedded.train import train

RECIPE, LAG, SYNC_STEPS = "sat_gspo_r3", "lag8", 8  # the paper's lag 8: 8 optimizer steps per broadcast
PROMPTS_PER_OPTIMIZER_STEP, RESPONSES = 4, 4  # recipes/cpu/e2e.yaml's sizes, on both
LEARNING_RATE = 3.0e-5  # the embedded engine's (recipes/embedded/default.yaml), on both
EPSILON = 0.2  # the shared clip radius of the Table 9 recipes
QUANTITIES = {"d_pi (mean abs log pi - log mu)": "actor/mismatch_abs_log_ratio", "SAT gate rate": "actor/sat_gate_rate",
              "SAT q / epsilon": "actor/sat_q", "SAT intercepted fraction": "actor/sat_intercepted_frac"}  # fmt: skip
SHARED = (f"data.train_batch_size={PROMPTS_PER_OPTIMIZER_STEP * SYNC_STEPS}",
          f"actor_rollout_ref.rollout.n={RESPONSES}", f"actor_rollout_ref.actor.optim.lr={LEARNING_RATE}")  # fmt: skip


def run_embedded(workdir: Path, trainer_steps: int, dtype: str, seed: int) -> list[dict]:
    overrides = [f"+recipe={RECIPE}", f"+lag={LAG}", *SHARED, f"trainer.total_training_steps={trainer_steps}",
                 f"trainer.test_freq={trainer_steps}", f"trainer.save_freq={trainer_steps}",
                 f"actor_rollout_ref.rollout.dtype={dtype}", f"data.seed={seed}",
                 f"trainer.experiment_name=embedded_vs_verl_{dtype}_s{seed}"]  # fmt: skip
    config, settings = compose_train_config(workdir, overrides)
    shutil.rmtree(settings.run_dir, ignore_errors=True)  # a fresh run, not the extension of an earlier one
    train(config, settings)
    return [r for r in run_files.read_metrics(settings.run_dir / "metrics.jsonl") if r["step"] > 0]


def run_verl(workdir: Path, trainer_steps: int, dtype: str, seed: int) -> list[dict]:
    run = E2ERun(
        "separate_async",
        f"embedded_vs_verl_{dtype}",
        (
            f"+recipe={RECIPE}",
            f"+lag={LAG}",
            "r3=fsdp",
            *SHARED,
            f"actor_rollout_ref.rollout.dtype={dtype}",
            f"data.seed={seed}",
        ),
        trainer_steps,
        False,
        ("actor/sat_gate_rate",),
        staleness=None,
    )  # fmt: skip  (measured, not checked)
    steps = run_e2e(workdir, (run,))[run.folder_name]["steps"]
    return [steps[step] for step in sorted(steps)]


def gap_counts_embedded(records: list[dict]) -> Counter:
    """Optimizer steps: one count per optimizer step (the engine logs the gap of each)."""
    return Counter(gap for r in records for gap in r["rollout/optimizer_step_gaps"])


def gap_counts_verl(records: list[dict]) -> Counter:
    """Optimizer steps, weighted by the share of trajectories: verl logs each trajectory's age in weight versions
    (the newest version that generated part of it) as min, max and mean over the batch; mini-batch j of a trainer step
    is trained after j of its optimizer steps, so a trajectory ``v`` versions old has the gap ``v * n + j``."""
    counts = Counter()
    for r in records:
        low, high, mean = (r[f"training/off_policy/trajectory_staleness/{k}"] for k in ("min", "max", "mean"))
        if high - low > 1:
            raise RuntimeError(f"a batch spans trajectory ages {low}..{high}: more than two versions")
        older = 1.0 if high == low else mean - low  # share of trajectories at the older age, `high`
        for j in range(SYNC_STEPS):
            counts[int(high) * SYNC_STEPS + j] += older
            counts[int(low) * SYNC_STEPS + j] += 1.0 - older if high != low else 0.0
    return +counts


def _distribution(counts: Counter) -> str:
    """Shares per window of n gaps (within a window every gap has the same share: one per mini-batch)."""
    total, windows = sum(counts.values()), Counter()
    for gap, n in counts.items():
        windows[gap // SYNC_STEPS] += n
    return ", ".join(f"{w * SYNC_STEPS}..{w * SYNC_STEPS + SYNC_STEPS - 1}: {n / total:.4f}"
                     for w, n in sorted(windows.items()))  # fmt: skip


def _mean_spread(records: list[dict], key: str, scale: float = 1.0, shift: float = 0.0) -> str:
    values = [(r[key] - shift) / scale for r in records if key in r]
    return f"{statistics.fmean(values):.4g} ({min(values):.3g}..{max(values):.3g})"


def table(embedded: dict[int, list[dict]], verl: list[dict], dtype: str, verl_seed: int) -> str:
    """One column per embedded seed, then verl's."""
    seeds = list(embedded)
    lines = [f"rollout.dtype={dtype}; per trainer step: mean (min..max)", "",
             "| quantity | " + " | ".join(f"embedded, seed {s}" for s in seeds) + f" | verl separate_async, seed "
             f"{verl_seed} |", "|---" * (len(seeds) + 2) + "|",
             "| trainer steps / optimizer steps | " + " | ".join(f"{len(r)} / {len(r) * SYNC_STEPS}"
                                                              for r in embedded.values())
             + f" | {len(verl)} / {len(verl) * SYNC_STEPS} |",
             "| realised gap (optimizer steps: share) | " + " | ".join(_distribution(gap_counts_embedded(r))
                                                                       for r in embedded.values())
             + f" | {_distribution(gap_counts_verl(verl))} |"]  # fmt: skip
    resumed = "training/off_policy/trajectory_spans/mean"  # 1: every trajectory generated by one weight version
    lines.append("| trajectories resumed across a broadcast (share) | " + " | ".join("0 (by construction)"
                                                                                     for _ in seeds)
                 + f" | {_mean_spread(verl, resumed, shift=1.0)} |")  # fmt: skip
    for label, key in QUANTITIES.items():
        scale = EPSILON if label.endswith("epsilon") else 1.0
        lines.append(f"| {label} | " + " | ".join(_mean_spread(r, key, scale) for r in embedded.values())
                     + f" | {_mean_spread(verl, key, scale)} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default="verl_sat_work", type=Path)
    parser.add_argument("--trainer-steps", default=4, type=int, help="trainer steps on each (8 optimizer steps each)")
    parser.add_argument("--rollout-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="actor_rollout_ref.rollout.dtype on both (default: verl's bfloat16)")  # fmt: skip
    parser.add_argument(
        "--seeds", default="0", help="comma-separated data seeds of the embedded runs (verl: the first)"
    )
    args = parser.parse_args()
    check_prepared(args.workdir)
    seeds = [int(s) for s in args.seeds.split(",")]
    embedded = {seed: run_embedded(args.workdir, args.trainer_steps, args.rollout_dtype, seed) for seed in seeds}
    verl = run_verl(args.workdir, args.trainer_steps, args.rollout_dtype, seeds[0])
    print(table(embedded, verl, args.rollout_dtype, seeds[0]))


if __name__ == "__main__":
    main()
