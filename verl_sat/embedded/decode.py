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
"""The embedded engine's decoder: a KV-cache decode loop that returns what SGLang and vLLM return, per sampled token.

For every decode step it keeps the log-prob of the sampled token under the tempered distribution that sampled it
(``log_softmax(logits / temperature)``, the rollout's ``old_log_prob`` mu) and, with a ``RoutingReplay`` attached,
the experts each MoE layer chose for the tokens of that forward (verl's ``routed_experts`` layout). Sampling draws
from a ``torch.Generator`` owned by the caller, never from torch's global RNG, so a thread's draws are its own.
"""

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from verl_sat.routing_replay import RoutingReplay


@dataclass
class Generation:
    """Responses to N prompts; P = padded prompt length, R = ``max_new_tokens``."""

    input_ids: torch.Tensor  # [N, P + R] long: left-padded prompt, right-padded response (pad after eos)
    attention_mask: torch.Tensor  # [N, P + R] bool
    response_mask: torch.Tensor  # [N, R] bool: response tokens up to and including the first eos
    log_probs: torch.Tensor  # [N, R] float32: sampling-time log-prob of each response token (0 where masked)
    routed_experts: torch.Tensor | None  # [N, P + R, num_layers, top_k] int16; zero rows: no route recorded
    prompt_len: int


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, P]`` ids and bool mask of ``rows`` left-padded to their longest."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = torch.tensor(row), True
    return ids, mask


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def generate(
    model: PreTrainedModel,
    prompt_rows: list[list[int]],
    pad_id: int,
    eos_id: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    routing: RoutingReplay | None = None,
) -> Generation:
    """Sample one response per prompt from the full tempered distribution (``generator``), or decode greedily
    (``generator=None``). With ``routing``, record every MoE layer's experts in each forward."""
    device = next(model.parameters()).device
    ids, mask = (t.to(device) for t in left_pad(prompt_rows, pad_id))
    num, prompt_len = ids.shape
    cache = DynamicCache()
    routes: list[torch.Tensor] = []

    def next_token_logits(tokens: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        forward = dict(input_ids=tokens, attention_mask=attention.long(), position_ids=positions,
                       past_key_values=cache, use_cache=True)  # fmt: skip
        if routing is None:
            return model(**forward).logits[:, -1].float()
        with routing.record() as recording:
            logits = model(**forward).logits[:, -1].float()
        routes.append(recording.routed_experts)
        return logits

    logits = next_token_logits(ids, mask, position_ids(mask))
    position = position_ids(mask)[:, -1:]
    finished = torch.zeros(num, dtype=torch.bool, device=device)
    tokens, log_probs, valid = [], [], []
    for step in range(max_new_tokens):
        if generator is None:
            log_softmax = torch.log_softmax(logits, dim=-1)
            token = logits.argmax(dim=-1)
        else:
            log_softmax = torch.log_softmax(logits / temperature, dim=-1)
            token = torch.multinomial(log_softmax.exp(), 1, generator=generator).squeeze(-1)
        valid.append(~finished)
        token = torch.where(finished, pad_id, token)
        tokens.append(token)
        log_probs.append(torch.where(finished, 0.0, log_softmax.gather(-1, token[:, None]).squeeze(-1)))
        finished = finished | (token == eos_id)
        if step + 1 == max_new_tokens or bool(finished.all()):
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        position = position + 1
        logits = next_token_logits(token[:, None], mask, position)

    pad = max_new_tokens - len(tokens)
    response = torch.nn.functional.pad(torch.stack(tokens, dim=1), (0, pad), value=pad_id)
    response_mask = torch.nn.functional.pad(torch.stack(valid, dim=1), (0, pad), value=False)
    attention_mask = torch.cat([mask[:, :prompt_len], response_mask], dim=1)
    routed = None
    if routing is not None:  # prefill, then one forward per response token but the last; zero where masked
        routed = torch.cat(routes, dim=1)
        missing = prompt_len + max_new_tokens - routed.shape[1]
        routed = torch.nn.functional.pad(routed, (0, 0, 0, 0, 0, missing))
        routed = routed * attention_mask[:, :, None, None]
    return Generation(
        input_ids=torch.cat([ids, response], dim=1),
        attention_mask=attention_mask,
        response_mask=response_mask,
        log_probs=torch.nn.functional.pad(torch.stack(log_probs, dim=1), (0, pad)),
        routed_experts=routed,
        prompt_len=prompt_len,
    )


def response_log_probs(logits: torch.Tensor, input_ids: torch.Tensor, prompt_len: int, temperature: float):
    """``[N, R]`` float32 log-probs of the response tokens under ``logits / temperature`` (as verl's actor computes
    them from a full forward over prompt + response)."""
    logits = logits[:, prompt_len - 1 : -1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, prompt_len:, None]).squeeze(-1)
