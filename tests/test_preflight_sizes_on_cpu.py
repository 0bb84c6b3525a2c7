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
"""``verl_sat.preflight.check_sizes`` on verl 0.9.1's composed configs: what verl asserts only once its workers run
(dynamic-batch token budgets, Megatron's parallel groups, the rollout's TP, the batch split) fails before Ray starts,
naming the keys and the numbers."""

import functools

import pytest
from hydra import compose, initialize_config_module

from verl_sat.preflight import PreflightError, check_sizes

FSDP = ["data.max_prompt_length=2048", "data.max_response_length=32768", "data.train_batch_size=256",
        "actor_rollout_ref.actor.ppo_mini_batch_size=256", "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=34816", "actor_rollout_ref.rollout.n=16",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=4", "trainer.nnodes=2",
        "trainer.n_gpus_per_node=8"]  # fmt: skip
MEGATRON = [*FSDP, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
            "actor_rollout_ref.actor.megatron.expert_model_parallel_size=8"]  # fmt: skip


@functools.cache
def _compose(name: str, overrides: tuple[str, ...]):
    with initialize_config_module("verl.trainer.config", version_base=None):
        return compose(name, overrides=list(overrides))


def _check(name: str, base: list[str], *overrides: str) -> None:
    check_sizes(_compose(name, (*base, *overrides)))


def test_the_papers_sizes_pass():
    _check("ppo_trainer", FSDP)
    _check("ppo_megatron_trainer", MEGATRON, "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1")


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=32768"],
            r"actor_rollout_ref.actor.ppo_max_token_len_per_gpu=32768 \(x 1-way sequence parallelism\) is below the "
            r"longest sequence, data.max_prompt_length \+ data.max_response_length = 2048 \+ 32768 = 34816: .* Set "
            r"actor_rollout_ref.actor.ppo_max_token_len_per_gpu >= 34816",
        ),
        (
            ["actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=16384"],
            r"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=16384 .* = 34816",
        ),
        (
            ["actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=4096"],
            r"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=4096",
        ),
        (
            ["actor_rollout_ref.rollout.tensor_model_parallel_size=3"],
            r"actor_rollout_ref.rollout.\{tensor_model,data,pipeline_model\}_parallel_size = 3 x 1 x 1 does not divide "
            r"the 16 rollout GPUs \(trainer.nnodes x trainer.n_gpus_per_node, shared with training\)",
        ),
        (
            ["actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=6"],
            r"does not divide the 6 rollout GPUs \(actor_rollout_ref.rollout.nnodes x n_gpus_per_node\)",
        ),
        (
            ["actor_rollout_ref.actor.ppo_mini_batch_size=96"],
            r"actor_rollout_ref.actor.ppo_mini_batch_size=96 does not divide data.train_batch_size=256",
        ),
        (
            [
                "data.train_batch_size=3",
                "actor_rollout_ref.actor.ppo_mini_batch_size=3",
                "actor_rollout_ref.rollout.n=1",
            ],
            r"a mini-batch's 3 samples .* do not divide over the trainer's 16 data-parallel ranks",
        ),
    ],
    ids=["actor-budget", "rollout-budget", "ref-budget", "rollout-tp", "rollout-pool", "mini-batch", "dp"],
)
def test_fsdp_sizes_that_verl_would_refuse_after_ray_started(overrides, message):
    with pytest.raises(PreflightError, match=message):
        _check("ppo_trainer", FSDP, *overrides)


def test_sequence_parallelism_multiplies_the_budget():
    overrides = ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu=17408",
                 "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2")  # fmt: skip
    _check("ppo_trainer", FSDP, *overrides)
    with pytest.raises(PreflightError, match=r"=16384 \(x 2-way sequence parallelism\) .* >= 17408"):
        _check("ppo_trainer", FSDP, *overrides, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384")


def test_the_ref_budget_is_checked_only_when_the_reference_model_runs():
    _check("ppo_trainer", FSDP, "actor_rollout_ref.actor.use_kl_loss=false",
           "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=4096")  # fmt: skip


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            [],
            r"actor_rollout_ref.actor.megatron.\{expert_tensor,expert_model,pipeline_model\}_parallel_size = "
            r"4 x 8 x 1 = 32 does not divide the trainer's 16 GPUs \(trainer.nnodes x trainer.n_gpus_per_node\); "
            r"expert_tensor_parallel_size is unset, so Megatron-core takes it equal to tensor_model_parallel_size "
            r"\(4\): set actor_rollout_ref.actor.megatron.expert_tensor_parallel_size",
        ),
        (
            [
                "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1",
                "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3",
            ],
            r"\{tensor_model,pipeline_model,context\}_parallel_size = 3 x 1 x 1 = 3 does not divide the trainer's 16",
        ),
        (
            [
                "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1",
                "actor_rollout_ref.actor.megatron.context_parallel_size=2",
                "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384",
            ],
            r"=16384 \(x 2-way sequence parallelism\) is below",
        ),
    ],
    ids=["etp-defaults-to-tp", "tp", "context-parallel-budget"],
)
def test_megatron_sizes(overrides, message):
    with pytest.raises(PreflightError, match=message):
        _check("ppo_megatron_trainer", MEGATRON, *overrides)
