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
"""Supervised warm start that lands in a target accuracy band, so that RL starts with headroom on any machine.

Next-token training on the train split's reference responses, with greedy accuracy on the validation split (verl's
scorer) measured every ``eval_every`` steps. Training stops at the first evaluation inside the band. An evaluation
above the band rolls the model, optimizer and data stream back to the previous evaluation and continues with
evaluations twice as often, down to every step; accuracy that jumps over the band even then, or never reaches it
within ``max_steps``, is a miss (``BandMissed``).
"""

import copy
from dataclasses import dataclass, field

import torch
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from verl_sat.embedded.evaluate import avg_at_k
from verl_sat.embedded.rollout import PromptSet
from verl_sat.embedded.task import DATA_SOURCE, Problem


class BandMissed(RuntimeError):
    """The warm start did not land in the band; the message says where it ended and what to change."""


@dataclass
class WarmStart:
    """What the warm start did: the steps it took, the loss per step, and every validation evaluation."""

    steps: int = 0
    losses: list[float] = field(default_factory=list)
    evaluations: list[tuple[int, float]] = field(default_factory=list)  # (step, greedy validation accuracy)
    accuracy: float = 0.0  # greedy validation accuracy of the model as it stands (the last kept evaluation)


def chat_prompt(tokenizer: PreTrainedTokenizerFast, problem: Problem) -> str:
    """The problem as verl's RLHFDataset renders it: the chat template with the generation prompt."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": problem.question}], add_generation_prompt=True, tokenize=False
    )


def prompt_set(tokenizer: PreTrainedTokenizerFast, problems: list[Problem]) -> PromptSet:
    """The problems as the engine's prompts (what ``PromptSet.load`` reads from their parquet)."""
    ids = [tokenizer(chat_prompt(tokenizer, p), add_special_tokens=False)["input_ids"] for p in problems]
    return PromptSet(ids, [str(p.answer) for p in problems], [DATA_SOURCE] * len(problems))


def encode_pairs(tokenizer: PreTrainedTokenizerFast, problems: list[Problem]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids`` ``[N, T]`` of chat prompt + reference response + eos, and ``labels`` with -100
    everywhere except the response tokens."""
    rows, labels = [], []
    for p in problems:
        prompt = tokenizer(chat_prompt(tokenizer, p), add_special_tokens=False)["input_ids"]
        response = tokenizer(p.solution() + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        rows.append(prompt + response)
        labels.append([-100] * len(prompt) + response)
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    lab = torch.full((len(rows), width), -100)
    for i, (row, label) in enumerate(zip(rows, labels, strict=True)):
        ids[i, : len(row)], lab[i, : len(label)] = torch.tensor(row), torch.tensor(label)
    return ids, lab


def greedy_accuracy(model: PreTrainedModel, tokenizer, prompts: PromptSet, max_new_tokens: int) -> float:
    """Fraction of prompts whose greedy response verl's GSM8K scorer marks correct."""
    return avg_at_k(model, tokenizer, prompts, 1, max_new_tokens, 1.0, generator=None)


def warm_start(
    model: PreTrainedModel,
    tokenizer,
    train: list[Problem],
    val: list[Problem],
    band: tuple[float, float],
    spec,
    seed: int,
    progress: bool = True,
) -> WarmStart:
    """Train with AdamW until greedy validation accuracy is inside ``band`` (inclusive); see the module docstring."""
    low, high = band
    ids, labels = encode_pairs(tokenizer, train)
    val_prompts = prompt_set(tokenizer, val)
    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.warm_start_lr)
    accuracy = greedy_accuracy(model, tokenizer, val_prompts, spec.max_response_length)
    result = WarmStart(evaluations=[(0, accuracy)], accuracy=accuracy)
    interval = spec.warm_start_eval_every
    saved = _state(model, optimizer, gen, result)
    # progress toward the band, not toward warm_start_max_steps (a cap the warm start rarely reaches): accuracy in
    # points against the band's lower edge, steps in the postfix, no ETA (accuracy does not grow linearly)
    bar = tqdm(total=round(low * 100), desc=f"warm start: greedy val accuracy to the band [{low:.0%}, {high:.0%}]",
               bar_format="{desc} {bar} {n}/{total} %{postfix}", disable=not progress)  # fmt: skip
    bar.n = min(round(accuracy * 100), bar.total)
    while low > result.accuracy:
        if result.steps >= spec.warm_start_max_steps:
            bar.close()
            raise BandMissed(
                f"the warm start stopped at its {spec.warm_start_max_steps} steps with greedy validation accuracy "
                f"{result.accuracy:.1%}, below the band [{low:.0%}, {high:.0%}]: lower the band (--band) or raise "
                "warm_start_max_steps"
            )
        model.train()
        for _ in range(min(interval, spec.warm_start_max_steps - result.steps)):
            pick = torch.randint(0, len(train), (spec.warm_start_batch,), generator=gen)
            mask = (ids[pick] != tokenizer.pad_token_id).long()
            loss = model(input_ids=ids[pick], attention_mask=mask, labels=labels[pick]).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            result.losses.append(loss.item())
            result.steps += 1
        accuracy = greedy_accuracy(model, tokenizer, val_prompts, spec.max_response_length)
        result.evaluations.append((result.steps, accuracy))
        bar.n = min(round(accuracy * 100), bar.total)
        bar.set_postfix_str(f"step {result.steps} (at most {spec.warm_start_max_steps}), evaluated every {interval}")
        if accuracy > high:  # jumped over the band: back to the last evaluation, evaluate twice as often
            if interval == 1:
                bar.close()
                raise BandMissed(
                    f"greedy validation accuracy went from {result.accuracy:.1%} to {accuracy:.1%} in one "
                    f"step, over the band [{low:.0%}, {high:.0%}]: widen the band (--band) or lower warm_start_lr"
                )
            _restore(model, optimizer, gen, result, saved)
            interval = max(1, interval // 2)
        else:
            result.accuracy = accuracy
            saved = _state(model, optimizer, gen, result)
    bar.close()
    if result.accuracy > high:
        raise BandMissed(
            f"the initial policy already scores {result.accuracy:.1%}, above the band [{low:.0%}, {high:.0%}]"
        )
    model.eval()
    return result


def _state(model, optimizer, gen, result: WarmStart) -> dict:
    return {
        "model": copy.deepcopy(model.state_dict()),
        "optimizer": copy.deepcopy(optimizer.state_dict()),
        "generator": gen.get_state(),
        "steps": result.steps,
        "losses": len(result.losses),
        "accuracy": result.accuracy,
    }


def _restore(model, optimizer, gen, result: WarmStart, saved: dict) -> None:
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    gen.set_state(saved["generator"])
    result.steps, result.accuracy = saved["steps"], saved["accuracy"]
    del result.losses[saved["losses"] :]
