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
"""Patch 1 of the upstream series: SAT as verl's own policy losses, generated from verl-sat's source.

- ``verl/trainer/ppo/sat_math.py``: ``verl_sat/sat_math.py`` as it is (pure torch, no verl import);
- ``verl/trainer/ppo/sat_inert.py``: ``verl_sat/inert_sat.py`` as it is (the warning when SAT cannot gate);
- ``verl/trainer/ppo/core_algos.py``: every function of ``verl_sat/losses.py`` (the registered ``sat`` and
  ``sat_gspo`` and their helpers), after verl's ``gspo``;
- ``verl/workers/config/actor.py``: ``PolicyLossConfig`` gains one flat field per ``SatParams`` field
  (``sat.<name>`` becomes ``sat_<name>``), validated in ``__post_init__`` by ``sat_math.check_sat_params``;
- ``verl/trainer/config/actor/actor.yaml``: the same keys with their defaults, a comment each.

The only code written here is the mapping from verl-sat's nested ``policy_loss.sat`` block to verl's flat keys.
"""

import ast
import inspect
import json
import textwrap
from dataclasses import MISSING, fields

import verl_sat.inert_sat
import verl_sat.losses
import verl_sat.sat_math
from verl_sat.config import VERL_FLAT_KEY
from verl_sat.sat_math import SatParams
from verl_sat.upstream.edit import (
    UpstreamDriftError,
    definitions_source,
    insert_after,
    insert_before,
    module_imports,
    replace_once,
    standalone_source,
    top_level_names,
)

SAT_MATH = "verl/trainer/ppo/sat_math.py"
SAT_INERT = "verl/trainer/ppo/sat_inert.py"
CORE_ALGOS = "verl/trainer/ppo/core_algos.py"
ACTOR_CONFIG = "verl/workers/config/actor.py"
ACTOR_YAML = "verl/trainer/config/actor/actor.yaml"
FLAT_PREFIX = VERL_FLAT_KEY.format("")  # verl's flat key of SatParams field `name` is `sat_<name>`
# imports of verl_sat/losses.py that only its module-level code uses (not copied): keeping verl's own losses registered
PLUGIN_ONLY_MODULES = ("verl_sat.verl_own_losses",)
PLUGIN_KEY = "actor_rollout_ref.actor.policy_loss.sat.{}"
UPSTREAM_KEY = "actor_rollout_ref.actor.policy_loss." + FLAT_PREFIX + "{}"
WIDTH = 120  # verl's ruff line length
# where verl-sat's modules land in verl, for the imports of the copied loss functions
MODULE_MAP = {"verl_sat.sat_math": "verl.trainer.ppo.sat_math", "verl_sat.inert_sat": "verl.trainer.ppo.sat_inert",
              "verl_sat.config": "verl.workers.config.actor"}  # fmt: skip
# the flat-key counterpart of verl_sat.config.sat_params_of, added to verl's actor config module
UPSTREAM_SAT_PARAMS_OF = '''

SAT_KEY_FORMAT = "{key}"  # how errors name a SAT key


def sat_params_of(policy_loss: Any, loss_mode: Optional[str] = None) -> SatParams:
    """The SAT hyperparameters (``verl.trainer.ppo.sat_math.SatParams``) of a policy-loss config: its flat ``sat_*``
    keys (``PolicyLossConfig``, dict or DictConfig; the default where a key is absent), validated for ``loss_mode``
    (the token-level ``sat`` refuses a non-default ``sat_granularity``).
    """
    defaults = SatParams()
    values = {{f.name: getattr(defaults, f.name) for f in fields(SatParams)}}
    if policy_loss is not None:
        values = {{name: policy_loss.get(f"{prefix}{{name}}", value) for name, value in values.items()}}
    params = SatParams(**values)
    check_sat_params(params, SAT_KEY_FORMAT, loss_mode)
    return params
'''
YAML_INTRO = """
  # Staleness-Adaptive Trust Region (SAT, https://arxiv.org/abs/2607.18722), read by loss_mode "sat" (token level,
  # SAT-GRPO) and "sat_gspo" (SAT-GSPO); see docs/algo/sat.md. Statistics are per micro-batch.
"""
POST_INIT = '''
    def __post_init__(self):
        """Validate the SAT keys (``sat_*``): a bad value fails when the config is built, naming its key."""
        sat_params_of(self, self.loss_mode)
'''


def key_mapping() -> list[tuple[str, str]]:
    """(verl-sat key, verl key) for every SAT hyperparameter."""
    return [(PLUGIN_KEY.format(f.name), UPSTREAM_KEY.format(f.name)) for f in fields(SatParams)]


def param_docs() -> dict[str, tuple[str, str]]:
    """``SatParams``'s ``Args:`` section: field name -> (type name, description as one line)."""
    doc = inspect.getdoc(SatParams)
    args = doc.split("Args:\n", 1)[1].splitlines()
    docs, name = {}, None
    for line in args:
        if line.startswith("    ") and not line.startswith("        "):
            head, text = line.strip().split(": ", 1)
            name, type_name = head.split(" (")
            docs[name] = (type_name.rstrip(")"), text)
        elif name is not None and line.strip():
            docs[name] = (docs[name][0], f"{docs[name][1]} {line.strip()}")
    missing = {f.name for f in fields(SatParams)} - set(docs)
    if missing:
        raise UpstreamDriftError(f"SatParams's docstring documents no {sorted(missing)} in its Args section")
    return docs


def sat_changes(read) -> dict[str, str]:
    """The new text of every file patch 1 touches (``read(path)`` gives verl 0.9.1's text); the generated trainer
    configs are rebuilt later, from the edited tree."""
    return {
        SAT_MATH: standalone_source(verl_sat.sat_math),
        SAT_INERT: standalone_source(verl_sat.inert_sat),
        CORE_ALGOS: _core_algos(read(CORE_ALGOS)),
        ACTOR_CONFIG: _actor_config(read(ACTOR_CONFIG)),
        ACTOR_YAML: _actor_yaml(read(ACTOR_YAML)),
    }


def _core_algos(text: str) -> str:
    bound = top_level_names(text)
    mapped: dict[str, list[str]] = {}
    for statement in module_imports(verl_sat.losses):
        node = ast.parse(statement).body[0]
        module = getattr(node, "module", None)
        names = [alias.asname or alias.name for alias in node.names]
        if module in PLUGIN_ONLY_MODULES:
            continue
        if module in MODULE_MAP:
            mapped.setdefault(MODULE_MAP[module], []).extend(names)
        elif module != "verl.trainer.ppo.core_algos" and not set(names) <= bound:
            raise UpstreamDriftError(
                f"verl_sat/losses.py imports {sorted(set(names) - bound)} ({statement!r}), which verl's core_algos.py "
                "does not have: add the import mapping to verl_sat/upstream/sat_patch.py"
            )
    losses = definitions_source(verl_sat.losses)
    clash = bound & top_level_names(losses)
    if clash:
        raise UpstreamDriftError(f"verl's core_algos.py already defines {sorted(clash)}, as verl_sat/losses.py does")
    text = insert_after(
        text,
        "from verl.trainer.config import AlgoConfig\n",
        _import_line("verl.trainer.ppo.sat_inert", mapped.pop("verl.trainer.ppo.sat_inert"))
        + _import_line("verl.trainer.ppo.sat_math", mapped.pop("verl.trainer.ppo.sat_math")),
        CORE_ALGOS,
    )
    text = insert_after(
        text,
        "from verl.workers.config import ActorConfig\n",
        _import_line("verl.workers.config.actor", mapped.pop("verl.workers.config.actor")),
        CORE_ALGOS,
    )
    return insert_before(text, '@register_policy_loss("sapo")', losses + "\n\n\n", CORE_ALGOS)


def flat_arg_docs() -> str:
    """The ``Args:`` lines of the flat ``sat_*`` keys, indented for a config dataclass's docstring."""
    docs = param_docs()
    return "".join(
        textwrap.fill(
            f"(SAT) {docs[f.name][1]}",
            WIDTH,
            initial_indent=f"        {FLAT_PREFIX}{f.name} ({docs[f.name][0]}): ",
            subsequent_indent=" " * 12,
            break_on_hyphens=False,
        )
        + "\n"
        for f in fields(SatParams)
    )


def flat_fields() -> str:
    """One dataclass field line per ``SatParams`` field: ``sat_<name>: <type> = <default>``."""
    return "".join(
        f"    {FLAT_PREFIX}{f.name}: {f.type.__name__} = {_python_literal(_default(f))}\n" for f in fields(SatParams)
    )


def flat_sat_params_of() -> str:
    """``SAT_KEY_FORMAT`` and ``sat_params_of`` for the flat keys (two blank lines before them)."""
    return UPSTREAM_SAT_PARAMS_OF.format(key=UPSTREAM_KEY, prefix=FLAT_PREFIX)


def _actor_config(text: str) -> str:
    arg_lines, field_lines = flat_arg_docs(), flat_fields()
    dataclass_import = "from dataclasses import dataclass, field\n"
    loss_modes = "'dro', 'cispo', and 'bypass_mode'."
    dro_doc = (
        "        dro_beta (Optional[float]): Quadratic log-ratio penalty for DRO. Required when loss_mode is 'dro'."
    )
    last_field = "    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)\n"
    text = replace_once(text, dataclass_import, dataclass_import.replace("field", "field, fields"), ACTOR_CONFIG)
    text = insert_after(
        text,
        "from verl.trainer.config import CheckpointConfig, RolloutCorrectionConfig\n",
        "from verl.trainer.ppo.sat_math import SatParams, check_sat_params\n",
        ACTOR_CONFIG,
    )
    text = replace_once(text, loss_modes, loss_modes.replace("'cispo',", "'cispo', 'sat', 'sat_gspo',"), ACTOR_CONFIG)
    text = insert_after(text, dro_doc + "\n", arg_lines, ACTOR_CONFIG)
    text = insert_after(text, "    dro_beta: Optional[float] = None\n", field_lines, ACTOR_CONFIG)
    text = insert_after(text, last_field, POST_INIT, ACTOR_CONFIG)
    return insert_before(text, "\n\n@dataclass\nclass ActorConfig(BaseConfig):", flat_sat_params_of(), ACTOR_CONFIG)


def _actor_yaml(text: str) -> str:
    docs = param_docs()
    keys = "".join(
        "\n"
        + textwrap.fill(docs[f.name][1], WIDTH, initial_indent="  # ", subsequent_indent="  # ", break_on_hyphens=False)
        + f"\n  {FLAT_PREFIX}{f.name}: {_yaml_scalar(_default(f))}\n"
        for f in fields(SatParams)
    )
    return insert_after(text, "  dro_beta: null\n", YAML_INTRO + keys, ACTOR_YAML)


def _default(f):
    if f.default is MISSING:
        raise UpstreamDriftError(f"SatParams.{f.name} has no default; verl's config needs one")
    return f.default


def _python_literal(value) -> str:
    """As ruff formats it: strings in double quotes."""
    return json.dumps(value) if isinstance(value, str) else repr(value)


def _yaml_scalar(value) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def _import_line(module: str, names: list[str]) -> str:
    return f"from {module} import {', '.join(sorted(set(names)))}\n"
