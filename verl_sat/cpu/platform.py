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
"""verl's platform interface for a CPU-only machine (``VERL_PLATFORM=cpu``): device ``cpu``, collectives over gloo,
and Ray's ``GPU`` resource as the unit of placement (Ray is started with fake GPUs, one per worker).

``device_module`` is a small namespace with the ``torch.cuda``-style calls verl makes on its device module (memory
statistics, caches, RNG state, streams), answered for the CPU.
"""

from contextlib import contextmanager, nullcontext
from types import SimpleNamespace
from typing import Any

import psutil
import torch
from verl.plugin.platform.platform_base import PlatformBase


def _memory_info() -> tuple[int, int]:
    """(free, total) bytes of host memory, as ``torch.cuda.mem_get_info`` reports them for a GPU."""
    memory = psutil.virtual_memory()
    return memory.available, memory.total


def _rss() -> int:
    return psutil.Process().memory_info().rss


CPU_DEVICE_MODULE = SimpleNamespace(
    is_available=lambda: True,
    is_initialized=lambda: True,
    current_device=torch.cpu.current_device,  # "cpu", as torch.cpu answers
    device_count=lambda: 1,
    set_device=lambda device=None: None,
    synchronize=lambda device=None: None,
    empty_cache=lambda: None,
    ipc_collect=lambda: None,
    reset_peak_memory_stats=lambda device=None: None,
    memory_allocated=lambda device=None: _rss(),
    max_memory_allocated=lambda device=None: _rss(),
    memory_reserved=lambda device=None: _rss(),
    max_memory_reserved=lambda device=None: _rss(),
    mem_get_info=lambda device=None: _memory_info(),
    memory_stats=lambda device=None: {},
    manual_seed=torch.manual_seed,
    manual_seed_all=torch.manual_seed,
    get_rng_state=lambda device=None: torch.get_rng_state(),
    set_rng_state=lambda state, device=None: torch.set_rng_state(state),
    Stream=torch.cpu.Stream,
    Event=torch.cpu.Event,
    stream=torch.cpu.stream,
    current_stream=torch.cpu.current_stream,
    get_device_name=lambda device=None: "cpu",
    get_device_properties=lambda device=None: SimpleNamespace(name="cpu", total_memory=_memory_info()[1]),
    amp=torch.cpu.amp,
)


class PlatformCPU(PlatformBase):
    """A CPU as verl's accelerator (registered as ``cpu`` by ``verl_sat.cpu.activate``)."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> Any:
        return CPU_DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return False  # chosen only by name (VERL_PLATFORM=cpu), never by auto-detection

    def current_device(self) -> str:
        """``"cpu"`` (as ``torch.cpu.current_device``): verl passes the device id to ``.to(...)``, where an int means
        an accelerator index."""
        return torch.cpu.current_device()

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"  # what Ray sets for its (fake) GPUs; nothing reads it on a CPU

    @contextmanager
    def nvtx_range(self, msg: str):
        with nullcontext():
            yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"  # Ray started with num_gpus=N fake GPUs places one worker per "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None
