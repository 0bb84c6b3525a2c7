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
"""The ``[rollout] fix:`` patch: SGLang's ``launch_server_process`` passes ``print``'s ``flush=`` to a logging call,
fixed in verl's source.

verl 0.9.1's own rollout never reaches the call (its ``ServerAdapter`` builds ``AsyncHttpServerAdapter`` with
``launch_server=False``; ``tests/test_trainer_fixes_on_cpu.py`` pins that), so ``verl_sat.trainer_fixes`` has no
run-time fix for it; a caller of ``HttpServerAdapter(launch_server=True)`` on a rank that does not start the server
hits it at ``VERL_LOGGING_LEVEL=INFO`` or ``DEBUG`` (the module's logger is at ``WARN`` otherwise).
"""

from collections.abc import Callable

from verl_sat.upstream.edit import replace_once

HTTP_SERVER_ENGINE = "verl/workers/rollout/sglang_rollout/http_server_engine.py"
LOGGING_TEST = "tests/workers/rollout/test_rollout_logging_on_cpu.py"
# launch_server_process on a rank that does not start the server: print's keyword in a logging call
LOGGING_CALL = 'logger.info(f"Server process started with PID {p.pid} for node rank {server_args.node_rank}"'
FLUSH_CALL = LOGGING_CALL + ", flush=True)\n"
FIXED_CALL = LOGGING_CALL + ")\n"


def logging_fix_changes(read: Callable[[str], str]) -> dict[str, str]:
    """``{path: new text}``: SGLang's ``launch_server_process`` logging call without ``flush=True``."""
    return {HTTP_SERVER_ENGINE: replace_once(read(HTTP_SERVER_ENGINE), FLUSH_CALL, FIXED_CALL, HTTP_SERVER_ENGINE)}
