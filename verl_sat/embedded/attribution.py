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
"""Staleness attribution, which the paper could not log: the split ``d = Δπ + Δimpl`` (arXiv 2607.18722, Eq. 2).

For a token sampled by the rollout engine at weight version ℓ and trained at policy j: ``d = log π(j) - log μ``,
``Δπ = log π(j) - log π(ℓ)`` (policy lag) and ``Δimpl = log π(ℓ) - log μ`` (engine mismatch: bf16, incremental
decode, routing), with π(ℓ) the trainer's own fp32 weights of version ℓ. The embedded engine holds every version,
so one extra forward per batch gives π(ℓ).
"""

import torch

from verl_sat.config import SatConfig
from verl_sat.sat_math import sat_gspo_surrogate, sat_token_surrogate, tail_quantile

PREFIX = "staleness/"


def sat_gate(
    loss_mode: str,
    sat: SatConfig | None,
    log_prob,
    old_log_prob,
    advantages,
    mask,
    clip_low: float,
    clip_high: float,
    carried: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``[B, T]`` bool, the tokens SAT gates on these inputs: the run's own SAT loss, or for any other loss the
    token-level rule with the paper's defaults (what SAT would gate). ``carried``: the carried sequences the loss
    pooled (``granularity=sequence_carried``)."""
    with torch.no_grad():
        if loss_mode == "sat_gspo":
            out = sat_gspo_surrogate(log_prob, old_log_prob, advantages, mask, clip_low, clip_high, sat,
                                     sat.granularity, carried)  # fmt: skip
        else:
            gate = sat if loss_mode == "sat" and sat is not None else SatConfig()
            out = sat_token_surrogate(log_prob, old_log_prob, advantages, mask, clip_low, clip_high, 3.0, gate)
    return out.region.gated.expand(mask.shape) & out.mask


class StalenessSplit:
    """Accumulates ``Δπ`` and ``Δimpl`` over the active tokens of the micro-batches it is given."""

    def __init__(self):
        self._policy: list[torch.Tensor] = []
        self._engine: list[torch.Tensor] = []
        self._gated = 0
        self._policy_dominant = 0

    def add(self, log_prob, trainer_at_version, rollout_log_prob, mask, gated) -> tuple[torch.Tensor, torch.Tensor]:
        """Add one micro-batch (all ``[B, T]``; ``log_prob`` is π(j), detached); returns ``(Δπ, Δimpl)``."""
        policy = log_prob - trainer_at_version
        engine = trainer_at_version - rollout_log_prob
        self._policy.append(policy[mask])
        self._engine.append(engine[mask])
        self._gated += int(gated.sum())
        self._policy_dominant += int((gated & (policy.abs() > engine.abs())).sum())
        return policy, engine

    def metrics(self) -> dict[str, float]:
        """Mean |.| and p90 of |.| of each part (the paper's lower empirical quantile), and the fraction of SAT-gated
        tokens whose policy lag exceeds their engine mismatch (0 when nothing is gated)."""
        out = {}
        for name, parts in (("policy", self._policy), ("engine", self._engine)):
            values = torch.cat(parts).abs() if parts else torch.zeros(0)
            out[f"{PREFIX}{name}_abs_mean"] = float(values.mean()) if values.numel() else 0.0
            out[f"{PREFIX}{name}_p90"] = float(tail_quantile(values, torch.ones_like(values, dtype=torch.bool), 0.9))
        out[f"{PREFIX}gated_policy_dominant_frac"] = self._policy_dominant / self._gated if self._gated else 0.0
        return out
