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
"""Hand-computed SAT cases: known d, q and advantages; bounds, factors and loss written out."""

import math

import pytest
import torch
from conftest import actor_config
from verl.trainer.ppo.core_algos import get_policy_loss_fn

from verl_sat.config import SatConfig
from verl_sat.sat_math import sat_gspo_surrogate, sat_token_surrogate, tail_quantile

# Five tokens of one sequence, lp_old = 0 so d = lp. |d| = [0, .1, .2, .4, .8]; quantile 0.5 -> k = ceil(2.5) = 3,
# q = 0.2 (linear interpolation gives the same middle order statistic); tokens 3 and 4 are gated. Hill n=2:
# kappa = q^2 / (q^2 + a^2) = 0.04/0.20 = 1/5 and 0.04/0.68 = 1/17.
D = [0.0, 0.1, -0.2, 0.4, -0.8]
ADV = [1.0, 1.0, -1.0, 1.0, -1.0]
EPS = 0.2


def _token_case(gate: SatConfig):
    log_prob = torch.tensor([D], dtype=torch.float64)
    zeros = torch.zeros_like(log_prob)
    mask = torch.ones_like(log_prob, dtype=torch.bool)
    return sat_token_surrogate(log_prob, zeros, torch.tensor([ADV], dtype=torch.float64), mask, EPS, EPS, 3.0, gate)


def test_hill_kernel_bounds_and_loss():
    out = _token_case(SatConfig(quantile=0.5))
    assert out.region.quantile.item() == pytest.approx(0.2)
    assert out.region.gated.tolist() == [[False, False, False, True, True]]
    assert out.region.kappa[0].tolist() == pytest.approx([1, 1, 1, 1 / 5, 1 / 17])
    # token 3 drifted up (d > 0): upper endpoint 1 + 0.2/5; token 4 drifted down: lower endpoint 1 - 0.2/17
    assert out.region.upper[0].tolist() == pytest.approx([1.2, 1.2, 1.2, 1.04, 1.2])
    assert out.region.lower[0].tolist() == pytest.approx([0.8, 0.8, 0.8, 0.8, 1 - 0.2 / 17])
    expected = [
        -1.0,  # r = 1, A = 1
        -math.exp(0.1),  # inside the interval
        math.exp(-0.2),  # A = -1, r = 0.8187 inside [0.8, 1.2]
        -1.04,  # A = 1, r = e^0.4 = 1.49 above hi = 1.04: clipped at 1.04 (nominal: 1.2)
        1 - 0.2 / 17,  # A = -1, r = e^-0.8 = 0.449 below lo: max(r, lo) = lo (nominal: 0.8); dual clip 3 inactive
    ]
    assert out.loss_mat[0].tolist() == pytest.approx(expected)
    assert out.intercepted[0].tolist() == [False, False, False, False, False]  # both were clipped nominally too


def test_hill_shifted_kernel_and_min_scale():
    # hill_shifted: kappa = 1 / (1 + ((a - q) / q)^2) = 1/2 for a = 0.4 and 1/10 for a = 0.8; min_scale lifts 1/10
    out = _token_case(SatConfig(quantile=0.5, kernel="hill_shifted", min_scale=0.3))
    assert out.region.kappa[0, 3:].tolist() == pytest.approx([0.5, 0.3])
    assert out.region.upper[0, 3].item() == pytest.approx(1.1)
    assert out.region.lower[0, 4].item() == pytest.approx(1 - 0.2 * 0.3)


def test_kernel_exponent():
    # n = 1: kappa = q / (q + a) = 0.2/0.6 and 0.2/1.0; a fractional n on ungated units stays finite (no NaN)
    assert _token_case(SatConfig(quantile=0.5, kernel_exponent=1.0)).region.kappa[0, 3:].tolist() == pytest.approx(
        [1 / 3, 1 / 5]
    )
    shifted = _token_case(SatConfig(quantile=0.5, kernel="hill_shifted", kernel_exponent=1.5)).region
    assert torch.all(torch.isfinite(shifted.lower)) and shifted.kappa[0, 3].item() == pytest.approx(1 / (1 + 1**1.5))


def test_floor_disables_gate():
    out = _token_case(SatConfig(quantile=0.5, floor=0.3))  # q = 0.2 is not above the floor
    assert not out.region.gated.any()
    assert out.region.upper[0].tolist() == pytest.approx([1.2] * 5)


def test_newly_intercepted_token():
    # One token with d = 0.15 (r = 1.1618, inside the nominal [0.8, 1.2]) in a batch whose q makes it gated.
    log_prob = torch.tensor([[0.15, 0.05, 0.05, 0.05]], dtype=torch.float64, requires_grad=True)
    zeros = torch.zeros_like(log_prob)
    mask = torch.ones_like(log_prob, dtype=torch.bool)
    out = sat_token_surrogate(log_prob, zeros, torch.ones_like(zeros), mask, EPS, EPS, 3.0, SatConfig(quantile=0.5))
    # q = 0.05, kappa = 0.0025 / (0.0025 + 0.0225) = 0.1, hi = 1.02 < r: clipped by SAT only
    assert out.region.upper[0, 0].item() == pytest.approx(1.02)
    assert out.loss_mat[0, 0].item() == pytest.approx(-1.02)
    assert out.intercepted[0].tolist() == [True, False, False, False]
    out.loss_mat.sum().backward()
    assert log_prob.grad[0, 0].item() == 0.0
    assert log_prob.grad[0, 1].item() == pytest.approx(-math.exp(0.05))


def test_quantile_rank_63_of_70():
    """alpha 0.9 over 70 active values is the 63rd smallest, k = ceil(0.9 * 70) = 63, no interpolation; linear
    interpolation gives the value 62.1 positions up."""
    values = torch.randperm(70, generator=torch.Generator().manual_seed(0)).double() + 1.0  # 1..70, shuffled
    mask = torch.ones(70, dtype=torch.bool)
    assert tail_quantile(values, mask, 0.9).item() == 63.0
    assert tail_quantile(values, mask, 0.9, "linear").item() == pytest.approx(1.0 + 0.9 * 69)
    # inactive entries do not count: 100 values, the 30 masked ones huge, still the 63rd of the 70 active
    padded = torch.cat([values, torch.full((30,), 1e9, dtype=torch.float64)])
    assert tail_quantile(padded, torch.arange(100) < 70, 0.9).item() == 63.0


def test_quantile_rank_is_exact_for_the_decimal_written():
    """alpha 0.07 over 100 values: 0.07 * 100 is 7.000000000000001 in binary floating point (ceil 8), but the rank of
    the decimal 0.07 is exactly 7."""
    assert math.ceil(0.07 * 100) == 8  # the binary-float trap
    values = torch.arange(1, 101, dtype=torch.float32)
    assert tail_quantile(values, torch.ones(100, dtype=torch.bool), 0.07).item() == 7.0


def _three_sequences():
    """Sequences of 1, 1 and 18 tokens with s = 0.5, 0.4, 0.1 (lp_old = 0, every token of a sequence at s_i)."""
    lengths, s = [1, 1, 18], [0.5, 0.4, 0.1]
    mask = torch.arange(18).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    log_prob = torch.tensor(s, dtype=torch.float64).unsqueeze(1).expand(3, 18) * mask
    return log_prob, torch.zeros_like(log_prob), torch.ones_like(log_prob), mask


def test_length_weighted_and_uniform_quantiles_gate_different_sequences():
    """alpha 0.5. Uniform (each sequence once): k = ceil(1.5) = 2 of {0.1, 0.4, 0.5}, q = 0.4, sequence 0 gated.
    Length-weighted: 0.1 eighteen times, 0.4, 0.5; k = ceil(10) = 10, q = 0.1: sequences 0 and 1 gated."""
    log_prob, old, adv, mask = _three_sequences()
    uniform = sat_gspo_surrogate(log_prob, old, adv, mask, EPS, EPS, SatConfig(quantile=0.5), "sequence_uniform")
    weighted = sat_gspo_surrogate(log_prob, old, adv, mask, EPS, EPS, SatConfig(quantile=0.5), "sequence")
    assert uniform.region.quantile.item() == pytest.approx(0.4)
    assert uniform.region.gated[:, 0].tolist() == [True, False, False]
    assert weighted.region.quantile.item() == pytest.approx(0.1)
    assert weighted.region.gated[:, 0].tolist() == [True, True, False]
    assert weighted.region.num_units.item() == 20 and uniform.region.num_units.item() == 3
    # the gate rate counts tokens for the length-weighted rule: 2 of 20 tokens
    config = actor_config("+actor_rollout_ref.actor.policy_loss.sat.quantile=0.5", loss_mode="sat_gspo")
    _, metrics = get_policy_loss_fn("sat_gspo")(old, log_prob, adv, mask, "seq-mean-token-mean", config)
    assert metrics["actor/sat_gate_rate"] == pytest.approx(2 / 20) and metrics["actor/sat_units"] == 20


@pytest.mark.parametrize("granularity", ["sequence", "sequence_uniform"])
@pytest.mark.parametrize("alpha", [0.1, 0.5, 0.9])
def test_one_sequence_alone_gates_nothing(granularity, alpha):
    """A micro-batch of one sequence: every unit the quantile sees has the score s, so q = s and nothing is above it;
    SAT-GSPO is GSPO there."""
    log_prob = torch.tensor([[0.3, 0.5, -0.1, 0.9]], dtype=torch.float64)
    out = sat_gspo_surrogate(log_prob, torch.zeros_like(log_prob), torch.ones_like(log_prob),
                             torch.ones_like(log_prob, dtype=torch.bool), EPS, EPS, SatConfig(quantile=alpha),
                             granularity)  # fmt: skip
    assert out.region.quantile.item() == pytest.approx(0.4)  # s = mean d
    assert not out.region.gated.any()
    assert out.region.upper.tolist() == [[1.2]] and out.region.lower.tolist() == [[0.8]]


@pytest.mark.parametrize(
    "method,q,kappa_up,kappa_down", [("linear", 0.2, 4 / 13, 0.1), ("inverted_cdf", 0.1, 0.1, 1 / 37)]
)
def test_gspo_sequence_granularity(method, q, kappa_up, kappa_down):
    # Four sequences of two tokens, s = [0.05, -0.1, 0.3, -0.6]; |s| quantile 0.5: linear q = 0.1 + 0.5 * 0.2 = 0.2,
    # inverted_cdf q = 2nd smallest = 0.1. Both gate s = 0.3 (upper) and s = -0.6 (lower);
    # Hill: kappa = q^2 / (q^2 + s^2).
    s = torch.tensor([0.05, -0.1, 0.3, -0.6], dtype=torch.float64)
    log_prob = (s.unsqueeze(-1) + torch.tensor([0.01, -0.01], dtype=torch.float64)).requires_grad_()
    zeros = torch.zeros(4, 2, dtype=torch.float64)
    adv = torch.tensor([[1.0], [1.0], [1.0], [-1.0]], dtype=torch.float64).expand(4, 2)
    mask = torch.ones(4, 2, dtype=torch.bool)
    gate = SatConfig(quantile=0.5, quantile_method=method)
    out = sat_gspo_surrogate(log_prob, zeros, adv, mask, EPS, EPS, gate, "sequence")
    assert out.region.quantile.item() == pytest.approx(q)
    assert (q**2 / (q**2 + 0.09), q**2 / (q**2 + 0.36)) == pytest.approx((kappa_up, kappa_down))
    assert out.region.gated[:, 0].tolist() == [False, False, True, True]
    assert out.region.upper[:, 0].tolist() == pytest.approx([1.2, 1.2, 1 + 0.2 * kappa_up, 1.2])
    assert out.region.lower[:, 0].tolist() == pytest.approx([0.8, 0.8, 0.8, 1 - 0.2 * kappa_down])
    rho = torch.exp(s)
    expected = [-rho[0], -rho[1], -(1 + 0.2 * kappa_up), 1 - 0.2 * kappa_down]  # seq 2 clipped at hi, seq 3 at lo
    assert out.loss_mat[:, 0].tolist() == pytest.approx([float(v) for v in expected])
    assert out.loss_mat[:, 1].tolist() == pytest.approx(out.loss_mat[:, 0].tolist())


def test_registered_loss_aggregates_and_reports_metrics():
    """The same five tokens through the registered ``sat`` loss: token-mean of the hand-computed values."""
    config = actor_config("+actor_rollout_ref.actor.policy_loss.sat.quantile=0.5")
    log_prob = torch.tensor([D], dtype=torch.float64)
    pg_loss, metrics = get_policy_loss_fn("sat")(
        torch.zeros_like(log_prob), log_prob, torch.tensor([ADV], dtype=torch.float64),
        torch.ones_like(log_prob, dtype=torch.bool), "token-mean", config,
    )  # fmt: skip
    expected = [-1.0, -math.exp(0.1), math.exp(-0.2), -1.04, 1 - 0.2 / 17]
    assert pg_loss.item() == pytest.approx(sum(expected) / 5)
    assert metrics["actor/sat_gate_rate"] == pytest.approx(2 / 5)
    assert metrics["actor/sat_q"] == pytest.approx(0.2)
    assert metrics["actor/sat_units"] == 5
    assert metrics["actor/sat_abs_log_ratio_mean"] == pytest.approx(1.5 / 5)
    assert metrics["actor/sat_eff_upper_radius"] == pytest.approx(0.2 * (4 + 1 / 5) / 5)
    assert metrics["actor/sat_eff_lower_radius"] == pytest.approx(0.2 * (4 + 1 / 17) / 5)
    assert metrics["actor/sat_min_factor"] == pytest.approx(1 / 17)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 5)
    assert metrics["actor/ppo_kl"] == pytest.approx(-sum(D) / 5)
    assert metrics["actor/sat_intercepted_frac"] == 0.0 and metrics["actor/pg_clipfrac_lower"] == 0.0
