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
"""Synthetic verifiable math tasks in verl's parquet format, scored by verl's own GSM8K scorer.

``addition`` (the default): each problem adds ``num_terms`` operands of up to ``max_operand`` (three-digit operands
by default, so most answers need carries) and is answered at once, GSM8K-style as ``#### N``: responses of a few
tokens. ``chain`` (long chain-of-thought): a problem lists ``num_terms`` lettered single digits (``a3b5c2=``) and the
reference response writes out the running sum, one line per term (``3+b5=8``, ``8+c2=10``, ...) before ``#### N``:
responses of 20-250 tokens whose length grows with the number of terms. Either way verl's ``default_compute_score``
(``data_source="openai/gsm8k"``) grades the last ``#### N`` exactly as it grades GSM8K. Problems are drawn without
repetition and split into train, validation (the warm start's stopping rule) and test (RL's evaluation), disjoint.
"""

import random
from dataclasses import dataclass

DATA_SOURCE = "openai/gsm8k"  # routes verl's default_compute_score to verl.utils.reward_score.gsm8k
SPLITS = ("train", "val", "test")
TASKS = ("addition", "chain")
LETTERS = "abcdefghijklmnopqrstuvwxyz"  # a chain's term labels: at most 26 terms


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


@dataclass(frozen=True)
class ChainProblem:
    """A running sum written out line by line: the long chain-of-thought task."""

    terms: tuple[int, ...]  # single digits, labelled a, b, c, ... in the question

    @property
    def question(self) -> str:
        return "".join(f"{letter}{term}" for letter, term in zip(LETTERS, self.terms, strict=False)) + "="

    @property
    def answer(self) -> int:
        return sum(self.terms)

    def solution(self) -> str:
        """The reference response: ``S+xT=S'`` per term after the first, then ``#### N``."""
        lines, total = [], self.terms[0]
        for letter, term in zip(LETTERS[1:], self.terms[1:], strict=False):
            lines.append(f"{total}+{letter}{term}={total + term}")
            total += term
        return "\n".join([*lines, f"#### {total}"])


def make_problems(
    seed: int, max_operand: int, num_terms: int, sizes: dict[str, int], task: str = "addition", min_terms: int = 0
) -> dict[str, list[Problem | ChainProblem]]:
    """Distinct problems drawn with ``seed``, split into ``sizes`` (split name to count, in ``SPLITS`` order); no
    problem is in two splits. ``addition``: ``num_terms`` operands in ``[0, max_operand]``; ``chain``: between
    ``min_terms`` and ``num_terms`` (at most 26) digits in ``[0, max_operand]`` (at most 9), the count uniform."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {list(TASKS)}")
    total = sum(sizes.values())
    if task == "chain":
        if not 2 <= min_terms <= num_terms <= len(LETTERS) or not 0 < max_operand <= 9:
            raise ValueError(f"a chain takes 2 <= min_terms <= num_terms <= {len(LETTERS)} and digits up to 9, got "
                             f"min_terms={min_terms}, num_terms={num_terms}, max_operand={max_operand}")  # fmt: skip
        counts = range(min_terms, num_terms + 1)
        available = sum((max_operand + 1) ** k for k in counts)
    else:
        counts = range(num_terms, num_terms + 1)
        available = (max_operand + 1) ** num_terms
    if total > available:
        raise ValueError(f"{total} distinct problems requested, only {available} exist")
    rng = random.Random(seed)
    seen: dict[tuple[int, ...], None] = {}
    while len(seen) < total:
        count = rng.choice(counts) if task == "chain" else num_terms  # addition draws as it always has
        seen.setdefault(tuple(rng.randint(0, max_operand) for _ in range(count)))
    kind = ChainProblem if task == "chain" else Problem
    problems = [kind(terms) for terms in seen]
    out, start = {}, 0
    for split in SPLITS:
        out[split] = problems[start : start + sizes[split]]
        start += sizes[split]
    return out


def to_verl_rows(problems: list[Problem | ChainProblem], split: str) -> list[dict]:
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
