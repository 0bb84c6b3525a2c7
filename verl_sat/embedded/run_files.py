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
"""The files of one embedded run, ``WORKDIR/runs/<experiment_name>/``::

    config.yaml                   the resolved config (a re-run must compose the same one to resume)
    metrics.jsonl                 one JSON line per step (step 0: evaluation before training)
    tensorboard/                  the same metrics as TensorBoard events
    checkpoints/global_step_N.pt  model, optimizer and the rollout's pending bf16 weight versions
    summary.json                  best / last accuracy, collapse flag, last-epoch mismatch and its attribution
    curves.png                    accuracy, reward, mismatch and its split (policy lag / engine) against optimizer step
    file_logger/, ...             what verl's Tracking backends write (trainer.logger), TensorBoard in tensorboard/

Every file is written to a temporary name and renamed, so an interruption never leaves a corrupted checkpoint or
a truncated metrics line; resuming from step N drops metric lines after N.
"""

import json
import math
import os
from pathlib import Path

import torch

from verl_sat.mismatch import MISMATCH_METRIC

ACCURACY = "val/accuracy"  # avg@k on the test split
REWARD = "reward/mean"
OPTIMIZER_STEP = "training/optimizer_step"  # optimizer steps done after the trainer step (lags compare on it)
MISMATCH = MISMATCH_METRIC  # mean |log_prob - mu| of the step's last epoch (Eq. 52)
POLICY_LAG = "staleness/policy_abs_mean"  # mean |log pi(j) - log pi(l)|
ENGINE_MISMATCH = "staleness/engine_abs_mean"  # mean |log pi(l) - log mu|
INTERCEPTED = "actor/sat_intercepted_frac"
GATE_RATE = "actor/sat_gate_rate"
SAT_Q = "actor/sat_q"
STRUCTURALLY_EMPTY = "actor/sat_structurally_empty_frac"  # micro-batches whose gate could not act
SEQS_PER_MICRO_BATCH = "actor/sat_seqs_per_micro_batch"
# summary key -> metric averaged over the last MISMATCH_TAIL of the steps
TAIL_MEANS = {"last_epoch_mismatch": MISMATCH, "last_policy_lag": POLICY_LAG, "last_engine_mismatch": ENGINE_MISMATCH,
              "last_intercepted_frac": INTERCEPTED, "last_gate_rate": GATE_RATE, "last_q": SAT_Q,
              "last_structurally_empty": STRUCTURALLY_EMPTY,
              "last_seqs_per_micro_batch": SEQS_PER_MICRO_BATCH}  # fmt: skip
# summary key -> metrics summed per step, then averaged over every training step: what each remedy acts on
RUN_MEANS = {
    "clip_frac": ("actor/pg_clipfrac",),  # tokens the loss clips (verl's pg_clipfrac)
    "rs_masked_frac": ("rollout_corr/rollout_rs_masked_fraction",),  # tokens rejection sampling masks
    # tokens whose IS weight pi_old / mu is out of its bounds: truncated (TIS) or zeroed (IcePop)
    "is_out_of_bounds_frac": (
        "rollout_corr/rollout_is_ratio_fraction_high",
        "rollout_corr/rollout_is_ratio_fraction_low",
    ),
    "sat_intercepted_frac": (INTERCEPTED,),  # tokens SAT's contracted bound intercepts
}
STEP_SECONDS = "timing/step_s"  # a trainer step's wall time, evaluation excluded
# collapsed: the last accuracy is below COLLAPSE_RATIO x the best; it collapsed at the first evaluation from which on
# every evaluation is below COLLAPSE_RATIO x the best accuracy reached up to it (``collapse_step``)
COLLAPSE_RATIO = 0.5
MISMATCH_TAIL = 0.1  # last-epoch mismatch of a run: mean over its last 10% of steps


def optimizer_step(record: dict) -> int:
    """The optimizer steps done when ``record`` was logged (0 for the evaluation before training)."""
    return record.get(OPTIMIZER_STEP, record["step"])


def collapse_step(evals: list[tuple[int, float]]) -> int | None:
    """The optimizer step of the first evaluation from which on every evaluation's accuracy is below
    ``COLLAPSE_RATIO`` x the best accuracy reached up to it; ``None`` if the last one is not. ``evals``: (optimizer
    step, accuracy) in order."""
    best_so_far, below = [], []
    for _, accuracy in evals:
        best_so_far.append(max(accuracy, best_so_far[-1]) if best_so_far else accuracy)
        below.append(accuracy < COLLAPSE_RATIO * best_so_far[-1])
    first = len(below)
    while first > 0 and below[first - 1]:
        first -= 1
    return evals[first][0] if first < len(evals) else None


def write_atomic(path: Path, data: str | bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)


class MetricsLog:
    """``metrics.jsonl``, kept consistent with the checkpoint the run resumes from."""

    def __init__(self, path: Path, resume_step: int):
        self.path = path
        self.records = [r for r in read_metrics(path) if r["step"] <= resume_step]
        write_atomic(path, "".join(json.dumps(r) + "\n" for r in self.records))

    def append(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.records.append(record)


def read_metrics(path: Path) -> list[dict]:
    """The complete JSON lines of ``path`` (a line cut by a crash is skipped)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def save_checkpoint(folder: Path, step: int, state: dict, keep: int) -> Path:
    """``folder/global_step_{step}.pt`` written then renamed; keeps the newest ``keep`` checkpoints."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"global_step_{step}.pt"
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"step": step, **state}, tmp)
    os.replace(tmp, path)
    for old in checkpoints(folder)[:-keep]:
        old.unlink()
    return path


def checkpoints(folder: Path) -> list[Path]:
    """Finished checkpoints, oldest first."""
    return sorted(folder.glob("global_step_*.pt"), key=checkpoint_step)


def checkpoint_step(path: Path) -> int:
    """The trainer step of a checkpoint ``global_step_{step}.pt``."""
    return int(path.stem.rsplit("_", 1)[1])


def summarize(records: list[dict], total_steps: int, radius: float | None = None) -> dict:
    """Best and last accuracy with their optimizer steps, the collapse flag (``last < COLLAPSE_RATIO * best``) and
    ``collapse_step``, and the means
    over the last ``MISMATCH_TAIL`` of the steps of the mismatch, its split and SAT's intercepted fraction, gate rate
    and tail quantile ``q`` (``None`` where the run does not log them), ``q / radius`` (the upper clip radius
    ``eps_hi``) when ``radius`` is given, the ``RUN_MEANS`` over every training step (``mean_<name>``), and the wall
    time per optimizer step."""
    evals = [(optimizer_step(r), r[ACCURACY]) for r in records if ACCURACY in r]
    steps = [r for r in records if MISMATCH in r]
    tail = steps[-max(1, math.ceil(MISMATCH_TAIL * len(steps))) :] if steps else []
    best_step, best = max(evals, key=lambda e: (e[1], -e[0])) if evals else (None, None)
    last_step, last = evals[-1] if evals else (None, None)
    tail_means = {}
    for name, key in TAIL_MEANS.items():
        values = [r[key] for r in tail if key in r]
        tail_means[name] = sum(values) / len(values) if values else None
    trained = [r for r in records if STEP_SECONDS in r]
    run_means = {}
    for name, keys in RUN_MEANS.items():
        values = [sum(r[k] for k in keys if k in r) for r in trained if any(k in r for k in keys)]
        run_means[f"mean_{name}"] = sum(values) / len(values) if values else None
    optimizer_steps = max((optimizer_step(r) for r in trained), default=0)
    step_seconds = sum(r[STEP_SECONDS] for r in trained) / optimizer_steps if optimizer_steps else None
    return {
        "steps_done": max((r["step"] for r in records), default=0),
        "total_steps": total_steps,
        "best_accuracy": best,
        "best_step": best_step,
        "last_accuracy": last,
        "last_step": last_step,
        "initial_accuracy": evals[0][1] if evals and evals[0][0] == 0 else None,
        "collapsed": bool(evals) and last < COLLAPSE_RATIO * best,
        "collapse_step": collapse_step(evals),
        "collapse_rule": f"last accuracy < {COLLAPSE_RATIO} x best accuracy",
        **tail_means,
        "radius": radius,
        "last_q_over_radius": None if tail_means["last_q"] is None or not radius else tail_means["last_q"] / radius,
        **run_means,
        "seconds_per_optimizer_step": step_seconds,
    }


def plot_curves(records: list[dict], path: Path, title: str) -> None:
    """``curves.png``: accuracy, reward, mismatch and its split into policy lag and engine mismatch against optimizer
    step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("test avg@k accuracy", [(ACCURACY, None)]),
        ("train reward (mean)", [(REWARD, None)]),
        ("mismatch: mean |log pi - log mu|", [(MISMATCH, None)]),
        ("its split (Eq. 2)", [(POLICY_LAG, "policy lag |Δπ|"), (ENGINE_MISMATCH, "engine |Δimpl|")]),
    )
    fig, axes = plt.subplots(1, 4, figsize=(18, 3.8))
    for ax, (panel, lines) in zip(axes, panels, strict=True):
        for key, label in lines:
            points = [(optimizer_step(r), r[key]) for r in records if key in r]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o" if key == ACCURACY else None, markersize=3, label=label)
        if any(label for _, label in lines):
            ax.legend(fontsize=8)
        ax.set_xlabel("optimizer step")
        ax.set_title(panel)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
