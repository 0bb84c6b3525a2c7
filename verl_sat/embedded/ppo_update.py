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
"""One trainer step of the embedded engine, as verl's v1 trainer runs it, with verl's pieces.

Before any update (no grad): the reference policy's log-probs for the KL loss, ``old_log_prob`` (the rollout's mu in
bypass mode; in decoupled mode the trainer's own log-probs at the start of the sync cycle, with IS weights from
verl's rollout-correction helper), and π(ℓ) for the staleness attribution. Then the batch is trained as
``parameter_sync_step`` chunks of whole GRPO groups; each chunk runs ``ppo_epochs`` passes over its mini-batches,
one optimizer step each, micro-batches accumulated (``ppo_micro_batch_size_per_gpu`` sequences each, or packed by
verl's token budget under ``use_dynamic_bsz``, with verl's own ``prepare_micro_batches``). The loss is verl's
``ppo_loss`` (the registered policy loss, entropy and KL terms, global batch sizes), fed the packed per-token outputs
verl's engine produces. A non-finite gradient norm skips the optimizer step, as verl's engine does.
"""

import inspect
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from tensordict import TensorDict
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo.core_algos import get_adv_estimator_fn
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask
from verl.utils import tensordict_utils as tu
from verl.utils.metric.utils import Metric
from verl.utils.torch_functional import entropy_from_logits
from verl.workers.config import ActorConfig
from verl.workers.engine.utils import prepare_micro_batches
from verl.workers.utils.losses import ppo_loss

from verl_sat.config import sat_params_of
from verl_sat.embedded.attribution import StalenessSplit, sat_gate
from verl_sat.embedded.decode import position_ids, response_log_probs
from verl_sat.embedded.rollout import RolloutBatch
from verl_sat.embedded.run_files import MISMATCH
from verl_sat.mismatch import abs_log_ratio_sum
from verl_sat.routing_replay import RoutingReplay
from verl_sat.sat_math import CARRIED


@dataclass
class Policy:
    """A model and, for R3 recipes, the replay hooks attached to it."""

    model: torch.nn.Module
    routing: RoutingReplay | None = None


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


def forward(
    policy: Policy,
    batch: RolloutBatch,
    rows: torch.Tensor,
    temperature: float,
    with_entropy: bool = False,
    trim: bool = False,
):
    """``[n, R]`` log-probs of the sampled tokens for ``rows`` under ``logits / temperature`` (and their entropy),
    replaying the rollout's routes for R3. ``trim``: run the model only up to the rows' longest response (the padding
    after it cannot change a causal model's outputs before it), as verl's engine drops padding; 0 beyond."""
    device = next(policy.model.parameters()).device
    width = batch.input_ids.shape[1]
    if trim:
        width = batch.prompt_len + int(batch.response_mask[rows].sum(-1).max())
    ids, mask = batch.input_ids[rows, :width].to(device), batch.attention_mask[rows, :width].to(device)
    inputs = dict(input_ids=ids, attention_mask=mask.long(), position_ids=position_ids(mask))
    if policy.routing is None:
        logits = policy.model(**inputs).logits
    else:
        with policy.routing.replay(batch.routed_experts[rows, :width].to(device)):
            logits = policy.model(**inputs).logits
    prompt_len = batch.prompt_len
    log_prob = response_log_probs(logits, ids, prompt_len, temperature)
    entropy = entropy_from_logits(logits[:, prompt_len - 1 : -1].float() / temperature) if with_entropy else None
    pad = batch.input_ids.shape[1] - width
    if pad:
        log_prob = torch.nn.functional.pad(log_prob, (0, pad))
        entropy = None if entropy is None else torch.nn.functional.pad(entropy, (0, pad))
    return log_prob, entropy


@torch.no_grad()
def batch_log_probs(policy: Policy, batch: RolloutBatch, temperature: float, micro: int) -> torch.Tensor:
    """``[N, R]`` log-probs of the whole batch, micro-batch by micro-batch (no grad)."""
    rows = torch.arange(batch.input_ids.shape[0])
    return torch.cat([forward(policy, batch, part, temperature)[0].cpu() for part in rows.split(micro)])


def micro_batches(batch: RolloutBatch, rows: torch.Tensor, actor: ActorConfig, micro: int) -> list[torch.Tensor]:
    """The micro-batches of a mini-batch's ``rows``: ``micro`` sequences each, or, under ``use_dynamic_bsz``, as
    verl's engine packs them, at most ``ppo_max_token_len_per_gpu`` tokens (prompt + response) each, balanced."""
    if not actor.use_dynamic_bsz:
        return list(rows.split(micro))
    data = TensorDict({"input_ids": batch.input_ids[rows], "attention_mask": batch.attention_mask[rows].long()},
                      batch_size=[len(rows)])  # fmt: skip
    tu.assign_non_tensor(data, use_dynamic_bsz=True, max_token_len_per_gpu=actor.ppo_max_token_len_per_gpu)
    _, index_lists = prepare_micro_batches(data)
    return [rows[torch.tensor(index)] for index in index_lists]


def pack(values: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Per-response-token ``values`` ``[n, R]`` laid out as verl's engine returns model outputs: one packed row of
    all valid tokens, the value of response token j at the position of the token before it."""
    full = torch.zeros(attention_mask.shape, dtype=values.dtype, device=values.device)
    full = torch.cat([full[:, : prompt_len - 1], values, full[:, -1:]], dim=1)
    return full[attention_mask.to(values.device).bool()]


def micro_batch_loss(
    actor: ActorConfig,
    log_prob: torch.Tensor,
    entropy: torch.Tensor | None,
    fields: dict[str, torch.Tensor],
    batch_info: dict,
    prompt_len: int,
) -> tuple[torch.Tensor, dict]:
    """verl's ``ppo_loss`` on one micro-batch: ``fields`` are the padded ``[n, ...]`` tensors verl's engine hands it
    (prompts, responses, attention and response masks, old log-probs, advantages, optionally ``ref_log_prob`` and
    ``rollout_is_weights``), ``batch_info`` the mini-batch's global sizes; ``log_prob`` / ``entropy`` ``[n, R]`` go
    in packed, as the engine's model output."""
    device = log_prob.device
    data = TensorDict({key: value.to(device) for key, value in fields.items()}, batch_size=[log_prob.shape[0]])
    tu.assign_non_tensor(data, **batch_info)
    attention = fields["attention_mask"]
    output = {"log_probs": pack(log_prob, attention, prompt_len)}
    if entropy is not None:
        output["entropy"] = pack(entropy, attention, prompt_len)
    return ppo_loss(actor, output, data)


def _value(metric) -> float:
    return float(metric.aggregate()) if isinstance(metric, Metric) else float(metric)


def train_step(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    batch: RolloutBatch,
    actor: ActorConfig,
    algo: AlgoConfig,
    settings,
    shuffle_generator: torch.Generator,
    reference: Policy | None,
    at_version: Policy,
    after_optimizer_step: Callable[[int], None] | None = None,
) -> dict:
    """Train one batch; returns the step's metrics (per optimizer step averages, the last epoch's mismatch and
    attribution, the optimizer steps skipped for a non-finite gradient). ``after_optimizer_step(k)`` is called after
    the batch's k-th optimizer step (1-based; a skipped one counts)."""
    temperature, micro = settings.temperature, actor.ppo_micro_batch_size_per_gpu or batch.input_ids.shape[0]
    adv = advantages(batch, algo)
    mask = batch.response_mask.clone()
    rollout = batch.rollout_log_prob
    metrics_in: dict[str, list] = defaultdict(list)
    shapes: dict[str, list[int]] = defaultdict(list)  # micro-batches per optimizer step, sequences in the largest
    step_metrics: dict[str, float] = {}

    start = time.perf_counter()
    trainer_at_version = batch_log_probs(at_version, batch, temperature, micro)  # pi(l) of Eq. 2: the attribution
    step_metrics["timing/attribution_s"] = time.perf_counter() - start
    ref_log_prob = batch_log_probs(reference, batch, temperature, micro) if reference is not None else None
    is_weights = None
    if settings.bypass_mode:
        old_log_prob = rollout
    else:  # decoupled: pi_old is the trainer at the start of the sync cycle, the rollout enters through IS weights
        old_log_prob = batch_log_probs(policy, batch, temperature, micro)
        weights, mask, correction = compute_rollout_correction_and_rejection_mask(
            old_log_prob=old_log_prob, rollout_log_prob=rollout, response_mask=mask, **settings.rollout_correction
        )
        is_weights = None if weights is None else weights.batch["rollout_is_weights"]
        step_metrics.update(correction)

    loss_mode = actor.policy_loss.get("loss_mode", "vanilla")
    sat = sat_params_of(actor.policy_loss, loss_mode) if loss_mode in ("sat", "sat_gspo") else None
    clip_low = actor.clip_ratio_low if actor.clip_ratio_low is not None else actor.clip_ratio
    clip_high = actor.clip_ratio_high if actor.clip_ratio_high is not None else actor.clip_ratio
    split, mismatch = StalenessSplit(), torch.zeros(2)
    skipped, grad_norms = 0, []
    prompts = batch.input_ids.shape[0] // settings.n
    chunks = torch.arange(batch.input_ids.shape[0]).split(prompts // settings.sync_steps * settings.n)
    mini = actor.ppo_mini_batch_size * settings.n  # verl counts prompts; rows are prompts x rollout.n
    with_entropy = actor.entropy_coeff != 0
    for chunk in chunks:
        for epoch in range(actor.ppo_epochs):
            last_epoch = epoch == actor.ppo_epochs - 1
            order = chunk[torch.randperm(len(chunk), generator=shuffle_generator)] if actor.shuffle else chunk
            for mini_rows in order.split(mini):
                optimizer.zero_grad(set_to_none=True)
                info = dict(dp_size=1, batch_num_tokens=int(mask[mini_rows].sum()), global_batch_size=len(mini_rows))
                mini_metrics: dict[str, list] = defaultdict(list)
                parts = micro_batches(batch, mini_rows, actor, micro)
                shapes["perf/micro_batches"].append(len(parts))
                shapes["perf/max_sequences_per_micro_batch"].append(max(map(len, parts)))
                for rows in parts:
                    log_prob, entropy = forward(policy, batch, rows, temperature, with_entropy, actor.use_dynamic_bsz)
                    fields = {
                        "prompts": batch.input_ids[rows, : batch.prompt_len],
                        "responses": batch.input_ids[rows, batch.prompt_len :],
                        "attention_mask": batch.attention_mask[rows].long(),
                        "response_mask": mask[rows].long(),
                        "old_log_probs": old_log_prob[rows],
                        "advantages": adv[rows],
                    }
                    if ref_log_prob is not None:
                        fields["ref_log_prob"] = ref_log_prob[rows]
                    if is_weights is not None:
                        fields["rollout_is_weights"] = is_weights[rows]
                    # the carried sequences this call's sequence_carried quantile pools (the loss adds its own)
                    carried = CARRIED.pooled(log_prob) if sat is not None and sat.granularity == "sequence_carried" \
                        else None  # fmt: skip
                    loss, metrics = micro_batch_loss(actor, log_prob, entropy, fields, info, batch.prompt_len)
                    loss.backward()
                    for key, value in metrics.items():
                        mini_metrics[key].append(value)  # a Metric holds floats (it detaches on append)
                    if policy.routing is not None:
                        for key, value in policy.routing.replay_metrics().items():
                            mini_metrics[key].append(value)
                    if last_epoch:
                        active = mask[rows]
                        detached = log_prob.detach().cpu()
                        gated = sat_gate(loss_mode, sat, detached, old_log_prob[rows], adv[rows], active, clip_low,
                                         clip_high, carried)  # fmt: skip
                        split.add(detached, trainer_at_version[rows], rollout[rows], active, gated)
                        mismatch = mismatch + abs_log_ratio_sum(detached, rollout[rows], active)
                grad_norm = torch.nn.utils.clip_grad_norm_(policy.model.parameters(), actor.optim.clip_grad)
                if torch.isfinite(grad_norm):
                    optimizer.step()
                else:  # as verl's FSDP engine: a non-finite gradient skips the update
                    optimizer.zero_grad(set_to_none=True)
                    skipped += 1
                grad_norms.append(float(grad_norm))
                for key, values in mini_metrics.items():
                    metrics_in[key].append(_merge(values))
                if after_optimizer_step is not None:
                    after_optimizer_step(len(grad_norms))
    out = {key: float(np.mean(values)) for key, values in metrics_in.items()}
    out.update(step_metrics)
    out["perf/micro_batches"] = float(np.mean(shapes["perf/micro_batches"]))
    out["perf/max_sequences_per_micro_batch"] = max(shapes["perf/max_sequences_per_micro_batch"])
    out["actor/grad_norm"] = float(np.mean(grad_norms))
    out["actor/optimizer_steps"] = len(grad_norms)
    out["actor/skipped_optimizer_steps"] = skipped
    mismatch_sum, mismatch_tokens = mismatch.tolist()
    out[MISMATCH] = mismatch_sum / max(mismatch_tokens, 1)
    out.update(split.metrics())
    return out


def _merge(values: list) -> float:
    """One optimizer step's value of a metric from its micro-batches, aggregated as verl's ``Metric`` says (the
    policy loss sums, ratios average); plain numbers average."""
    if isinstance(values[0], Metric):
        merged = Metric(values[0].aggregation)
        for value in values:
            merged.extend(value)
        return _value(merged)
    return float(np.mean(values))
