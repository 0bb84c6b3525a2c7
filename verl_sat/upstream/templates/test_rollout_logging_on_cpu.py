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
"""The rollouts' logging calls take only ``logging``'s keywords: ``print``'s ``flush=`` makes Python's logging raise
``TypeError`` as soon as the record is built (SGLang's ``launch_server_process`` did on a rank that does not start the
server, at ``VERL_LOGGING_LEVEL=INFO``)."""

import ast
import logging
from pathlib import Path

import pytest

import verl

LOGGING_METHODS = {"debug", "info", "warning", "warn", "error", "exception", "critical", "log"}
PRINT_KEYWORDS = {"flush", "end", "sep", "file"}


def logging_calls_with_print_keywords(root: Path) -> list[str]:
    """``path:line`` of each ``<...log...>.info(..., flush=...)``-style call under ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            owner = node.func.value
            owner_name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
            keywords = {keyword.arg for keyword in node.keywords}
            if node.func.attr in LOGGING_METHODS and "log" in owner_name.lower() and keywords & PRINT_KEYWORDS:
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return found


def test_python_logging_refuses_print_keywords():
    logger = logging.getLogger("verl.tests.rollout_logging")
    logger.setLevel(logging.INFO)
    with pytest.raises(TypeError, match="flush"):
        logger.info("x", flush=True)


def test_rollout_logging_calls_take_no_print_keywords():
    assert logging_calls_with_print_keywords(Path(verl.__file__).parent / "workers" / "rollout") == []
