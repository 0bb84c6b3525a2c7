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
"""Exact equality with verl's ``vanilla`` and ``gspo`` when nothing is gated, and dtype/size support."""

import pytest
import torch
from conftest import LOSS_CASES, actor_config, make_stale_batch
from verl.trainer.ppo.core_algos import get_policy_loss_fn

from verl_sat.config import SatConfig
from verl_sat.sat_math import masked_quantile, sat_token_surrogate

AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
CASE_IDS = [f"{loss}-{gran}" for loss, gran, _ in LOSS_CASES]


def _call_pair(loss, nominal, batch, config, agg, weights=None, dtype=torch.float32):
    args = [t.to(dtype) if t.is_floating_point() else t for t in (batch.old_log_prob, batch.advantages)]
    lp_sat = batch.log_prob.to(dtype).clone().requires_grad_()
    lp_ref = batch.log_prob.to(dtype).clone().requires_grad_()
    out_sat = get_policy_loss_fn(loss)(args[0], lp_sat, args[1], batch.response_mask, agg, config, weights)
    out_ref = get_policy_loss_fn(nominal)(args[0], lp_ref, args[1], batch.response_mask, agg, config, weights)
    out_sat[0].backward()
    out_ref[0].backward()
    return out_sat, out_ref, lp_sat.grad, lp_ref.grad


@pytest.mark.parametrize("loss,granularity,nominal", LOSS_CASES, ids=CASE_IDS)
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_equal_to_verl_when_floor_above_every_proxy(loss, granularity, nominal, agg, dtype):
    """Stale batch, but ``sat.floor`` above every |d|: no token is gated and SAT is verl's rule exactly."""
    config = actor_config(f"+actor_rollout_ref.actor.policy_loss.sat.granularity={granularity}",
                          "+actor_rollout_ref.actor.policy_loss.sat.floor=100.0")  # fmt: skip
    batch = make_stale_batch(11)
    weights = torch.rand(batch.response_mask.shape, dtype=dtype, generator=torch.Generator().manual_seed(0)) + 0.5
    (loss_sat, metrics_sat), (loss_ref, metrics_ref), grad_sat, grad_ref = _call_pair(
        loss, nominal, batch, config, agg, weights, dtype
    )
    assert torch.equal(loss_sat, loss_ref)
    assert torch.equal(grad_sat, grad_ref)
    assert metrics_sat["actor/sat_gate_rate"] == 0.0 and metrics_sat["actor/sat_intercepted_frac"] == 0.0
    for key, value in metrics_ref.items():
        assert metrics_sat[key] == pytest.approx(value, abs=1e-7), key


@pytest.mark.parametrize("loss,granularity,nominal", LOSS_CASES, ids=CASE_IDS)
def test_differs_from_verl_when_stale(loss, granularity, nominal):
    """The counter-check: with a gate the same stale batch gets a larger loss and other gradients."""
    config = actor_config(f"+actor_rollout_ref.actor.policy_loss.sat.granularity={granularity}",
                          "+actor_rollout_ref.actor.policy_loss.sat.quantile=0.5")  # fmt: skip
    batch = make_stale_batch(11)
    (loss_sat, metrics), (loss_ref, _), grad_sat, grad_ref = _call_pair(loss, nominal, batch, config, "token-mean")
    assert metrics["actor/sat_gate_rate"] > 0
    assert loss_sat > loss_ref
    assert not torch.equal(grad_sat, grad_ref)


@pytest.mark.parametrize("loss,granularity,_", LOSS_CASES, ids=CASE_IDS)
def test_bfloat16_inputs(loss, granularity, _):
    """bf16 inputs: loss and gradient stay bf16; the gate is computed in float32 and matches a float32 run on the
    same (bf16-rounded) values."""
    config = actor_config(f"+actor_rollout_ref.actor.policy_loss.sat.granularity={granularity}")
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
    for key in ["actor/sat_gate_rate", "actor/sat_quantile", "actor/sat_abs_log_ratio_mean"]:
        assert metrics[key] == pytest.approx(metrics32[key], rel=1e-6), key


def test_masked_quantile_matches_torch_quantile():
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(37, 53, generator=gen, dtype=torch.float64).abs()
    mask = torch.rand(37, 53, generator=gen) > 0.3
    for alpha in [0.0, 0.1, 0.5, 0.9, 0.95, 1.0]:
        assert torch.equal(masked_quantile(values, mask, alpha), torch.quantile(values[mask], alpha))
    assert masked_quantile(values, torch.zeros_like(mask), 0.9).item() == 0.0


@pytest.mark.parametrize("shape", [(300, 1000), (80, 100)])
@pytest.mark.parametrize("kind", ["continuous", "ties", "adversarial_stride"])
def test_masked_quantile_bracket_path_is_exact(kind, shape):
    """Inputs above the bracketing threshold (a sampled bracket, then kthvalue on the candidates) stay exact,
    including many ties and a periodic layout that makes the strided sample miss (the fallback path)."""
    gen = torch.Generator().manual_seed(1)
    numel = shape[0] * shape[1]
    if kind == "continuous":
        values = torch.randn(shape, generator=gen).abs()
    elif kind == "ties":
        values = torch.randint(0, 7, shape, generator=gen).float()
    else:  # every element the stride samples is huge, so the sample's bracket lies far above the true quantile
        flat = torch.rand(numel, generator=gen)
        flat[:: max(numel // (1 << 14), 16)] = 1e6
        values = flat.reshape(shape)
    values = values.double()  # float64: torch.quantile's float32 interpolation weight is coarser than ours
    mask = torch.rand(shape, generator=gen) > 0.25
    for alpha in [0.5, 0.9, 0.95, 0.999]:
        assert torch.equal(masked_quantile(values, mask, alpha), torch.quantile(values[mask], alpha)), alpha


def test_more_than_2_pow_24_active_tokens():
    """torch.quantile refuses > 2^24 elements; the SAT quantile and the loss must not."""
    n = 2**24 + 7
    values = torch.randperm(n, generator=torch.Generator().manual_seed(0)).double()
    mask = torch.ones(n, dtype=torch.bool)
    # sorted values are 0..n-1, so the linear-interpolation quantile is alpha * (n - 1) exactly
    assert masked_quantile(values, mask, 0.9).item() == pytest.approx(0.9 * (n - 1), rel=0, abs=1e-6)

    zeros = torch.zeros(1, n)
    log_prob = (values.float() / n).unsqueeze(0)  # |d| uniform in [0, 1)
    with torch.no_grad():
        out = sat_token_surrogate(log_prob, zeros, torch.ones(1, n), mask.unsqueeze(0), 0.2, 0.2, 3.0, SatConfig())
    assert out.region.gated.sum().item() == pytest.approx(0.1 * n, rel=1e-3)
    assert torch.isfinite(out.loss_mat).all()
