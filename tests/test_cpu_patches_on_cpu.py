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
"""The verl code that verl-sat's CPU patches work around, pinned: each test fails when verl 0.9.1's code the patch
relies on changes, or when the torch behaviour that makes the patch necessary goes away. Then each patch's effect."""

import inspect

import pytest
import torch
import torch.distributed
from verl.utils import distributed, fsdp_utils
from verl.workers.engine.fsdp import transformer_impl

from verl_sat.cpu import patches


def test_pinned_backend_string_and_torchs_refusal():
    """verl builds ``cpu:gloo,{device}:{backend}``; with device cpu and backend gloo torch refuses the string."""
    expected = 'f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"'
    assert expected in inspect.getsource(distributed.initialize_global_process_group)
    assert expected in inspect.getsource(distributed.initialize_global_process_group_ray)
    with pytest.raises(ValueError, match="Duplicate device type cpu"):
        torch.distributed.distributed_c10d.BackendConfig("cpu:gloo,cpu:gloo")
    assert patches.dedupe_backend("cpu:gloo,cpu:gloo") == "cpu:gloo"
    assert patches.dedupe_backend("cpu:gloo,cuda:nccl") == "cpu:gloo,cuda:nccl"
    assert patches.dedupe_backend("gloo") == "gloo" and patches.dedupe_backend(None) is None


def test_pinned_forward_only_offload_policy_pins_memory():
    source = inspect.getsource(transformer_impl.FSDPEngine._build_fsdp_module)
    assert "if self.engine_config.offload_policy or self.engine_config.forward_only:" in source
    assert "offload_policy = CPUOffloadPolicy(pin_memory=True)" in source
    if not torch.accelerator.is_available():
        with pytest.raises(RuntimeError):
            torch.zeros(1).pin_memory()
    assert patches.unpinned_offload_policy(pin_memory=True).pin_memory is False


def test_pinned_sharded_save_aliases_on_cpu():
    """``.detach().cpu()`` of a CPU tensor is the tensor itself: a "snapshot" that follows the optimizer."""
    assert "local_gpu_tensor.detach().cpu()" in inspect.getsource(fsdp_utils.fsdp2_sharded_save_to_cpu)
    param = torch.ones(3)
    assert param.detach().cpu().data_ptr() == param.data_ptr()

    def save(model):
        return {"w": (model.detach().cpu(), "spec")}, "global"

    state, spec = patches.copying_sharded_save(save)(param)
    param.add_(1.0)
    assert spec == "global" and state["w"][1] == "spec" and torch.equal(state["w"][0], torch.ones(3))


def test_pinned_fsdp1_sync_module_states_refuses_host_tensors():
    """verl's FSDP1 engine wraps with ``sync_module_states=True``; torch's check for it refuses parameters on the CPU
    (gloo would broadcast them). The patched check lets host tensors through and hands any other set to torch's."""
    from torch.distributed.fsdp import _init_utils

    assert "sync_module_states=True" in inspect.getsource(transformer_impl.FSDPEngine._build_fsdp_module)
    assert "_check_module_states_for_sync_module_states(module_states)" in inspect.getsource(
        _init_utils._sync_module_params_and_buffers
    )
    original = getattr(_init_utils._check_module_states_for_sync_module_states, "__wrapped__", None)
    original = original or _init_utils._check_module_states_for_sync_module_states
    with pytest.raises(ValueError, match="has CPU parameters or buffers"):
        original([torch.zeros(1)])
    seen = []
    check = patches.host_sync_check(seen.append)
    check([torch.zeros(1), torch.ones(2)])
    assert seen == []
    on_meta = [torch.zeros(1), torch.empty(1, device="meta")]
    check(on_meta)
    assert seen == [on_meta]


def test_pinned_fsdp1_load_to_device_builds_an_invalid_cpu_device():
    """verl's ``load_fsdp_model_to_gpu`` moves FSDP1 flat parameters to ``f"{device_name}:{device_id}"``, on the CPU
    ``"cpu:cpu"``; the FSDP engine calls it by the name it imported. The patched call leaves FSDP1 modules on the
    host and hands anything else to verl's function."""
    source = inspect.getsource(fsdp_utils.load_fsdp_model_to_gpu)
    assert 'torch.device(f"{get_device_name()}:{device_id}")' in source
    with pytest.raises(RuntimeError, match="Invalid device string"):
        torch.device("cpu:cpu")
    assert "load_fsdp_model_to_gpu(self.module)" in inspect.getsource(transformer_impl.FSDPEngine)
    loaded = []
    load = patches.host_resident_fsdp1_load(loaded.append)
    module = torch.nn.Linear(2, 2)  # not FSDP-wrapped (fsdp_version 0): verl's function
    load(module)
    assert loaded == [module]


def test_pinned_fsdp1_forward_only_offload_pins_memory():
    """verl's FSDP1 engine imports ``CPUOffload`` from ``torch.distributed.fsdp`` as it builds the module and offloads a
    forward-only model (the reference policy); torch's FSDP1 pins offloaded parameters. On the CPU the patched class
    never offloads."""
    from torch.distributed.fsdp import CPUOffload, _flat_param

    source = inspect.getsource(transformer_impl.FSDPEngine._build_fsdp_module)
    assert "from torch.distributed.fsdp import CPUOffload, MixedPrecision" in source
    assert "cpu_offload = CPUOffload(offload_params=True)" in source
    init = inspect.getsource(_flat_param.FlatParamHandle.init_flat_param_attributes)
    assert "if self._offload_params:" in init and "flat_param._local_shard.pin_memory()" in init
    offload = patches.HostResidentOffload(offload_params=True)
    assert isinstance(offload, CPUOffload) and offload.offload_params is False
