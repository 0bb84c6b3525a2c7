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
"""When SAT cannot act: ``actor/sat_structurally_empty_frac`` (the top unit covers the quantile's rank) against the
gate itself, its exact boundary in sequences per micro-batch, ``actor/sat_seqs_per_micro_batch``, and the warning
that names the keys when most micro-batches of several optimizer steps were structurally empty."""

import logging
import math
from fractions import Fraction

import pytest
import torch
from conftest import AGG_MODES, QUANTILE_METHODS, gate_config
from verl.trainer.ppo.core_algos import get_policy_loss_fn

from verl_sat import inert_sat
from verl_sat.sat_math import CARRIED, CarriedScores, sat_gspo_surrogate, sat_token_surrogate, tail_quantile

GRANULARITIES = ["sequence", "sequence_uniform", "token", "token_ratio_side"]


def _micro_batch(sequences: int, seed: int, lengths: tuple[int, int] = (3, 12), scale: float = 0.2):
    """``sequences`` responses of random lengths, distinct log-ratios: ``(log_prob, old_log_prob, adv, mask)``."""
    g = torch.Generator().manual_seed(seed)
    longest = lengths[1]
    length = torch.randint(lengths[0], longest + 1, (sequences,), generator=g)
    mask = torch.arange(longest)[None, :] < length[:, None]
    old = -torch.rand(sequences, longest, generator=g, dtype=torch.float64) * 3
    log_prob = old + torch.randn(sequences, longest, generator=g, dtype=torch.float64) * scale
    adv = torch.randn(sequences, 1, generator=g, dtype=torch.float64).expand(-1, longest).clone()
    return log_prob, old, adv, mask


def _surrogate(granularity, method, alpha, batch):
    log_prob, old, adv, mask = batch
    gate = gate_config("sat_gspo", granularity, quantile=alpha, quantile_method=method)
    return sat_gspo_surrogate(log_prob, old, adv, mask, 0.2, 0.2, gate, granularity)


@pytest.mark.parametrize("method", QUANTILE_METHODS)
def test_sequence_carried_with_nothing_carried_is_the_papers_sequence_rule(method):
    """Before any sequence was carried (every slot weight 0) the rule is Eq. 20 bit for bit: loss, gradient, gate."""
    for sequences in (1, 4, 16):
        results = {}
        for granularity in ("sequence", "sequence_carried"):
            log_prob, old, adv, mask = _micro_batch(sequences, 7)
            log_prob.requires_grad_()
            gate = gate_config("sat_gspo", granularity, quantile=0.9, quantile_method=method)
            carried = CarriedScores(32).pooled(log_prob) if granularity == "sequence_carried" else None
            out = sat_gspo_surrogate(log_prob, old, adv, mask, 0.2, 0.2, gate, granularity, carried)
            out.loss_mat.sum().backward()
            results[granularity] = (out, log_prob.grad)
        (paper, paper_grad), (carried_out, carried_grad) = results["sequence"], results["sequence_carried"]
        assert torch.equal(paper.loss_mat, carried_out.loss_mat) and torch.equal(paper_grad, carried_grad)
        assert torch.equal(paper.region.gate, carried_out.region.gate)
        assert torch.equal(paper.region.quantile, carried_out.region.quantile)


@pytest.mark.parametrize("method", QUANTILE_METHODS)
def test_sequence_carried_quantile_is_over_this_and_the_carried_sequences(method):
    """One sequence per micro-batch, as long-CoT micro-batches hold: the paper's quantile is its own score and gates
    nothing, the carried quantile is the length-weighted quantile of the last K sequences and this one (checked
    against ``tail_quantile`` over their concatenation), and it gates the micro-batch's sequence when its drift lies
    in that tail. Every gated sequence is one the clip acts on: a ratio beyond the contracted endpoint gets zero
    gradient and counts as intercepted. The ring keeps exactly the last K sequences."""
    ring = CarriedScores(size=12)
    gate = gate_config("sat_gspo", "sequence_carried", quantile=0.9, quantile_method=method)
    seen_scores, seen_lengths, gated_calls = [], [], 0
    for call in range(40):
        log_prob, old, _, mask = _micro_batch(1, 100 + call, lengths=(20, 40), scale=0.02)
        # every tenth sequence drifts far, inside the band, each further than the last (so it lies above the
        # quantile even when the previous far one is still carried)
        log_prob = log_prob + (0.1 + 0.01 * (call // 10) if call % 10 == 9 else 0.0)
        adv = torch.ones_like(old)
        log_prob.requires_grad_()
        pooled = ring.pooled(log_prob)
        out = sat_gspo_surrogate(log_prob, old, adv, mask, 0.2, 0.2, gate, "sequence_carried", pooled)
        out.loss_mat.sum().backward()
        score = float(out.region.abs_proxy.reshape(-1)[0])
        length = int(mask.sum())
        values = torch.tensor([*seen_scores[-12:], score], dtype=torch.float64)
        weights = torch.tensor([*seen_lengths[-12:], length])
        expected_q = tail_quantile(values, weights > 0, 0.9, method, weight=weights)
        assert torch.equal(out.region.quantile, expected_q), call
        is_gated = bool(out.region.gate.reshape(-1)[0])
        assert is_gated == (score > float(expected_q) > 0.0), call
        if is_gated:
            gated_calls += 1
            seq_ratio = math.exp(float((log_prob - old).detach()[mask].mean()))
            if seq_ratio > float(out.region.upper.reshape(-1)[0]):  # beyond the contracted endpoint: clipped
                assert torch.all(log_prob.grad[mask] == 0) and bool(out.intercepted[mask].all())
        ring.add(out.region)
        seen_scores.append(score)
        seen_lengths.append(length)
        kept_scores, kept_lengths = ring.pooled(log_prob)
        n = min(len(seen_scores), 12)
        assert torch.equal(kept_lengths[-n:], torch.tensor(seen_lengths[-n:]))
        assert torch.equal(kept_scores[-n:], torch.tensor(seen_scores[-n:], dtype=torch.float64))
    assert gated_calls >= 4  # the far-drifting sequences were gated (and possibly a near one), one per micro-batch


def test_sequence_carried_acts_through_verls_loss_at_one_sequence_per_micro_batch():
    """Through verl's registry, the process-wide ring: the paper's ``sequence`` rule is structurally empty on every
    one-sequence micro-batch; ``sequence_carried`` only until ten sequences are pooled, and then gates and
    intercepts."""
    config = {g: _actor_config("sat_gspo", g) for g in ("sequence", "sequence_carried")}
    loss = get_policy_loss_fn("sat_gspo")
    CARRIED.clear()
    try:
        totals = {g: [0.0, 0.0, 0.0] for g in config}  # structurally empty, gated, intercepted
        for call in range(30):
            log_prob, old, _, mask = _micro_batch(1, 200 + call, lengths=(30, 30), scale=0.02)
            log_prob = log_prob + (0.1 + 0.01 * (call // 10) if call % 10 == 9 else 0.0)  # as above
            adv = torch.ones_like(old)
            for granularity, actor in config.items():
                _, metrics = loss(old, log_prob, adv, mask, "seq-mean-token-mean", actor)
                if call == 0:
                    assert metrics["actor/sat_structurally_empty_frac"] == 1.0
                totals[granularity][0] += metrics["actor/sat_structurally_empty_frac"]
                totals[granularity][1] += metrics["actor/sat_gate_rate"]
                totals[granularity][2] += metrics["actor/sat_intercepted_frac"]
        assert totals["sequence"] == [30.0, 0.0, 0.0]
        assert totals["sequence_carried"][0] == 9.0  # equal lengths: until 10 sequences are pooled (alpha 0.9)
        assert totals["sequence_carried"][1] >= 3.0 and totals["sequence_carried"][2] >= 3.0
    finally:
        CARRIED.clear()


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("method", QUANTILE_METHODS)
@pytest.mark.parametrize("alpha", [0.5, 0.9, 0.95])
def test_structurally_empty_exactly_when_nothing_can_be_gated(granularity, method, alpha):
    """With distinct scores and floor 0 (so q > floor whenever anything is stale), the gate is empty if and only if
    the metric says the micro-batch was structurally empty, over micro-batches of 1 to 24 sequences."""
    seen = set()
    for sequences in range(1, 25):
        for seed in range(3):
            out = _surrogate(granularity, method, alpha, _micro_batch(sequences, seed))
            empty, gated = float(out.region.stats.structurally_empty), float(out.region.stats.gated)
            assert empty in (0.0, 1.0)
            assert (empty == 1.0) == (gated == 0.0), (sequences, seed, empty, gated)
            seen.add(empty)
    # per-token scores are structurally empty only below 1 / (1 - alpha) tokens (inverted_cdf) or at one token (linear)
    if not granularity.startswith("token") or (alpha >= 0.9 and method == "inverted_cdf"):
        assert seen == {0.0, 1.0}  # both sides of the boundary were reached


def _top_share_boundary(alpha: float, tokens_per_sequence: int, sequences: int) -> bool:
    """Equal-length sequences under ``sequence`` granularity: empty iff one sequence's tokens exceed (1 - alpha) of
    the micro-batch's, in exact rational arithmetic."""
    return tokens_per_sequence > (1 - Fraction(repr(alpha))) * tokens_per_sequence * sequences


@pytest.mark.parametrize("alpha", [0.8, 0.9, 0.95])
def test_equal_length_boundary_is_one_over_one_minus_alpha_sequences(alpha):
    """Equal lengths: the sequence quantile is structurally empty below 1 / (1 - alpha) sequences (10 at 0.9) and not
    from there on, whatever the staleness; the metric reports it, and sequences per micro-batch are counted."""
    config = _actor_config("sat_gspo", "sequence", alpha)
    for sequences in range(1, 2 * math.ceil(1 / (1 - alpha)) + 1):
        log_prob, old, adv, _ = _micro_batch(sequences, 0)
        mask = torch.ones_like(log_prob, dtype=torch.bool)
        _, metrics = get_policy_loss_fn("sat_gspo")(old, log_prob, adv, mask, "seq-mean-token-mean", config)
        expected = _top_share_boundary(alpha, log_prob.shape[1], sequences)
        assert metrics["actor/sat_structurally_empty_frac"] == float(expected)
        assert (metrics["actor/sat_gate_rate"] == 0.0) == expected
        assert metrics["actor/sat_seqs_per_micro_batch"] == sequences


def _actor_config(loss, granularity, alpha=0.9):
    from conftest import actor_config

    config = actor_config(loss_mode=loss)
    object.__setattr__(config.policy_loss, "sat", gate_config(loss, granularity, quantile=alpha))
    return config


@pytest.mark.parametrize("agg", AGG_MODES)
def test_token_rule_and_token_granularity_act_on_one_sequence(agg):
    """One sequence of 30 tokens: per-token scores still gate (not structurally empty), the sequence scores cannot."""
    log_prob, old, adv, mask = _micro_batch(1, 4, lengths=(30, 30))
    for loss, granularity, empty in (("sat", "sequence", 0.0), ("sat_gspo", "token", 0.0),
                                     ("sat_gspo", "sequence", 1.0)):  # fmt: skip
        _, metrics = get_policy_loss_fn(loss)(old, log_prob, adv, mask, agg, _actor_config(loss, granularity))
        assert metrics["actor/sat_structurally_empty_frac"] == empty
        assert metrics["actor/sat_seqs_per_micro_batch"] == 1.0
        assert (metrics["actor/sat_gate_rate"] > 0) == (empty == 0.0)


def test_token_surrogate_structural_boundary_is_ten_tokens():
    """Unit weights at alpha 0.9: 9 active tokens cannot gate (rank 9 of 9), 10 can (rank 9 of 10)."""
    gate = gate_config("sat", "sequence", quantile=0.9)
    for tokens, empty in ((9, 1.0), (10, 0.0)):
        log_prob, old, adv, mask = _micro_batch(1, 0, lengths=(tokens, tokens))
        out = sat_token_surrogate(log_prob, old, adv, mask, 0.2, 0.2, 3.0, gate)
        assert float(out.region.stats.structurally_empty) == empty


def test_an_all_inactive_micro_batch_is_not_counted_as_structurally_empty():
    log_prob, old, adv, mask = _micro_batch(4, 0)
    for granularity in GRANULARITIES:
        out = _surrogate(granularity, "inverted_cdf", 0.9, (log_prob, old, adv, torch.zeros_like(mask)))
        assert float(out.region.stats.structurally_empty) == 0.0


KEY_FORMAT = "actor_rollout_ref.actor.policy_loss.sat.{}"


def test_the_warning_names_the_keys_after_several_inert_optimizer_steps(caplog):
    """Two ranks, 64 sequences per optimizer step (32 per rank) in micro-batches of 8: a window is 3 steps = 12
    micro-batches on this rank. Half of them empty: no warning; most of them: one warning, naming the keys."""
    monitor = inert_sat.InertSatMonitor()
    info = {"global_batch_size": 64, "dp_size": 2}
    with caplog.at_level(logging.WARNING, logger=inert_sat.__name__):
        for call in range(12):
            monitor.observe(float(call % 2), 8.0, info, 0.9, KEY_FORMAT)
        assert not caplog.records and monitor.calls == 0  # the window closed without a warning
        for _ in range(11):
            monitor.observe(1.0, 8.0, info, 0.9, KEY_FORMAT)
        assert not caplog.records  # the window is not full yet
        monitor.observe(0.0, 8.0, info, 0.9, KEY_FORMAT)
        assert len(caplog.records) == 1
        for _ in range(50):
            monitor.observe(1.0, 8.0, info, 0.9, KEY_FORMAT)
        assert len(caplog.records) == 1  # once per process
    message = caplog.records[0].getMessage()
    assert "SAT could not act in 11 of the last 12 micro-batches (8.0 sequences per micro-batch)" in message
    assert "its gate was structurally empty" in message and "could not gate" not in message
    assert "1 - actor_rollout_ref.actor.policy_loss.sat.quantile = 0.1 of the micro-batch's units" in message
    for key in ("actor_rollout_ref.actor.policy_loss.sat.granularity=sequence_carried",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
                "actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "actor_rollout_ref.actor.use_dynamic_bsz=true",
                "actor/sat_structurally_empty_frac"):  # fmt: skip
        assert key in message


def test_without_the_mini_batch_size_a_window_is_a_fixed_number_of_micro_batches(caplog):
    monitor = inert_sat.InertSatMonitor()
    with caplog.at_level(logging.WARNING, logger=inert_sat.__name__):
        for _ in range(inert_sat.FALLBACK_WINDOW_CALLS - 1):
            monitor.observe(1.0, 2.0, {"global_batch_size": None}, 0.9, KEY_FORMAT)
        assert not caplog.records
        monitor.observe(1.0, 2.0, None, 0.9, KEY_FORMAT)
    assert len(caplog.records) == 1


def test_the_losses_feed_the_process_monitor(monkeypatch):
    """verl's registered losses report every micro-batch to the process's monitor, with the values they log and the
    config's global batch info."""
    seen = []
    monkeypatch.setattr(inert_sat.INERT_MONITOR, "observe", lambda *args, **kwargs: seen.append(args))
    log_prob, old, adv, mask = _micro_batch(4, 1)
    for loss in ("sat_gspo", "sat"):
        config = _actor_config(loss, "sequence")
        config.global_batch_info.update(global_batch_size=64, dp_size=2, batch_num_tokens=int(mask.sum()) * 2)
        get_policy_loss_fn(loss)(old, log_prob, adv, mask, "token-mean", config)
    info = {"global_batch_size": 64, "dp_size": 2, "batch_num_tokens": int(mask.sum()) * 2}
    assert seen == [(1.0, 4.0, info, 0.9, KEY_FORMAT), (0.0, 4.0, info, 0.9, KEY_FORMAT)]


def test_radius_check_is_beyond_only_when_q_lies_past_both_ends_and_nothing_was_intercepted():
    """The radius in log-ratio space is the nearer end, min(log(1 + clip_high), -log(1 - clip_low))."""
    ratio, beyond = inert_sat.radius_check(0.0073, 12.0, 0.0, 3e-4, 4e-4)  # verl #7356: q 18-23x the radius
    assert ratio == pytest.approx(0.0073 / min(math.log1p(4e-4), -math.log1p(-3e-4)))
    assert 18 < ratio < 25 and beyond == 1.0
    assert inert_sat.radius_check(0.0073, 12.0, 1.0, 3e-4, 4e-4)[1] == 0.0  # something was intercepted
    assert inert_sat.radius_check(0.0073, 0.0, 0.0, 3e-4, 4e-4)[1] == 0.0  # nothing gated
    assert inert_sat.radius_check(0.0073, 12.0, 0.0, 0.2, 0.2) == pytest.approx((0.0073 / math.log1p(0.2), 0.0))
    # between the two ends: the far side can still be intercepted
    assert inert_sat.radius_check(3.5e-4, 12.0, 0.0, 3e-4, 4e-4)[1] == 0.0


def test_the_radius_warning_names_the_keys_and_the_papers_radius_once(caplog):
    monitor = inert_sat.InertSatMonitor()
    with caplog.at_level(logging.WARNING, logger=inert_sat.__name__):
        for _ in range(2 * inert_sat.FALLBACK_WINDOW_CALLS):
            monitor.observe(0.0, 16.0, None, 0.9, KEY_FORMAT, beyond_radius=1.0, q_over_radius=20.0,
                            radii=(3e-4, 4e-4))  # fmt: skip
    (record,) = caplog.records
    message = record.getMessage()
    assert message.startswith("SAT gated but could not act in 32 of the last 32 micro-batches")
    for text in ("20 times the clip radius", "actor_rollout_ref.actor.clip_ratio_low=0.0003",
                 "actor_rollout_ref.actor.clip_ratio_high=0.0004", "clip_ratio_low = clip_ratio_high = 0.2",
                 "actor/sat_beyond_radius"):  # fmt: skip
        assert text in message
    assert not monitor.warned  # the structural warning is a separate one


@pytest.mark.parametrize("method", QUANTILE_METHODS)
def test_token_ratio_side_gates_only_what_its_clip_acts_on(method):
    """Per-token scores on a drifted sequence ratio: every sequence's ratio exp(0.15) lies inside verl's band (0.2)
    and beyond every gated token's contracted upper endpoint (the Hill kernel halves the radius at least), tokens
    drift both ways around it. With the side taken from the ratio's drift (``token_ratio_side``) every token counted
    as gated is clipped (zero gradient, advantage +1) and intercepted; with each token's own side (``token``) the
    gated tokens that drifted against their sequence contract the other endpoint and keep their gradient."""
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(8, 40, generator=g, dtype=torch.float64) * 0.5
    drift = 0.15 + noise - noise.mean(dim=-1, keepdim=True)  # each sequence's mean log-ratio exactly 0.15
    old = -torch.rand(8, 40, generator=g, dtype=torch.float64) - 1.0
    adv, mask = torch.ones_like(old), torch.ones_like(old, dtype=torch.bool)
    results = {}
    for granularity in ("token", "token_ratio_side"):
        log_prob = (old + drift).requires_grad_()
        gate = gate_config("sat_gspo", granularity, quantile=0.9, quantile_method=method)
        out = sat_gspo_surrogate(log_prob, old, adv, mask, 0.2, 0.2, gate, granularity)
        out.loss_mat.sum().backward()
        gated = out.region.gate.bool() & mask
        results[granularity] = (gated, log_prob.grad, out)
    gated, grad, out = results["token_ratio_side"]
    assert int(gated.sum()) > 0 and bool((drift[gated] < 0).any())  # some gated tokens drifted against the ratio
    assert torch.all(grad[gated] == 0) and torch.all(grad[~gated] != 0)
    assert torch.equal(out.intercepted, gated) and float(out.region.stats.gated) == int(gated.sum())
    assert torch.all(out.region.upper[gated] <= 1.1) and torch.all(out.region.lower[gated] == 0.8)
    token_gated, token_grad, _ = results["token"]
    against = token_gated & (drift < 0)
    assert torch.equal(token_gated, gated)  # the same gate: only the side differs
    assert bool(against.any()) and torch.all(token_grad[against] != 0)
