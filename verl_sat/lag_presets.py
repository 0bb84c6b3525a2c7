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
"""``+lag=lagN`` and ``+lag=fixedN`` for any N >= 1, on every trainer, in that trainer's own keys.

The recipe group ships ``lag1``, ``lag8`` and ``fixed8`` for each trainer (``recipes/lag/*.yaml`` for separate_async,
``recipes/lag/colocate_async/``, ``recipes/lag/fully_async/``), each key commented. Any other N is the same trainer's
``lag8`` / ``fixed8`` file with the keys of ``lag_keys`` set for N, stored in Hydra's ConfigStore under the same group
and name before the config is composed (``register``, called by ``verl_sat.main.compose_from_args``, which both
``python -m verl_sat.main`` and ``verl-sat train`` compose through). The shipped files are instances of the same rule:
``lag_keys`` at N = 1 and 8 reproduces them (tested).
"""

import re
from importlib.resources import files

from omegaconf import DictConfig, OmegaConf

# a lag group option: [TRAINER/](lag|fixed)N, N >= 1
LAG_OPTION = re.compile(r"^(?:(?P<folder>colocate_async|fully_async)/)?(?P<kind>lag|fixed)(?P<n>[1-9][0-9]*)$")
TEMPLATE_N = 8  # the shipped file each generated preset starts from: TRAINER/lag8.yaml or TRAINER/fixed8.yaml


def lag_keys(trainer: str, kind: str, n: int) -> dict[str, object]:
    """The keys a ``kind`` preset (``lag``: the paper's lag, n optimizer steps per broadcast with rollout one batch
    ahead; ``fixed``: a constant gap of n) sets differently for each n, on ``trainer``; dotted key -> value."""
    if trainer == "separate_async":
        if kind == "lag":  # n mini-batch optimizer steps per broadcast (the mini-batch follows parameter_sync_step)
            return {"trainer.v1.separate_async.parameter_sync_step": n}
        return {"trainer.v1.separate_async.num_warmup_batches": n, "trainer.v1.sampler.max_off_policy_threshold": n + 1}
    if trainer == "colocate_async":
        if kind == "lag":  # n mini-batches per trainer step, one broadcast per trainer step
            return {"actor_rollout_ref.actor.ppo_mini_batch_size": f"${{verl_sat.div:${{data.train_batch_size}},{n}}}"}
        return {"trainer.v1.colocate_async.num_warmup_batches": n}
    if trainer == "fully_async":
        if kind == "lag":
            return {"async_training.trigger_parameter_sync_step": n}
        return {"async_training.staleness_threshold": n}
    raise ValueError(f"no lag presets for the {trainer} trainer")


def generate(folder: str | None, kind: str, n: int) -> DictConfig:
    """The ``kind`` preset for ``n`` on the trainer whose presets live in ``recipes/lag/<folder>`` (``None``:
    separate_async): the shipped template with ``lag_keys`` applied."""
    template = files("verl_sat.recipes").joinpath("lag", *([folder] if folder else []), f"{kind}{TEMPLATE_N}.yaml")
    node = OmegaConf.create(template.read_text())
    for key, value in lag_keys(folder or "separate_async", kind, n).items():
        OmegaConf.update(node, key, value, merge=False)
    return node


def register(overrides: list[str]) -> None:
    """Store a generated preset in Hydra's ConfigStore for each ``lag`` override naming ``lagN`` / ``fixedN`` (bare or
    ``TRAINER/``) that no shipped file provides, for all three trainers (``verl_sat.main`` rewrites ``+lag=NAME`` to
    the selected trainer's folder after a first composition). Anything else is left to Hydra, which names it."""
    from hydra.core.config_store import ConfigStore

    for override in overrides:
        key, _, value = override.partition("=")
        match = LAG_OPTION.match(value.strip()) if key.lstrip("+~") == "lag" else None
        if match is None:
            continue
        kind, n = match["kind"], int(match["n"])
        for folder in (None, "colocate_async", "fully_async"):
            group = "lag" if folder is None else f"lag/{folder}"
            shipped = files("verl_sat.recipes").joinpath(*group.split("/"), f"{kind}{n}.yaml")
            if not shipped.is_file():
                ConfigStore.instance().store(group=group, name=f"{kind}{n}", node=generate(folder, kind, n),
                                             package="_global_")  # fmt: skip
