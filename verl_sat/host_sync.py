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
"""Count the host synchronisations a piece of torch code makes, on any device (CPU included).

A host sync is a read of a tensor's value by Python: on CUDA it stalls the stream until the kernels before it are
done. Counted: ``.item()``, ``bool()`` / ``int()`` / ``float()`` of a tensor, ``.tolist()``, ``nonzero``, boolean-mask
indexing, indexing with a 0-dim tensor, and ``masked_select``::

    with HostSyncCounter() as syncs:
        loss, metrics = loss_fn(...)
    print(syncs.count, syncs.calls)
"""

import torch
from torch.overrides import TorchFunctionMode

_READS = {"item", "__bool__", "__int__", "__float__", "__index__", "tolist", "nonzero", "masked_select", "argwhere"}


def _reads_value(name: str, args: tuple) -> bool:
    if name in _READS:
        return True
    if name == "__getitem__" and len(args) > 1:
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, torch.Tensor) and (i.dtype == torch.bool or i.dim() == 0) for i in index)
    return False


class HostSyncCounter(TorchFunctionMode):
    """A ``TorchFunctionMode`` that counts host syncs; ``calls`` lists their names in order."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    @property
    def count(self) -> int:
        return len(self.calls)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if _reads_value(name, args):
            self.calls.append(name)
        return func(*args, **(kwargs or {}))
