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
"""The embedded rollout engine: its own copy of the policy in ``rollout.dtype`` (verl's default bfloat16), sampling in
a background thread with an exact lag.

The trainer publishes every weight version (``WeightStore``: a copy in the rollout's dtype and the fp32
weights, which the staleness attribution reads); the worker waits for the version ``LagSchedule`` names for each
step, so it runs exactly ``ahead`` batches ahead and overlaps generation with training. Sampling draws from a
generator seeded by (seed, step), owned by the worker thread: the same seed gives the same batches at any lag.
"""

import queue
import threading
import time
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from transformers import PreTrainedModel
from verl.utils.reward_score import default_compute_score

from verl_sat.embedded.decode import generate
from verl_sat.embedded.schedule import LagSchedule
from verl_sat.routing_replay import RoutingReplay


def stream_seed(seed: int, stream: int, index: int) -> int:
    """Seed of one random stream: ``stream`` tells rollout, evaluation and shuffling apart, ``index`` the step."""
    return (seed * 1_000_003 + stream) * 1_000_033 + index


ROLLOUT_STREAM, EVAL_STREAM, SHUFFLE_STREAM = 1, 2, 3


class WeightStore:
    """Weight versions by number, shared by the trainer (publish) and the rollout worker (wait): a state dict in the
    rollout's ``dtype`` for the rollout engine and the fp32 one for the attribution forward."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16):
        self.dtype = dtype
        self._states: dict[int, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}
        self._cond = threading.Condition()

    def publish(self, version: int, state: dict[str, torch.Tensor]) -> None:
        fp32 = {k: v.detach().to(torch.float32, copy=True) for k, v in state.items()}
        rollout = {k: v.to(self.dtype) for k, v in fp32.items()}  # a float32 rollout shares the trainer's tensors
        with self._cond:
            self._states[version] = (rollout, fp32)
            self._cond.notify_all()

    def wait(self, version: int, stop: threading.Event) -> dict[str, torch.Tensor] | None:
        """The rollout's state of ``version`` once published; ``None`` if ``stop`` is set first."""
        with self._cond:
            while version not in self._states and not stop.is_set():
                self._cond.wait(timeout=0.1)
            return self._states[version][0] if version in self._states else None

    def trainer_weights(self, version: int) -> dict[str, torch.Tensor]:
        """The fp32 weights of ``version`` (the trainer's own, before the rollout's cast)."""
        with self._cond:
            return self._states[version][1]

    def keep_from(self, version: int) -> None:
        """Drop versions older than ``version`` (no future batch needs them)."""
        with self._cond:
            for v in [v for v in self._states if v < version]:
                del self._states[v]

    def snapshot(self) -> dict[int, dict[str, torch.Tensor]]:
        """The fp32 state of every kept version (what a checkpoint stores)."""
        with self._cond:
            return {v: states[1] for v, states in self._states.items()}


@dataclass
class PromptSet:
    """Tokenized chat prompts and ground truths of one parquet split (verl's RL format)."""

    prompt_ids: list[list[int]]
    ground_truths: list[str]
    data_sources: list[str]

    @classmethod
    def load(cls, path: str, tokenizer) -> "PromptSet":
        frame = pd.read_parquet(path)
        prompts = [
            tokenizer.apply_chat_template(list(p), add_generation_prompt=True, tokenize=False) for p in frame["prompt"]
        ]
        ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        return cls(ids, [str(r["ground_truth"]) for r in frame["reward_model"]], list(frame["data_source"]))

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def for_step(self, step: int, batch_prompts: int, seed: int) -> list[int]:
        """Prompt indices of trainer step ``step`` (1-based): epochs of a seeded permutation, the same on resume."""
        start = (step - 1) * batch_prompts
        out = []
        while len(out) < batch_prompts:
            epoch, offset = divmod(start + len(out), len(self))
            order = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
            out += order[offset : offset + batch_prompts - len(out)].tolist()
        return out


@dataclass
class RolloutBatch:
    """One trainer step's batch; N = prompts x rollout.n (a prompt's responses adjacent), T = P + R."""

    step: int
    version: int  # weight version that sampled it
    input_ids: torch.Tensor  # [N, T]
    attention_mask: torch.Tensor  # [N, T] bool
    response_mask: torch.Tensor  # [N, R] bool: response tokens up to and including eos
    rollout_log_prob: torch.Tensor  # [N, R] float32: mu, the sampling-time log-prob of each response token
    routed_experts: torch.Tensor | None  # [N, T, num_layers, top_k] int16, recorded during decode (R3 recipes)
    scores: torch.Tensor  # [N] float32: verl's reward score of each response
    uids: np.ndarray  # [N] prompt index: the GRPO group of each response
    gen_seconds: float

    @property
    def prompt_len(self) -> int:
        return self.input_ids.shape[1] - self.response_mask.shape[1]


def score(tokenizer, input_ids: torch.Tensor, prompt_len: int, prompts: PromptSet, index: list[int]) -> torch.Tensor:
    """verl's reward score (``default_compute_score``) of each response."""
    texts = tokenizer.batch_decode(input_ids[:, prompt_len:], skip_special_tokens=True)
    return torch.tensor(
        [
            float(default_compute_score(prompts.data_sources[i], text, prompts.ground_truths[i]))
            for text, i in zip(texts, index, strict=True)
        ]
    )


class RolloutEngine:
    """The rollout policy in ``settings.rollout_dtype``: samples ``rollout.n`` responses per prompt with the engine's
    decoder, returning the sampling-time log-probs and, for R3, the routes of each decode step."""

    def __init__(self, policy: PreTrainedModel, tokenizer, prompts: PromptSet, settings):
        self.model = policy.to(settings.rollout_dtype).eval()
        self.tokenizer, self.prompts, self.settings = tokenizer, prompts, settings
        self.routing = RoutingReplay.attach(self.model) if settings.routing_replay else None
        self.version = -1

    def load(self, version: int, state: dict[str, torch.Tensor]) -> None:
        if version != self.version:
            self.model.load_state_dict(state)
            self.version = version

    def generate(self, step: int) -> RolloutBatch:
        s, start = self.settings, time.perf_counter()
        index = [i for i in self.prompts.for_step(step, s.batch_prompts, s.seed) for _ in range(s.n)]
        out = generate(
            self.model,
            [self.prompts.prompt_ids[i] for i in index],
            self.tokenizer.pad_token_id,
            self.tokenizer.eos_token_id,
            s.max_response_length,
            s.temperature,
            generator=torch.Generator().manual_seed(stream_seed(s.seed, ROLLOUT_STREAM, step)),
            routing=self.routing,
        )
        return RolloutBatch(
            step=step,
            version=self.version,
            input_ids=out.input_ids.cpu(),
            attention_mask=out.attention_mask.cpu(),
            response_mask=out.response_mask.cpu(),
            rollout_log_prob=out.log_probs.cpu(),
            routed_experts=None if out.routed_experts is None else out.routed_experts.cpu(),
            scores=score(self.tokenizer, out.input_ids.cpu(), out.prompt_len, self.prompts, index),
            uids=np.array(index),
            gen_seconds=time.perf_counter() - start,
        )


class RolloutWorker(threading.Thread):
    """Generates the batches of steps ``first..last`` in order, each from the version the schedule names."""

    def __init__(self, engine: RolloutEngine, store: WeightStore, schedule: LagSchedule, first: int, last: int):
        super().__init__(name="verl-sat-rollout", daemon=True)
        self.engine, self.store, self.schedule, self.first, self.last = engine, store, schedule, first, last
        self.batches: queue.Queue = queue.Queue()
        self.stop_event = threading.Event()

    def run(self) -> None:
        try:
            for step in range(self.first, self.last + 1):
                version = self.schedule.version_for_step(step)
                state = self.store.wait(version, self.stop_event)
                if state is None:
                    return
                self.engine.load(version, state)
                self.batches.put(self.engine.generate(step))
        except BaseException as err:  # surfaced in the trainer thread by next_batch
            self.batches.put(err)

    def next_batch(self, step: int) -> RolloutBatch:
        item = self.batches.get()
        if isinstance(item, BaseException):
            raise RuntimeError("the rollout worker failed") from item
        assert item.step == step, f"rollout batch of step {item.step} arrived for step {step}"
        return item

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=30)
