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
"""verl's own trainer on a CPU-only machine: the pieces verl's registries take (platform, FSDP engine for device
``cpu``, checkpoint engine); the rollout is verl's own vLLM server on vLLM's CPU build, with verl-sat's worker
extension (``verl_sat.cpu.vllm_reload``). Active only when a run asks for it (``trainer.device=cpu``, which
``python -m verl_sat.main`` turns into ``VERL_PLATFORM=cpu`` for the driver and every Ray worker)."""

import os

PLATFORM_ENV = "VERL_PLATFORM"
PLATFORM_NAME = "cpu"
VLLM_EXTENSION = "verl_sat.cpu.vllm_reload.VLLMCPUWorkerExtension"
# what verl's vLLM server needs on a CPU (recipes/cpu/e2e.yaml sets it): vLLM's rollout, eager mode, no sleep mode,
# and the worker extension whose weight update works on vLLM's CPU build (verl_sat.cpu.vllm_reload)
VLLM_REQUIRED = {
    "actor_rollout_ref.rollout.name": "vllm",
    "actor_rollout_ref.rollout.enforce_eager": True,
    "actor_rollout_ref.rollout.enable_sleep_mode": False,
    "actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls": VLLM_EXTENSION,
}
CHECKPOINT_BACKEND = "ray_object_store"  # actor_rollout_ref.rollout.checkpoint_engine.backend


def requested() -> bool:
    """Whether this process runs a CPU job (``VERL_PLATFORM=cpu``)."""
    return os.environ.get(PLATFORM_ENV, "").strip().lower() == PLATFORM_NAME


def activate() -> None:
    """Register the CPU pieces in verl's registries (idempotent). The platform goes first: importing verl's engines
    resolves verl's platform."""
    from verl.plugin.platform import PlatformRegistry, platform_manager

    from verl_sat.cpu.platform import PlatformCPU

    if PlatformRegistry.get(PLATFORM_NAME) is not PlatformCPU:
        PlatformRegistry.register(platform=PLATFORM_NAME)(PlatformCPU)
    resolved = platform_manager._current_platform
    if resolved is not None and not isinstance(resolved, PlatformCPU):
        raise RuntimeError(
            f"verl's platform was already resolved as {type(resolved).__name__} in this process before verl-sat's CPU "
            f"platform was registered: set {PLATFORM_ENV}={PLATFORM_NAME} before anything imports verl's engines"
        )

    from verl_sat.cpu import packed_attention, patches

    patches.apply()
    packed_attention.register()  # attn_implementation=packed_sdpa: Ulysses sequence parallelism on the CPU

    from verl.checkpoint_engine.base import CheckpointEngineRegistry
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    from verl_sat.cpu import checkpoint_engine

    # verl's own FSDP engines, for device "cpu" too (verl registers them for cuda and npu)
    for model_type, engine in (("language_model", FSDPEngineWithLMHead), ("value_model", FSDPEngineWithValueHead)):
        if PLATFORM_NAME not in EngineRegistry._engines.get(model_type, {}).get("fsdp2", {}):
            EngineRegistry.register(model_type=model_type, backend=["fsdp", "fsdp2"], device=PLATFORM_NAME)(engine)
    # the weight transport (checkpoint_engine.backend=ray_object_store)
    CheckpointEngineRegistry.register(CHECKPOINT_BACKEND)(checkpoint_engine.RayObjectStoreCheckpointEngine)
