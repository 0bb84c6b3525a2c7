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
"""``verl-sat upstream``'s verl-recipe contribution, tried as a maintainer would: ``sat/`` laid into a copy of
verl-recipe (``conftest.VERL_RECIPE``), whose installer's dry run pins verl 0.9.1 and whose ruff configuration passes;
and, from a folder laid out like a verl checkout (``verl/`` beside ``recipe/``), in an interpreter where verl-sat
cannot be imported, ``python -m recipe.sat.main ... --cfg job`` composes and passes the same checks as
``python -m verl_sat.main`` on all three trainers with the recipe's fallback on verl 0.9.1, and takes verl's own losses,
keys and FSDP routing replay once the core series is applied to verl (``conftest.series``)."""

import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import VERL_RECIPE, run_recipe, without_verl_sat
from omegaconf import OmegaConf

import verl_sat.main
from verl_sat.main import compose_job, with_recipes_searchpath
from verl_sat.preflight import check_config, check_sizes, check_trainer_startup
from verl_sat.upstream.edit import UpstreamDriftError
from verl_sat.upstream.recipe_code import module_copy
from verl_sat.upstream.recipe_configs import flat_sat_keys
from verl_sat.upstream.recipe_names import PACKAGE, RECIPE, renamed
from verl_sat.upstream.recipe_readme import REVIEW_RUNS
from verl_sat.upstream.series import VERL_VERSION, verl_site_root

WARNING = f"{PACKAGE}: warning: "
BAD_QUANTILE = ("+recipe=sat_gspo", "+lag=lag1", "actor_rollout_ref.actor.policy_loss.sat_quantile=2")
BAD_FULLY_ASYNC_BATCH = (*REVIEW_RUNS["fully_async"][:2], "data.train_batch_size=64", *REVIEW_RUNS["fully_async"][3:])


def _plugin_warnings(args: tuple[str, ...]) -> list[str]:
    """What ``python -m verl_sat.main`` warns for the same job."""
    _, config = compose_job(with_recipes_searchpath(list(args)))
    warnings = check_config(config)
    check_sizes(config)
    return [*warnings, *check_trainer_startup(config)]


@pytest.mark.skipif(not (VERL_RECIPE / "install_verl.sh").is_file(), reason=f"no verl-recipe copy at {VERL_RECIPE}")
def test_installer_pins_verl_0_9_1_and_verl_recipes_ruff_passes(series):
    _, _, tree = series
    repo = tree / "recipe"
    show = subprocess.run(["bash", "install_verl.sh", "--recipe", RECIPE, "--show"], cwd=repo,
                          env={**os.environ, "PIP": "pip"}, capture_output=True, text=True)  # fmt: skip
    assert show.returncode == 0, show.stderr
    assert "[install_verl] MODE:     pinned_tag" in show.stderr
    assert f"[install_verl] pip line: pip install verl=={VERL_VERSION}" in show.stderr
    assert f"[install_verl] + pip install verl=={VERL_VERSION}" in show.stderr
    listed = subprocess.run(["bash", "install_verl.sh", "--list"], cwd=repo, capture_output=True, text=True)
    assert any(line.split()[:1] == [RECIPE] and f"verl=={VERL_VERSION}" in line for line in listed.stdout.splitlines())
    assert "line-length = 120" in (repo / "pyproject.toml").read_text()  # verl-recipe's configuration, found from cwd
    ruff = [sys.executable, "-m", "ruff"]
    lint = subprocess.run([*ruff, "check", "--no-cache", RECIPE], cwd=repo, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = subprocess.run([*ruff, "format", "--no-cache", "--check", RECIPE], cwd=repo, capture_output=True, text=True)
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_recipe_composes_and_passes_the_checks_on_verl_0_9_1_without_verl_sat(series, tmp_path):
    """Each trainer the pull request's reviewer runs composes and passes the checks on verl 0.9.1 with the recipe's
    fallback (its losses registered, its FSDP engine installed by an R3 config); the warnings are the plugin's for the
    same job; a bad SAT key and a fully-async batch are refused."""
    _, _, tree = series
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "verl").symlink_to(verl_site_root() / "verl")  # verl 0.9.1 as installed
    (checkout / "recipe").symlink_to(tree / "recipe")
    report = run_recipe(checkout, without_verl_sat(tmp_path / "block"), *REVIEW_RUNS.values(), BAD_QUANTILE,
                        BAD_FULLY_ASYNC_BATCH)  # fmt: skip
    assert report["blocked"] and report["verl"] == str(checkout / "verl" / "__init__.py")
    assert report["losses"] == [f"{PACKAGE}.fallback.losses"] * 2
    assert report["classes"] == [f"{PACKAGE}.fallback.config.SatPolicyLossConfig",
                                 f"{PACKAGE}.fallback.config.FSDPRouterReplayConfig"]  # fmt: skip
    assert report["fsdp_engine_with_r3"] == f"{PACKAGE}.fallback.fsdp_engine.RoutingReplayFSDPEngine"
    *trainer_runs, bad_quantile, bad_batch = report["runs"]
    for (trainer, args), run in zip(REVIEW_RUNS.items(), trainer_runs, strict=True):
        assert run["code"] == 0, f"{trainer}: {run['code']}\n{run['stderr'][-3000:]}"
        printed = OmegaConf.create(run["stdout"])
        actor = printed.actor_rollout_ref.actor
        assert actor.policy_loss.loss_mode == "sat_gspo" and actor.policy_loss.sat_granularity == "sequence"
        assert actor.policy_loss._target_ == f"{PACKAGE}.compat.SatPolicyLossConfig" and "sat" not in actor.policy_loss
        assert actor.fsdp_config.router_replay._target_ == f"{PACKAGE}.compat.FSDPRouterReplayConfig"
        assert actor.fsdp_config.router_replay.mode == "R3" and actor.ppo_epochs == 1
        if trainer == "fully_async":
            assert printed.async_training.trigger_parameter_sync_step == 8 and actor.ppo_mini_batch_size == 16
        else:  # the lag preset's mini-batch, pinned for verl's Ray processes: 64 prompts in 8 optimizer steps
            assert actor.ppo_mini_batch_size == 8 and printed.trainer.v1.trainer_mode == trainer
        warned = [line.removeprefix(WARNING) for line in run["stderr"].splitlines() if line.startswith(WARNING)]
        assert warned == _plugin_warnings(args), trainer
    assert f"{PACKAGE}: actor_rollout_ref.actor.policy_loss does not build: " in bad_quantile["code"]
    assert "actor_rollout_ref.actor.policy_loss.sat_quantile=2 is invalid" in bad_quantile["code"]
    assert bad_batch["code"].startswith(f"{PACKAGE}: data.train_batch_size=64: verl's fully-async trainer asserts 0")


def test_recipe_uses_verls_own_losses_with_the_core_series(series, patched_report):
    """In verl 0.9.1's tree with the core series applied, the recipe takes verl's losses, keys and FSDP routing replay
    (verl's own engine class stays registered under R3) and never imports its fallback."""
    _, _, tree = series
    assert patched_report["blocked"] and patched_report["verl"] == str(tree / "verl" / "__init__.py")
    assert patched_report["losses"] == ["verl.trainer.ppo.core_algos"] * 2
    assert patched_report["classes"] == ["verl.workers.config.actor.PolicyLossConfig",
                                         "verl.workers.config.engine.EngineRouterReplayConfig"]  # fmt: skip
    assert patched_report["fsdp_engine_with_r3"] == "verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead"
    assert patched_report["fallback_loaded"] == []
    (run,) = patched_report["runs"]
    assert run["code"] == 0, run["stderr"][-3000:]
    policy_loss = OmegaConf.create(run["stdout"]).actor_rollout_ref.actor.policy_loss
    assert policy_loss._target_ == f"{PACKAGE}.compat.SatPolicyLossConfig" and policy_loss.sat_quantile == 0.9


def test_recipe_recognises_verls_losses_by_where_they_come_from(series, tmp_path):
    """A verl whose core series named its helpers otherwise (``SAT_KEY_FORMAT`` and ``sat_params_of`` renamed all
    through the package): the recipe still sees verl's registered ``sat`` / ``sat_gspo`` come from verl's package, keeps
    them, never imports its fallback losses, says so once, and composes."""
    _, _, tree = series
    renamed_tree = tmp_path / "verl-renamed"
    shutil.copytree(tree, renamed_tree, ignore=shutil.ignore_patterns("__pycache__", ".git"))
    helpers = re.compile(r"\b(SAT_KEY_FORMAT|sat_params_of)\b")
    touched = []
    for path in (renamed_tree / "verl").rglob("*.py"):
        text = path.read_text()
        if helpers.search(text):
            path.write_text(helpers.sub(lambda m: f"{m[1]}_v2", text))
            touched.append(path.relative_to(renamed_tree).as_posix())
    assert "verl/workers/config/actor.py" in touched and "verl/trainer/ppo/core_algos.py" in touched
    report = run_recipe(renamed_tree, without_verl_sat(tmp_path / "block", renamed_tree), REVIEW_RUNS["separate_async"])
    assert report["losses"] == ["verl.trainer.ppo.core_algos"] * 2
    assert f"{PACKAGE}.fallback.losses" not in report["fallback_loaded"]
    (run,) = report["runs"]
    assert run["code"] == 0, run["stderr"][-3000:]
    said = "verl registers its own SAT policy losses (sat: verl.trainer.ppo.core_algos.compute_policy_loss_sat"
    assert run["stderr"].count(said) == 1, run["stderr"][-3000:]
    policy_loss = OmegaConf.create(run["stdout"]).actor_rollout_ref.actor.policy_loss
    assert policy_loss.sat_quantile == 0.9


def test_what_the_recipe_cannot_carry_stops_generation_naming_the_file():
    """A plugin-only reference left in a recipe file, a plugin line the recipe's main no longer finds, and a nested SAT
    key that is not a SAT hyperparameter each stop generation with the file named."""
    with pytest.raises(UpstreamDriftError, match=r"recipes/lag/lag8\.yaml still names \['docs/results\.md'\]"):
        renamed("# see docs/results.md\n", "recipes/lag/lag8.yaml")
    with pytest.raises(UpstreamDriftError, match=r"verl_sat\.main -> recipe\.sat\.main: expected exactly one"):
        module_copy(verl_sat.main, "", edits=(("    use_gpu()\n", ""),))
    nested = "actor:\n  policy_loss:\n    sat:\n      quantile: 0.9\n      radius: 2\n"
    with pytest.raises(UpstreamDriftError, match=r"recipes/method/x\.yaml: sat\.radius is not a SatParams field"):
        flat_sat_keys(nested, "method/x.yaml")
    assert flat_sat_keys(nested.replace("      radius: 2\n", ""), "method/x.yaml") == (
        "actor:\n  policy_loss:\n    sat_quantile: 0.9\n"
    )
