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
"""``verl-sat train``: asynchronous RL on one machine with an exact policy lag (see ``rollout`` for the versions).

The trainer (fp32) runs in the calling thread and the rollout engine (bf16 copy) in a background thread; the loss,
advantages, reward and optimizer are verl's (``ppo_update``). A re-run of the same command resumes from the latest
checkpoint; a run that already finished only prints its summary.
"""

import copy
import json
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config.optimizer import build_optimizer

from verl_sat.embedded import run_files
from verl_sat.embedded.evaluate import avg_at_k
from verl_sat.embedded.ppo_update import ppo_update
from verl_sat.embedded.rollout import PromptSet, RolloutEngine, RolloutWorker, WeightStore
from verl_sat.embedded.run_config import EmbeddedConfigError, RunSettings
from verl_sat.routing_replay import RoutingReplay


def _config_diff(old: dict, new: dict, prefix: str = "") -> str | None:
    """The first key whose value differs between two resolved configs."""
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            found = _config_diff(a, b, f"{prefix}{key}.")
            if found:
                return found
        elif a != b:
            return f"{prefix}{key}: {a!r} (run) vs {b!r} (now)"
    return None


def _prepare_run_dir(config: DictConfig, settings: RunSettings) -> None:
    """Create the run folder with the resolved config, or check that a re-run asks for the same config."""
    resolved = OmegaConf.to_container(config, resolve=True)
    path = settings.run_dir / "config.yaml"
    if path.exists():
        diff = _config_diff(OmegaConf.to_container(OmegaConf.load(path)), resolved)
        if diff:
            raise EmbeddedConfigError(
                f"{settings.run_dir} holds a run with another config ({diff}); choose another "
                "trainer.experiment_name or delete the folder"
            )
        return
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    run_files.write_atomic(path, OmegaConf.to_yaml(OmegaConf.create(resolved)))


def train(config: DictConfig, settings: RunSettings, progress: bool = True) -> dict:
    """Run (or resume) the embedded asynchronous RL loop; returns the summary written to ``summary.json``."""
    _prepare_run_dir(config, settings)
    run_dir, device = settings.run_dir, torch.device(settings.device)
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    algo = omega_conf_to_dataclass(config.algorithm)
    tokenizer = AutoTokenizer.from_pretrained(settings.model_path)
    model = AutoModelForCausalLM.from_pretrained(settings.model_path, dtype=torch.float32).to(device).train()
    optimizer = build_optimizer(model.parameters(), actor.optim)
    train_prompts = PromptSet.load(settings.train_file, tokenizer)
    test_prompts = PromptSet.load(settings.test_file, tokenizer)
    store = WeightStore()
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
        store.publish(0, model)
    log = run_files.MetricsLog(run_dir / "metrics.jsonl", resume_step=done)
    if done >= settings.total_steps:
        return _finish(run_dir, log.records, settings)

    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=done + 1)
    engine = RolloutEngine(copy.deepcopy(model), tokenizer, train_prompts, settings)
    routing = RoutingReplay.attach(model) if settings.routing_replay else None
    worker = RolloutWorker(engine, store, settings.lag, done + 1, settings.total_steps)
    worker.start()
    generator = torch.Generator().manual_seed(settings.seed)

    def evaluate(step: int) -> float:
        return avg_at_k(
            model,
            tokenizer,
            test_prompts,
            settings.val_n,
            settings.max_response_length,
            settings.val_temperature,
            settings.val_do_sample,
            seed=settings.seed + 7919 * step,
        )

    def record(metrics: dict) -> None:
        log.append(metrics)
        for key, value in metrics.items():
            if key != "step":
                writer.add_scalar(key, value, metrics["step"])

    try:
        if done == 0 and settings.val_before_train:
            record({"step": 0, run_files.ACCURACY: evaluate(0)})
        accuracy = next((r[run_files.ACCURACY] for r in reversed(log.records) if run_files.ACCURACY in r), None)
        bar = tqdm(
            range(done + 1, settings.total_steps + 1),
            desc=settings.run_dir.name,
            unit="step",
            initial=done,
            total=settings.total_steps,
            disable=not progress,
        )
        for step in bar:
            start = time.perf_counter()
            batch = worker.next_batch(step)
            waited = time.perf_counter() - start
            metrics = ppo_update(
                model, optimizer, batch, actor, algo, settings.n, settings.temperature, routing, generator
            )
            store.publish(step, model)
            store.keep_from(step - settings.lag)
            tokens = int(batch.attention_mask.sum())
            metrics = {
                "step": step,
                "rollout/policy_version": batch.version,
                "rollout/version_gap": step - 1 - batch.version,
                run_files.REWARD: float(batch.scores.mean()),
                "response_length/mean": float(batch.response_mask.sum(-1).float().mean()),
                **metrics,
                "timing/gen_s": batch.gen_seconds,
                "timing/wait_s": waited,
                "timing/step_s": time.perf_counter() - start,
            }
            metrics["perf/tokens_per_s"] = tokens / metrics["timing/step_s"]
            if _due(step, settings.test_freq, settings.total_steps):
                eval_start = time.perf_counter()
                accuracy = metrics[run_files.ACCURACY] = evaluate(step)
                metrics["timing/eval_s"] = time.perf_counter() - eval_start
            record(metrics)  # before the checkpoint: a resume from it never lacks this line
            if _due(step, settings.save_freq, settings.total_steps):
                state = {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "rollout_versions": store.snapshot(),
                }
                run_files.save_checkpoint(run_dir / "checkpoints", step, state, settings.keep_checkpoints)
            bar.set_postfix(
                reward=f"{metrics[run_files.REWARD]:.2f}",
                acc="-" if accuracy is None else f"{accuracy:.3f}",
                lag=metrics["rollout/version_gap"],
            )
    finally:
        worker.stop()
        writer.close()
    return _finish(run_dir, log.records, settings)


def _due(step: int, freq: int, total: int) -> bool:
    return step == total or (freq > 0 and step % freq == 0)


def _finish(run_dir: Path, records: list[dict], settings: RunSettings) -> dict:
    summary = run_files.summarize(records, settings.total_steps)
    run_files.write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2))
    run_files.plot_curves(records, run_dir / "curves.png", run_dir.name)
    return summary
