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
"""verl-sat's CPU pieces are active only in a CPU run (``VERL_PLATFORM=cpu``), register what verl's registries need
there, never fall back to the CUDA platform when the plugin fails, and the entry point refuses CPU jobs that name a
rollout it cannot run (vLLM's CPU build only, with the keys it needs there)."""

import os
import re
import subprocess
import sys

import pytest

from verl_sat.cpu import VLLM_EXTENSION
from verl_sat.main import compose_from_args, with_recipes_searchpath
from verl_sat.preflight import PreflightError, check_config, check_trainer_device


def _python(code: str, env_extra: dict | None = None, sitecustomize: str | None = None, tmp_path=None):
    env = {k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"}
    env.update(env_extra or {})
    if sitecustomize is not None:
        (tmp_path / "sitecustomize.py").write_text(sitecustomize)
        env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


REGISTRIES = """
import verl, torch.distributed
from verl.plugin.platform import PlatformRegistry
from verl.checkpoint_engine.base import CheckpointEngineRegistry
print('cpu' in PlatformRegistry.registered_names(), 'ray_object_store' in CheckpointEngineRegistry._registry,
      getattr(torch.distributed.init_process_group, '_verl_sat_cpu_patched', False))
"""


def test_nothing_changes_without_a_cpu_run():
    proc = _python(REGISTRIES)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False"] * 3


def test_a_cpu_run_registers_the_pieces_and_verls_process_group_starts():
    code = (
        REGISTRIES
        + """
import os
import re
from verl.utils.device import get_device_id, get_device_name, get_nccl_backend
from verl.workers.engine.base import EngineRegistry
from verl.utils.distributed import initialize_global_process_group
print(get_device_name(), get_device_id(), get_nccl_backend())
print(EngineRegistry.get_engine_cls('language_model', 'fsdp2').__name__)
os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='29531', RANK='0', WORLD_SIZE='1', LOCAL_RANK='0')
initialize_global_process_group()
print(torch.distributed.get_backend())
"""
    )
    proc = _python(code, {"VERL_PLATFORM": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["True"] * 3
    assert lines[1].split() == ["cpu", "cpu", "gloo"]
    assert lines[2] == "FSDPEngineWithLMHead"
    assert lines[3] == "cpu:gloo"  # verl's "cpu:gloo,cpu:gloo" with the repeated device dropped


def test_a_cpu_run_whose_plugin_failed_stops_with_the_error_never_on_cuda(tmp_path):
    blocked = "import sys\nsys.modules['verl_sat.cpu.platform'] = None\n"
    code = "import verl\nfrom verl.plugin.platform import get_platform\nprint(get_platform().device_name)"
    proc = _python(code, {"VERL_PLATFORM": "cpu"}, blocked, tmp_path)
    assert proc.returncode != 0
    assert "Unknown platform 'cpu'" in proc.stderr  # verl refuses the name: no fallback to another platform
    assert "verl-sat plugin failed to load" in proc.stderr and "verl_sat.cpu.platform" in proc.stderr
    main = subprocess.run(
        [sys.executable, "-m", "verl_sat.main", "+recipe=sat_gspo_r3", "+lag=lag1", "r3=fsdp", "trainer.device=cpu",
         "+cpu=e2e", "--cfg", "job"],
        capture_output=True, text=True, timeout=300,
        env={**{k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"}, "PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
    assert main.returncode != 0
    assert "import of verl_sat.cpu.platform halted" in main.stderr


def _cpu_config(*overrides: str):
    import verl_sat.plugin  # noqa: F401  (the recipes' resolvers)

    return compose_from_args(with_recipes_searchpath(["+recipe=sat_gspo_r3", "+lag=lag1", "r3=fsdp", *overrides]))


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["trainer.device=cpu"], "needs actor_rollout_ref.rollout.name=vllm, got None: add +cpu=e2e"),
        (["trainer.device=cpu", "+cpu=e2e", "actor_rollout_ref.rollout.enforce_eager=false"],
         "needs actor_rollout_ref.rollout.enforce_eager=True, got False"),
        (["trainer.device=cpu", "+cpu=e2e", "actor_rollout_ref.rollout.name=sglang"],
         "needs actor_rollout_ref.rollout.name=vllm, got 'sglang'"),
        (["trainer.device=cpu", "+cpu=e2e", "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl"],
         "needs actor_rollout_ref.rollout.checkpoint_engine.backend=ray_object_store"),
        (["trainer.device=cpu", "+cpu=e2e", "actor_rollout_ref.rollout.enable_sleep_mode=true"],
         "needs actor_rollout_ref.rollout.enable_sleep_mode=False, got True"),
        (["trainer.device=cpu", "+cpu=e2e", "actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls=x.Y"],
         "needs actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls=verl_sat.cpu.vllm_reload"),
    ],
)  # fmt: skip
def test_preflight_refuses_a_cpu_job_it_cannot_run(overrides, message):
    config = _cpu_config(*overrides)
    check_config(config)  # what verl-sat checks for any job (also the embedded engine's)
    with pytest.raises(PreflightError, match=re.escape(message)):
        check_trainer_device(config)  # what verl's trainer needs on a CPU


def test_the_cpu_sizes_pass_the_preflight_with_vllms_cpu_build_only(monkeypatch):
    import importlib.metadata

    config = _cpu_config("trainer.device=cpu", "+cpu=e2e")
    check_config(config)
    check_trainer_device(config)
    rollout = config.actor_rollout_ref.rollout
    assert rollout.name == "vllm" and rollout.engine_kwargs.vllm.worker_extension_cls == VLLM_EXTENSION
    assert config.ray_kwargs.ray_init.num_gpus == 2
    assert config.ray_kwargs.ray_init.runtime_env.env_vars.VLLM_CPU_KVCACHE_SPACE == "1"
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.30.0")  # a CUDA build under the name vllm
    with pytest.raises(PreflightError, match="needs vLLM's CPU build registered as vllm"):
        check_trainer_device(config)


def test_object_store_engine_topology_sends_from_the_trainers_rank_zero():
    from verl_sat.cpu.checkpoint_engine import RayObjectStoreCheckpointEngine

    metadata = [{"is_master": True}, {"is_master": False}, {"is_master": False}]
    actor, rollout = RayObjectStoreCheckpointEngine.build_topology(2, 1, metadata)
    assert actor == {"rank": [0, -1]} and rollout == {"rank": [1]}
    with pytest.raises(RuntimeError, match="rank 0 must be the checkpoint engine's master"):
        RayObjectStoreCheckpointEngine.build_topology(2, 1, metadata[1:])
