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
"""The Hydra pieces of the verl-recipe ``sat/`` recipe (``config/``), from verl-sat's recipe group: the rows, the
methods, the paper's shared settings, the radii, the corrections, R3, and the lag presets of all three trainers,
every comment kept. verl-sat's nested ``policy_loss.sat`` block becomes the core pull request's flat ``sat_*`` keys
(``policy_loss.sat.quantile`` -> ``policy_loss.sat_quantile``) and the ``_target_`` classes the recipe's
``compat`` module. Left out: ``cpu/`` and ``embedded/`` (verl-sat's CPU platform and its embedded engine)."""

import re
from dataclasses import fields
from importlib.resources import files

from verl_sat.sat_math import SatParams
from verl_sat.upstream.edit import UpstreamDriftError, replace_once
from verl_sat.upstream.recipe_names import PACKAGE, renamed
from verl_sat.upstream.sat_patch import FLAT_PREFIX

GROUPS = ("recipe", "method", "paper", "radii", "correction", "r3", "lag", "lag/colocate_async", "lag/fully_async")
# (file, verl-sat's text, the recipe's): what the recipe says differently about its own pieces
EDITS = (
    ("paper/table9.yaml", "belong to the launch script (see examples/).", "belong to the launch script (run_*.sh)."),
    ("paper/table9.yaml",
     "      # verl-sat's policy-loss config for every row: verl's PolicyLossConfig plus the `sat` block (read by the "
     "SAT\n      # losses only); building it makes the actor log the paper's mismatch actor/mismatch_abs_log_ratio "
     "(Eq. 52)\n",
     "      # the recipe's policy-loss config for every row: verl's PolicyLossConfig with the sat_* keys of the SAT\n"
     f"      # losses ({PACKAGE}.compat: verl's own class once verl has them)\n"),
    ("r3/fsdp.yaml", ", added by verl-sat.\n",
     f":\n# verl's own once verl has it, else this recipe's ({PACKAGE}.compat).\n"),
    ("r3/fsdp.yaml", ' (docs/routing_replay.md, "Engine configurations tested").', "."),
    ("r3/fsdp.yaml",
     "        # verl's router-replay config, as verl-sat's subclass: building it with mode R3 installs verl-sat's "
     "FSDP\n        # routing replay in that process (a worker without verl-sat fails to import it: loud, never "
     "silent)\n",
     "        # verl's router-replay config; on verl 0.9.1 the recipe's subclass, which installs the recipe's FSDP\n"
     "        # routing replay in that process when built with mode R3\n"),
    ("method/sat_gspo_token.yaml", '(docs/sat.md, "The scope of the quantile"; docs/results.md).',
     '(docs/algo/sat.md of verl, "The scope of the quantile").'),
    ("recipe/sat_gspo_token.yaml", '; this row kept SAT\'s gain at 8 and 2 (docs/results.md,\n# "Sequences per '
     'micro-batch").', "."),
)  # fmt: skip
_KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_]\w*):(?P<rest>.*)$")


def recipe_configs() -> dict[str, str]:
    """``config/<group>/<name>.yaml`` -> its text, for every piece of ``GROUPS``."""
    recipes = files("verl_sat.recipes")
    configs = {}
    for group in GROUPS:
        folder = recipes.joinpath(*group.split("/"))
        for path in sorted(folder.iterdir(), key=lambda p: p.name):
            if path.name.endswith(".yaml"):
                name = f"{group}/{path.name}"
                configs[name] = flat_sat_keys(path.read_text(), name)
    for name, old, new in EDITS:
        if name not in configs:
            raise UpstreamDriftError(f"verl-sat's recipe group has no {name}: extend {__name__}.EDITS")
        configs[name] = replace_once(configs[name], old, new, f"recipes/{name}")
    return {f"config/{name}": renamed(text, f"recipes/{name}") for name, text in configs.items()}


def flat_sat_keys(text: str, where: str) -> str:
    """``text`` with every ``sat:`` block directly under ``policy_loss:`` turned into the flat ``sat_<name>`` keys of
    ``policy_loss`` (its comments kept, one level up)."""
    lines, out = text.splitlines(keepends=True), []
    names = {f.name for f in fields(SatParams)}
    loss_indent = block_indent = None
    for line in lines:
        indent = len(line) - len(line.lstrip(" "))
        content = line.strip()
        if block_indent is not None and content and indent <= block_indent:
            block_indent = None
        if loss_indent is not None and content and not content.startswith("#") and indent <= loss_indent:
            loss_indent = None
        key = _KEY.match(line.rstrip("\n"))
        if block_indent is not None:
            if key and indent == block_indent + 2:
                if key["key"] not in names:
                    raise UpstreamDriftError(f"recipes/{where}: sat.{key['key']} is not a SatParams field")
                line = f"{' ' * block_indent}{FLAT_PREFIX}{key['key']}:{key['rest']}\n"
            elif key:
                raise UpstreamDriftError(f"recipes/{where}: a nested key under policy_loss.sat: {content}")
            else:
                line = line[2:] if content else line
        elif key and key["key"] == "policy_loss" and not key["rest"].strip():
            loss_indent = indent
        elif key and key["key"] == "sat" and loss_indent is not None and indent == loss_indent + 2:
            block_indent = indent
            continue
        out.append(line)
    return "".join(out)
