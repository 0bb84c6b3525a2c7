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
"""The verl plugin: entry-point registration in a fresh interpreter, ``verl-sat doctor``, loud failure, and verl's
own policy-loss tests with the plugin installed."""

import os
import subprocess
import sys

import pytest

VERL_POLICY_LOSS_TESTS = [
    "tests.trainer.ppo.test_core_algos_on_cpu",
    "tests.trainer.ppo.test_dynamic_policy_losses_on_cpu",
]


def _python(code: str, env: dict | None = None, cwd: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


def test_import_verl_registers_the_losses():
    proc = _python(
        "import sys, verl\n"
        "from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R\n"
        "assert 'verl_sat.losses' in sys.modules\n"
        "print(R['sat'].__module__, R['sat_gspo'].__module__, R['vanilla'].__module__, R['gspo'].__module__)"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["verl_sat.losses"] * 2 + ["verl.trainer.ppo.core_algos"] * 2


def test_plugin_can_be_disabled_with_verl_switch():
    env = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": "none"}
    proc = _python(
        "import verl\nfrom verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R\nprint('sat' in R)", env
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "False"


def test_doctor_passes():
    proc = subprocess.run([sys.executable, "-m", "verl_sat.cli", "doctor"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS policy loss 'sat' registered" in proc.stdout
    assert "PASS policy loss 'sat_gspo' registered" in proc.stdout
    assert "all checks passed" in proc.stdout


@pytest.fixture
def broken_plugin_env(tmp_path):
    """An interpreter in which ``verl_sat.losses`` cannot be imported (a sitecustomize blocks it)."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['verl_sat.losses'] = None\n")
    return {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def test_broken_plugin_warns_instead_of_debug(broken_plugin_env):
    proc = _python("import verl", broken_plugin_env)
    assert proc.returncode == 0
    assert "verl-sat plugin failed to load" in proc.stderr
    assert "ModuleNotFoundError: import of verl_sat.losses halted" in proc.stderr


def test_doctor_fails_loudly_with_the_real_exception(broken_plugin_env):
    proc = subprocess.run(
        [sys.executable, "-m", "verl_sat.cli", "doctor"], capture_output=True, text=True, env=broken_plugin_env
    )
    assert proc.returncode != 0
    assert "FAIL policy loss 'sat' registered" in proc.stdout
    assert "ModuleNotFoundError: import of verl_sat.losses halted" in proc.stdout
    assert "FAILED" in proc.stderr


def test_verl_policy_loss_tests_pass_with_plugin_installed(tmp_path):
    """Nothing of verl's is overwritten: verl's shipped policy-loss CPU tests pass with verl-sat registered."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", *VERL_POLICY_LOSS_TESTS],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout
