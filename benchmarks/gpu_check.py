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
"""The hot paths on one GPU (``make gpu-check``), in sections, each one's results written as soon as it ends:

1. ``environment``: the carried wheels (``.whl/``) unpacked into a site folder put on ``sys.path``; the versions of
   Python, torch, transformers and verl found, with a note for each that differs from the image the check was written
   for (Python 3.12, torch 2.11.0+cu130, transformers 5.17.x, verl 0.9.1: the check proceeds).
2. ``imports``: every module the check imports (torch, transformers, verl's loss and config modules, verl-sat's),
   with Ray stubbed. If one is missing, a child interpreter imports them again with each missing module replaced by
   a stub, so that one run lists every module that neither the image nor ``.whl/`` provides, with the distribution
   to add to ``GPU_WHEELS`` in the Makefile. Nothing before this section touches the GPU.
3. ``loss_syncs_*``, one per loss and granularity: the SAT surrogate, verl's ``agg_loss`` and the backward under
   ``torch.cuda.set_sync_debug_mode("error")`` and ``torch.use_deterministic_algorithms(True)`` (nothing may sync
   or raise), in fp32 and bf16; the registered loss and verl's counterpart under ``"warn"``, counting syncs (one, the
   metrics read, against verl's three reads; ``gspo`` also copies ``torch.tensor(0.0, device=...)`` from the host,
   a fourth).
4. ``r3_syncs_2_layers``, ``r3_syncs_6_layers``: an R3 forward + backward under ``"warn"`` against the same model's
   native one (transformers' expert dispatch syncs; R3 may add none beyond its one metrics read).
5. ``loss_time_float32``, ``loss_time_bfloat16``: ``sat`` / ``vanilla`` and ``sat_gspo`` / ``gspo``, forward +
   backward timed with CUDA events at 8 x 4096, 32 x 8192 and 64 x 16384 tokens (``benchmarks/bench_losses.py``).
6. ``r3_time``: R3 replay against native routing, forward + backward, on a Qwen3-MoE built from a config (8 layers,
   64 experts, hidden 1024, 8,192 tokens; ``benchmarks/bench_routing_replay.py``).

``OUT/gpu_check.json`` is rewritten (temporary file + rename) after every section: a crash or a timeout keeps every
finished section. Each section is recorded as ``ok``, ``missed`` (it ran, a target was not met), ``error`` (it
raised: type, message, the traceback's last frames; the next section runs) or ``skipped`` (a section it needs did not
succeed, or past ``--deadline-s``); the exit status is non-zero unless every section is ``ok``.

On a bare GPU machine (PyTorch with CUDA, transformers, numpy; no verl, no Ray, no network), from the repository root:

    OUT=$OUT make gpu-check               # = PYTHONPATH=. python3 benchmarks/gpu_check.py --out $OUT
    python benchmarks/gpu_check.py --device cpu --quick   # the same code on a CPU (make gpu-check-dryrun, a test)

- verl 0.9.1 and the small packages its loss and config modules import travel as wheels in ``.whl/`` (``make
  gpu-wheels``, for CPython 3.12 on x86-64; not tracked by git: carry the folder with the tree). The script unpacks
  them itself (``--wheels``, ``--site``; no pip needed) and puts the site folder ahead of the image's packages.
- no Ray: verl imports ``ray`` at module level (``verl.protocol``) only for the annotation ``ray.ObjectRef``, and
  ``transfer_queue`` (which needs Ray) behind a fallback. Before importing verl this script puts a stub ``ray`` module
  holding that one name in ``sys.modules`` and blocks ``transfer_queue``; nothing here calls Ray.

On the CPU the sync checks run through ``verl_sat.op_audit.CudaOpAudit`` instead of CUDA's sync debug mode.
"""

import argparse
import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import types
import warnings
import zipfile
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))  # the sibling benchmarks
sys.path.insert(1, str(REPO))  # verl_sat from this tree

# The image the check was written for; others are reported, and the check proceeds.
WRITTEN_FOR = {"python": "3.12", "torch": "2.11.0+cu130", "transformers": "5.17.x", "verl": "0.9.1"}
# Everything the sections import, in this order (the imports section imports them before any GPU work).
IMPORT_TARGETS = (
    "torch",
    "transformers",
    "bench_losses",
    "bench_routing_replay",
    "verl.trainer.ppo.core_algos",
    "verl.workers.config",
    "verl_sat.losses",
    "verl_sat.config",
    "verl_sat.op_audit",
    "verl_sat.routing_replay",
    "verl_sat.sat_math",
)
# Import names whose distribution is named otherwise (any other module: the distribution of the same name).
DISTRIBUTIONS = {
    "antlr4": "antlr4-python3-runtime",
    "yaml": "PyYAML",
    "PIL": "pillow",
    "attr": "attrs",
    "google": "protobuf",
    "dateutil": "python-dateutil",
    "sklearn": "scikit-learn",
    "cv2": "opencv-python",
    "jwt": "PyJWT",
    "git": "GitPython",
    "verl_sat": "verl-sat (this repository: run from its root)",
}
SITE_MARKER = ".verl_sat_gpu_site"
PROBE_MARKER = "GPU_CHECK_PROBE "
CASES = [("sat", "token", "vanilla", "token-mean")] + [
    ("sat_gspo", granularity, "gspo", "seq-mean-token-mean")
    for granularity in ("sequence", "sequence_uniform", "token")
]
R3_SIZES = {"full": (8, 64, 1024, 8192), "quick": (2, 8, 64, 256)}  # layers, experts, hidden, tokens


# ------------------------------------------------------------------------------------------------ sections and results


@dataclass
class Section:
    """One step of the check. ``run`` returns its JSON-able result; a dict result may hold ``"missed"``, a list of the
    targets it did not meet (the section is then recorded as ``missed``)."""

    name: str
    run: Callable[[], object]
    needs: tuple[str, ...] = ()


def write_json_atomic(path: Path, data: dict) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and a rename: a reader (or a kill)
    never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _error_record(error: BaseException) -> dict:
    frames = traceback.format_exception(type(error), error, error.__traceback__, limit=-6)
    record = {"type": type(error).__name__, "message": str(error)[:4000], "traceback": "".join(frames)[-4000:]}
    if getattr(error, "details", None) is not None:  # what the section measured before it raised
        record["details"] = error.details
    return record


def _failures(sections: dict) -> list[str]:
    out = []
    for name, entry in sections.items():
        if entry["status"] == "error":
            out.append(f"{name}: {entry['error']['type']}: {entry['error']['message'].splitlines()[0][:300]}")
        elif entry["status"] == "missed":
            out.append(f"{name}: " + "; ".join(entry["missed"]))
        elif entry["status"] == "skipped":
            out.append(f"{name}: skipped ({entry['reason']})")
    return out


def _detail(entry: dict) -> str:
    if entry["status"] == "error":
        message = entry["error"]["message"].splitlines()
        return entry["error"]["type"] + (f": {message[0][:300]}" if message else "")
    if entry["status"] == "skipped":
        return entry["reason"]
    return f"in {entry['seconds']:.1f} s" + "".join(f"; {m}" for m in entry.get("missed", []))


def run_sections(sections: list[Section], results: dict, out: Path, deadline_s: float | None = None) -> int:
    """Run ``sections`` in order, recording each in ``results["sections"]`` and rewriting ``out`` after each. A section
    that raises is recorded with its error and the next one runs; one whose ``needs`` did not succeed is skipped, as is
    every section that would start past ``deadline_s``. Returns 0 if every section is ``ok``, else 1."""
    done = results.setdefault("sections", {})
    start = time.monotonic()
    for i, section in enumerate(sections, 1):
        tag = f"[{i}/{len(sections)}] {section.name}"
        unmet = [n for n in section.needs if done.get(n, {}).get("status") not in ("ok", "missed")]
        if unmet:
            entry = {"status": "skipped", "reason": "needs " + ", ".join(unmet)}
        elif deadline_s is not None and time.monotonic() - start > deadline_s:
            entry = {"status": "skipped", "reason": f"past --deadline-s {deadline_s:g}"}
        else:
            print(f"\n{tag}: running", flush=True)
            t0 = time.monotonic()
            try:
                value = section.run()
                missed = value.pop("missed", []) if isinstance(value, dict) else []
                entry = {"status": "missed" if missed else "ok", "result": value}
                if missed:
                    entry["missed"] = list(missed)
            except Exception as error:  # noqa: BLE001 - recorded, and the next section runs
                entry = {"status": "error", "error": _error_record(error)}
            entry["seconds"] = round(time.monotonic() - t0, 3)
        done[section.name] = entry
        results["failures"] = _failures(done)
        results["elapsed_s"] = round(time.monotonic() - start, 3)
        write_json_atomic(out, results)
        print(f"{tag}: {entry['status'].upper()} {_detail(entry)} (results: {out})", flush=True)
    return 0 if all(entry["status"] == "ok" for entry in done.values()) else 1


# ------------------------------------------------------------------------------------------- carried wheels, versions


def wheel_inventory(folder: Path) -> list[dict]:
    """The wheels in ``folder``: file, distribution, version, tags, size, the top-level modules each provides and
    whether this interpreter can use it (``packaging.tags``; assumed when packaging is absent)."""
    try:
        from packaging.tags import parse_tag, sys_tags

        supported = set(sys_tags())
    except ImportError:
        parse_tag, supported = None, None
    rows = []
    for path in sorted(Path(folder).glob("*.whl")) if Path(folder).is_dir() else []:
        parts = path.name[: -len(".whl")].split("-")
        tag = "-".join(parts[-3:])
        with zipfile.ZipFile(path) as zf:
            modules = sorted({_top_level(name) for name in zf.namelist()} - {None})
        compatible = True if parse_tag is None else any(t in supported for t in parse_tag(tag))
        rows.append({"file": path.name, "distribution": parts[0], "version": parts[1], "tag": tag,
                     "bytes": path.stat().st_size, "modules": modules, "compatible": compatible})  # fmt: skip
    return rows


def _top_level(name: str) -> str | None:
    parts = name.split("/")
    if parts[0].endswith(".data"):
        if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
            return None
        parts = parts[2:]
    if parts[0].endswith(".dist-info") or (len(parts) == 1 and not re.search(r"\.(py|so|pyd)$", parts[0])):
        return None
    return parts[0].split(".")[0] or None


def unpack_wheels(wheels: list[dict], folder: Path, site: Path) -> list[str]:
    """Unpack the usable ``wheels`` into ``site`` as ``pip install --target`` would (a wheel is a zip; its
    ``.data/purelib`` and ``.data/platlib`` go to the root, its scripts nowhere), afresh each run. ``site`` is emptied
    first only if an earlier run of this function made it. Returns the files unpacked."""
    site = Path(site)
    if site.exists():
        if not (site / SITE_MARKER).exists() and any(site.iterdir()):
            raise RuntimeError(f"{site} exists and was not made by gpu_check.py; pass another --site")
        shutil.rmtree(site)
    site.mkdir(parents=True)
    (site / SITE_MARKER).write_text("made by benchmarks/gpu_check.py; emptied on its next run\n")
    unpacked = []
    for wheel in wheels:
        if not wheel["compatible"]:
            continue
        with zipfile.ZipFile(Path(folder) / wheel["file"]) as zf:
            for info in zf.infolist():
                parts = info.filename.split("/")
                if parts[0].endswith(".data"):
                    if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                        continue
                    parts = parts[2:]
                if info.is_dir() or ".." in parts or info.filename.startswith("/"):
                    continue
                dest = site.joinpath(*parts)
                dest.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as src, open(dest, "wb") as dst:
                    shutil.copyfileobj(src, dst)
                if (info.external_attr >> 16) & 0o111:
                    dest.chmod(0o755)
        unpacked.append(wheel["file"])
    return unpacked


def found_versions() -> dict:
    """Python's version and the installed versions of torch, transformers and verl (None where absent), from their
    metadata: nothing is imported."""
    versions = {"python": ".".join(map(str, sys.version_info[:3]))}
    for dist in ("torch", "transformers", "verl"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return versions


def version_notes(versions: dict) -> list[str]:
    """One note per version that differs from ``WRITTEN_FOR``."""
    matches = {
        "python": lambda v: v.startswith(WRITTEN_FOR["python"] + "."),
        "torch": lambda v: v == WRITTEN_FOR["torch"],
        "transformers": lambda v: v.startswith(WRITTEN_FOR["transformers"].removesuffix("x")),
        "verl": lambda v: v == WRITTEN_FOR["verl"],
    }
    notes = []
    for name, expected in WRITTEN_FOR.items():
        found = versions.get(name)
        if found is None:
            notes.append(f"{name} not found (the check was written for {expected})")
        elif not matches[name](found):
            notes.append(f"{name} {found} differs from {expected}, the version the check was written for")
    return notes


def makefile_pins(makefile: Path = REPO / "Makefile") -> dict[str, str]:
    """The carried distributions the Makefile pins (``GPU_WHEELS``, ``GPU_SDISTS``): normalised name -> pin."""
    if not Path(makefile).exists():
        return {}
    text = Path(makefile).read_text().replace("\\\n", " ")
    pins = {}
    for match in re.finditer(r"^(GPU_WHEELS|GPU_SDISTS)\s*:?=(.*)$", text, re.MULTILINE):
        for pin in match.group(2).split():
            pins[_normalise(re.split(r"[=<>!~]", pin)[0])] = pin
    return pins


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# ----------------------------------------------------------------------------------------------------- import listing


class _Stub(type):
    """A class standing for anything a missing module would have held: attributes, subscripts and calls give stubs."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub(name, (), {})

    def __getitem__(cls, item):
        return cls

    def __call__(cls, *args, **kwargs):
        return cls


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub(name, (), {})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds every module at or under ``names`` as a stub package."""

    def __init__(self):
        self.names: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        pass


def _importer(error: BaseException) -> str | None:
    """The module whose import statement raised ``error``: the innermost frame outside importlib."""
    found = None
    for frame, _ in traceback.walk_tb(error.__traceback__):
        filename = frame.f_code.co_filename
        if "importlib" not in filename and not filename.startswith("<frozen"):
            found = frame.f_globals.get("__name__")
    return found


def _probe_child(spec: dict) -> dict:
    """In a child interpreter: import ``spec["targets"]`` in order with Ray stubbed as the check does. A module whose
    absence stops an import (not one an optional import catches) is recorded, replaced by a stub package, and the
    failed target imported again, until every target imports or something else stops it."""
    sys.path[:] = spec["path"]
    stub_ray()
    finder = _StubFinder()
    sys.meta_path.insert(0, finder)
    for name in spec.get("blocked", ()):
        sys.modules[name] = None  # as if absent: an import of it raises ModuleNotFoundError
    missing, stopped = [], None
    for target in spec["targets"]:
        for _ in range(100):  # the modules whose execution failed left sys.modules: the retry runs them again
            try:
                importlib.import_module(target)
                break
            except ModuleNotFoundError as error:
                top = (error.name or "").split(".")[0]
                if not top or top in finder.names or (error.name != top and importlib.util.find_spec(top)):
                    stopped = f"{target}: {type(error).__name__}: {error}"  # e.g. a submodule a version lacks
                    break
                missing.append({"module": top, "wanted": error.name, "needed_by": _importer(error) or target})
                finder.names.add(top)
                if sys.modules.get(top, 0) is None:
                    del sys.modules[top]
            except Exception as error:  # noqa: BLE001 - reported: not a missing module
                stopped = f"{target}: {type(error).__name__}: {str(error)[:500]}"
                break
        if stopped:
            break
    return {"missing": missing, "stopped": stopped}


def missing_imports(targets: Iterable[str], blocked: Iterable[str] = (), path: list[str] | None = None,
                    wheels: list[dict] | None = None, timeout: float = 600) -> dict:  # fmt: skip
    """Every module that ``targets`` import and that this interpreter lacks, found in a child interpreter (stubs
    stand in for the missing modules there, so one run finds them all). ``blocked`` modules count as absent (a test's
    lever). Each missing module comes with its distribution and what to do: add it to ``GPU_WHEELS``, or fetch the
    wheel the Makefile already pins, or replace a carried wheel that does not fit this interpreter."""
    spec = {"targets": list(targets), "blocked": list(blocked), "path": list(path if path is not None else sys.path)}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--probe-imports"],
                          input=json.dumps(spec), capture_output=True, text=True, timeout=timeout)  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith(PROBE_MARKER)]
    if not lines:
        return {"missing": [], "stopped": f"the probe exited {proc.returncode}: {proc.stderr[-2000:]}"}
    report = json.loads(lines[-1][len(PROBE_MARKER) :])
    pins = makefile_pins()
    for row in report["missing"]:
        row["distribution"] = DISTRIBUTIONS.get(row["module"], row["module"])
        row["advice"] = _advice(row["module"], row["distribution"], pins, wheels or [])
    return report


def _advice(module: str, distribution: str, pins: dict, wheels: list[dict]) -> str:
    carried = [w for w in wheels if module in w["modules"]]
    if carried and not carried[0]["compatible"]:
        return (f"carried as {carried[0]['file']}, which does not fit Python {sys.version_info[0]}."
                f"{sys.version_info[1]} here: fetch it for this interpreter")  # fmt: skip
    if carried:
        return f"carried as {carried[0]['file']} but not importable from the site folder"
    pin = pins.get(_normalise(distribution))
    if pin:
        return f"the Makefile pins {pin}, but .whl/ lacks it: run `make gpu-wheels` and carry .whl/"
    if module == "verl_sat":
        return "run from the repository root (verl-sat is imported from the tree)"
    return f"add {distribution}==<version> to GPU_WHEELS in the Makefile, then `make gpu-wheels`"


def loaded_distributions(site: Path | None) -> list[dict]:
    """The distributions of the non-standard-library modules now imported, with versions and where each came from
    (``carried``: the site folder of ``.whl/``; ``image``: the interpreter's own packages; ``tree``: this
    repository)."""
    tops = {name.split(".")[0] for name in list(sys.modules)} - set(sys.stdlib_module_names)
    owners = importlib.metadata.packages_distributions()
    rows = {}
    for top in sorted(t for t in tops if not t.startswith("_")):
        module = sys.modules.get(top)
        origin = getattr(module, "__file__", None) or next(iter(getattr(module, "__path__", []) or []), None)
        if origin is None or getattr(module, "__verl_sat_stub__", False):
            continue
        path = Path(origin).resolve()
        carried = site is not None and path.is_relative_to(Path(site).resolve())
        if not carried and path.is_relative_to(REPO) and not path.is_relative_to(Path(sys.prefix).resolve()):
            rows[top] = {"distribution": top, "version": None, "from": "tree"}  # not a venv or site under the tree
            continue
        for dist in owners.get(top, [top]):
            try:
                meta = importlib.metadata.distribution(dist)
            except importlib.metadata.PackageNotFoundError:
                continue
            came = "carried" if carried else "image"
            rows.setdefault(meta.metadata["Name"], {"distribution": meta.metadata["Name"], "version": meta.version,
                                                    "from": came})  # fmt: skip
    return sorted(rows.values(), key=lambda r: (r["from"], r["distribution"].lower()))


# -------------------------------------------------------------------------------------------------- the check's pieces


def stub_ray() -> None:
    """A ``ray`` module with the one name verl's import chain reads (``ray.ObjectRef``), and no ``transfer_queue``
    (verl falls back to its mock); verl's plugin loader skips installed plugins (verl-sat is imported directly)."""
    ray = types.ModuleType("ray")
    ray.ObjectRef = type("ObjectRef", (), {})
    ray.__verl_sat_stub__ = True
    sys.modules["ray"] = ray
    sys.modules["transfer_queue"] = None
    os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")


@contextmanager
def sync_count(device: str):
    """Count host syncs inside the block: CUDA's sync debug mode (``"warn"``) on a GPU, the op audit's reads and
    syncing operators on the CPU. Yields a list that holds one entry per sync when the block ends."""
    import torch

    from verl_sat.op_audit import CudaOpAudit

    found: list[str] = []
    if device == "cuda":
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield found
                torch.cuda.synchronize()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        found += [str(w.message).splitlines()[0] for w in caught if "synchronizing" in str(w.message)]
    else:
        with CudaOpAudit() as audit:
            yield found
        found += audit.reads + audit.syncing


@contextmanager
def no_sync(device: str):
    """Fail on any host sync inside the block (CUDA's sync debug mode ``"error"``; the op audit on the CPU)."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
    else:
        with sync_count(device) as found:
            yield
        if found:
            raise RuntimeError(f"host syncs: {found}")


@contextmanager
def deterministic_algorithms():
    """``torch.use_deterministic_algorithms(True)`` inside the block (an operator without a deterministic CUDA
    kernel raises)."""
    import torch

    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def loss_syncs(device: str, batch: int, length: int, case: tuple[str, str, str, str]) -> dict:
    """One loss and granularity, fp32 and bf16: the surrogate with ``agg_loss`` and backward under "error" and
    deterministic algorithms; the registered loss's syncs per call against verl's counterpart's."""
    import torch
    from bench_losses import _config, _inputs
    from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn

    import verl_sat.losses  # noqa: F401  (registers sat and sat_gspo)
    from verl_sat.config import SatConfig
    from verl_sat.sat_math import sat_gspo_surrogate, sat_token_surrogate

    name, granularity, nominal, agg = case
    gate = SatConfig(granularity=granularity) if name == "sat_gspo" else SatConfig()
    rows, missed = [], []
    for dtype in (torch.float32, torch.bfloat16):
        dtype_name = str(dtype).removeprefix("torch.")
        old, log_prob, adv, mask = _inputs(batch, length, dtype, device)
        lp = log_prob.detach().requires_grad_()
        surrogate = "no sync"
        try:
            with no_sync(device), deterministic_algorithms():
                if name == "sat":
                    out = sat_token_surrogate(lp, old, adv, mask, 0.2, 0.2, 3.0, gate)
                else:
                    out = sat_gspo_surrogate(lp, old, adv, mask, 0.2, 0.2, gate, granularity)
                agg_loss(out.loss_mat, out.mask, agg).backward()
        except RuntimeError as error:
            surrogate = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
            missed.append(f"{dtype_name} surrogate + agg_loss + backward: {surrogate}")
        counts = {}
        for loss in (name, nominal):
            lp = log_prob.detach().requires_grad_()
            with sync_count(device) as found:
                pg_loss, _ = get_policy_loss_fn(loss)(old, lp, adv, mask, agg, _config(loss, gate))
                pg_loss.backward()
            counts[loss] = len(found)
        if counts[name] > 1:
            missed.append(f"{dtype_name}: {counts[name]} syncs per call (target 1; {nominal}: {counts[nominal]})")
        rows.append({"loss": name, "granularity": granularity, "dtype": dtype_name, "surrogate": surrogate,
                     "loss_syncs": counts[name], "verl_syncs": counts[nominal]})  # fmt: skip
    print("| loss | granularity | dtype | surrogate + agg_loss + backward, 'error' + deterministic | registered loss "
          "| verl |\n|---|---|---|---|---:|---:|")  # fmt: skip
    for row in rows:
        print(f"| {row['loss']} | {row['granularity']} | {row['dtype']} | {row['surrogate']} | {row['loss_syncs']} | "
              f"{row['verl_syncs']} |")  # fmt: skip
    return {"rows": rows, "missed": missed}


def r3_syncs(device: str, layers: int, experts: int, hidden: int, tokens: int) -> dict:
    """Syncs of a native and a replayed forward + backward of the same model, and of the metrics read."""
    import torch
    from bench_routing_replay import _qwen3_moe

    from verl_sat.routing_replay import RoutingReplay

    torch.manual_seed(0)
    model = _qwen3_moe(layers=layers, experts=experts, hidden=hidden).to(device)
    ids = torch.randint(0, 512, (1, tokens), device=device)
    rr = RoutingReplay.attach(model)
    with torch.no_grad(), rr.record() as recording:
        model(input_ids=ids)
    routes = recording.routed_experts.reshape(tokens, layers, -1)

    def forward_backward():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    forward_backward()  # warm-up
    with sync_count(device) as native:
        forward_backward()
    with sync_count(device) as replayed:
        with rr.replay(routes):
            forward_backward()
    with sync_count(device) as metrics_read:
        rr.replay_metrics()
    row = {"layers": layers, "experts": experts, "hidden": hidden, "tokens": tokens, "native_syncs": len(native),
           "replay_syncs": len(replayed), "metrics_read_syncs": len(metrics_read),
           "native_kinds": sorted(set(native))}  # fmt: skip
    print("| R3, MoE layers | native forward + backward | replayed | metrics read |\n|---:|---:|---:|---:|")
    print(f"| {layers} | {len(native)} | {len(replayed)} | {len(metrics_read)} |")
    missed = []
    if len(replayed) > len(native):
        missed.append(f"R3 with {layers} layers: {len(replayed)} syncs against {len(native)} native")
    return {**row, "missed": missed}


def loss_time(device: str, dtype: str, repeats: int, shapes=None) -> dict:
    """``sat`` / ``vanilla`` and ``sat_gspo`` / ``gspo`` timed at ``shapes`` in ``dtype`` (the target is reported,
    not enforced: timings on a shared machine are noisy)."""
    from bench_losses import RATIO_TARGET, time_pairs

    rows: list[dict] = []
    worst = time_pairs(device, [dtype], repeats, **({"shapes": shapes} if shapes else {}), rows=rows)
    return {"rows": rows, "worst_ratio": worst, "target_ratio": RATIO_TARGET.get(device), "repeats": repeats}


def r3_time(device: str, repeats: int, layers: int, experts: int, hidden: int, tokens: int) -> dict:
    """R3 replay against native routing, forward + backward, medians of ``repeats`` interleaved rounds."""
    from bench_routing_replay import overhead

    native, replay = overhead(repeats, device, layers, experts, hidden, tokens)
    print("| model | tokens | native ms | replay ms | ratio |\n|---|---:|---:|---:|---:|")
    print(f"| Qwen3-MoE {layers} layers, {experts} experts, top-2, hidden {hidden} | {tokens} | {native:.1f} | "
          f"{replay:.1f} | {replay / native:.3f}x |")  # fmt: skip
    return {"layers": layers, "experts": experts, "hidden": hidden, "tokens": tokens, "repeats": repeats,
            "native_ms": native, "replay_ms": replay, "ratio": replay / native}  # fmt: skip


# ---------------------------------------------------------------------------------------------------------- the check


def environment(args, state: dict) -> dict:
    """The carried wheels unpacked and on ``sys.path``; the versions found against those the check was written for."""
    wheels = wheel_inventory(args.wheels)
    state["wheels"] = wheels
    unpacked = []
    if wheels:
        unpacked = unpack_wheels(wheels, args.wheels, args.site)
        if str(args.site) not in sys.path:
            sys.path.insert(2, str(args.site))  # after the benchmarks and the tree, ahead of the image's packages
        importlib.invalidate_caches()
        state["site"] = args.site
    print(f"carried wheels: {len(wheels)} in {args.wheels}" + (f", unpacked into {args.site}" if wheels else ""))
    for w in wheels:
        fit = "" if w["compatible"] else f"  NOT FOR THIS INTERPRETER ({w['tag']}): not unpacked"
        print(f"  {w['file']}  {w['bytes'] / 2**20:.2f} MiB{fit}")
    versions = found_versions()
    notes = version_notes(versions)
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    print("written for: " + ", ".join(f"{k} {v}" for k, v in WRITTEN_FOR.items()))
    for note in notes:
        print(f"NOTE: {note}: the check proceeds; gpu_check.json records the versions found")
    return {"versions": versions, "written_for": WRITTEN_FOR, "notes": notes, "wheels": wheels, "unpacked": unpacked,
            "site": str(args.site) if wheels else None, "executable": sys.executable}  # fmt: skip


def imports(args, state: dict) -> dict:
    """Import everything the sections use, with Ray stubbed; on a missing module list every one (a child
    interpreter) with the distribution to carry. Then the device."""
    stub_ray()
    try:
        for target in IMPORT_TARGETS:
            importlib.import_module(target)
    except ImportError as error:
        report = missing_imports(IMPORT_TARGETS, wheels=state.get("wheels"))
        print(f"imports: {len(report['missing'])} module(s) that neither the image nor .whl/ provides "
              f"(first error: {type(error).__name__}: {error})")  # fmt: skip
        if report["missing"]:
            print("| module | imported by | distribution | to do |\n|---|---|---|---|")
        for row in report["missing"]:
            print(f"| {row['module']} | {row['needed_by']} | {row['distribution']} | {row['advice']} |")
        if report["stopped"]:
            print(f"the listing stopped at: {report['stopped']}")
        missing = ", ".join(f"{r['module']} ({r['distribution']})" for r in report["missing"])
        failure = ImportError(f"missing: {missing or '-'}; " + (report["stopped"] or str(error)))
        failure.details = report  # the listing, in gpu_check.json
        raise failure from error
    import torch

    loaded = loaded_distributions(state.get("site"))
    print("imports: nothing missing; the modules the check imports resolve to")
    for origin in ("image", "carried", "tree"):
        names = [f"{r['distribution']} {r['version'] or ''}".strip() for r in loaded if r["from"] == origin]
        print(f"  {origin}: " + (", ".join(names) or "-"))
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda, but torch.cuda.is_available() is False")
    state["device"] = device
    gpu = torch.cuda.get_device_name() if device == "cuda" else None  # the first GPU work of the check
    print(f"device={device} gpu={gpu or '-'} torch={torch.__version__} cuda={torch.version.cuda}")
    return {"device": device, "gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda,
            "ray_stub": getattr(sys.modules["ray"], "__verl_sat_stub__", False),
            "verl_sat_from": str(Path(sys.modules["verl_sat"].__file__).parent), "loaded": loaded}  # fmt: skip


def build_sections(args) -> list[Section]:
    state: dict = {}
    size = "quick" if args.quick else "full"
    batch, length = (8, 512) if args.quick else (32, 8192)
    imp = ("imports",)
    device = lambda: state["device"]  # noqa: E731  (known once the imports section has run)
    sections = [
        Section("environment", functools.partial(environment, args, state)),
        Section("imports", functools.partial(imports, args, state), needs=("environment",)),
    ]
    for case in CASES:
        name = case[0] if case[0] == "sat" else f"{case[0]}_{case[1]}"
        sections.append(Section(f"loss_syncs_{name}", lambda c=case: loss_syncs(device(), batch, length, c), imp))
    sizes = R3_SIZES[size][1:]  # experts, hidden, tokens
    for layers in (2, 6):
        sections.append(Section(f"r3_syncs_{layers}_layers", lambda n=layers: r3_syncs(device(), n, *sizes), imp))
    shapes = [(4, 256), (8, 512)] if args.quick else None
    repeats = 3 if args.quick else 100
    for dtype in ("float32", "bfloat16"):
        sections.append(Section(f"loss_time_{dtype}", lambda d=dtype: loss_time(device(), d, repeats, shapes), imp))
    sections.append(Section("r3_time", lambda: r3_time(device(), 2 if args.quick else 15, *R3_SIZES[size]), imp))
    if args.only:
        keep = set(args.only.split(",")) | {"environment", "imports"}
        sections = [s for s in sections if s.name in keep]
    return sections


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats (a test of the script)")
    parser.add_argument("--out", default="gpu_check_out", help="folder for gpu_check.json (rewritten per section)")
    parser.add_argument("--wheels", type=Path, default=REPO / ".whl", help="the carried wheels (make gpu-wheels)")
    parser.add_argument("--site", type=Path, default=Path(tempfile.gettempdir()) / "verl_sat_gpu_site",
                        help="where the carried wheels are unpacked (emptied if an earlier run made it)")  # fmt: skip
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="skip the sections that would start this many seconds after the first")  # fmt: skip
    parser.add_argument("--only", default=None, help="comma-separated sections to run (with environment, imports)")
    parser.add_argument("--probe-imports", action="store_true", help=argparse.SUPPRESS)  # the child of the listing
    args = parser.parse_args()
    if args.probe_imports:
        print(PROBE_MARKER + json.dumps(_probe_child(json.loads(sys.stdin.read()))), flush=True)
        return
    out = Path(args.out) / "gpu_check.json"
    results = {"script": "benchmarks/gpu_check.py", "argv": sys.argv[1:], "quick": args.quick,
               "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "written_for": WRITTEN_FOR}  # fmt: skip
    code = run_sections(build_sections(args), results, out, args.deadline_s)
    status = {s: [n for n, e in results["sections"].items() if e["status"] == s] for s in ("ok", "missed", "error")}
    print(f"\ngpu_check: {len(status['ok'])} of {len(results['sections'])} sections ok in {results['elapsed_s']:.0f} s"
          + "".join(f"; {k}: {', '.join(v)}" for k, v in status.items() if k != "ok" and v)
          + f"; results in {out}")  # fmt: skip
    sys.exit(code)


if __name__ == "__main__":
    main()
