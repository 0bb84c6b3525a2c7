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
"""The paper's train-inference mismatch ``d_pi`` (Eq. 52) for every row of Table 1 on verl's trainer.

``d_pi`` is the token-level mean ``|log pi - log mu|`` over the active tokens of a micro-batch, with ``pi`` the
trainer's log-prob in the update and ``mu`` the rollout engine's. verl 0.9.1 logs no such figure (its
``rollout_corr/log_ppl_abs_diff`` takes the absolute value of per-sequence means, before training, and only in
decoupled mode), and its policy losses never see ``mu`` in decoupled mode (the TIS rows), where ``old_log_prob`` is
the trainer's recomputed ``pi_old``. So verl-sat wraps verl's ``ppo_loss`` in the actor worker (``install``): the
wrapper reads ``mu`` from the micro-batch, ``rollout_log_probs`` in decoupled mode, ``old_log_probs`` in bypass mode
(where verl moved the rollout's log-probs there), and adds ``actor/mismatch_abs_log_ratio`` to the loss's metrics.

``install`` runs when a job's policy-loss config is verl-sat's (``verl_sat.config.SatPolicyLossConfig``, which every
recipe sets) in a process of verl's workers, so a verl job without verl-sat's config keeps verl's ``ppo_loss``. The
embedded engine logs the same figure under the same name from the same sums (``abs_log_ratio_sum``).
"""

import functools
import sys

import torch

MISMATCH_METRIC = "actor/mismatch_abs_log_ratio"
_WRAPPED = "_verl_sat_mismatch"


def abs_log_ratio_sum(log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of ``|log pi - log mu|`` (float32, or float64 for float64 inputs) over the active tokens whose difference
    is not NaN, and their count, stacked: ``[2]``. ``log_prob``, ``rollout_log_prob``, ``mask``: ``[B, T]``. No
    host read."""
    dtype = torch.float64 if log_prob.dtype == torch.float64 else torch.float32
    diff = log_prob.detach().to(dtype) - rollout_log_prob.to(dtype)
    active = mask.bool() & ~torch.isnan(diff)
    return torch.stack([torch.where(active, diff, 0.0).abs().sum(), active.sum().to(dtype)])


def mean_abs_log_ratio(log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor) -> float:
    """``d_pi`` (Eq. 52) of one micro-batch, ``[B, T]`` inputs; 0 with no active token. One host read."""
    total, count = abs_log_ratio_sum(log_prob, rollout_log_prob, mask).tolist()
    return total / count if count else 0.0


def with_mismatch_metric(ppo_loss):
    """verl's ``ppo_loss(config, model_output, data, dp_group=None)`` that also returns ``MISMATCH_METRIC``, from the
    model output's log-probs and the micro-batch's rollout log-probs, laid out by verl's own padding helper."""
    from verl.utils.metric.utils import AggregationType, Metric
    from verl.workers.utils.padding import no_padding_2_padding

    @functools.wraps(ppo_loss)
    def ppo_loss_with_mismatch(config, model_output, data, dp_group=None):
        loss, metrics = ppo_loss(config, model_output, data, dp_group=dp_group)
        rollout_key = "rollout_log_probs" if "rollout_log_probs" in data else "old_log_probs"
        log_prob = no_padding_2_padding(model_output["log_probs"].detach(), data)
        padded = data.select("response_mask", rollout_key).to_padded_tensor()
        value = mean_abs_log_ratio(log_prob, padded[rollout_key], padded["response_mask"])
        metrics[MISMATCH_METRIC] = Metric(aggregation=AggregationType.MEAN, value=value)
        return loss, metrics

    setattr(ppo_loss_with_mismatch, _WRAPPED, True)
    return ppo_loss_with_mismatch


def install() -> None:
    """Make verl's actor worker build its loss from ``with_mismatch_metric(ppo_loss)`` in this process (idempotent).
    The worker binds ``ppo_loss`` when it builds the actor, after it has built the actor's config; a process that has
    not imported verl's worker module (a driver, the embedded engine) binds nothing, and is left as it is."""
    engine_workers = sys.modules.get("verl.workers.engine_workers")
    if engine_workers is not None and not getattr(engine_workers.ppo_loss, _WRAPPED, False):
        engine_workers.ppo_loss = with_mismatch_metric(engine_workers.ppo_loss)
