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
from dataclasses import dataclass, field, fields
from typing import Any

from omegaconf import OmegaConf
from verl.base_config import BaseConfig
from verl.workers.config import EngineRouterReplayConfig, PolicyLossConfig

from verl_sat.sat_math import SatParams, check_sat_params

SAT_KEY_FORMAT = "actor_rollout_ref.actor.policy_loss.sat.{}"  # how errors name a SAT key
VERL_FLAT_KEY = "sat_{}"  # the PolicyLossConfig field of a SAT key in a verl that ships SAT (the core pull request)


@dataclass
class SatConfig(BaseConfig, SatParams):
    """The SAT hyperparameters (``verl_sat.sat_math.SatParams``: keys, defaults and their meaning) as verl's config
    block ``actor_rollout_ref.actor.policy_loss.sat``; a bad value fails when the block is built, naming the key."""

    def __post_init__(self):
        check_sat_params(self, SAT_KEY_FORMAT)


@dataclass
class SatPolicyLossConfig(PolicyLossConfig):
    """verl's ``PolicyLossConfig`` plus the ``sat`` block read by the ``sat`` and ``sat_gspo`` losses. Every recipe
    sets it, whatever the loss: building it also makes this process's actor log the paper's mismatch
    ``actor/mismatch_abs_log_ratio`` (Eq. 52) for any ``loss_mode`` (``verl_sat.mismatch.install``).

    Args:
        sat (SatConfig): SAT hyperparameters; a mapping (e.g. from ``hydra.utils.instantiate``) is converted.
    """

    sat: SatConfig = field(default_factory=SatConfig)

    def __post_init__(self):
        # BaseConfig fields are frozen after __init__; the conversion happens once, here.
        object.__setattr__(self, "sat", as_sat_config(self.sat))
        check_sat_params(self.sat, SAT_KEY_FORMAT, self.loss_mode)
        # a verl that ships SAT reads flat sat_<name> keys of its PolicyLossConfig (verl_sat.verl_own_losses): the
        # nested block sets them, so the recipes' keys act on verl's losses
        for f in fields(SatParams):
            if VERL_FLAT_KEY.format(f.name) in self.__dataclass_fields__:
                object.__setattr__(self, VERL_FLAT_KEY.format(f.name), getattr(self.sat, f.name))
        from verl_sat.mismatch import install

        install(self.loss_mode)


def sat_params_of(policy_loss: Any, loss_mode: str | None = None) -> SatConfig:
    """The ``SatConfig`` carried by an actor's ``policy_loss`` (dataclass or DictConfig), validated for
    ``loss_mode`` (the token-level ``sat`` refuses a non-default granularity).

    A policy_loss without a ``sat`` block (verl's plain ``PolicyLossConfig``) yields the defaults.
    """
    sat = policy_loss.get("sat", None) if policy_loss is not None else None
    params = SatConfig() if sat is None else as_sat_config(sat)
    check_sat_params(params, SAT_KEY_FORMAT, loss_mode)
    return params


def as_sat_config(sat: Any) -> SatConfig:
    """Convert a mapping of SAT keys (dict, DictConfig) to ``SatConfig``; unknown keys raise with their names."""
    if isinstance(sat, SatConfig):
        return sat
    if not isinstance(sat, Mapping):
        raise TypeError(
            f"actor_rollout_ref.actor.policy_loss.sat must be a mapping of SAT keys, got {type(sat).__name__}"
        )
    values = {k: v for k, v in sat.items() if k != "_target_"}
    valid = sorted(f.name for f in fields(SatParams))
    unknown = sorted(set(values) - set(valid))
    if unknown:
        raise ValueError(f"actor_rollout_ref.actor.policy_loss.sat has unknown keys {unknown}; valid keys are {valid}")
    return SatConfig(**values)


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
