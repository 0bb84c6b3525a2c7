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
"""verl policy losses ``sat`` (SAT-PPO/SAT-GRPO) and ``sat_gspo`` (SAT-GSPO), registered with verl's registry.

Thin adapters: the rule lives in ``verl_sat.sat_math``; aggregation and masked means are verl's own.
Signature and return value follow ``verl.trainer.ppo.core_algos.PolicyLossFn``. Each call reads the device once
(all metrics in one transfer), where verl's ``vanilla`` and ``gspo`` read it three times.
"""

from typing import Any

import torch
from omegaconf import DictConfig
from verl.trainer.ppo.core_algos import agg_loss, register_policy_loss
from verl.workers.config import ActorConfig

from verl_sat.config import SAT_KEY_FORMAT, sat_params_of
from verl_sat.inert_sat import INERT_MONITOR, radius_check
from verl_sat.sat_math import CARRIED, SatSurrogate, sat_gspo_surrogate, sat_token_surrogate
from verl_sat.verl_own_losses import keep_verl_own, verl_own

# where verl already registers sat / sat_gspo (the core pull request), its own stay registered (bottom of this module)
_VERL_OWN = verl_own()


@register_policy_loss("sat")  # type: ignore[arg-type]
def compute_policy_loss_sat(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: DictConfig | ActorConfig | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Token-level SAT: verl's ``vanilla`` dual-clip PPO with staleness-adaptive endpoints (Eq. 18).

    Args:
        old_log_prob, log_prob, advantages: ``[B, T]``; response_mask: ``[B, T]``.
        config: the actor config; reads the clip radii, ``clip_ratio_c`` and the SAT hyperparameters of
            ``policy_loss`` (``sat_params_of``).
        rollout_is_weights: optional ``[B, T]`` rollout-correction weights multiplied into the loss.
    """
    assert config is not None, "the SAT losses need the actor config (clip radii and policy_loss's SAT keys)"
    clip_low, clip_high = _sat_clip_radii(config)
    sat = sat_params_of(config.policy_loss, "sat")
    clip_ratio_c = config.get("clip_ratio_c", 3.0)

    out = sat_token_surrogate(log_prob, old_log_prob, advantages, response_mask, clip_low, clip_high, clip_ratio_c, sat)
    return _sat_aggregate(out, loss_agg_mode, config, rollout_is_weights, clip_low, clip_high, sat.quantile)


@register_policy_loss("sat_gspo")  # type: ignore[arg-type]
def compute_policy_loss_sat_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: DictConfig | ActorConfig | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """SAT-GSPO: verl's ``gspo`` (GSPO-token ratio) with staleness-adaptive endpoints (Eqs. 19-20).

    Args: as ``compute_policy_loss_sat``; the SAT hyperparameter ``granularity`` selects the score unit.
    """
    assert config is not None, "the SAT losses need the actor config (clip radii and policy_loss's SAT keys)"
    clip_low, clip_high = _sat_clip_radii(config)
    sat = sat_params_of(config.policy_loss, "sat_gspo")

    carried = CARRIED.pooled(log_prob) if sat.granularity == "sequence_carried" else None
    out = sat_gspo_surrogate(
        log_prob, old_log_prob, advantages, response_mask, clip_low, clip_high, sat, sat.granularity, carried
    )
    if carried is not None:
        CARRIED.add(out.region)
    return _sat_aggregate(out, loss_agg_mode, config, rollout_is_weights, clip_low, clip_high, sat.quantile)


def _sat_clip_radii(config: DictConfig | ActorConfig) -> tuple[float, float]:
    clip_low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    clip_high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    return clip_low, clip_high


def _sat_ppo_kl(log_ratio: torch.Tensor, num_active: torch.Tensor) -> torch.Tensor:
    """verl's ``ppo_kl``, ``masked_mean(-log_ratio, mask)``, bit for bit with fewer temporaries: ``log_ratio`` is 0 at
    inactive tokens, so the same values are summed in the same order (negation and a 1.0 mask are exact)."""
    return -log_ratio.sum() / (num_active + 1e-8)


def _sat_batch_info(global_batch_info: dict, loss_agg_mode: str, out: SatSurrogate) -> dict:
    """verl's ``global_batch_info``, plus the denominators ``agg_loss`` would count from the mask on one rank when verl
    passes none: the same counts, clamped at 1, so that an all-inactive micro-batch is a finite zero (connected to the
    graph) instead of 0 / 0."""
    info = dict(global_batch_info)
    if info.get("dp_size", 1) == 1:
        if loss_agg_mode == "token-mean" and info.get("batch_num_tokens") is None:
            info["batch_num_tokens"] = out.num_active.clamp(min=1)
        elif loss_agg_mode.startswith("seq-mean") and info.get("global_batch_size") is None:
            info["global_batch_size"] = out.num_sequences.clamp(min=1)
    return info


def _sat_aggregate(
    out: SatSurrogate,
    loss_agg_mode: str,
    config: DictConfig | ActorConfig,
    rollout_is_weights: torch.Tensor | None,
    clip_low: float,
    clip_high: float,
    quantile: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Aggregate with verl's ``agg_loss``; the metrics (Table 10 of the paper, and ours) from one host read, which
    also feeds the process's ``INERT_MONITOR`` (``quantile``: SAT's alpha, for its warning)."""
    loss_mat, mask, num_active = out.loss_mat, out.mask, out.num_active
    if rollout_is_weights is not None:  # a NaN weight of an inactive token stays out of the loss and its gradient
        loss_mat = loss_mat * torch.where(mask, rollout_is_weights, 0.0)
    pg_loss = agg_loss(loss_mat=loss_mat, loss_mask=mask, loss_agg_mode=loss_agg_mode,
                       **_sat_batch_info(config.global_batch_info, loss_agg_mode, out))  # fmt: skip

    region, stats = out.region, out.region.stats
    values = [
        region.quantile.double(),  # float64 first: the stack promotes every entry, so counts stay exact
        stats.gated,
        stats.abs_proxy,
        stats.lower_shrink,
        stats.upper_shrink,
        stats.max_shrink,
        stats.structurally_empty,
        out.num_sequences,
        _sat_ppo_kl(out.log_ratio, num_active),
        region.num_units,
        num_active,
        out.num_nan,
        *out.clip_counts(),
        torch.zeros_like(num_active) if out.dual_clipped is None else torch.count_nonzero(out.dual_clipped),
    ]
    read = torch.stack(values).tolist()  # the one host read
    q, gate_sum, abs_sum, lower_shrink, upper_shrink, max_shrink, empty, sequences = read[:8]
    ppo_kl, units, active, nan, *counts = read[8:]
    q_over_radius, beyond_radius = radius_check(q, gate_sum, counts[0], clip_low, clip_high)
    radii = (clip_low, clip_high)
    INERT_MONITOR.observe(empty, sequences, config.global_batch_info, quantile, SAT_KEY_FORMAT,
                          beyond_radius=beyond_radius, q_over_radius=q_over_radius, radii=radii)  # fmt: skip
    per_unit, per_token = 1.0 / max(units, 1.0), 1.0 / max(active, 1.0)
    intercepted, clipped, dual_clipped = (count * per_token for count in counts)
    return pg_loss, {
        "actor/sat_gate_rate": gate_sum * per_unit,
        "actor/sat_q": q,
        "actor/sat_units": units,
        "actor/sat_abs_log_ratio_mean": abs_sum * per_unit,
        "actor/sat_eff_lower_radius": clip_low * (1.0 - lower_shrink * per_unit),
        "actor/sat_eff_upper_radius": clip_high * (1.0 - upper_shrink * per_unit),
        "actor/sat_min_factor": 1.0 - max_shrink,
        "actor/sat_structurally_empty_frac": empty,
        "actor/sat_seqs_per_micro_batch": sequences,
        "actor/sat_intercepted_frac": intercepted,
        "actor/sat_q_over_radius": q_over_radius,
        "actor/sat_beyond_radius": beyond_radius,
        "actor/sat_nan_frac": nan / max(active + nan, 1.0),
        "actor/pg_clipfrac": clipped,
        "actor/ppo_kl": ppo_kl,
        "actor/pg_clipfrac_lower": dual_clipped,
    }


keep_verl_own(_VERL_OWN)
