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
"""Bit-for-bit equality with verl's ``vanilla`` and ``gspo`` when nothing is gated (extreme inputs included), the
exact tail quantile against reference implementations, dtypes and sizes."""

import math
from fractions import Fraction

import pytest
import torch
from conftest import AGG_MODES, LOSS_CASES, QUANTILE_METHODS, actor_config, make_stale_batch, sat_overrides
from verl.trainer.ppo.core_algos import get_policy_loss_fn

from verl_sat.config import SatConfig
from verl_sat.sat_math import sat_gspo_surrogate, sat_token_surrogate, tail_quantile

CASES = [(*case, method) for case in LOSS_CASES for method in QUANTILE_METHODS]
CASE_IDS = [f"{loss}-{gran}-{method}" for loss, gran, _, method in CASES]


def _call_pair(loss, nominal, batch, config, agg, weights=None, dtype=torch.float32):
    args = [t.to(dtype) if t.is_floating_point() else t for t in (batch.old_log_prob, batch.advantages)]
    lp_sat = batch.log_prob.to(dtype).clone().requires_grad_()
    lp_ref = batch.log_prob.to(dtype).clone().requires_grad_()
    out_sat = get_policy_loss_fn(loss)(args[0], lp_sat, args[1], batch.response_mask, agg, config, weights)
    out_ref = get_policy_loss_fn(nominal)(args[0], lp_ref, args[1], batch.response_mask, agg, config, weights)
    out_sat[0].backward()
    out_ref[0].backward()
    return out_sat, out_ref, lp_sat.grad, lp_ref.grad


def _extreme_batch():
    """A stale batch whose log-ratios reach +-50: beyond verl's +-20 clamp, and sequence means far outside it."""
    batch = make_stale_batch(11)
    gen = torch.Generator().manual_seed(1)
    far = torch.rand(batch.log_prob.shape, generator=gen, dtype=torch.float64) < 0.2
    jump = (torch.rand(batch.log_prob.shape, generator=gen, dtype=torch.float64) * 100 - 50).to(batch.log_prob.dtype)
    batch.log_prob = torch.where(far, batch.old_log_prob + jump, batch.log_prob)
    batch.log_prob[5, :] = batch.old_log_prob[5, :] + 45.0  # a whole sequence at s = 45
    return batch


@pytest.mark.parametrize("loss,granularity,nominal,method", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_equal_to_verl_when_nothing_is_gated(loss, granularity, nominal, method, agg, dtype):
    """|lp - lp_old| up to 50 and ``sat.floor`` above every |d|: no unit is gated and SAT is verl's rule exactly, in
    value, gradient and verl's own metrics (``ppo_kl`` included)."""
    config = actor_config(*sat_overrides(loss, granularity, "+actor_rollout_ref.actor.policy_loss.sat.floor=100.0",
                                         f"+actor_rollout_ref.actor.policy_loss.sat.quantile_method={method}"),
                          loss_mode=loss)  # fmt: skip
    batch = _extreme_batch()
    weights = torch.rand(batch.response_mask.shape, dtype=dtype, generator=torch.Generator().manual_seed(0)) + 0.5
    (loss_sat, metrics_sat), (loss_ref, metrics_ref), grad_sat, grad_ref = _call_pair(
        loss, nominal, batch, config, agg, weights, dtype
    )
    assert torch.equal(loss_sat, loss_ref)
    assert torch.equal(grad_sat, grad_ref)
    assert metrics_sat["actor/sat_gate_rate"] == 0.0 and metrics_sat["actor/sat_intercepted_frac"] == 0.0
    assert metrics_sat["actor/ppo_kl"] == metrics_ref["actor/ppo_kl"]  # the same float64 value verl reads
    for key, value in metrics_ref.items():
        assert metrics_sat[key] == pytest.approx(value, abs=1e-7), key


@pytest.mark.parametrize("loss,granularity,nominal,method", CASES, ids=CASE_IDS)
def test_differs_from_verl_when_stale(loss, granularity, nominal, method):
    """The counter-check: with a gate the same stale batch gets a larger loss and other gradients."""
    config = actor_config(*sat_overrides(loss, granularity, "+actor_rollout_ref.actor.policy_loss.sat.quantile=0.5",
                                         f"+actor_rollout_ref.actor.policy_loss.sat.quantile_method={method}"),
                          loss_mode=loss)  # fmt: skip
    batch = make_stale_batch(11)
    (loss_sat, metrics), (loss_ref, _), grad_sat, grad_ref = _call_pair(loss, nominal, batch, config, "token-mean")
    assert metrics["actor/sat_gate_rate"] > 0
    assert loss_sat > loss_ref
    assert not torch.equal(grad_sat, grad_ref)


@pytest.mark.parametrize("loss,granularity,_", LOSS_CASES, ids=[f"{c[0]}-{c[1]}" for c in LOSS_CASES])
def test_bfloat16_inputs(loss, granularity, _):
    """bf16 inputs: loss and gradient stay bf16; the gate is computed in float32 and matches a float32 run on the
    same (bf16-rounded) values."""
    config = actor_config(*sat_overrides(loss, granularity), loss_mode=loss)
    batch = make_stale_batch(12)
    old, lp, adv = (t.bfloat16() for t in (batch.old_log_prob, batch.log_prob, batch.advantages))
    lp = lp.requires_grad_()
    pg_loss, metrics = get_policy_loss_fn(loss)(old, lp, adv, batch.response_mask, "token-mean", config)
    pg_loss.backward()
    assert pg_loss.dtype == torch.bfloat16 and lp.grad.dtype == torch.bfloat16
    assert torch.isfinite(pg_loss) and torch.all(torch.isfinite(lp.grad))
    _, metrics32 = get_policy_loss_fn(loss)(
        old.float(), lp.detach().float(), adv.float(), batch.response_mask, "token-mean", config
    )
    assert metrics["actor/sat_gate_rate"] > 0
    for key in ["actor/sat_gate_rate", "actor/sat_q", "actor/sat_abs_log_ratio_mean"]:
        assert metrics[key] == pytest.approx(metrics32[key], rel=1e-6), key


def _lower_quantile(values: torch.Tensor, alpha: float) -> float:
    """Reference for ``inverted_cdf``: sort, then the ceil(alpha * n)-th smallest with alpha as a decimal."""
    ordered = values.sort().values
    return ordered[max(math.ceil(Fraction(repr(alpha)) * len(ordered)), 1) - 1].item()


@pytest.mark.parametrize("numel", [1, 300, 5000, 40000, 70000])  # the last one above _SORT_MIN_UNITS: a full sort
@pytest.mark.parametrize("kind", ["continuous", "ties", "zeros", "spread"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tail_quantile_matches_references(numel, kind, dtype):
    """``inverted_cdf`` equals the sorted ceil(alpha n)-th value, ``linear`` equals ``torch.quantile``, bit for bit,
    on continuous values, heavy ties, all zeros and values spread over many octaves."""
    gen = torch.Generator().manual_seed(numel)
    if kind == "continuous":
        values = torch.randn(numel, generator=gen, dtype=torch.float64).abs()
    elif kind == "ties":
        values = torch.randint(0, 7, (numel,), generator=gen).double() / 4
    elif kind == "zeros":
        values = torch.zeros(numel, dtype=torch.float64)
    else:
        values = torch.exp(torch.randn(numel, generator=gen, dtype=torch.float64) * 10)
    values = values.to(dtype)
    mask = torch.rand(numel, generator=gen) > 0.3
    mask[0] = True
    for alpha in [0.0, 0.1, 0.5, 0.9, 0.95, 0.999, 1.0]:
        assert tail_quantile(values, mask, alpha).item() == _lower_quantile(values[mask], alpha), alpha
        if dtype == torch.float64:  # torch.quantile's float32 interpolation weight is coarser than ours
            assert torch.equal(tail_quantile(values, mask, alpha, "linear"), torch.quantile(values[mask], alpha))
    assert tail_quantile(values, torch.zeros_like(mask), 0.9).item() == 0.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tail_quantile_in_half_precision(dtype):
    """Half-precision values order as their int16 bit patterns too."""
    gen = torch.Generator().manual_seed(5)
    values = torch.randn(5000, generator=gen).abs().to(dtype)
    mask = torch.rand(5000, generator=gen) > 0.3
    for alpha in [0.1, 0.5, 0.9, 0.99]:
        assert tail_quantile(values, mask, alpha).item() == _lower_quantile(values[mask].float(), alpha), alpha


@pytest.mark.parametrize("num_sequences", [40, 3000])
def test_weighted_tail_quantile_is_the_length_weighted_one(num_sequences):
    """With a weight per entry the quantile is the one of the multiset holding each value ``weight`` times."""
    gen = torch.Generator().manual_seed(num_sequences)
    values = torch.randn(num_sequences, generator=gen).abs()
    weight = torch.randint(0, 40, (num_sequences,), generator=gen)
    mask = weight > 0
    repeated = values.repeat_interleave(weight)
    for alpha in [0.1, 0.5, 0.9, 0.99]:
        assert tail_quantile(values, mask, alpha, weight=weight).item() == _lower_quantile(repeated, alpha)
        expected = torch.quantile(repeated.double(), alpha).float()
        assert tail_quantile(values, mask, alpha, "linear", weight).item() == pytest.approx(expected.item(), rel=1e-6)
    assert tail_quantile(values, torch.zeros_like(mask), 0.9, weight=weight).item() == 0.0  # no weight: 0


def test_more_than_2_pow_24_active_tokens():
    """torch.quantile refuses > 2^24 elements; the SAT quantile and the losses must not."""
    n = 2**24 + 7
    values = torch.randperm(n, generator=torch.Generator().manual_seed(0)).float()  # 0..n-1, exact in float32
    mask = torch.ones(n, dtype=torch.bool)
    k = math.ceil(Fraction(9, 10) * n)
    assert tail_quantile(values, mask, 0.9).item() == k - 1  # the k-th smallest of 0..n-1
    assert tail_quantile(values.double(), mask, 0.9, "linear").item() == pytest.approx(0.9 * (n - 1), abs=1e-6)

    zeros = torch.zeros(1, n)
    log_prob = (values / n).unsqueeze(0)  # |d| uniform in [0, 1)
    with torch.no_grad():
        out = sat_token_surrogate(log_prob, zeros, torch.ones(1, n), mask.unsqueeze(0), 0.2, 0.2, 3.0, SatConfig())
        assert int(out.region.gated.sum()) == n - k
        assert torch.isfinite(out.loss_mat).all()
        rows = torch.rand(4100, 4100, generator=torch.Generator().manual_seed(1))  # 16.8M tokens in 4100 sequences
        seq = sat_gspo_surrogate(rows, torch.zeros_like(rows), torch.ones_like(rows), torch.ones_like(rows).bool(),
                                 0.2, 0.2, SatConfig(), "sequence")  # fmt: skip
        assert seq.region.num_units.item() == 4100 * 4100 > 2**24
        assert seq.region.gated.sum().item() == 4100 - math.ceil(0.9 * 4100)  # equal lengths: 10% of the sequences
