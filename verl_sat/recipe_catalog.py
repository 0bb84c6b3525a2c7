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
"""The recipe group shipped as ``verl_sat.recipes``: which recipes and lags exist, and what each one is."""

from importlib.resources import files

RECIPE_GROUPS = ("recipe", "lag")


def describe(group: str) -> dict[str, str]:
    """``{name: first comment line}`` for every YAML of a config group, sorted by name."""
    entries = {}
    for path in sorted(files("verl_sat.recipes").joinpath(group).iterdir(), key=lambda p: p.name):
        if path.name.endswith(".yaml"):
            lines = [line for line in path.read_text().splitlines() if line.startswith("# ")]
            summary = next((line[2:] for line in lines if not line.startswith("# @package")), "")
            entries[path.name.removesuffix(".yaml")] = summary
    return entries


def format_catalog() -> str:
    """One line per recipe and per lag, as ``verl-sat recipes`` prints them."""
    out = []
    for group in RECIPE_GROUPS:
        out.append(f"+{group}=NAME")
        for name, summary in describe(group).items():
            out.append(f"  {name:<13} {summary}")
    return "\n".join(out)
