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
"""The Staleness-Adaptive Trust Region (SAT) in pure torch: SAT_SPEC.md sections 2-5, no verl import.

Shapes: ``B`` sequences, ``T`` response tokens. Inputs are ``[B, T]`` tensors of any float dtype; the gate's
statistics (``|d|``, the quantile, the contraction factors) are computed in float32, or float64 for float64 inputs.
The surrogates return per-token loss matrices; aggregation (verl's ``agg_loss``) is left to the caller.
"""

import math
from dataclasses import dataclass
from typing import Protocol

import torch

LOG_RATIO_CLAMP = 20.0  # |lp - lp_old| clamp, as verl's `vanilla`
GSPO_LOG_RATIO_MAX = 10.0  # upper clamp of the GSPO-token log-ratio, as verl's `gspo`
KERNELS = ("hill", "hill_shifted")
GRANULARITIES = ("sequence", "token")


class GateParams(Protocol):
    """What the gate reads (section 3); ``verl_sat.config.SatConfig`` satisfies it."""

    quantile: float
    kernel: str
    kernel_exponent: float
    min_scale: float
    floor: float


@dataclass(frozen=True)
class TrustRegion:
    """Per-unit SAT interval. A unit is a token (shape ``[B, T]``) or a sequence (shape ``[B, 1]``).

    Attributes:
        lower, upper: interval endpoints ``lo = 1 - eps_lo * c_minus``, ``hi = 1 + eps_hi * c_plus`` (loss dtype).
        gated: bool, units in the tail (``a > q``, ``q > floor``, active).
        gated_index: ``gated.nonzero(as_tuple=True)``, the ``G`` gated units in row-major order.
        kappa: ``[G]`` contraction factor of each gated unit (stat dtype); every other factor is 1.
        contract_up: ``[G]`` bool, the gated unit drifted up (``d > 0``, ``c_plus = kappa``), else down
            (``d < 0``, ``c_minus = kappa``).
        abs_proxy: ``a = |d|`` (stat dtype).
        unit_mask: bool, active units.
        quantile: 0-dim, ``q``.
    """

    lower: torch.Tensor
    upper: torch.Tensor
    gated: torch.Tensor
    gated_index: tuple[torch.Tensor, ...]
    kappa: torch.Tensor
    contract_up: torch.Tensor
    abs_proxy: torch.Tensor
    unit_mask: torch.Tensor
    quantile: torch.Tensor


@dataclass(frozen=True)
class SatSurrogate:
    """Output of a SAT surrogate.

    Attributes:
        loss_mat: ``[B, T]`` per-token loss (finite at every position).
        mask: ``[B, T]`` bool, active tokens after dropping NaN tokens; aggregate with this mask.
        nan_tokens: ``[B, T]`` bool, originally active tokens dropped for NaN inputs.
        log_ratio: ``[B, T]`` detached clamped ``lp - lp_old``.
        clipped: ``[B, T]`` bool, the clip term is active (``L2 > L1``), verl's ``pg_clipfrac`` numerator.
        intercepted: ``[B, T]`` bool, clipped by SAT but not by the nominal interval.
        dual_clipped: ``[B, T]`` bool, the dual clip is active (token rule only; all False for GSPO).
        region: the trust region, per token or per sequence.
    """

    loss_mat: torch.Tensor
    mask: torch.Tensor
    nan_tokens: torch.Tensor
    log_ratio: torch.Tensor
    clipped: torch.Tensor
    intercepted: torch.Tensor
    dual_clipped: torch.Tensor
    region: TrustRegion


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs, float32 otherwise (statistics are never computed in half precision)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def masked_quantile(values: torch.Tensor, mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """Exact linear-interpolation quantile of ``values[mask]`` (``torch.quantile`` semantics), any element count.

    ``torch.quantile`` refuses more than 2^24 elements. Inactive entries are moved below every active one (no
    boolean indexing) and the two order statistics around ``alpha * (n - 1)`` are selected together.

    Args:
        values: any shape; mask: bool, same shape; alpha: in [0, 1].

    Returns:
        0-dim tensor in ``values.dtype``; 0 when the mask is empty.
    """
    num_active = int(torch.count_nonzero(mask))
    if num_active == 0:
        return values.new_zeros(())
    flat = torch.where(mask, values, float("-inf")).reshape(-1)
    num_inactive = flat.numel() - num_active
    pos = alpha * (num_active - 1)
    lo = math.floor(pos)
    v_lo, v_hi = order_statistic_pair(flat, num_inactive + lo + 1)
    return v_lo if pos == lo else torch.lerp(v_lo, v_hi, pos - lo)


# Inputs up to this size go straight to kthvalue; above it a strided sample of numel / 16 elements (at most
# _BRACKET_SAMPLE) brackets the rank, and kthvalue runs on the few candidates inside the bracket.
_BRACKET_MIN_NUMEL = 1 << 12
_BRACKET_SAMPLE = 1 << 14


def order_statistic_pair(flat: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact ``rank``-th and ``rank + 1``-th smallest values of a 1-D tensor (1-based; the second equals the first
    when ``rank`` is the last).

    Large inputs: a strided sample's order statistics give a bracket ``[low, high]`` expected to hold both ranks
    (4 standard deviations of the sample rank on each side); one counting pass checks it, and the selection then
    runs on the candidates inside the bracket only. A bracket that misses falls back to the whole tensor.
    """
    numel = flat.numel()
    if numel > _BRACKET_MIN_NUMEL:
        sample = flat[:: max(numel // _BRACKET_SAMPLE, 16)].sort().values
        size = sample.numel()
        p_lo, p_hi = (rank - 1) / numel, min(rank + 1, numel) / numel
        margin = 4.0 * math.sqrt(size * max(p_lo * (1 - p_lo), p_hi * (1 - p_hi))) + 2
        low = sample[max(int(p_lo * size - margin), 0)]
        high = sample[min(int(p_hi * size + margin), size - 1)]
        num_below = int(torch.count_nonzero(flat < low))
        candidates = flat[(flat >= low) & (flat <= high)]
        if num_below < rank and num_below + candidates.numel() >= min(rank + 1, numel):
            flat, rank = candidates, rank - num_below
    value = torch.kthvalue(flat, rank).values
    if rank >= flat.numel() or int(torch.count_nonzero(flat <= value)) > rank:  # last rank, or value repeated
        return value, value
    return value, torch.where(flat > value, flat, float("inf")).min()


def contraction_factor(abs_proxy: torch.Tensor, q: torch.Tensor, gate: GateParams) -> torch.Tensor:
    """Kernel factor kappa(a; q) for gated units (any shape), clipped below at ``min_scale``.

    ``hill``: ``q^n / (q^n + a^n)`` in ``(0, 0.5]`` for ``a > q``; ``hill_shifted``: ``1 / (1 + ((a - q) / q)^n)``.
    """
    q = q.clamp(min=torch.finfo(abs_proxy.dtype).tiny)
    if gate.kernel == "hill":
        excess = abs_proxy / q
    elif gate.kernel == "hill_shifted":
        excess = (abs_proxy - q).div_(q)
    else:
        raise ValueError(f"unknown SAT kernel {gate.kernel!r}; expected one of {list(KERNELS)}")
    return excess.pow_(gate.kernel_exponent).add_(1.0).reciprocal_().clamp_(min=gate.min_scale)


def trust_region(
    proxy: torch.Tensor,
    unit_mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    gate: GateParams,
    loss_dtype: torch.dtype,
) -> TrustRegion:
    """Tail gate, kernel and sign-selected endpoint contraction (sections 3 and 4).

    Args:
        proxy: detached staleness proxy ``d`` per unit, any shape; unit_mask: bool, same shape.
        clip_low, clip_high: nominal radii ``eps_lo``, ``eps_hi``.
        loss_dtype: dtype of the returned endpoints (the dtype the ratio is clamped in).
    """
    d = proxy.detach().to(stat_dtype(proxy.dtype))
    a = d.abs()
    q = masked_quantile(a, unit_mask, gate.quantile)
    gated = unit_mask & (a > q) if q.item() > gate.floor else torch.zeros_like(unit_mask)
    # Ungated endpoints are verl's scalars (bit for bit); only the tail's G units are computed and scattered in.
    lower = torch.full(d.shape, 1.0 - clip_low, dtype=loss_dtype, device=d.device)
    upper = torch.full(d.shape, 1.0 + clip_high, dtype=loss_dtype, device=d.device)
    gated_index = gated.nonzero(as_tuple=True)
    kappa = contraction_factor(a[gated_index], q, gate)
    contract_up = d[gated_index] > 0  # gated implies a > q >= 0, so d != 0
    lower[gated_index] = torch.where(contract_up, 1.0 - clip_low, 1.0 - clip_low * kappa).to(loss_dtype)
    upper[gated_index] = torch.where(contract_up, 1.0 + clip_high * kappa, 1.0 + clip_high).to(loss_dtype)
    return TrustRegion(
        lower=lower,
        upper=upper,
        gated=gated,
        gated_index=gated_index,
        kappa=kappa,
        contract_up=contract_up,
        abs_proxy=a,
        unit_mask=unit_mask,
        quantile=q,
    )


def stat_log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor, log_ratio: torch.Tensor) -> torch.Tensor:
    """Detached clamped ``lp - lp_old`` in the stat dtype: reuses ``log_ratio`` for float32/64 inputs, recomputes
    from upcast inputs for half precision (a bf16 difference of log-probs near -3 is quantised to 1/64)."""
    dtype = stat_dtype(log_ratio.dtype)
    if log_ratio.dtype == dtype:
        return log_ratio.detach()
    diff = log_prob.detach().to(dtype) - old_log_prob.to(dtype)
    return torch.clamp(diff, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)


def drop_nan_tokens(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Section 6.7: tokens with NaN inputs become inactive and their values 0 (so no NaN reaches sums or grads).

    Returns:
        ``(log_prob, old_log_prob, advantages, mask, nan_tokens, log_ratio)``, all ``[B, T]``: ``mask`` and
        ``nan_tokens`` are bool (``nan_tokens``: originally active tokens that were dropped); ``log_ratio`` is the
        clamped ``lp - lp_old``.
    """
    diff = log_prob - old_log_prob
    bad = torch.isnan(diff + advantages)  # NaN in any input (or inf - inf in the difference)
    active = response_mask.bool()
    if bool(bad.any()):
        log_prob = torch.where(bad, 0.0, log_prob)
        old_log_prob = torch.where(bad, 0.0, old_log_prob)
        advantages = torch.where(bad, 0.0, advantages)
        diff = log_prob - old_log_prob
        nan_tokens, active = active & bad, active & ~bad
    else:
        nan_tokens = torch.zeros_like(active)
    log_ratio = torch.clamp(diff, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    return log_prob, old_log_prob, advantages, active, nan_tokens, log_ratio


def _intercepted(clipped: torch.Tensor, ratio: torch.Tensor, clip_low: float, clip_high: float) -> torch.Tensor:
    """Clipped by SAT but not by the nominal interval: SAT's interval lies inside the nominal one, so a clipped
    token escapes the nominal clip exactly when its ratio is inside ``[1 - eps_lo, 1 + eps_hi]``."""
    return clipped & (ratio >= 1.0 - clip_low) & (ratio <= 1.0 + clip_high)


def sat_token_surrogate(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float,
    gate: GateParams,
) -> SatSurrogate:
    """Token-level SAT (SAT-PPO / SAT-GRPO, section 5): verl's dual-clip PPO with per-token SAT endpoints.

    Args:
        log_prob, old_log_prob, advantages: ``[B, T]``; response_mask: ``[B, T]`` bool or 0/1.
        clip_low, clip_high: nominal radii; clip_ratio_c: dual-clip constant (> 1).
    """
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 for dual-clip PPO, got {clip_ratio_c}")
    log_prob, old_log_prob, advantages, mask, nan_tokens, log_ratio = drop_nan_tokens(
        log_prob, old_log_prob, advantages, response_mask
    )
    proxy = stat_log_ratio(log_prob, old_log_prob, log_ratio)
    region = trust_region(proxy, mask, clip_low, clip_high, gate, log_ratio.dtype)

    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, region.lower, region.upper)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    loss_dual = -advantages * clip_ratio_c
    loss_mat = torch.where(advantages < 0, torch.minimum(loss_dual, loss_ppo), loss_ppo)

    clipped = torch.gt(loss_clipped, loss_unclipped)
    return SatSurrogate(
        loss_mat=loss_mat,
        mask=mask,
        nan_tokens=nan_tokens,
        log_ratio=log_ratio.detach(),
        clipped=clipped,
        intercepted=_intercepted(clipped, ratio.detach(), clip_low, clip_high),
        dual_clipped=torch.gt(loss_ppo, loss_dual) & (advantages < 0),
        region=region,
    )


def sat_gspo_surrogate(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    gate: GateParams,
    granularity: str = "sequence",
) -> SatSurrogate:
    """GSPO-token surrogate with SAT endpoints (section 5), no dual clip.

    ``granularity="sequence"``: the proxy is the sequence log-ratio ``s_i`` and each sequence's factors are
    broadcast to its tokens; ``"token"``: proxy, gate and factors per token.

    Args:
        log_prob, old_log_prob, advantages: ``[B, T]``; response_mask: ``[B, T]`` bool or 0/1.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown SAT granularity {granularity!r}; expected one of {list(GRANULARITIES)}")
    log_prob, old_log_prob, advantages, mask, nan_tokens, log_ratio = drop_nan_tokens(
        log_prob, old_log_prob, advantages, response_mask
    )
    lengths = torch.sum(mask, dim=-1)
    seq_log_ratio = torch.sum(log_ratio * mask, dim=-1) / lengths.clamp(min=1)  # s_i, [B]

    proxy = stat_log_ratio(log_prob, old_log_prob, log_ratio)
    if granularity == "sequence":  # d_i = s_i, in the stat dtype
        proxy = (torch.sum(proxy * mask, dim=-1) / lengths.clamp(min=1)).unsqueeze(-1)
        unit_mask = (lengths > 0).unsqueeze(-1)
    else:
        unit_mask = mask
    region = trust_region(proxy, unit_mask, clip_low, clip_high, gate, log_ratio.dtype)

    log_rho = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    rho = torch.exp(torch.clamp(log_rho, max=GSPO_LOG_RATIO_MAX))
    loss_unclipped = -advantages * rho
    loss_clipped = -advantages * torch.clamp(rho, region.lower, region.upper)
    loss_mat = torch.maximum(loss_unclipped, loss_clipped)

    clipped = torch.gt(loss_clipped, loss_unclipped)
    return SatSurrogate(
        loss_mat=loss_mat,
        mask=mask,
        nan_tokens=nan_tokens,
        log_ratio=log_ratio.detach(),
        clipped=clipped,
        intercepted=_intercepted(clipped, rho.detach(), clip_low, clip_high),
        dual_clipped=torch.zeros_like(mask),
        region=region,
    )
