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
"""``python -m verl_sat.cpu.vllm_dist`` refuses, before it runs pip or writes anything, next to a torch built for CUDA
or ROCm, and says how to install on GPUs with the extras setup.py really has. Run here on the CPU torch, with the
build faked."""

import ast
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from verl_sat.cpu import vllm_dist

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "cuda, hip, cuda_built, expected",
    [
        (None, None, False, None),  # the CPU build
        ("12.8", None, True, "CUDA 12.8"),
        (None, "6.3.42131", False, "ROCm 6.3.42131"),
        (None, None, True, "CUDA"),  # a build whose version fields say nothing, with CUDA built in
    ],
)
def test_accelerator_build_from_the_version_module(cuda, hip, cuda_built, expected):
    assert vllm_dist.accelerator_build(SimpleNamespace(cuda=cuda, hip=hip), cuda_built) == expected


def test_accelerator_build_of_a_version_module_without_hip():
    assert vllm_dist.accelerator_build(SimpleNamespace(cuda=None), False) is None


def test_the_installed_torch_is_the_cpu_build_and_passes():
    assert vllm_dist.accelerator_build(torch.version, torch.backends.cuda.is_built()) is None
    vllm_dist.refuse_accelerator_torch()


@pytest.mark.parametrize("field, value", [("cuda", "12.8"), ("hip", "6.3.42131")])
def test_install_refuses_a_gpu_torch_and_changes_nothing(monkeypatch, tmp_path, field, value):
    calls = []

    def record(name):
        return lambda *args, **kwargs: calls.append((name, args))

    monkeypatch.setattr(torch.version, field, value)
    monkeypatch.setattr(vllm_dist.subprocess, "run", record("subprocess.run"))
    monkeypatch.setattr(vllm_dist, "_pip", record("pip"))
    monkeypatch.setattr(vllm_dist.shutil, "rmtree", record("rmtree"))
    monkeypatch.setattr(vllm_dist, "write_vllm_record", record("write_vllm_record"))
    monkeypatch.setattr(vllm_dist.sysconfig, "get_paths", lambda: {"purelib": str(tmp_path)})
    with pytest.raises(SystemExit) as refused:
        vllm_dist.install()
    message = str(refused.value.code)
    assert calls == [] and list(tmp_path.iterdir()) == []
    assert f"is a {'CUDA' if field == 'cuda' else 'ROCm'} {value} build" in message
    assert "nothing was changed" in message and "pip install -e '.[vllm]'" in message


def test_the_message_names_extras_setup_py_has():
    """Every ``.[extra,...]`` the refusal suggests is a key of setup.py's ``extras_require``."""
    tree = ast.parse((REPO / "setup.py").read_text())
    (extras,) = [
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "extras_require" for t in node.targets)
    ]
    defined = {key.value for key in extras.keys}
    named = {name for group in re.findall(r"\.\[([\w,-]+)\]", vllm_dist.GPU_INSTALL) for name in group.split(",")}
    assert {"vllm", "sglang", "gpu"} <= named <= defined


def test_python_m_refuses_with_exit_status_1_and_runs_no_subprocess():
    probe = (
        "import runpy, subprocess, torch\n"
        "torch.version.cuda = '12.8'\n"
        "def refuse(*a, **k):\n    raise AssertionError(f'subprocess started: {a}')\n"
        "subprocess.run = subprocess.Popen = refuse\n"
        "runpy.run_module('verl_sat.cpu.vllm_dist', run_name='__main__')\n"
    )
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stderr[-2000:]
    assert run.stderr.startswith("vllm_dist: refusing to run: the installed torch"), run.stderr[-2000:]
    assert "CUDA 12.8 build" in run.stderr and "AssertionError" not in run.stderr
