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
"""Rollout routing replay (R3) under verl's FSDP engine for Hugging Face MoE models.

``actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3`` (verl's own ``EngineRouterReplayConfig``) makes the
actor replay the ``routed_experts`` the rollout engine returned, in both ``compute_log_prob`` and the update, on the
engine configurations tested on the CPU (FSDP1 and FSDP2, float32 and bf16 mixed precision, gradient
checkpointing, LoRA, Ulysses, dynamic batching, hybrid sharding on FSDP2; offload composes). A separate
reference model has its own engine config and keeps native routing. Under LoRA verl computes the reference log-probs
in the actor with the adapters off (``compute_log_prob`` with ``no_lora_adapter``): that pass replays too,
as in verl's Megatron R3, so the KL term compares actor and reference on the same routes.

verl 0.9.1's FSDP engine ignores ``routed_experts``. ``RoutingReplayFSDPEngine`` subclasses its
``FSDPEngineWithLMHead``; ``register_engine`` puts it in verl's ``EngineRegistry`` when a job's router-replay config
asks for R3 (``verl_sat.config.FSDPRouterReplayConfig``), so a job without R3 builds verl's own class.
"""

import logging

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.ulysses import slice_input_tensor
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

from verl_sat.routing_replay import RoutingReplay

logger = logging.getLogger(__name__)

FSDP_BACKENDS = ("fsdp", "fsdp2")


def micro_batch_routes(routed_experts: torch.Tensor, pad_size: int, sequence_parallel: bool) -> torch.Tensor:
    """This rank's replay targets for one packed micro-batch, laid out like the ``input_ids`` the model sees.

    Args:
        routed_experts: nested ``[bs, j, L, top_k]`` (as ``left_right_2_no_padding`` leaves it) or ``[nnz, L, top_k]``.
        pad_size: rows the engine appended to the packed sequence (static pad + Ulysses pad); they get zero rows,
            which route natively.
        sequence_parallel: slice along the tokens like ``input_ids`` under Ulysses sequence parallelism.

    Returns:
        int64 ``[(nnz + pad_size) / sp_size, L, top_k]``.
    """
    targets = (routed_experts.values() if routed_experts.is_nested else routed_experts).to(torch.int64)
    if pad_size:
        targets = torch.cat([targets, targets.new_zeros((pad_size, *targets.shape[1:]))])
    if sequence_parallel:
        targets = slice_input_tensor(targets, dim=0, padding=False)
    return targets


class RoutingReplayFSDPEngine(FSDPEngineWithLMHead):
    """verl's FSDP language-model engine with rollout routing replay (R3) for Hugging Face MoE models.

    The three overrides only call the hooks below them, which hold the logic; ``verl-sat upstream`` copies the hooks
    into verl's ``FSDPEngineWithLMHead`` and the same three calls into its methods.
    """

    _routing_replay: RoutingReplay | None = None
    # verl's per-call ``enable_routing_replay`` flag, as its worker sets it on the data: True for the actor's
    # ``compute_log_prob`` and update, False for ``compute_ref_log_prob``. Replay needs both that flag and
    # ``router_replay.mode=R3``, as in verl's Megatron and VeOmni engines. Where no flag is set (verl 0.9.1's worker
    # sets it only for the Megatron and VeOmni strategies), the engine config decides.
    _routing_replay_without_flag: bool = True

    def prepare_model_inputs(self, micro_batch: TensorDict):
        model_inputs, output_args = super().prepare_model_inputs(micro_batch)
        self._prepare_router_replay_inputs(micro_batch, output_args)
        return model_inputs, output_args

    def prepare_model_outputs(self, output, output_args, micro_batch: TensorDict, logits_processor_func):
        self._end_router_replay()
        return super().prepare_model_outputs(output, output_args, micro_batch, logits_processor_func)

    def forward_step(self, micro_batch: TensorDict, loss_function, forward_only):
        loss, output = super().forward_step(micro_batch, loss_function, forward_only)
        self._add_router_replay_metrics(output["metrics"])
        return loss, output

    # ---- routing-replay hooks -------------------------------------------------------------------------------------

    def _prepare_router_replay_inputs(self, micro_batch: TensorDict, output_args: dict) -> None:
        """Under ``router_replay.mode=R3``, unless the call's ``enable_routing_replay`` flag is False, arm replay of
        this packed micro-batch's ``routed_experts`` (laid out like its ``input_ids``: pad rows appended, sliced under
        Ulysses) for the forward that follows."""
        if self.engine_config.router_replay.mode != "R3":
            return
        flag = tu.get_non_tensor_data(data=micro_batch, key="enable_routing_replay", default=None)
        if not (self._routing_replay_without_flag if flag is None else flag):
            return
        if not tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True):
            raise RuntimeError(
                "router_replay.mode=R3 under the FSDP engine needs packed inputs: set "
                "actor_rollout_ref.model.use_remove_padding=True"
            )
        routed = micro_batch.get("routed_experts", None)
        if routed is None:
            raise RuntimeError(
                "router_replay.mode=R3: the micro-batch has no 'routed_experts'. Set "
                "actor_rollout_ref.rollout.enable_rollout_routing_replay=True so the rollout returns them."
            )
        if self._routing_replay is None:
            self._routing_replay = RoutingReplay.attach(self.module)
        targets = micro_batch_routes(routed, int(output_args.get("pad_size", 0)), self.use_ulysses_sp)
        self._routing_replay.begin_replay(targets)

    def _end_router_replay(self) -> None:
        """The replayed forward is done; the targets stay armed for a gradient-checkpointing recompute."""
        if self._routing_replay is not None:
            self._routing_replay.end_replay()

    def _add_router_replay_metrics(self, metrics: dict) -> None:
        """Add ``actor/r3_route_flip_frac`` and ``actor/r3_layers_replayed`` of the last replayed forward."""
        if self.engine_config.router_replay.mode == "R3" and self._routing_replay is not None:
            metrics.update(self._routing_replay.replay_metrics())


class RoutingReplayUnavailable(RuntimeError):
    """A job asks for R3 under FSDP but the engine verl would build cannot replay."""


def register_engine() -> None:
    """Put ``RoutingReplayFSDPEngine`` in verl's ``EngineRegistry`` for language models on the fsdp/fsdp2 backends
    (every device verl registered its ``FSDPEngineWithLMHead`` for), and make ``fsdp_turbo`` refuse R3.

    Called by ``verl_sat.config.FSDPRouterReplayConfig`` when a job asks for R3, never at import, so a job without R3
    keeps verl's own class. ``EngineRegistry.register`` refuses a key twice, so entries are replaced in place; an
    entry that is neither verl's class nor ours (another plugin's engine) raises, since it would ignore the routes.
    """
    language_models = EngineRegistry._engines["language_model"]
    for backend in FSDP_BACKENDS:
        for key, registered in language_models.get(backend, {}).items():
            if registered is FSDPEngineWithLMHead:
                language_models[backend][key] = RoutingReplayFSDPEngine
            elif registered is not RoutingReplayFSDPEngine:
                raise RoutingReplayUnavailable(
                    f"actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3, but verl's {backend}/{key} "
                    f"language-model engine is {registered.__module__}.{registered.__name__}, not verl's "
                    "FSDPEngineWithLMHead, and verl-sat cannot add routing replay to it: remove the other engine "
                    "plugin, or set router_replay.mode=disabled"
                )
    for key, registered in language_models.get("fsdp_turbo", {}).items():
        if not getattr(registered, "_refuses_routing_replay", False):
            language_models["fsdp_turbo"][key] = _refusing_routing_replay(registered)


def _refusing_routing_replay(engine_cls: type) -> type:
    """``engine_cls`` unchanged, except that building it with R3 raises (verl's fsdp_turbo engine has no replay)."""

    class RefusesRoutingReplay(engine_cls):
        _refuses_routing_replay = True

        def __init__(self, *args, **kwargs):
            engine_config = kwargs.get("engine_config")
            if getattr(getattr(engine_config, "router_replay", None), "mode", "disabled") != "disabled":
                raise RoutingReplayUnavailable(
                    "actor_rollout_ref.actor.strategy=fsdp_turbo has no routing replay, but "
                    "actor_rollout_ref.actor.fsdp_config.router_replay.mode is not disabled: use strategy=fsdp2 "
                    "(verl-sat's R3) or set router_replay.mode=disabled"
                )
            super().__init__(*args, **kwargs)

    RefusesRoutingReplay.__name__ = RefusesRoutingReplay.__qualname__ = f"{engine_cls.__name__}RefusesRoutingReplay"
    return RefusesRoutingReplay
