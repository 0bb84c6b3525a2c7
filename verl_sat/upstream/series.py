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
"""``verl-sat upstream --out DIR``'s first contribution, ``DIR/verl/``: the patch series against verl 0.9.1 and its
``PR.md``, built with git.

A scratch repository holds verl 0.9.1's files that the series touches (from the installed wheel) as its base commit;
each patch is one commit whose files come from verl-sat's own source; ``git format-patch`` writes the series. Authors,
dates and commit ids are fixed, so the same source gives the same bytes.
"""

import os
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import verl

from verl_sat.upstream.edit import UpstreamDriftError, insert_after
from verl_sat.upstream.generated_configs import CONFIG_DIR, regenerate

VERL_VERSION = "0.9.1"
AUTHOR = "verl-sat authors <verl-sat@users.noreply.github.com>"
DATE = "2026-12-04T00:00:00+00:00"  # fixed: the series is a pure function of the source
# verl's check-license hook (tests/special_sanity/check_license.py, in verl's repository, not its wheel) accepts a
# fixed list of copyright lines; an individual contributor's is "Copyright 2025 Individual Contributor:". The series'
# new files carry verl-sat's year under that form, and the series adds the 2026 line to the list, as verl added the
# 2026 lines of Bytedance, Amazon, Huawei and NVIDIA
OWN_HEADER = "# Copyright 2026 The verl-sat Authors\n"
UPSTREAM_HEADER = "# Copyright 2026 Individual Contributor: The verl-sat Authors\n"
LICENSE_CHECK = "tests/special_sanity/check_license.py"
# verl's Sphinx build (doc.yml) fails on a page in no toctree: a new docs/algo/ page joins the algorithms' toctree
DOCS_INDEX = "docs/index.rst"
DOCS_INDEX_ANCHOR = "   algo/dro.md\n"  # the last entry of the algorithms' toctree in 0.9.1
# the files of verl's repository, not its wheel, that the series edits: taken from --verl-repo
REPO_FILES = (LICENSE_CHECK, DOCS_INDEX)
LICENSE_ANCHORS = (
    'license_head_individual = "Copyright 2025 Individual Contributor:"\n',
    "    license_head_individual,\n",
)
LICENSE_LINES = ('license_head_individual_26 = "Copyright 2026 Individual Contributor:"\n',
                 "    license_head_individual_26,\n")  # fmt: skip


@dataclass(frozen=True)
class Patch:
    """One commit of the series: ``changes(read, repo)`` returns ``{path: new text}`` for the files it writes, with
    ``read(path)`` the text of a file as the previous patches left it (verl 0.9.1's before the first) and ``repo``
    verl-sat's checkout; ``edits`` lists the verl files it changes (besides the config folder, always present)."""

    subject: str
    body: str
    edits: tuple[str, ...]
    changes: Callable[[Callable[[str], str], Path], dict[str, str]]


def verl_site_root() -> Path:
    """The folder the verl wheel was installed into (it holds ``verl/`` and the wheel's ``tests/``)."""
    if verl.__version__ != VERL_VERSION:
        raise UpstreamDriftError(
            f"the patch series is written against verl {VERL_VERSION}, but verl {verl.__version__} is installed: "
            f"pip install verl=={VERL_VERSION}"
        )
    return Path(verl.__file__).resolve().parent.parent


def write_series(
    out: Path, repo: Path, patches: list[Patch], verl_repo: Path | None = None
) -> list[tuple[Path, list[str]]]:
    """Write ``0001-*.patch`` ... into ``out`` (created; old ``*.patch`` files there are removed); return each patch
    file with the paths its commit changes.

    New Python files get ``UPSTREAM_HEADER``. ``verl_repo``, a verl repository checkout, supplies ``REPO_FILES``
    (not in the wheel): the first patch that adds such a file adds the 2026 line to ``LICENSE_CHECK``, and a new
    ``docs/algo/`` page joins ``DOCS_INDEX``'s toctree; without one those edits are left out, with a warning, and verl's
    check-license hook and docs build fail on the series."""
    site = verl_site_root()
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.patch"):
        old.unlink()
    with tempfile.TemporaryDirectory(prefix="verl-sat-upstream-") as tmp:
        work = Path(tmp) / "verl"
        _base_tree(site, work, {path for patch in patches for path in patch.edits})
        missing = [path for path in REPO_FILES if verl_repo is None or not (verl_repo / path).is_file()]
        for path in sorted(set(REPO_FILES) - set(missing)):
            (work / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(verl_repo / path, work / path)
        if missing:
            left = f"no {', '.join(missing)} (pass --verl-repo, a verl checkout): the series leaves them as they are"
            warnings.warn(f"{left}, and verl's check-license hook and docs build fail on it", stacklevel=2)
        git = _git(work, Path(tmp))
        git("init", "-q")
        git("add", "-A")
        git("commit", "-q", "-m", f"verl {VERL_VERSION} (the files this series touches)")
        changed_paths = []
        for patch in patches:
            changed = _with_repo_conventions(patch.changes(lambda path: _read(work, path), repo), work)
            for path, text in changed.items():
                (work / path).parent.mkdir(parents=True, exist_ok=True)
                (work / path).write_text(text)
            if any(path.startswith(CONFIG_DIR) and path.endswith(".yaml") for path in changed):
                for path, text in regenerate(work).items():
                    (work / path).write_text(text)
            git("add", "-A")
            git("commit", "-q", "-m", f"{patch.subject}\n\n{patch.body}")
            changed_paths.append(git("show", "--name-only", "--format=", "HEAD").split())
        git("format-patch", "-q", "--zero-commit", "--no-signature", "-o", str(out.resolve()), f"HEAD~{len(patches)}")
    return list(zip(sorted(out.glob("*.patch")), changed_paths, strict=True))


def _with_repo_conventions(changed: dict[str, str], work: Path) -> dict[str, str]:
    """``changed`` with ``UPSTREAM_HEADER`` on new Python files (the first of them registers its line with verl's
    license check) and each new ``docs/algo/`` page in the algorithms' toctree, where the base tree has those files."""
    changed = dict(changed)
    new_files = [path for path, text in changed.items() if path.endswith(".py") and text.startswith(OWN_HEADER)]
    for path in new_files:
        changed[path] = UPSTREAM_HEADER + changed[path][len(OWN_HEADER) :]
    check = work / LICENSE_CHECK
    if new_files and check.is_file() and LICENSE_LINES[0] not in check.read_text():
        text = check.read_text()
        for anchor, line in zip(LICENSE_ANCHORS, LICENSE_LINES, strict=True):
            text = insert_after(text, anchor, line, LICENSE_CHECK)
        changed[LICENSE_CHECK] = text
    index = work / DOCS_INDEX
    for page in [path for path in changed if path.startswith("docs/algo/") and path.endswith(".md")]:
        entry = f"   {page.removeprefix('docs/')}\n"
        if index.is_file() and entry not in index.read_text():
            changed[DOCS_INDEX] = insert_after(index.read_text(), DOCS_INDEX_ANCHOR, entry, DOCS_INDEX)
    return changed


def _base_tree(site: Path, work: Path, edits: set[str]) -> None:
    """verl's config folder (composed to rebuild the generated configs) and the files the series edits, from the
    installed wheel, in a fresh scratch tree."""
    shutil.copytree(site / CONFIG_DIR, work / CONFIG_DIR, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for path in sorted(edits):
        if not (site / path).is_file():
            raise UpstreamDriftError(f"verl {VERL_VERSION} has no {path}")
        (work / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(site / path, work / path)


def _read(work: Path, path: str) -> str:
    """A file of the scratch tree; a verl file a patch reads must be in its ``edits``."""
    if not (work / path).is_file():
        raise UpstreamDriftError(f"{path} is not in the series' base tree: list it in the patch's edits")
    return (work / path).read_text()


def _git(work: Path, home: Path) -> Callable[..., str]:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_AUTHOR_NAME": AUTHOR.split(" <")[0],
        "GIT_AUTHOR_EMAIL": AUTHOR.split(" <")[1].rstrip(">"),
        "GIT_AUTHOR_DATE": DATE,
        "GIT_COMMITTER_NAME": AUTHOR.split(" <")[0],
        "GIT_COMMITTER_EMAIL": AUTHOR.split(" <")[1].rstrip(">"),
        "GIT_COMMITTER_DATE": DATE,
    }

    def git(*args: str) -> str:
        command = ["git", "-c", "init.defaultBranch=main", "-c", "core.autocrlf=false", *args]
        proc = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"git {' '.join(args[:2])} failed: {proc.stderr.strip()}")
        return proc.stdout

    return git
