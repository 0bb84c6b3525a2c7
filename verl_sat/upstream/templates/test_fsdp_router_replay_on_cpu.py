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
"""Rollout routing replay (R3) under the FSDP engine: the model-level replay of Hugging Face MoE routers, the engine's
arming of a packed micro-batch (``routed_experts`` laid out like ``input_ids``), and the actor config's checks."""

import os

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from tensordict import TensorDict
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import verl
from verl.models.transformers.router_replay import RoutingReplay
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import EngineRouterReplayConfig, FSDPActorConfig, FSDPEngineConfig
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.utils.padding import left_right_2_no_padding

VOCAB, EXPERTS, TOP_K = 64, 4, 2


def _tiny_moe() -> Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, norm_topk_prob=True,
    )  # fmt: skip
    return Qwen3MoeForCausalLM(config).eval()


def _other_routes(routes: torch.Tensor) -> torch.Tensor:
    """Valid routes that differ from ``routes`` everywhere (each expert id shifted by one); zero rows stay zero."""
    shifted = (routes.long() + 1) % EXPERTS
    return torch.where(routes.long().abs().sum(-1, keepdim=True) > 0, shifted, 0).to(routes.dtype)


def test_replaying_recorded_routes_reproduces_the_forward_and_other_routes_change_it():
    model = _tiny_moe()
    input_ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    replay = RoutingReplay.attach(model)
    with torch.no_grad(), replay.record() as recorded:
        native = model(input_ids=input_ids).logits
    routes = recorded.routed_experts
    assert routes.shape == (2, 7, 2, TOP_K) and routes.dtype == torch.int16
    with torch.no_grad(), replay.replay(routes):
        assert torch.equal(model(input_ids=input_ids).logits, native)
    assert replay.replay_metrics()["actor/r3_route_flip_frac"] == 0.0
    with torch.no_grad(), replay.replay(_other_routes(routes)):
        assert not torch.allclose(model(input_ids=input_ids).logits, native)
    assert replay.replay_metrics()["actor/r3_route_flip_frac"] == 1.0
    replay.detach()


def _engine(model, mode: str = "R3") -> FSDPEngineWithLMHead:
    engine = FSDPEngineWithLMHead.__new__(FSDPEngineWithLMHead)  # only what the routing-replay hooks read
    engine.engine_config = OmegaConf.create({"router_replay": {"mode": mode}})
    engine.module, engine.use_ulysses_sp = model, False
    return engine


def _micro_batch(model, lengths: list[int], routes_of=lambda routes: routes, flag: bool | None = True) -> TensorDict:
    """A padded batch with per-sequence recorded routes, converted to verl's packed layout, with the per-call
    ``enable_routing_replay`` flag verl's worker sets (``None``: not set)."""
    bs, seq = len(lengths), max(lengths) + 2
    attention_mask = (torch.arange(seq).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()
    input_ids = torch.randint(1, VOCAB, (bs, seq), generator=torch.Generator().manual_seed(1)) * attention_mask
    routes = torch.zeros(bs, seq, model.config.num_hidden_layers, TOP_K, dtype=torch.int16)
    replay = RoutingReplay.attach(model)
    with torch.no_grad(), replay.record() as recorded:
        for i, n in enumerate(lengths):
            model(input_ids=input_ids[i : i + 1, :n])
            routes[i, :n] = recorded.routed_experts[0]
    replay.detach()
    data = {"input_ids": input_ids, "attention_mask": attention_mask, "routed_experts": routes_of(routes)}
    data["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    data["response_mask"] = attention_mask[:, 1:]
    micro_batch = left_right_2_no_padding(TensorDict(data, batch_size=[bs]))
    if flag is not None:
        tu.assign_non_tensor_data(micro_batch, "enable_routing_replay", flag)
    return micro_batch


def _packed_forward(engine, micro_batch, lengths, pad: int):
    ids = torch.cat([micro_batch["input_ids"].values(), torch.zeros(pad, dtype=torch.long)]).unsqueeze(0)
    position_ids = torch.cat([torch.arange(n) for n in lengths] + [torch.arange(pad)]).unsqueeze(0)
    engine._prepare_router_replay_inputs(micro_batch, {"pad_size": pad})
    with torch.no_grad():
        logits = engine.module(input_ids=ids, position_ids=position_ids).logits
    engine._end_router_replay()
    metrics = {}
    engine._add_router_replay_metrics(metrics)
    return logits[0, : sum(lengths)], metrics


def test_engine_replays_the_micro_batch_routes_on_packed_inputs():
    """The engine arms the rollout's routes for the packed forward (pad rows route natively): the rollout's own
    routes and shifted ones give different outputs, and disabled mode is the native forward."""
    model, lengths, pad = _tiny_moe(), [5, 7, 3], 2
    rollout_batch = _micro_batch(model, lengths)
    replayed, metrics = _packed_forward(_engine(model), rollout_batch, lengths, pad)
    assert metrics["actor/r3_layers_replayed"] == 2.0
    shifted, shifted_metrics = _packed_forward(
        _engine(model), _micro_batch(model, lengths, _other_routes), lengths, pad
    )
    assert shifted_metrics["actor/r3_route_flip_frac"] > metrics["actor/r3_route_flip_frac"]
    assert not torch.allclose(shifted, replayed)
    native, native_metrics = _packed_forward(_engine(model, "disabled"), rollout_batch, lengths, pad)
    assert native_metrics == {}
    assert not torch.allclose(native, shifted)


def test_engine_replays_only_when_the_call_and_the_config_both_ask():
    """As the Megatron and VeOmni engines: R3 in the engine config, and the worker's per-call flag (False for
    ``compute_ref_log_prob``, absent for a caller that is not the worker) decides each forward."""
    model, lengths, pad = _tiny_moe(), [5, 7, 3], 2
    shifted = _micro_batch(model, lengths, _other_routes)
    native, _ = _packed_forward(_engine(model, "disabled"), shifted, lengths, pad)
    replayed, metrics = _packed_forward(_engine(model), shifted, lengths, pad)
    assert metrics["actor/r3_route_flip_frac"] > 0 and not torch.allclose(replayed, native)
    for flag in (False, None):
        unflagged = _micro_batch(model, lengths, _other_routes, flag)
        off, off_metrics = _packed_forward(_engine(model), unflagged, lengths, pad)
        assert torch.equal(off, native) and off_metrics == {}


def test_gradient_checkpointing_recompute_replays_the_same_routes():
    """Under gradient checkpointing the backward runs each layer's forward again, router included: the recompute must
    use the replayed routes, so the gradients equal those without checkpointing on the same (shifted) routes, and
    differ from the native routes' gradients."""
    lengths, pad = [5, 7, 3], 2

    def grads(checkpointing: bool, mode: str = "R3") -> list[torch.Tensor]:
        model = _tiny_moe().train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        engine = _engine(model, mode)
        micro_batch = _micro_batch(model, lengths, _other_routes)
        ids = torch.cat([micro_batch["input_ids"].values(), torch.zeros(pad, dtype=torch.long)]).unsqueeze(0)
        position_ids = torch.cat([torch.arange(n) for n in lengths] + [torch.arange(pad)]).unsqueeze(0)
        engine._prepare_router_replay_inputs(micro_batch, {"pad_size": pad})
        # use_cache=False, as verl's engine calls the model: with a cache, transformers masks the packed sequences
        # differently from the checkpointed forward, which turns the cache off
        logits = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits
        engine._end_router_replay()  # the forward is done; the backward's recompute comes after
        logits[0, : sum(lengths)].logsumexp(-1).sum().backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    plain, checkpointed, native = grads(False), grads(True), grads(True, "disabled")
    assert len(plain) == len(checkpointed)
    for a, b in zip(plain, checkpointed, strict=True):
        assert torch.equal(b, a)  # the same operations on the same values
    assert any(not torch.allclose(a, b) for a, b in zip(plain, native, strict=True))


def test_engine_without_routes_names_the_rollout_key():
    model = _tiny_moe()
    micro_batch = _micro_batch(model, [4, 4])
    del micro_batch["routed_experts"]
    with pytest.raises(RuntimeError, match="enable_rollout_routing_replay=True"):
        _engine(model)._prepare_router_replay_inputs(micro_batch, {"pad_size": 0})


def _actor(mode: str, strategy: str = "fsdp", use_remove_padding: bool = True) -> FSDPActorConfig:
    engine = FSDPEngineConfig(strategy=strategy, router_replay=EngineRouterReplayConfig(mode=mode))
    return FSDPActorConfig(strategy=strategy, rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                           use_remove_padding=use_remove_padding, fsdp_config=engine)  # fmt: skip


def test_actor_config_refuses_what_fsdp_cannot_replay():
    assert _actor("R3").fsdp_config.router_replay.mode == "R3"
    assert _actor("disabled", use_remove_padding=False).fsdp_config.router_replay.mode == "disabled"
    with pytest.raises(ValueError, match=r"router_replay\.mode='R2'.*R3\) only"):
        _actor("R2")
    with pytest.raises(ValueError, match="use_remove_padding=True"):
        _actor("R3", use_remove_padding=False)
    with pytest.raises(ValueError, match="fsdp_turbo"):
        _actor("R3", strategy="fsdp_turbo")


def test_router_replay_composes_from_the_trainer_config():
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    overrides = [
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3",
    ]
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=overrides)
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    assert actor.fsdp_config.router_replay.mode == "R3"
    assert config.actor_rollout_ref.ref.fsdp_config.router_replay.mode == "disabled"
