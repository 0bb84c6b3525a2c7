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
"""The few spots where verl 0.9.1 cannot run on a CPU as it is, patched as narrowly as possible and only in a CPU
run's processes (``verl_sat.cpu.activate``). Each one is pinned by a test on the verl code it works around
(``tests/test_cpu_patches_on_cpu.py``), which fails when verl changes that code.

1. ``verl.utils.distributed`` builds the process-group backend ``f"cpu:gloo,{device}:{backend}"``; with device
   ``cpu`` and backend ``gloo`` that is ``cpu:gloo,cpu:gloo``, which torch refuses (a device type twice).
   ``torch.distributed.init_process_group`` gets the string with the repeated device entry dropped.
2. verl's FSDP2 engine wraps a forward-only model (the reference policy) in ``CPUOffloadPolicy(pin_memory=True)``;
   pinning host memory needs an accelerator. The engine module's ``CPUOffloadPolicy`` builds the policy without
   pinning (on a CPU the "offload" keeps the parameters where they already are).
3. Outside bypass mode with ``parameter_sync_step > 1`` the trainer snapshots the policy with
   ``fsdp2_sharded_save_to_cpu`` (``param.detach().cpu()``), which on a CPU returns the parameter itself: the
   "snapshot" would follow every optimizer step. The snapshot is cloned.
4. verl's FSDP1 engine (``strategy=fsdp``, verl's default) wraps with ``sync_module_states=True``; torch refuses
   that for parameters on the CPU (``_check_module_states_for_sync_module_states``: NCCL cannot broadcast host
   tensors), although the broadcast itself runs over gloo. The check lets CPU tensors pass and still refuses a mix
   with accelerator tensors.
5. verl's ``load_fsdp_model_to_gpu`` moves FSDP1's flat parameters to ``torch.device(f"{device_name}:{device_id}")``,
   which on the CPU is ``"cpu:cpu"``, an invalid device (verl's FSDP1 engine calls it before exporting weights and
   under param offload). In a CPU run the flat parameters never leave the host, so the FSDP engine's call returns at
   once for FSDP1 modules; FSDP2 modules still go to verl's function.
6. verl's FSDP1 engine wraps a forward-only model (the reference policy) with ``CPUOffload(offload_params=True)``,
   imported from ``torch.distributed.fsdp`` when it builds the module; FSDP1 then pins the host copy, which needs an
   accelerator. In a CPU run ``torch.distributed.fsdp.CPUOffload`` is a subclass that never offloads (the parameters
   are on the host already), as patch 2 does for FSDP2.
"""

import functools
from dataclasses import dataclass

import torch
import torch.distributed
import torch.distributed.fsdp
from torch.distributed.fsdp import CPUOffload, CPUOffloadPolicy
from torch.distributed.fsdp import _init_utils as fsdp1_init

_PATCHED = "_verl_sat_cpu_patched"


def dedupe_backend(backend: str | None) -> str | None:
    """``"cpu:gloo,cpu:gloo"`` -> ``"cpu:gloo"``: a ``device:backend`` list with each device type once (the first);
    anything else unchanged."""
    if not isinstance(backend, str) or ":" not in backend:
        return backend
    entries, seen = [], set()
    for entry in backend.split(","):
        device = entry.split(":", 1)[0].strip()
        if device not in seen:
            seen.add(device)
            entries.append(entry)
    return ",".join(entries)


def unpinned_offload_policy(*args, pin_memory: bool = True, **kwargs) -> CPUOffloadPolicy:
    """``CPUOffloadPolicy`` that never pins (the ``pin_memory`` asked for is ignored)."""
    return CPUOffloadPolicy(*args, pin_memory=False, **kwargs)


def copying_sharded_save(save):
    """``fsdp2_sharded_save_to_cpu`` whose saved shards are copies, never the parameters' own storage."""

    @functools.wraps(save)
    def sharded_save_to_cpu(model):
        state, spec = save(model)
        return {name: (tensor.clone(), tensor_spec) for name, (tensor, tensor_spec) in state.items()}, spec

    setattr(sharded_save_to_cpu, _PATCHED, True)
    return sharded_save_to_cpu


@dataclass
class HostResidentOffload(CPUOffload):
    """FSDP1's ``CPUOffload`` for a CPU run: ``offload_params`` is always false (the parameters never leave the
    host, and offloading them would pin memory)."""

    def __post_init__(self) -> None:
        self.offload_params = False


def host_sync_check(check):
    """FSDP1's ``sync_module_states`` check that lets module states on the CPU pass (gloo broadcasts them); any other
    set of states goes to ``check``."""

    @functools.wraps(check)
    def check_module_states(module_states: list[torch.Tensor]) -> None:
        if any(tensor.device.type != "cpu" for tensor in module_states):
            check(module_states)

    setattr(check_module_states, _PATCHED, True)
    return check_module_states


def host_resident_fsdp1_load(load):
    """verl's ``load_fsdp_model_to_gpu`` that leaves FSDP1 modules where they are (on the host)."""
    from verl.utils.fsdp_utils import fsdp_version

    @functools.wraps(load)
    def load_fsdp_model_to_gpu(model) -> None:
        if fsdp_version(model) != 1:
            load(model)

    setattr(load_fsdp_model_to_gpu, _PATCHED, True)
    return load_fsdp_model_to_gpu


def apply() -> None:
    """Apply the patches (idempotent)."""
    from verl.utils import fsdp_utils
    from verl.workers.engine.fsdp import transformer_impl

    if not getattr(fsdp_utils.fsdp2_sharded_save_to_cpu, _PATCHED, False):
        fsdp_utils.fsdp2_sharded_save_to_cpu = copying_sharded_save(fsdp_utils.fsdp2_sharded_save_to_cpu)

    transformer_impl.CPUOffloadPolicy = unpinned_offload_policy
    if not getattr(transformer_impl.load_fsdp_model_to_gpu, _PATCHED, False):
        transformer_impl.load_fsdp_model_to_gpu = host_resident_fsdp1_load(transformer_impl.load_fsdp_model_to_gpu)
    torch.distributed.fsdp.CPUOffload = HostResidentOffload
    check = fsdp1_init._check_module_states_for_sync_module_states
    if not getattr(check, _PATCHED, False):
        fsdp1_init._check_module_states_for_sync_module_states = host_sync_check(check)
    init = torch.distributed.init_process_group
    if getattr(init, _PATCHED, False):
        return

    @functools.wraps(init)
    def init_process_group(*args, **kwargs):
        if "backend" in kwargs:
            kwargs["backend"] = dedupe_backend(kwargs["backend"])
        elif args:
            args = (dedupe_backend(args[0]), *args[1:])
        return init(*args, **kwargs)

    setattr(init_process_group, _PATCHED, True)
    torch.distributed.init_process_group = init_process_group
