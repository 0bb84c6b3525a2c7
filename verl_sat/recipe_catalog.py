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
"""The recipe group shipped as ``verl_sat.recipes``: which recipes, lags and pieces exist, what each one is, the
paper's Table 1 numbers beside the recipes that are its rows, and the SAT variants and remedy comparison rows apart
from them."""

from dataclasses import dataclass
from importlib.resources import files

RECIPE_GROUPS = ("recipe", "lag", "radii", "r3", "cpu")  # listed by `verl-sat recipes`
GROUP_USAGE = {"recipe": "+recipe=NAME",
               "lag": "+lag=NAME (any trainer: python -m verl_sat.main picks lag/<trainer>/NAME; lagN and fixedN "
                      "for any N >= 1; docs/recipes.md)",
               "radii": "+radii=NAME", "r3": "r3=NAME (with *_r3)",
               "cpu": "+cpu=NAME (with trainer.device=cpu)"}  # fmt: skip


@dataclass(frozen=True)
class PaperRow:
    """One row of the paper's Table 1 (arXiv 2607.18722): AIME24 avg@8 of the best checkpoint at lag 1 and lag 8
    (Qwen3-30B-A3B-Base, one seed), whether the lag-8 run collapsed later, and the last-epoch mismatch d_pi."""

    method: str
    lag1: float
    lag8: float
    collapses_at_lag8: bool
    mismatch_lag1: float
    mismatch_lag8: float

    def scores(self) -> str:
        return f"{self.lag1:.2f} / {self.lag8:.2f}{' (collapses)' if self.collapses_at_lag8 else ''}"


PAPER_TABLE_1 = {
    "grpo": PaperRow("GRPO", 31.25, 30.17, True, 0.0103, 0.0110),
    "gspo": PaperRow("GSPO", 32.25, 31.46, True, 0.0097, 0.0109),
    "grpo_r3": PaperRow("GRPO w/ R3", 31.83, 29.58, False, 0.0058, 0.0218),
    "gspo_r3": PaperRow("GSPO w/ R3", 34.00, 33.13, False, 0.0091, 0.0158),
    "grpo_tis": PaperRow("GRPO w/ TIS", 31.62, 31.46, False, 0.0108, 0.0169),
    "gspo_tis": PaperRow("GSPO w/ TIS", 32.88, 31.21, False, 0.0151, 0.0208),
    "grpo_tis_r3": PaperRow("GRPO w/ TIS w/ R3", 31.79, 31.79, False, 0.0048, 0.0081),
    "gspo_tis_r3": PaperRow("GSPO w/ TIS w/ R3", 31.88, 32.92, False, 0.0054, 0.0068),
    "dppo": PaperRow("DPPO", 33.96, 32.71, False, 0.0108, 0.0118),
    "sat_grpo": PaperRow("SAT-GRPO", 32.71, 32.08, False, 0.0101, 0.0108),
    "sat_gspo": PaperRow("SAT-GSPO", 34.17, 32.71, False, 0.0095, 0.0107),
    "sat_grpo_r3": PaperRow("SAT-GRPO w/ R3", 33.75, 33.13, False, 0.0056, 0.0079),
    "sat_gspo_r3": PaperRow("SAT-GSPO w/ R3", 35.83, 34.79, False, 0.0056, 0.0076),
}

# Rows beyond the paper's Table 1 for comparing off-policy remedies under staleness: each is gspo or sat_gspo with one
# remedy, a verl rollout-correction preset or a verl policy loss at verl's defaults (docs/recipes.md)
REMEDY_ROWS = ("gspo_icepop", "gspo_seq_is_rs", "gspo_geo_rs", "gspo_k3_rs", "sapo", "cispo", "dppo_kl",
               "geo_mean", "sat_gspo_icepop")  # fmt: skip

# SAT-GSPO for micro-batches of few sequences, where the paper's sequence scores cannot gate (docs/sat.md): the
# carried-over quantile (granularity=sequence_carried, the recommended rule) and the two per-token rules measured
# against it on the long chain-of-thought task (docs/results.md)
SAT_VARIANT_ROWS = ("sat_gspo_carried", "sat_gspo_carried_r3", "sat_gspo_ratio_side", "sat_gspo_token",
                    "sat_gspo_token_r3")  # fmt: skip


def describe(group: str) -> dict[str, str]:
    """``{name: first comment line}`` for every YAML of a config group, sorted by name."""
    entries = {}
    for path in sorted(files("verl_sat.recipes").joinpath(group).iterdir(), key=lambda p: p.name):
        if path.name.endswith(".yaml"):
            entries[path.name.removesuffix(".yaml")] = summary(path.read_text())
    return entries


def summary(text: str) -> str:
    """A recipe piece's first comment line after its ``# @package`` line."""
    lines = [line for line in text.splitlines() if line.startswith("# ")]
    return next((line[2:] for line in lines if not line.startswith("# @package")), "")


def format_catalog() -> str:
    """What ``verl-sat recipes`` prints: each recipe of the paper's Table 1 with its lag 1 / lag 8 score, the SAT
    variants, the remedy comparison rows, then the lags and pieces."""
    recipes = describe("recipe")
    out = ["+recipe=NAME  (paper Table 1, AIME24 avg@8 at lag 1 / lag 8)"]
    for name, summary in recipes.items():
        if name not in REMEDY_ROWS and name not in SAT_VARIANT_ROWS:
            row = PAPER_TABLE_1.get(name)
            out.append(f"  {name:<12} {row.scores() if row else '':<25} {summary}")
    out.append("+recipe=NAME  (SAT variants, not in the paper's Table 1: for micro-batches of few sequences)")
    out += [f"  {name:<17} {summary}" for name, summary in recipes.items() if name in SAT_VARIANT_ROWS]
    out.append("+recipe=NAME  (remedy comparison, not in the paper's Table 1: gspo or sat_gspo with one remedy)")
    out += [f"  {name:<15} {summary}" for name, summary in recipes.items() if name in REMEDY_ROWS]
    for group in RECIPE_GROUPS[1:]:
        out.append(GROUP_USAGE[group])
        out += [f"  {name:<12} {summary}" for name, summary in describe(group).items()]
    return "\n".join(out)
