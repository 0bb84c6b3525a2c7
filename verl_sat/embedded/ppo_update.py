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
"""One trainer step of the embedded engine with verl's pieces: the registered advantage estimator, the registered
policy loss (``get_policy_loss_fn``) aggregated with the global mini-batch sizes (``global_batch_info``, as verl's
``ppo_loss`` sets them), mini-batches, micro-batches and epochs from ``ActorConfig``, and R3 replay."""

import inspect
from collections import defaultdict

import torch
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo.core_algos import get_adv_estimator_fn, get_policy_loss_fn
from verl.utils.torch_functional import masked_sum
from verl.workers.config import ActorConfig

from verl_sat.embedded.rollout import RolloutBatch, position_ids, response_log_probs
from verl_sat.routing_replay import RoutingReplay


def advantages(batch: RolloutBatch, algo: AlgoConfig) -> torch.Tensor:
    """``[N, R]`` advantages from verl's registered estimator; the score sits on the last response token."""
    mask = batch.response_mask.float()
    last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & batch.response_mask
    token_level_rewards = torch.where(last, batch.scores[:, None], 0.0)
    estimator = get_adv_estimator_fn(algo.adv_estimator)
    kwargs = dict(token_level_rewards=token_level_rewards, response_mask=mask, index=batch.uids, config=algo)
    if "norm_adv_by_std_in_grpo" in inspect.signature(estimator).parameters:
        kwargs["norm_adv_by_std_in_grpo"] = algo.norm_adv_by_std_in_grpo
    return estimator(**kwargs)[0]


def micro_log_probs(
    model, batch: RolloutBatch, rows: torch.Tensor, temperature: float, routing: RoutingReplay | None
) -> torch.Tensor:
    """``[n, R]`` trainer log-probs of the sampled tokens for ``rows``, replaying the rollout's routes if R3."""
    device = next(model.parameters()).device
    ids, mask = batch.input_ids[rows].to(device), batch.attention_mask[rows].to(device)
    forward = dict(input_ids=ids, attention_mask=mask.long(), position_ids=position_ids(mask))
    if routing is None:
        logits = model(**forward).logits
    else:
        with routing.replay(batch.routed_experts[rows].to(device)):
            logits = model(**forward).logits
    return response_log_probs(logits, ids, ids.shape[1] - batch.response_mask.shape[1], temperature)


def ppo_update(
    model,
    optimizer,
    batch: RolloutBatch,
    actor: ActorConfig,
    algo: AlgoConfig,
    n: int,
    temperature: float,
    routing: RoutingReplay | None,
    generator: torch.Generator,
) -> dict[str, float]:
    """Epochs x mini-batches of optimizer steps on ``batch``; returns the step's metrics (micro-batch means; the
    mismatch is the mean |log_prob - old_log_prob| of the last epoch)."""
    device = next(model.parameters()).device
    adv = advantages(batch, algo)
    loss_fn = get_policy_loss_fn(actor.policy_loss.get("loss_mode", "vanilla"))
    num = batch.input_ids.shape[0]
    mini = actor.ppo_mini_batch_size * n
    micro = actor.ppo_micro_batch_size_per_gpu or mini
    sums, counts = defaultdict(float), defaultdict(int)
    mismatch_sum, mismatch_tokens = 0.0, 0
    for epoch in range(actor.ppo_epochs):
        order = torch.randperm(num, generator=generator) if actor.shuffle else torch.arange(num)
        last_epoch = epoch == actor.ppo_epochs - 1
        for mini_rows in order.split(mini):
            optimizer.zero_grad(set_to_none=True)
            response_mask = batch.response_mask[mini_rows]
            actor.global_batch_info.update(
                dp_size=1,
                batch_num_tokens=int(response_mask.sum()),
                global_batch_size=len(mini_rows),
                loss_scale_factor=actor.loss_scale_factor,
            )
            mini_loss = 0.0
            for rows in mini_rows.split(micro):
                mask = batch.response_mask[rows].to(device)
                log_prob = micro_log_probs(model, batch, rows, temperature, routing)
                old_log_prob = batch.old_log_prob[rows].to(device)
                loss, metrics = loss_fn(
                    old_log_prob=old_log_prob,
                    log_prob=log_prob,
                    advantages=adv[rows].to(device),
                    response_mask=mask,
                    loss_agg_mode=actor.loss_agg_mode,
                    config=actor,
                    rollout_is_weights=None,
                )
                loss.backward()
                mini_loss += float(loss.detach())  # micro-batch losses are scaled to sum to the mini-batch loss
                for key, value in {**metrics, **(routing.replay_metrics() if routing else {})}.items():
                    sums[key] += float(value)
                    counts[key] += 1
                if last_epoch:
                    mismatch_sum += float(masked_sum((log_prob.detach() - old_log_prob).abs(), mask))
                    mismatch_tokens += int(mask.sum())
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), actor.optim.clip_grad)
            for key, value in (("actor/pg_loss", mini_loss), ("actor/grad_norm", float(grad_norm))):
                sums[key] += value
                counts[key] += 1
            optimizer.step()
    out = {key: sums[key] / counts[key] for key in sums}
    out["actor/mismatch_abs_log_ratio"] = mismatch_sum / max(mismatch_tokens, 1)
    return out
