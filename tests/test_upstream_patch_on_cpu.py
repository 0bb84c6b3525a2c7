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
"""``verl-sat upstream``: the patch series applies to verl 0.9.1's installed source, and in that patched copy, in a
fresh interpreter where verl-sat cannot be imported, the SAT loss tests, the FSDP routing-replay tests, the logging
tests of the two fixes and verl's own policy-loss tests pass; the series is byte-for-byte deterministic; the patched
Python is formatted and lint-clean; a verl that moved the edited code makes generation fail, naming the file."""

import ast
import email
import email.policy
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import git_apply, verl_copy, without_verl_sat
from omegaconf import OmegaConf

from verl_sat.preflight import check_sizes
from verl_sat.upstream import LOGGING_TEST, PATCHES, R3_TEST, ROLLOUT_LOGGING_TEST, SAT_TEST, VERL_DIR, write_upstream
from verl_sat.upstream.edit import UpstreamDriftError
from verl_sat.upstream.examples import SCRIPTS
from verl_sat.upstream.generated_configs import CONFIG_DIR, GENERATED, regenerate
from verl_sat.upstream.pr_text import UPSTREAM_TESTS
from verl_sat.upstream.rollout_fix_patch import FIXED_CALL, FLUSH_CALL, HTTP_SERVER_ENGINE
from verl_sat.upstream.sat_patch import CORE_ALGOS, key_mapping, sat_changes
from verl_sat.upstream.series import verl_site_root
from verl_sat.upstream.trainer_fix_patch import SEPARATE_ASYNC

REPO = Path(__file__).resolve().parent.parent


def _patched_python(tree: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = without_verl_sat(tmp_path / "block", tree)
    return subprocess.run([sys.executable, *args], cwd=tree, env=env, capture_output=True, text=True, timeout=900)


def test_generated_trainer_configs_are_reproduced_from_verls_config_tree(tmp_path):
    """The regeneration the series relies on gives verl 0.9.1's shipped ``_generated_*.yaml`` byte for byte."""
    site = verl_site_root()
    shutil.copytree(site / CONFIG_DIR, tmp_path / CONFIG_DIR, ignore=shutil.ignore_patterns("__pycache__"))
    regenerated = regenerate(tmp_path)
    assert sorted(regenerated) == sorted(f"{CONFIG_DIR}/{name}" for name in GENERATED)
    for path, text in regenerated.items():
        assert text == (site / path).read_text(), path


def test_series_has_four_patches_and_a_pr_text(series):
    out, patches, _ = series
    assert [p.name[:5] for p in patches] == ["0001-", "0002-", "0003-", "0004-"]
    texts = [p.read_text() for p in patches]
    # git folds a long Subject header over two lines; the e-mail parser unfolds it as git am does
    subjects = [email.message_from_string(text, policy=email.policy.default)["Subject"] for text in texts]
    assert subjects == [f"[PATCH {i}/4] {patch.subject}" for i, patch in enumerate(PATCHES, 1)]
    assert [patch.subject.split(":")[0] for patch in PATCHES] == [
        "[algo] feat",
        "[fsdp] feat",
        "[trainer] fix",
        "[rollout] fix",
    ]
    for path in (SEPARATE_ASYNC, LOGGING_TEST):
        assert f"diff --git a/{path} b/{path}" in texts[2], path
    assert "-                flush=True,\n" in texts[2]
    for path in (HTTP_SERVER_ENGINE, ROLLOUT_LOGGING_TEST):
        assert f"diff --git a/{path} b/{path}" in texts[3], path
    assert re.findall(r"^diff --git a/(\S+)", texts[3], re.M) == [ROLLOUT_LOGGING_TEST, HTTP_SERVER_ENGINE]
    assert f"-        {FLUSH_CALL}+        {FIXED_CALL}" in texts[3]
    for path in (
        "verl/trainer/ppo/sat_math.py",
        "verl/trainer/ppo/sat_inert.py",
        "verl/trainer/ppo/core_algos.py",
        "verl/workers/config/actor.py",
        "verl/trainer/config/actor/actor.yaml",
        "docs/algo/sat.md",
        SAT_TEST,
        *(f"{CONFIG_DIR}/{name}" for name in GENERATED),
        *(target for target, _ in SCRIPTS.values()),
    ):
        assert f"diff --git a/{path} b/{path}" in texts[0], path  # fmt: skip
    for path in (
        "verl/workers/engine/fsdp/transformer_impl.py",
        "verl/trainer/config/engine/fsdp.yaml",
        "verl/workers/config/actor.py",
        "verl/models/transformers/router_replay.py",
        R3_TEST,
    ):
        assert f"diff --git a/{path} b/{path}" in texts[1], path  # fmt: skip
    pr = (out / VERL_DIR / "PR.md").read_text()
    assert pr.startswith("# [algo] feat: SAT")
    assert "The series has 4 patches" in pr and f"4. `{patches[3].name}`: {PATCHES[3].subject}" in pr
    assert "git am --keep-non-patch 0001-*.patch 0002-*.patch 0003-*.patch 0004-*.patch" in pr
    assert ROLLOUT_LOGGING_TEST in pr
    for plugin_key, verl_key in key_mapping():
        assert f"| `{plugin_key}` | `{verl_key}` |" in pr
    assert "| SAT-GSPO w/ R3 | 35.83 | 34.79 |" in pr  # the paper's Table 1
    assert "verl-sat sweep --workdir W --name table1" in pr  # the command behind our numbers
    # the paired row with its p-value and its Holm-adjusted p
    assert re.search(r"\| sat_gspo \| gspo \| lag8 \| 3 \| [+-]\d+\.\d \(0\.\d{3}, [01]\.\d{3}\)", pr)


def test_patched_verl_passes_sat_r3_and_verls_tests_without_the_plugin(series, patched_report, tmp_path):
    _, _, tree = series
    assert patched_report["blocked"]  # verl-sat is not importable there
    assert patched_report["verl"] == str(tree / "verl" / "__init__.py")
    assert patched_report["losses"] == ["verl.trainer.ppo.core_algos"] * 2
    run = _patched_python(tree, tmp_path, "-m", "pytest", "-q", "-p", "no:cacheprovider", *UPSTREAM_TESTS)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    summary = run.stdout.strip().splitlines()[-1]  # e.g. "37 passed, 5 warnings in 5.40s"
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed[1]) >= 30 and not re.search(r"failed|error|skipped", summary), summary


PLUGIN_ON_PATCHED_VERL = """
import json
import verl  # loads verl-sat's plugin entry point
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
import verl_sat.losses
from verl_sat.config import SatPolicyLossConfig
config = SatPolicyLossConfig(loss_mode="sat_gspo", sat={"quantile": 0.8, "granularity": "token"})
print(json.dumps({"verl": verl.__file__, "plugin": "verl_sat.plugin" in __import__("sys").modules,
                  "losses": [POLICY_LOSS_REGISTRY[name].__module__ for name in ("sat", "sat_gspo")],
                  "flat": [config.sat_quantile, config.sat_granularity]}))
"""


def test_plugin_never_shadows_verls_own_sat_losses(series, tmp_path):
    """With verl-sat installed next to a verl that ships SAT (the core series applied): verl's registered losses stay
    (the plugin recognises them by their module), the plugin says so once, and its nested ``sat`` keys set verl's flat
    ``sat_*`` keys, which verl's losses read. On verl 0.9.1 (this interpreter) the plugin's losses are registered."""
    _, _, tree = series
    env = {**os.environ, "PYTHONPATH": str(tree)}
    run = subprocess.run([sys.executable, "-c", PLUGIN_ON_PATCHED_VERL], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.splitlines()[-1])
    assert report["verl"] == str(tree / "verl" / "__init__.py") and report["plugin"]
    assert report["losses"] == ["verl.trainer.ppo.core_algos"] * 2
    assert report["flat"] == [0.8, "token"]
    assert run.stderr.count("verl registers its own SAT policy losses") == 1, run.stderr[-3000:]
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    from verl_sat.verl_own_losses import verl_own

    assert [POLICY_LOSS_REGISTRY[name].__module__ for name in ("sat", "sat_gspo")] == ["verl_sat.losses"] * 2
    assert verl_own() == {}


def test_example_overrides_are_keys_of_the_patched_config(series, tmp_path):
    """Every `key=value` of the generated examples composes against the patched verl config without a `+`."""
    _, _, tree = series
    checks = []
    for target, _ in SCRIPTS.values():
        script = (tree / target).read_text()
        assert "verl_sat" not in script and "verl-sat recipes" not in script
        syntax = subprocess.run(["bash", "-n", str(tree / target)], capture_output=True, text=True)
        assert syntax.returncode == 0, syntax.stderr
        launch = re.search(r"python3 -m verl\.trainer\.main_ppo(.*?) \\\n(.*?)\n  \"\$@\"", script, re.S)
        config_name = (
            (launch[1].split("--config-name")[1].split() or ["ppo_trainer"])[0] if launch[1] else "ppo_trainer"
        )
        keys = re.findall(r"(?:^|\s)([a-z_][\w.]*)=", launch[2], re.M)
        assert "actor_rollout_ref.actor.policy_loss.loss_mode" in keys
        checks.append((config_name, keys))
    code = (
        "import os, sys, verl\nfrom hydra import compose, initialize_config_dir\n"
        "config_dir = os.path.join(os.path.dirname(verl.__file__), 'trainer', 'config')\n"
        f"for name, keys in {checks!r}:\n"
        "    overrides = [k + '=' + ('[0.9,0.98]' if k.endswith('betas') else '1') for k in keys\n"
        "                 if not k.endswith(('loss_mode', 'sat_kernel', 'sat_quantile_method', 'sat_granularity',\n"
        "                                    'trainer_mode', 'adv_estimator', 'backend', 'loss_agg_mode', 'mode'))]\n"
        "    with initialize_config_dir(config_dir=config_dir, version_base=None):\n"
        "        cfg = compose(config_name=name, overrides=overrides)\n"
        "    print(name, cfg.actor_rollout_ref.actor.policy_loss.sat_quantile)\n"
    )
    run = _patched_python(tree, tmp_path, "-c", code)
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(run.stdout.splitlines()) == len(SCRIPTS)


def test_generated_examples_pass_the_size_checks(series, tmp_path):
    """Each generated example at paper lag 1 and 8, run with ``--cfg job`` by verl's own entry point in the patched
    tree (no verl-sat), composes a config whose token budgets, parallel sizes and batch split pass verl-sat's size
    checks (the four runs two at a time)."""
    _, _, tree = series
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (tmp_path / "bin" / "python3").chmod(0o755)
    env = {**without_verl_sat(tmp_path / "block", tree), "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"}

    def run(case):
        target, lag = case
        return case, subprocess.run(["bash", str(tree / target), "--cfg", "job"], cwd=tree, env={**env, "LAG": lag},
                                    capture_output=True, text=True, timeout=600)  # fmt: skip

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(run, [(target, lag) for target, _ in SCRIPTS.values() for lag in ("1", "8")]))
    for case, proc in results:
        assert proc.returncode == 0, f"{case}: {proc.stderr[-3000:]}"
        check_sizes(OmegaConf.create(proc.stdout))


def test_patched_python_is_formatted_and_lint_clean(series):
    _, patches, tree = series
    changed = sorted({path for p in patches for path in re.findall(r"^\+\+\+ b/(\S+\.py)$", p.read_text(), re.M)})
    assert "verl/workers/engine/fsdp/transformer_impl.py" in changed
    files = [str(tree / path) for path in changed]
    ruff = [sys.executable, "-m", "ruff"]
    fmt = subprocess.run([*ruff, "format", "--isolated", "--line-length", "120", "--check", *files],
                         capture_output=True, text=True)  # fmt: skip
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr
    lint = subprocess.run([*ruff, "check", "--isolated", "--line-length", "120", "--select", "F,E9,E501", *files],
                          capture_output=True, text=True)  # fmt: skip
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_generation_is_deterministic(series, tmp_path):
    """Both contributions, file by file: the same source gives the same bytes (and the CLI wrote nothing else)."""
    out, _, _ = series
    again = tmp_path / "again"
    written = write_upstream(again)
    assert sorted(p.relative_to(again) for p in written) == sorted(
        p.relative_to(out) for p in out.rglob("*") if p.is_file()
    )
    for path in written:
        assert path.read_bytes() == (out / path.relative_to(again)).read_bytes(), path


@pytest.mark.parametrize("index", [1, 2, 3])  # routing replay, the trainer fix, the rollout fix
def test_later_patches_apply_alone_to_verl_0_9_1(series, tmp_path, index):
    _, patches, _ = series
    check = git_apply(verl_copy(tmp_path), "--check", str(patches[index]))
    assert check.returncode == 0, check.stderr


def test_a_verl_that_moved_the_code_fails_generation_naming_the_file():
    site = verl_site_root()

    def read(path):
        text = (site / path).read_text()
        return (
            text.replace('@register_policy_loss("sapo")', '@register_policy_loss("sapo_v2")')
            if path == CORE_ALGOS
            else text
        )

    with pytest.raises(UpstreamDriftError, match=r"verl/trainer/ppo/core_algos\.py: expected exactly one occurrence"):
        sat_changes(read)


def test_series_patches_are_the_four_documented():
    assert [p.subject.split("]")[0] for p in PATCHES] == ["[algo", "[fsdp", "[trainer", "[rollout"]


def test_logging_fix_tests_fail_on_unpatched_verl(tmp_path):
    """Each logging patch's test is pinned: on verl 0.9.1 as installed it finds the call its patch fixes (the
    rollout's file imports sglang, which is not installed here: the test only parses it). Both run at the same time."""
    cases = [(LOGGING_TEST, "trainer/ppo/v1/trainer_separate_async.py:181"),
             (ROLLOUT_LOGGING_TEST, "rollout/sglang_rollout/http_server_engine.py:144")]  # fmt: skip

    def run(template):
        (tmp_path / Path(template).stem).mkdir()
        test = tmp_path / Path(template).stem / Path(template).name
        shutil.copy(REPO / "verl_sat/upstream/templates" / test.name, test)
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)],
                              capture_output=True, text=True, cwd=test.parent)  # fmt: skip

    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = list(pool.map(run, [template for template, _ in cases]))
    for (template, found), proc in zip(cases, runs, strict=True):
        assert proc.returncode == 1, f"{template}: {proc.stdout[-2000:]}"
        assert "1 failed, 1 passed" in proc.stdout and found in proc.stdout


def test_the_two_logging_tests_share_the_scanner():
    """The trainer's and the rollout's logging tests go in separate patches, each applying alone, so each carries the
    scanner; it is the same code in both."""

    def shared(name):
        tree = ast.parse((REPO / "verl_sat/upstream/templates" / Path(name).name).read_text())
        return [ast.dump(n) for n in tree.body if not isinstance(n, ast.Expr) and "test_" not in getattr(n, "name", "")]

    assert shared(LOGGING_TEST) == shared(ROLLOUT_LOGGING_TEST)
    assert any("logging_calls_with_print_keywords" in node for node in shared(LOGGING_TEST))
