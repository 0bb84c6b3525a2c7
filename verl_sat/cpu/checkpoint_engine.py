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
"""A checkpoint engine for verl on a CPU (``rollout.checkpoint_engine.backend=ray_object_store``): the trainer's
rank 0 puts the full weights into Ray's object store once per update, and every rollout worker reads them from
there. A small named actor (the mailbox) hands the object reference from the sender to the receivers.

verl's engines broadcast over NCCL/NIXL between GPUs; on one machine the object store is the same single copy in
shared memory. Every actor rank still walks the weight generator, since producing a full tensor is collective
over the FSDP group.
"""

from collections.abc import AsyncGenerator, Generator

import ray
import torch
from verl.checkpoint_engine.base import CheckpointEngine

from verl_sat.cpu.mailbox import MAILBOX, WeightsMailbox


def _mailbox():
    return ray.remote(WeightsMailbox).options(name=MAILBOX, get_if_exists=True, num_cpus=0).remote()


class RayObjectStoreCheckpointEngine(CheckpointEngine):
    """verl's ``CheckpointEngine`` over Ray's object store (see the module docstring).

    Args:
        bucket_size: verl's bucket size (unused: the update travels as one object).
        is_master: the trainer's rank 0, which sends.
    """

    def __init__(self, bucket_size: int = 0, is_master: bool = False, **unused) -> None:
        self.is_master = is_master
        self.rank: int | None = None
        self._mailbox = None
        self._updates = 0  # updates seen by this worker: the same count on every worker of the run

    def prepare(self) -> dict:
        if self.is_master and self._mailbox is None:
            self._mailbox = _mailbox()  # the master holds the handle: an actor without one is collected
        return {"is_master": self.is_master}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        if not metadata[0]["is_master"]:
            raise RuntimeError("the trainer's rank 0 must be the checkpoint engine's master")
        actor = {"rank": [0] + [-1] * (actor_wg_world_size - 1)}
        rollout = {"rank": list(range(1, rollout_world_size + 1))}
        return actor, rollout

    def init_process_group(self, rank: int) -> None:
        self.rank = rank

    def finalize(self) -> None:
        return None

    @torch.no_grad()
    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None], global_steps=None):
        # a copy on the CPU, never a view of the trainer's parameters (which the next optimizer step changes)
        named = {name: tensor.detach().to("cpu", copy=True) for name, tensor in weights}
        self._updates += 1
        if self.rank == 0:
            await self._mailbox.put.remote(self._updates, [ray.put(named)])
        return {}

    async def receive_weights(self, global_steps=None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        self._updates += 1
        mailbox = ray.get_actor(MAILBOX)
        (ref,) = await mailbox.get.remote(self._updates)
        for item in (await ref).items():
            yield item
