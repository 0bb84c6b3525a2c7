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
"""Dataclass configs for the SAT policy losses.

``SatPolicyLossConfig`` extends verl's ``PolicyLossConfig`` with a nested ``sat`` block, so a recipe that sets
``actor_rollout_ref.actor.policy_loss._target_=verl_sat.config.SatPolicyLossConfig`` accepts command-line overrides
such as ``actor_rollout_ref.actor.policy_loss.sat.quantile=0.95``.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from verl.base_config import BaseConfig
from verl.workers.config import PolicyLossConfig

from verl_sat.sat_math import GRANULARITIES, KERNELS


@dataclass
class SatConfig(BaseConfig):
    """Hyperparameters of the Staleness-Adaptive Trust Region (SAT_SPEC.md sections 3-5).

    Args:
        quantile (float): Tail quantile alpha in (0, 1); tokens with |d| above Quantile_alpha(|d|) are gated.
        kernel (str): Contraction kernel, "hill" (kappa = q^n / (q^n + a^n)) or "hill_shifted"
            (kappa = 1 / (1 + ((a - q) / q)^n), continuous at q).
        kernel_exponent (float): Hill exponent n > 0.
        min_scale (float): Lower bound on the contraction factor kappa, in [0, 1].
        floor (float): Gate only when the quantile q exceeds this value (>= 0); avoids gating pure noise.
        granularity (str): "sequence" (proxy is the sequence log-ratio) or "token"; used by ``sat_gspo`` only.
    """

    quantile: float = 0.9
    kernel: str = "hill"
    kernel_exponent: float = 2.0
    min_scale: float = 0.0
    floor: float = 0.0
    granularity: str = "sequence"

    def __post_init__(self):
        _check(0.0 < self.quantile < 1.0, "quantile", self.quantile, "a float in the open interval (0, 1)")
        _check(self.kernel in KERNELS, "kernel", self.kernel, f"one of {list(KERNELS)}")
        _check(self.kernel_exponent > 0.0, "kernel_exponent", self.kernel_exponent, "a float > 0")
        _check(0.0 <= self.min_scale <= 1.0, "min_scale", self.min_scale, "a float in [0, 1]")
        _check(self.floor >= 0.0, "floor", self.floor, "a float >= 0")
        _check(self.granularity in GRANULARITIES, "granularity", self.granularity, f"one of {list(GRANULARITIES)}")


@dataclass
class SatPolicyLossConfig(PolicyLossConfig):
    """verl's ``PolicyLossConfig`` plus the ``sat`` block read by the ``sat`` and ``sat_gspo`` losses.

    Args:
        sat (SatConfig): SAT hyperparameters; a mapping (e.g. from ``hydra.utils.instantiate``) is converted.
    """

    sat: SatConfig = field(default_factory=SatConfig)

    def __post_init__(self):
        # BaseConfig fields are frozen after __init__; the conversion happens once, here.
        object.__setattr__(self, "sat", as_sat_config(self.sat))


def resolve_sat_config(policy_loss: Any) -> SatConfig:
    """Return the ``SatConfig`` carried by an actor's ``policy_loss`` (dataclass or DictConfig).

    A policy_loss without a ``sat`` block (verl's plain ``PolicyLossConfig``) yields the defaults.
    """
    sat = policy_loss.get("sat", None) if policy_loss is not None else None
    return SatConfig() if sat is None else as_sat_config(sat)


def as_sat_config(sat: Any) -> SatConfig:
    """Convert a mapping of SAT keys (dict, DictConfig) to ``SatConfig``; unknown keys raise with their names."""
    if isinstance(sat, SatConfig):
        return sat
    if not isinstance(sat, Mapping):
        raise TypeError(
            f"actor_rollout_ref.actor.policy_loss.sat must be a mapping of SAT keys, got {type(sat).__name__}"
        )
    values = {k: v for k, v in sat.items() if k != "_target_"}
    unknown = sorted(set(values) - set(SatConfig.__dataclass_fields__))
    if unknown:
        raise ValueError(
            f"actor_rollout_ref.actor.policy_loss.sat has unknown keys {unknown}; "
            f"valid keys are {sorted(k for k in SatConfig.__dataclass_fields__ if k != '_target_')}"
        )
    return SatConfig(**values)


def _check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(
            f"actor_rollout_ref.actor.policy_loss.sat.{key}={value!r} is invalid: expected {allowed}. "
            f"Fix the override or the recipe's sat block."
        )
