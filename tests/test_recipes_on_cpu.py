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
"""The recipe group and ``python -m verl_sat.main``: every Table 1 row x every lag preset composed over verl 0.9.1's
packaged configs, built into verl's dataclasses and checked key by key; every remedy comparison row on each of verl's
three asynchronous trainers against the row it is built on; the lag presets against verl's separate-async rules; the
entry point's composition; the examples."""

import functools
import os
import subprocess
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import verl
from conftest import REMEDIES
from omegaconf import OmegaConf
from verl.trainer.config import AlgoConfig
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import McoreActorConfig, RolloutConfig

from verl_sat.config import FSDPRouterReplayConfig, SatConfig, SatPolicyLossConfig
from verl_sat.main import RECIPES_SEARCHPATH, compose_from_args, compose_job, split_args, with_recipes_searchpath
from verl_sat.preflight import (
    PreflightError,
    check_config,
    check_trainer_startup,
    decoupled_sat_warnings,
    selected_trainer,
    unread_key_warnings,
)
from verl_sat.recipe_catalog import PAPER_TABLE_1, REMEDY_ROWS, SAT_VARIANT_ROWS, describe

ROWS = list(PAPER_TABLE_1)  # the 13 rows of Table 1
RECIPES = [*ROWS, "tis"]
LAGS = ["lag1", "lag8", "fixed8", "sync"]
LOSS_MODE = {"grpo": "vanilla", "gspo": "gspo", "dppo": "dppo_tv", "sat_grpo": "sat", "sat_gspo": "sat_gspo"}
# separate_async's own rollout pool, which verl's trainer asserts (verl-sat's preflight too)
ROLLOUT_POOL = ["actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=8"]
SMALL_BATCH = [
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
    "data.train_batch_size=64",
    "actor_rollout_ref.rollout.name=sglang",
    *ROLLOUT_POOL,
]
# lag preset -> (parameter_sync_step, num_warmup_batches, max_off_policy_threshold); None: verl's own sync mode
LAG_KEYS = {"lag1": (1, 1, 2), "lag8": (8, 1, 2), "fixed8": (1, 8, 9), "sync": None}


def _config_name(recipe: str) -> str:
    return "ppo_megatron_trainer" if recipe.endswith("_r3") else "ppo_trainer"


def compose_recipe(recipe: str, lag: str | None = None, *overrides: str, config_name: str | None = None):
    """What ``python -m verl_sat.main --config-name NAME +recipe=R +lag=L OVERRIDES`` composes."""
    args = ["--config-name", config_name or _config_name(recipe), f"hydra.searchpath=[{RECIPES_SEARCHPATH}]",
            f"+recipe={recipe}", *([f"+lag={lag}"] if lag else []), *SMALL_BATCH, *overrides]  # fmt: skip
    return compose_from_args(args)


def _family(recipe: str) -> str:
    return recipe.removesuffix("_r3").removesuffix("_tis")


@pytest.mark.parametrize("lag", [None, *LAGS])
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_builds_verl_dataclasses_with_the_papers_settings(recipe, lag):
    """Composed over verl's packaged config, verl's own dataclasses build and carry Table 9's settings."""
    cfg = compose_recipe(recipe, lag)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)  # via each node's _target_, as verl does
    algorithm = omega_conf_to_dataclass(cfg.algorithm)
    assert isinstance(rollout, RolloutConfig) and isinstance(algorithm, AlgoConfig)
    family = _family("grpo_tis" if recipe == "tis" else recipe)
    assert actor.policy_loss.loss_mode == LOSS_MODE[family]
    assert actor.loss_agg_mode == "seq-mean-token-mean"  # one aggregation for every row
    if family == "dppo":  # DPPO-TV: delta 1e-3, clip_ratio_c large
        assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.clip_ratio_c) == (1e-3, 1e-3, 20.0)
    else:  # (0.2, 0.2) for every family, GSPO included
        assert (actor.clip_ratio_low, actor.clip_ratio_high) == (0.2, 0.2)
    assert actor.use_kl_loss and actor.kl_loss_type == "low_var_kl" and actor.kl_loss_coef == 1e-3
    assert actor.entropy_coeff == 0.0
    assert actor.optim.lr == 1e-6 and tuple(actor.optim.betas) == (0.9, 0.98) and actor.optim.lr_warmup_steps_ratio == 0
    assert (rollout.temperature, rollout.top_p, rollout.top_k, rollout.n) == (1.0, 1.0, -1, 16)
    assert algorithm.adv_estimator == "grpo"
    tis = "tis" in recipe
    assert algorithm.rollout_correction["bypass_mode"] is not tis  # a plain dict in AlgoConfig
    if tis:
        assert algorithm.rollout_correction["rollout_is"] == "token"
        assert algorithm.rollout_correction["rollout_is_threshold"] == 2.0
    assert isinstance(actor.policy_loss, SatPolicyLossConfig)  # every row: it logs the paper's mismatch (Eq. 52)
    assert actor.policy_loss.sat == SatConfig()  # the paper's rule: the defaults
    r3 = recipe.endswith("_r3")
    assert rollout.enable_rollout_routing_replay is r3
    if r3:
        assert isinstance(actor, McoreActorConfig) and actor.megatron.router_replay.mode == "R3"
        assert cfg.actor_rollout_ref.ref.megatron.router_replay.mode == "disabled"  # never in the reference model
    if lag is not None:
        _assert_lag(cfg, lag)
    assert check_config(cfg) == []  # the entry point's own checks pass, without warnings


def _assert_lag(cfg, lag: str) -> None:
    v1 = cfg.trainer.v1
    assert cfg.trainer.use_v1
    if LAG_KEYS[lag] is None:
        assert v1.trainer_mode == "sync"
        return
    sync_step, warmup, threshold = LAG_KEYS[lag]
    assert v1.trainer_mode == "separate_async"
    assert v1.separate_async.parameter_sync_step == sync_step
    assert v1.separate_async.num_warmup_batches == warmup
    assert v1.sampler.max_off_policy_threshold == threshold and v1.sampler.max_off_policy_strategy == "drop"
    # verl's separate-async trainer asserts train_batch_size == parameter_sync_step * ppo_mini_batch_size
    assert cfg.data.train_batch_size == sync_step * cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    assert cfg.actor_rollout_ref.rollout.checkpoint_engine.backend != "naive"


@pytest.mark.parametrize("lag", ["lag1", "lag8", "fixed8"])
@pytest.mark.parametrize("batch", [64, 2048])
def test_mini_batch_follows_the_train_batch_size(lag, batch):
    """The lag presets keep verl's separate-async identity when the user overrides data.train_batch_size."""
    cfg = compose_recipe("sat_gspo", lag, f"data.train_batch_size={batch}")
    sync_step = cfg.trainer.v1.separate_async.parameter_sync_step
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size * sync_step == batch
    assert omega_conf_to_dataclass(cfg.actor_rollout_ref.actor).ppo_mini_batch_size * sync_step == batch


def test_a_batch_the_lag_does_not_divide_is_named():
    cfg = compose_recipe("grpo", "lag8", "data.train_batch_size=100")
    with pytest.raises(Exception, match=r"data.train_batch_size=100 must be a positive multiple of the lag n=8"):
        cfg.actor_rollout_ref.actor.ppo_mini_batch_size  # noqa: B018  (resolving the interpolation raises)


def test_gspo_radii_are_one_piece_away():
    actor = compose_recipe("gspo", "lag1", "+radii=gspo").actor_rollout_ref.actor
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (3e-4, 4e-4)


def test_command_line_overrides_reach_the_dataclasses():
    cfg = compose_recipe(
        "sat_gspo",
        "lag8",
        "actor_rollout_ref.actor.clip_ratio_high=5e-4",
        "actor_rollout_ref.actor.policy_loss.sat.quantile=0.95",
        "actor_rollout_ref.actor.policy_loss.sat.granularity=sequence_uniform",
    )
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert actor.clip_ratio_high == 5e-4
    assert actor.policy_loss.sat == SatConfig(quantile=0.95, granularity="sequence_uniform")


def test_bad_override_fails_with_the_sat_config_error():
    cfg = compose_recipe("sat_gspo", "lag1", "actor_rollout_ref.actor.policy_loss.sat.quantile=1.5")
    with pytest.raises(PreflightError, match=r"policy_loss.sat.quantile=1.5 is invalid: expected a float in the open"):
        check_config(cfg)


def test_legacy_trainer_with_bypass_is_refused():
    with pytest.raises(PreflightError, match="legacy trainer replaces"):
        check_config(compose_recipe("sat_grpo", None, "trainer.use_v1=false"))


# ---- R3 under FSDP: loud or absent --------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", [r for r in ROWS if r.endswith("_r3")])
def test_fsdp_r3_composes_and_builds(recipe):
    """``r3=fsdp`` selects verl-sat's FSDP routing replay through verl-sat's router-replay config (the same for the
    recipes without a SAT ``_target_``) on verl's default actor strategy, FSDP1; the reference model routes natively."""
    cfg = compose_recipe(recipe, "lag8", "r3=fsdp", config_name="ppo_trainer")
    assert cfg.actor_rollout_ref.actor.strategy == "fsdp"  # verl's default, untouched by the recipe
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert type(actor.fsdp_config.router_replay) is FSDPRouterReplayConfig
    assert actor.fsdp_config.router_replay.mode == "R3" and actor.engine.router_replay.mode == "R3"
    assert "megatron" not in cfg.actor_rollout_ref.actor
    assert (
        cfg.actor_rollout_ref.rollout.enable_rollout_routing_replay and cfg.actor_rollout_ref.model.use_remove_padding
    )
    assert "router_replay" not in cfg.actor_rollout_ref.ref.fsdp_config
    assert check_config(cfg) == []


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["+recipe=sat_gspo_r3"], r"Megatron routing replay \(r3=megatron\) but .*strategy='fsdp': add r3=fsdp"),
        (["+recipe=gspo", "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"],
         r"the FSDP actor does not replay .*verl's FSDP engine ignores the routes\): add r3=fsdp"),
        (["+recipe=gspo_r3", "r3=fsdp", "actor_rollout_ref.actor.fsdp_config.router_replay.mode=R2"],
         r"router_replay: _target_='verl_sat.config.FSDPRouterReplayConfig', mode='R2'"),
        (["+recipe=gspo_r3", "r3=fsdp", "actor_rollout_ref.actor.fsdp_config.router_replay._target_="
          "verl.workers.config.EngineRouterReplayConfig"], r"_target_='verl.workers.config.EngineRouterReplayConfig'"),
        (["+recipe=gspo_r3", "r3=fsdp", "actor_rollout_ref.actor.strategy=fsdp_turbo"],
         r"actor_rollout_ref.actor.strategy='fsdp_turbo' has no routing replay"),
        (["+recipe=gspo", "+actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3"],
         r"router_replay.mode='R3' but the rollout returns no routes: set actor_rollout_ref.rollout."
         "enable_rollout_routing_replay=true"),
        (["+recipe=gspo_r3", "r3=fsdp", "actor_rollout_ref.model.use_remove_padding=false"],
         r"needs actor_rollout_ref.model.use_remove_padding=true"),
    ],
)  # fmt: skip
def test_r3_under_fsdp_that_cannot_replay_stops_at_start(overrides, message):
    cfg = compose_from_args([f"hydra.searchpath=[{RECIPES_SEARCHPATH}]", "+lag=lag1", *SMALL_BATCH, *overrides])
    with pytest.raises(PreflightError, match=message):
        check_config(cfg)


def test_router_replay_config_refuses_other_modes_in_the_worker():
    """Where the preflight does not run (verl's own entry point), the worker that builds the engine config fails."""
    with pytest.raises(ValueError, match=r"fsdp_config.router_replay.mode='R2': .*\(R3\) only"):
        FSDPRouterReplayConfig(mode="R2")


def _python(code: str, *extra_path: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(extra_path)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)


def test_non_r3_fsdp_job_is_unaffected(tmp_path):
    """Installing verl-sat changes nothing in an FSDP job without R3: after ``import verl`` (which loads the plugin),
    verl's engine module and verl's own config, the registry holds verl's engine class; asking for R3 is what
    installs verl-sat's, and a second, non-R3 engine config in the same process leaves it as it is."""
    proc = _python(
        "import verl, verl_sat.plugin\n"
        "from verl.workers.engine.base import EngineRegistry\n"
        "from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead\n"
        "from verl.workers.config import FSDPEngineConfig\n"
        "from verl_sat.config import FSDPRouterReplayConfig\n"
        "FSDPEngineConfig(strategy='fsdp2')\n"
        "assert EngineRegistry.get_engine_cls('language_model', 'fsdp2') is FSDPEngineWithLMHead\n"
        "FSDPRouterReplayConfig(mode='disabled')\n"
        "assert EngineRegistry.get_engine_cls('language_model', 'fsdp2') is FSDPEngineWithLMHead\n"
        "FSDPRouterReplayConfig(mode='R3')\n"
        "print(EngineRegistry.get_engine_cls('language_model', 'fsdp2').__name__)\n"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("RoutingReplayFSDPEngine")


def test_r3_with_another_fsdp_engine_fails_loudly():
    proc = _python(
        "import verl, verl_sat.plugin\n"
        "from verl.workers.engine.base import EngineRegistry\n"
        "from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead\n"
        "class Other(FSDPEngineWithLMHead): pass\n"
        "EngineRegistry._engines['language_model']['fsdp2']['cuda'] = Other\n"
        "from verl_sat.config import FSDPRouterReplayConfig\n"
        "FSDPRouterReplayConfig(mode='R3')\n"
    )
    assert proc.returncode != 0
    assert "router_replay.mode=R3, but verl's fsdp2/cuda language-model engine is __main__.Other" in proc.stderr


def test_r3_requested_on_fsdp_turbo_fails_in_the_engine():
    proc = _python(
        "import verl, verl_sat.plugin\n"
        "from verl.workers.engine.base import EngineRegistry\n"
        "from verl.workers.config import EngineRouterReplayConfig\n"
        "from verl_sat.config import FSDPRouterReplayConfig\n"
        "FSDPRouterReplayConfig(mode='R3')\n"
        "cls = EngineRegistry._engines['language_model']['fsdp_turbo']['cuda']\n"
        "class Config: router_replay = EngineRouterReplayConfig(mode='R3')\n"
        "cls(model_config=None, engine_config=Config())\n"
    )
    assert proc.returncode != 0
    assert "actor_rollout_ref.actor.strategy=fsdp_turbo has no routing replay" in proc.stderr


def test_worker_without_verl_sat_fails_to_build_the_r3_config(tmp_path):
    """A worker where verl-sat is missing cannot build the actor config of an FSDP R3 job: the error names the
    target, where verl's own router-replay config would have run without replay."""
    cfg = compose_recipe("gspo_r3", "lag1", "r3=fsdp", config_name="ppo_trainer")
    node = OmegaConf.to_yaml(cfg.actor_rollout_ref.actor.fsdp_config.router_replay)
    proc = _python(
        "import sys\n"
        "class NoVerlSat:  # as if verl-sat were not installed on this node\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'verl_sat': raise ModuleNotFoundError(f'No module named {name!r}')\n"
        "sys.meta_path.insert(0, NoVerlSat())\n"
        "from omegaconf import OmegaConf; from verl.utils.config import omega_conf_to_dataclass\n"
        f"omega_conf_to_dataclass(OmegaConf.create({node!r}))\n"
    )
    assert proc.returncode != 0
    assert "verl_sat.config.FSDPRouterReplayConfig" in proc.stderr


# ---- the entry point -----------------------------------------------------------------------------------------------


def _entry(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "verl_sat.main", *args], capture_output=True, text=True,
                          timeout=600, cwd=cwd)  # fmt: skip


def test_entry_point_cfg_job_for_every_lag():
    """``--cfg job`` prints the composed config, runs the same checks as a real run and starts nothing."""
    cases = [("sat_gspo", "lag1"), ("grpo", "lag8"), ("gspo_tis", "fixed8"), ("sat_grpo_r3", "sync")]

    def run(case):
        recipe, lag = case
        return case, _entry("--config-name", _config_name(recipe), f"+recipe={recipe}", f"+lag={lag}", *ROLLOUT_POOL,
                            "--cfg", "job")  # fmt: skip

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(run, cases))
    for (recipe, lag), proc in results:
        assert proc.returncode == 0, f"{recipe}+{lag}: {proc.stderr[-2000:]}"
        printed = OmegaConf.create(proc.stdout)
        assert printed.actor_rollout_ref.actor.policy_loss.loss_mode == LOSS_MODE[_family(recipe)]
        assert printed.trainer.v1.trainer_mode == ("sync" if lag == "sync" else "separate_async")


def test_entry_point_cfg_job_runs_the_checks():
    proc = _entry("+recipe=sat_gspo", "+lag=lag1", "actor_rollout_ref.actor.policy_loss.sat.quantile=2", "--cfg", "job")
    assert proc.returncode == 1
    assert "verl-sat: actor_rollout_ref.actor.policy_loss does not build" in proc.stderr
    assert "sat.quantile=2 is invalid" in proc.stderr and "trainer:" not in proc.stdout


def test_entry_point_composes_a_custom_config_path(tmp_path):
    """A user's own config under ``--config-path`` (relative paths too) composes as verl's hydra.main composes it,
    passes the preflight, and keeps its own search path in front of the recipes."""
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "my_trainer.yaml").write_text(
        "defaults:\n  - ppo_trainer\n  - _self_\nhydra:\n  searchpath:\n    - pkg://verl.trainer.config\n"
        "trainer:\n  project_name: my_project\n"
    )
    args = ["--config-name", "my_trainer", "+recipe=sat_gspo", "+lag=lag1", *SMALL_BATCH]
    cfg = compose_from_args(with_recipes_searchpath(["--config-path", str(tmp_path / "conf"), *args]))
    assert cfg.trainer.project_name == "my_project"
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "sat_gspo"
    assert check_config(cfg) == []
    with ThreadPoolExecutor(max_workers=2) as pool:  # --config-path and --config-dir, two at a time
        procs = list(pool.map(lambda flag: _entry(flag, str(tmp_path / "conf"), *args, "--cfg", "job",
                                                  cwd=str(tmp_path)), ("-cp", "-cd")))  # fmt: skip
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert OmegaConf.create(proc.stdout).trainer.project_name == "my_project"


def test_compose_equals_what_verl_prints():
    """The preflight's composition is verl's: the job config equals ``python -m verl.trainer.main_ppo --cfg job``."""
    args = ["hydra.searchpath=[pkg://verl_sat.recipes]", "+recipe=sat_gspo", "+lag=lag8", *SMALL_BATCH]
    proc = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", *args, "--cfg", "job"],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    ours = OmegaConf.to_container(compose_from_args(args))
    del ours["hydra"]
    assert ours == OmegaConf.to_container(OmegaConf.create(proc.stdout))


def test_entry_point_unknown_recipe_lists_valid_names():
    proc = _entry("+recipe=sat_gpso")
    assert proc.returncode != 0
    assert "Could not find 'recipe/sat_gpso'" in proc.stderr
    for name in RECIPES:
        assert f"\t{name}\n" in proc.stderr


def test_entry_point_prints_the_micro_batch_warning():
    proc = _entry("+recipe=sat_gspo", "+lag=lag1", *SMALL_BATCH,
                  "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "--cfg", "job")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "verl-sat: warning: actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1" in proc.stderr


@pytest.mark.parametrize(
    "overrides,warned",
    [
        (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"], "gates nothing: SAT-GSPO is exactly GSPO"),
        (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"], "gates almost nothing"),
        (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=10"], None),  # 1 / (1 - 0.9) sequences
        (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "actor_rollout_ref.actor.use_dynamic_bsz=true"],
         None),
        (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
          "actor_rollout_ref.actor.policy_loss.sat.granularity=token"], None),
        (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=12",
          "actor_rollout_ref.actor.policy_loss.sat.quantile=0.95"], "set actor_rollout_ref.actor.ppo_micro_batch_size"),
        # the paper's long-CoT budget: one full-length sequence per micro-batch
        (["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=34816",
          "data.max_prompt_length=2048", "data.max_response_length=32768"], "holds 1, so once responses grow"),
        # 8 x 1088 tokens: 8 full-length sequences, below 10; with two Ulysses ranks verl packs 16
        (["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8704",
          "data.max_prompt_length=64", "data.max_response_length=1024"], "raise the budget to 10880 tokens per GPU"),
        (["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8704",
          "data.max_prompt_length=64", "data.max_response_length=1024",
          "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2"], None),
        # with two Ulysses ranks verl packs twice the budget: 5440 tokens per GPU hold the 10 sequences
        (["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4352",
          "data.max_prompt_length=64", "data.max_response_length=1024",
          "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2"], "raise the budget to 5440 tokens"),
        # a null length is no length: nothing to estimate
        (["actor_rollout_ref.actor.use_dynamic_bsz=true", "data.max_prompt_length=null"], None),
        # interpolated quantile over sequences each once: gates from two sequences on
        (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
          "actor_rollout_ref.actor.policy_loss.sat.granularity=sequence_uniform",
          "actor_rollout_ref.actor.policy_loss.sat.quantile_method=linear"], None),
        (["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=34816",
          "data.max_prompt_length=2048", "data.max_response_length=32768",
          "actor_rollout_ref.actor.policy_loss.sat.granularity=token"], None),
        # the carried quantile pools the last 256 sequences: one per micro-batch is enough
        (["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=34816",
          "data.max_prompt_length=2048", "data.max_response_length=32768",
          "actor_rollout_ref.actor.policy_loss.sat.granularity=sequence_carried"], None),
        (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
          "actor_rollout_ref.actor.policy_loss.sat.granularity=sequence_carried"], None),
    ],
)  # fmt: skip
def test_preflight_warns_when_the_micro_batch_cannot_gate(overrides, warned):
    """SAT-GSPO's quantile is per micro-batch: a static micro-batch under 1 / (1 - alpha) sequences, or a dynamic
    token budget that holds fewer full-length sequences, is named with the keys that fix it."""
    warnings = check_config(compose_recipe("sat_gspo", "lag1", *overrides))
    if warned is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and warned in warnings[0]
        assert "actor_rollout_ref.actor.policy_loss.sat.granularity=sequence_carried" in warnings[0]
    token_rule = compose_recipe("sat_grpo", "lag1", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1")
    assert check_config(token_rule) == []  # the token-level rule has many tokens in one sequence


def test_searchpath_goes_before_the_overrides_and_flags_first():
    args = ["--config-name", "ppo_megatron_trainer", "+recipe=gspo_r3", "--cfg", "job", "trainer.total_epochs=2"]
    assert with_recipes_searchpath(args) == [
        "--config-name", "ppo_megatron_trainer", "--cfg", "job",
        "hydra.searchpath=[pkg://verl_sat.recipes]", "+recipe=gspo_r3", "trainer.total_epochs=2",
    ]  # fmt: skip
    custom = ["+recipe=grpo", "hydra.searchpath=[pkg://my.recipes]"]
    assert with_recipes_searchpath(custom) == [
        "hydra.searchpath=[pkg://my.recipes,pkg://verl_sat.recipes]",
        "+recipe=grpo",
    ]
    assert split_args(["-cp", "x", "a=1"]) == (["-cp", "x"], ["a=1"])
    # verl's fully-async Megatron config declares file://verl/trainer/config, found only from a verl checkout's root
    fully_async = ["--config-name", "fully_async_ppo_megatron_trainer", "+recipe=grpo"]
    assert with_recipes_searchpath(fully_async) == [
        "--config-name", "fully_async_ppo_megatron_trainer",
        "hydra.searchpath=[file://verl/trainer/config,pkg://verl.trainer.config,pkg://verl_sat.recipes]",
        "+recipe=grpo",
    ]  # fmt: skip


# ---- the catalog, the wheel, the examples ---------------------------------------------------------------------------


def _flat_keys(node: dict, prefix: str = "") -> set[str]:
    keys = set()
    for key, value in node.items():
        if isinstance(value, dict) and value:
            keys |= _flat_keys(value, f"{prefix}{key}.")
        else:
            keys.add(f"{prefix}{key}")
    return keys


def _job(cfg) -> dict:
    """The job config as ``--cfg job`` shows it (no ``hydra`` node), interpolations unresolved."""
    container = OmegaConf.to_container(cfg, resolve=False)
    container.pop("hydra", None)
    return container


def _job_keys(cfg) -> set[str]:
    return _flat_keys(_job(cfg))


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipes_only_set_keys_verl_defines(recipe):
    """Every key a recipe (with any lag) sets exists in verl's own config, except the deliberate `sat` block and,
    for r3=fsdp, the router_replay block verl's FSDP yaml lacks."""
    base_keys = _job_keys(compose_from_args(["--config-name", _config_name(recipe), *SMALL_BATCH]))
    for lag in LAGS:
        added = sorted(k for k in _job_keys(compose_recipe(recipe, lag)) - base_keys
                       if not k.startswith("actor_rollout_ref.actor.policy_loss.sat."))  # fmt: skip
        assert added == [], f"{recipe}+{lag} adds keys verl does not define: {added}"
    if recipe.endswith("_r3"):
        keys = _job_keys(compose_recipe(recipe, "lag1", "r3=fsdp", config_name="ppo_trainer"))
        added = {k for k in keys - _job_keys(compose_from_args(SMALL_BATCH))
                 if not k.startswith("actor_rollout_ref.actor.policy_loss.sat.")}  # fmt: skip
        assert added == {
            "actor_rollout_ref.actor.fsdp_config.router_replay._target_",
            "actor_rollout_ref.actor.fsdp_config.router_replay.mode",
        }


def test_recipes_command_lists_every_row_with_the_papers_numbers():
    proc = subprocess.run([sys.executable, "-m", "verl_sat.cli", "recipes"], capture_output=True, text=True)
    assert proc.returncode == 0
    sections = []  # (header, {name: line})
    for line in proc.stdout.splitlines():
        if line.startswith("  "):
            sections[-1][1][line.split()[0]] = line
        else:
            sections.append((line, {}))
    headers = [header.split()[0] for header, _ in sections]
    assert headers == ["+recipe=NAME", "+recipe=NAME", "+recipe=NAME", "+lag=NAME", "+radii=NAME", "r3=NAME",
                       "+cpu=NAME"]  # fmt: skip
    (paper_header, lines), (variant_header, variants), (remedy_header, remedies), lags, radii, r3, cpu = sections
    assert "paper Table 1" in paper_header and "remedy comparison, not in the paper's Table 1" in remedy_header
    assert "SAT variants, not in the paper's Table 1" in variant_header
    assert set(lines) == set(RECIPES) and set(remedies) == set(REMEDY_ROWS) == set(REMEDIES)
    assert (
        set(variants)
        == set(SAT_VARIANT_ROWS)
        == {"sat_gspo_token", "sat_gspo_token_r3", "sat_gspo_ratio_side", "sat_gspo_carried", "sat_gspo_carried_r3"}
    )
    assert set(lags[1]) == set(LAGS) and set(r3[1]) == {"fsdp", "megatron"} and set(radii[1]) == {"gspo"}
    assert set(cpu[1]) == {"e2e"}
    for name, row in PAPER_TABLE_1.items():
        assert f"{row.lag1:.2f} / {row.lag8:.2f}" in lines[name]
    assert "(collapses)" in lines["grpo"] and "(collapses)" not in lines["sat_gspo"]
    assert set(describe("recipe")) == {*RECIPES, *SAT_VARIANT_ROWS, *REMEDY_ROWS}  # each file in one section
    assert len(ROWS) == 13 and all(describe("recipe").values())


def test_wheel_ships_the_recipes(tmp_path):
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True).stdout.strip()
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), root],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("verl_sat-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {
        "recipe": [*RECIPES, *SAT_VARIANT_ROWS, *REMEDY_ROWS], "lag": LAGS, "r3": ["megatron", "fsdp"],
        "paper": ["table9"],
        "correction": ["tis", "icepop", "seq_is_rs", "geo_rs", "k3_rs"], "method": [*LOSS_MODE, "sapo", "cispo",
        "dppo_kl", "sat_gspo_token"], "radii": ["gspo"], "embedded": ["default"], "cpu": ["e2e"],
    }  # fmt: skip
    for group, entries in shipped.items():
        for entry in entries:
            assert f"verl_sat/recipes/{group}/{entry}.yaml" in names, (group, entry)
    for trainer in ("colocate_async", "fully_async"):  # each trainer's lag presets, one folder down
        for lag in LAGS:
            assert f"verl_sat/recipes/lag/{trainer}/{lag}.yaml" in names, (trainer, lag)
    for template in ("test_sat_policy_loss_on_cpu.py", "test_fsdp_router_replay_on_cpu.py",
                     "test_trainer_logging_on_cpu.py", "test_rollout_logging_on_cpu.py"):  # fmt: skip  # upstream
        assert f"verl_sat/upstream/templates/{template}" in names


EXAMPLE_CASES = [  # script, environment, loss_mode, parameter_sync_step (None: sync), train_batch_size
    ("run_qwen3_30b_a3b_sat_gspo_r3_megatron.sh", {}, "sat_gspo", 8, 2048),
    ("run_qwen3_30b_a3b_sat_gspo_r3_megatron.sh", {"RECIPE": "gspo_tis_r3", "LAG": "1"}, "gspo", 1, 256),
    ("run_qwen3_30b_a3b_sat_gspo_r3_megatron.sh", {"LAG": "sync"}, "sat_gspo", None, 256),
    ("run_qwen2_5_7b_sat_grpo_fsdp.sh", {}, "sat", 1, 64),
    ("run_qwen2_5_7b_sat_grpo_fsdp.sh", {"RECIPE": "dppo", "LAG": "8"}, "dppo_tv", 8, 512),
    ("run_qwen2_5_7b_sat_grpo_fsdp.sh", {"LAG": "sync"}, "sat", None, 64),
]


def test_example_scripts_compose(tmp_path):
    """Every shipped example at every lag it offers (1, 8, sync): every override is a key verl 0.9.1 knows and the
    entry point's checks pass under ``--cfg job``, the size checks included (token budgets, parallel sizes, batch
    split); the paper's optimizer step (prompts per optimizer step) is kept at every lag. Two scripts at a time."""
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True).stdout.strip()
    path = f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}"

    def run(index):
        script, env = EXAMPLE_CASES[index][:2]
        (tmp_path / str(index)).mkdir()
        return subprocess.run(["bash", f"{root}/examples/{script}", "--cfg", "job"], capture_output=True, text=True,
                              env={**os.environ, "PATH": path, **env}, cwd=tmp_path / str(index))  # fmt: skip

    with ThreadPoolExecutor(max_workers=2) as pool:
        procs = list(pool.map(run, range(len(EXAMPLE_CASES))))
    for (script, env, loss_mode, sync_step, batch), proc in zip(EXAMPLE_CASES, procs, strict=True):
        assert proc.returncode == 0, f"{script} {env}: {proc.stderr[-2000:]}"
        warnings = [line for line in proc.stderr.splitlines() if "warning" in line]
        # separate_async keeps the lag's gap only while generation outpaces training, and says so; nothing else warns
        assert len(warnings) == (sync_step is not None), (script, env)
        assert all("only while generation outpaces training" in line for line in warnings)
        printed = OmegaConf.create(proc.stdout)
        assert printed.actor_rollout_ref.actor.policy_loss.loss_mode == loss_mode
        if sync_step is None:  # lag sync: verl's synchronous v1 mode
            assert printed.trainer.v1.trainer_mode == "sync"
        else:
            assert printed.trainer.v1.separate_async.parameter_sync_step == sync_step
        assert printed.data.train_batch_size == batch
        assert printed.actor_rollout_ref.actor.use_dynamic_bsz


# ---- the three asynchronous trainers -------------------------------------------------------------------------------

FULLY_ASYNC_ARGS = (
    "--config-name", "fully_async_ppo_trainer", "data.train_batch_size=0", "actor_rollout_ref.hybrid_engine=false",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
)  # fmt: skip
TRAINER_ARGS = {
    "separate_async": tuple(ROLLOUT_POOL),
    "colocate_async": ("trainer.v1.trainer_mode=colocate_async",),
    "fully_async": FULLY_ASYNC_ARGS,
}
# lag -> the trainer's own keys: colocate (num_warmup_batches, optimizer steps per trainer step) and fully-async
# (trigger_parameter_sync_step, staleness_threshold)
COLOCATE_LAG = {"lag1": (1, 1), "lag8": (1, 8), "fixed8": (8, 1), "sync": (0, 1)}
FULLY_ASYNC_LAG = {"lag1": (1, 1), "lag8": (8, 1), "fixed8": (1, 8), "sync": (1, 0)}


def compose_for_trainer(trainer: str, lag: str, *overrides: str, recipe: str = "sat_gspo_r3"):
    """What ``python -m verl_sat.main`` composes for ``+recipe=RECIPE +lag=LAG`` (``r3=fsdp`` for an R3 row) on
    ``trainer``: the args it passes on and the config."""
    extra = () if trainer == "fully_async" else ("data.train_batch_size=64",)
    r3 = ("r3=fsdp",) if recipe.endswith("_r3") else ()
    args = with_recipes_searchpath([*TRAINER_ARGS[trainer], f"+recipe={recipe}", *r3, f"+lag={lag}", *extra,
                                    *overrides])  # fmt: skip
    return compose_job(args)


@pytest.mark.parametrize("lag", LAGS)
@pytest.mark.parametrize("trainer", list(TRAINER_ARGS))
def test_lag_preset_is_written_in_the_selected_trainers_keys(trainer, lag):
    args, cfg = compose_for_trainer(trainer, lag)
    v1, defaults = cfg.trainer.v1, OmegaConf.load(Path(verl.__file__).parent / "trainer/config/ppo_trainer.yaml")
    assert selected_trainer(cfg) == (trainer if lag != "sync" or trainer != "separate_async" else "sync")
    assert unread_key_warnings(cfg) == []  # nothing set that the trainer does not read
    assert check_config(cfg) is not None
    actor = cfg.actor_rollout_ref.actor
    if trainer == "fully_async":
        assert f"+lag=fully_async/{lag}" in args
        assert OmegaConf.to_container(v1) == OmegaConf.to_container(defaults.trainer.v1)  # verl's defaults
        training = cfg.async_training
        assert (training.trigger_parameter_sync_step, training.staleness_threshold) == FULLY_ASYNC_LAG[lag]
        assert training.require_batches == 1 and actor.ppo_epochs == 1 and actor.ppo_mini_batch_size == 16
    elif trainer == "colocate_async":
        assert f"+lag=colocate_async/{lag}" in args and v1.trainer_mode == "colocate_async"
        assert v1.separate_async == defaults.trainer.v1.separate_async
        ahead, optimizer_steps = COLOCATE_LAG[lag]
        assert v1.colocate_async.num_warmup_batches == ahead and actor.ppo_epochs == 1
        assert actor.ppo_mini_batch_size == 64 // optimizer_steps
        if lag != "sync":  # sample only once nothing is in flight: no trajectory resumed across a broadcast
            assert (v1.sampler.max_off_policy_strategy, v1.sampler.max_off_policy_threshold) == ("wait", 1)
    else:
        assert f"+lag={lag}" in args
        if lag != "sync":
            sync_steps, ahead, bound = LAG_KEYS[lag]
            assert v1.separate_async.parameter_sync_step == sync_steps and v1.colocate_async == (
                defaults.trainer.v1.colocate_async
            )
            assert actor.ppo_mini_batch_size == 64 // sync_steps


def test_entry_point_cfg_job_shows_the_trainers_own_lag_keys(tmp_path):
    """Each trainer (and fully-async on Megatron) gets its own lag keys from ``+lag=lag8``; the four entry points run
    two at a time."""

    def run(trainer):
        megatron = trainer == "fully_async_megatron"
        if megatron:  # verl's own Megatron R3 keys, composed away from a verl checkout (its searchpath is CWD-relative)
            args = (*FULLY_ASYNC_ARGS[2:], "--config-name", "fully_async_ppo_megatron_trainer")
        else:
            args = (*TRAINER_ARGS[trainer], "r3=fsdp")
        (tmp_path / trainer).mkdir()
        return trainer, _entry(*args, "+recipe=sat_gspo_r3", "+lag=lag8", "--cfg", "job", cwd=str(tmp_path / trainer))

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(run, [*TRAINER_ARGS, "fully_async_megatron"]))
    for trainer, proc in results:
        assert proc.returncode == 0, f"{trainer}: {proc.stderr[-3000:]}"
        printed = OmegaConf.create(proc.stdout)
        assert printed.actor_rollout_ref.actor.policy_loss.loss_mode == "sat_gspo"
        megatron = trainer == "fully_async_megatron"
        engine = printed.actor_rollout_ref.actor.megatron if megatron else printed.actor_rollout_ref.actor.fsdp_config
        assert engine.router_replay.mode == "R3" and printed.actor_rollout_ref.rollout.enable_rollout_routing_replay
        assert "is not read by" not in proc.stderr
        if trainer.startswith("fully_async"):
            assert printed.async_training.trigger_parameter_sync_step == 8
            assert printed.async_training.staleness_threshold == 1
            assert printed.trainer.v1.trainer_mode == "sync"  # verl's default, untouched
            assert "gives the gap 8..15 optimizer steps only while the rollouter keeps its budget queued" in proc.stderr
        elif trainer == "colocate_async":
            assert printed.trainer.v1.trainer_mode == "colocate_async"
            assert printed.trainer.v1.sampler.max_off_policy_strategy == "wait"
            assert printed.trainer.v1.separate_async.parameter_sync_step == 4  # verl's default, untouched
        else:
            assert printed.trainer.v1.trainer_mode == "separate_async"
            assert printed.trainer.v1.separate_async.parameter_sync_step == 8


def test_a_key_the_selected_trainer_does_not_read_is_named():
    _, cfg = compose_for_trainer("colocate_async", "lag8", "trainer.v1.separate_async.parameter_sync_step=8")
    [warning] = unread_key_warnings(cfg)
    assert warning.startswith("trainer.v1.separate_async.parameter_sync_step=8 is not read by the colocate_async")
    _, cfg = compose_for_trainer("fully_async", "lag8", "trainer.v1.separate_async.num_warmup_batches=2")
    [warning] = unread_key_warnings(cfg)
    assert warning.startswith("trainer.v1.separate_async.num_warmup_batches=2 is not read by the fully_async")


@pytest.mark.parametrize(("trainer", "lag", "overrides", "message"), [
    ("separate_async", "lag8", ("trainer.v1.trainer_mode=sync",),
     "+lag=lag8 is written for the separate_async trainer, but trainer.v1.trainer_mode=sync selects sync"),
    ("fully_async", "colocate_async/lag8", (),
     "+lag=colocate_async/lag8 is written for the colocate_async trainer, but --config-name fully_async_ppo_trainer"),
    ("fully_async", "lag8", ("data.train_batch_size=64",),
     "data.train_batch_size=64: verl's fully-async trainer asserts 0. It trains actor_rollout_ref.actor."
     "ppo_mini_batch_size prompts per optimizer step and broadcasts the weights every "
     "async_training.trigger_parameter_sync_step=8 steps; for 64 prompts per broadcast, as on the v1 trainers, set "
     "data.train_batch_size=0 actor_rollout_ref.actor.ppo_mini_batch_size=8"),
    ("fully_async", "lag1", ("actor_rollout_ref.hybrid_engine=true",),
     "actor_rollout_ref.hybrid_engine=True: verl's fully-async trainer asserts False"),
])  # fmt: skip
def test_a_lag_the_trainer_cannot_take_is_refused(trainer, lag, overrides, message):
    _, cfg = compose_for_trainer(trainer, lag, *overrides)
    with pytest.raises(PreflightError) as err:
        check_config(cfg)
    assert message in str(err.value)


# ---- the remedy comparison rows on the three trainers --------------------------------------------------------------


@functools.cache
def _composed_on(trainer: str, recipe: str):
    """``+recipe=RECIPE +lag=lag8`` on ``trainer`` as ``python -m verl_sat.main`` composes it (shared: read only)."""
    return compose_for_trainer(trainer, "lag8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
                               recipe=recipe)[1]  # fmt: skip


VARIANT_GRANULARITY = {"_carried": "sequence_carried", "_ratio_side": "token_ratio_side", "_token": "token"}


@pytest.mark.parametrize("recipe,trainer", [("sat_gspo_carried_r3", "fully_async"),
                                            ("sat_gspo_carried", "colocate_async"),
                                            ("sat_gspo_carried", "separate_async"),
                                            ("sat_gspo_token_r3", "fully_async"),
                                            ("sat_gspo_ratio_side", "separate_async")])  # fmt: skip
def test_variant_row_is_the_sat_gspo_row_with_its_granularity_on_every_trainer(recipe, trainer):
    """On each asynchronous trainer, a SAT variant row composes to the paper's SAT-GSPO row with only the score unit
    changed (the R3 row on one: it adds only the R3 piece to the other), builds verl's dataclasses, and keeps the
    preflight quiet at one sequence per micro-batch, where the paper's row is warned about."""
    suffix = next(s for s in VARIANT_GRANULARITY if s in recipe)
    paper_row, granularity = recipe.replace(suffix, ""), VARIANT_GRANULARITY[suffix]
    cfg, base = _composed_on(trainer, recipe), _composed_on(trainer, paper_row)
    expected = _job(base)
    expected["actor_rollout_ref"]["actor"]["policy_loss"]["sat"]["granularity"] = granularity
    assert _job(cfg) == expected
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert actor.policy_loss.loss_mode == "sat_gspo" and actor.policy_loss.sat.granularity == granularity
    one = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"
    token_warnings = check_config(compose_for_trainer(trainer, "lag8", one, recipe=recipe)[1])
    *others, warning = check_config(compose_for_trainer(trainer, "lag8", one, recipe=paper_row)[1])
    assert others == token_warnings  # the trainer's own warnings (the lag's), nothing about the micro-batch
    assert "SAT-GSPO is exactly GSPO" in warning and "policy_loss.sat.granularity=sequence_carried" in warning


@pytest.mark.parametrize("trainer", list(TRAINER_ARGS))
@pytest.mark.parametrize("recipe", REMEDY_ROWS)
def test_remedy_row_is_its_base_row_plus_the_remedy_on_every_trainer(recipe, trainer):
    """On each asynchronous trainer, a remedy row composes to the row it is built on (Table 9's settings, the
    trainer's lag keys) with only the remedy changed: verl's registered loss and the keys verl documents for it, or
    every key of verl's rollout-correction preset, decoupled mode included. verl's dataclasses build, and the
    preflight passes with the base row's warnings only, plus, for a SAT row in decoupled mode, the warning that SAT
    then measures the drift since pi_old."""
    remedy = REMEDIES[recipe]
    cfg, base = _composed_on(trainer, recipe), _composed_on(trainer, remedy.base)
    expected = _job(base)
    expected["actor_rollout_ref"]["actor"]["policy_loss"]["loss_mode"] = remedy.loss_mode
    expected["actor_rollout_ref"]["actor"].update(remedy.actor)
    if remedy.correction is not None:
        expected["algorithm"]["rollout_correction"] = remedy.correction_keys()
    assert _job(cfg) == expected
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert actor.policy_loss.loss_mode == remedy.loss_mode and isinstance(actor.policy_loss, SatPolicyLossConfig)
    assert {key: getattr(actor, key) for key in remedy.actor} == remedy.actor
    assert isinstance(omega_conf_to_dataclass(cfg.algorithm), AlgoConfig)
    decoupled_sat = remedy.loss_mode.startswith("sat") and remedy.correction is not None
    assert check_config(cfg) == check_config(base) + decoupled_sat_warnings(cfg, remedy.loss_mode)
    assert bool(decoupled_sat_warnings(cfg, remedy.loss_mode)) == decoupled_sat
    assert check_trainer_startup(cfg) == check_trainer_startup(base)
