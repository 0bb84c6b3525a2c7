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
"""The recipe group and ``python -m verl_sat.main``: composition with verl 0.9.1's configs, key by key."""

import os
import subprocess
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from verl.trainer.config import AlgoConfig
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import EngineRouterReplayConfig, McoreActorConfig, RolloutConfig

from verl_sat.config import SatConfig, SatPolicyLossConfig
from verl_sat.main import with_recipes_searchpath
from verl_sat.preflight import PreflightError, check_config
from verl_sat.recipe_catalog import describe

RECIPES = ["grpo", "gspo", "dppo", "tis", "sat_grpo", "sat_gspo", "gspo_r3", "sat_grpo_r3", "sat_gspo_r3"]
LAGS = {"sync": 0, "lag1": 1, "lag8": 8}
GRPO_FAMILY = {"loss_agg_mode": "token-mean", "clip_ratio_low": 0.2, "clip_ratio_high": 0.2}
GSPO_FAMILY = {"loss_agg_mode": "seq-mean-token-mean", "clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}
EXPECTED = {  # recipe -> (loss_mode, family, bypass_mode)
    "grpo": ("vanilla", GRPO_FAMILY, True),
    "gspo": ("gspo", GSPO_FAMILY, True),
    "dppo": ("dppo_tv", GRPO_FAMILY, True),
    "tis": ("vanilla", GRPO_FAMILY, False),
    "sat_grpo": ("sat", GRPO_FAMILY, True),
    "sat_gspo": ("sat_gspo", GSPO_FAMILY, True),
    "gspo_r3": ("gspo", GSPO_FAMILY, True),
    "sat_grpo_r3": ("sat", GRPO_FAMILY, True),
    "sat_gspo_r3": ("sat_gspo", GSPO_FAMILY, True),
}
SMALL_BATCH = [
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "data.train_batch_size=64",
    "actor_rollout_ref.rollout.name=sglang",
]


def _config_name(recipe: str) -> str:
    return "ppo_megatron_trainer" if recipe.endswith("_r3") else "ppo_trainer"


def compose_recipe(recipe: str, lag: str | None = None, *overrides: str, config_name: str | None = None):
    args = [f"+recipe={recipe}", *([f"+lag={lag}"] if lag else []), *SMALL_BATCH, *overrides]
    with initialize_config_module("verl.trainer.config", version_base=None):
        return compose(config_name or _config_name(recipe), overrides=with_recipes_searchpath(args))


@pytest.mark.parametrize("lag", [None, *LAGS])
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_builds_verl_dataclasses(recipe, lag):
    """Composed over verl's packaged config, verl's own dataclasses build from the result."""
    cfg = compose_recipe(recipe, lag)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)  # via each node's _target_, as verl does
    algorithm = omega_conf_to_dataclass(cfg.algorithm)
    assert isinstance(rollout, RolloutConfig) and isinstance(algorithm, AlgoConfig)
    loss_mode, family, bypass = EXPECTED[recipe]
    assert actor.policy_loss.loss_mode == loss_mode
    assert actor.loss_agg_mode == family["loss_agg_mode"]
    assert actor.clip_ratio_low == family["clip_ratio_low"] and actor.clip_ratio_high == family["clip_ratio_high"]
    assert algorithm.adv_estimator == "grpo"
    assert algorithm.rollout_correction["bypass_mode"] is bypass  # a plain dict in AlgoConfig
    assert isinstance(actor.policy_loss, SatPolicyLossConfig) == recipe.startswith("sat_")
    if recipe.startswith("sat_"):
        assert actor.policy_loss.sat == SatConfig()  # the paper's rule: the defaults
    r3 = recipe.endswith("_r3")
    assert rollout.enable_rollout_routing_replay is r3
    if r3:
        assert isinstance(actor, McoreActorConfig) and actor.megatron.router_replay.mode == "R3"
        assert cfg.actor_rollout_ref.ref.megatron.router_replay.mode == "disabled"  # never in the reference model
    if recipe == "tis":
        assert algorithm.rollout_correction["rollout_is"] == "token"
        assert algorithm.rollout_correction["rollout_is_threshold"] == 2.0
    check_config(cfg)  # the entry point's own checks pass


@pytest.mark.parametrize("lag,bound", [("lag1", 1), ("lag8", 8)])
def test_lag_keys_bound_the_version_gap(lag, bound):
    cfg = compose_recipe("sat_gspo", lag)
    v1 = cfg.trainer.v1
    assert cfg.trainer.use_v1 and v1.trainer_mode == "separate_async"
    assert v1.sampler.max_off_policy_threshold == bound + 1  # span <= L + 1 versions, i.e. staleness <= L
    assert v1.sampler.max_off_policy_strategy == "drop"
    assert v1.separate_async.num_warmup_batches == bound
    assert v1.separate_async.parameter_sync_step == 1
    # verl's separate_async trainer asserts train_batch_size == parameter_sync_step * ppo_mini_batch_size
    assert (
        cfg.data.train_batch_size
        == v1.separate_async.parameter_sync_step * cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    )
    assert cfg.actor_rollout_ref.rollout.checkpoint_engine.backend != "naive"


def test_sync_lag_is_the_synchronous_v1_trainer():
    cfg = compose_recipe("grpo", "sync")
    assert cfg.trainer.use_v1 and cfg.trainer.v1.trainer_mode == "sync"


def test_command_line_overrides_reach_the_dataclasses():
    cfg = compose_recipe(
        "sat_gspo",
        "lag8",
        "actor_rollout_ref.actor.clip_ratio_high=5e-4",
        "actor_rollout_ref.actor.policy_loss.sat.quantile=0.95",
        "actor_rollout_ref.actor.policy_loss.sat.kernel_exponent=3",
    )
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert actor.clip_ratio_high == 5e-4
    assert actor.policy_loss.sat.quantile == 0.95 and actor.policy_loss.sat.kernel_exponent == 3


def test_bad_override_fails_with_the_sat_config_error():
    cfg = compose_recipe("sat_gspo", "lag1", "actor_rollout_ref.actor.policy_loss.sat.quantile=1.5")
    with pytest.raises(PreflightError, match=r"policy_loss.sat.quantile=1.5 is invalid: expected a float in the open"):
        check_config(cfg)


def test_megatron_r3_under_fsdp_stops_at_start():
    cfg = compose_recipe("sat_gspo_r3", "lag8", config_name="ppo_trainer")
    with pytest.raises(
        PreflightError, match="Megatron routing replay .r3=megatron. but .*strategy='fsdp': add r3=fsdp"
    ):
        check_config(cfg)


@pytest.mark.parametrize("recipe", ["gspo_r3", "sat_grpo_r3", "sat_gspo_r3"])
def test_fsdp_r3_composes_and_builds(recipe):
    """``r3=fsdp`` selects verl-sat's FSDP routing replay with verl's own EngineRouterReplayConfig."""
    cfg = compose_recipe(recipe, "lag8", "r3=fsdp", config_name="ppo_trainer")
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert isinstance(actor.fsdp_config.router_replay, EngineRouterReplayConfig)
    assert actor.fsdp_config.router_replay.mode == "R3" and actor.engine.router_replay.mode == "R3"
    assert "megatron" not in cfg.actor_rollout_ref.actor
    assert (
        cfg.actor_rollout_ref.rollout.enable_rollout_routing_replay and cfg.actor_rollout_ref.model.use_remove_padding
    )
    assert "router_replay" not in cfg.actor_rollout_ref.ref.fsdp_config  # the reference model routes natively
    check_config(cfg)
    with initialize_config_module("verl.trainer.config", version_base=None):
        base = compose("ppo_trainer", overrides=SMALL_BATCH)
    keys = _flat_keys(OmegaConf.to_container(cfg, resolve=False))
    added = keys - _flat_keys(OmegaConf.to_container(base, resolve=False))
    added = {k for k in added if not k.startswith("actor_rollout_ref.actor.policy_loss.sat.")}
    assert added == {  # the one deliberate addition: verl's FSDP yaml has no router_replay block
        "actor_rollout_ref.actor.fsdp_config.router_replay._target_",
        "actor_rollout_ref.actor.fsdp_config.router_replay.mode",
    }


def test_fsdp_r3_without_replay_on_the_actor_is_refused():
    cfg = compose_recipe("sat_gspo", "lag1", "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
                         config_name="ppo_trainer")  # fmt: skip
    with pytest.raises(PreflightError, match=r"\+actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3"):
        check_config(cfg)


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
    ],
)  # fmt: skip
def test_preflight_warns_when_the_micro_batch_cannot_gate(overrides, warned):
    """SAT-GSPO's quantile is per micro-batch: a static micro-batch under 1 / (1 - alpha) sequences is named with
    the keys that fix it."""
    warnings = check_config(compose_recipe("sat_gspo", "lag1", *overrides))
    if warned is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and warned in warnings[0]
        assert "actor_rollout_ref.actor.use_dynamic_bsz=true" in warnings[0]
    assert (
        check_config(compose_recipe("sat_grpo", "lag1", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1")) == []
    )  # the token-level rule has many tokens in one sequence


def test_entry_point_prints_the_micro_batch_warning():
    proc = subprocess.run(
        [sys.executable, "-m", "verl_sat.main", "+recipe=sat_gspo", "+lag=lag1", *SMALL_BATCH,
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "--cfg", "job"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "verl-sat: warning: actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1" in proc.stderr


def test_legacy_trainer_with_bypass_is_refused():
    cfg = compose_recipe("sat_grpo", None, "trainer.use_v1=false")
    with pytest.raises(PreflightError, match="legacy trainer replaces"):
        check_config(cfg)


def _flat_keys(node: dict, prefix: str = "") -> set[str]:
    keys = set()
    for key, value in node.items():
        if isinstance(value, dict) and value:
            keys |= _flat_keys(value, f"{prefix}{key}.")
        else:
            keys.add(f"{prefix}{key}")
    return keys


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipes_only_set_keys_verl_defines(recipe):
    """Every key a recipe (with any lag) sets exists in verl's own config, except the deliberate `sat` block."""
    with initialize_config_module("verl.trainer.config", version_base=None):
        base = compose(_config_name(recipe), overrides=SMALL_BATCH)
    base_keys = _flat_keys(OmegaConf.to_container(base, resolve=False))
    for lag in LAGS:
        keys = _flat_keys(OmegaConf.to_container(compose_recipe(recipe, lag), resolve=False))
        added = sorted(k for k in keys - base_keys if not k.startswith("actor_rollout_ref.actor.policy_loss.sat."))
        assert added == [], f"{recipe}+{lag} adds keys verl does not define: {added}"


def _entry(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "verl_sat.main", *args], capture_output=True, text=True, timeout=600)


def test_entry_point_cfg_job_for_every_recipe_and_lag():
    """``python -m verl_sat.main +recipe=R +lag=L --cfg job`` prints the composed config and starts nothing."""
    cases = [(recipe, lag) for recipe in RECIPES for lag in LAGS]

    def run(case):
        recipe, lag = case
        extra = ["--config-name", "ppo_megatron_trainer"] if recipe.endswith("_r3") else []
        return case, _entry(*extra, f"+recipe={recipe}", f"+lag={lag}", "--cfg", "job")

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(run, cases))
    for (recipe, lag), proc in results:
        assert proc.returncode == 0, f"{recipe}+{lag}: {proc.stderr[-2000:]}"
        printed = OmegaConf.create(proc.stdout)
        assert printed.actor_rollout_ref.actor.policy_loss.loss_mode == EXPECTED[recipe][0]
        assert printed.trainer.v1.trainer_mode == ("sync" if lag == "sync" else "separate_async")


def test_entry_point_unknown_recipe_lists_valid_names():
    proc = _entry("+recipe=sat_gpso")
    assert proc.returncode != 0
    assert "Could not find 'recipe/sat_gpso'" in proc.stderr
    for name in RECIPES:
        assert f"\t{name}\n" in proc.stderr


def test_entry_point_reports_bad_value_before_ray():
    proc = _entry("+recipe=sat_gspo", "+lag=lag8", "actor_rollout_ref.actor.policy_loss.sat.kernel=gauss")
    assert proc.returncode == 1
    assert "verl-sat: actor_rollout_ref.actor.policy_loss does not build" in proc.stderr
    assert "sat.kernel='gauss' is invalid" in proc.stderr
    assert "ray" not in proc.stderr.lower()


def test_recipes_command_lists_every_recipe_and_lag():
    proc = subprocess.run([sys.executable, "-m", "verl_sat.cli", "recipes"], capture_output=True, text=True)
    assert proc.returncode == 0
    listed = {line.split()[0] for line in proc.stdout.splitlines() if line.startswith("  ")}
    assert listed == set(RECIPES) | set(LAGS)
    assert all(describe("recipe").values())


def test_wheel_ships_the_recipes(tmp_path):
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True).stdout.strip()
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), root],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("verl_sat-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for recipe in RECIPES:
        assert f"verl_sat/recipes/recipe/{recipe}.yaml" in names
    for lag in LAGS:
        assert f"verl_sat/recipes/lag/{lag}.yaml" in names
    assert "verl_sat/recipes/r3/megatron.yaml" in names and "verl_sat/recipes/r3/fsdp.yaml" in names
    assert "verl_sat/recipes/embedded/default.yaml" in names  # the embedded engine's defaults


def test_searchpath_goes_before_the_overrides_and_flags_first():
    args = ["--config-name", "ppo_megatron_trainer", "+recipe=gspo_r3", "--cfg", "job", "trainer.total_epochs=2"]
    assert with_recipes_searchpath(args) == [
        "--config-name", "ppo_megatron_trainer", "--cfg", "job",
        "hydra.searchpath=[pkg://verl_sat.recipes]", "+recipe=gspo_r3", "trainer.total_epochs=2",
    ]  # fmt: skip
    custom = ["+recipe=grpo", "hydra.searchpath=[pkg://my.recipes]"]
    assert with_recipes_searchpath(custom) == custom


@pytest.mark.parametrize(
    "script,loss_mode,threshold,r3",
    [
        ("run_qwen3_30b_a3b_sat_gspo_r3_megatron.sh", "sat_gspo", 9, True),
        ("run_qwen2_5_7b_sat_grpo_fsdp.sh", "sat", 2, False),
    ],
)
def test_example_scripts_compose(script, loss_mode, threshold, r3, tmp_path):
    """Every override in the example launch scripts is a key verl 0.9.1 knows (``--cfg job`` passed through)."""
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True).stdout.strip()
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(
        ["bash", f"{root}/examples/{script}", "--cfg", "job"], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = OmegaConf.create(proc.stdout)
    assert printed.actor_rollout_ref.actor.policy_loss.loss_mode == loss_mode
    assert printed.trainer.v1.sampler.max_off_policy_threshold == threshold
    assert printed.actor_rollout_ref.rollout.enable_rollout_routing_replay is r3
