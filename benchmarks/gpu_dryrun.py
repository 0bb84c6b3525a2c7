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
"""``make gpu-check-dryrun``: ``benchmarks/gpu_check.py`` on this CPU as a bare GPU machine would run it.

1. The carried set: every wheel the Makefile pins (``GPU_WHEELS``, ``GPU_SDISTS``) is in ``.whl/``, and the wheels fit
   in what travels with the tree (64 MiB less the files ``git ls-files --cached --others --exclude-standard`` lists).
2. An interpreter that sees only the GPU image's packages: a venv (``--build``/venv, no system site packages) holding
   ``--image`` (torch, the CPU build on this disk: a resolution that would fetch a CUDA build is refused before
   anything is downloaded; transformers; numpy; packaging; cloudpickle) and their dependencies, nothing else.
3. The carried wheels for that interpreter: those it can use as they are; for a binary wheel built for another Python
   (the GPU image's is 3.12), the same distribution and version built for this one (said so in the output).
4. ``gpu_check.py --device cpu --quick`` in the venv with only this tree on ``PYTHONPATH`` (no install of verl-sat):
   it unpacks the wheels itself, as on the GPU machine, and must list no missing import and pass every section.

Only the standard library here (and ``gpu_check.py``'s helpers, which need no more).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from gpu_check import REPO, _normalise, makefile_pins, wheel_inventory

TRAVEL_BYTES = 64 * 2**20  # the working tree, untracked files and carried paths that reach the GPU machine
MIB = 2**20


def tree_bytes(repo: Path = REPO) -> tuple[int, int]:
    """Files and bytes of what travels with the tree besides carried paths: tracked files and untracked ones git does
    not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                            capture_output=True, check=True).stdout  # fmt: skip
    paths = {p for p in listed.decode().split("\0") if p}
    sizes = [(repo / p).stat().st_size for p in paths if (repo / p).is_file() and not (repo / p).is_symlink()]
    return len(sizes), sum(sizes)


def check_carried_set(wheel_dir: Path) -> tuple[list[dict], list[str]]:
    """Print the carried wheels and their sizes against the budget; return them and the problems found."""
    problems = []
    files, tree = tree_bytes()
    wheels = wheel_inventory(wheel_dir)
    total = sum(w["bytes"] for w in wheels)
    budget = TRAVEL_BYTES - tree
    print(f"tree: {files} files, {tree / MIB:.2f} MiB (git ls-files --cached --others --exclude-standard)")
    print(f"carried wheels ({wheel_dir}):\n| wheel | MiB |\n|---|---:|")
    for w in wheels:
        print(f"| {w['file']} | {w['bytes'] / MIB:.2f} |")
    verdict = "within" if total <= budget else "OVER"
    print(f"wheels total: {total / MIB:.2f} MiB ({total} bytes), {verdict} the budget of {budget / MIB:.2f} MiB "
          f"(64 MiB less the tree)")  # fmt: skip
    if total > budget:
        problems.append(f"the wheels ({total / MIB:.2f} MiB) exceed the budget ({budget / MIB:.2f} MiB)")
    have = {(_normalise(w["distribution"]), w["version"]) for w in wheels}
    pins = makefile_pins()
    absent = [pin for pin in pins.values() if "==" in pin and (_normalise(pin.split("==")[0]), pin.split("==")[1])
              not in have]  # fmt: skip
    extra = [w["file"] for w in wheels if _normalise(w["distribution"]) not in pins]
    print(f"pinned in the Makefile: {len(pins)}; absent from {wheel_dir}: {', '.join(absent) or 'none'}; "
          f"not pinned: {', '.join(extra) or 'none'}")  # fmt: skip
    if absent:
        problems.append("absent from .whl/: " + ", ".join(absent) + " (make gpu-wheels)")
    return wheels, problems


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], check=True, **kwargs)


def image_venv(python: str, image: list[str], venv: Path, fresh: bool) -> Path:
    """The venv that stands for the GPU image, made (or kept, when ``image`` and the interpreter are the same)."""
    stamp = venv / ".gpu-image"
    key = json.dumps({"python": python, "image": image})
    vpy = venv / "bin" / "python"
    if not fresh and stamp.exists() and stamp.read_text() == key and vpy.exists():
        print(f"image venv: {venv} (kept; DRYRUN_FRESH=1 rebuilds it)")
        return vpy
    shutil.rmtree(venv, ignore_errors=True)
    run([python, "-m", "venv", venv])
    torch_pins = [r for r in image if r.startswith("torch")]
    # refuse a CUDA build of torch (several GB) before anything is downloaded
    report = venv / "torch-resolution.json"
    run([vpy, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed", "--report", report, *torch_pins])
    resolved = json.loads(report.read_text())["install"]
    cuda = [f"{r['metadata']['name']} {r['metadata']['version']}" for r in resolved
            if r["metadata"]["name"].startswith("nvidia") or "+cu" in r["metadata"]["version"]]  # fmt: skip
    if cuda:
        raise SystemExit(f"refusing a CUDA build of torch for the dry run: {', '.join(cuda)}")
    run([vpy, "-m", "pip", "install", "--quiet", *torch_pins])  # first, so that nothing pulls another torch
    run([vpy, "-m", "pip", "install", "--quiet", *[r for r in image if r not in torch_pins]])
    stamp.write_text(key)
    print(f"image venv: {venv} (made)")
    return vpy


def wheels_for(vpy: Path, wheels: list[dict], wheel_dir: Path, out: Path) -> list[str]:
    """The carried wheels as the venv's interpreter can use them, into ``out``; returns the substitutions made."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    code = "import json; from packaging.tags import sys_tags; print(json.dumps([str(t) for t in sys_tags()]))"
    supported = set(json.loads(run([vpy, "-c", code], capture_output=True, text=True).stdout))
    swapped = []
    for w in wheels:
        py, abi, plats = w["tag"].split("-")
        if any(f"{a}-{b}-{c}" in supported for a in py.split(".") for b in abi.split(".") for c in plats.split(".")):
            shutil.copy2(wheel_dir / w["file"], out / w["file"])
            continue
        before = set(os.listdir(out))
        run([vpy, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "-d", out,
             f"{w['distribution']}=={w['version']}"])  # fmt: skip
        got = sorted(set(os.listdir(out)) - before)
        swapped.append(f"{w['file']} -> {', '.join(got)}")
    return swapped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", default=sys.executable, help="the interpreter the venv is made from")
    parser.add_argument("--image", default="torch==2.13.0 transformers==5.17.* numpy packaging cloudpickle")
    parser.add_argument("--build", type=Path, default=REPO / "build" / "gpu-dryrun")
    parser.add_argument("--wheels", type=Path, default=REPO / ".whl")
    parser.add_argument("--fresh", action="store_true", help="rebuild the venv")
    args = parser.parse_args()
    build = args.build.resolve()
    t0 = time.monotonic()
    times = {}

    print("== the carried set ==")
    wheels, problems = check_carried_set(args.wheels)
    if not wheels:
        raise SystemExit(f"no wheels in {args.wheels}: run make gpu-wheels")

    print("\n== an interpreter with the GPU image's packages only ==")
    t = time.monotonic()
    vpy = image_venv(args.python, args.image.split(), build / "venv", args.fresh)
    times["venv"] = time.monotonic() - t
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "TMPDIR") if k in os.environ}
    env.update(PYTHONPATH=str(REPO), PYTHONNOUSERSITE="1")
    probe = "import sys; print(sys.version.split()[0]); print(sys.path)"
    version, path = run([vpy, "-c", probe], capture_output=True, text=True, env=env).stdout.splitlines()
    listed = json.loads(run([vpy, "-m", "pip", "list", "--format=json"], capture_output=True, text=True).stdout)
    print(f"Python {version} ({vpy}); sys.path: {path}")
    print(f"{len(listed)} distributions: " + ", ".join(f"{d['name']} {d['version']}" for d in listed))

    print("\n== the carried wheels for this interpreter ==")
    t = time.monotonic()
    swapped = wheels_for(vpy, wheels, args.wheels, build / "wheels")
    times["wheels"] = time.monotonic() - t
    for line in swapped:
        print(f"built for another Python (the GPU image's 3.12), the same version for {version} instead: {line}")
    if not swapped:
        print("every carried wheel as it is")

    print("\n== benchmarks/gpu_check.py --device cpu --quick ==", flush=True)
    out = build / "out"
    shutil.rmtree(out, ignore_errors=True)
    t = time.monotonic()
    check = subprocess.run([str(vpy), "benchmarks/gpu_check.py", "--device", "cpu", "--quick", "--wheels",
                            str(build / "wheels"), "--site", str(build / "site"), "--out", str(out)],
                           cwd=REPO, env=env)  # fmt: skip
    times["check"] = time.monotonic() - t
    results = json.loads((out / "gpu_check.json").read_text()) if (out / "gpu_check.json").exists() else {}
    if check.returncode:
        problems.append(f"gpu_check.py exited {check.returncode}: " + "; ".join(results.get("failures", [])))
    loaded = results.get("sections", {}).get("imports", {}).get("result", {}).get("loaded", [])
    carried = sorted(r["distribution"] for r in loaded if r["from"] == "carried")
    print(f"\nloaded from the carried wheels: {', '.join(carried) or 'none'}")
    unused = [w["file"] for w in wheels if _normalise(w["distribution"]) not in {_normalise(c) for c in carried}]
    print(f"carried, never imported by the check here: {', '.join(unused) or 'none'}")
    if "verl" not in carried:
        problems.append("verl did not come from the carried wheels")

    times["total"] = time.monotonic() - t0
    timing = ", ".join(f"{k} {v:.0f} s" for k, v in times.items())
    total = sum(w["bytes"] for w in wheels)
    if problems:
        print(f"\ngpu-check-dryrun: FAILED ({timing}): " + "; ".join(problems))
        sys.exit(1)
    print(f"\ngpu-check-dryrun: OK ({timing}); wheels {total / MIB:.2f} MiB; results in {out / 'gpu_check.json'}")


if __name__ == "__main__":
    main()
