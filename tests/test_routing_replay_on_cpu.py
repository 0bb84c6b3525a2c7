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
"""Rollout routing replay on tiny random Qwen3-MoE, Mixtral and DeepSeek-V3 models built from configs."""

import copy

import pytest
import torch
from torch import nn
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from verl_sat.routing_replay import RoutingReplay, RoutingReplayError

VOCAB, EXPERTS, TOP_K = 64, 8, 2
FAMILIES = ["qwen3_moe", "mixtral", "deepseek_v3"]


def tiny_moe(family: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_experts_per_tok=TOP_K)
    if family == "qwen3_moe":  # layer 1 is dense (mlp_only_layers): its routes stay zero
        config = Qwen3MoeConfig(**common, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
                                num_key_value_heads=2, head_dim=8, num_experts=EXPERTS, norm_topk_prob=True,
                                mlp_only_layers=[1])  # fmt: skip
        return Qwen3MoeForCausalLM(config)
    if family == "mixtral":
        config = MixtralConfig(**common, intermediate_size=32, num_hidden_layers=2, num_key_value_heads=2, head_dim=8,
                               num_local_experts=EXPERTS)  # fmt: skip
        return MixtralForCausalLM(config)
    config = DeepseekV3Config(**common, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
                              num_key_value_heads=4, n_routed_experts=EXPERTS, n_group=2, topk_group=1,
                              first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
                              qk_nope_head_dim=8, v_head_dim=8, n_shared_experts=1)  # fmt: skip
    model = DeepseekV3ForCausalLM(config)
    for module in model.modules():  # random init leaves the router weights and score bias empty
        if type(module).__name__ == "DeepseekV3TopkRouter":
            nn.init.normal_(module.weight, std=0.5)
            nn.init.normal_(module.e_score_correction_bias, std=0.05)
    return model


def perturbed_copy(model: nn.Module, scale: float = 0.5, seed: int = 1) -> nn.Module:
    """A 'rollout engine' copy whose routers differ enough to flip routes."""
    rollout = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in rollout.named_parameters():
            if name.endswith(("gate.weight", "router.weight")):
                param.add_(torch.randn(param.shape, generator=gen) * scale * param.std())
    return rollout


class ExpertsSpy:
    """Captures the expert indices each MoE layer's experts module is called with (all families pass them)."""

    def __init__(self, model: nn.Module):
        self.used: dict[str, torch.Tensor] = {}
        self._handles = [
            module.register_forward_pre_hook(self._hook(name))
            for name, module in model.named_modules()
            if name.endswith(".experts")
        ]

    def _hook(self, name):
        def hook(module, args):
            self.used[name] = args[1].detach().clone()

        return hook

    def close(self):
        for handle in self._handles:
            handle.remove()


def ids(batch=3, seq=9, seed=0):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def sampled_log_probs(model, input_ids):
    logits = model(input_ids=input_ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)


@pytest.mark.parametrize("family", FAMILIES)
def test_replay_of_recorded_routes_reproduces_the_forward(family):
    model = tiny_moe(family).eval()
    rr = RoutingReplay.attach(model)
    with torch.no_grad(), rr.record() as rec:
        reference = model(input_ids=ids()).logits
    routes = rec.routed_experts
    assert routes.dtype == torch.int16 and routes.shape == (3, 9, model.config.num_hidden_layers, TOP_K)
    with torch.no_grad(), rr.replay(routes):
        replayed = model(input_ids=ids()).logits
    assert torch.equal(replayed, reference)
    assert rr.replay_metrics()["actor/r3_route_flip_frac"] == 0.0
    rr.detach()


def test_dense_layers_keep_zero_rows():
    model = tiny_moe("qwen3_moe").eval()
    rr = RoutingReplay.attach(model)
    with torch.no_grad(), rr.record() as rec:
        model(input_ids=ids())
    routes = rec.routed_experts
    assert torch.all(routes[:, :, 1] == 0) and torch.any(routes[:, :, 0] != 0)
    with torch.no_grad(), rr.replay(routes):
        model(input_ids=ids())
    assert rr.replay_metrics()["actor/r3_layers_replayed"] == 2.0


@pytest.mark.parametrize("family", FAMILIES)
def test_trainer_uses_the_rollout_experts_and_the_gap_shrinks(family):
    trainer = tiny_moe(family)
    rollout = perturbed_copy(trainer)
    inputs = ids(batch=4, seq=16)
    rollout_rr, trainer_rr = RoutingReplay.attach(rollout), RoutingReplay.attach(trainer)
    rollout_spy = ExpertsSpy(rollout)
    with torch.no_grad(), rollout_rr.record() as rec:
        rollout_lp = sampled_log_probs(rollout, inputs)
    rollout_spy.close()

    with torch.no_grad():
        native_lp = sampled_log_probs(trainer, inputs)
    trainer_spy = ExpertsSpy(trainer)
    with trainer_rr.replay(rec.routed_experts):
        replay_lp = sampled_log_probs(trainer, inputs)
    trainer_spy.close()

    for name, used in rollout_spy.used.items():  # layer by layer, exactly the rollout's experts
        assert torch.equal(trainer_spy.used[name], used), name
    assert trainer_rr.replay_metrics()["actor/r3_route_flip_frac"] > 0.05
    gap_native = (native_lp - rollout_lp).abs().mean()
    gap_replay = (replay_lp.detach() - rollout_lp).abs().mean()
    assert gap_replay < gap_native

    replay_lp.sum().backward()  # the router still learns: gradients reach it through the gathered scores
    routers = [p for n, p in trainer.named_parameters() if n.endswith(("gate.weight", "router.weight"))]
    assert routers and all(p.grad is not None and p.grad.abs().sum() > 0 for p in routers)


def test_bf16_rollout_copy():
    trainer = tiny_moe("qwen3_moe")
    rollout = copy.deepcopy(trainer).to(torch.bfloat16)
    rollout_rr, trainer_rr = RoutingReplay.attach(rollout), RoutingReplay.attach(trainer)
    inputs = ids(batch=8, seq=32)
    with torch.no_grad(), rollout_rr.record() as rec:
        rollout(input_ids=inputs)
    spy = ExpertsSpy(trainer)
    with torch.no_grad(), trainer_rr.replay(rec.routed_experts):
        trainer(input_ids=inputs)
    spy.close()
    layer0 = rec.routed_experts[:, :, 0].reshape(-1, TOP_K).long()
    assert torch.equal(spy.used["model.layers.0.mlp.experts"], layer0)


def test_zero_rows_route_natively():
    trainer = tiny_moe("mixtral").eval()
    rollout = perturbed_copy(trainer)
    inputs = ids()
    rollout_rr, trainer_rr = RoutingReplay.attach(rollout), RoutingReplay.attach(trainer)
    with torch.no_grad(), rollout_rr.record() as rec:
        rollout(input_ids=inputs)
    with torch.no_grad(), trainer_rr.record() as native:
        trainer(input_ids=inputs)
    routes = rec.routed_experts.clone()
    routes[1] = 0  # the second sequence has no recorded routes (e.g. padding)
    spy = ExpertsSpy(trainer)
    with torch.no_grad(), trainer_rr.replay(routes):
        trainer(input_ids=inputs)
    used = spy.used["model.layers.0.mlp.experts"].reshape(3, 9, TOP_K)
    assert torch.equal(used[1], native.routed_experts[1, :, 0].long())
    assert torch.equal(used[0], rec.routed_experts[0, :, 0].long())


def test_padded_and_packed_inputs():
    model = tiny_moe("qwen3_moe").eval()
    rr = RoutingReplay.attach(model)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    with torch.no_grad(), rr.record() as rec:
        padded = model(input_ids=ids(), attention_mask=mask).logits
    with torch.no_grad(), rr.replay(rec.routed_experts):
        assert torch.equal(model(input_ids=ids(), attention_mask=mask).logits, padded)

    packed_ids = ids(batch=1, seq=14)  # two sequences of 6 and 8 tokens packed as verl's remove-padding path does
    position_ids = torch.cat([torch.arange(6), torch.arange(8)]).unsqueeze(0)
    with torch.no_grad(), rr.record() as rec:
        packed = model(input_ids=packed_ids, position_ids=position_ids).logits
    routes = rec.routed_experts.reshape(14, model.config.num_hidden_layers, TOP_K)  # [nnz, L, top_k]
    with torch.no_grad(), rr.replay(routes):
        assert torch.equal(model(input_ids=packed_ids, position_ids=position_ids).logits, packed)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_gradient_checkpointing_recompute_replays_the_same_routes(family):
    rollout_routes = None
    grads = []
    for checkpointing in (False, True):
        trainer = tiny_moe(family)
        trainer.train()
        if checkpointing:
            trainer.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if rollout_routes is None:
            rollout = perturbed_copy(trainer)
            with torch.no_grad(), RoutingReplay.attach(rollout).record() as rec:
                rollout(input_ids=ids())
            rollout_routes = rec.routed_experts
        rr = RoutingReplay.attach(trainer)
        with rr.replay(rollout_routes):
            loss = trainer(input_ids=ids(), labels=ids()).loss
        assert rr.replay_metrics()["actor/r3_route_flip_frac"] > 0
        loss.backward()  # outside the context: the recompute must still replay
        grads.append(torch.cat([p.grad.flatten() for p in trainer.parameters() if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-5)


def test_detach_restores_native_routing():
    model = tiny_moe("deepseek_v3").eval()
    with torch.no_grad():
        reference = model(input_ids=ids()).logits
    rr = RoutingReplay.attach(model)
    routes = torch.ones(3, 9, model.config.num_hidden_layers, TOP_K, dtype=torch.int16)
    routes[..., 1] = 2
    rr.detach()
    # nothing is hooked any more: the forward routes natively, and a replay around it says so
    with pytest.raises(RoutingReplayError, match="in layer 1 the MoE block model.layers.1.mlp \\(DeepseekV3MoE\\) "
                       "did not call its route_tokens_to_experts"), torch.no_grad(), rr.replay(routes):  # fmt: skip
        assert torch.equal(model(input_ids=ids()).logits, reference)
    assert "route_tokens_to_experts" not in vars(model.model.layers[1].mlp)


@pytest.mark.parametrize(
    "shape_fix,message",
    [
        (lambda r: r[:, :, :2], "expected \\[..., num_hidden_layers=3, top_k=2\\]"),
        (lambda r: torch.cat([r, r[..., :1]], -1), "expected \\[..., num_hidden_layers=3, top_k=2\\]"),
        (lambda r: r[:, :5], "routes cover 15 tokens but layer 0 routes 27"),
        (
            lambda r: r.masked_fill(r == r.max(), EXPERTS),
            "routes with an expert id outside \\[0, num_experts\\) of their MoE layer \\(experts per layer: "
            "\\{0: 8, 2: 8\\}\\); they were routed natively",
        ),
    ],
    ids=["layers", "top_k", "tokens", "expert_id"],
)
def test_bad_routes_are_clear_errors(shape_fix, message):
    model = tiny_moe("qwen3_moe").eval()
    rr = RoutingReplay.attach(model)
    with torch.no_grad(), rr.record() as rec:
        model(input_ids=ids())
    with pytest.raises(RoutingReplayError, match=message), torch.no_grad():
        with rr.replay(shape_fix(rec.routed_experts)):
            model(input_ids=ids())
        rr.replay_metrics()  # the one read of a replay: where an out-of-range expert id is refused


def test_model_without_routers_is_an_error():
    dense = Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8))  # fmt: skip
    with pytest.raises(RoutingReplayError, match="no MoE router found in Qwen3ForCausalLM"):
        RoutingReplay.attach(dense)


def test_unsupported_router_family_is_an_error():
    class PhimoeTopKRouter(nn.Linear):
        pass

    model = tiny_moe("qwen3_moe")
    model.model.layers[0].mlp.gate = PhimoeTopKRouter(32, EXPERTS)
    with pytest.raises(RoutingReplayError, match=r"does not support these routers: \['model.layers.0.mlp.gate"):
        RoutingReplay.attach(model)


def test_a_moe_block_that_bypasses_its_router_is_an_error():
    """A kernel patch that replaces a MoE block's forward (here: Qwen3-MoE's layer 2 routes by its own top-k) would
    train with native routing under R3; the replay says which layer and which block."""
    model = tiny_moe("qwen3_moe").eval()
    rr = RoutingReplay.attach(model)
    with torch.no_grad(), rr.record() as rec:
        model(input_ids=ids())
    block = model.model.layers[2].mlp
    gate = block.gate

    def patched_forward(hidden_states):  # the experts, with a router that is not the hooked module
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        logits = torch.nn.functional.linear(flat, gate.weight)
        weights, indices = torch.topk(logits.softmax(-1), gate.top_k, dim=-1)
        return block.experts(flat, indices, weights).reshape(hidden_states.shape)

    block.forward = patched_forward
    message = (r"in layer 2 the MoE block model.layers.2.mlp \(Qwen3MoeSparseMoeBlock\) did not call its router "
               r"model.layers.2.mlp.gate \(Qwen3MoeTopKRouter\), so the layer routed natively under R3 \(layers not "
               r"replayed: \[2\]\)")  # fmt: skip
    with pytest.raises(RoutingReplayError, match=message), torch.no_grad(), rr.replay(rec.routed_experts):
        model(input_ids=ids())


def test_top_1_routing_is_refused():
    """With one expert per token, verl's all-zero "no recorded route" row is also "expert 0": refused at attach."""
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_experts_per_tok=1,
                            intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                            num_key_value_heads=2, head_dim=8, num_experts=EXPERTS)  # fmt: skip
    with pytest.raises(RoutingReplayError, match="routing replay needs top_k >= 2.*cannot be told from 'expert 0'"):
        RoutingReplay.attach(Qwen3MoeForCausalLM(config))


def test_routes_on_another_device_are_a_clear_error():
    """Routes must lie where the routers compute; the first replayed layer says so, naming both devices."""
    model = tiny_moe("qwen3_moe").eval()
    rr = RoutingReplay.attach(model)
    routes = torch.zeros(3, 9, 3, TOP_K, dtype=torch.int16, device="meta")
    rr.begin_replay(routes)
    with pytest.raises(RoutingReplayError, match="routed_experts are on meta but layer 0 routes on cpu"):
        with torch.no_grad():
            model(input_ids=ids())


def test_routers_without_parameters_replay():
    """FSDP1 without ``use_orig_params`` (verl's default actor) turns every wrapped module's parameters into plain
    tensor views of its flat parameter: routers with no ``parameters()`` still replay exactly."""
    model = tiny_moe("qwen3_moe").eval()
    rr = RoutingReplay.attach(model)
    with torch.no_grad(), rr.record() as rec:
        native = model(input_ids=ids()).logits
    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            weight = module.weight.detach().clone()
            del module._parameters["weight"]
            module.weight = weight  # a plain tensor attribute, as FSDP1's flat-parameter views
            assert not list(module.parameters())
    spy = ExpertsSpy(model)
    with torch.no_grad(), rr.replay(rec.routed_experts):
        replayed = model(input_ids=ids()).logits
    spy.close()
    assert torch.equal(replayed, native)
    assert torch.equal(spy.used["model.layers.0.mlp.experts"], rec.routed_experts[:, :, 0].reshape(-1, TOP_K).long())
    assert rr.replay_metrics()["actor/r3_layers_replayed"] == 2.0
