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
"""Dataclass configs verl-sat adds to verl's config tree, and the recipes' OmegaConf resolvers.

``SatPolicyLossConfig`` extends verl's ``PolicyLossConfig`` with a nested ``sat`` block, so a recipe that sets
``actor_rollout_ref.actor.policy_loss._target_=verl_sat.config.SatPolicyLossConfig`` accepts command-line overrides
such as ``actor_rollout_ref.actor.policy_loss.sat.quantile=0.95``. ``FSDPRouterReplayConfig`` is verl's router-replay
config for the FSDP engine, where verl-sat provides R3.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omegaconf import OmegaConf
from verl.base_config import BaseConfig
from verl.workers.config import EngineRouterReplayConfig, PolicyLossConfig

from verl_sat.sat_math import GRANULARITIES, KERNELS, QUANTILE_METHODS

DEFAULT_GRANULARITY = "sequence"
TOKEN_LEVEL_LOSSES = ("sat",)  # losses whose proxy is always per token (no `granularity` key)


@dataclass
class SatConfig(BaseConfig):
    """Hyperparameters of the Staleness-Adaptive Trust Region (arXiv 2607.18722, Eqs. 14-20).

    Args:
        quantile (float): Tail quantile alpha in (0, 1); units with |d| above the alpha-quantile q of the
            micro-batch are gated (Eq. 14).
        quantile_method (str): "inverted_cdf" (the paper's lower empirical quantile: the ceil(alpha * n)-th smallest,
            no interpolation) or "linear" (torch.quantile's interpolation, the earlier behaviour).
        kernel (str): Contraction kernel (Eq. 16), "hill" (kappa = q^n / (q^n + a^n)) or "hill_shifted"
            (kappa = 1 / (1 + ((a - q) / q)^n), continuous at q).
        kernel_exponent (float): Hill exponent n > 0.
        min_scale (float): Lower bound on the contraction factor kappa, in [0, 1].
        floor (float): Gate only when the quantile q exceeds this value (>= 0); avoids gating pure noise.
        granularity (str): SAT score unit of ``sat_gspo``: "sequence" (s_i broadcast to the sequence's active tokens,
            quantile over tokens: length-weighted, Eq. 20), "sequence_uniform" (quantile over sequences, each once)
            or "token". ``sat`` is always per token and refuses any other value than the default.
    """

    quantile: float = 0.9
    quantile_method: str = "inverted_cdf"
    kernel: str = "hill"
    kernel_exponent: float = 2.0
    min_scale: float = 0.0
    floor: float = 0.0
    granularity: str = DEFAULT_GRANULARITY

    def __post_init__(self):
        _check(0.0 < self.quantile < 1.0, "quantile", self.quantile, "a float in the open interval (0, 1)")
        _check(self.quantile_method in QUANTILE_METHODS, "quantile_method", self.quantile_method,
               f"one of {list(QUANTILE_METHODS)}")  # fmt: skip
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
        check_granularity(self.loss_mode, self.sat)


def check_granularity(loss_mode: str, sat: SatConfig) -> None:
    """``granularity`` is a ``sat_gspo`` key: the token-level ``sat`` loss refuses a non-default value."""
    if loss_mode in TOKEN_LEVEL_LOSSES and sat.granularity != DEFAULT_GRANULARITY:
        raise ValueError(
            f"actor_rollout_ref.actor.policy_loss.sat.granularity={sat.granularity!r} has no effect with "
            f"loss_mode={loss_mode!r} (the token-level rule scores every token): remove the key, or use "
            "loss_mode=sat_gspo"
        )


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


@dataclass
class FSDPRouterReplayConfig(EngineRouterReplayConfig):
    """verl's ``EngineRouterReplayConfig`` for the FSDP engine (``actor_rollout_ref.actor.fsdp_config.router_replay``,
    set by the ``r3=fsdp`` recipe piece). verl 0.9.1's FSDP engine has no routing replay; building this config with
    ``mode=R3`` installs verl-sat's (``verl_sat.fsdp_engine``) in verl's engine registry of this process, so a job
    that does not ask for R3 runs verl's engine unchanged. Anything that cannot replay fails here, in the worker that
    builds the engine, naming the key: a mode other than R3, or an FSDP engine that is not verl's. A worker without
    verl-sat fails to import this class.
    """

    def __post_init__(self):
        super().__post_init__()
        if self.mode == "disabled":
            return
        if self.mode != "R3":
            raise ValueError(
                f"actor_rollout_ref.actor.fsdp_config.router_replay.mode={self.mode!r}: verl-sat's routing replay "
                "under the FSDP engine replays the rollout engine's routes (R3) only; set mode=R3 or disabled"
            )
        from verl_sat.fsdp_engine import register_engine

        register_engine()


def divide_evenly(total: int, parts: int) -> int:
    """``${verl_sat.div:a,b}``: ``a / b`` as an int, for a mini-batch that must follow ``data.train_batch_size``."""
    if parts <= 0 or total % parts:
        raise ValueError(
            f"data.train_batch_size={total} must be a positive multiple of the lag n={parts}: the +lag preset trains "
            f"each batch as n mini-batches of train_batch_size / n prompts (trainer.v1.separate_async."
            f"parameter_sync_step={parts}); choose data.train_batch_size = {parts} x prompts per optimizer step"
        )
    return total // parts


def batch_for_lag(prompts_per_optimizer_step: int, trainer_mode: str, parameter_sync_step: int) -> int:
    """``${verl_sat.lag_batch:p,mode,n}``: the prompts of a trainer step that trains ``p`` prompts per optimizer
    step: ``p * n`` under verl's separate-async mode (n optimizer steps per broadcast), ``p`` otherwise."""
    return prompts_per_optimizer_step * (parameter_sync_step if trainer_mode == "separate_async" else 1)


def steps_for_lag(optimizer_steps: int, trainer_mode: str, parameter_sync_step: int) -> int:
    """``${verl_sat.lag_steps:k,mode,n}``: the trainer steps that hold ``k`` optimizer steps: ``ceil(k / n)`` under
    verl's separate-async mode (n optimizer steps per trainer step), ``k`` otherwise."""
    per_step = parameter_sync_step if trainer_mode == "separate_async" else 1
    return max(1, -(-optimizer_steps // per_step))


RESOLVERS = {"verl_sat.div": divide_evenly, "verl_sat.lag_batch": batch_for_lag, "verl_sat.lag_steps": steps_for_lag}


def register_resolvers() -> None:
    """Register the recipes' OmegaConf resolvers (the plugin does, in every verl process)."""
    for name, resolver in RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver)
