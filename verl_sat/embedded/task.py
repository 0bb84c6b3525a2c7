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

Each problem adds ``num_terms`` operands of up to ``max_operand`` (three-digit operands by default, so most answers
need carries); the answer is written GSM8K-style as ``#### N``, so verl's ``default_compute_score``
(``data_source="openai/gsm8k"``) grades responses exactly as it grades GSM8K. Problems are drawn without repetition
and split into train, validation (the warm start's stopping rule) and test (RL's evaluation), disjoint.
"""

import random
from dataclasses import dataclass

DATA_SOURCE = "openai/gsm8k"  # routes verl's default_compute_score to verl.utils.reward_score.gsm8k
SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class Problem:
    terms: tuple[int, ...]

    @property
    def question(self) -> str:
        return "+".join(map(str, self.terms)) + "="

    @property
    def answer(self) -> int:
        return sum(self.terms)

    def solution(self) -> str:
        """The reference response used by the supervised warm start."""
        return f"#### {self.answer}"


def make_problems(seed: int, max_operand: int, num_terms: int, sizes: dict[str, int]) -> dict[str, list[Problem]]:
    """Distinct problems with operands in ``[0, max_operand]``, drawn with ``seed``, split into ``sizes`` (split name
    to count, in ``SPLITS`` order); no problem is in two splits."""
    total = sum(sizes.values())
    if total > (max_operand + 1) ** num_terms:
        raise ValueError(f"{total} distinct problems requested, only {(max_operand + 1) ** num_terms} exist")
    rng = random.Random(seed)
    seen: dict[tuple[int, ...], None] = {}
    while len(seen) < total:
        seen.setdefault(tuple(rng.randint(0, max_operand) for _ in range(num_terms)))
    problems = [Problem(terms) for terms in seen]
    out, start = {}, 0
    for split in SPLITS:
        out[split] = problems[start : start + sizes[split]]
        start += sizes[split]
    return out


def to_verl_rows(problems: list[Problem], split: str) -> list[dict]:
    """Rows of verl's RL parquet schema (``data_source``, chat ``prompt``, ``ability``, ``reward_model``,
    ``extra_info``), as verl's ``examples/data_preprocess`` scripts write them."""
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": p.question}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(p.answer)},
            "extra_info": {"split": split, "index": i, "terms": list(p.terms)},
        }
        for i, p in enumerate(problems)
    ]
