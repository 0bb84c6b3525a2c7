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
"""``SatConfig`` / ``SatPolicyLossConfig``: defaults, validation errors, and building from verl's Hydra config."""

import pytest
from conftest import SAT_TARGET, actor_config, compose_verl
from hydra.errors import ConfigCompositionException
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import PolicyLossConfig

from verl_sat.config import SatConfig, SatPolicyLossConfig, sat_params_of


def test_defaults_match_the_spec():
    sat = SatConfig()
    assert (sat.quantile, sat.quantile_method, sat.kernel, sat.kernel_exponent, sat.min_scale, sat.floor,
            sat.granularity) == (0.9, "inverted_cdf", "hill", 2.0, 0.0, 0.0, "sequence")  # fmt: skip
    assert isinstance(SatPolicyLossConfig(), PolicyLossConfig)
    assert SatPolicyLossConfig().sat == sat


@pytest.mark.parametrize(
    "key,value,allowed",
    [
        ("quantile", 0.0, "(0, 1)"),
        ("quantile", 1.0, "(0, 1)"),
        ("kernel", "gauss", "['hill', 'hill_shifted']"),
        ("kernel_exponent", 0.0, "> 0"),
        ("min_scale", 1.5, "[0, 1]"),
        ("min_scale", -0.1, "[0, 1]"),
        ("floor", -1.0, ">= 0"),
        ("granularity", "batch", "['sequence', 'sequence_uniform', 'sequence_carried', 'token', 'token_ratio_side']"),
        ("quantile_method", "nearest", "['inverted_cdf', 'linear']"),
    ],
)
def test_bad_values_name_key_value_and_range(key, value, allowed):
    with pytest.raises(ValueError) as err:
        SatConfig(**{key: value})
    message = str(err.value)
    assert f"actor_rollout_ref.actor.policy_loss.sat.{key}={value!r}" in message
    assert allowed in message


@pytest.mark.parametrize("granularity", ["token", "sequence_uniform"])
def test_granularity_is_refused_for_the_token_level_loss(granularity):
    """``granularity`` selects the score unit of ``sat_gspo``; ``sat`` scores every token and refuses the key, both
    when verl builds the config and when the loss is called with a config built another way."""
    message = rf"policy_loss.sat.granularity='{granularity}' has no effect with loss_mode='sat'"
    with pytest.raises(ValueError, match=message):
        SatPolicyLossConfig(loss_mode="sat", sat={"granularity": granularity})
    with pytest.raises(Exception) as err:
        actor_config(f"+actor_rollout_ref.actor.policy_loss.sat.granularity={granularity}", loss_mode="sat")
    assert "has no effect with loss_mode='sat'" in str(err.value) + str(err.value.__cause__)
    assert SatPolicyLossConfig(loss_mode="sat_gspo", sat={"granularity": granularity}).sat.granularity == granularity


def test_unknown_sat_key_is_an_error():
    with pytest.raises(ValueError, match=r"unknown keys \['quantil'\]"):
        SatPolicyLossConfig(sat={"quantil": 0.5})


def test_built_from_verl_config_with_command_line_overrides():
    actor = actor_config(
        "+actor_rollout_ref.actor.policy_loss.sat.quantile=0.95",
        "+actor_rollout_ref.actor.policy_loss.sat.kernel_exponent=3",
        "+actor_rollout_ref.actor.policy_loss.sat.granularity=token",
        "actor_rollout_ref.actor.clip_ratio_high=5e-4",
        loss_mode="sat_gspo",
    )
    assert isinstance(actor.policy_loss, SatPolicyLossConfig)
    assert actor.policy_loss.loss_mode == "sat_gspo"
    assert actor.policy_loss.sat == SatConfig(quantile=0.95, kernel_exponent=3.0, granularity="token")
    assert actor.clip_ratio_high == 5e-4


def test_bad_override_fails_with_the_sat_error():
    with pytest.raises(Exception) as err:
        actor_config("+actor_rollout_ref.actor.policy_loss.sat.quantile=1.5")
    assert "actor_rollout_ref.actor.policy_loss.sat.quantile=1.5 is invalid" in str(err.value) + str(
        err.value.__cause__
    )


def test_sat_block_without_target_is_rejected_by_verl():
    """Without the SAT ``_target_``, verl's PolicyLossConfig refuses the extra block (nothing silently ignored)."""
    cfg = compose_verl(
        ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "+actor_rollout_ref.actor.policy_loss.sat.floor=1"]
    )
    with pytest.raises(Exception, match="sat"):
        omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def test_sat_key_without_plus_is_a_hydra_error():
    with pytest.raises(ConfigCompositionException):
        compose_verl([SAT_TARGET, "actor_rollout_ref.actor.policy_loss.sat.quantile=0.5"])


def test_sat_params_of_plain_verl_policy_loss_and_mappings():
    assert sat_params_of(PolicyLossConfig(loss_mode="sat")) == SatConfig()
    assert sat_params_of({"sat": {"quantile": 0.7}}).quantile == 0.7
    with pytest.raises(ValueError, match=r"policy_loss.sat.granularity='token' has no effect with loss_mode='sat'"):
        sat_params_of({"sat": {"granularity": "token"}}, "sat")
    assert sat_params_of({"sat": {"granularity": "token"}}, "sat_gspo").granularity == "token"
