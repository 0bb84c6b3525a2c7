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
"""The SAT properties, one test each, for ``sat`` and ``sat_gspo`` under every granularity and quantile method:
containment, pointwise pessimism, baseline preservation, pull-back unchanged, the newly intercepted band, no active
tokens, NaN tokens, and the gate rate bound."""

import math
from fractions import Fraction

import pytest
import torch
from conftest import (
    AGG_MODES,
    LOSS_CASES,
    QUANTILE_METHODS,
    actor_config,
    gate_config,
    make_stale_batch,
    nominal_gspo_loss,
    nominal_token_loss,
)
from verl.trainer.ppo.core_algos import get_policy_loss_fn

from verl_sat.sat_math import CARRIED, CarriedScores, sat_gspo_surrogate, sat_token_surrogate

EPS_LO, EPS_HI = 0.2, 0.28
QUANTILE = 0.5  # a low quantile so that every case has gated tokens on both sides of 1
CASES = [(*case, method) for case in LOSS_CASES for method in QUANTILE_METHODS]
CASE_IDS = [f"{loss}-{gran}-{method}" for loss, gran, _, method in CASES]


def _surrogate(loss, granularity, method, batch, log_prob, quantile=QUANTILE, **replaced):
    """The surrogate on ``batch`` with ``log_prob``; ``replaced`` swaps ``old_log_prob``, ``advantages`` or
    ``response_mask``."""
    gate = gate_config(loss, granularity, quantile=quantile, quantile_method=method)
    tensors = {"old_log_prob": batch.old_log_prob, "advantages": batch.advantages, "response_mask": batch.response_mask}
    old, adv, mask = ({**tensors, **replaced}[key] for key in tensors)
    if loss == "sat":
        return sat_token_surrogate(log_prob, old, adv, mask, EPS_LO, EPS_HI, 3.0, gate)
    carried = _carried(log_prob) if granularity == "sequence_carried" else None
    return sat_gspo_surrogate(log_prob, old, adv, mask, EPS_LO, EPS_HI, gate, granularity, carried)


def _carried(like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``sequence_carried``'s earlier sequences: those of another stale batch (seed 99), less stale than the tests'
    (scale 0.05), so the pooled quantile differs from the micro-batch's own and gates a different share of it."""
    batch = make_stale_batch(99, scale=0.05)
    ring = CarriedScores(64)
    ring.pooled(like)
    gate = gate_config("sat_gspo", "sequence_carried")
    ring.add(sat_gspo_surrogate(batch.log_prob, batch.old_log_prob, batch.advantages, batch.response_mask, EPS_LO,
                                EPS_HI, gate, "sequence_carried", ring.pooled(like)).region)  # fmt: skip
    return ring.pooled(like)


def _nominal(loss, batch, log_prob):
    if loss == "sat":
        return nominal_token_loss(log_prob, batch.old_log_prob, batch.advantages, EPS_LO, EPS_HI)
    return nominal_gspo_loss(log_prob, batch.old_log_prob, batch.advantages, batch.response_mask, EPS_LO, EPS_HI)


def _per_token(loss, granularity, method, batch):
    """SAT and nominal per-token losses and gradients (each token's loss depends on its own log-prob only)."""
    lp_sat, lp_nom = batch.fresh_log_prob(), batch.fresh_log_prob()
    out = _surrogate(loss, granularity, method, batch, lp_sat)
    nominal = _nominal(loss, batch, lp_nom)
    out.loss_mat.sum().backward()
    nominal.sum().backward()
    return out, nominal.detach(), lp_sat.grad, lp_nom.grad


def _tokens(out, x):
    """A per-unit tensor of the region (``[B, T]`` or ``[B, 1]``) broadcast to ``[B, T]``."""
    return x.expand(out.mask.shape)


def _seq_log_ratio(out):
    return (torch.sum(out.log_ratio * out.mask, dim=-1) / torch.sum(out.mask, dim=-1).clamp(min=1)).unsqueeze(-1)


def _ratio(loss, out):
    """The ratio the interval clamps: ``r`` per token, or the sequence ratio ``exp(s_i)`` for GSPO."""
    if loss == "sat":
        return torch.exp(out.log_ratio)
    return torch.exp(_seq_log_ratio(out)).expand(out.mask.shape)


def _proxy(out, granularity):
    """The drift whose sign picks a gated unit's contracted endpoint: the token's own log-ratio under ``token``, the
    sequence's ``s_i`` otherwise (``token_ratio_side`` gates per token on the ratio's side)."""
    return out.log_ratio if granularity == "token" else _seq_log_ratio(out).expand(out.mask.shape)


@pytest.mark.parametrize("loss,granularity,_,method", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_containment(loss, granularity, _, method, seed):
    """1: 1 - eps_lo <= lo <= 1 <= hi <= 1 + eps_hi for every unit, and some endpoints really contract."""
    region = _surrogate(loss, granularity, method, make_stale_batch(seed), make_stale_batch(seed).log_prob).region
    assert torch.all(region.lower >= 1 - EPS_LO) and torch.all(region.lower <= 1)
    assert torch.all(region.upper >= 1) and torch.all(region.upper <= 1 + EPS_HI)
    assert torch.any(region.lower > 1 - EPS_LO) and torch.any(region.upper < 1 + EPS_HI)
    kappa = region.kappa[region.gated]
    assert kappa.numel() > 0 and torch.all((kappa > 0) & (kappa <= 0.5))  # Hill: kappa jumps below 1/2 at the gate
    assert torch.all(region.kappa[~region.gated] == 1.0)


@pytest.mark.parametrize("loss,granularity,_,method", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pointwise_pessimism(loss, granularity, _, method, seed):
    """2: per-token SAT loss >= per-token nominal loss, strictly greater somewhere."""
    batch = make_stale_batch(seed)
    out = _surrogate(loss, granularity, method, batch, batch.log_prob)
    nominal = _nominal(loss, batch, batch.log_prob)
    active = out.mask
    assert torch.all(out.loss_mat[active] >= nominal[active])
    assert torch.any(out.loss_mat[active] > nominal[active])


@pytest.mark.parametrize("loss,granularity,_,method", CASES, ids=CASE_IDS)
def test_baseline_preserved_on_ungated_tokens(loss, granularity, _, method):
    """3: on ungated tokens the loss and its gradient equal the nominal rule's, bit for bit."""
    batch = make_stale_batch(3)
    out, nominal, grad_sat, grad_nom = _per_token(loss, granularity, method, batch)
    ungated = ~_tokens(out, out.region.gated) & out.mask
    assert ungated.sum() > 0 and (out.mask & ~ungated).sum() > 0
    assert torch.equal(out.loss_mat[ungated], nominal[ungated])
    assert torch.equal(grad_sat[ungated], grad_nom[ungated])


@pytest.mark.parametrize("loss,granularity,nominal_name,method", CASES, ids=CASE_IDS)
def test_baseline_preserved_without_staleness(loss, granularity, nominal_name, method, sat_actor_config):
    """3: with lp == lp_old the registered loss equals verl's own (values and gradients)."""
    batch = make_stale_batch(4)
    fresh = batch.old_log_prob.clone()
    config = sat_actor_config
    object.__setattr__(config.policy_loss, "sat", gate_config(loss, granularity, quantile_method=method))
    for agg in ["token-mean", "seq-mean-token-mean"]:
        lp_sat, lp_ref = fresh.clone().requires_grad_(), fresh.clone().requires_grad_()
        sat_loss, metrics = get_policy_loss_fn(loss)(
            batch.old_log_prob, lp_sat, batch.advantages, batch.response_mask, agg, config
        )
        ref_loss, _ = get_policy_loss_fn(nominal_name)(
            batch.old_log_prob, lp_ref, batch.advantages, batch.response_mask, agg, config
        )
        sat_loss.backward()
        ref_loss.backward()
        assert torch.equal(sat_loss, ref_loss)
        assert torch.equal(lp_sat.grad, lp_ref.grad)
        assert metrics["actor/sat_gate_rate"] == 0.0


@pytest.mark.parametrize("loss,granularity,_,method", CASES, ids=CASE_IDS)
def test_pull_back_unchanged(loss, granularity, _, method):
    """4: a gated token whose update moves the ratio toward 1 keeps the nominal gradient."""
    batch = make_stale_batch(5)
    out, _, grad_sat, grad_nom = _per_token(loss, granularity, method, batch)
    d, adv = _proxy(out, granularity), batch.advantages
    pull_back = _tokens(out, out.region.gated) & out.mask & (((d > 0) & (adv < 0)) | ((d < 0) & (adv > 0)))
    assert pull_back.sum() > 0
    assert torch.equal(grad_sat[pull_back], grad_nom[pull_back])


@pytest.mark.parametrize("loss,granularity,_,method", CASES, ids=CASE_IDS)
def test_newly_intercepted_band(loss, granularity, _, method):
    """5: gated outward tokens with the ratio in (hi_t, 1 + eps_hi] or [1 - eps_lo, lo_t) get zero gradient where
    the nominal rule's is non-zero, and are counted as intercepted; no other token is."""
    batch = make_stale_batch(6)
    out, _, grad_sat, grad_nom = _per_token(loss, granularity, method, batch)
    d, adv, ratio = _proxy(out, granularity), batch.advantages, _ratio(loss, out)
    lower, upper = _tokens(out, out.region.lower), _tokens(out, out.region.upper)
    gated = _tokens(out, out.region.gated) & out.mask
    upper_band = gated & (d > 0) & (adv > 0) & (ratio > upper) & (ratio <= 1 + EPS_HI)
    lower_band = gated & (d < 0) & (adv < 0) & (ratio < lower) & (ratio >= 1 - EPS_LO)
    band = upper_band | lower_band
    assert upper_band.sum() > 0 and lower_band.sum() > 0
    assert torch.all(grad_sat[band] == 0)
    assert torch.all(grad_nom[band] != 0)
    assert torch.equal(out.intercepted, band)


@pytest.mark.parametrize("loss,granularity,_,method", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("agg", AGG_MODES)
def test_no_active_tokens(loss, granularity, _, method, agg, sat_actor_config):
    """6: an all-masked micro-batch gives a finite zero loss connected to the graph, and finite metrics, under every
    aggregation, also with NaN log-probs in the padding."""
    batch = make_stale_batch(7)
    object.__setattr__(sat_actor_config.policy_loss, "sat", gate_config(loss, granularity, quantile_method=method))
    lp = batch.log_prob.clone()
    lp[:, ::3] = float("nan")
    lp.requires_grad_()
    empty = torch.zeros_like(batch.response_mask)
    pg_loss, metrics = get_policy_loss_fn(loss)(batch.old_log_prob, lp, batch.advantages, empty, agg, sat_actor_config)
    assert pg_loss.item() == 0.0 and pg_loss.requires_grad
    pg_loss.backward()
    assert torch.all(lp.grad == 0)
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["actor/sat_min_factor"] == 1.0 and metrics["actor/sat_gate_rate"] == 0.0
    assert metrics["actor/sat_units"] == 0.0 and metrics["actor/sat_q"] == 0.0


def _with_nan(batch, tensor: str, nan_at: torch.Tensor) -> dict[str, torch.Tensor]:
    inputs = {"log_prob": batch.log_prob.clone(), "old_log_prob": batch.old_log_prob, "advantages": batch.advantages}
    inputs[tensor] = inputs[tensor].clone().masked_fill(nan_at, float("nan"))
    return inputs


def _nan_positions(batch) -> torch.Tensor:
    """The first token of every non-empty sequence, one more token, and every other padding position."""
    nan_at = batch.response_mask.clone()
    nan_at[:, 1:] = False
    nan_at[1, 3] = bool(batch.response_mask[1, 3])
    padding = ~batch.response_mask
    padding[:, 1::2] = False
    return nan_at | padding


@pytest.mark.parametrize("loss,granularity,_,method", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("tensor", ["log_prob", "old_log_prob", "advantages"])
def test_nan_tokens_are_exact_zeros_of_the_loss_matrix(loss, granularity, _, method, tensor):
    """7: NaN in an active token's inputs or in the padding leaves ``loss_mat`` exactly 0 there (NaN x 0 would be NaN
    in verl's seq-mean aggregations), and the other tokens' losses as without the NaN."""
    batch = make_stale_batch(8)
    nan_at = _nan_positions(batch)
    inputs = _with_nan(batch, tensor, nan_at)
    out = _surrogate(loss, granularity, method, batch, inputs["log_prob"], old_log_prob=inputs["old_log_prob"],
                     advantages=inputs["advantages"])  # fmt: skip
    reference = _surrogate(loss, granularity, method, batch, batch.log_prob, response_mask=out.mask)
    assert torch.equal(out.mask, batch.response_mask & ~nan_at)
    assert torch.all(out.loss_mat[~out.mask] == 0) and torch.all(torch.isfinite(out.loss_mat))
    assert torch.equal(out.loss_mat, reference.loss_mat)


@pytest.mark.parametrize("loss,granularity,_,method", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("tensor", ["log_prob", "old_log_prob", "advantages"])
@pytest.mark.parametrize("agg", AGG_MODES)
def test_nan_tokens_become_inactive(loss, granularity, _, method, tensor, agg, sat_actor_config):
    """7: NaN in an active token's inputs drops the token from the quantile and agg_loss, under every aggregation;
    NaN in the padding changes nothing; nothing else changes."""
    batch = make_stale_batch(8)
    object.__setattr__(sat_actor_config.policy_loss, "sat", gate_config(loss, granularity, quantile_method=method))
    fn = get_policy_loss_fn(loss)
    nan_at = _nan_positions(batch)
    inputs = _with_nan(batch, tensor, nan_at)

    lp_nan = inputs["log_prob"].clone().requires_grad_()
    loss_nan, metrics_nan = fn(
        inputs["old_log_prob"], lp_nan, inputs["advantages"], batch.response_mask, agg, sat_actor_config
    )
    lp_ref = batch.fresh_log_prob()
    loss_ref, metrics_ref = fn(
        batch.old_log_prob, lp_ref, batch.advantages, batch.response_mask & ~nan_at, agg, sat_actor_config
    )
    loss_nan.backward()
    loss_ref.backward()
    assert torch.isfinite(loss_nan) and torch.equal(loss_nan, loss_ref)
    assert torch.all(torch.isfinite(lp_nan.grad)) and torch.all(lp_nan.grad[nan_at] == 0)
    assert torch.equal(lp_nan.grad[~nan_at], lp_ref.grad[~nan_at])
    dropped = nan_at & batch.response_mask
    expected_frac = dropped.sum().item() / batch.response_mask.sum().item()
    assert metrics_nan["actor/sat_nan_frac"] == pytest.approx(expected_frac)
    assert metrics_ref["actor/sat_nan_frac"] == 0.0
    for key in ["actor/sat_q", "actor/sat_gate_rate", "actor/sat_units", "actor/pg_clipfrac", "actor/ppo_kl"]:
        assert metrics_nan[key] == metrics_ref[key], key


def test_inf_log_probs_go_through_the_clamp(sat_actor_config):
    """7: +-inf log-probs are not NaN tokens: the +-20 clamp maps them, exactly as verl's vanilla does."""
    batch = make_stale_batch(9)
    log_prob = batch.log_prob.clone()
    log_prob[2, 0], log_prob[3, 1] = float("inf"), float("-inf")
    results = []
    for name in ("sat", "vanilla"):
        lp = log_prob.clone().requires_grad_()
        pg_loss, metrics = get_policy_loss_fn(name)(
            batch.old_log_prob, lp, batch.advantages, batch.response_mask, "token-mean", sat_actor_config
        )
        pg_loss.backward()
        results.append((pg_loss, lp.grad, metrics))
    (sat_loss, sat_grad, metrics), (ref_loss, ref_grad, _) = results
    assert torch.isfinite(sat_loss) and torch.all(torch.isfinite(sat_grad))
    assert metrics["actor/sat_nan_frac"] == 0.0 and metrics["actor/sat_gate_rate"] > 0
    assert sat_grad[2, 0] == ref_grad[2, 0] == 0.0  # clamped: no gradient, as in verl


@pytest.mark.parametrize("granularity", ["sequence", "sequence_uniform", "token", "token_ratio_side"])
@pytest.mark.parametrize("agg", AGG_MODES)
def test_gspo_with_an_old_log_prob_of_minus_inf_stays_finite_and_equals_verls(granularity, agg):
    """7: an ``old_log_prob`` of -inf (``s_i`` = +inf) gives verl's ``gspo`` loss and gradient when nothing is gated
    (``sat.floor`` above every proxy), under every aggregation; an ``lp`` of +-inf, where verl's ``gspo`` is NaN, and
    a gated run stay finite too."""
    batch = make_stale_batch(9)
    old = batch.old_log_prob.clone()
    old[2, 0] = float("-inf")
    results = []
    for name, floor in (("sat_gspo", 100.0), ("gspo", 100.0), ("sat_gspo", 0.0)):
        sat_keys = [f"+actor_rollout_ref.actor.policy_loss.sat.{key}" for key in (f"granularity={granularity}",
                                                                                  f"floor={floor}")]  # fmt: skip
        config = actor_config(*sat_keys, loss_mode="sat_gspo")
        lp = batch.fresh_log_prob()
        pg_loss, _ = get_policy_loss_fn(name)(old, lp, batch.advantages, batch.response_mask, agg, config)
        pg_loss.backward()
        assert torch.isfinite(pg_loss) and torch.all(torch.isfinite(lp.grad)), name
        results.append((pg_loss, lp.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    log_prob = batch.log_prob.clone()
    log_prob[2, 0], log_prob[3, 1] = float("inf"), float("-inf")
    out = sat_gspo_surrogate(log_prob.requires_grad_(), batch.old_log_prob, batch.advantages, batch.response_mask,
                             EPS_LO, EPS_HI, gate_config("sat_gspo", granularity), granularity)  # fmt: skip
    out.loss_mat.sum().backward()
    assert torch.all(torch.isfinite(out.loss_mat)) and torch.all(torch.isfinite(log_prob.grad))


def _gate_bound(method: str, alpha: float, units: int) -> float:
    """Most units (tokens, length-weighted) above q: floor((1 - alpha) n) for the paper's quantile; linear
    interpolation between the order statistics around alpha (n - 1) can gate ceil((1 - alpha)(n - 1)), at most one
    unit more."""
    frac = 1 - Fraction(repr(alpha))
    return math.floor(frac * units) if method == "inverted_cdf" else math.ceil(frac * (units - 1))


@pytest.mark.parametrize("loss,granularity,_,method", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("alpha", [0.5, 0.9, 0.95, 0.99])
@pytest.mark.parametrize("kind", ["heavy_tailed", "ties", "tiny_batch"])
def test_gate_rate_bound(loss, granularity, _, method, alpha, kind, sat_actor_config):
    """8: at most 1 - alpha of the active units are gated, length-weighted for ``sequence``, for any input (for
    ``sequence_carried``: of the active and the carried units together); the metric reports the same fraction (through
    verl's registry, each call with the ring empty: the micro-batch's own quantile)."""
    if kind == "tiny_batch":
        batch = make_stale_batch(10, num_prompts=1, group=3, length=6)
    else:
        batch = make_stale_batch(10, scale=0.3)
    if kind == "ties":  # log-ratios on a coarse grid: many units share |d|, also at q
        batch.log_prob = batch.old_log_prob + torch.round((batch.log_prob - batch.old_log_prob) * 4) / 4
    out = _surrogate(loss, granularity, method, batch, batch.log_prob, quantile=alpha)
    region = out.region
    weight = region.weight if region.weight is not None else region.unit_mask.long()
    units = int(weight.sum())
    gated_units = int((weight * region.gated).sum())
    pooled_units = units + (int(_carried(batch.log_prob)[1].sum()) if granularity == "sequence_carried" else 0)
    assert gated_units <= _gate_bound(method, alpha, pooled_units)
    if method == "inverted_cdf":
        assert gated_units <= (1 - alpha) * pooled_units + 1e-9
    if granularity == "sequence_carried":  # the registry's calls below start from an empty ring
        empty = (torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.int64))
        gate = gate_config(loss, granularity, quantile=alpha, quantile_method=method)
        region = sat_gspo_surrogate(batch.log_prob, batch.old_log_prob, batch.advantages, batch.response_mask, EPS_LO,
                                    EPS_HI, gate, granularity, empty).region  # fmt: skip
        gated_units = int((region.weight * region.gated).sum())
    object.__setattr__(sat_actor_config.policy_loss, "sat", gate_config(loss, granularity, quantile=alpha,
                                                                        quantile_method=method))  # fmt: skip
    for agg in AGG_MODES:
        CARRIED.clear()
        _, metrics = get_policy_loss_fn(loss)(
            batch.old_log_prob, batch.log_prob, batch.advantages, batch.response_mask, agg, sat_actor_config
        )
        assert metrics["actor/sat_gate_rate"] == pytest.approx(gated_units / units)
        assert metrics["actor/sat_units"] == units


@pytest.mark.parametrize("loss,granularity,_,method", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("agg", AGG_MODES)
def test_nan_rollout_is_weights_of_dropped_tokens_stay_out(loss, granularity, _, method, agg, sat_actor_config):
    """7, decoupled mode: verl's IS weights are exp(old - mu) times the mask, so a NaN ``old_log_prob`` gives a NaN
    weight too; the dropped token's loss stays exactly 0 and the loss is the one without that token."""
    batch = make_stale_batch(8)
    object.__setattr__(sat_actor_config.policy_loss, "sat", gate_config(loss, granularity, quantile_method=method))
    fn = get_policy_loss_fn(loss)
    nan_at = _nan_positions(batch)
    old = batch.old_log_prob.masked_fill(nan_at, float("nan"))
    weights = torch.rand(batch.response_mask.shape, generator=torch.Generator().manual_seed(3), dtype=old.dtype) + 0.5
    lp_nan, lp_ref = batch.fresh_log_prob(), batch.fresh_log_prob()
    loss_nan, _ = fn(old, lp_nan, batch.advantages, batch.response_mask, agg, sat_actor_config,
                     weights.masked_fill(nan_at, float("nan")))  # fmt: skip
    loss_ref, _ = fn(batch.old_log_prob, lp_ref, batch.advantages, batch.response_mask & ~nan_at, agg,
                     sat_actor_config, weights)  # fmt: skip
    loss_nan.backward()
    loss_ref.backward()
    assert torch.isfinite(loss_nan) and torch.equal(loss_nan, loss_ref)
    assert torch.all(torch.isfinite(lp_nan.grad)) and torch.equal(lp_nan.grad, lp_ref.grad)
