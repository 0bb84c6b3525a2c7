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
"""SAT policy losses ``sat`` and ``sat_gspo`` (arXiv 2607.18722): equal to ``vanilla`` / ``gspo`` when nothing is
gated, a gated case computed by hand; for both losses, every granularity, both quantile methods and every
``loss_agg_mode``: containment and pessimism of the SAT interval, the nominal gradient on ungated tokens, the gate-rate
bound, NaN inputs and empty micro-batches; the once-per-process warning when the gate is structurally empty; and the
``sat_*`` keys of ``PolicyLossConfig`` (validation, Hydra composition)."""

import logging
import math
import os
from fractions import Fraction

import pytest
import torch
from hydra import compose, initialize_config_dir

import verl
from verl.trainer.ppo import core_algos, sat_inert
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.trainer.ppo.sat_math import SatParams, sat_gspo_surrogate, sat_token_surrogate
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config.actor import ActorConfig, PolicyLossConfig

EPS = 0.2
AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
# (loss_mode, granularity, the nominal loss it contracts)
RULES = [("sat", "sequence", "vanilla"), ("sat_gspo", "sequence", "gspo"), ("sat_gspo", "sequence_uniform", "gspo"),
         ("sat_gspo", "token", "gspo"), ("sat_gspo", "token_ratio_side", "gspo")]  # fmt: skip


def _stale_batch(seed: int, batch: int = 24, length: int = 10):
    """A micro-batch with per-sequence drift plus token noise, ragged responses and mixed-sign advantages."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 3
    drift = torch.randn(batch, 1, generator=gen, dtype=torch.float64) * 0.08
    new = old + drift + torch.randn(batch, length, generator=gen, dtype=torch.float64) * 0.05
    advantages = torch.randn(batch, 1, generator=gen, dtype=torch.float64).expand(batch, length).contiguous()
    lengths = torch.randint(3, length + 1, (batch, 1), generator=gen)
    mask = (torch.arange(length).unsqueeze(0) < lengths).float()
    return old, new, advantages, mask


def _rule_keys(granularity: str, quantile_method: str, quantile: float = 0.8) -> dict:
    keys = {"sat_quantile": quantile, "sat_quantile_method": quantile_method}
    return keys if granularity == "sequence" else {**keys, "sat_granularity": granularity}


def _actor_config(loss_mode: str, loss_agg_mode: str = "token-mean", **sat_keys) -> ActorConfig:
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=EPS,
        clip_ratio_low=EPS,
        clip_ratio_high=EPS,
        loss_agg_mode=loss_agg_mode,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode, **sat_keys),
    )


def _loss_and_grad(loss_mode: str, nominal_mode: str, old, new, advantages, mask, agg: str):
    out = []
    for mode in (loss_mode, nominal_mode):
        log_prob = new.clone().requires_grad_(True)
        loss, metrics = get_policy_loss_fn(mode)(old, log_prob, advantages, mask, agg, _actor_config(mode, agg))
        loss.backward()
        out.append((loss.detach(), log_prob.grad, metrics))
    return out


def test_token_rule_equals_vanilla_when_nothing_is_gated():
    """Equal |lp - lp_old| everywhere: no token lies strictly above the quantile, so nothing is gated."""
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 9, generator=gen, dtype=torch.float64) * 3
    signs = torch.randint(0, 2, (4, 9), generator=gen).to(torch.float64) * 2 - 1
    new = old + 0.05 * signs
    advantages = torch.randn(4, 9, generator=gen, dtype=torch.float64)
    mask = (torch.rand(4, 9, generator=gen) < 0.8).float()
    (sat_loss, sat_grad, sat_metrics), (loss, grad, metrics) = _loss_and_grad(
        "sat", "vanilla", old, new, advantages, mask, "token-mean"
    )
    assert torch.equal(sat_loss, loss) and torch.equal(sat_grad, grad)
    assert sat_metrics["actor/sat_gate_rate"] == 0.0
    assert sat_metrics["actor/ppo_kl"] == pytest.approx(float(metrics["actor/ppo_kl"]))


def test_gspo_rule_equals_gspo_without_staleness():
    gen = torch.Generator().manual_seed(1)
    old = -torch.rand(6, 7, generator=gen, dtype=torch.float64) * 3
    advantages = torch.randn(6, 1, generator=gen, dtype=torch.float64).expand(6, 7).contiguous()
    mask = torch.ones(6, 7)
    (sat_loss, sat_grad, sat_metrics), (loss, grad, _) = _loss_and_grad(
        "sat_gspo", "gspo", old, old.clone(), advantages, mask, "seq-mean-token-mean"
    )
    assert torch.equal(sat_loss, loss) and torch.equal(sat_grad, grad)
    assert sat_metrics["actor/sat_q"] == 0.0 and sat_metrics["actor/sat_intercepted_frac"] == 0.0


def test_token_rule_gated_case_by_hand():
    """One sequence, d = lp - lp_old = (0, 0.01, -0.02, 0.03, 0.15), alpha = 0.6: q is the 3rd smallest |d| (0.02),
    tokens 3 and 4 are gated; token 4 (A > 0, ratio e^0.15 inside the nominal 1.2) is cut at
    hi = 1 + 0.2 q^2 / (q^2 + 0.15^2) and loses its gradient, token 3's ratio stays below its contracted endpoint."""
    d = torch.tensor([[0.0, 0.01, -0.02, 0.03, 0.15]], dtype=torch.float64)
    old = torch.full_like(d, -1.0)
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones_like(d)
    log_prob = (old + d).requires_grad_(True)
    config = _actor_config("sat", sat_quantile=0.6)
    loss, metrics = get_policy_loss_fn("sat")(old, log_prob, advantages, mask, "token-mean", config)
    loss.backward()

    q = 0.02
    hi_4 = 1 + EPS * q**2 / (q**2 + 0.15**2)
    ratio = [math.exp(x) for x in d[0].tolist()]
    per_token = [-ratio[0], -ratio[1], ratio[2], ratio[3], -hi_4]
    assert loss.item() == pytest.approx(sum(per_token) / 5, rel=1e-12)
    assert log_prob.grad[0].tolist() == pytest.approx([-ratio[0] / 5, -ratio[1] / 5, ratio[2] / 5, ratio[3] / 5, 0.0])
    assert metrics["actor/sat_q"] == pytest.approx(q)
    assert metrics["actor/sat_gate_rate"] == pytest.approx(0.4)
    assert metrics["actor/sat_intercepted_frac"] == pytest.approx(0.2)


@pytest.mark.parametrize("granularity", ["sequence", "sequence_uniform", "token", "token_ratio_side"])
def test_interval_inside_nominal_and_loss_never_below_nominal(granularity):
    gen = torch.Generator().manual_seed(2)
    old = -torch.rand(40, 12, generator=gen, dtype=torch.float64) * 3
    new = old + torch.randn(40, 12, generator=gen, dtype=torch.float64) * 0.1
    advantages = torch.randn(40, 12, generator=gen, dtype=torch.float64)
    mask = torch.rand(40, 12, generator=gen) < 0.9
    params = SatParams(granularity=granularity)
    for out in (
        sat_token_surrogate(new, old, advantages, mask, EPS, EPS, 3.0, SatParams()),
        sat_gspo_surrogate(new, old, advantages, mask, EPS, EPS, params, granularity),
    ):
        region = out.region
        assert torch.all(region.lower >= 1 - EPS) and torch.all(region.lower <= 1)
        assert torch.all(region.upper >= 1) and torch.all(region.upper <= 1 + EPS)
        assert out.region.gate.sum() > 0
    ratio = torch.exp(new - old)
    token = sat_token_surrogate(new, old, advantages, mask, EPS, EPS, 3.0, SatParams())
    nominal = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - EPS, 1 + EPS))
    nominal = torch.where(advantages < 0, torch.minimum(nominal, -advantages * 3.0), nominal)
    assert torch.all(token.loss_mat[mask] >= nominal[mask])


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("quantile_method", ["inverted_cdf", "linear"])
@pytest.mark.parametrize("loss_mode, granularity, nominal_mode", RULES)
def test_properties_for_every_rule_quantile_method_and_aggregation(loss_mode, granularity, nominal_mode,
                                                                    quantile_method, agg):  # fmt: skip
    """Through verl's registry: the gate takes at most 1 - alpha of the active units (the linear quantile one unit
    more); the per-token loss never falls below the nominal rule's; on every ungated token the gradient is the nominal
    rule's; and SAT acts (a gated token loses the gradient the nominal rule gives it)."""
    old, new, advantages, mask = _stale_batch(3)
    keys = _rule_keys(granularity, quantile_method)
    log_prob = new.clone().requires_grad_(True)
    config = _actor_config(loss_mode, agg, **keys)
    loss, metrics = get_policy_loss_fn(loss_mode)(old, log_prob, advantages, mask, agg, config)
    loss.backward()
    nominal_log_prob = new.clone().requires_grad_(True)
    nominal_loss, _ = get_policy_loss_fn(nominal_mode)(old, nominal_log_prob, advantages, mask, agg,
                                                       _actor_config(nominal_mode, agg))  # fmt: skip
    nominal_loss.backward()

    params = SatParams(quantile=0.8, quantile_method=quantile_method, granularity=granularity)
    if loss_mode == "sat":
        out = sat_token_surrogate(new, old, advantages, mask.bool(), EPS, EPS, 3.0, params)
    else:
        out = sat_gspo_surrogate(new, old, advantages, mask.bool(), EPS, EPS, params, granularity)
    units = round(metrics["actor/sat_units"])
    at_most = units - math.ceil(Fraction("0.8") * units) + (1 if quantile_method == "linear" else 0)
    assert round(metrics["actor/sat_gate_rate"] * units) <= at_most
    assert metrics["actor/sat_gate_rate"] > 0
    assert loss.item() >= nominal_loss.item() - 1e-12  # pessimism, aggregated
    # a gated token's interval has one endpoint contracted; an ungated one keeps (1 - eps, 1 + eps)
    region = out.region
    contracted = (region.lower > 1 - EPS) | (region.upper < 1 + EPS)
    gate = contracted.reshape(mask.shape[0], -1).expand_as(mask) & mask.bool()
    assert gate.any()
    torch.testing.assert_close(log_prob.grad[~gate], nominal_log_prob.grad[~gate], rtol=0, atol=1e-12)
    assert metrics["actor/sat_intercepted_frac"] > 0  # some gated tokens lost the nominal rule's gradient
    intercepted = out.intercepted & mask.bool()
    assert torch.all(log_prob.grad[intercepted] == 0) and torch.all(nominal_log_prob.grad[intercepted] != 0)


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("loss_mode, granularity, nominal_mode", RULES)
def test_nan_token_is_inactive_and_the_loss_finite(loss_mode, granularity, nominal_mode, agg):
    """A NaN log-prob on an active token: the loss and its gradient are finite under every aggregation, the token is
    counted in ``sat_nan_frac``, and ``-inf`` old log-probs go through the clamp."""
    old, new, advantages, mask = _stale_batch(4)
    new[2, 1] = float("nan")
    old[5, 0] = float("-inf")
    log_prob = new.clone().requires_grad_(True)
    config = _actor_config(loss_mode, agg, **_rule_keys(granularity, "inverted_cdf"))
    loss, metrics = get_policy_loss_fn(loss_mode)(old, log_prob, advantages, mask, agg, config)
    loss.backward()
    assert torch.isfinite(loss) and torch.all(torch.isfinite(log_prob.grad))
    assert metrics["actor/sat_nan_frac"] == pytest.approx(1 / mask.sum().item())
    # SAT's own metrics (ppo_kl is the raw log-ratio's, as gspo's: -inf with an lp_old of -inf)
    assert all(math.isfinite(value) for key, value in metrics.items() if key.startswith("actor/sat_"))


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("loss_mode, granularity, nominal_mode", RULES)
def test_no_active_tokens_is_a_finite_zero_on_the_graph(loss_mode, granularity, nominal_mode, agg):
    old, new, advantages, mask = _stale_batch(5)
    log_prob = new.clone().requires_grad_(True)
    config = _actor_config(loss_mode, agg, **_rule_keys(granularity, "inverted_cdf"))
    loss, metrics = get_policy_loss_fn(loss_mode)(old, log_prob, advantages, torch.zeros_like(mask), agg, config)
    loss.backward()
    assert loss.item() == 0.0 and torch.all(log_prob.grad == 0)
    assert metrics["actor/sat_gate_rate"] == 0.0 and all(math.isfinite(value) for value in metrics.values())


def test_structurally_empty_gate_warns_once(monkeypatch, caplog):
    """Sequence scores in micro-batches of 2 sequences cannot gate at alpha = 0.9 (each sequence holds more than
    1 - alpha of the tokens): ``actor/sat_structurally_empty_frac`` is 1 and the process warns once, naming the keys."""
    monkeypatch.setattr(core_algos, "INERT_MONITOR", sat_inert.InertSatMonitor())
    old, new, advantages, mask = _stale_batch(6, batch=2)
    config = _actor_config("sat_gspo", "seq-mean-token-mean", sat_quantile=0.9)
    with caplog.at_level(logging.WARNING, logger=sat_inert.__name__):
        for _ in range(2 * sat_inert.FALLBACK_WINDOW_CALLS):
            _, metrics = get_policy_loss_fn("sat_gspo")(old, new, advantages, mask, "seq-mean-token-mean", config)
            assert metrics["actor/sat_structurally_empty_frac"] == 1.0 and metrics["actor/sat_gate_rate"] == 0.0
    warnings = [r.getMessage() for r in caplog.records if r.name == sat_inert.__name__]
    assert len(warnings) == 1 and "sat_granularity=sequence_carried" in warnings[0]


def test_sat_keys_are_validated_and_named():
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.policy_loss\.sat_quantile=1\.5 is invalid"):
        PolicyLossConfig(loss_mode="sat", sat_quantile=1.5)
    with pytest.raises(ValueError, match=r"sat_kernel='gauss' is invalid"):
        PolicyLossConfig(sat_kernel="gauss")
    with pytest.raises(ValueError, match=r"sat_granularity='token' has no effect with loss_mode='sat'"):
        PolicyLossConfig(loss_mode="sat", sat_granularity="token")
    assert PolicyLossConfig(loss_mode="sat_gspo", sat_granularity="token").sat_granularity == "token"


def test_sat_keys_compose_from_the_trainer_config():
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    overrides = [
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.policy_loss.loss_mode=sat_gspo",
        "actor_rollout_ref.actor.policy_loss.sat_quantile=0.95",
        "actor_rollout_ref.actor.policy_loss.sat_granularity=token",
    ]
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=overrides)
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    assert actor.policy_loss.sat_quantile == 0.95 and actor.policy_loss.sat_granularity == "token"
    assert actor.policy_loss.sat_kernel == SatParams().kernel
