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
"""Warnings, once per process each, when SAT cannot act in most micro-batches for several steps: its gate is
structurally empty (nothing lies above the quantile), or it gates but its tail quantile lies beyond the clip radius
(the nominal interval already clips every gated unit, so nothing is intercepted).

The SAT losses call ``InertSatMonitor.observe`` with values they already read back (no extra host read). The steps
are counted in sequences: verl hands the loss the mini-batch's sequences over all data-parallel ranks
(``global_batch_info["global_batch_size"]``, one optimizer step) and ``dp_size``; without them, a window is
``FALLBACK_WINDOW_CALLS`` micro-batches. No torch or verl import: host-side bookkeeping only.
"""

import logging
import math
from dataclasses import dataclass

logger = logging.getLogger(__name__)

WINDOW_STEPS = 3  # optimizer steps of one window
INERT_FRACTION = 0.5  # warn when more than this fraction of a window's micro-batches was structurally empty
FALLBACK_WINDOW_CALLS = 32  # micro-batches of a window when the loss is not told the mini-batch size
ACTOR = "actor_rollout_ref.actor"


@dataclass
class InertSatMonitor:
    """Counts, over tumbling windows of ``WINDOW_STEPS`` optimizer steps, the micro-batches whose gate was
    structurally empty (``sat_math.structurally_empty``), and warns once when they are most of a window."""

    calls: int = 0
    empty: float = 0.0
    sequences: float = 0.0
    beyond_radius: float = 0.0
    q_over_radius: float = 0.0  # summed over the window's beyond-radius micro-batches
    warned: bool = False
    warned_radius: bool = False

    def observe(self, empty: float, sequences: float, global_batch_info: dict | None, quantile: float,
                key_format: str, beyond_radius: float = 0.0, q_over_radius: float = 0.0,
                radii: tuple[float, float] = (0.0, 0.0)) -> None:  # fmt: skip
        """One micro-batch: ``empty`` 1.0 or 0.0, ``sequences`` its sequences, ``global_batch_info`` the loss's
        (verl's actor config), ``quantile`` SAT's alpha, ``key_format`` how to name a SAT key (``"...{}"``);
        ``beyond_radius`` 1.0 or 0.0 and ``q_over_radius`` from ``radius_check``, ``radii`` the clip radii
        ``(clip_ratio_low, clip_ratio_high)``."""
        if self.warned and self.warned_radius:
            return
        self.calls, self.empty, self.sequences = self.calls + 1, self.empty + empty, self.sequences + sequences
        self.beyond_radius += beyond_radius
        self.q_over_radius += q_over_radius * beyond_radius
        info = global_batch_info or {}
        global_batch = info.get("global_batch_size")
        if global_batch:
            full = self.sequences >= WINDOW_STEPS * global_batch / max(info.get("dp_size") or 1, 1)
        else:
            full = self.calls >= FALLBACK_WINDOW_CALLS
        if not full:
            return
        if self.empty > INERT_FRACTION * self.calls and not self.warned:
            logger.warning(inert_message(self.empty, self.calls, self.sequences / self.calls, quantile, key_format))
            self.warned = True
        if self.beyond_radius > INERT_FRACTION * self.calls and not self.warned_radius:
            q_over_radius = self.q_over_radius / self.beyond_radius
            logger.warning(radius_message(self.beyond_radius, self.calls, q_over_radius, *radii))
            self.warned_radius = True
        self.calls, self.empty, self.sequences, self.beyond_radius, self.q_over_radius = 0, 0.0, 0.0, 0.0, 0.0


def radius_check(q: float, gated: float, intercepted: float, clip_low: float, clip_high: float) -> tuple[float, float]:
    """``(q_over_radius, beyond_radius)`` of one micro-batch. The radius is the nearer end of the nominal interval in
    the log-ratio space of ``q``: ``min(log(1 + clip_high), -log(1 - clip_low))``. ``beyond_radius`` is 1.0 when SAT
    gated (``gated`` units) but intercepted nothing (``intercepted`` tokens) and ``q`` lies beyond both ends: every
    gated unit's ratio is then already outside the nominal interval, which clips it, so SAT cannot act."""
    upper = math.log1p(clip_high)
    lower = -math.log1p(-clip_low) if clip_low < 1 else math.inf
    radius = min(upper, lower)
    q_over_radius = q / radius if radius > 0 else math.inf
    beyond = gated > 0 and intercepted == 0 and q >= max(upper, lower)
    return q_over_radius, float(beyond)


def inert_message(empty: float, calls: int, sequences: float, quantile: float, key_format: str) -> str:
    """The warning: what was seen (``empty`` of the last ``calls`` micro-batches, ``sequences`` per micro-batch), why
    it cannot act, and the keys that fix it."""
    return (
        f"SAT could not act in {empty:.0f} of the last {calls} micro-batches ({sequences:.1f} sequences per "
        f"micro-batch): its gate was structurally empty, since the highest-scoring unit held more than "
        f"1 - {key_format.format('quantile')} = {1 - quantile:.3g} of the micro-batch's units, so none lay above the "
        f"quantile and the loss ran as its base loss (actor/sat_structurally_empty_frac). For loss_mode=sat_gspo set "
        f"{key_format.format('granularity')}=sequence_carried (the quantile over this micro-batch's and the last 256 "
        f"sequences' scores: it acts at one sequence per micro-batch; whether SAT then acts shows in "
        f"actor/sat_intercepted_frac), or put more sequences in a micro-batch: {ACTOR}.ppo_micro_batch_size_per_gpu, "
        f"or {ACTOR}.ppo_max_token_len_per_gpu under {ACTOR}.use_dynamic_bsz=true."
    )


def radius_message(beyond: float, calls: int, q_over_radius: float, clip_low: float, clip_high: float) -> str:
    """The warning when SAT gates but its quantile lies beyond the clip radius: what was seen, why SAT cannot act,
    the keys and what the paper uses."""
    return (
        f"SAT gated but could not act in {beyond:.0f} of the last {calls} micro-batches: its tail quantile q was "
        f"{q_over_radius:.3g} times the clip radius ({ACTOR}.clip_ratio_low={clip_low:g}, {ACTOR}.clip_ratio_high="
        f"{clip_high:g}), beyond both ends of the nominal interval, which therefore already clips every gated unit: "
        f"nothing was intercepted (actor/sat_intercepted_frac 0, actor/sat_beyond_radius 1) and the loss ran as its "
        f"base loss. SAT acts only where q lies inside the radius: the paper runs GRPO, GSPO and DPPO at "
        f"clip_ratio_low = clip_ratio_high = 0.2 with a mean mismatch of about 0.01. Widen {ACTOR}.clip_ratio_low and "
        f"{ACTOR}.clip_ratio_high (the paper's 0.2), or run the base loss."
    )


INERT_MONITOR = InertSatMonitor()
