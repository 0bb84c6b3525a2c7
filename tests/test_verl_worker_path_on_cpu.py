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
"""The registered losses through verl's real worker path: ``verl.workers.utils.losses.ppo_loss`` with a TensorDict
prepared as the FSDP engine prepares it (``left_right_2_no_padding``, nested log-probs)."""

import pytest
import torch
from conftest import LOSS_CASES, actor_config, make_stale_batch, sat_overrides
from tensordict import TensorDict
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, get_policy_loss_fn
from verl.utils import tensordict_utils as tu
from verl.utils.metric.utils import AggregationType
from verl.workers import engine_workers
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import left_right_2_no_padding

PROMPT_LENS = [5, 3, 4, 2, 5, 1]
RESPONSE_LENS = [7, 4, 1, 6, 7, 3]
MAX_PROMPT, MAX_RESPONSE = 5, 7


def _engine_batch(old_log_probs, advantages, **fields):
    """Left-padded prompts, right-padded responses (and ``fields``, response-shaped), then verl's no-padding
    conversion."""
    bs = len(PROMPT_LENS)
    arange_p, arange_r = torch.arange(MAX_PROMPT), torch.arange(MAX_RESPONSE)
    prompt_mask = arange_p.unsqueeze(0) >= (MAX_PROMPT - torch.tensor(PROMPT_LENS)).unsqueeze(1)
    response_mask = arange_r.unsqueeze(0) < torch.tensor(RESPONSE_LENS).unsqueeze(1)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()
    input_ids = torch.randint(1, 100, (bs, MAX_PROMPT + MAX_RESPONSE), generator=torch.Generator().manual_seed(0))
    input_ids = input_ids * attention_mask
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    data = TensorDict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "prompts": input_ids[:, :MAX_PROMPT],
            "responses": input_ids[:, MAX_PROMPT:],
            "response_mask": response_mask.long(),
            "old_log_probs": old_log_probs,
            "advantages": advantages,
            **fields,
        },
        batch_size=[bs],
    )
    data = left_right_2_no_padding(data)
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(response_mask.sum()), global_batch_size=bs)
    return data, response_mask


def _nested_log_probs(log_prob, response_mask):
    """Model output as the engine returns it: one jagged row per sequence over prompt + response tokens, where the
    log-prob of response token j sits at position prompt_len + j - 1."""
    seq_lens = [p + r for p, r in zip(PROMPT_LENS, RESPONSE_LENS, strict=True)]
    offsets = torch.tensor([0, *seq_lens]).cumsum(0)
    positions = torch.cat(
        [offsets[i] + PROMPT_LENS[i] - 1 + torch.arange(RESPONSE_LENS[i]) for i in range(len(PROMPT_LENS))]
    )
    values = torch.zeros(int(offsets[-1]), dtype=log_prob.dtype).index_put((positions,), log_prob[response_mask])
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets)


@pytest.mark.parametrize("loss,granularity,_", LOSS_CASES, ids=[f"{c[0]}-{c[1]}" for c in LOSS_CASES])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_ppo_loss_worker_path(loss, granularity, _, agg):
    config = actor_config(
        f"actor_rollout_ref.actor.loss_agg_mode={agg}",
        *sat_overrides(loss, granularity, "+actor_rollout_ref.actor.policy_loss.sat.quantile=0.5"),
        loss_mode=loss,
    )
    stale = make_stale_batch(21, num_prompts=3, group=2, length=MAX_RESPONSE)
    data, response_mask = _engine_batch(stale.old_log_prob, stale.advantages)

    lp_engine = stale.fresh_log_prob()
    total, metrics = ppo_loss(config, {"log_probs": _nested_log_probs(lp_engine, response_mask)}, data)
    total.backward()

    lp_direct = stale.fresh_log_prob()
    direct, direct_metrics = get_policy_loss_fn(loss)(
        stale.old_log_prob, lp_direct, stale.advantages, response_mask, agg, config
    )
    direct.backward()

    assert torch.allclose(total, direct, rtol=1e-6, atol=1e-7)
    assert torch.allclose(lp_engine.grad * response_mask, lp_direct.grad * response_mask, rtol=1e-6, atol=1e-8)
    assert torch.any(lp_engine.grad != 0)
    assert metrics["actor/sat_gate_rate"].aggregate() == pytest.approx(direct_metrics["actor/sat_gate_rate"])
    assert metrics["actor/sat_gate_rate"].aggregate() > 0
    for key in ["sat_q", "sat_units", "sat_min_factor", "sat_eff_upper_radius", "sat_intercepted_frac", "pg_clipfrac",
                "ppo_kl"]:  # fmt: skip
        assert f"actor/{key}" in metrics


@pytest.fixture
def restored_verl(monkeypatch):
    """verl's ``ppo_loss`` binding and policy-loss registry restored after the test (building verl-sat's config in a
    process that imported verl's workers wraps them)."""
    monkeypatch.setattr(engine_workers, "ppo_loss", engine_workers.ppo_loss)
    for name, fn in list(POLICY_LOSS_REGISTRY.items()):
        monkeypatch.setitem(POLICY_LOSS_REGISTRY, name, fn)


@pytest.mark.parametrize("loss_mode", ["vanilla", "gspo", "dppo_tv", "sat", "sat_gspo"])  # every Table 1 loss
@pytest.mark.parametrize("mode", ["bypass", "decoupled", "decoupled-nested"])
def test_every_row_logs_the_token_mismatch_against_the_rollout(loss_mode, mode, restored_verl):
    """Building verl-sat's policy-loss config wraps the ``ppo_loss`` verl's actor worker binds and the registered
    loss; through verl's ``ppo_loss`` the loss adds ``actor/mismatch_abs_log_ratio``, the token-level mean
    |log pi - log mu| over the active, non-NaN tokens (Eq. 52), with mu the rollout's log-prob: ``old_log_probs`` in
    bypass mode, ``rollout_log_probs`` in decoupled mode (TIS rows). Called directly, the loss is verl's as it was."""
    config = actor_config(loss_mode=loss_mode)  # builds SatPolicyLossConfig: installs the wrappers
    assert engine_workers.ppo_loss.__wrapped__ is ppo_loss
    assert getattr(get_policy_loss_fn(loss_mode), "_verl_sat_mismatch", False)
    stale = make_stale_batch(22, num_prompts=3, group=2, length=MAX_RESPONSE)
    mu = stale.old_log_prob.clone()
    old, extra = mu, {}
    if mode != "bypass":
        mu[1, 0] = float("nan")  # a NaN rollout log-prob (outside the loss in decoupled mode): not counted
        old = stale.old_log_prob + 0.05 * torch.randn(mu.shape, generator=torch.Generator().manual_seed(1))
        extra = {"rollout_log_probs": mu, "rollout_is_weights": torch.exp(old - mu).clamp(max=2.0).nan_to_num(1.0)}
    data, response_mask = _engine_batch(old, stale.advantages, **extra)
    if mode == "decoupled-nested":
        data["rollout_log_probs"] = torch.nested.as_nested_tensor(
            [row[mask] for row, mask in zip(mu, response_mask, strict=True)], layout=torch.jagged
        )
    lp = stale.fresh_log_prob()
    loss, metrics = engine_workers.ppo_loss(config, {"log_probs": _nested_log_probs(lp, response_mask)}, data)
    _, plain_metrics = ppo_loss(config, {"log_probs": _nested_log_probs(lp, response_mask)}, data)
    counted = response_mask & ~torch.isnan(mu)
    expected = (lp.detach() - mu).abs()[counted].mean().item()
    metric = metrics["actor/mismatch_abs_log_ratio"]
    assert metric.aggregation == AggregationType.MEAN
    assert metric.aggregate() == pytest.approx(expected, rel=1e-6)
    assert set(metrics) - set(plain_metrics) == {"actor/mismatch_abs_log_ratio"}  # verl's own metrics untouched
    loss.backward()
    assert torch.all(torch.isfinite(lp.grad))
    direct = get_policy_loss_fn(loss_mode)(old, stale.fresh_log_prob(), stale.advantages, response_mask,
                                           "token-mean", config)  # fmt: skip
    assert "actor/mismatch_abs_log_ratio" not in direct[1]  # outside verl's ppo_loss: no metric, no read


@pytest.mark.parametrize("radii, fires", [((3e-4, 4e-4), True), ((0.2, 0.2), False)])
def test_sat_gspo_says_when_its_quantile_lies_beyond_the_clip_radius(monkeypatch, caplog, radii, fires):
    """verl #7356's setting through verl's ppo_loss: SAT-GSPO at GSPO's usual clip_ratio_low/high = 3e-4 / 4e-4 gates
    but its q lies far beyond the radius, so it intercepts nothing: actor/sat_beyond_radius is 1 at every call and
    one warning names the keys and the paper's 0.2. At the paper's radii the same micro-batches give neither."""
    import logging

    from verl_sat import inert_sat, losses

    monkeypatch.setattr(losses, "INERT_MONITOR", inert_sat.InertSatMonitor())
    low, high = radii
    config = actor_config(
        f"actor_rollout_ref.actor.clip_ratio_low={low}",
        f"actor_rollout_ref.actor.clip_ratio_high={high}",
        *sat_overrides("sat_gspo", "sequence", "+actor_rollout_ref.actor.policy_loss.sat.quantile=0.5"),
        loss_mode="sat_gspo",
    )
    stale = make_stale_batch(21, num_prompts=3, group=2, length=MAX_RESPONSE)
    data, response_mask = _engine_batch(stale.old_log_prob, stale.advantages)
    with caplog.at_level(logging.WARNING, logger=inert_sat.__name__):
        for _ in range(2 * inert_sat.WINDOW_STEPS):  # two windows of 3 optimizer steps (one micro-batch each)
            _, metrics = ppo_loss(config, {"log_probs": _nested_log_probs(stale.fresh_log_prob(), response_mask)}, data)
            assert metrics["actor/sat_gate_rate"].aggregate() > 0
            assert metrics["actor/sat_beyond_radius"].aggregate() == float(fires)
            assert (metrics["actor/sat_q_over_radius"].aggregate() > 1) == fires
    warned = [r.getMessage() for r in caplog.records if r.name == inert_sat.__name__]
    if fires:
        assert len(warned) == 1 and "actor_rollout_ref.actor.clip_ratio_low=0.0003" in warned[0]
        assert "clip_ratio_low = clip_ratio_high = 0.2" in warned[0]
    else:
        assert warned == []


def test_pinned_where_verls_actor_worker_binds_ppo_loss():
    """The wrapper works because verl's worker imports ``ppo_loss`` by name and binds it after building the actor
    config; fails when verl 0.9.1's code changes."""
    import inspect

    source = inspect.getsource(engine_workers)
    assert "from verl.workers.utils.losses import ppo_loss\n" in source
    init = inspect.getsource(engine_workers.ActorRolloutRefWorker.init_model)
    assert init.index("actor_config: ActorConfig = omega_conf_to_dataclass(self.config.actor)") < init.index(
        "self.loss_fn = partial(ppo_loss, config=actor_config)"
    )
