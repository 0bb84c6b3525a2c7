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
"""avg@k on a split: k responses per problem (``rollout.val_kwargs``), scored by verl's reward functions; the
accuracy is the mean score (the paper's AIME24 avg@k at this scale). Sampling draws from the generator it is given."""

import torch

from verl_sat.embedded.decode import generate
from verl_sat.embedded.rollout import PromptSet, score


@torch.no_grad()
def avg_at_k(
    model,
    tokenizer,
    prompts: PromptSet,
    k: int,
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator | None,
    chunk: int = 1024,
) -> float:
    """Mean verl score over ``k`` sampled responses to each prompt of the split, or of one greedy response each
    (``generator=None``)."""
    was_training = model.training
    model.eval()
    index = [i for i in range(len(prompts)) for _ in range(k if generator is not None else 1)]
    total = 0.0
    for start in range(0, len(index), chunk):
        part = index[start : start + chunk]
        out = generate(model, [prompts.prompt_ids[i] for i in part], tokenizer.pad_token_id, tokenizer.eos_token_id,
                       max_new_tokens, temperature, generator=generator)  # fmt: skip
        total += float(score(tokenizer, out.input_ids.cpu(), out.prompt_len, prompts, part).sum())
    model.train(was_training)
    return total / len(index)
