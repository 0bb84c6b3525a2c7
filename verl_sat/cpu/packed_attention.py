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
"""``attn_implementation=packed_sdpa``: flash-attention's packed-sequence interface, computed by PyTorch's SDPA, for
CPU runs of verl's FSDP engine with Ulysses sequence parallelism.

verl's Ulysses patch (``verl.models.transformers.monkey_patch``) wraps transformers' flash-attention entry point
(``transformers.integrations.flash_attention._flash_attention_forward``) with its all-to-all and then calls the
flash-attention kernel, which needs a GPU; under ``sdpa`` the patch is never reached and each rank attends within its
own slice of the sequence. ``packed_sdpa`` is transformers' own ``flash_attention_forward`` registered under a new
name, with the kernel it ends in, in transformers and in verl's wrapper, replaced by ``packed_attention``: causal
attention within each packed sequence (sequences start where ``position_ids`` is 0), by ``scaled_dot_product_attention``
with a block-diagonal mask. Registered only in CPU runs (``verl_sat.cpu.activate``); a GPU run keeps flash-attention.
"""

import torch

NAME = "packed_sdpa"


def packed_attention(
    query_states: torch.Tensor,
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    attention_mask: torch.Tensor | None,
    query_length: int,
    is_causal: bool = True,
    dropout: float = 0.0,
    position_ids: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    **kwargs,
) -> torch.Tensor:
    """Flash-attention's ``_flash_attention_forward`` contract on packed input.

    Args:
        query_states: ``[1, S, H, D]``; key_states, value_states: ``[1, S, H_kv, D]`` (``H`` a multiple of ``H_kv``).
        attention_mask: must be ``None`` (packed input carries no padding mask).
        position_ids: ``[1, S]``, restarting at 0 where each packed sequence starts.

    Returns:
        ``[1, S, H, D]``.
    """
    if attention_mask is not None or position_ids is None or query_states.shape[0] != 1:
        raise ValueError(
            f"{NAME} computes packed input only (batch 1, position_ids, no attention_mask); got query "
            f"{tuple(query_states.shape)}, attention_mask {'set' if attention_mask is not None else 'None'}, "
            f"position_ids {'None' if position_ids is None else tuple(position_ids.shape)}: set "
            "actor_rollout_ref.model.use_remove_padding=True"
        )
    positions = position_ids.reshape(-1)
    sequence = torch.cumsum(positions == 0, dim=0)  # [S] id of the packed sequence each token belongs to
    index = torch.arange(positions.numel(), device=positions.device)
    mask = sequence.unsqueeze(1) == sequence.unsqueeze(0)
    if is_causal:
        mask = mask & (index.unsqueeze(1) >= index.unsqueeze(0))
    out = torch.nn.functional.scaled_dot_product_attention(
        query_states.transpose(1, 2), key_states.transpose(1, 2), value_states.transpose(1, 2), attn_mask=mask,
        dropout_p=dropout, scale=softmax_scale, enable_gqa=query_states.shape[2] != key_states.shape[2],
    )  # fmt: skip
    return out.transpose(1, 2)


def register() -> None:
    """Register ``packed_sdpa`` with transformers and route flash-attention's kernel calls, transformers' and verl's
    Ulysses wrapper's, to ``packed_attention`` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.integrations import flash_attention
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    from verl.models.transformers import monkey_patch

    AttentionInterface.register(NAME, flash_attention.flash_attention_forward)
    AttentionMaskInterface.register(NAME, flash_attention_mask)
    if flash_attention._flash_attention_forward is not monkey_patch._ulysses_flash_attention_forward:
        flash_attention._flash_attention_forward = packed_attention
    monkey_patch._flash_attention_forward = packed_attention
