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
"""``verl_sat.trainer_fixes``: the verl code each fix works around, pinned (the test fails when verl 0.9.1's code
changes), the fix's effect, and where and when it applies: in every process of a run started by
``python -m verl_sat.main`` (GPU runs too), in no other verl job, and only once verl's module it fixes is imported
(``import verl`` alone loads no trainer)."""

import ast
import importlib.util
import inspect
import logging
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf
from verl.trainer.ppo.v1 import trainer_separate_async

from verl_sat import trainer_fixes
from verl_sat.main import worker_env_overrides
from verl_sat.upstream.rollout_fix_patch import FLUSH_CALL as SGLANG_FLUSH_CALL
from verl_sat.upstream.trainer_fix_patch import FLUSH_CALL_END

# imports sglang at its top, which is not installed here: read as text, never imported
SGLANG_HTTP_ENGINE = "verl.workers.rollout.sglang_rollout.http_server_engine"

APPLIED_PROBE = (
    "import sys, verl\n"
    "from verl_sat.trainer_fixes import SEPARATE_ASYNC, FixOnImport, FlushTolerantLogger\n"
    "print('imported by import verl:', SEPARATE_ASYNC in sys.modules)\n"
    "print('hooks:', sum(isinstance(finder, FixOnImport) for finder in sys.meta_path))\n"
    "from verl.trainer.ppo.v1 import trainer_separate_async as m\n"
    "print('loader:', type(m.__loader__).__name__, type(m.__spec__.loader).__name__)\n"
    "m.logger.info('probe', flush=True)\n"
    "print('patched:', isinstance(m.logger, FlushTolerantLogger))\n"
)
# verl imported in a process that is not a verl_sat.main run (no hook), the trainer too; then install, twice
ALREADY_IMPORTED_PROBE = (
    "import logging, sys, verl\n"
    "from verl.trainer.ppo.v1 import trainer_separate_async as m\n"
    "from verl_sat import trainer_fixes\n"
    "trainer_fixes.install()\n"
    "trainer_fixes.install()\n"
    "m.logger.info('probe', flush=True)\n"
    "print(isinstance(m.logger, trainer_fixes.FlushTolerantLogger), isinstance(m.logger.logger, logging.Logger),\n"
    "      sum(isinstance(finder, trainer_fixes.FixOnImport) for finder in sys.meta_path))\n"
)


def _env(fixes: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (trainer_fixes.FIXES_ENV, "VERL_LOGGING_LEVEL")}
    if fixes:
        env[trainer_fixes.FIXES_ENV] = "1"
    return env


def test_pinned_flush_keyword_to_logging_at_info_level():
    source = inspect.getsource(trainer_separate_async.PPOTrainerSeparateAsync._setup)
    assert FLUSH_CALL_END in source and "if self._enable_hybrid_replicas:" in source
    assert 'logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))' in inspect.getsource(trainer_separate_async)
    logger = logging.getLogger("verl_sat.test_flush")
    logger.setLevel(logging.INFO)  # a record is only built (and the keyword refused) when the level is enabled
    with pytest.raises(TypeError, match="flush"):
        logger.info("x", flush=True)
    trainer_fixes.FlushTolerantLogger(logger, {}).info("x", flush=True)


def test_fix_applies_only_in_a_verl_sat_main_process_when_the_trainer_is_imported():
    """With and without the fixes (the two probes run at the same time)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = list(pool.map(lambda fixes: subprocess.run([sys.executable, "-c", APPLIED_PROBE], env=_env(fixes),
                                                          capture_output=True, text=True), (True, False)))  # fmt: skip
    for fixes, run in zip((True, False), runs, strict=True):
        lines = run.stdout.splitlines()
        assert lines[0] == "imported by import verl: False", run.stderr[-2000:]  # the plugin loads no trainer
        assert lines[1] == f"hooks: {int(fixes)}"
        if fixes:
            assert run.returncode == 0, run.stderr[-2000:]
            assert lines[2] == "loader: SourceFileLoader SourceFileLoader"  # the hook keeps verl's own loader
            assert lines[3] == "patched: True"
        else:  # verl as it ships: the call raises
            assert run.returncode == 1 and "TypeError" in run.stderr and "flush" in run.stderr


def test_install_fixes_a_module_already_imported_once():
    run = subprocess.run([sys.executable, "-c", ALREADY_IMPORTED_PROBE], env=_env(False), capture_output=True,
                         text=True)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["True", "True", "1"]


def test_the_hook_answers_only_for_the_fixed_modules():
    assert set(trainer_fixes.FIXES) == {trainer_fixes.SEPARATE_ASYNC}
    assert trainer_fixes.SEPARATE_ASYNC == trainer_separate_async.__name__
    hook = trainer_fixes.FixOnImport()
    for name in ("verl.trainer.ppo.v1", "verl.trainer.ppo.core_algos", "verl.trainer.ppo.v1.trainer_colocate_async"):
        assert hook.find_spec(name, None) is None
    spec = hook.find_spec(trainer_fixes.SEPARATE_ASYNC, sys.modules["verl.trainer.ppo.v1"].__path__)
    assert spec is not None and spec.origin == trainer_separate_async.__file__
    assert isinstance(spec.loader, trainer_fixes._FixAfterExec)
    assert spec.loader.get_filename(trainer_fixes.SEPARATE_ASYNC) == trainer_separate_async.__file__


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_every_ray_worker_of_a_verl_sat_main_run_gets_the_fixes(device):
    config = OmegaConf.create({"trainer": {"device": device}, "ray_kwargs": {"ray_init": {"runtime_env": {}}}})
    overrides = worker_env_overrides(config)
    assert f"+ray_kwargs.ray_init.runtime_env.env_vars.{trainer_fixes.FIXES_ENV}='1'" in overrides
    assert ("+ray_kwargs.ray_init.runtime_env.env_vars.VERL_PLATFORM='cpu'" in overrides) == (device == "cpu")
    # Ray takes only strings as environment values: the overrides compose to strings
    parser = OverridesParser.create()
    assert all(isinstance(parser.parse_override(override).value(), str) for override in overrides)


def test_pinned_sglang_launch_server_process_passes_flush_to_logging():
    """The same bug in SGLang's HTTP engine (fixed upstream by the series' ``[rollout] fix:`` patch), pinned on the
    file's text: ``launch_server_process`` on a rank that does not start the server logs with ``flush=True``."""
    source = Path(importlib.util.find_spec(SGLANG_HTTP_ENGINE).origin).read_text()
    assert source.count(SGLANG_FLUSH_CALL) == 1
    (function,) = [n for n in ast.parse(source).body if getattr(n, "name", None) == "launch_server_process"]
    assert SGLANG_FLUSH_CALL in ast.get_source_segment(source, function)
    assert "if server_args.node_rank != 0 or not first_rank_in_node:" in ast.get_source_segment(source, function)
    # at verl's default level for the module (WARN) the record is never built, so the keyword is not refused
    assert 'logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "WARN"))' in source


def test_verl_never_reaches_sglangs_launch_server_process():
    """Why ``verl_sat.trainer_fixes`` has no run-time fix for it: in verl 0.9.1 only ``HttpServerAdapter.__init__``
    calls ``launch_server_process`` (when built with ``launch_server=True``), and verl's one construction of an adapter,
    the SGLang rollout's ``ServerAdapter``, passes ``launch_server=False``. Fails when verl starts calling it."""
    root = Path(importlib.util.find_spec("verl").origin).parent
    names = {"HttpServerAdapter", "AsyncHttpServerAdapter", "launch_server_process"}
    calls = set()
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        if not any(name in text for name in names):
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name in names:
                    keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
                    calls.add((path.relative_to(root).as_posix(), name, keywords.get("launch_server")))
    assert calls == {
        ("workers/rollout/sglang_rollout/http_server_engine.py", "launch_server_process", None),
        ("workers/rollout/sglang_rollout/sglang_rollout.py", "AsyncHttpServerAdapter", "False"),
    }, "verl may now reach SGLang's launch_server_process: give it a run-time fix in verl_sat.trainer_fixes"
    engine = (root / "workers/rollout/sglang_rollout/http_server_engine.py").read_text()
    assert "if launch_server:\n            self.process: multiprocessing.Process = launch_server_process(" in engine
