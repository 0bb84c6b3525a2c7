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
"""Fixes of verl 0.9.1 bugs that stop a run on any platform, GPU clusters included. They apply in the processes of a
run that ``python -m verl_sat.main`` starts (it sets ``VERL_SAT_TRAINER_FIXES=1`` there and passes it to every Ray
worker), and nowhere else; each is pinned by a test on the verl code it works around
(``tests/test_trainer_fixes_on_cpu.py``) and goes upstream as its own ``[trainer] fix:`` patch (``verl-sat upstream``).

1. verl's separate-async trainer logs ``logger.info(..., flush=True)`` when ``actor_rollout_ref.hybrid_engine=False``
   (rollout only on its standalone replicas), and Python's ``logging`` refuses the keyword: the trainer's set-up raises
   ``TypeError``. The module's logger drops the keyword.
"""

import logging
import os

FIXES_ENV = "VERL_SAT_TRAINER_FIXES"


def requested() -> bool:
    """Whether this process belongs to a run started by ``python -m verl_sat.main``."""
    return os.environ.get(FIXES_ENV, "") == "1"


class FlushTolerantLogger(logging.LoggerAdapter):
    """A logger that accepts (and drops) ``print``'s ``flush`` keyword."""

    def process(self, msg, kwargs):
        kwargs.pop("flush", None)
        return msg, kwargs


def apply() -> None:
    """Apply the fixes (idempotent)."""
    from verl.trainer.ppo.v1 import trainer_separate_async

    if not isinstance(trainer_separate_async.logger, FlushTolerantLogger):
        trainer_separate_async.logger = FlushTolerantLogger(trainer_separate_async.logger, {})
