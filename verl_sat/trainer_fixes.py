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

Each fix acts on one verl module when that module is imported, not before: ``install`` (called by verl-sat's plugin
inside ``import verl``) puts an import hook on ``sys.meta_path`` that answers only for the modules named in ``FIXES``
and runs the fix right after the module's own code; a module already imported is fixed at once. So a process that
never imports verl's trainer (a vLLM worker, say) never loads it on verl-sat's account.

1. verl's separate-async trainer (``verl.trainer.ppo.v1.trainer_separate_async``) logs ``logger.info(..., flush=True)``
   when ``actor_rollout_ref.hybrid_engine=False`` (rollout only on its standalone replicas), and Python's ``logging``
   refuses the keyword: the trainer's set-up raises ``TypeError``. The module's logger drops the keyword.

Not fixed here: the same keyword in SGLang's ``launch_server_process``
(``verl/workers/rollout/sglang_rollout/http_server_engine.py``), which verl 0.9.1 never calls (its SGLang rollout
builds the HTTP adapter with ``launch_server=False``); the test pins that, and the series' ``[rollout] fix:`` patch
fixes it upstream.
"""

import importlib.abc
import logging
import os
import sys
from collections.abc import Callable
from types import ModuleType

FIXES_ENV = "VERL_SAT_TRAINER_FIXES"
SEPARATE_ASYNC = "verl.trainer.ppo.v1.trainer_separate_async"


def requested() -> bool:
    """Whether this process belongs to a run started by ``python -m verl_sat.main``."""
    return os.environ.get(FIXES_ENV, "") == "1"


class FlushTolerantLogger(logging.LoggerAdapter):
    """A logger that accepts (and drops) ``print``'s ``flush`` keyword."""

    def process(self, msg, kwargs):
        kwargs.pop("flush", None)
        return msg, kwargs


def flush_tolerant_logger(module: ModuleType) -> None:
    """Wrap ``module.logger`` in a ``FlushTolerantLogger`` (idempotent)."""
    if not isinstance(module.logger, FlushTolerantLogger):
        module.logger = FlushTolerantLogger(module.logger, {})


# module name -> its fix, run on the module right after its code: the only names the import hook answers for
FIXES: dict[str, Callable[[ModuleType], None]] = {SEPARATE_ASYNC: flush_tolerant_logger}


class _FixAfterExec(importlib.abc.Loader):
    """The module's own loader, which then runs the fix on the module; once done it puts the own loader back on the
    module and its spec."""

    def __init__(self, loader: importlib.abc.Loader, fix: Callable[[ModuleType], None]):
        self.loader = loader
        self.fix = fix

    def __getattr__(self, name):  # get_source, get_filename, is_package, ... while the module executes
        if name == "loader":  # not set yet: no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        try:
            self.loader.exec_module(module)
        finally:
            module.__loader__ = self.loader
            if module.__spec__ is not None:
                module.__spec__.loader = self.loader
        self.fix(module)


class FixOnImport(importlib.abc.MetaPathFinder):
    """The import hook: for a module named in ``FIXES`` it asks the finders after it for the spec and wraps the
    spec's loader in ``_FixAfterExec``; for every other name it answers None (the next finder decides)."""

    def find_spec(self, fullname, path, target=None):
        fix = FIXES.get(fullname)
        if fix is None:
            return None
        for finder in sys.meta_path:
            if finder is self or isinstance(finder, FixOnImport) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _FixAfterExec(spec.loader, fix)
        return spec


def install() -> None:
    """Fix the modules of ``FIXES`` already imported, and put the import hook first on ``sys.meta_path`` for the
    others (idempotent: one hook per process)."""
    for name, fix in FIXES.items():
        module = sys.modules.get(name)
        if module is not None:
            fix(module)
    if not any(isinstance(finder, FixOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, FixOnImport())
