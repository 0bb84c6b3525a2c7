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
"""verl plugin entry point (group ``verl.plugins``): importing this module registers everything verl-sat adds.

verl imports plugins inside ``import verl`` and logs their failures at DEBUG level only; this module logs
them at WARNING so a broken install is visible in every driver and Ray worker. ``verl-sat doctor`` checks it.
It registers the SAT losses, and adds routing replay to verl's FSDP engine when verl imports that engine.
"""

import importlib
import logging

logger = logging.getLogger(__name__)

FSDP_ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"


def _register_fsdp_routing_replay(_module) -> None:
    """Post-import hook of verl's FSDP engine module: add routing replay (R3) to its language-model engine."""
    try:
        # registers on import; if verl_sat.fsdp_engine is itself being imported (and pulled verl's engine in), this
        # returns the partly run module, which registers when its own import finishes
        importlib.import_module("verl_sat.fsdp_engine")
    except Exception:
        logger.warning("verl-sat: routing replay (R3) could NOT be added to verl's FSDP engine", exc_info=True)
        raise


try:
    import wrapt

    import verl_sat.config  # noqa: F401  (SatPolicyLossConfig, the target of policy_loss._target_)
    import verl_sat.losses  # noqa: F401  (registers the "sat" and "sat_gspo" policy losses)

    # verl imports its FSDP engine in the workers only; hooking its import keeps `import verl` unchanged
    wrapt.register_post_import_hook(_register_fsdp_routing_replay, FSDP_ENGINE_MODULE)
except Exception:
    logger.warning("verl-sat plugin failed to load; the sat/sat_gspo losses are NOT registered", exc_info=True)
    raise
