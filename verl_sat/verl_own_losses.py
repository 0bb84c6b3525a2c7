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
"""Never shadow verl: where verl registers ``sat`` / ``sat_gspo`` itself (a verl with the core pull request), those
stay in its registry and verl-sat says so once.

verl's ``register_policy_loss`` overwrites an entry without a word, so ``verl_sat.losses`` notes verl's own entries
before its decorators run and puts them back after. A loss is verl's own when the registered function comes from
verl's package (its ``__module__``), whatever verl names its helpers.
"""

import logging
from collections.abc import Callable

from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

logger = logging.getLogger(__name__)

SAT_LOSSES = ("sat", "sat_gspo")


def is_verls(function: Callable) -> bool:
    """``function`` is defined in verl's own package."""
    module = getattr(function, "__module__", None) or ""
    return module == "verl" or module.startswith("verl.")


def verl_own(names: tuple[str, ...] = SAT_LOSSES) -> dict[str, Callable]:
    """The losses among ``names`` that verl's registry holds from verl's own package."""
    return {name: POLICY_LOSS_REGISTRY[name] for name in names if is_verls(POLICY_LOSS_REGISTRY.get(name))}


def keep_verl_own(own: dict[str, Callable]) -> None:
    """Put verl's own losses back over what was registered since ``verl_own`` read them, and say so (once: this runs
    when ``verl_sat.losses`` is imported)."""
    if not own:
        return
    POLICY_LOSS_REGISTRY.update(own)
    where = ", ".join(f"{name}: {fn.__module__}.{fn.__qualname__}" for name, fn in own.items())
    logger.warning(
        "verl registers its own SAT policy losses (%s): verl-sat uses verl's, not its own copy. The recipes' "
        "actor_rollout_ref.actor.policy_loss.sat.<name> keys are passed on to verl's flat sat_<name> keys.",
        where,
    )
