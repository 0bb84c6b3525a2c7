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
"""``attn_implementation=packed_sdpa`` (``verl_sat.cpu.packed_attention``): flash-attention's packed interface over
SDPA, the kernel verl's Ulysses wrapper ends in on the CPU. Exact against per-sequence attention, and pinned to the
transformers and verl code it plugs into."""

import inspect

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.integrations import flash_attention
from verl.models.transformers import monkey_patch

from verl_sat.cpu import packed_attention
from verl_sat.cpu.packed_attention import NAME
from verl_sat.cpu.packed_attention import packed_attention as attend

LENGTHS = [5, 1, 7]


def _positions() -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)


def test_packed_attention_is_causal_attention_within_each_sequence():
    gen = torch.Generator().manual_seed(0)
    total, heads, kv_heads, dim = sum(LENGTHS), 4, 2, 8
    q = torch.randn(1, total, heads, dim, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, total, kv_heads, dim, generator=gen, dtype=torch.float64) for _ in range(2))
    out = attend(q, k, v, None, total, position_ids=_positions(), softmax_scale=0.3)
    assert out.shape == q.shape
    start = 0
    for n in LENGTHS:
        rows = slice(start, start + n)
        qs, ks, vs = (t[:, rows].transpose(1, 2) for t in (q, k, v))
        expected = torch.nn.functional.scaled_dot_product_attention(qs, ks.repeat_interleave(2, 1),
                                                                    vs.repeat_interleave(2, 1), is_causal=True,
                                                                    scale=0.3)  # fmt: skip
        torch.testing.assert_close(out[:, rows], expected.transpose(1, 2), rtol=1e-12, atol=1e-12)
        start += n


def test_packed_attention_refuses_padded_input():
    q = torch.zeros(2, 4, 2, 8)
    with pytest.raises(ValueError, match="use_remove_padding=True"):
        attend(q, q, q, torch.ones(2, 4), 4, position_ids=torch.arange(4).expand(2, 4))


def test_a_model_on_packed_sdpa_equals_its_per_sequence_forwards(monkeypatch):
    """A Qwen3-MoE forward on packed input under ``packed_sdpa`` equals the per-sequence forwards under ``sdpa``."""
    monkeypatch.setattr(flash_attention, "_flash_attention_forward", flash_attention._flash_attention_forward)
    monkeypatch.setattr(monkey_patch, "_flash_attention_forward", monkey_patch._flash_attention_forward)
    packed_attention.register()
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=40, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2, num_experts=4,
                            num_experts_per_tok=2)  # fmt: skip
    model = Qwen3MoeForCausalLM(config).eval()
    ids = torch.randint(1, 40, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model.set_attn_implementation(NAME)
        packed = model(input_ids=ids, position_ids=_positions()).logits
        model.set_attn_implementation("sdpa")
        alone = torch.cat([model(input_ids=part).logits for part in ids.split(LENGTHS, dim=1)], dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def test_pinned_where_verls_ulysses_wrapper_and_transformers_call_the_kernel():
    """transformers' ``flash_attention_forward`` calls its module's ``_flash_attention_forward``, which verl's Ulysses
    patch replaces with a wrapper calling the kernel its own module imported: the two names ``register`` routes."""
    assert "attn_output = _flash_attention_forward(" in inspect.getsource(flash_attention.flash_attention_forward)
    assert "from transformers.modeling_flash_attention_utils import _flash_attention_forward" in inspect.getsource(
        monkey_patch
    )
    wrapper = inspect.getsource(monkey_patch._ulysses_flash_attention_forward)
    assert "attn_output = _flash_attention_forward(" in wrapper and "gather_seq_scatter_heads(" in wrapper
    assert "flash_attention._flash_attention_forward = _ulysses_flash_attention_forward" in inspect.getsource(
        monkey_patch.apply_monkey_patch
    )
