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
"""verl-sat's CPU rollout server and weight transport, without Ray: what verl's clients read from a response, abort
and resume, weight updates in the form verl's FSDP engine sends them (experts split per expert), and the checkpoint
engine's topology."""

import asyncio
import threading

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer
from verl.workers.engine.fsdp.utils import unfuse_moe_params

from verl_sat.cpu.checkpoint_engine import RayObjectStoreCheckpointEngine
from verl_sat.cpu.rollout import HFCPUServer, load_weights
from verl_sat.embedded.decode import generate


@pytest.fixture
def server(tiny_workdir):
    config = OmegaConf.create({"dtype": "bfloat16", "enable_rollout_routing_replay": True, "seed": 0,
                               "response_length": 8})  # fmt: skip
    return HFCPUServer(config, OmegaConf.create({"path": str(tiny_workdir / "model")}), replica_rank=0)


@pytest.fixture
def prompt(tiny_workdir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_workdir / "model")
    return tokenizer.apply_chat_template([{"role": "user", "content": "3+4="}], add_generation_prompt=True,
                                         tokenize=True)["input_ids"]  # fmt: skip


def _generate(server, prompt, **params):
    return asyncio.run(server.generate(prompt_ids=prompt, sampling_params=params, request_id="r"))


def test_response_carries_log_probs_routes_stop_reason_and_weights_version(server, prompt):
    out = _generate(server, prompt, temperature=1.0, logprobs=True)
    layers, top_k = server.model.config.num_hidden_layers, server.model.config.num_experts_per_tok
    assert 1 <= len(out.token_ids) <= 8 and len(out.log_probs) == len(out.token_ids)
    assert all(lp <= 0.0 for lp in out.log_probs) and out.stop_reason == "completed"
    assert out.routed_experts.shape == (len(prompt) + len(out.token_ids), layers, top_k)
    assert str(out.routed_experts.dtype) == "int16" and (out.routed_experts[: len(prompt)] != 0).any()
    assert out.extra_fields == {"global_steps": None}
    assert _generate(server, prompt, temperature=1.0).log_probs is None  # only when verl asks (calculate_log_probs)


def test_temperature_zero_is_the_embedded_greedy_decode(server, prompt):
    out = _generate(server, prompt, temperature=0, logprobs=True)
    greedy = generate(server.model, [prompt], server.pad_id, server.eos_id, 8)
    length = int(greedy.response_mask[0].sum())
    assert out.token_ids == greedy.input_ids[0, greedy.prompt_len : greedy.prompt_len + length].tolist()


def test_truncated_sampling_is_refused(server, prompt):
    with pytest.raises(NotImplementedError, match="top_p=0.9"):
        _generate(server, prompt, temperature=1.0, top_p=0.9)


def test_abort_returns_the_tokens_so_far_and_resume_lets_new_requests_through(server, prompt):
    """A decode held after its third forward is aborted: it returns what it has, marked aborted; requests arriving
    while aborted wait for resume_generation."""
    forwards, reached, proceed = [0], threading.Event(), threading.Event()

    def hold_third_forward(module, args):
        forwards[0] += 1
        if forwards[0] == 3:
            reached.set()
            proceed.wait(timeout=60)

    async def scenario():
        handle = server.model.model.register_forward_pre_hook(hold_third_forward)
        params = {"temperature": 1.0, "max_tokens": 8}
        request = asyncio.create_task(server.generate(prompt_ids=prompt, request_id="a", sampling_params=params))
        await asyncio.to_thread(reached.wait, 60)
        abort = asyncio.create_task(server.abort_all_requests())
        await asyncio.sleep(0.05)
        proceed.set()
        aborted = await request
        await abort
        handle.remove()
        waiting = asyncio.create_task(server.generate(prompt_ids=prompt, request_id="b",
                                                      sampling_params={"temperature": 1.0}))  # fmt: skip
        await asyncio.sleep(0.2)
        held = not waiting.done()
        await server.resume_generation()
        return aborted, held, await waiting

    aborted, held, resumed = asyncio.run(scenario())
    assert aborted.stop_reason == "aborted" and len(aborted.token_ids) == 3  # prefill + 2 decode forwards: 3 tokens
    assert held and resumed.stop_reason == "completed"


def test_rejecting_abort_refuses_new_requests(server, prompt):
    async def scenario():
        await server.abort_all_requests(reject_request=True)
        return await server.generate(prompt_ids=prompt, sampling_params={}, request_id="x")

    out = asyncio.run(scenario())
    assert out.stop_reason == "aborted" and out.token_ids == []


def test_weight_update_refuses_split_experts_as_verl_sends_them(server, tiny_workdir):
    """verl's FSDP engine sends Qwen3-MoE experts split per expert (its ``unfuse_moe_params``); the server stacks
    them back and loads every parameter, records the version, and refuses unknown or missing weights."""
    trained = AutoModelForCausalLM.from_pretrained(tiny_workdir / "model")
    with torch.no_grad():
        for param in trained.parameters():
            param.add_(0.01 * torch.randn(param.shape, generator=torch.Generator().manual_seed(1)))
    sent = dict(unfuse_moe_params(trained.state_dict().items(), trained.config.model_type))
    assert any(".mlp.experts.0.gate_proj.weight" in name for name in sent)  # verl did split them
    asyncio.run(server.update_weights(sent, global_steps=7))
    for name, param in trained.named_parameters():
        assert torch.equal(server.model.get_parameter(name), param.to(torch.bfloat16)), name
    assert server.global_steps == 7
    with pytest.raises(KeyError, match="'model.unknown.weight'"):
        load_weights(server.model, [("model.unknown.weight", torch.zeros(1))])
    with pytest.raises(KeyError, match="left .* parameters untouched"):
        load_weights(server.model, [(name, tensor) for name, tensor in sent.items() if name != "model.norm.weight"])


def test_object_store_engine_topology_sends_from_the_trainers_rank_zero():
    metadata = [{"is_master": True}, {"is_master": False}, {"is_master": False}]
    actor, rollout = RayObjectStoreCheckpointEngine.build_topology(2, 1, metadata)
    assert actor == {"rank": [0, -1]} and rollout == {"rank": [1]}
    with pytest.raises(RuntimeError, match="rank 0 must be the checkpoint engine's master"):
        RayObjectStoreCheckpointEngine.build_topology(2, 1, metadata[1:])
