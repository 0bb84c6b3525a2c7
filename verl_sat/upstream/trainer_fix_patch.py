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
"""The ``[trainer] fix:`` patches: verl 0.9.1 bugs that ``verl_sat.trainer_fixes`` works around at run time, fixed in
verl's source."""

from collections.abc import Callable

from verl_sat.upstream.edit import replace_once

SEPARATE_ASYNC = "verl/trainer/ppo/v1/trainer_separate_async.py"
LOGGING_TEST = "tests/trainer/ppo/test_trainer_logging_on_cpu.py"
# the separate-async trainer's set-up with hybrid_engine=False: print's keyword in a logging call
FLUSH_CALL_END = 'standalone replicas only",\n                flush=True,\n            )\n'
FIXED_CALL_END = 'standalone replicas only"\n            )\n'


def logging_fix_changes(read: Callable[[str], str]) -> dict[str, str]:
    """``{path: new text}``: the separate-async trainer's logging call without ``flush=True``."""
    return {SEPARATE_ASYNC: replace_once(read(SEPARATE_ASYNC), FLUSH_CALL_END, FIXED_CALL_END, SEPARATE_ASYNC)}
