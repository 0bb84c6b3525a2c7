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
"""A synthetic verifiable math task in verl's parquet format, scored by verl's own GSM8K scorer.

Each problem is two-operand addition; the answer is written GSM8K-style as ``#### N``, so verl's
``default_compute_score`` (``data_source="openai/gsm8k"``) grades responses exactly as it grades GSM8K.
"""

import random
from dataclasses import dataclass

DATA_SOURCE = "openai/gsm8k"  # routes verl's default_compute_score to verl.utils.reward_score.gsm8k


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def question(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> int:
        return self.a + self.b

    def solution(self) -> str:
        """The reference response used by the supervised warm start."""
        return f"#### {self.answer}"


def make_problems(seed: int, max_operand: int, num_test: int) -> tuple[list[Problem], list[Problem]]:
    """Every pair of operands in ``[0, max_operand]``, shuffled with ``seed``; the first ``num_test`` are the test
    split (never seen in the warm start or RL), the rest the train split."""
    problems = [Problem(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    random.Random(seed).shuffle(problems)
    return problems[num_test:], problems[:num_test]


def to_verl_rows(problems: list[Problem], split: str) -> list[dict]:
    """Rows of verl's RL parquet schema (``data_source``, chat ``prompt``, ``ability``, ``reward_model``,
    ``extra_info``), as verl's ``examples/data_preprocess`` scripts write them."""
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": p.question}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(p.answer)},
            "extra_info": {"split": split, "index": i, "a": p.a, "b": p.b},
        }
        for i, p in enumerate(problems)
    ]
