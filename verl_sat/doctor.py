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
"""``verl-sat doctor``: check, in a fresh interpreter, that ``import verl`` loads the plugin and its losses."""

import subprocess
import sys
import textwrap

REQUIRED_LOSSES = ("sat", "sat_gspo")

# Runs in a child interpreter so that the check sees exactly what a verl driver or Ray worker sees.
_PROBE = textwrap.dedent(
    f"""
    import importlib, importlib.metadata, traceback
    ok = True
    def report(passed, what, detail=""):
        global ok
        ok &= passed
        print(("PASS " if passed else "FAIL ") + what + (": " + detail if detail else ""))

    eps = [ep for ep in importlib.metadata.entry_points(group="verl.plugins") if ep.value == "verl_sat.plugin"]
    report(bool(eps), "entry point verl.plugins -> verl_sat.plugin", "" if eps else "reinstall: pip install -e .")
    import verl
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
    report(True, "import verl", verl.__version__)
    for name in {REQUIRED_LOSSES!r}:
        found = name in POLICY_LOSS_REGISTRY
        report(found, f"policy loss {{name!r}} registered by import verl")
    try:
        importlib.import_module("verl_sat.plugin")
        from verl_sat.config import SatConfig, SatPolicyLossConfig
        SatPolicyLossConfig()
        report(True, "verl_sat.config imports (SatConfig, SatPolicyLossConfig)")
    except Exception:
        report(False, "verl_sat plugin import", "\\n" + traceback.format_exc())
    raise SystemExit(0 if ok else 1)
    """
)


def run_doctor() -> int:
    """Print a PASS/FAIL report; return 0 when every check passes."""
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True)
    print(proc.stdout, end="")
    if proc.returncode != 0:
        if proc.stderr:
            print(proc.stderr, end="", file=sys.stderr)
        print("verl-sat doctor: FAILED", file=sys.stderr)
    else:
        print("verl-sat doctor: all checks passed")
    return proc.returncode
