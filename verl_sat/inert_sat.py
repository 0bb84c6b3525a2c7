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
"""A warning, once per process, when SAT's gate is structurally empty in most micro-batches for several steps.

The SAT losses call ``InertSatMonitor.observe`` with values they already read back (no extra host read). The steps
are counted in sequences: verl hands the loss the mini-batch's sequences over all data-parallel ranks
(``global_batch_info["global_batch_size"]``, one optimizer step) and ``dp_size``; without them, a window is
``FALLBACK_WINDOW_CALLS`` micro-batches. No torch or verl import: host-side bookkeeping only.
"""

import logging
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
    warned: bool = False

    def observe(self, empty: float, sequences: float, global_batch_info: dict | None, quantile: float,
                key_format: str) -> None:  # fmt: skip
        """One micro-batch: ``empty`` 1.0 or 0.0, ``sequences`` its sequences, ``global_batch_info`` the loss's
        (verl's actor config), ``quantile`` SAT's alpha, ``key_format`` how to name a SAT key (``"...{}"``)."""
        if self.warned:
            return
        self.calls, self.empty, self.sequences = self.calls + 1, self.empty + empty, self.sequences + sequences
        info = global_batch_info or {}
        global_batch = info.get("global_batch_size")
        if global_batch:
            full = self.sequences >= WINDOW_STEPS * global_batch / max(info.get("dp_size") or 1, 1)
        else:
            full = self.calls >= FALLBACK_WINDOW_CALLS
        if not full:
            return
        if self.empty > INERT_FRACTION * self.calls:
            logger.warning(inert_message(self.empty, self.calls, self.sequences / self.calls, quantile, key_format))
            self.warned = True
        self.calls, self.empty, self.sequences = 0, 0.0, 0.0


def inert_message(empty: float, calls: int, sequences: float, quantile: float, key_format: str) -> str:
    """The warning: what was seen (``empty`` of the last ``calls`` micro-batches, ``sequences`` per micro-batch), why
    it cannot gate, and the keys that fix it."""
    return (
        f"SAT could not gate in {empty:.0f} of the last {calls} micro-batches ({sequences:.1f} sequences per "
        f"micro-batch): the highest-scoring unit held more than 1 - {key_format.format('quantile')} = "
        f"{1 - quantile:.3g} of the micro-batch's units, so none lay above the quantile and the loss ran as its base "
        f"loss (actor/sat_structurally_empty_frac). For loss_mode=sat_gspo set {key_format.format('granularity')}="
        f"token (per-token scores: they gate in any micro-batch of about 1 / (1 - quantile) tokens or more), or put "
        f"more sequences in a micro-batch: {ACTOR}.ppo_micro_batch_size_per_gpu, or {ACTOR}.ppo_max_token_len_per_gpu "
        f"under {ACTOR}.use_dynamic_bsz=true."
    )


INERT_MONITOR = InertSatMonitor()
