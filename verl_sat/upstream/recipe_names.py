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
"""The verl-recipe ``sat/`` recipe's names for verl-sat's: its package, where each verl-sat module lands in it, and the
phrases that name the plugin. ``renamed`` applies them to a text and refuses a text that still names the plugin."""

import re

from verl_sat.upstream.edit import UpstreamDriftError

RECIPE = "sat"  # the recipe's folder in verl-recipe
PACKAGE = f"recipe.{RECIPE}"  # as a verl checkout imports it (verl-recipe is verl's recipe/ submodule)
FALLBACK = "fallback"  # the recipe's copy of the core pull request's code, used while verl lacks it
# verl-sat module -> the recipe's module, relative to PACKAGE. ``compat`` holds verl's names where verl has them (the
# core pull request) and the fallback's otherwise; ``config`` is the Hydra config folder (a package, like verl's).
MODULES = {
    "verl_sat.sat_math": f"{FALLBACK}.sat_math",
    "verl_sat.inert_sat": f"{FALLBACK}.inert_sat",
    "verl_sat.routing_replay": f"{FALLBACK}.routing_replay",
    "verl_sat.fsdp_engine": f"{FALLBACK}.fsdp_engine",
    "verl_sat.losses": f"{FALLBACK}.losses",
    "verl_sat.config": "compat",
    "verl_sat.plugin": "compat",
    "verl_sat.main": "main",
    "verl_sat.preflight": "preflight",
    "verl_sat.lag_presets": "lag_presets",
    "verl_sat.recipes": "config",
}
# inside the fallback, verl-sat's config module is the fallback's own (the flat sat_* keys), not compat
FALLBACK_MODULES = {**MODULES, "verl_sat.config": f"{FALLBACK}.config"}
# (verl-sat's phrase, the recipe's), in this order, before module names are mapped
PHRASES = (
    ("python -m verl_sat.main", f"python -m {PACKAGE}.main"),
    ("${verl_sat.div:", "${sat.div:"),
    ("verl_sat.div", "sat.div"),
    ("registered by the verl-sat plugin", f"registered by verl ({PACKAGE}.compat on verl 0.9.1)"),
    (
        "the verl-sat plugin does not import: {err!r}. Run `verl-sat doctor`.",
        f"{PACKAGE}.compat does not import: {{err!r}}",
    ),
    ("``verl-sat upstream`` copies", "the core pull request copies"),
    ("verl-sat's `sat` loss", "the `sat` loss"),
    ("verl-sat's `sat_gspo` loss", "the `sat_gspo` loss"),
    ("verl-sat's sat loss", "the sat loss"),
    ("verl-sat's sat_gspo loss", "the sat_gspo loss"),
    ("verl-sat's\nrecipe group", "the recipe's\nconfig group"),
    ("Args with verl-sat's recipes", "Args with the recipe's config folder"),
    ("(the plugin does, in every verl process)", f"(``{PACKAGE}.compat`` does, when imported)"),
    ("the sat block", "the sat_* keys"),
    ("the `sat` block", "the `sat_*` keys"),
    ("verl-sat: ", f"{PACKAGE}: "),
    ("verl-sat's", "this recipe's"),
    ("verl-sat", "this recipe"),
    ("``recipes/", "``config/"),
)
_MODULE_NAME = re.compile(r"\bverl_sat\.\w+")
# what no file of the recipe may still say: the plugin's names, its docs, tests, make targets and example paths
LEFTOVER = re.compile(r"verl[-_]sat|docs/(?!algo/)\w+\.md|\btests/test_\w+|\bmake \w+|\bexamples/run_\w+")
LICENSE_END = "# limitations under the License.\n"


def renamed(text: str, where: str, modules: dict[str, str] = MODULES, prefix: str = f"{PACKAGE}.") -> str:
    """``text`` (a Python module with its license header, a YAML file or a script) with verl-sat's phrases and module
    names replaced by the recipe's (``modules``: verl-sat module -> the recipe's, relative to ``PACKAGE``, named with
    ``prefix``: the fallback's modules name each other from the recipe's folder, ``fallback.config``, as long as
    ``verl_sat.config``); fails, naming ``where``, if the plugin is still named outside the license header."""
    header, _, body = text.rpartition(LICENSE_END)
    body = with_recipe_phrases(body)

    def module(match: re.Match) -> str:
        name = match[0]
        if name not in modules:
            raise UpstreamDriftError(f"{where}: names {name}, which the recipe has no module for: extend {__name__}")
        return f"{prefix}{modules[name]}"

    body = _MODULE_NAME.sub(module, body)
    leftover = sorted(set(LEFTOVER.findall(body)))
    if leftover:
        raise UpstreamDriftError(f"{where} still names {leftover} in the recipe: extend {__name__}.PHRASES")
    return header + (LICENSE_END if header else "") + body


def with_recipe_phrases(text: str) -> str:
    """``text`` with ``PHRASES`` replaced (no module names, no check)."""
    for old, new in PHRASES:
        text = text.replace(old, new)
    return text
