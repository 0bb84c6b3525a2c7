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
Signature and return value follow ``verl.trainer.ppo.core_algos.PolicyLossFn``.
"""

from typing import Any

import torch
from omegaconf import DictConfig
from verl.trainer.ppo.core_algos import agg_loss, register_policy_loss
from verl.utils.torch_functional import masked_mean
from verl.workers.config import ActorConfig

from verl_sat.config import resolve_sat_config
from verl_sat.sat_math import SatSurrogate, TrustRegion, sat_gspo_surrogate, sat_token_surrogate


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
    """Token-level SAT: verl's ``vanilla`` dual-clip PPO with staleness-adaptive endpoints.

    Args:
        old_log_prob, log_prob, advantages: ``[B, T]``; response_mask: ``[B, T]``.
        config: the actor config; reads the clip radii, ``clip_ratio_c`` and ``policy_loss.sat``.
        rollout_is_weights: optional ``[B, T]`` rollout-correction weights multiplied into the loss.
    """
    clip_low, clip_high = _clip_radii(config)
    out = sat_token_surrogate(
        log_prob,
        old_log_prob,
        advantages,
        response_mask,
        clip_low=clip_low,
        clip_high=clip_high,
        clip_ratio_c=config.get("clip_ratio_c", 3.0),
        gate=resolve_sat_config(config.policy_loss),
    )
    return _aggregate(out, loss_agg_mode, config, rollout_is_weights, clip_low, clip_high)


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
    """SAT-GSPO: verl's ``gspo`` (GSPO-token ratio) with staleness-adaptive endpoints, per sequence or per token.

    Args: as ``compute_policy_loss_sat``; ``policy_loss.sat.granularity`` selects the proxy.
    """
    clip_low, clip_high = _clip_radii(config)
    sat = resolve_sat_config(config.policy_loss)
    out = sat_gspo_surrogate(
        log_prob,
        old_log_prob,
        advantages,
        response_mask,
        clip_low=clip_low,
        clip_high=clip_high,
        gate=sat,
        granularity=sat.granularity,
    )
    return _aggregate(out, loss_agg_mode, config, rollout_is_weights, clip_low, clip_high)


def _clip_radii(config: DictConfig | ActorConfig | None) -> tuple[float, float]:
    if config is None:
        raise ValueError("the SAT losses need the actor config (clip radii and policy_loss.sat); got config=None")
    clip_low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    clip_high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    return clip_low, clip_high


def _aggregate(
    out: SatSurrogate,
    loss_agg_mode: str,
    config: DictConfig | ActorConfig,
    rollout_is_weights: torch.Tensor | None,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Aggregate with verl's ``agg_loss`` and build the metrics of SAT_SPEC.md section 7."""
    loss_mat, mask = out.loss_mat, out.mask
    if rollout_is_weights is not None:
        loss_mat = loss_mat * rollout_is_weights

    num_active = int(torch.count_nonzero(mask))
    if num_active > 0:
        pg_loss = agg_loss(loss_mat=loss_mat, loss_mask=mask, loss_agg_mode=loss_agg_mode, **config.global_batch_info)
    else:  # section 6.6: a finite zero that stays connected to the graph
        pg_loss = torch.where(mask, loss_mat, 0.0).sum()

    region = out.region
    num_nan = int(torch.count_nonzero(out.nan_tokens))
    num_units = max(int(torch.count_nonzero(region.unit_mask)), 1)
    lower_factor, upper_factor = _mean_endpoint_factors(region, num_units)
    metrics = {
        "actor/sat_gate_rate": region.kappa.numel() / num_units,
        "actor/sat_quantile": region.quantile.item(),
        "actor/sat_abs_log_ratio_mean": masked_mean(region.abs_proxy, region.unit_mask).item(),
        "actor/sat_eff_lower_radius": clip_low * lower_factor,
        "actor/sat_eff_upper_radius": clip_high * upper_factor,
        "actor/sat_min_scale": region.kappa.min().item() if region.kappa.numel() else 1.0,  # 1: nothing gated
        "actor/sat_intercepted_frac": _token_frac(out.intercepted, mask, num_active),
        "actor/sat_nan_frac": num_nan / (num_active + num_nan) if num_nan else 0.0,
        "actor/pg_clipfrac": _token_frac(out.clipped, mask, num_active),
        "actor/ppo_kl": masked_mean(-out.log_ratio, mask).item(),
        "actor/pg_clipfrac_lower": _token_frac(out.dual_clipped, mask, num_active),
    }
    return pg_loss, metrics


def _token_frac(flags: torch.Tensor, mask: torch.Tensor, num_active: int) -> float:
    """Fraction of active tokens where the bool ``[B, T]`` ``flags`` hold."""
    return int(torch.count_nonzero(flags & mask)) / max(num_active, 1)


def _mean_endpoint_factors(region: TrustRegion, num_units: int) -> tuple[float, float]:
    """Mean ``c_minus`` and ``c_plus`` over active gate units: 1 minus each endpoint's summed deficit ``1 - kappa``
    over the gated units that contract it."""
    deficit = 1.0 - region.kappa
    up = float(deficit[region.contract_up].sum())
    down = float(deficit[~region.contract_up].sum())
    return 1.0 - down / num_units, 1.0 - up / num_units
