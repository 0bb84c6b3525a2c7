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
"""``verl-sat e2e`` (``make e2e``): verl's real entry point and its asynchronous trainers on this CPU, on a prepared
embedded workdir, for a few steps each:

1. ``separate_async``: ``+recipe=sat_gspo_r3 +lag=lag1 r3=fsdp`` (SAT-GSPO with routing replay under verl's FSDP
   engine), then the same command with one more step, which resumes from verl's checkpoint; and ``+recipe=grpo
   +lag=lag8``, the paper's lag (8 optimizer steps per broadcast);
2. ``colocate_async``: ``+recipe=sat_gspo_r3 +lag=lag1 r3=fsdp`` with two FSDP ranks over gloo (verl's
   global-batch loss normalisation over 2 data-parallel ranks, R3 on sharded parameters) and rollout from replicas
   inside the training workers (verl's hybrid engine);
3. ``fully_async``: ``--config-name fully_async_ppo_trainer +recipe=sat_gspo_r3 +lag=lag1 r3=fsdp``.

Each run is ``python -m verl_sat.main ... trainer.device=cpu +cpu=e2e`` in its own process; its output goes to
``WORKDIR/e2e/TRAINER-NAME/log*.txt`` and verl's metrics (verl's ``file`` logger) to ``metrics*.jsonl``. The command
checks what the run must show in verl's own metrics, the realised staleness included, and prints it.
"""

import json
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

import psutil
from omegaconf import OmegaConf
from tqdm import tqdm

from verl_sat.mismatch import MISMATCH_METRIC

SAT_METRICS = ("actor/sat_gate_rate", "actor/sat_q", "actor/sat_intercepted_frac", "actor/sat_abs_log_ratio_mean")
R3_METRICS = ("actor/r3_route_flip_frac", "actor/r3_layers_replayed")
STALENESS_METRICS = ("training/off_policy/trajectory_staleness/mean", "training/off_policy/trajectory_staleness/max",
                     "training/off_policy/trajectory_staleness/min")  # fmt: skip
# verl's fully-async trainer logs no per-trajectory gap: the running count of trained trajectories sampled at least one
# weight version before the one being trained, and the current version
FULLY_ASYNC_STALENESS_METRICS = (
    "fully_async/count/stale_trajectory_processed",
    "fully_async/count/current_param_version",
)
REWARD_METRICS = ("critic/score/mean",)
MISMATCH_METRICS = (MISMATCH_METRIC,)  # every recipe row: the paper's d_pi (Eq. 52)
SHOWN = (*SAT_METRICS, *R3_METRICS, *STALENESS_METRICS, *FULLY_ASYNC_STALENESS_METRICS, *REWARD_METRICS,
         *MISMATCH_METRICS, "actor/ppo_kl", "timing_s/step")  # fmt: skip
GLOBAL_STEP = "training/global_step"  # the trainer step verl logs with its metrics
RESUMED = "Resuming from"  # what verl's trainer logs when it loads a checkpoint


@dataclass(frozen=True)
class E2ERun:
    """One verl run: its trainer, recipe arguments, trainer steps, whether a second invocation resumes it for one
    more step, the metrics it must log, and the staleness it must show from its second step on, in weight versions
    (the v1 trainers' ``training/off_policy/trajectory_staleness``; one version = the lag's optimizer steps)."""

    trainer: str
    name: str
    recipe_args: tuple[str, ...]
    steps: int
    resume: bool
    required: tuple[str, ...]
    staleness: int | None = 1

    @property
    def folder_name(self) -> str:
        return f"{self.trainer}-{self.name}"


# colocate_async on the CPU: verl-sat's CPU rollout as verl's hybrid replicas, inside the two training workers
COLOCATE_ASYNC = ("trainer.v1.trainer_mode=colocate_async", "actor_rollout_ref.hybrid_engine=true",
                  "actor_rollout_ref.rollout.checkpoint_engine.backend=naive", "trainer.n_gpus_per_node=2")  # fmt: skip
# verl's fully-async trainer on the CPU: 4 prompts per optimizer step, its rollouter on one slot, 24 prompts in all
# (the run ends when its rollouter has consumed them), and the logical CPUs its Ray actors reserve (23, plus 3 per
# training and 2 per rollout slot)
FULLY_ASYNC = ("--config-name", "fully_async_ppo_trainer", "data.train_batch_size=0",
               "actor_rollout_ref.actor.ppo_mini_batch_size=4", "rollout.nnodes=1", "rollout.n_gpus_per_node=1",
               "ray_kwargs.ray_init.num_cpus=32")  # fmt: skip
RUNS = (
    E2ERun("separate_async", "sat_gspo_r3-lag1", ("+recipe=sat_gspo_r3", "+lag=lag1", "r3=fsdp"), 2, True,
           (*SAT_METRICS, *R3_METRICS, *STALENESS_METRICS, *REWARD_METRICS, *MISMATCH_METRICS)),
    E2ERun("separate_async", "grpo-lag8", ("+recipe=grpo", "+lag=lag8"), 2, False,
           (*STALENESS_METRICS, *REWARD_METRICS, *MISMATCH_METRICS)),
    E2ERun("colocate_async", "sat_gspo_r3-lag1", ("+recipe=sat_gspo_r3", "+lag=lag1", "r3=fsdp", *COLOCATE_ASYNC),
           2, True, (*SAT_METRICS, *R3_METRICS, *STALENESS_METRICS, *REWARD_METRICS, *MISMATCH_METRICS)),
    E2ERun("fully_async", "sat_gspo_r3-lag1", (*FULLY_ASYNC, "+recipe=sat_gspo_r3", "+lag=lag1", "r3=fsdp"), 2, False,
           (*SAT_METRICS, *R3_METRICS, *FULLY_ASYNC_STALENESS_METRICS, *REWARD_METRICS, *MISMATCH_METRICS),
           staleness=None),
)  # fmt: skip
FULLY_ASYNC_PROMPTS_PER_STEP = 4  # actor.ppo_mini_batch_size above


class E2EFailed(RuntimeError):
    """A run failed or did not show what it must; the message names the log to read."""


def command(workdir: Path, run: E2ERun, steps: int, metrics_path: Path, checkpoints: Path) -> list[str]:
    """The ``python -m verl_sat.main`` command line of one invocation."""
    return [
        sys.executable, "-m", "verl_sat.main", *run.recipe_args, "trainer.device=cpu", "+cpu=e2e",
        f"actor_rollout_ref.model.path={workdir / 'model'}",
        f"data.train_files={workdir / 'data' / 'train.parquet'}", f"data.val_files={workdir / 'data' / 'test.parquet'}",
        f"trainer.total_training_steps={steps}", f"trainer.default_local_dir={checkpoints}",
        "trainer.project_name=verl_sat_e2e", f"trainer.experiment_name={run.folder_name}",
        f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH={metrics_path}",
        f"hydra.run.dir={checkpoints.parent / 'hydra'}",
        # fully-async: the run ends when the rollouter has consumed its prompts, and verl logs a trainer step's metrics
        # with the next step (the last is never logged): prompts for one step more than the logged ones
        *([f"rollout.total_rollout_steps={FULLY_ASYNC_PROMPTS_PER_STEP * (steps + 1)}"] if run.trainer == "fully_async"
          else []),
    ]  # fmt: skip


def run_e2e(workdir: Path, runs: tuple[E2ERun, ...] = RUNS, out: Path | None = None) -> dict[str, dict]:
    """Run ``runs`` and check them; return, per run, its metrics per step, the wall time and the peak memory."""
    out = workdir / "e2e" if out is None else out
    results = {}
    for run in runs:
        folder = fresh_folder(out / run.folder_name)
        checkpoints = folder / "checkpoints"
        phases = [("", 0, run.steps)] + ([("_resume", run.steps, run.steps + 1)] if run.resume else [])
        steps, seconds, peak = {}, 0.0, 0
        for suffix, done, total in phases:
            metrics_path, log_path = folder / f"metrics{suffix}.jsonl", folder / f"log{suffix}.txt"
            metrics_path.unlink(missing_ok=True)
            started = time.monotonic()
            phase_peak = _run(command(workdir, run, total, metrics_path, checkpoints), log_path, metrics_path,
                              total - done, f"{run.folder_name}{suffix}")  # fmt: skip
            seconds, peak = seconds + time.monotonic() - started, max(peak, phase_peak)
            logged = read_metrics(metrics_path)
            if suffix == "_resume":
                _check_resumed(log_path, logged, run.steps)
            steps.update(logged)
        missing = [key for key in run.required if not any(key in metrics for metrics in steps.values())]
        if missing:
            raise E2EFailed(f"{run.folder_name}: verl's metrics lack {missing} (see {folder / 'metrics.jsonl'})")
        check_staleness(run, steps, folder)
        results[run.folder_name] = {"steps": steps, "seconds": seconds, "peak_pss_bytes": peak, "folder": str(folder)}
    return results


def fresh_folder(folder: Path) -> Path:
    """``folder``, emptied: a run starts clean, so a second ``make e2e`` on the same workdir finds no checkpoint of the
    first to resume past its step budget (its resume phase resumes on purpose, from its own first phase)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


def _run(cmd: list[str], log_path: Path, metrics_path: Path, total: int, label: str) -> int:
    """Run ``cmd`` with its output in ``log_path``, a progress bar over the ``total`` trainer steps this invocation
    runs (as verl logs them), and the
    peak memory of the whole process tree (Ray's processes included); fail naming the log."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        peak = _PeakMemory(proc.pid)
        with tqdm(total=total, desc=label, unit="step") as bar:
            while proc.poll() is None:
                time.sleep(2)
                done = min(total, len(read_metrics(metrics_path)))
                if done != bar.n:
                    bar.update(done - bar.n)
        peak.stop()
    if proc.returncode != 0:
        tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise E2EFailed(f"{label} exited with {proc.returncode}; the log is {log_path}. Its end:\n{tail}")
    return peak.value


class _PeakMemory:
    """Samples the summed proportional set size (PSS: shared pages split among the processes that share them) of a
    process and its descendants every second, in a thread."""

    def __init__(self, pid: int) -> None:
        self.value, self._done = 0, threading.Event()
        self._root = psutil.Process(pid)
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.wait(1.0):
            try:
                processes = [self._root, *self._root.children(recursive=True)]
                self.value = max(self.value, sum(_pss(p) for p in processes))
            except psutil.NoSuchProcess:
                return

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def _pss(process: psutil.Process) -> int:
    try:
        return process.memory_full_info().pss
    except psutil.Error:
        return 0


def read_metrics(path: Path) -> dict[int, dict]:
    """verl's ``file`` logger lines (``{"step": N, "data": {...}}``) as trainer step -> metrics (the lines of one
    logged step merged); nothing if absent. verl's fully-async trainer logs by weight version, its rollouter's lines
    too, and a trainer step's metrics one version late: a trainer step is a logged step with
    ``training/global_step``, taken as its number."""
    if not path.exists():
        return {}
    merged: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            merged.setdefault(record["step"], {}).update(record["data"])
    return {int(data[GLOBAL_STEP]): data for data in merged.values() if GLOBAL_STEP in data}


def check_staleness(run: E2ERun, steps: dict[int, dict], folder: Path) -> None:
    """From the second trainer step on, every trained trajectory is ``run.staleness`` weight versions old."""
    if run.trainer == "fully_async":
        _check_fully_async_staleness(run, steps, folder)
    if run.staleness is None:
        return
    for step in sorted(steps)[1:]:
        seen = [steps[step].get(key) for key in STALENESS_METRICS[1:]]
        if seen != [run.staleness] * 2:
            raise E2EFailed(f"{run.folder_name} step {step}: trajectory staleness (max, min) {seen}, expected "
                            f"{run.staleness} weight version(s) (see {folder / 'metrics.jsonl'})")  # fmt: skip


def _check_fully_async_staleness(run: E2ERun, steps: dict[int, dict], folder: Path) -> None:
    """Lag 1 on verl's fully-async trainer: the first step trains the initial weights' samples, every later one only
    samples one version old (the rollouter's budget allows no more): the running stale count grows by the whole
    batch, and the version by one, per step."""
    stale, version = FULLY_ASYNC_STALENESS_METRICS
    ordered = [steps[step] for step in sorted(steps)]
    counts, versions = [m.get(stale) for m in ordered], [m.get(version) for m in ordered]
    per_step = FULLY_ASYNC_PROMPTS_PER_STEP * _responses_per_prompt()
    if counts != [per_step * i for i in range(len(ordered))] or versions != list(range(len(ordered))):
        raise E2EFailed(f"{run.folder_name}: {stale} {counts} and {version} {versions}: expected 0 stale trajectories "
                        f"at the first step, all {per_step} at every later one, one version per step (see "
                        f"{folder / 'metrics.jsonl'})")  # fmt: skip


def _responses_per_prompt() -> int:
    """``actor_rollout_ref.rollout.n`` of the CPU preset (``recipes/cpu/e2e.yaml``)."""
    preset = files("verl_sat.recipes").joinpath("cpu", "e2e.yaml").read_text()
    return OmegaConf.create(preset).actor_rollout_ref.rollout.n


def _check_resumed(log_path: Path, logged: dict[int, dict], saved_step: int) -> None:
    text = log_path.read_text(errors="replace")
    if RESUMED not in text or f"global_step_{saved_step}" not in text:
        raise E2EFailed(f"the second invocation did not resume from global_step_{saved_step} (see {log_path})")
    if sorted(logged) != [saved_step + 1]:
        raise E2EFailed(f"the resumed run logged steps {sorted(logged)}, expected only {saved_step + 1}")


def format_results(results: dict[str, dict]) -> str:
    """One block per run: the shown metrics per step, wall time and peak memory."""
    lines = []
    for name, result in results.items():
        steps = result["steps"]
        lines.append(f"{name}: {len(steps)} trainer steps in {result['seconds']:.0f} s, peak memory "
                     f"{result['peak_pss_bytes'] / 2**30:.2f} GiB (all processes), {result['folder']}")  # fmt: skip
        lines.append("  " + f"{'metric':<48}" + "".join(f"step {step:<6}" for step in sorted(steps)))
        for key in SHOWN:
            if any(key in metrics for metrics in steps.values()):
                values = "".join(f"{_number(steps[step].get(key)):<11}" for step in sorted(steps))
                lines.append(f"  {key:<48}{values}")
    return "\n".join(lines)


def _number(value) -> str:
    return "-" if value is None else f"{value:.4g}"
