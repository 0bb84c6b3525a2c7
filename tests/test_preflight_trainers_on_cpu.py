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
"""The preflight says what verl's trainers would say once Ray is up: separate_async's start-up asserts, the
fully-async rollout pool where verl reads it, and the lag presets for any N on every trainer. Each mirrored assert is
pinned to verl 0.9.1's code."""

import inspect
from importlib.resources import files

import pytest
from omegaconf import OmegaConf
from verl.experimental.fully_async_policy import fully_async_main
from verl.trainer.ppo.v1 import trainer_base, trainer_separate_async

from verl_sat.lag_presets import generate
from verl_sat.main import compose_job, with_recipes_searchpath
from verl_sat.preflight import PreflightError, check_config, check_sizes, check_trainer_startup

POOL = ("actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=8")
FULLY_ASYNC = ("--config-name", "fully_async_ppo_trainer", "data.train_batch_size=0",
               "actor_rollout_ref.hybrid_engine=false")  # fmt: skip
TRAINERS = {"separate_async": POOL, "colocate_async": ("trainer.v1.trainer_mode=colocate_async",),
            "fully_async": FULLY_ASYNC}  # fmt: skip


def _job(*args: str):
    return compose_job(with_recipes_searchpath(["+recipe=sat_gspo", *args]))[1]


def _all_checks(config) -> list[str]:
    warnings = check_config(config)
    check_sizes(config)
    return [*warnings, *check_trainer_startup(config)]


def test_pinned_separate_async_startup_asserts():
    """The asserts ``_check_separate_async`` mirrors, as verl 0.9.1 writes them."""
    init = inspect.getsource(trainer_separate_async.PPOTrainerSeparateAsync.__init__)
    for line in (
        "assert train_batch_size == parameter_sync_step * ppo_mini_batch_size",
        "assert config.actor_rollout_ref.rollout.nnodes > 0",
        "assert config.actor_rollout_ref.rollout.n_gpus_per_node > 0",
        'assert config.actor_rollout_ref.rollout.checkpoint_engine.backend != "naive"',
        "if need_reward_model(config):\n            assert config.reward.reward_model.enable_resource_pool",
    ):
        assert line in init, line
    assert "ppo_mini_batch_size = config.actor_rollout_ref.actor.ppo_mini_batch_size" in init
    assert "parameter_sync_step = config.trainer.v1.separate_async.parameter_sync_step" in init


def test_pinned_fully_async_rollout_pool_is_copied_in_its_main():
    main = inspect.getsource(fully_async_main.main)
    assert "config.actor_rollout_ref.rollout.nnodes = config.rollout.nnodes" in main
    assert "config.actor_rollout_ref.rollout.n_gpus_per_node = config.rollout.n_gpus_per_node" in main


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["actor_rollout_ref.actor.ppo_mini_batch_size=64"],
         r"data.train_batch_size=256 but trainer.v1.separate_async.parameter_sync_step x "
         r"actor_rollout_ref.actor.ppo_mini_batch_size = 8 x 64 = 512: verl's separate-async trainer asserts"),
        (["actor_rollout_ref.rollout.nnodes=0"],
         r"actor_rollout_ref.rollout.nnodes=0: verl's separate-async trainer asserts > 0"),
        (["actor_rollout_ref.rollout.n_gpus_per_node=0"],
         r"actor_rollout_ref.rollout.n_gpus_per_node=0: verl's separate-async trainer asserts > 0"),
        (["actor_rollout_ref.rollout.checkpoint_engine.backend=naive"],
         r"checkpoint_engine.backend='naive': verl's separate-async trainer refuses it"),
        (["reward.reward_model.enable=true", "reward.reward_model.enable_resource_pool=false",
          "reward.reward_model.model_path=RM"],
         r"reward.reward_model.enable_resource_pool=false with a reward model"),
    ],
    ids=["batch", "nnodes", "gpus", "naive", "reward-pool"],
)  # fmt: skip
def test_separate_async_startup_asserts_refused_before_ray(overrides, message):
    config = _job("+lag=lag8", "data.train_batch_size=256", *POOL, *overrides)
    check_config(config)
    with pytest.raises(PreflightError, match=message):
        check_trainer_startup(config)


def test_separate_async_warns_that_its_gap_needs_fast_generation():
    warnings = check_trainer_startup(_job("+lag=lag8", "data.train_batch_size=256", *POOL))
    assert len(warnings) == 1
    assert "gives the gap 8..15 optimizer steps only while generation outpaces training" in warnings[0]
    fixed = check_trainer_startup(_job("+lag=fixed8", "data.train_batch_size=32", *POOL))
    assert "gives the gap 8 optimizer steps only while" in fixed[0]


def test_sat_in_decoupled_mode_warns_that_it_measures_drift_since_pi_old():
    """Decoupled mode (a correction recipe) hands SAT pi_old, not mu; the paper's bypass-mode rows stay silent."""

    def warned(recipe: str) -> list[str]:
        config = compose_job(with_recipes_searchpath([f"+recipe={recipe}"]))[1]
        return [w for w in check_config(config) if "decoupled mode" in w]

    decoupled = warned("sat_gspo_icepop")
    assert len(decoupled) == 1 and "log pi - log pi_old" in decoupled[0] and "bypass_mode=true" in decoupled[0]
    for recipe in ("sat_gspo", "gspo_icepop", "sat_grpo"):
        assert not warned(recipe), recipe


def test_pinned_v1_bypass_mode_reads_no_rollout_correction():
    """verl's v1 trainers in bypass mode copy the rollout's log-probs and skip the correction, and never rewrite the
    loss (the legacy and fully-async trainers call ``apply_bypass_mode``)."""
    old_log_prob = inspect.getsource(trainer_base.PPOTrainer._compute_old_log_prob)
    assert 'data["old_log_probs"] = data.pop("rollout_log_probs")' in old_log_prob
    assert "return batch" in old_log_prob.split("if bypass_recomputing_logprobs:")[1].split("# 1. compute log probs")[0]
    advantage = inspect.getsource(trainer_base.PPOTrainer._compute_advantage)
    assert "and not bypass_recomputing_logprobs" in advantage
    separate = inspect.getsource(trainer_separate_async.PPOTrainerSeparateAsync._compute_old_log_prob)
    assert (
        "return super()._compute_old_log_prob(batch, metrics)" in separate.split("if bypass_recomputing_logprobs:")[1]
    )
    assert "apply_bypass_mode" not in inspect.getsource(trainer_base)


@pytest.mark.parametrize("lag", ["+lag=lag8", "+lag=colocate_async/lag8"])
def test_bypass_presets_beyond_ppo_clip_warn_on_the_v1_trainers(lag):
    """verl's bypass_ppo_clip_geo_rs and bypass_pg_is keys are named as unread; bypass_ppo_clip is silent."""
    geo = [
        "algorithm.rollout_correction.rollout_rs=seq_mean_k1",
        "algorithm.rollout_correction.rollout_rs_threshold=0.999_1.001",
    ]
    pg = ["algorithm.rollout_correction.rollout_is=sequence", "algorithm.rollout_correction.loss_type=reinforce"]
    for extra, keys in ((geo, ["rollout_rs"]), (pg, ["rollout_is", "loss_type"]), ([], [])):
        warned = [w for w in check_config(_job(lag, *extra)) if "with bypass_mode=true is not read" in w]
        assert [w.split("=", 1)[0] for w in warned] == [f"algorithm.rollout_correction.{k}" for k in keys], extra


def test_fully_async_rollout_pool_is_the_top_level_one():
    """4 trainer GPUs and an 8-GPU rollout pool with rollout TP 8 is a valid fully-async layout; TP 3 is not, and the
    message names the keys verl reads."""
    layout = ("trainer.n_gpus_per_node=4", "rollout.nnodes=1", "rollout.n_gpus_per_node=8",
              "actor_rollout_ref.actor.ppo_mini_batch_size=4")  # fmt: skip
    check_sizes(_job(*FULLY_ASYNC, "+lag=lag8", *layout, "actor_rollout_ref.rollout.tensor_model_parallel_size=8"))
    with pytest.raises(PreflightError, match=r"3 x 1 x 1 does not divide the 8 rollout GPUs \(rollout.nnodes x "
                                             r"rollout.n_gpus_per_node\)"):  # fmt: skip
        check_sizes(_job(*FULLY_ASYNC, "+lag=lag8", *layout, "actor_rollout_ref.rollout.tensor_model_parallel_size=3"))


@pytest.mark.parametrize("folder", [None, "colocate_async", "fully_async"])
def test_generated_presets_reproduce_the_shipped_ones(folder):
    """The rule behind ``+lag=lagN`` / ``fixedN`` gives exactly the shipped lag1, lag8 and fixed8 files."""
    lag = files("verl_sat.recipes").joinpath("lag", *([folder] if folder else []))
    for kind, n in (("lag", 1), ("lag", 8), ("fixed", 8)):
        shipped = OmegaConf.create(lag.joinpath(f"{kind}{n}.yaml").read_text())
        assert OmegaConf.to_container(generate(folder, kind, n)) == OmegaConf.to_container(shipped), (folder, kind, n)


def test_every_lag_preset_pins_one_epoch():
    for preset in files("verl_sat.recipes").joinpath("lag").rglob("*.yaml"):
        assert OmegaConf.create(preset.read_text()).actor_rollout_ref.actor.ppo_epochs == 1, preset


@pytest.mark.parametrize("trainer", TRAINERS)
def test_any_lag_on_every_trainer(trainer):
    """``+lag=lag3`` and ``+lag=fixed5`` compose in the selected trainer's own keys and pass the same checks."""
    batch = (
        ("data.train_batch_size=24",)
        if trainer != "fully_async"
        else ("actor_rollout_ref.actor.ppo_mini_batch_size=8",)
    )
    lag3 = _job(*TRAINERS[trainer], "+lag=lag3", *batch)
    fixed5 = _job(*TRAINERS[trainer], "+lag=fixed5", *batch)
    for config in (lag3, fixed5):
        _all_checks(config)
    if trainer == "separate_async":
        assert (
            lag3.trainer.v1.separate_async.parameter_sync_step == 3
            and lag3.actor_rollout_ref.actor.ppo_mini_batch_size == 8
        )
        assert fixed5.trainer.v1.separate_async.num_warmup_batches == 5
        assert fixed5.trainer.v1.sampler.max_off_policy_threshold == 6
    elif trainer == "colocate_async":
        assert lag3.actor_rollout_ref.actor.ppo_mini_batch_size == 8
        assert fixed5.trainer.v1.colocate_async.num_warmup_batches == 5
    else:
        assert lag3.async_training.trigger_parameter_sync_step == 3
        assert fixed5.async_training.staleness_threshold == 5
