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
"""The machinery of ``benchmarks/gpu_check.py`` (``make gpu-check``), on small fakes: the import listing, the sections
that record an error and go on, the results file rewritten after each section, the carried wheels unpacked, the
version notes. The check itself runs in ``test_device_behaviour_on_cpu.py`` and ``make gpu-check-dryrun``."""

import importlib.util
import json
import sys
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    saved = list(sys.path)
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.path[:] = saved  # the script puts benchmarks/ and the tree first
    return module


def _wheel(folder: Path, name: str, files: dict[str, str]) -> Path:
    path = folder / name
    with zipfile.ZipFile(path, "w") as zf:
        for arcname, text in files.items():
            zf.writestr(arcname, text)
    return path


def test_the_import_listing_names_every_missing_module_with_its_distribution(gpu_check, tmp_path):
    (tmp_path / "needs.py").write_text(
        "import json\n"
        "import antlr4\n"
        "from omegaconf import DictConfig, OmegaConf\n"
        "from not_a_module_anywhere.sub import thing\n"
        "import carried_for_cp399\n"
        "OmegaConf.register_new_resolver('x', lambda: 1)\n"
        "class Config(DictConfig):\n"
        "    pass\n"
        "try:\n"
        "    import optional_and_absent\n"
        "except ImportError:\n"
        "    pass\n"
    )
    wheels_dir = tmp_path / "whl"
    wheels_dir.mkdir()
    _wheel(wheels_dir, "carried_for_cp399-1.0-cp399-cp399-manylinux_2_17_x86_64.whl",
           {"carried_for_cp399/__init__.py": "", "carried_for_cp399-1.0.dist-info/METADATA": ""})  # fmt: skip
    wheels = gpu_check.wheel_inventory(wheels_dir)
    assert [(w["distribution"], w["modules"], w["compatible"]) for w in wheels] == [
        ("carried_for_cp399", ["carried_for_cp399"], False)
    ]
    # antlr4 and omegaconf are installed here: blocked, they count as absent
    report = gpu_check.missing_imports(["needs"], blocked=["antlr4", "omegaconf"], path=[str(tmp_path), *sys.path],
                                       wheels=wheels)  # fmt: skip
    assert report["stopped"] is None
    rows = {row["module"]: row for row in report["missing"]}
    assert list(rows) == ["antlr4", "omegaconf", "not_a_module_anywhere", "carried_for_cp399"]  # not the optional one
    assert {m: r["distribution"] for m, r in rows.items()} == {
        "antlr4": "antlr4-python3-runtime",
        "omegaconf": "omegaconf",
        "not_a_module_anywhere": "not_a_module_anywhere",
        "carried_for_cp399": "carried_for_cp399",
    }
    assert all(row["needed_by"] == "needs" for row in rows.values())
    assert "pins antlr4-python3-runtime==4.9.3" in rows["antlr4"]["advice"]  # GPU_SDISTS
    assert "pins omegaconf==2.3.1" in rows["omegaconf"]["advice"]  # GPU_WHEELS
    assert "add not_a_module_anywhere==<version> to GPU_WHEELS" in rows["not_a_module_anywhere"]["advice"]
    assert "does not fit" in rows["carried_for_cp399"]["advice"]


def _with_details(error: Exception, details) -> Exception:
    error.details = details
    return error


def test_a_section_that_raises_is_recorded_and_the_next_ones_run(gpu_check, tmp_path):
    out = tmp_path / "out" / "gpu_check.json"
    on_disk = []  # the sections each section found in the results file when it started

    def section(name, value=None, error=None, needs=()):
        def body():
            on_disk.append(list(json.loads(out.read_text())["sections"]) if out.exists() else None)
            if error:
                raise error
            return value

        return gpu_check.Section(name, body, needs)

    sections = [
        section("first", {"x": 1}),
        section("boom", error=ValueError("bad input")),
        section("boom_with_details", error=_with_details(KeyError("k"), {"measured": [1, 2]})),
        section("after", {"y": 2}),
        section("slow", {"z": 3, "missed": ["3.0x against a 1.2x target"]}),
        section("needs_boom", {"never": True}, needs=("boom",)),
        section("last", [1, 2]),
    ]
    results = {"script": "test"}
    code = gpu_check.run_sections(sections, results, out)
    assert code == 1
    before = ["first", "boom", "boom_with_details", "after", "slow", "needs_boom"]
    assert on_disk == [None, before[:1], before[:2], before[:3], before[:4], before[:6]]  # needs_boom never ran
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(results, default=str))
    entries = saved["sections"]
    assert {name: e["status"] for name, e in entries.items()} == {
        "first": "ok", "boom": "error", "boom_with_details": "error", "after": "ok", "slow": "missed",
        "needs_boom": "skipped", "last": "ok",
    }  # fmt: skip
    assert entries["first"]["result"] == {"x": 1} and entries["last"]["result"] == [1, 2]
    assert entries["boom"]["error"]["type"] == "ValueError" and entries["boom"]["error"]["message"] == "bad input"
    assert "raise error" in entries["boom"]["error"]["traceback"] and "details" not in entries["boom"]["error"]
    assert entries["boom_with_details"]["error"]["details"] == {"measured": [1, 2]}
    assert entries["slow"]["result"] == {"z": 3} and entries["slow"]["missed"] == ["3.0x against a 1.2x target"]
    assert entries["needs_boom"]["reason"] == "needs boom"
    assert saved["failures"] == ["boom: ValueError: bad input", "boom_with_details: KeyError: 'k'",
                                 "slow: 3.0x against a 1.2x target", "needs_boom: skipped (needs boom)"]  # fmt: skip
    assert sorted(p.name for p in out.parent.iterdir()) == ["gpu_check.json"]  # no temporary file left

    # every section ok: exit status 0; past the deadline, the rest is skipped and written
    assert gpu_check.run_sections([section("a", 1)], {}, tmp_path / "ok.json") == 0
    late = {}
    assert gpu_check.run_sections([section("a", 1), section("b", 2)], late, tmp_path / "late.json", deadline_s=-1) == 1
    assert [e["status"] for e in late["sections"].values()] == ["skipped", "skipped"]


def test_the_carried_wheels_are_unpacked_as_pip_would(gpu_check, tmp_path):
    wheels_dir = tmp_path / "whl"
    wheels_dir.mkdir()
    _wheel(wheels_dir, "tiny_mod-0.1-py3-none-any.whl", {
        "tiny_mod/__init__.py": "VALUE = 7\n",
        "tiny_mod-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: tiny_mod\nVersion: 0.1\n",
        "tiny_mod-0.1.data/purelib/tiny_extra.py": "EXTRA = 1\n",
        "tiny_mod-0.1.data/scripts/tiny-cli": "#!python\n",
    })  # fmt: skip
    wheels = gpu_check.wheel_inventory(wheels_dir)
    assert [(w["modules"], w["compatible"]) for w in wheels] == [(["tiny_extra", "tiny_mod"], True)]
    site = tmp_path / "site"
    assert gpu_check.unpack_wheels(wheels, wheels_dir, site) == ["tiny_mod-0.1-py3-none-any.whl"]
    assert sorted(p.name for p in site.iterdir()) == [".verl_sat_gpu_site", "tiny_extra.py", "tiny_mod",
                                                      "tiny_mod-0.1.dist-info"]  # fmt: skip
    gpu_check.unpack_wheels(wheels, wheels_dir, site)  # made by it: emptied and unpacked again
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("not the script's")
    with pytest.raises(RuntimeError, match="not made by gpu_check.py"):
        gpu_check.unpack_wheels(wheels, wheels_dir, foreign)
    assert (foreign / "keep.txt").exists()


def test_versions_other_than_the_image_are_noted(gpu_check):
    same = {"python": "3.12.7", "torch": "2.11.0+cu130", "transformers": "5.17.2", "verl": "0.9.1"}
    assert gpu_check.version_notes(same) == []
    notes = gpu_check.version_notes({"python": "3.11.7", "torch": "2.13.0+cpu", "transformers": "5.18.0", "verl": None})
    assert notes == [
        "python 3.11.7 differs from 3.12, the version the check was written for",
        "torch 2.13.0+cpu differs from 2.11.0+cu130, the version the check was written for",
        "transformers 5.18.0 differs from 5.17.x, the version the check was written for",
        "verl not found (the check was written for 0.9.1)",
    ]
    assert gpu_check.makefile_pins()["verl"] == "verl==0.9.1"
