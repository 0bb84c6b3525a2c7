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
"""The Python files of the verl-recipe ``sat/`` recipe, generated from verl-sat's source.

- ``main.py``, ``preflight.py``, ``lag_presets.py``: ``verl_sat.main`` (``python -m recipe.sat.main``), its checks
  and its lag presets, without the plugin's CPU platform and run-time fixes of verl bugs (the core pull request fixes
  those in verl); ``main`` also pins the values of the recipe's resolvers (``resolvers.py``), which verl's Ray task
  runner, a process that never imports the recipe, could not resolve;
- ``fallback/``: the core pull request's code for verl 0.9.1, from the same source as the pull request: the SAT math,
  the inert-gate warning and the model-level routing replay as they are, the registered losses and the FSDP engine
  with routing replay with their imports mapped, and a ``PolicyLossConfig`` with the pull request's flat ``sat_*``
  keys;
- ``compat.py``: verl's own names where verl has them (the core pull request), the fallback's otherwise; the YAML
  names its config classes as ``_target_``, so every worker that builds the actor config imports it.

Imports are laid out as verl-recipe's ruff configuration sorts them (``verl`` first-party, the recipe's own relative).
"""

import ast
import inspect
import re
import sys
from types import ModuleType

import verl_sat.config
import verl_sat.fsdp_engine
import verl_sat.inert_sat
import verl_sat.lag_presets
import verl_sat.losses
import verl_sat.main
import verl_sat.preflight
import verl_sat.routing_replay
import verl_sat.sat_math
from verl_sat.upstream.edit import UpstreamDriftError, definitions_source, replace_once, standalone_source
from verl_sat.upstream.recipe_names import FALLBACK, FALLBACK_MODULES, LICENSE_END, MODULES, PACKAGE, renamed
from verl_sat.upstream.sat_patch import MODULE_MAP as SAT_MODULE_MAP
from verl_sat.upstream.sat_patch import POST_INIT, flat_arg_docs, flat_fields, flat_sat_params_of

HEADER = inspect.getsource(verl_sat.sat_math).split(LICENSE_END)[0] + LICENSE_END  # the Apache-2.0 header
# verl_sat.main's plugin-only lines: the CPU platform (verl-sat's own), the run-time fixes of verl bugs (the core pull
# request fixes them in verl); the recipe pins its resolvers' values instead of passing the plugin's worker variables
MAIN_EDITS = (
    ("from verl_sat import lag_presets, trainer_fixes\n", "from verl_sat import lag_presets\nfrom .resolvers import "
                                                          "resolved_overrides\n"),
    ("    check_trainer_device,\n", ""),
    ('            if config.trainer.get("device") == "cpu":  # before the checks: they may import verl\'s engines\n'
     "                use_cpu()\n", ""),
    ("            args = [*args, *worker_env_overrides(config)]\n",
     "            args = [*args, *resolved_overrides(config)]\n"),
    ("            check_trainer_device(config)\n", ""),
    ('        os.environ[trainer_fixes.FIXES_ENV] = "1"  # for the workers Ray starts from this process\'s '
     "environment\n", ""),
)  # fmt: skip
MAIN_DROPPED = ("use_cpu", "worker_env_overrides")
PREFLIGHT_DROPPED = ("check_trainer_device", "_check_vllm_cpu_build")  # a trainer.device=cpu job: verl-sat's platform
PREFLIGHT_EDITS = (
    # the mirrored asserts are pinned to verl's code by verl-sat's tests
    (" (each failure names the keys and the numbers; the mirrored asserts are\n    pinned to verl's code by "
     "``tests/test_preflight_trainers_on_cpu.py``)", " (each failure names the keys and the numbers)"),
)  # fmt: skip
LAG_PRESETS_EDITS = (
    (", which both\n``python -m verl_sat.main`` and ``verl-sat train`` compose through)", ", which\n"
     "``python -m verl_sat.main`` composes through)"),
    (" reproduces them (tested).", " reproduces them."),
)  # fmt: skip
RESOLVED_OVERRIDES = '''

def resolved_overrides(config: DictConfig) -> list[str]:
    """``key=value`` for every key of the composed ``config`` whose value calls a resolver of ``RESOLVERS``, resolved
    here: verl resolves its config again in its Ray task runner, a process that never imports this recipe."""
    register_resolvers()
    calls = tuple(f"${{{name}:" for name in RESOLVERS)
    overrides = []

    def visit(node: dict, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                visit(value, f"{prefix}{key}.")
            elif isinstance(value, str) and any(call in value for call in calls):
                overrides.append(f"{prefix}{key}={OmegaConf.select(config, f'{prefix}{key}')}")

    visit(OmegaConf.to_container(config, resolve=False), "")
    return overrides
'''
COMPAT = f'''\
"""SAT (arXiv 2607.18722) and FSDP routing replay from verl where verl has them, from this recipe's copy otherwise.

verl gets the ``sat`` and ``sat_gspo`` policy losses with ``PolicyLossConfig``'s flat ``sat_*`` keys, and routing
replay (R3) in its FSDP engine, from the pull request "[algo] feat: SAT ..." and "[fsdp] feat: rollout routing replay
(R3) ...". Until verl has them, ``{FALLBACK}/`` holds the same code. verl's losses are recognised by where the
registered functions come from, so the fallback never registers over verl's own. The recipe's YAML names
``SatPolicyLossConfig`` and ``FSDPRouterReplayConfig`` as ``_target_``, so every worker that builds the actor config
imports this module: with the fallback that registers the losses, and a router-replay config built with ``mode=R3``
installs the fallback's FSDP engine in that process. Importing it also registers the recipe's OmegaConf resolvers
(``resolvers.py``).
"""

import logging

from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

from .resolvers import register_resolvers

logger = logging.getLogger(__name__)

SAT_LOSSES = ("sat", "sat_gspo")
# verl's own SAT losses: registered functions that come from verl's package, whatever verl names its helpers; the
# recipe never registers its copy over them
VERL_SAT_LOSSES = {{
    name: loss
    for name in SAT_LOSSES
    if (loss := POLICY_LOSS_REGISTRY.get(name)) is not None and loss.__module__.split(".")[0] == "verl"
}}

if len(VERL_SAT_LOSSES) == len(SAT_LOSSES):  # verl with the core pull request's SAT losses
    from verl.workers.config import PolicyLossConfig as SatPolicyLossConfig

    try:
        from verl.workers.config.actor import SAT_KEY_FORMAT, sat_params_of
    except ImportError:  # verl named its helpers otherwise: the fallback's reader of the same flat sat_* keys
        from .{FALLBACK}.config import SAT_KEY_FORMAT, sat_params_of
    logger.warning(
        "verl registers its own SAT policy losses (%s): the recipe uses verl's, not its fallback copy",
        ", ".join(f"{{name}}: {{loss.__module__}}.{{loss.__qualname__}}" for name, loss in VERL_SAT_LOSSES.items()),
    )
elif VERL_SAT_LOSSES:
    raise ImportError(
        f"verl registers {{sorted(VERL_SAT_LOSSES)}} but not all of {{list(SAT_LOSSES)}}: the recipe cannot mix "
        "verl's SAT losses with its fallback copy"
    )
else:  # verl 0.9.1: the recipe's copy; importing its losses registers them
    from .{FALLBACK} import losses  # noqa: F401
    from .{FALLBACK}.config import SAT_KEY_FORMAT, SatPolicyLossConfig, sat_params_of

try:  # verl with the core pull request's routing replay in the FSDP engine
    from verl.models.transformers.router_replay import RoutingReplay  # noqa: F401
except ImportError:  # verl 0.9.1: the recipe's copy, installed by the config when a job asks for R3
    from .{FALLBACK}.config import FSDPRouterReplayConfig
else:
    from verl.workers.config import EngineRouterReplayConfig as FSDPRouterReplayConfig

__all__ = ["FSDPRouterReplayConfig", "SAT_KEY_FORMAT", "SatPolicyLossConfig", "sat_params_of"]

register_resolvers()
'''
# the fallback's losses are imported only where verl registers no SAT losses of its own (compat.py decides), so the
# plugin's guard that keeps verl's own registered is left out
LOSSES_EDITS = (
    ("from verl_sat.verl_own_losses import keep_verl_own, verl_own\n", ""),
    (
        "\n# where verl already registers sat / sat_gspo (the core pull request), its own stay registered (bottom of "
        "this module)\n_VERL_OWN = verl_own()\n",
        "",
    ),
    ("\n\nkeep_verl_own(_VERL_OWN)\n", ""),
)
FALLBACK_INIT = '''\
"""The core pull request's SAT losses and FSDP routing replay for verl 0.9.1, generated from the same source as the
pull request; ``recipe.sat.compat`` imports each piece only where verl lacks it."""
'''
FALLBACK_CONFIG_DOC = '''\
"""The core pull request's SAT keys of verl's ``PolicyLossConfig`` (``verl/workers/config/actor.py``) and its FSDP
router-replay config, for verl 0.9.1."""
'''
FALLBACK_CONFIG_IMPORTS = """
from dataclasses import dataclass, fields
from typing import Any, Optional

from verl.workers.config import EngineRouterReplayConfig, PolicyLossConfig

from .sat_math import SatParams, check_sat_params
"""
RESOLVERS_DOC = '''\
"""The recipe's OmegaConf resolver ``${sat.div:a,b}`` (a lag preset's mini-batch, ``data.train_batch_size`` / lag),
and the overrides that pin its values for verl's Ray processes."""

from omegaconf import DictConfig, OmegaConf


'''
_RELATIVE_FROM = re.compile(r"^(?P<indent> *)from (?P<module>verl_sat(?:\.\w+)*) import ", re.M)
_PLAIN_IMPORT = re.compile(r"^(?P<indent> *)import (?P<module>verl_sat\.\w+)(?P<rest>.*)$", re.M)


def recipe_code() -> dict[str, str]:
    """The recipe's Python files, by path inside its folder."""
    return {
        "__init__.py": _module(
            '"""SAT (arXiv 2607.18722): the Staleness-Adaptive Trust Region for asynchronous RL, '
            'on verl\'s three asynchronous\ntrainers (``python -m recipe.sat.main``)."""\n'
        ),
        "config/__init__.py": _module('"""The recipe\'s Hydra config group (``pkg://recipe.sat.config``)."""\n'),
        "main.py": module_copy(verl_sat.main, "", MAIN_DROPPED, MAIN_EDITS),
        "preflight.py": module_copy(verl_sat.preflight, "", PREFLIGHT_DROPPED, PREFLIGHT_EDITS),
        "lag_presets.py": module_copy(verl_sat.lag_presets, "", edits=LAG_PRESETS_EDITS),
        "resolvers.py": _resolvers(),
        "compat.py": _module(COMPAT),
        f"{FALLBACK}/__init__.py": _module(FALLBACK_INIT),
        f"{FALLBACK}/sat_math.py": standalone_source(verl_sat.sat_math),
        f"{FALLBACK}/inert_sat.py": standalone_source(verl_sat.inert_sat),
        f"{FALLBACK}/routing_replay.py": standalone_source(verl_sat.routing_replay),
        f"{FALLBACK}/losses.py": module_copy(verl_sat.losses, FALLBACK, edits=LOSSES_EDITS),
        f"{FALLBACK}/fsdp_engine.py": module_copy(verl_sat.fsdp_engine, FALLBACK),
        f"{FALLBACK}/config.py": _fallback_config(),
    }


def module_copy(module: ModuleType, package: str, dropped: tuple[str, ...] = (), edits: tuple = ()) -> str:
    """verl-sat's ``module`` as a module of the recipe's ``package`` (``""``: the recipe's top, or ``FALLBACK``):
    without the top-level definitions ``dropped``, with ``edits`` (each ``(old, new)`` must occur once), its verl-sat
    imports made relative, its imports laid out in verl-recipe's sections and verl-sat's names replaced."""
    where = f"{module.__name__} -> {PACKAGE}.{MODULES[module.__name__]}"
    text = _without_definitions(inspect.getsource(module), dropped)
    for old, new in edits:
        text = replace_once(text, old, new, where)
    return _laid_out(_relative_imports(text, package, where), package, where)


def _module(body: str) -> str:
    return HEADER + body


def _laid_out(text: str, package: str, where: str) -> str:
    """``text`` with its top-level import block in verl-recipe's isort sections and verl-sat's names replaced."""
    if package == FALLBACK:
        return renamed(_sorted_import_block(text), where, FALLBACK_MODULES, prefix="")
    return renamed(_sorted_import_block(text), where)


def _relative_imports(text: str, package: str, where: str) -> str:
    """Every import of a verl-sat module in ``text``, at any depth, as a relative import of the recipe's module."""
    modules = FALLBACK_MODULES if package == FALLBACK else MODULES

    def relative(name: str) -> str:
        if name == "verl_sat":
            return "."
        if name not in modules:
            raise UpstreamDriftError(f"{where}: imports {name}, which the recipe has no module for")
        target = modules[name]
        if package and not target.startswith(f"{package}."):
            raise UpstreamDriftError(f"{where}: imports {name} ({PACKAGE}.{target}) from outside {package}/")
        return "." + target.removeprefix(f"{package}.")

    text = _RELATIVE_FROM.sub(lambda m: f"{m['indent']}from {relative(m['module'])} import ", text)
    return _PLAIN_IMPORT.sub(
        lambda m: (
            f"{m['indent']}from {relative(m['module']).rpartition('.')[0] or '.'} import "
            f"{relative(m['module']).rpartition('.')[2]}{m['rest']}"
        ),
        text,
    )


def _sorted_import_block(text: str) -> str:
    """The top-level imports in ruff's isort sections for verl-recipe (standard library, third party, ``verl``, the
    recipe's relative imports), each section in ruff's order, one blank line between sections."""
    tree = ast.parse(text)
    imports = [node for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)]
    if not imports:
        return text
    lines = text.splitlines(keepends=True)
    first, last = imports[0].lineno - 1, imports[-1].end_lineno
    between = [n for n in tree.body if first < n.lineno - 1 < last and n not in imports]
    if between:
        raise UpstreamDriftError(f"code between the top-level imports at line {between[0].lineno}")
    sections: dict[int, list[tuple[tuple, str]]] = {0: [], 1: [], 2: [], 3: []}
    for node in imports:
        statement = "".join(lines[node.lineno - 1 : node.end_lineno])
        if isinstance(node, ast.Import):
            top, key = node.names[0].name.split(".")[0], (0, 0, node.names[0].name)
        else:
            top, key = (node.module or "").split(".")[0], (1, -node.level, node.module or "")
        section = 3 if getattr(node, "level", 0) else 2 if top == "verl" else 0 if top in sys.stdlib_module_names else 1
        sections[section].append((key, statement))
    block = "\n".join("".join(s for _, s in sorted(entries)) for entries in sections.values() if entries)
    return "".join(lines[:first]) + block + "".join(lines[last:])


def _without_definitions(text: str, names: tuple[str, ...]) -> str:
    """``text`` without the top-level functions or classes ``names`` (each must exist) and the blank lines before
    them."""
    nodes = {n.name: n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
    missing = sorted(set(names) - set(nodes))
    if missing:
        raise UpstreamDriftError(f"no top-level definition named {missing} to leave out of the recipe")
    lines = text.splitlines(keepends=True)
    for node in sorted((nodes[name] for name in names), key=lambda n: n.lineno, reverse=True):
        start = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
        while start and not lines[start - 1].strip():
            start -= 1
        del lines[start : node.end_lineno]
    return "".join(lines)


def _resolvers() -> str:
    divide = definitions_source(verl_sat.config, ["divide_evenly"])
    register = definitions_source(verl_sat.config, ["register_resolvers"])
    resolvers = 'RESOLVERS = {"sat.div": divide_evenly}'
    body = f"{RESOLVERS_DOC}{divide}\n\n\n{resolvers}\n\n\n{register}\n{RESOLVED_OVERRIDES}"
    return renamed(_module(body), f"{PACKAGE}.resolvers")


def _fallback_config() -> str:
    router_replay = _relative_imports(definitions_source(verl_sat.config, ["FSDPRouterReplayConfig"]), FALLBACK,
                                      f"{PACKAGE}.{FALLBACK}.config")  # fmt: skip
    core_sat_math = SAT_MODULE_MAP["verl_sat.sat_math"]  # the flat sat_params_of names verl's module, as in the PR
    sat_params_of = replace_once(flat_sat_params_of(), f"``{core_sat_math}.", f"``{MODULES['verl_sat.sat_math']}.",
                                 f"{PACKAGE}.{FALLBACK}.config")  # fmt: skip
    body = (
        f"{FALLBACK_CONFIG_DOC}{FALLBACK_CONFIG_IMPORTS}{sat_params_of.removeprefix(chr(10))}\n\n"
        "@dataclass\nclass SatPolicyLossConfig(PolicyLossConfig):\n"
        '    """verl\'s ``PolicyLossConfig`` with the ``sat_*`` keys of the ``sat`` and ``sat_gspo`` policy losses.\n\n'
        f'    Args:\n{flat_arg_docs()}    """\n\n{flat_fields()}{POST_INIT}\n\n{router_replay}\n'
    )
    return renamed(_module(body), f"{PACKAGE}.{FALLBACK}.config", FALLBACK_MODULES, prefix="")
