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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import verl

from verl_sat.upstream.edit import UpstreamDriftError
from verl_sat.upstream.generated_configs import CONFIG_DIR, regenerate

VERL_VERSION = "0.9.1"
AUTHOR = "verl-sat authors <verl-sat@users.noreply.github.com>"
DATE = "2026-12-04T00:00:00+00:00"  # fixed: the series is a pure function of the source


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


def write_series(out: Path, repo: Path, patches: list[Patch]) -> list[tuple[Path, list[str]]]:
    """Write ``0001-*.patch`` ... into ``out`` (created; old ``*.patch`` files there are removed); return each patch
    file with the paths its commit changes."""
    site = verl_site_root()
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.patch"):
        old.unlink()
    with tempfile.TemporaryDirectory(prefix="verl-sat-upstream-") as tmp:
        work = Path(tmp) / "verl"
        _base_tree(site, work, {path for patch in patches for path in patch.edits})
        git = _git(work, Path(tmp))
        git("init", "-q")
        git("add", "-A")
        git("commit", "-q", "-m", f"verl {VERL_VERSION} (the files this series touches)")
        changed_paths = []
        for patch in patches:
            changed = patch.changes(lambda path: _read(work, path), repo)
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
