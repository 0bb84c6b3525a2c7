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
"""``make upstream-check``: the offline checks verl's and verl-recipe's CI run on a pull request, run on the
contributions ``verl-sat upstream`` writes.

For each patch set (the whole series, and each patch that ``PR.md`` says can go alone, applied alone) a verl 0.9.1
checkout is stood up from a verl repository checkout's files (``--verl-repo``: CI config, hooks, ``docs/``,
``tests/``, ``scripts/``), the installed wheel's ``verl/`` package and the files the wheel carries under ``tests/`` and
``scripts/`` laid over them, committed as ``origin/main``; the patches are applied with ``git am`` on top, as a pull
request's branch. Then every check runs as its workflow or hook says:

- ``.pre-commit-config.yaml`` (``pre-commit.yml`` runs it with ``--all-files``): ruff and ruff-format, mypy, and each
  local hook's ``entry``;
- ``sanity.yml``: ``pytest -s -x tests/special_sanity`` and ``validate_imported_docs.py``;
- ``doc.yml``: ``make html`` in ``docs/`` with ``--keep-going -w _build/sphinx.log``, failing on the lines it greps;
- ``type-coverage-check.yml``: ``type_coverage_check.py`` and ``check_api_docs.py verl``;
- ``check-pr-title.yml``: ``check_pr_title.py`` and ``check_pr_description.py`` on the pull request's title and body.

verl-recipe's pre-commit (ruff and ruff-format at its pinned version) runs on the generated ``sat/`` laid into a
verl-recipe checkout (``--recipe-repo``). The pinned tools come from the package registry into their own virtual
environments under ``--tools`` (never into this project's); the scripts that import verl run in this interpreter,
which has verl's dependencies, with the checkout first on the path and verl-sat blocked, so they see the patched verl.
"""

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from verl_sat.upstream import ALONE, PATCHES, RECIPE_DIR, VERL_DIR, write_upstream
from verl_sat.upstream.recipe_names import RECIPE
from verl_sat.upstream.series import verl_site_root

# the versions verl's and verl-recipe's .pre-commit-config.yaml pin (checked against the files at run time)
VERL_TOOLS = ("ruff==0.12.2", "mypy==1.17.0", "pytest", "hydra-core")
RECIPE_TOOLS = ("ruff==0.14.10",)
# mirrors-mypy's hook: `mypy` with these default args, on every Python file (pre-commit's types_or: python, pyi)
MYPY_HOOK_ARGS = ("--ignore-missing-imports",)
# doc.yml fails the build on these lines of the Sphinx log
DOC_FAILURES = (
    ": ERROR:",
    "WARNING: document isn't included in any toctree",
    "WARNING: Inline emphasis",
    "WARNING: Definition list ends without a blank line",
)
BASELINE = "v0.9.1"  # the unpatched checkout: a check failing there is the stand-in's, not the series'
# doc.yml's build: `make html` with its options, then the greps that fail it (and no HTML at all fails too)
SPHINX = (
    "cd docs && make clean >/dev/null && make html SPHINXOPTS='--keep-going -w _build/sphinx.log' >/dev/null 2>&1;"
    f" fail=0; for line in {' '.join(map(shlex.quote, DOC_FAILURES))}; do"
    ' if grep -F "$line" _build/sphinx.log; then fail=1; fi; done;'
    " test -f _build/html/index.html && exit $fail || { tail -20 _build/sphinx.log; exit 1; }"
)
# an interpreter that must see the patched checkout, not verl-sat's plugin
# (plus the modules named in UPSTREAM_CHECK_BLOCK, for a check whose workflow installs less than this interpreter has)
BLOCK_PLUGIN = """import os, sys
for name in ["verl_sat", *filter(None, os.environ.get("UPSTREAM_CHECK_BLOCK", "").split(","))]:
    sys.modules[name] = None
"""
# check_api_docs.py imports every verl module it can; type-coverage-check.yml installs verl's requirements.txt, which
# has no vLLM, so verl.utils.vllm (whose VLLMHijack has no docstring in 0.9.1) is skipped there
API_DOCS_BLOCK = "vllm"
# local hooks that fail on the unpatched stand-in because the repository snapshot's script predates 0.9.1's package
# (check_device_api_usage.py's whitelist lacks verl/utils/profiler/torch_memory_profile.py): there they run on each
# folder under verl/ that the patch set changes, the narrowest run the script allows
PER_CHANGED_FOLDER = {"check-device-api-usage": "--directory"}


@dataclass
class Result:
    """One check on one patch set."""

    patch_set: str
    check: str
    source: str
    command: str
    passed: bool
    seconds: float
    tail: str = ""


@dataclass
class Environments:
    """Where each kind of command runs: the pinned tools' venvs, and this interpreter for the scripts that import
    verl (``site_python``)."""

    verl_tools: Path
    recipe_tools: Path
    site_python: str = sys.executable
    block: Path = field(default_factory=Path)

    def tool(self, name: str) -> str:
        return str(self.verl_tools / "bin" / name)


def make_tool_env(venv: Path, requirements: tuple[str, ...], extra_files: tuple[Path, ...] = ()) -> Path:
    """A virtual environment at ``venv`` with ``requirements`` (and ``-r`` each of ``extra_files``) from the package
    registry; reused when its stamp lists the same requirements."""
    stamp = venv / ".verl-sat-tools"
    wanted = "\n".join([*requirements, *(path.read_text() for path in extra_files)])
    if stamp.is_file() and stamp.read_text() == wanted:
        return venv
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, *requirements, *(arg for path in extra_files for arg in ("-r", str(path)))], check=True)
    stamp.write_text(wanted)
    return venv


def pinned_rev(config: Path, repo_suffix: str) -> str:
    """The ``rev`` a ``.pre-commit-config.yaml`` pins for the hook repository whose URL ends with ``repo_suffix``."""
    for repo in yaml.safe_load(config.read_text())["repos"]:
        if repo["repo"].endswith(repo_suffix):
            return repo["rev"].lstrip("v")
    raise SystemExit(f"{config} pins no {repo_suffix} hooks")


def check_pins(verl_repo: Path, recipe_repo: Path) -> None:
    """The tool versions here are the ones the two repositories' pre-commit configurations pin."""
    pins = {
        "ruff": pinned_rev(verl_repo / ".pre-commit-config.yaml", "ruff-pre-commit"),
        "mypy": pinned_rev(verl_repo / ".pre-commit-config.yaml", "mirrors-mypy"),
    }
    for tool, version in pins.items():
        if f"{tool}=={version}" not in VERL_TOOLS:
            raise SystemExit(f"verl's .pre-commit-config.yaml pins {tool} {version}; update VERL_TOOLS in {__file__}")
    recipe_ruff = pinned_rev(recipe_repo / ".pre-commit-config.yaml", "ruff-pre-commit")
    if f"ruff=={recipe_ruff}" not in RECIPE_TOOLS:
        raise SystemExit(f"verl-recipe's .pre-commit-config.yaml pins ruff {recipe_ruff}; update RECIPE_TOOLS")


# ---- the checkout -------------------------------------------------------------------------------------------------


def _git(tree: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_AUTHOR_NAME": "verl-sat",
        "GIT_AUTHOR_EMAIL": "verl-sat@users.noreply.github.com",
        "GIT_COMMITTER_NAME": "verl-sat",
        "GIT_COMMITTER_EMAIL": "verl-sat@users.noreply.github.com",
    }
    proc = subprocess.run(["git", *args], cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"git {' '.join(args)} in {tree} failed:\n{proc.stdout}{proc.stderr}")
    return proc.stdout


def wheel_repo_files(site: Path) -> list[str]:
    """The files verl's wheel installed under ``tests/`` and ``scripts/`` (its RECORD), without byte code."""
    record = next(site.glob("verl-*.dist-info/RECORD"))
    paths = [line.split(",")[0] for line in record.read_text().splitlines()]
    return [p for p in paths if p.split("/")[0] in ("tests", "scripts") and "__pycache__" not in p]


def stand_up_checkout(verl_repo: Path, recipe_repo: Path, dest: Path, patches: list[Path]) -> Path:
    """A verl 0.9.1 checkout at ``dest``: ``verl_repo``'s files (no ``.git``), the wheel's ``verl/`` and its
    ``tests/`` and ``scripts/`` files over them, committed and named ``origin/main``, with ``recipe_repo`` as its
    ``recipe/`` submodule (untracked, as a submodule's files are to the parent); then ``patches`` applied with
    ``git am`` as commits of the branch ``pr``."""
    site = verl_site_root()
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(verl_repo, dest, ignore=shutil.ignore_patterns(".git"))
    for path in [dest, *dest.rglob("*")]:  # the snapshot may be read-only
        path.chmod(path.stat().st_mode | 0o200)
    shutil.rmtree(dest / "verl", ignore_errors=True)
    shutil.copytree(site / "verl", dest / "verl", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for path in wheel_repo_files(site):
        (dest / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(site / path, dest / path)
    shutil.rmtree(dest / "recipe", ignore_errors=True)
    shutil.copytree(recipe_repo, dest / "recipe", ignore=shutil.ignore_patterns(".git"))
    for path in [dest, *dest.rglob("*")]:  # the snapshots may be read-only
        path.chmod(path.stat().st_mode | 0o200)
    _git(dest, "init", "-q", "-b", "main")
    with (dest / ".git" / "info" / "exclude").open("a") as exclude:
        exclude.write("/recipe/\n")
    _git(dest, "add", "-A")
    _git(dest, "commit", "-q", "--no-verify", "-m", "verl 0.9.1")
    _git(dest, "update-ref", "refs/remotes/origin/main", "HEAD")
    _git(dest, "checkout", "-q", "-b", "pr")
    if patches:
        _git(dest, "am", "-q", "--keep-non-patch", *map(str, patches))
    return dest


# ---- the checks ---------------------------------------------------------------------------------------------------


def _run(command: list[str] | str, cwd: Path, env: dict[str, str], timeout: int = 1800) -> tuple[bool, str, float]:
    start = time.monotonic()
    shell = isinstance(command, str)
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, shell=shell,
                          executable="/bin/bash" if shell else None)  # fmt: skip
    return proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:], time.monotonic() - start


def _check_env(envs: Environments, tree: Path, extra: dict[str, str]) -> dict[str, str]:
    """A check's environment: the checkout importable as ``pip install --no-deps -e .`` makes it, verl-sat's plugin
    blocked, ``extra``'s variables set (its ``PATH``, a folder whose ``python3`` the check runs, goes in front)."""
    path = os.environ.get("PATH", "/usr/bin:/bin")
    if "PATH" in extra:
        path = f"{extra['PATH']}{os.pathsep}{path}"
    return {**os.environ, **extra, "PATH": path, "PYTHONPATH": f"{tree}{os.pathsep}{envs.block}",
            "VERL_USE_EXTERNAL_PLUGINS": "none", "PYTHONDONTWRITEBYTECODE": "1"}  # fmt: skip


def local_hooks(tree: Path) -> list[tuple[str, str]]:
    """``(id, entry)`` of each local hook of the checkout's ``.pre-commit-config.yaml``."""
    config = yaml.safe_load((tree / ".pre-commit-config.yaml").read_text())
    local = [repo for repo in config["repos"] if repo["repo"] == "local"]
    return [(hook["id"], hook["entry"]) for repo in local for hook in repo["hooks"]]


def pr_event(tree: Path, title: str, body: str, out: Path) -> dict[str, str]:
    """``check-pr-title.yml``'s environment: the title, and a GitHub event file with the body."""
    event = out / "event.json"
    event.write_text(json.dumps({"pull_request": {"title": title, "body": body}}))
    return {"PR_TITLE": title, "GITHUB_EVENT_PATH": str(event), "GITHUB_WORKSPACE": str(tree)}


def verl_checks(
    tree: Path, envs: Environments, title: str, body: str, out: Path, narrow: bool
) -> list[tuple[str, str, object, dict]]:
    """``(check, where verl defines it, command, extra env)`` for every offline check of verl's CI; ``narrow`` runs the
    hooks of ``PER_CHANGED_FOLDER`` on the folders the patch set changes."""
    tools_bin = envs.verl_tools / "bin"
    site_bin = Path(envs.site_python).parent
    # pre-commit hands each hook the tracked files of its types (ruff: python, pyi, jupyter, less the hook's
    # `exclude: ^.*\.(ipynb)$`; mypy: python, pyi)
    py_files = _git(tree, "ls-files", "*.py", "*.pyi").split()
    checks: list[tuple[str, str, object, dict]] = [
        (
            "ruff",
            ".pre-commit-config.yaml",
            [envs.tool("ruff"), "check", "--force-exclude", "--output-format=full", *py_files],
            {},
        ),  # fmt: skip
        (
            "ruff-format",
            ".pre-commit-config.yaml",
            [envs.tool("ruff"), "format", "--force-exclude", "--check", *py_files],
            {},
        ),  # fmt: skip
        ("mypy", ".pre-commit-config.yaml", [envs.tool("mypy"), *MYPY_HOOK_ARGS, *py_files], {}),
    ]
    diff = _git(tree, "diff", "--name-only", "origin/main...HEAD", "--", "verl").split()
    changed = {str(Path(path).parent) for path in diff}
    for hook, entry in local_hooks(tree):
        # language: python hooks run in pre-commit's venv (no extra dependencies: the tools venv's python);
        # autogen-trainer-cfg composes verl's configs with hydra, as pre-commit.yml installs it
        if hook in PER_CHANGED_FOLDER and narrow:
            flag = PER_CHANGED_FOLDER[hook]
            head = entry.split(f" {flag}")[0]
            entry = " && ".join(f"{head} {flag} {shlex.quote(folder)}" for folder in sorted(changed)) or "true"
            hook += " (changed folders)"
        checks.append((hook, ".pre-commit-config.yaml (local)", entry, {"PATH": str(tools_bin)}))
    site = {"PATH": str(site_bin)}
    checks += [
        (
            "special_sanity",
            "sanity.yml",
            [
                envs.site_python,
                "-m",
                "pytest",
                "-s",
                "-x",
                "-q",
                "-p",
                "no:cacheprovider",
                "-c",
                "pyproject.toml",
                "tests/special_sanity",
            ],
            site,
        ),  # fmt: skip
        (
            "validate_imported_docs",
            "sanity.yml",
            [envs.site_python, "tests/special_sanity/validate_imported_docs.py"],
            site,
        ),  # fmt: skip
        ("sphinx", "doc.yml", SPHINX, {"PATH": str(tools_bin)}),
        (
            "type_coverage",
            "type-coverage-check.yml",
            [envs.site_python, "tests/special_sanity/type_coverage_check.py"],
            site,
        ),  # fmt: skip
        (
            "api_docs",
            "type-coverage-check.yml",
            [envs.site_python, "tests/special_sanity/check_api_docs.py", "verl"],
            {**site, "UPSTREAM_CHECK_BLOCK": API_DOCS_BLOCK},
        ),  # fmt: skip
    ]
    event = pr_event(tree, title, body, out)
    checks += [
        ("pr_title", "check-pr-title.yml", [envs.site_python, "tests/special_sanity/check_pr_title.py"], event),
        (
            "pr_description",
            "check-pr-title.yml",
            [envs.site_python, "tests/special_sanity/check_pr_description.py"],
            event,
        ),  # fmt: skip
    ]
    return checks


def run_verl_checks(name: str, tree: Path, envs: Environments, title: str, body: str, out: Path) -> list[Result]:
    results = []
    for check, source, command, extra in verl_checks(tree, envs, title, body, out, narrow=name != BASELINE):
        passed, tail, seconds = _run(command, tree, _check_env(envs, tree, extra))
        shown = command if isinstance(command, str) else shlex.join(command[:6]) + (" ..." if len(command) > 6 else "")
        results.append(Result(name, check, source, shown, passed, round(seconds, 1), "" if passed else tail))
        print(f"  {name:>14} {check:<26} {'pass' if passed else 'FAIL'} ({seconds:.0f} s)", flush=True)
    return results


def run_recipe_checks(recipe_repo: Path, sat_dir: Path, envs: Environments, work: Path) -> list[Result]:
    """verl-recipe's pre-commit (ruff, ruff-format at its pin, with its pyproject) on ``sat/`` laid into a copy."""
    checkout = work / "verl-recipe"
    shutil.rmtree(checkout, ignore_errors=True)
    shutil.copytree(recipe_repo, checkout, ignore=shutil.ignore_patterns(".git"))
    for path in checkout.rglob("*"):
        path.chmod(path.stat().st_mode | 0o200)
    shutil.copytree(sat_dir, checkout / RECIPE)
    ruff = str(envs.recipe_tools / "bin" / "ruff")
    results = []
    for check, command in (("ruff", [ruff, "check", "--output-format=full", RECIPE]),
                           ("ruff-format", [ruff, "format", "--check", RECIPE])):  # fmt: skip
        passed, tail, seconds = _run(command, checkout, dict(os.environ))
        results.append(Result("verl-recipe sat/", check, ".pre-commit-config.yaml", shlex.join(command), passed,
                              round(seconds, 1), "" if passed else tail))  # fmt: skip
        print(f"  {'verl-recipe':>14} {check:<26} {'pass' if passed else 'FAIL'} ({seconds:.0f} s)", flush=True)
    return results


def patch_sets(upstream: Path) -> list[tuple[str, list[Path], str, str]]:
    """``(name, patches, PR title, PR body)``: unpatched verl 0.9.1 (``BASELINE``), the whole series with ``PR.md``,
    and each patch after the first alone
    (``PR.md`` says each can go as its own pull request), as ``write_upstream`` generates it on its own, with its
    subject and commit message."""
    patches = sorted((upstream / VERL_DIR).glob("*.patch"))
    if len(patches) != len(PATCHES):
        raise SystemExit(f"{upstream / VERL_DIR} holds {len(patches)} patches, the series has {len(PATCHES)}")
    head, _, rest = (upstream / VERL_DIR / "PR.md").read_text().partition("\n")
    title, body = head.removeprefix("# ").strip(), rest.lstrip("\n")
    sets = [(BASELINE, [], title, body), ("series", patches, title, body)]
    for number, spec in enumerate(PATCHES[1:], start=2):
        alone = sorted((upstream / VERL_DIR / ALONE / str(number)).glob("*.patch"))
        body = f"### What does this PR do?\n\n{spec.body}\n"
        sets.append((f"patch {number} alone", alone, spec.subject, body))
    return sets


def markdown_table(results: list[Result]) -> str:
    lines = ["| patch set | check | defined in | result | seconds | command |", "|---|---|---|---|---|---|"]
    for r in results:
        verdict = "pass" if r.passed else "**FAIL**"
        if not r.passed and r.patch_set == BASELINE and r.check in PER_CHANGED_FOLDER:
            verdict = "fails on the stand-in (expected; run on the changed folders of each patch set)"
        command = r.command.replace("|", "\\|")
        if len(command) > 90:
            command = command[:87] + "..."
        lines.append(f"| {r.patch_set} | {r.check} | {r.source} | {verdict} | "
                     f"{r.seconds} | `{command}` |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl_sat.upstream.ci_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--verl-repo", type=Path, required=True, help="a verl repository checkout (or its snapshot)")
    parser.add_argument("--recipe-repo", type=Path, required=True, help="a verl-recipe checkout (or its snapshot)")
    parser.add_argument("--tools", type=Path, default=Path("build/upstream-tools"), help="the tools' venvs")
    parser.add_argument("--out", type=Path, default=Path("verl_sat_work/upstream-check"), help="report and trees")
    parser.add_argument("--only", default="", help="comma-separated patch sets to run (default: all)")
    args = parser.parse_args(argv)
    for flag, path in (("--verl-repo", args.verl_repo), ("--recipe-repo", args.recipe_repo)):
        if not (path / ".pre-commit-config.yaml").is_file():
            parser.error(f"{flag} {path}: no .pre-commit-config.yaml there (not a checkout of that repository)")
    check_pins(args.verl_repo, args.recipe_repo)
    out = args.out.resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    print("tools: verl's pinned linters and Sphinx, verl-recipe's ruff (own venvs under --tools)", flush=True)
    envs = Environments(
        verl_tools=make_tool_env(
            args.tools.resolve() / "verl", VERL_TOOLS, (args.verl_repo.resolve() / "docs" / "requirements-docs.txt",)
        ),  # fmt: skip
        recipe_tools=make_tool_env(args.tools.resolve() / "verl-recipe", RECIPE_TOOLS),
        block=out / "block",
    )
    envs.block.mkdir()
    (envs.block / "sitecustomize.py").write_text(BLOCK_PLUGIN)
    upstream = out / "upstream"
    write_upstream(upstream, verl_repo=args.verl_repo.resolve())
    results: list[Result] = []
    wanted = {name.strip() for name in args.only.split(",") if name.strip()}
    for name, patches, title, body in patch_sets(upstream):
        if wanted and name not in wanted:
            continue
        print(f"{name}: {', '.join(p.name for p in patches)}", flush=True)
        tree = stand_up_checkout(args.verl_repo.resolve(), args.recipe_repo.resolve(),
                                 out / name.replace(" ", "_") / "verl", patches)  # fmt: skip
        results += run_verl_checks(name, tree, envs, title, body, tree.parent)
    results += run_recipe_checks(args.recipe_repo.resolve(), upstream / RECIPE_DIR / RECIPE, envs, out)
    (out / "report.json").write_text(json.dumps([r.__dict__ for r in results], indent=1))
    (out / "report.md").write_text(markdown_table(results))
    # on the unpatched stand-in, only the hooks known to predate 0.9.1's package may fail (run narrowed elsewhere)
    expected = [r for r in results if not r.passed and r.patch_set == BASELINE and r.check in PER_CHANGED_FOLDER]
    failed = [r for r in results if not r.passed and r not in expected]
    for r in failed:
        print(f"\n==== {r.patch_set}: {r.check} ({r.source}) failed: {r.command}\n{r.tail}", flush=True)
    passed = len(results) - len(failed) - len(expected)
    print(f"\n{passed} passed, {len(failed)} failed, {len(expected)} failing on unpatched {BASELINE} as expected "
          f"(table: {out / 'report.md'})", flush=True)  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
