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
"""Which weights sample which batch: the lag regimes of verl's v1 trainer, exact.

Version v is the policy after v trainer steps, each ending with a weight broadcast. The rollout runs ``ahead``
batches ahead of the trainer (verl's ``num_warmup_batches``; 0 is synchronous), so the batch of trainer step s
(1-based) is sampled with version ``max(0, s - 1 - ahead)``. A trainer step trains its batch as
``sync_steps`` chunks (verl's ``parameter_sync_step``), each one or more optimizer steps.

- paper lag n (``+lag=lagN``): ``ahead = 1``, ``sync_steps = n``; the gap of an optimizer step is n..2n-1 optimizer
  steps (0..n-1 for the first batch);
- fixed lag L (``+lag=fixed8``): ``ahead = L``, ``sync_steps = 1``; the gap is exactly L from step L + 1 on;
- synchronous (``+lag=sync``): ``ahead = 0``, ``sync_steps = 1``; gap 0.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class LagSchedule:
    ahead: int  # batches generated before the first trainer step
    sync_steps: int  # chunks (verl's parameter_sync_step) per trainer step, one broadcast after the last

    def version_for_step(self, step: int) -> int:
        """The weight version that samples the batch of trainer step ``step`` (1-based)."""
        return max(0, step - 1 - self.ahead)

    def version_gap(self, step: int) -> int:
        """Trainer steps between that version and the weights the step starts from (verl's staleness)."""
        return step - 1 - self.version_for_step(step)

    def optimizer_step_gaps(self, step: int, optimizer_steps_per_trainer_step: int) -> list[int]:
        """The gap, in optimizer steps, between each optimizer step of trainer step ``step`` and the weights that
        sampled its batch (optimizer steps are counted the same way in every trainer step)."""
        k = optimizer_steps_per_trainer_step
        return [self.version_gap(step) * k + i for i in range(k)]
