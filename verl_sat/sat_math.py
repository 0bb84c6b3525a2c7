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
"""The Staleness-Adaptive Trust Region (SAT, arXiv 2607.18722, Eqs. 13-20) in pure torch, no verl import.

Shapes: ``B`` sequences, ``T`` response tokens. Inputs are ``[B, T]`` tensors of any float dtype; the gate's
statistics (``|d|``, the quantile, the contraction factors) are computed in float32, or float64 for float64 inputs.
The surrogates return per-token loss matrices; aggregation (verl's ``agg_loss``) is left to the caller.

Nothing here reads a tensor back to the host, and every operator is deterministic on CUDA: the tail quantile is an
exact order statistic from ``topk`` (or a ``sort`` and an int64 cumulative weight) with static sizes and int64 ranks,
so on CUDA the loss is queued without a stream stall, also under ``torch.use_deterministic_algorithms(True)``.
"""

import functools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch

LOG_RATIO_CLAMP = 20.0  # |lp - lp_old| clamp of the token rule and the proxy (Eq. 13), as verl's `vanilla`
GSPO_LOG_RATIO_MAX = 10.0  # upper clamp of the GSPO-token log-ratio, as verl's `gspo`
KERNELS = ("hill", "hill_shifted")
GRANULARITIES = ("sequence", "sequence_uniform", "sequence_carried", "token", "token_ratio_side")
CARRIED_SEQUENCES = 256  # ``sequence_carried``: the most recent sequence scores pooled into the quantile
QUANTILE_METHODS = ("inverted_cdf", "linear")


DEFAULT_GRANULARITY = "sequence"
TOKEN_LEVEL_LOSSES = ("sat",)  # losses whose proxy is always per token: any granularity but the default is refused


@dataclass
class SatParams:
    """Hyperparameters of the Staleness-Adaptive Trust Region (Eqs. 14-20): what the gate and the surrogates read.

    Args:
        quantile (float): Tail quantile alpha in (0, 1), a decimal of at most 6 places; units with |d| above the
            alpha-quantile q of the micro-batch are gated (Eq. 14).
        quantile_method (str): How q is read off the sorted |d|: "inverted_cdf" (the paper's lower empirical
            quantile: the ceil(alpha * n)-th smallest, no interpolation) or "linear" (torch.quantile's interpolation).
        kernel (str): Contraction kernel (Eq. 16), "hill" (kappa = q^n / (q^n + a^n)) or "hill_shifted"
            (kappa = 1 / (1 + ((a - q) / q)^n), continuous at q).
        kernel_exponent (float): Hill exponent n > 0.
        min_scale (float): Lower bound on the contraction factor kappa, in [0, 1].
        floor (float): Gate only when the quantile q exceeds this value (>= 0); avoids gating pure noise.
        granularity (str): SAT score unit of the GSPO surrogate: "sequence" (s_i broadcast to the sequence's active
            tokens, quantile over tokens: length-weighted, Eq. 20), "sequence_uniform" (quantile over sequences,
            each once), "sequence_carried" (as "sequence", the quantile over this micro-batch's sequences and the
            last ``CARRIED_SEQUENCES`` ones the process scored before it, detached: no gate is empty for lack of
            sequences), "token" (per-token scores, each gated token contracting the endpoint its own d_t drifted
            toward) or "token_ratio_side" (per-token scores and gate, the contracted endpoint the one the sequence
            ratio exp(s_i) drifted toward, so every gated token is one the clip can act on). The token-level loss is
            always per token and refuses any other value.
    """

    quantile: float = 0.9
    quantile_method: str = "inverted_cdf"
    kernel: str = "hill"
    kernel_exponent: float = 2.0
    min_scale: float = 0.0
    floor: float = 0.0
    granularity: str = DEFAULT_GRANULARITY


def sat_param_errors(params: SatParams, loss_mode: str | None = None) -> list[tuple[str, Any, str]]:
    """Every invalid hyperparameter as ``(name, value, what is wrong)``; ``loss_mode`` adds the check that a
    token-level loss keeps the default granularity."""
    allowed = {
        "quantile": (
            0.0 < params.quantile < 1.0 and _alpha_fraction(params.quantile).denominator <= MAX_QUANTILE_DENOMINATOR,
            "a float in the open interval (0, 1) with at most 6 decimal places",
        ),
        "quantile_method": (params.quantile_method in QUANTILE_METHODS, f"one of {list(QUANTILE_METHODS)}"),
        "kernel": (params.kernel in KERNELS, f"one of {list(KERNELS)}"),
        "kernel_exponent": (params.kernel_exponent > 0.0, "a float > 0"),
        "min_scale": (0.0 <= params.min_scale <= 1.0, "a float in [0, 1]"),
        "floor": (params.floor >= 0.0, "a float >= 0"),
        "granularity": (params.granularity in GRANULARITIES, f"one of {list(GRANULARITIES)}"),
    }
    errors = [(name, getattr(params, name), f"is invalid: expected {what}; fix the command-line override or the "
               "config file") for name, (ok, what) in allowed.items() if not ok]  # fmt: skip
    if loss_mode in TOKEN_LEVEL_LOSSES and params.granularity != DEFAULT_GRANULARITY:
        errors.append(("granularity", params.granularity, f"has no effect with loss_mode={loss_mode!r} (the "
                       "token-level rule scores every token): remove the key, or use loss_mode=sat_gspo"))  # fmt: skip
    return errors


def check_sat_params(params: SatParams, key_format: str, loss_mode: str | None = None) -> None:
    """Raise ``ValueError`` for the first invalid hyperparameter, naming its config key ``key_format.format(name)``
    (e.g. ``"actor_rollout_ref.actor.policy_loss.sat_{}"``), its value and what is allowed."""
    errors = sat_param_errors(params, loss_mode)
    if errors:
        name, value, problem = errors[0]
        raise ValueError(f"{key_format.format(name)}={value!r} {problem}")


@dataclass(frozen=True)
class RegionStats:
    """Sums over the quantile's units (weighted by ``TrustRegion.weight``), 0-dim tensors: the diagnostics of the
    paper's Table 10 before division, so that the caller reads them all in one transfer."""

    gated: torch.Tensor  # gated units
    abs_proxy: torch.Tensor  # sum of |d|
    lower_shrink: torch.Tensor  # sum of 1 - c_minus
    upper_shrink: torch.Tensor  # sum of 1 - c_plus
    max_shrink: torch.Tensor  # max of 1 - kappa (0 when nothing is gated)
    structurally_empty: torch.Tensor  # 1.0 when the top unit alone covers the quantile's rank (see below), else 0.0


@dataclass(frozen=True)
class TrustRegion:
    """Per-unit SAT interval. A unit is a token (shape ``[B, T]``) or a sequence (shape ``[B, 1]``).

    Attributes:
        lower, upper: endpoints ``lo = 1 - eps_lo * c_minus``, ``hi = 1 + eps_hi * c_plus`` per unit (loss dtype);
            verl's scalars ``1 -+ eps`` bit for bit where nothing is contracted.
        gate: bool per unit, True on gated units (active, ``q > floor`` and ``a > q``, and a side other than 0).
        deficit: ``1 - kappa`` per unit on gated units, else 0 (stat dtype).
        direction: the side each unit contracts, -1 / 0 / +1 (stat dtype): the sign of ``d``, or the ``side`` given
            (``[B, 1]`` for a side per sequence, broadcast over its tokens).
        abs_proxy: ``a = |d|`` per unit (stat dtype), 0 at inactive units.
        unit_mask: bool per unit, active.
        weight: int64 tokens each unit stands for in the quantile (``sequence``: a sequence's length, 0 when
            inactive), or ``None``: 1 per active unit.
        num_units: 0-dim int64, the units the quantile saw (tokens; sequences for ``sequence_uniform``).
        quantile: 0-dim ``q`` (stat dtype); 0 when there is no active unit.
        stats: the sums behind the diagnostics.
    """

    lower: torch.Tensor
    upper: torch.Tensor
    gate: torch.Tensor
    deficit: torch.Tensor
    direction: torch.Tensor
    abs_proxy: torch.Tensor
    unit_mask: torch.Tensor
    weight: torch.Tensor | None
    num_units: torch.Tensor
    quantile: torch.Tensor
    stats: RegionStats

    @property
    def gated(self) -> torch.Tensor:
        """bool per unit, the gated units."""
        return self.gate

    @property
    def shrink(self) -> torch.Tensor:
        """Signed contraction per unit: ``1 - kappa`` with the sign of the side on gated units (> 0 contracts the
        upper endpoint, ``c_plus = 1 - shrink``; < 0 the lower, ``c_minus = 1 + shrink``), else 0."""
        return self.deficit * self.direction

    @property
    def kappa(self) -> torch.Tensor:
        """The contraction factor per unit (Eq. 16) where gated, 1 elsewhere."""
        return 1.0 - self.deficit


@dataclass(frozen=True)
class SatSurrogate:
    """Output of a SAT surrogate.

    Attributes:
        loss_mat: ``[B, T]`` per-token loss, exactly 0 at inactive tokens (padding and NaN tokens).
        mask: ``[B, T]`` bool, active tokens after dropping NaN tokens; aggregate with this mask.
        num_active: 0-dim int64, active tokens (``mask`` count).
        num_sequences: 0-dim int64, sequences with an active token.
        num_nan: 0-dim int64, originally active tokens dropped for NaN inputs.
        log_ratio: ``[B, T]`` detached ``lp - lp_old`` from which verl's counterpart computes ``ppo_kl`` (clamped at
            +-20 for the token rule, raw for GSPO); 0 at inactive tokens.
        clipped: ``[B, T]`` bool, active tokens whose clip term is active (``L2 > L1``), verl's ``pg_clipfrac``.
        in_band: bool, ``[B, T]`` or ``[B, 1]`` (a ratio per sequence): the (detached) ratio lies inside verl's
            nominal interval ``[1 - eps_lo, 1 + eps_hi]``; ``intercepted`` = ``clipped & in_band``.
        dual_clipped: ``[B, T]`` bool, active tokens whose dual clip is active (token rule), ``None`` for GSPO.
        region: the trust region, per token or per sequence.
    """

    loss_mat: torch.Tensor
    mask: torch.Tensor
    num_active: torch.Tensor
    num_nan: torch.Tensor
    log_ratio: torch.Tensor
    clipped: torch.Tensor
    in_band: torch.Tensor
    dual_clipped: torch.Tensor | None
    region: TrustRegion
    num_sequences: torch.Tensor

    @property
    def intercepted(self) -> torch.Tensor:
        """``[B, T]`` bool, active tokens clipped by SAT but not by the nominal interval. SAT's interval lies inside
        the nominal one on the side a clip acts, so these are the clipped tokens whose ratio lies in the nominal
        interval; only gated units can have one."""
        return self.clipped & self.in_band

    def clip_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """0-dim int64 counts of the intercepted and the clipped tokens; with a band test per sequence from the
        clipped tokens' row sums (one pass over ``[B, T]``)."""
        if self.in_band.shape == self.clipped.shape:
            return torch.count_nonzero(self.intercepted), torch.count_nonzero(self.clipped)
        rows = _row_counts(self.clipped).unsqueeze(-1)
        return rows.mul(self.in_band).sum(), rows.sum()


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs, float32 otherwise (statistics are never computed in half precision)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---- the tail quantile (Eq. 14) ------------------------------------------------------------------------------------

# the quantile is a decimal of at most 6 places, so the int64 rank arithmetic is exact up to 2^40 units:
# (10^6 + 10^6) x 2^40 < 2^62
MAX_QUANTILE_DENOMINATOR = 10**6


@functools.cache
def _alpha_fraction(alpha: float) -> Fraction:
    """``alpha`` as the decimal the user wrote (``0.9`` is 9/10, not the nearest binary float)."""
    return Fraction(repr(float(alpha)))


def quantile_ranks(num: torch.Tensor, alpha: float, method: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """1-based ascending ranks of the order statistics that define ``q`` among ``num`` active units.

    ``inverted_cdf`` (the paper's lower empirical quantile, Eq. 14): rank ``k = ceil(alpha * n)`` in int64, exact for
    the decimal written (alpha 0.9 of 70 units is rank 63). ``linear`` (``torch.quantile``): ranks ``floor(p) + 1``
    and ``ceil(p) + 1`` with ``p = alpha * (n - 1)`` in float64, interpolated with weight ``p - floor(p)``.

    Args:
        num: 0-dim int64 count of active units, below 2^40; alpha: a decimal of at most 6 places.

    Returns:
        ``ranks``, int64, at least 1: ``[1]`` for ``inverted_cdf``, ``[2]`` for ``linear``; and the interpolation
        weight (0-dim float64; ``None`` for ``inverted_cdf``).
    """
    if method == "inverted_cdf":
        frac = _alpha_fraction(alpha)
        if frac.denominator > MAX_QUANTILE_DENOMINATOR:
            raise ValueError(f"SAT quantile {alpha!r} has more than 6 decimal places: no exact int64 rank")
        rank = torch.div(num * frac.numerator + frac.denominator - 1, frac.denominator, rounding_mode="floor")
        return rank.clamp_(min=1).reshape(1), None
    if method == "linear":
        pos = alpha * (num.to(torch.float64) - 1).clamp(min=0)
        low = pos.floor()
        return torch.stack([low, pos.ceil()]).long() + 1, pos - low
    raise ValueError(f"unknown SAT quantile method {method!r}; expected one of {list(QUANTILE_METHODS)}")


# A non-negative float orders as its bit pattern read as a signed integer of its width; integers sort by radix sort,
# on a CPU ten times faster than floats (1M float32: 6 ms against 98 ms on 2 cores), and select faster too.
_PATTERNS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
             torch.float16: torch.int16}  # fmt: skip
# From this many units on, a full sort of the patterns costs less than a topk of the tail (radix sort is linear);
# below, the topk's small output avoids the allocations of a full sort (int32 at alpha 0.9 on 2 cores: 65,536 units,
# sort 0.54 ms against topk 0.74 ms; 32,768 units, 0.27 ms against 0.21 ms).
_SORT_MIN_UNITS = 1 << 16


def tail_quantile(
    values: torch.Tensor,
    mask: torch.Tensor,
    alpha: float,
    method: str = "inverted_cdf",
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """The alpha-quantile ``q`` of the active ``values`` (Eq. 14), exact for any count (also above 2^24).

    Args:
        values: non-negative and finite at active entries, any shape; mask: bool, same shape (active entries).
        alpha: in [0, 1]; method: ``inverted_cdf`` or ``linear`` (see ``quantile_ranks``).
        weight: optional int64 multiplicity per entry (``sequence`` granularity: a sequence's length).

    Returns:
        0-dim ``q`` in ``values.dtype``; 0 when nothing is active.
    """
    if weight is not None:
        weight = torch.where(mask, weight, 0)
    num = torch.count_nonzero(mask) if weight is None else weight.sum()
    return _masked_tail_quantile(torch.where(mask, values, 0.0), num, alpha, method, weight)


def _masked_tail_quantile(values, num, alpha, method, weight, ranks=None) -> torch.Tensor:
    """``tail_quantile`` of ``values`` that are 0 at inactive entries, with ``weight`` 0 there too (or ``None``: unit
    weights); ``num`` counts the active units.

    The values are ordered as their integer bit patterns (the same order for non-negative floats). Unit weights: the
    inactive zeros sort below (or tie with) every active entry, so rank ``k`` among ``num`` active entries is position
    ``k - 1 + (numel - num)`` of an ascending sort; below ``_SORT_MIN_UNITS`` it is read off a ``topk`` of static size
    instead, the ``(num - k)``-th largest: ``n - ceil(alpha n) = floor((1 - alpha) n)`` entries lie above the rank,
    which grows with ``n``, plus one for the rank and one for ``linear``'s upper neighbour. Weights: a sort, the int64
    cumulative weight in that order, and a ``searchsorted`` of the rank, which lands on an entry of positive weight.
    Ties cannot change the value found, no operator reads back to the host, and each is deterministic on CUDA
    (``topk``, ``sort``, integer ``cumsum``, ``searchsorted``, ``gather``). ``ranks``: ``quantile_ranks(num, alpha,
    method)`` when the caller has them.
    """
    flat = values.reshape(-1)
    numel = flat.numel()
    if numel == 0:
        return values.new_zeros(())
    ranks, interpolation = quantile_ranks(num, alpha, method) if ranks is None else ranks
    patterns = flat.view(_PATTERNS[flat.dtype])
    if weight is None and numel < _SORT_MIN_UNITS:
        top = min(numel, numel - math.ceil(_alpha_fraction(alpha) * numel) + 2)
        ordered = torch.topk(patterns, top).values  # descending
        position = num - ranks
    elif weight is None:
        ordered = torch.sort(patterns).values  # ascending: a descending integer sort is no radix sort on a CPU
        position = ranks + (numel - num) - 1
    else:
        ordered, order = torch.sort(patterns)
        position = torch.searchsorted(weight.reshape(-1).gather(0, order).cumsum(0), ranks)
    # gather, not ordered[position]: indexing with a tensor of positions would read it back to size the result
    found = ordered.gather(0, position.clamp_(0, len(ordered) - 1)).view(flat.dtype)
    if method == "inverted_cdf":
        return found.squeeze(0)
    low, high = found.unbind()
    return torch.lerp(low, high, interpolation.to(values.dtype))


# ---- kernel and endpoints (Eqs. 15-17) -----------------------------------------------------------------------------


def contraction_deficit(abs_proxy: torch.Tensor, q: torch.Tensor, gate: SatParams) -> torch.Tensor:
    """``1 - kappa(a; q)`` of the kernel (Eq. 16), any shape, at most ``1 - min_scale``; 0 for ``a <= q`` under
    ``hill_shifted``, meaningful on gated units (``a > q``) under ``hill``.

    ``hill``: ``kappa = q^n / (q^n + a^n)``, so ``1 - kappa = 1 / (1 + (q / a)^n)`` (``kappa`` in ``(0, 0.5]`` for
    ``a > q``); ``hill_shifted``: ``kappa = 1 / (1 + ((a - q) / q)^n)``, so ``1 - kappa = 1 / (1 + (q / (a - q))^n)``.
    """
    q = q.clamp(min=torch.finfo(abs_proxy.dtype).tiny)  # a = 0 gives q / a = inf and a deficit of 0, never NaN
    if gate.kernel == "hill":
        inverse = torch.div(q, abs_proxy)
    elif gate.kernel == "hill_shifted":
        inverse = torch.div(q, (abs_proxy - q).clamp_(min=0.0))
    else:
        raise ValueError(f"unknown SAT kernel {gate.kernel!r}; expected one of {list(KERNELS)}")
    deficit = inverse.pow_(gate.kernel_exponent).add_(1.0).reciprocal_()
    return deficit.clamp_(max=1.0 - gate.min_scale) if gate.min_scale > 0 else deficit


def structurally_empty(
    abs_proxy: torch.Tensor,
    unit_mask: torch.Tensor,
    weight: torch.Tensor | None,
    num_units: torch.Tensor,
    lowest_rank: torch.Tensor,
) -> torch.Tensor:
    """Whether the gate is empty because of the micro-batch's shape rather than its staleness: the highest-scoring
    unit (the heaviest of those tied at the top) stands for at least ``n - k + 1`` of the ``n`` units, ``k`` the
    quantile's (lowest) rank, so it covers rank ``k``: ``q`` is its own score and no unit lies strictly above ``q``.
    For ``inverted_cdf`` that is a weight above ``(1 - alpha) n``, in exact int64 arithmetic. With unit weights it
    means ``k = n`` (``inverted_cdf`` at alpha 0.9: fewer than 10 units; ``linear``: one unit); with length weights
    (``sequence``) it holds whenever the top sequence has more than ``1 - alpha`` of the tokens, e.g. below about 10
    sequences of similar length. Not flagged (0.0) but also gating nothing: ``q <= floor`` (e.g. no staleness), and a
    group of units tied at the top that covers ``k`` only together.

    Args:
        abs_proxy: ``|d|`` per unit, 0 at inactive units; unit_mask: bool, same shape; weight: int64 tokens per unit
            (0 at inactive units) or ``None`` (1 per active unit); num_units: 0-dim int64, ``n``; lowest_rank: 1-dim
            int64, the quantile's lowest rank ``k`` (``quantile_ranks(...)[0][:1]``).

    Returns:
        0-dim, 1.0 or 0.0 in ``abs_proxy``'s dtype; 0.0 when nothing is active.
    """
    active = num_units > 0
    if weight is None:  # the top unit weighs 1: it covers rank k if k = n
        covers = torch.ge(lowest_rank, num_units)
    else:
        at_top = torch.eq(abs_proxy, abs_proxy.amax()).logical_and_(unit_mask)
        top_weight = torch.where(at_top, weight, 0).amax()
        covers = torch.ge(top_weight + lowest_rank, num_units + 1)
    return covers.squeeze(0).logical_and_(active).to(abs_proxy.dtype)


def trust_region(
    proxy: torch.Tensor,
    unit_mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    gate: SatParams,
    loss_dtype: torch.dtype,
    weight: torch.Tensor | None = None,
    num_units: torch.Tensor | None = None,
    side: torch.Tensor | None = None,
    carried: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> TrustRegion:
    """Tail gate, kernel and sign-selected endpoint contraction (Eqs. 14-17).

    Args:
        proxy: detached staleness proxy ``d`` per unit, any shape, finite, 0 at inactive units; unit_mask: bool, same
            shape.
        clip_low, clip_high: nominal radii ``eps_lo``, ``eps_hi``.
        loss_dtype: dtype of the returned endpoints (the dtype the ratio is clamped in).
        weight: optional int64 tokens per unit (length-weighted quantile), 0 at inactive units; default 1 per active
            unit.
        num_units: the active units (``unit_mask`` count, or the weight sum), when the caller has it already.
        side: optional -1 / 0 / +1 per unit (``proxy``'s shape, or broadcast to it: ``[B, 1]`` for a side per
            sequence): the endpoint a gated unit contracts, instead of the sign of its own ``d``; a unit of side 0 is
            not gated (nothing has drifted for the clip to act on).
        carried: optional ``(a, weight)``, ``[K]`` detached ``|d|`` (stat dtype) and int64 weights of units scored
            before (0 and 0 in empty slots), pooled with this call's units into the quantile only (needs ``weight``);
            ``num_units`` and the statistics stay this call's.
    """
    # the statistics are detached, fresh tensors: updated in place (each fresh CPU temporary costs page faults)
    d = proxy.detach().to(stat_dtype(proxy.dtype))
    a = d.abs()  # 0 at inactive units, as d
    if num_units is None:
        num_units = torch.count_nonzero(unit_mask) if weight is None else weight.sum()
    pool_a, pool_mask, pool_weight, pool_units = a, unit_mask, weight, num_units
    if carried is not None:  # the quantile of this call's units and the carried ones together
        pool_a = torch.cat([a.reshape(-1), carried[0].to(a.dtype)])
        pool_weight = torch.cat([weight.reshape(-1), carried[1]])
        pool_mask, pool_units = pool_weight > 0, num_units + carried[1].sum()
    ranks = quantile_ranks(pool_units, gate.quantile, gate.quantile_method)
    q = _masked_tail_quantile(pool_a, pool_units, gate.quantile, gate.quantile_method, pool_weight, ranks)
    empty = structurally_empty(pool_a, pool_mask, pool_weight, pool_units, ranks[0][:1]) if a.numel() else \
        a.new_zeros(())  # fmt: skip
    # 1.0 where a > threshold (a - threshold has sign +1), 0.0 elsewhere: inactive units have a = 0 <= q
    threshold = q.masked_fill(q <= gate.floor, math.inf)
    gated = torch.gt(a, threshold)
    if side is not None:
        gated.logical_and_(side != 0)  # broadcast: a [B, 1] side costs nothing per token
    direction = d.sign() if side is None else side.to(d.dtype)
    deficit = torch.where(gated, contraction_deficit(a, q, gate), 0.0)  # 1 - kappa on gated units, else 0
    max_shrink = deficit.amax() if a.numel() else a.new_zeros(())
    # lo = (1 - eps_lo) + eps_lo * (1 - c_minus), hi = (1 + eps_hi) - eps_hi * (1 - c_plus); adding +-0 to verl's
    # scalar leaves it bit for bit where nothing is contracted
    if direction.shape == deficit.shape:  # a side per unit: split the signed contraction
        shrink = deficit * direction
        lower_part, upper_part = torch.clamp(shrink, max=0.0), torch.clamp(shrink, min=0.0)  # -(1 - c_-), 1 - c_+
        lower_sum, upper_sum = -lower_part.sum(), upper_part.sum()
        lower = lower_part.mul_(-clip_low).to(loss_dtype).add_(1.0 - clip_low)
        upper = upper_part.mul_(-clip_high).to(loss_dtype).add_(1.0 + clip_high)
    else:  # one side per sequence ([B, 1], broadcast): each sequence contracts one endpoint, no per-token split
        down, up = torch.lt(direction, 0.0).to(a.dtype), torch.gt(direction, 0.0).to(a.dtype)
        row = deficit.sum(dim=-1, keepdim=True)
        lower_sum, upper_sum = row.mul(down).sum(), row.mul(up).sum()
        lower = deficit.mul(down * clip_low).to(loss_dtype).add_(1.0 - clip_low)
        upper = deficit.mul(up * -clip_high).to(loss_dtype).add_(1.0 + clip_high)

    if weight is None:
        sums = [torch.count_nonzero(gated).to(a.dtype), a.sum()]
    else:  # per-sequence units: one weighted reduction (no matmul: cuBLAS is not deterministic by default)
        parts = (gated.to(a.dtype), a, lower_part, upper_part)
        sums = torch.stack(parts).reshape(len(parts), -1).mul_(weight.reshape(-1)).sum(-1).unbind()
        lower_sum, upper_sum = -sums[2], sums[3]
    stats = RegionStats(
        gated=sums[0],
        abs_proxy=sums[1],
        lower_shrink=lower_sum,
        upper_shrink=upper_sum,
        max_shrink=max_shrink,
        structurally_empty=empty,
    )
    return TrustRegion(
        lower=lower,
        upper=upper,
        gate=gated,
        deficit=deficit,
        direction=direction,
        abs_proxy=a,
        unit_mask=unit_mask,
        weight=weight,
        num_units=num_units,
        quantile=q,
        stats=stats,
    )


# ---- surrogates (Eqs. 18-20) ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _CleanInputs:
    """The inputs with every inactive token set to 0: padding, and active tokens with a NaN input, which become
    inactive (Eq. 13 needs a finite log-ratio). ``[B, T]``.

    The zeros are selected with ``where`` before anything else, so no NaN or inf of an inactive token reaches the
    loss, its gradient or the statistics: ``loss_mat`` is exactly 0 there, which verl's ``seq-mean-*`` aggregations
    need (they multiply by the mask, and NaN x 0 is NaN).
    """

    diff: torch.Tensor  # lp - lp_old, carries the gradient; 0 at inactive tokens, +-inf where a log-prob is +-inf
    multiplier: torch.Tensor  # -A, 0 at inactive tokens
    mask: torch.Tensor  # bool, active and not NaN
    num_active: torch.Tensor  # 0-dim int64
    num_nan: torch.Tensor  # 0-dim int64, originally active tokens dropped


def _clean_inputs(log_prob, old_log_prob, advantages, response_mask) -> _CleanInputs:
    diff = log_prob - old_log_prob
    given = response_mask.bool()
    # NaN in any input (or inf - inf in the difference, or with the advantage) drops the token; +-inf log-probs alone
    # go through the clamp
    dropped = torch.isnan(diff.detach() + advantages).logical_and_(given)
    mask = given ^ dropped
    return _CleanInputs(
        diff=torch.where(mask, diff, 0.0),
        multiplier=torch.where(mask, advantages, -0.0).neg_(),  # +0.0 at inactive tokens
        mask=mask,
        num_active=torch.count_nonzero(mask),
        num_nan=torch.count_nonzero(dropped),
    )


def _row_counts(flags: torch.Tensor) -> torch.Tensor:
    """``[B]`` int64 count of the True entries of each row of a bool ``[B, T]``: summed in int32 (exact below 2^31
    entries; at 64 x 16384 on 2 cores a bool sum, which accumulates in int64, costs 1.7 times as much and a byte view
    2.7 times), then widened."""
    return flags.sum(dim=-1, dtype=torch.int32).long()


def _clamp_log_ratio(diff: torch.Tensor) -> torch.Tensor:
    return torch.clamp(diff, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)


def _stat_proxy(inputs: _CleanInputs, log_prob, old_log_prob, log_ratio: torch.Tensor | None = None) -> torch.Tensor:
    """The token proxy ``d = clamp(lp - lp_old, -20, 20)`` (Eq. 13), detached, in the stat dtype, 0 at inactive tokens:
    ``log_ratio`` (the clamped ``diff``) itself when given for float32/64 inputs; recomputed from upcast inputs for half
    precision (a bf16 difference of log-probs near -3 is quantised to 1/64)."""
    dtype = stat_dtype(inputs.diff.dtype)
    if inputs.diff.dtype == dtype:
        return _clamp_log_ratio(inputs.diff.detach()) if log_ratio is None else log_ratio.detach()
    diff = torch.where(inputs.mask, log_prob.detach().to(dtype) - old_log_prob.to(dtype), 0.0)
    return _clamp_log_ratio(diff)


def _in_band(ratio: torch.Tensor, clip_low: float, clip_high: float) -> torch.Tensor:
    """``ratio`` (detached; ``[B, T]``, or ``[B, 1]`` when it is the same at every token of a sequence) inside
    verl's nominal interval ``[1 - eps_lo, 1 + eps_hi]``."""
    return torch.eq(torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high), ratio)


def sat_token_surrogate(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float,
    gate: SatParams,
) -> SatSurrogate:
    """Token-level SAT (SAT-PPO / SAT-GRPO, Eq. 18): verl's dual-clip PPO with per-token SAT endpoints.

    Args:
        log_prob, old_log_prob, advantages: ``[B, T]``; response_mask: ``[B, T]`` bool or 0/1.
        clip_low, clip_high: nominal radii; clip_ratio_c: dual-clip constant (> 1).
    """
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 for dual-clip PPO, got {clip_ratio_c}")
    inputs = _clean_inputs(log_prob, old_log_prob, advantages, response_mask)
    mask, multiplier = inputs.mask, inputs.multiplier
    log_ratio = _clamp_log_ratio(inputs.diff)
    proxy = _stat_proxy(inputs, log_prob, old_log_prob, log_ratio)
    region = trust_region(proxy, mask, clip_low, clip_high, gate, log_ratio.dtype, num_units=inputs.num_active)

    ratio = torch.exp(log_ratio)
    loss_unclipped = multiplier * ratio
    loss_clipped = multiplier * torch.clamp(ratio, region.lower, region.upper)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    loss_dual = multiplier * clip_ratio_c
    negative = advantages < 0
    loss_mat = torch.where(negative, torch.minimum(loss_dual, loss_ppo), loss_ppo)

    # inactive tokens have a multiplier of +0 and a finite ratio: both losses are 0 there, never clipped
    clipped = torch.gt(loss_clipped, loss_unclipped)
    return SatSurrogate(
        loss_mat=loss_mat,
        mask=mask,
        num_active=inputs.num_active,
        num_nan=inputs.num_nan,
        log_ratio=log_ratio.detach(),
        clipped=clipped,
        in_band=_in_band(ratio.detach(), clip_low, clip_high),
        dual_clipped=torch.gt(loss_ppo, loss_dual).logical_and_(negative).logical_and_(mask),
        region=region,
        num_sequences=torch.count_nonzero(mask.any(dim=-1)),
    )


def sat_gspo_surrogate(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    gate: SatParams,
    granularity: str = "sequence",
    carried: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> SatSurrogate:
    """GSPO-token surrogate with SAT endpoints (Eqs. 19-20), no dual clip. The ratio is built exactly as verl's
    ``gspo`` builds it, ``log rho = lp - sg(lp) + sg(s_i)`` clamped at 10, with ``s_i`` the mean of ``lp - lp_old``
    over the sequence's active tokens, and stays finite for +-inf log-probs (verl's is NaN for an ``lp`` of +-inf,
    and for a sequence whose ``s_i`` is inf - inf, which counts as 0 here). The gate's sequence proxy is ``s_i``
    clamped at +-20 (Eq. 13).

    ``granularity``: ``sequence`` scores every active token of sequence ``i`` with ``d_i = s_i`` and takes the
    quantile over active tokens, so a sequence weighs as many times as it has active tokens (Eq. 20);
    ``sequence_uniform`` counts each non-empty sequence once; ``token`` scores, gates and contracts per token, each
    gated token on the side its own ``d_t`` drifted to; ``token_ratio_side`` scores and gates per token and contracts
    the endpoint on the side ``s_i`` (the ratio's drift) lies, so a gated token's clip can act on the ratio, and a
    token of a sequence with ``s_i = 0`` is never gated; ``sequence_carried`` is ``sequence`` with the quantile over
    this micro-batch's sequences and the ``carried`` ones. A sequence's factors apply to all its tokens.

    Args:
        log_prob, old_log_prob, advantages: ``[B, T]``; response_mask: ``[B, T]`` bool or 0/1.
        carried: ``sequence_carried`` only: ``(|s|, lengths)`` of earlier sequences, ``[K]`` each (``CarriedScores``).
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown SAT granularity {granularity!r}; expected one of {list(GRANULARITIES)}")
    inputs = _clean_inputs(log_prob, old_log_prob, advantages, response_mask)
    mask, multiplier = inputs.mask, inputs.multiplier
    lengths = _row_counts(mask)
    # s_i, [B], as verl computes it (the diff is 0 at inactive tokens); inf - inf (NaN) counts as 0
    seq_log_ratio = (inputs.diff.detach().sum(dim=-1) / lengths.clamp(min=1)).nan_to_num_(0.0)

    token_proxy = _stat_proxy(inputs, log_prob, old_log_prob)
    if granularity in ("token", "token_ratio_side"):
        side = None if granularity == "token" else seq_log_ratio.sign().unsqueeze(-1)  # [B, 1], broadcast
        region = trust_region(token_proxy, mask, clip_low, clip_high, gate, log_prob.dtype,
                              num_units=inputs.num_active, side=side)  # fmt: skip
    else:
        proxy = seq_log_ratio
        if proxy.dtype != stat_dtype(proxy.dtype):  # half precision: s_i from upcast inputs
            upcast = torch.where(mask, log_prob.detach().float() - old_log_prob.float(), 0.0)
            proxy = (upcast.sum(dim=-1) / lengths.clamp(min=1)).nan_to_num_(0.0)
        proxy = _clamp_log_ratio(proxy)
        if granularity != "sequence_uniform":  # length-weighted (Eq. 20): the units it saw are the active tokens
            weight, num_units = lengths.unsqueeze(-1), inputs.num_active
        else:
            weight, num_units = None, None
        if granularity != "sequence_carried":
            carried = None
        elif carried is None:
            raise ValueError("granularity 'sequence_carried' needs the carried scores (CarriedScores.pooled())")
        region = trust_region(proxy.unsqueeze(-1), (lengths > 0).unsqueeze(-1), clip_low, clip_high, gate,
                              log_prob.dtype, weight=weight, num_units=num_units, carried=carried)  # fmt: skip

    # value s_i, gradient d lp, as verl's gspo; NaN and +-inf log-probs contribute neither (their tokens carry a zero
    # multiplier, and no inf - inf arises)
    gradient_path = log_prob.nan_to_num(0.0, 0.0, 0.0)
    log_rho = gradient_path - gradient_path.detach() + seq_log_ratio.unsqueeze(-1)
    rho = torch.exp(torch.clamp(log_rho, max=GSPO_LOG_RATIO_MAX))
    loss_unclipped = multiplier * rho
    loss_clipped = multiplier * torch.clamp(rho, region.lower, region.upper)
    loss_mat = torch.maximum(loss_unclipped, loss_clipped)

    # inactive tokens have a multiplier of +0 and a finite ratio: both losses are 0 there, never clipped
    clipped = torch.gt(loss_clipped, loss_unclipped)
    # the ratio's value is exp(min(s_i, 10)) at every token of sequence i (lp - sg(lp) is exactly 0): the band test
    # runs per sequence, at every granularity
    band_ratio = torch.exp(seq_log_ratio.clamp(max=GSPO_LOG_RATIO_MAX)).unsqueeze(-1)
    return SatSurrogate(
        loss_mat=loss_mat,
        mask=mask,
        num_active=inputs.num_active,
        num_nan=inputs.num_nan,
        log_ratio=inputs.diff.detach(),
        clipped=clipped,
        in_band=_in_band(band_ratio, clip_low, clip_high),
        dual_clipped=None,
        region=region,
        num_sequences=torch.count_nonzero(lengths),
    )


class CarriedScores:
    """The last ``size`` sequence scores ``|s_i|`` and lengths a process's ``sequence_carried`` gate saw, detached,
    for the next call's quantile (no extra forward: they are scores already computed). A ring of static size on the
    scores' device, updated with ``cat`` and a slice (no host read); slots never filled hold weight 0."""

    def __init__(self, size: int = CARRIED_SEQUENCES):
        self.size = size
        self._scores: torch.Tensor | None = None
        self._lengths: torch.Tensor | None = None

    def pooled(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``([size] |s|, [size] int64 lengths)`` on ``like``'s device, in its stat dtype; zeros before any call."""
        dtype = stat_dtype(like.dtype)
        if self._scores is None or self._scores.device != like.device:
            self._scores = torch.zeros(self.size, dtype=dtype, device=like.device)
            self._lengths = torch.zeros(self.size, dtype=torch.int64, device=like.device)
        return self._scores.to(dtype), self._lengths

    def add(self, region: TrustRegion) -> None:
        """Carry ``region``'s sequences (``[B, 1]`` ``|s|`` and lengths, 0 for empty sequences), newest last."""
        self._scores = torch.cat([self._scores, region.abs_proxy.reshape(-1).to(self._scores.dtype)])[-self.size :]
        self._lengths = torch.cat([self._lengths, region.weight.reshape(-1)])[-self.size :]

    def clear(self) -> None:
        self._scores = self._lengths = None


# granularity=sequence_carried: the sequence scores this process's sat_gspo calls saw last, for the next quantile
CARRIED = CarriedScores()
