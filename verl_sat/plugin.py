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
It registers the SAT losses and the recipes' OmegaConf resolvers. Nothing else in verl changes: routing replay under
the FSDP engine is installed only by a job that asks for it (``verl_sat.config.FSDPRouterReplayConfig``), the CPU
pieces (``verl_sat.cpu``) only in a process of a CPU run (``VERL_PLATFORM=cpu``), and the fixes of verl bugs
(``verl_sat.trainer_fixes``) only in a process of a run started by ``python -m verl_sat.main``, each when verl's
module it fixes is imported.
"""

import logging

logger = logging.getLogger(__name__)

try:
    import verl_sat.cpu
    import verl_sat.losses  # noqa: F401  (registers the "sat" and "sat_gspo" policy losses)
    from verl_sat import trainer_fixes
    from verl_sat.config import register_resolvers

    register_resolvers()
    if verl_sat.cpu.requested():  # a trainer.device=cpu run: VERL_PLATFORM=cpu in every process
        verl_sat.cpu.activate()
    if trainer_fixes.requested():  # a run started by python -m verl_sat.main
        trainer_fixes.install()  # an import hook: each fix acts when verl imports the module it fixes
except Exception:
    logger.warning("verl-sat plugin failed to load; the sat/sat_gspo losses are NOT registered", exc_info=True)
    raise
