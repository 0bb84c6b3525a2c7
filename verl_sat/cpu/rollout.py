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
"""A rollout backend for verl on a CPU: a Ray actor serving Hugging Face ``generate``-style decoding of a low-precision
copy of the policy, with what verl's clients read from SGLang and vLLM.

- ``HFCPUServer``: token in, token out. Each response carries the sampling-time log-probs, a stop reason, the version
  of the weights that sampled it (``extra_fields["global_steps"]``) and, with
  ``rollout.enable_rollout_routing_replay``, the experts every MoE layer chose (``routed_experts``, recorded during
  decode by ``verl_sat.routing_replay``). ``abort_all_requests`` ends in-flight requests after their current token
  and returns them as ``aborted`` with the tokens so far (verl's partial rollout resumes them);
  ``resume_generation`` lets held requests through.
- ``HFCPUReplica``: verl's ``RolloutReplica`` for it (``rollout.name=hf_cpu``, standalone mode).
- ``HFCPUServerAdapter``: verl's ``BaseRollout`` in the rollout worker; it hands the weights a checkpoint engine
  received to the server, which re-fuses Qwen3-MoE experts that verl sends split per expert.
"""

import asyncio
import logging
import os
import re
from collections.abc import AsyncIterator, Iterable
from typing import Any

import ray
import torch
from transformers import AutoModelForCausalLM
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import HFModelConfig
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

from verl_sat.embedded.decode import generate
from verl_sat.routing_replay import RoutingReplay

logger = logging.getLogger(__name__)

SERVER_NAME = "verl_sat_hf_cpu_server_{replica}{suffix}"
_EXPERT_KEY = re.compile(
    r"^(?P<base>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class HFCPUServer:
    """One rollout replica's inference server (a Ray actor): the policy in ``rollout.dtype``, decoding one request
    at a time.

    Args:
        config: verl's ``RolloutConfig``; reads ``dtype``, ``response_length``, ``enable_rollout_routing_replay``
            and ``seed``.
        model_config: verl's ``HFModelConfig``; reads ``local_path``.
        replica_rank: this replica's rank (its sampling stream: ``seed + replica_rank``).
    """

    def __init__(self, config, model_config, replica_rank: int) -> None:
        self.config, self.replica_rank = config, replica_rank
        dtype = DTYPES.get(str(config.dtype))
        if dtype is None:
            raise ValueError(f"actor_rollout_ref.rollout.dtype={config.dtype!r}: expected one of {sorted(DTYPES)}")
        model_config = omega_conf_to_dataclass(model_config, HFModelConfig)
        self.model = AutoModelForCausalLM.from_pretrained(model_config.local_path, dtype=dtype).eval()
        hf_config = self.model.config
        self.eos_id = hf_config.eos_token_id if isinstance(hf_config.eos_token_id, int) else hf_config.eos_token_id[0]
        self.pad_id = hf_config.pad_token_id if hf_config.pad_token_id is not None else self.eos_id
        self.routing = RoutingReplay.attach(self.model) if config.enable_rollout_routing_replay else None
        self.generator = torch.Generator().manual_seed(int(config.get("seed", 0) or 0) + replica_rank)
        self.global_steps: int | None = None
        self._lock = asyncio.Lock()  # one decode (and one weight update) at a time
        self._open = asyncio.Event()
        self._open.set()
        self._reject = False
        self._abort_epoch = 0  # bumped by abort_all_requests; an in-flight decode stops when it changes

    def ready(self) -> bool:
        return True

    async def generate(
        self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str, **unused: Any
    ) -> TokenOutput:
        """Decode one response to ``prompt_ids`` (``sampling_params``: temperature, max_tokens, logprobs; top_p 1
        and top_k -1 or 0 only, as the CPU decoder samples from the full tempered distribution)."""
        if unused.get("image_data") or unused.get("video_data") or unused.get("audio_data"):
            raise NotImplementedError("the CPU rollout (rollout.name=hf_cpu) serves text-only models")
        temperature, max_tokens = self._sampling(sampling_params, len(prompt_ids))
        if not self._open.is_set():
            if self._reject:
                return self._aborted()
            await self._open.wait()
        async with self._lock:
            epoch = self._abort_epoch
            out = await asyncio.to_thread(
                generate,
                self.model,
                [list(prompt_ids)],
                self.pad_id,
                self.eos_id,
                max_tokens,
                temperature=max(temperature, 1e-6),
                generator=None if temperature == 0 else self.generator,
                routing=self.routing,
                should_stop=lambda: self._abort_epoch != epoch,
            )
        length = int(out.response_mask[0].sum())
        token_ids = out.input_ids[0, out.prompt_len : out.prompt_len + length].tolist()
        routed = None
        if out.routed_experts is not None:  # prompt + response rows, as vLLM returns them
            routed = out.routed_experts[0, : out.prompt_len + length].numpy()
        return TokenOutput(
            token_ids=token_ids,
            log_probs=out.log_probs[0, :length].tolist() if sampling_params.get("logprobs") else None,
            routed_experts=routed,
            stop_reason="aborted" if out.stopped else "completed",
            extra_fields={"global_steps": self.global_steps},
        )

    def _sampling(self, params: dict[str, Any], prompt_len: int) -> tuple[float, int]:
        top_p, top_k = float(params.get("top_p", 1.0) or 1.0), int(params.get("top_k", -1) or -1)
        if top_p != 1.0 or top_k > 0:
            raise NotImplementedError(
                f"the CPU rollout samples from the full tempered distribution: got top_p={top_p}, top_k={top_k}; "
                "set actor_rollout_ref.rollout.top_p=1.0 and top_k=-1"
            )
        max_tokens = params.get("max_tokens", params.get("max_new_tokens", self.config.response_length))
        return float(params.get("temperature", 1.0)), max(1, int(max_tokens))

    def _aborted(self) -> TokenOutput:
        return TokenOutput(
            token_ids=[], log_probs=[], stop_reason="aborted", extra_fields={"global_steps": self.global_steps}
        )

    async def abort_all_requests(self, reject_request: bool = False, **unused: Any) -> dict[str, Any]:
        """Stop in-flight decodes after their current token (returned ``aborted``); hold (or, with
        ``reject_request``, refuse) new requests until ``resume_generation``."""
        self._open.clear()
        self._reject = reject_request
        self._abort_epoch += 1
        async with self._lock:  # the in-flight decode has returned
            pass
        return {}

    async def resume_generation(self) -> None:
        self._reject = False
        self._open.set()

    async def update_weights(self, named_tensors: dict[str, torch.Tensor], global_steps: int | None) -> None:
        """Load the trainer's weights (experts re-fused where verl split them) and record their version."""
        async with self._lock:
            load_weights(self.model, named_tensors.items())
            self.global_steps = global_steps

    # the rest of a server's interface: nothing to do on a CPU
    async def wake_up(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def sleep(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None


def load_weights(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy ``named_tensors`` into ``model``'s parameters (cast to their dtype). Experts that arrive split per expert
    (verl's ``unfuse_moe_params``: ``...mlp.experts.{e}.{gate,up,down}_proj.weight``) are stacked back into the
    fused ``gate_up_proj`` / ``down_proj`` of Transformers 5. Every parameter must be covered and every name known."""
    params = dict(model.named_parameters(remove_duplicate=False))  # tied weights under each of their names
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    updated: set[int] = set()
    with torch.no_grad():
        for name, tensor in named_tensors:
            match = _EXPERT_KEY.match(name)
            if match:
                experts.setdefault(match["base"], {}).setdefault(match["proj"], {})[int(match["expert"])] = tensor
                continue
            if name not in params:
                raise KeyError(f"the trainer sent weight {name!r}, which the rollout model does not have")
            params[name].copy_(tensor)
            updated.add(id(params[name]))
        for base, parts in experts.items():
            count = len(parts["down_proj"])
            gate_up = [torch.cat([parts["gate_proj"][e], parts["up_proj"][e]], dim=0) for e in range(count)]
            for name, value in (
                (f"{base}.gate_up_proj", torch.stack(gate_up)),
                (f"{base}.down_proj", torch.stack([parts["down_proj"][e] for e in range(count)])),
            ):
                params[name].copy_(value)
                updated.add(id(params[name]))  # fmt: skip
    missing = sorted(name for name, param in params.items() if id(param) not in updated)
    if missing:
        raise KeyError(f"the weight update left {len(missing)} parameters untouched, e.g. {missing[:3]}")


class HFCPUReplica(RolloutReplica):
    """verl's rollout replica for ``HFCPUServer`` (standalone: its own "GPU" in Ray, which on a CPU is a slot)."""

    async def launch_servers(self) -> None:
        name = SERVER_NAME.format(replica=self.replica_rank, suffix=self.name_suffix)
        server = (
            ray.remote(HFCPUServer)
            .options(name=name, max_concurrency=self.max_concurrency, num_cpus=0)
            .remote(config=self.config, model_config=self.model_config, replica_rank=self.replica_rank)
        )
        await server.ready.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = name  # no HTTP endpoint: verl's clients call the actor (token in, token out)


class HFCPUServerAdapter(BaseRollout):
    """The rollout worker's side of a weight update: what the checkpoint engine received goes to this replica's
    ``HFCPUServer``."""

    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1, **unused: Any) -> None:
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", "0"))
        world = self.config.tensor_model_parallel_size * self.config.data_parallel_size
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.is_leader_rank = rank % world == 0
        self._server = None

    def _server_handle(self):
        if self._server is None:
            self._server = ray.get_actor(SERVER_NAME.format(replica=self.replica_rank, suffix=""))
        return self._server

    async def update_weights(self, weights, wire_format: str = "named_tensors", global_steps=None, **unused: Any):
        if wire_format != "named_tensors":
            raise NotImplementedError(f"the CPU rollout takes full named tensors, not {wire_format!r}")
        named = {name: tensor async for name, tensor in _aiter(weights)}
        if self.is_leader_rank:
            await self._server_handle().update_weights.remote(named, global_steps)

    async def resume(self, tags: list[str]) -> None:
        return None

    async def release(self) -> None:
        return None


async def _aiter(weights) -> AsyncIterator[tuple[str, torch.Tensor]]:
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item
