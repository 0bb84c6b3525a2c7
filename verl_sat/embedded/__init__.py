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
"""The embedded single-machine engine (docs/local_engine.md).

``prepare``: offline tokenizer, MoE policy, task and warm start; ``run_config``: the composed config and the keys the
engine reads; ``rollout``: the bf16 rollout engine and its lagged background worker; ``ppo_update``: one trainer
step with verl's estimator, loss and optimizer; ``evaluate``: avg@k; ``run_files``: metrics, checkpoints, summary and
curves of a run; ``train``: the loop; ``sweep``: recipes x lags x seeds and the results table.
"""
