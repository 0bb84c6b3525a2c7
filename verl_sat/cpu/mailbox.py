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
"""The named Ray actor through which the CPU checkpoint engine hands an update's object reference from the trainer
to the rollout workers. It imports neither verl nor verl-sat's verl adapters, so the process that hosts it never
loads verl (whose plugin loader would import verl-sat's CPU modules while they are being imported)."""

import asyncio

MAILBOX = "verl_sat_weights_mailbox"
KEEP_UPDATES = 2  # the mailbox drops older updates


class WeightsMailbox:
    """Update number -> the object reference of that update's weights."""

    def __init__(self) -> None:
        self._refs: dict[int, list] = {}
        self._arrived: dict[int, asyncio.Event] = {}

    def _event(self, update: int) -> asyncio.Event:
        return self._arrived.setdefault(update, asyncio.Event())

    async def put(self, update: int, refs: list) -> None:
        self._refs[update] = refs
        self._event(update).set()
        for old in [u for u in self._refs if u <= update - KEEP_UPDATES]:
            self._refs.pop(old)
            self._arrived.pop(old, None)

    async def get(self, update: int) -> list:
        await self._event(update).wait()
        return self._refs[update]
