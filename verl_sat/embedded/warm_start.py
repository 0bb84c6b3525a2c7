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
"""Supervised warm start: a few epochs of next-token training on the train split's reference responses, so that
RL starts from a policy with partial accuracy. Greedy accuracy is measured with verl's own scorer."""

import torch
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerFast
from verl.utils.reward_score import default_compute_score

from verl_sat.embedded.task import DATA_SOURCE, Problem


def chat_prompt(tokenizer: PreTrainedTokenizerFast, problem: Problem) -> str:
    """The problem as verl's RLHFDataset renders it: the chat template with the generation prompt."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": problem.question}], add_generation_prompt=True, tokenize=False
    )


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


def warm_start(model: PreTrainedModel, tokenizer, problems: list[Problem], steps: int, batch_size: int, lr: float,
               seed: int) -> list[float]:  # fmt: skip
    """Train on reference responses with AdamW; returns the loss per step."""
    ids, labels = encode_pairs(tokenizer, problems)
    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for _ in tqdm(range(steps), desc="warm start", unit="step", disable=steps < 20):
        pick = torch.randint(0, len(problems), (batch_size,), generator=gen)
        mask = (ids[pick] != tokenizer.pad_token_id).long()
        loss = model(input_ids=ids[pick], attention_mask=mask, labels=labels[pick]).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    return losses


@torch.no_grad()
def greedy_accuracy(model: PreTrainedModel, tokenizer, problems: list[Problem], max_new_tokens: int = 10) -> float:
    """Fraction of problems whose greedy response verl's GSM8K scorer marks correct."""
    prompts = [chat_prompt(tokenizer, p) for p in problems]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    scores = [default_compute_score(DATA_SOURCE, t, str(p.answer)) for t, p in zip(texts, problems, strict=True)]
    return sum(scores) / len(scores)
