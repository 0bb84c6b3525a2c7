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
"""``verl-sat train``: asynchronous RL on one machine, the paper's pipeline in miniature (see ``schedule`` for the lag).

The trainer (fp32) runs in the calling thread and the rollout engine (bf16 copy) in a background thread; the loss,
KL, advantages, reward, rollout correction, optimizer and loggers are verl's (``ppo_update``). Every random draw
comes from a generator seeded by (seed, stream, step), so the same seed and config give the same ``metrics.jsonl``
(timings aside) at any lag, also across a resume. A re-run of the same command resumes from the latest checkpoint;
a re-run with a larger ``trainer.total_training_steps`` (or other test/save frequencies or loggers) extends the run.
"""

import copy
import json
import os
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.tracking import Tracking
from verl.workers.config.optimizer import build_optimizer

from verl_sat.embedded import run_files
from verl_sat.embedded.evaluate import avg_at_k
from verl_sat.embedded.ppo_update import Policy, train_step
from verl_sat.embedded.rollout import (
    EVAL_STREAM,
    SHUFFLE_STREAM,
    PromptSet,
    RolloutEngine,
    RolloutWorker,
    WeightStore,
    stream_seed,
)
from verl_sat.embedded.run_config import EXTENSIBLE_KEYS, EmbeddedConfigError, RunSettings
from verl_sat.routing_replay import RoutingReplay

TIMING_PREFIXES = ("timing/", "perf/")  # the only metrics that differ between two runs of the same config


def _config_diff(old: dict, new: dict, prefix: str = "") -> str | None:
    """The first key, outside ``EXTENSIBLE_KEYS``, whose value differs between two resolved configs."""
    for key in sorted(set(old) | set(new)):
        a, b, name = old.get(key), new.get(key), f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            found = _config_diff(a, b, f"{name}.")
            if found:
                return found
        elif a != b and name not in EXTENSIBLE_KEYS:
            return f"{name}: {a!r} (run) vs {b!r} (now)"
    return None


def _prepare_run_dir(config: DictConfig, settings: RunSettings) -> None:
    """Create the run folder with the resolved config, or check that a re-run asks for the same config (up to the
    keys that extend a run) and record the new one."""
    resolved = OmegaConf.to_container(config, resolve=True)
    path = settings.run_dir / "config.yaml"
    if path.exists():
        diff = _config_diff(OmegaConf.to_container(OmegaConf.load(path)), resolved)
        if diff:
            raise EmbeddedConfigError(
                f"{settings.run_dir} holds a run with another config ({diff}); only {', '.join(EXTENSIBLE_KEYS)} may "
                "change to extend it: choose another trainer.experiment_name or delete the folder"
            )
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    run_files.write_atomic(path, OmegaConf.to_yaml(OmegaConf.create(resolved)))


def _frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    copied = copy.deepcopy(model).eval()
    for parameter in copied.parameters():
        parameter.requires_grad_(False)
    return copied


def _tracking(config: DictConfig, settings: RunSettings, first_step: int) -> Tracking:
    """verl's ``Tracking`` with the run's backends, writing into the run folder (TensorBoard, wandb, a file-logger
    file per resume segment, so nothing earlier is overwritten)."""
    os.environ["TENSORBOARD_DIR"] = str(settings.run_dir / "tensorboard")
    os.environ["WANDB_DIR"] = str(settings.run_dir)  # wandb (e.g. WANDB_MODE=offline) writes run_dir/wandb/
    (settings.run_dir / "file_logger").mkdir(exist_ok=True)
    os.environ["VERL_FILE_LOGGER_PATH"] = str(settings.run_dir / "file_logger" / f"from_step_{first_step}.jsonl")
    try:
        return Tracking(settings.project_name, settings.run_dir.name, default_backend=list(settings.loggers),
                        config=OmegaConf.to_container(config, resolve=True))  # fmt: skip
    except ImportError as err:
        raise EmbeddedConfigError(f"trainer.logger={list(settings.loggers)}: {err}") from err


def train(config: DictConfig, settings: RunSettings, progress: bool = True) -> dict:
    """Run (or resume, or extend) the embedded asynchronous RL loop; returns the summary written to
    ``summary.json``."""
    _prepare_run_dir(config, settings)
    run_dir, device, schedule = settings.run_dir, torch.device(settings.device), settings.schedule
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    algo = omega_conf_to_dataclass(config.algorithm)
    tokenizer = AutoTokenizer.from_pretrained(settings.model_path)
    model = AutoModelForCausalLM.from_pretrained(settings.model_path, dtype=torch.float32).to(device).train()
    reference = Policy(_frozen_copy(model)) if settings.use_kl_loss else None  # the prepared model, never updated
    at_version = Policy(_frozen_copy(model))  # loaded with the fp32 weights that sampled each batch
    optimizer = build_optimizer(model.parameters(), actor.optim)
    train_prompts = PromptSet.load(settings.train_file, tokenizer)
    test_prompts = PromptSet.load(settings.test_file, tokenizer)
    store = WeightStore(settings.rollout_dtype)
    done = 0
    saved = run_files.checkpoints(run_dir / "checkpoints")
    if saved:
        state = torch.load(saved[-1], map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        for version, weights in state["rollout_versions"].items():
            store.publish(int(version), weights)
        done = state["step"]
    else:
        store.publish(0, model.state_dict())
    log = run_files.MetricsLog(run_dir / "metrics.jsonl", resume_step=done)
    if done >= settings.total_steps:
        return _finish(run_dir, log.records, settings, actor.clip_ratio_high)

    engine = RolloutEngine(copy.deepcopy(model), tokenizer, train_prompts, settings)
    policy = Policy(model, RoutingReplay.attach(model) if settings.routing_replay else None)
    if settings.routing_replay:
        at_version.routing = RoutingReplay.attach(at_version.model)
    tracker = _tracking(config, settings, done + 1)
    worker = RolloutWorker(engine, store, schedule, done + 1, settings.total_steps)
    worker.start()

    def evaluate(index: int) -> float:
        """avg@k, its sampling seeded by ``index`` (the trainer step; on the optimizer-step grid, the optimizer
        step)."""
        generator = torch.Generator().manual_seed(stream_seed(settings.seed, EVAL_STREAM, index))
        return avg_at_k(model, tokenizer, test_prompts, settings.val_n, settings.max_response_length,
                        settings.val_temperature, generator if settings.val_do_sample else None)  # fmt: skip

    def record(metrics: dict) -> None:
        log.append(metrics)
        scalars = {k: v for k, v in metrics.items() if k != "step" and isinstance(v, int | float)}
        tracker.log(scalars, step=metrics["step"])

    try:
        if done == 0 and settings.val_before_train and not log.records:
            record({"step": 0, run_files.ACCURACY: evaluate(0)})
        accuracy = next((r[run_files.ACCURACY] for r in reversed(log.records) if run_files.ACCURACY in r), None)
        every = settings.eval_every_optimizer_steps
        trained = [run_files.optimizer_step(r) for r in log.records if run_files.STEP_SECONDS in r]
        optimizer_steps_done = max(trained, default=0)
        eval_seconds = 0.0

        def after_optimizer_step(k: int) -> None:
            """On the optimizer-step grid: evaluate after every ``every``-th optimizer step, inside the trainer step
            too, as its own metrics line."""
            nonlocal accuracy, eval_seconds
            at = optimizer_steps_done + k
            if at % every == 0:
                eval_start = time.perf_counter()
                accuracy = evaluate(at)
                seconds = time.perf_counter() - eval_start
                eval_seconds += seconds
                record({"step": step, run_files.OPTIMIZER_STEP: at, run_files.ACCURACY: accuracy,
                        "timing/eval_s": seconds})  # fmt: skip

        bar = tqdm(range(done + 1, settings.total_steps + 1), desc=run_dir.name, unit="step", initial=done,
                   total=settings.total_steps, disable=not progress)  # fmt: skip
        for step in bar:
            start = time.perf_counter()
            batch = worker.next_batch(step)
            waited = time.perf_counter() - start
            at_version.model.load_state_dict(store.trainer_weights(batch.version))
            shuffle = torch.Generator().manual_seed(stream_seed(settings.seed, SHUFFLE_STREAM, step))
            eval_seconds = 0.0
            metrics = train_step(policy, optimizer, batch, actor, algo, settings, shuffle, reference, at_version,
                                 None if every is None else after_optimizer_step)  # fmt: skip
            optimizer_steps_done += int(metrics["actor/optimizer_steps"])
            store.publish(step, model.state_dict())
            store.keep_from(schedule.version_for_step(step + 1))
            gaps = schedule.optimizer_step_gaps(step, int(metrics["actor/optimizer_steps"]))
            metrics = {
                "step": step,
                run_files.OPTIMIZER_STEP: step * int(metrics["actor/optimizer_steps"]),  # the same count every step
                "rollout/policy_version": batch.version,
                "rollout/version_gap": schedule.version_gap(step),
                "rollout/optimizer_step_gaps": gaps,
                "rollout/optimizer_step_gap_min": min(gaps),
                "rollout/optimizer_step_gap_max": max(gaps),
                run_files.REWARD: float(batch.scores.mean()),
                "response_length/mean": float(batch.response_mask.sum(-1).float().mean()),
                **metrics,
                "timing/gen_s": batch.gen_seconds,
                "timing/wait_s": waited,
                run_files.STEP_SECONDS: time.perf_counter() - start - eval_seconds,
            }
            metrics["perf/tokens_per_s"] = int(batch.attention_mask.sum()) / metrics["timing/step_s"]
            on_grid_end = every is not None and optimizer_steps_done % every == 0  # evaluated just now
            if _due(step, settings.test_freq, settings.total_steps) if every is None else \
                    step == settings.total_steps and not on_grid_end:  # fmt: skip
                eval_start = time.perf_counter()
                accuracy = metrics[run_files.ACCURACY] = evaluate(step if every is None else optimizer_steps_done)
                metrics["timing/eval_s"] = time.perf_counter() - eval_start
            record(metrics)  # before the checkpoint: a resume from it never lacks this line
            if _due(step, settings.save_freq, settings.total_steps):
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                         "rollout_versions": store.snapshot()}  # fmt: skip
                run_files.save_checkpoint(run_dir / "checkpoints", step, state, settings.keep_checkpoints)
            shown = "-" if accuracy is None else f"{accuracy:.3f}"
            bar.set_postfix(reward=f"{metrics[run_files.REWARD]:.2f}", acc=shown, gap=f"{min(gaps)}..{max(gaps)}")
    finally:
        worker.stop()
        tracker.finish()
    return _finish(run_dir, log.records, settings, actor.clip_ratio_high)


def _due(step: int, freq: int, total: int) -> bool:
    return step == total or (freq > 0 and step % freq == 0)


def _finish(run_dir: Path, records: list[dict], settings: RunSettings, radius: float) -> dict:
    summary = run_files.summarize(records, settings.total_steps, radius)
    run_files.write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2))
    run_files.plot_curves(records, run_dir / "curves.png", run_dir.name)
    return summary
