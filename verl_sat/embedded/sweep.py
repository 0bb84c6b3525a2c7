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

Each cell is one ``verl-sat train`` process (run name ``<sweep>/<recipe>-lag<L>-s<seed>``, or ``-fixed<L>-`` for a
fixed lag, under ``WORKDIR/runs``), so a failing cell does not stop the others and a re-run skips finished cells and
resumes unfinished ones. A finished cell also leaves a small record (its summary and curves) in ``--store DIR``
when given: a later sweep, on this machine or a fresh one, takes the cell from there instead of running it again,
so a sweep longer than one session is committed cell by cell. Output in ``WORKDIR/sweeps/<sweep>/``: the report of
``verl_sat.embedded.report`` and one log per cell under ``logs/``.
"""

import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from verl_sat.embedded import cell_stats, report, run_files
from verl_sat.embedded.prepare import check_prepared

RECORD_FORMAT = 1
CURVE_POINTS = 50  # points kept per cell for the mismatch split curves of the record


@dataclass(frozen=True)
class Cell:
    recipe: str
    lag: int
    seed: int
    regime: str = "paper"  # "paper": the paper's lag (+lag=lag<L>, L = 0: +lag=sync); "fixed": gap exactly L

    def __post_init__(self):
        if self.regime not in ("paper", "fixed") or self.lag < 0 or (self.regime == "fixed" and self.lag < 1):
            raise ValueError(f"lag {self.regime} {self.lag}: expected a paper lag >= 0 or a fixed lag >= 1")

    @property
    def lag_label(self) -> str:
        """``lag8`` (the paper's lag 8), ``fixed8`` (exact gap of 8 optimizer steps), ``lag0`` (synchronous)."""
        return f"{'fixed' if self.regime == 'fixed' else 'lag'}{self.lag}"

    @property
    def lag_regime(self) -> str:
        """``paper``, ``fixed`` or ``sync`` (lag 0)."""
        return "sync" if self.regime == "paper" and self.lag == 0 else self.regime

    @property
    def name(self) -> str:
        return f"{self.recipe}-{self.lag_label}-s{self.seed}"

    @property
    def optimizer_steps_per_trainer_step(self) -> int:
        return self.lag if self.regime == "paper" and self.lag > 1 else 1

    def trainer_steps(self, optimizer_steps: int) -> int:
        """The trainer steps that hold ``optimizer_steps`` optimizer steps at this lag."""
        return math.ceil(optimizer_steps / self.optimizer_steps_per_trainer_step)

    def overrides(self, sweep: str, optimizer_steps: int | None = None) -> list[str]:
        """The paper's lag L: ``+lag=sync`` / ``+lag=lag1`` / ``+lag=lag8``; any other L is lag1 with
        ``parameter_sync_step=L``. A fixed lag L is ``+lag=fixed8`` with the rollout L batches ahead.
        ``optimizer_steps`` sets ``trainer.total_training_steps`` to the trainer steps that hold them."""
        if self.regime == "fixed":
            lag = ["+lag=fixed8"] + ([] if self.lag == 8 else [
                f"trainer.v1.separate_async.num_warmup_batches={self.lag}",
                f"trainer.v1.sampler.max_off_policy_threshold={self.lag + 1}"])  # fmt: skip
        else:
            lag = {0: ["+lag=sync"], 1: ["+lag=lag1"], 8: ["+lag=lag8"]}.get(self.lag) or [
                "+lag=lag1",
                f"trainer.v1.separate_async.parameter_sync_step={self.lag}",
            ]
        total = (
            [] if optimizer_steps is None else [f"trainer.total_training_steps={self.trainer_steps(optimizer_steps)}"]
        )
        return [
            f"+recipe={self.recipe}",
            *lag,
            f"data.seed={self.seed}",
            f"trainer.experiment_name={sweep}/{self.name}",
            *total,
        ]  # fmt: skip


def parse_lag(text: str) -> tuple[int, str]:
    """``"8"`` -> ``(8, "paper")``, ``"fixed8"`` -> ``(8, "fixed")``."""
    regime = "fixed" if text.startswith("fixed") else "paper"
    value = text.removeprefix("fixed")
    if not value.isdigit():
        raise ValueError(f"lag {text!r}: expected an integer (the paper's lag) or fixedL (an exact gap of L)")
    return int(value), regime


def run_dir(workdir: Path, sweep: str, cell: Cell) -> Path:
    return workdir / "runs" / sweep / cell.name


class StoreMismatch(ValueError):
    """A stored cell record was made with other overrides than the sweep asks for, or a run holds more steps."""


def finished(summary_path: Path, total_steps: int | None = None) -> dict | None:
    """The summary of a finished run, else ``None``: also ``None`` for a run finished at fewer than ``total_steps``
    trainer steps (re-running it extends it); a run extended beyond ``total_steps``, also one whose extension was
    interrupted (a checkpoint past its summary), is refused: its metrics hold the longer run."""
    if not summary_path.is_file():
        return None
    summary = json.loads(summary_path.read_text())
    saved = run_files.checkpoints(summary_path.parent / "checkpoints")
    ran = max(summary["total_steps"], run_files.checkpoint_step(saved[-1]) if saved else 0)
    if total_steps is not None and ran > total_steps:
        raise StoreMismatch(f"{summary_path.parent} ran {ran} trainer steps, more than the {total_steps} asked for: "
                            f"choose another sweep --name")  # fmt: skip
    if total_steps is not None and summary["total_steps"] < total_steps:
        return None
    return summary if summary["steps_done"] >= summary["total_steps"] else None


def make_record(cell: Cell, overrides: list[str], optimizer_steps: int | None, summary: dict, records: list[dict],
                model: str) -> dict:  # fmt: skip
    """A finished cell's record: the cell, the sweep's overrides and ``--optimizer-steps``, the prepared model
    (``prepare.json``'s ``model_sha256``), its summary, its accuracy curve and its mismatch split (``CURVE_POINTS``
    points)."""
    split = [r for r in records if run_files.MISMATCH in r]
    stride = max(1, math.ceil(len(split) / CURVE_POINTS))
    return {
        "format": RECORD_FORMAT,
        "cell": asdict(cell),
        "overrides": list(overrides),
        "optimizer_steps": optimizer_steps,
        "model_sha256": model,
        "summary": summary,
        "accuracy": [[run_files.optimizer_step(r), r[run_files.ACCURACY]] for r in records if run_files.ACCURACY in r],
        "split": [[run_files.optimizer_step(r), r[run_files.MISMATCH], r.get(run_files.POLICY_LAG),
                   r.get(run_files.ENGINE_MISMATCH)] for r in split[stride - 1 :: stride]],
    }  # fmt: skip


def stored_record(store: Path | None, cell: Cell, overrides: list[str], optimizer_steps: int | None) -> dict | None:
    """The cell's record in ``store``, else ``None``; refuses one made with other overrides or optimizer steps."""
    if store is None or not (store / f"{cell.name}.json").is_file():
        return None
    record = json.loads((store / f"{cell.name}.json").read_text())
    wanted = cell_stats.settings({"overrides": list(overrides), "optimizer_steps": optimizer_steps})
    if cell_stats.settings(record) != wanted:
        raise StoreMismatch(
            f"{store / (cell.name + '.json')} was made with {list(cell_stats.settings(record))}, not {list(wanted)}: "
            "use another --store for other settings, or delete the record to run the cell again"
        )
    return record


def start_accuracies(store: Path, records: dict[str, dict]) -> dict[int, float]:
    """The step-0 test accuracy per seed of ``records`` (file name -> record): every run of one seed from one
    prepared model starts from it, whatever its recipe and lag. Raises ``StoreMismatch`` where two records of a seed
    disagree."""
    accuracies: dict[int, float] = {}
    for name, record in records.items():
        seed, accuracy = record["cell"]["seed"], record["summary"].get("initial_accuracy")
        if accuracy is not None and accuracies.setdefault(seed, accuracy) != accuracy:
            raise StoreMismatch(f"{store} holds seed-{seed} cells from two prepared models (step-0 accuracy "
                                f"{accuracies[seed]} and {accuracy} in {name})")  # fmt: skip
    return accuracies


def check_same_model(workdir: Path, sweep: str, store: Path | None, pending: list[Cell], overrides: list[str],
                     threads: int, model: str) -> None:  # fmt: skip
    """Refuse to add cells to a store whose cells another prepared model trained: a record names its model
    (``model_sha256``, the same on every CPU since prepare runs portable floating point). A record made before that
    field (native floating point: another CPU's prepare could land elsewhere) is checked by a probe: the first
    pending cell of a seed such records hold, at lag 1 for one optimizer step in the sweep ``<sweep>-probe``, must
    start from their step-0 accuracy."""
    records = {path.name: json.loads(path.read_text())
               for path in (sorted(store.glob("*.json")) if store is not None and store.is_dir() else [])}  # fmt: skip
    others = sorted({r["model_sha256"] for r in records.values() if r.get("model_sha256") not in (None, model)})
    if others:
        raise StoreMismatch(
            f"{workdir}'s prepared model (model_sha256 {model[:16]}) is not the one that trained cells in {store} "
            f"({', '.join(m[:16] for m in others)}): prepare the workdir with the same verl-sat version, or use "
            "another --store"
        )
    known = start_accuracies(store, {n: r for n, r in records.items() if "model_sha256" not in r})
    first = next((cell for cell in pending if cell.seed in known), None)
    if first is None:
        return
    probe = Cell(first.recipe, 1, first.seed)
    _, record = run_cell(workdir, f"{sweep}-probe", probe, [*overrides, "trainer.total_training_steps=1"], threads,
                         model)  # fmt: skip
    if record is None:
        raise RuntimeError(f"the prepared-model probe failed: see {workdir / 'sweeps' / (sweep + '-probe') / 'logs'}")
    accuracy = record["summary"]["initial_accuracy"]
    if accuracy != known[first.seed]:
        raise StoreMismatch(
            f"{workdir}'s prepared model is not the one that trained the cells in {store}: seed {first.seed} starts "
            f"from step-0 test accuracy {accuracy} here, {known[first.seed]} there (prepare.json: "
            f"{workdir / 'prepare.json'}). Run the sweep where `verl-sat prepare` reproduces that model, or use "
            "another --store"
        )


def run_cell(workdir: Path, sweep: str, cell: Cell, overrides: list[str], threads: int, model: str,
             optimizer_steps: int | None = None, store: Path | None = None) -> tuple[Cell, dict | None]:  # fmt: skip
    """Take the cell from ``store``, or run (resume, or extend to more ``optimizer_steps``) it in its own ``verl-sat
    train`` process on ``workdir``'s prepared ``model`` (its ``model_sha256``); returns its record (``None`` if it
    failed) and writes it to ``store``."""
    record = stored_record(store, cell, overrides, optimizer_steps)
    if record is not None:
        return cell, record
    folder = run_dir(workdir, sweep, cell)
    total_steps = None if optimizer_steps is None else cell.trainer_steps(optimizer_steps)
    summary = finished(folder / "summary.json", total_steps)
    if summary is None:
        logs = workdir / "sweeps" / sweep / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TQDM_MININTERVAL": "30"}
        command = [sys.executable, "-m", "verl_sat.cli", "train", "--workdir", str(workdir),
                   *cell.overrides(sweep, optimizer_steps), *overrides]  # fmt: skip
        with (logs / f"{cell.name}.log").open("w") as log:
            log.write(" ".join(command) + "\n")
            log.flush()
            subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, check=False)
        summary = finished(folder / "summary.json", total_steps)
        if summary is None:
            return cell, None
    # the summary's steps only: an extension interrupted before its first checkpoint logged steps beyond them
    metrics = [r for r in run_files.read_metrics(folder / "metrics.jsonl") if r["step"] <= summary["total_steps"]]
    record = make_record(cell, overrides, optimizer_steps, summary, metrics, model)
    if store is not None:
        store.mkdir(parents=True, exist_ok=True)
        run_files.write_atomic(store / f"{cell.name}.json", json.dumps(record, indent=1) + "\n")
    return cell, record


def sweep(workdir: str | Path, recipes: list[str], lags: list[int | str], seeds: list[int], overrides: list[str],
          name: str = "default", jobs: int = 1, progress: bool = True, optimizer_steps: int | None = None,
          store: str | Path | None = None) -> Path:  # fmt: skip
    """Run every cell (``jobs`` at a time; ``lags`` as ``8`` or ``"fixed8"``), then write the report; returns the
    sweep folder."""
    workdir = Path(workdir)
    model = check_prepared(workdir)["model_sha256"]
    store = None if store is None else Path(store)
    out = workdir / "sweeps" / name
    out.mkdir(parents=True, exist_ok=True)
    lag_specs = [parse_lag(str(lag)) for lag in lags]
    # seed by seed: early seeds finish first
    cells = [Cell(r, lag, s, regime) for s in seeds for r in recipes for lag, regime in lag_specs]
    # refuse a store made with other overrides, or a run extended beyond, before anything runs
    pending = [cell for cell in cells if stored_record(store, cell, overrides, optimizer_steps) is None]
    for cell in pending if optimizer_steps is not None else []:
        finished(run_dir(workdir, name, cell) / "summary.json", cell.trainer_steps(optimizer_steps))
    threads = max(1, (os.cpu_count() or 1) // jobs)
    check_same_model(workdir, name, store, pending, overrides, os.cpu_count() or 1, model)
    failed, records = [], []
    with ThreadPoolExecutor(max_workers=jobs) as pool, tqdm(total=len(cells), desc=f"sweep {name}", unit="cell",
                                                            disable=not progress) as bar:  # fmt: skip
        futures = [pool.submit(run_cell, workdir, name, cell, overrides, threads, model, optimizer_steps, store)
                   for cell in cells]  # fmt: skip
        for future in futures:
            cell, record = future.result()
            bar.update()
            if record is None:
                failed.append(cell.name)
                bar.write(f"{cell.name}: FAILED, see {out / 'logs' / (cell.name + '.log')}")
            else:
                records.append(record)
                bar.write(f"{cell.name}: {cell_line(record['summary'])}")
    command = ["verl-sat sweep", f"--workdir {workdir}", f"--name {name}", f"--recipes {','.join(recipes)}",
               f"--lags {','.join(map(str, lags))}", f"--seeds {','.join(map(str, seeds))}",
               *([f"--optimizer-steps {optimizer_steps}"] if optimizer_steps else []),
               *([f"--store {store}"] if store else []), *overrides]  # fmt: skip
    report.write_report(out, records, [" ".join(command)], failed)
    return out


def cell_line(summary: dict) -> str:
    return (f"best {summary['best_accuracy']:.3f} (step {summary['best_step']}), last {summary['last_accuracy']:.3f}, "
            f"collapsed {summary['collapsed']}, mismatch {summary['last_epoch_mismatch']:.4f}")  # fmt: skip
