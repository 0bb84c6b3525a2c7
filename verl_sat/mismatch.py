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
the trainer's recomputed ``pi_old``.

So ``install`` wraps two things in a process of verl's workers, both without touching what they compute:

- the ``ppo_loss`` verl's actor worker binds, which now makes the micro-batch's ``rollout_log_probs`` (decoupled mode;
  absent in bypass mode, where verl moved them to ``old_log_probs``) visible to the policy loss it calls;
- the job's registered policy loss, which, called from that ``ppo_loss``, adds ``actor/mismatch_abs_log_ratio`` from
  the padded ``log_prob`` verl already built and ``mu`` (``rollout_log_probs``, else ``old_log_prob``): one device
  read per micro-batch, no padding of its own. Called from anywhere else (the embedded engine, a test), it is the
  loss as registered.

verl averages the metric over micro-batches like its other loss metrics (``ppo_kl``): each micro-batch's token mean
counts once. ``install`` runs when a job's policy-loss config is verl-sat's (``verl_sat.config.SatPolicyLossConfig``,
which every recipe sets), so a verl job without it keeps verl's functions. The embedded engine logs the same figure
under the same name, as the token mean of the step's last epoch (``abs_log_ratio_sum``).
"""

import functools
import sys
from contextvars import ContextVar

import torch

MISMATCH_METRIC = "actor/mismatch_abs_log_ratio"
_WRAPPED = "_verl_sat_mismatch"
# inside the wrapped ppo_loss: a 1-tuple holding the micro-batch's rollout_log_probs (or None)
_ROLLOUT_LOG_PROBS: ContextVar[tuple | None] = ContextVar("verl_sat_rollout_log_probs", default=None)


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


def with_rollout_log_probs(ppo_loss):
    """verl's ``ppo_loss(config, model_output, data, dp_group=None)`` that lets the policy loss it calls see the
    micro-batch's ``rollout_log_probs`` (``None`` when it has none)."""

    @functools.wraps(ppo_loss)
    def ppo_loss_with_rollout_log_probs(config, model_output, data, dp_group=None):
        token = _ROLLOUT_LOG_PROBS.set((data.get("rollout_log_probs", None),))
        try:
            return ppo_loss(config, model_output, data, dp_group=dp_group)
        finally:
            _ROLLOUT_LOG_PROBS.reset(token)

    setattr(ppo_loss_with_rollout_log_probs, _WRAPPED, True)
    return ppo_loss_with_rollout_log_probs


def with_mismatch_metric(policy_loss_fn):
    """A registered policy loss that, inside ``with_rollout_log_probs``' ``ppo_loss``, also returns
    ``MISMATCH_METRIC``; elsewhere it is ``policy_loss_fn`` unchanged. Inputs as verl's ``PolicyLossFn``, ``[B, T]``."""

    @functools.wraps(policy_loss_fn)
    def policy_loss_with_mismatch(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                  config=None, rollout_is_weights=None):  # fmt: skip
        pg_loss, metrics = policy_loss_fn(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages,
                                          response_mask=response_mask, loss_agg_mode=loss_agg_mode, config=config,
                                          rollout_is_weights=rollout_is_weights)  # fmt: skip
        context = _ROLLOUT_LOG_PROBS.get()
        if context is not None:
            rollout = context[0]
            if rollout is None:  # bypass mode: old_log_prob is the rollout's
                rollout = old_log_prob
            elif rollout.is_nested:  # laid out as the loss's inputs, with the size given: no host read
                rollout = torch.nested.to_padded_tensor(rollout, 0.0, output_size=tuple(log_prob.shape))
            metrics[MISMATCH_METRIC] = mean_abs_log_ratio(log_prob, rollout, response_mask)
        return pg_loss, metrics

    setattr(policy_loss_with_mismatch, _WRAPPED, True)
    return policy_loss_with_mismatch


def install(loss_mode: str) -> None:
    """In a process that has imported verl's worker module: wrap the ``ppo_loss`` its actor binds (it binds it after
    building the actor's config) and the registered ``loss_mode`` (idempotent). A process without verl's workers (a
    driver, the embedded engine) is left as it is."""
    engine_workers = sys.modules.get("verl.workers.engine_workers")
    if engine_workers is None:
        return
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    if not getattr(engine_workers.ppo_loss, _WRAPPED, False):
        engine_workers.ppo_loss = with_rollout_log_probs(engine_workers.ppo_loss)
    registered = POLICY_LOSS_REGISTRY.get(loss_mode)
    if registered is not None and not getattr(registered, _WRAPPED, False):
        POLICY_LOSS_REGISTRY[loss_mode] = with_mismatch_metric(registered)
