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
"""``python -m verl_sat.main +recipe=NAME [+lag=lagL] [verl overrides]``: verl's own entry point with verl-sat's
recipe group on the search path. The trainer is chosen as in verl:

- verl's PPO entry point (``verl.trainer.main_ppo.main``) with its v1 trainer, ``trainer.v1.trainer_mode`` =
  ``separate_async`` (the lag presets' default), ``colocate_async`` or ``sync``;
- verl's fully-async trainer (``verl.experimental.fully_async_policy.fully_async_main.main``) with
  ``--config-name fully_async_ppo_trainer`` or ``fully_async_ppo_megatron_trainer`` (any config with an
  ``async_training`` block).

``+lag=lagL`` selects the preset written in the chosen trainer's own keys (``recipes/lag/<trainer>/``; the files
directly under ``recipes/lag/`` are ``separate_async``'s). Before verl starts Ray, the composed config is checked
(``verl_sat.preflight``), also for ``--cfg job``, so that a dry run fails as the real run would; only Hydra's help
flags skip the checks.
"""

import os
import sys
from dataclasses import dataclass
from importlib import import_module
from importlib.util import find_spec

from omegaconf import DictConfig

from verl_sat import lag_presets, trainer_fixes
from verl_sat.preflight import (
    PreflightError,
    check_config,
    check_sizes,
    check_trainer_device,
    check_trainer_startup,
    lag_preset_for_trainer,
    selected_trainer,
)

RECIPES_SEARCHPATH = "pkg://verl_sat.recipes"
VERL_CONFIG_SEARCHPATH = "pkg://verl.trainer.config"  # verl's config tree, which the fully-async configs extend


@dataclass(frozen=True)
class VerlEntry:
    """One of verl's entry points: its module and its ``@hydra.main(config_path=..., config_name=...)``."""

    module: str
    config_path: str
    config_name: str


PPO_ENTRY = VerlEntry("verl.trainer.main_ppo", "config", "ppo_trainer")
FULLY_ASYNC_ENTRY = VerlEntry(
    "verl.experimental.fully_async_policy.fully_async_main", "config", "fully_async_ppo_trainer"
)
FULLY_ASYNC_CONFIG_NAMES = ("fully_async_ppo_trainer", "fully_async_ppo_megatron_trainer")
_HELP_FLAGS = ("--help", "-h", "--hydra-help", "--info", "-i")  # print without composing a job: no checks
_FLAGS_WITH_VALUE = ("--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd", "--cfg", "-c",
                     "--package", "-p", "--experimental-rerun")  # fmt: skip


def split_args(args: list[str]) -> tuple[list[str], list[str]]:
    """Split Hydra command-line args into flags (with their values) and overrides."""
    flags, overrides, i = [], [], 0
    while i < len(args):
        arg = args[i]
        if arg in _FLAGS_WITH_VALUE and i + 1 < len(args):
            flags += args[i : i + 2]
            i += 2
            continue
        (flags if arg.startswith("-") else overrides).append(arg)
        i += 1
    return flags, overrides


def entry_for(args: list[str]) -> VerlEntry:
    """The entry point whose config folder ``args`` compose from: fully-async for its config names, else PPO."""
    from hydra._internal.utils import get_args_parser

    name = get_args_parser().parse_args(split_args(args)[0]).config_name
    return FULLY_ASYNC_ENTRY if name is not None and os.path.basename(name) in FULLY_ASYNC_CONFIG_NAMES else PPO_ENTRY


def with_recipes_searchpath(args: list[str]) -> list[str]:
    """Args with verl-sat's recipes (and, for the fully-async configs, verl's config tree) appended to
    ``hydra.searchpath``, flags first (argparse takes the overrides as one positional group). The search path the
    user gave on the command line, or else the one the primary config declares (a custom ``--config-path`` config
    often lists ``pkg://verl.trainer.config`` there; verl's fully-async Megatron config lists
    ``file://verl/trainer/config``, which resolves only from a verl checkout's root), is kept in front."""
    flags, overrides = split_args(args)
    given = [o for o in overrides if o.lstrip("+").startswith("hydra.searchpath=")]
    if given:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        entries = OverridesParser.create().parse_override(given[-1]).value()  # the override's list
        overrides = [o for o in overrides if o not in given]
    else:
        entries = declared_searchpath(flags)
    needed = [VERL_CONFIG_SEARCHPATH] if entry_for(flags) is FULLY_ASYNC_ENTRY else []  # its configs extend verl's
    entries = [*entries, *(path for path in (*needed, RECIPES_SEARCHPATH) if path not in entries)]
    return [*flags, f"hydra.searchpath=[{','.join(entries)}]", *overrides]


def declared_searchpath(flags: list[str]) -> list[str]:
    """The ``hydra.searchpath`` the primary config file declares (read, not composed: its defaults may only be found
    on the search path this returns)."""
    from hydra._internal.config_repository import ConfigRepository
    from hydra._internal.utils import get_args_parser
    from hydra.errors import MissingConfigException

    parsed = get_args_parser().parse_args(flags)
    entry = entry_for(flags)
    name = parsed.config_name or entry.config_name
    loaded = ConfigRepository(_search_path(parsed, entry)).load_config(name)
    if loaded is None:
        raise MissingConfigException(f"Cannot find primary config '{name}'", name)
    return list(loaded.config.get("hydra", {}).get("searchpath", []))


def _search_path(parsed, entry: VerlEntry):
    """The search path ``entry``'s ``hydra.main`` builds: its config folder next to its module, or ``--config-path``
    / ``-cp`` absolute or relative to that file, plus ``--config-dir`` / ``-cd``."""
    from hydra._internal.utils import create_automatic_config_search_path
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.errors import SearchPathException

    search_path = create_automatic_config_search_path(
        find_spec(entry.module).origin, None, parsed.config_path or entry.config_path
    )
    if parsed.config_dir is not None:
        config_dir = os.path.abspath(parsed.config_dir)
        if not os.path.isdir(config_dir):
            raise SearchPathException(f"Additional config directory '{config_dir}' not found")
        search_path.prepend(provider="command-line", path=f"file://{config_dir}", anchor=SearchPathQuery("schema"))
    return search_path


def compose_from_args(args: list[str]) -> DictConfig:
    """The config verl's entry point will compose for ``args``, composed the way its ``hydra.main`` does it: the
    same search path, config name and overrides. Hydra's own helpers build the search path; nothing runs and Hydra's
    global state is left as it was."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import get_args_parser
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    parsed = get_args_parser().parse_args(args)
    entry = entry_for(args)
    lag_presets.register(parsed.overrides)  # +lag=lagN / fixedN for any N
    global_hydra = GlobalHydra.instance()
    outer = global_hydra.hydra if global_hydra.is_initialized() else None
    try:
        hydra = Hydra.create_main_hydra2(
            task_name=entry.module.rsplit(".", 1)[-1], config_search_path=_search_path(parsed, entry)
        )
        return hydra.compose_config(parsed.config_name or entry.config_name, parsed.overrides, run_mode=RunMode.RUN)
    finally:
        global_hydra.clear()
        if outer is not None:
            global_hydra.initialize(outer)


def with_trainer_lag(args: list[str], config: DictConfig) -> list[str]:
    """Args with ``+lag=NAME`` replaced by the preset written in the selected trainer's keys (``+lag=TRAINER/NAME``),
    for the trainers whose presets live in a subfolder; anything else unchanged."""
    choice = config.hydra.runtime.choices.get("lag")
    preset = lag_preset_for_trainer(choice, selected_trainer(config))
    if preset == choice:
        return args
    return [f"{arg.split('=', 1)[0]}={preset}" if _is_lag_override(arg) else arg for arg in args]


def compose_job(args: list[str]) -> tuple[list[str], DictConfig]:
    """The args verl's entry point will get (``+lag=`` naming the selected trainer's preset) and their config."""
    config = compose_from_args(args)
    lag_args = with_trainer_lag(args, config)
    return (args, config) if lag_args == args else (lag_args, compose_from_args(lag_args))


def _is_lag_override(arg: str) -> bool:
    return arg.lstrip("+~").split("=", 1)[0] == "lag"


def main() -> None:
    args = with_recipes_searchpath(sys.argv[1:])
    if not any(arg in _HELP_FLAGS for arg in split_args(args)[0]):
        from hydra.errors import HydraException

        try:
            args, config = compose_job(args)
            if config.trainer.get("device") == "cpu":  # before the checks: they may import verl's engines
                use_cpu()
            args = [*args, *worker_env_overrides(config)]
            for warning in check_config(config):
                print(f"verl-sat: warning: {warning}", file=sys.stderr)
            check_trainer_device(config)
            check_sizes(config)
            for warning in check_trainer_startup(config):
                print(f"verl-sat: warning: {warning}", file=sys.stderr)
        except (PreflightError, HydraException) as err:  # Hydra's message lists e.g. the valid recipe names
            sys.exit(f"verl-sat: {err}")
        entry = FULLY_ASYNC_ENTRY if selected_trainer(config) == "fully_async" else PPO_ENTRY
        os.environ[trainer_fixes.FIXES_ENV] = "1"  # for the workers Ray starts from this process's environment
    else:
        entry = entry_for(args)
    sys.argv = [sys.argv[0], *with_config_folder(args, entry)]
    import_module(entry.module).main()


def with_config_folder(args: list[str], entry: VerlEntry) -> list[str]:
    """Args naming ``entry``'s config folder as an absolute ``--config-path`` when they name none: Hydra resolves a
    relative ``config_path`` of an imported (not ``__main__``) entry module as a Python package, which verl's
    fully-async config folder is not."""
    if entry is PPO_ENTRY or any(flag in ("--config-path", "-cp") for flag in split_args(args)[0]):
        return args
    folder = os.path.join(os.path.dirname(find_spec(entry.module).origin), entry.config_path)
    return ["--config-path", folder, *args]


def use_cpu() -> None:
    """A ``trainer.device=cpu`` run: select verl-sat's CPU platform in this process (an import error stops the run
    here, with the real exception); ``worker_env_overrides`` passes it to the Ray workers."""
    import verl_sat.cpu

    os.environ[verl_sat.cpu.PLATFORM_ENV] = verl_sat.cpu.PLATFORM_NAME
    verl_sat.cpu.activate()


def worker_env_overrides(config: DictConfig) -> list[str]:
    """The overrides that set, in every Ray worker of the run, ``VERL_SAT_TRAINER_FIXES=1`` (verl_sat.trainer_fixes)
    and for a ``trainer.device=cpu`` run ``VERL_PLATFORM=cpu``."""
    import verl_sat.cpu

    env = {trainer_fixes.FIXES_ENV: "1"}
    if config.trainer.get("device") == "cpu":
        env[verl_sat.cpu.PLATFORM_ENV] = verl_sat.cpu.PLATFORM_NAME
    given = config.ray_kwargs.ray_init.runtime_env.get("env_vars") or {}
    key = "ray_kwargs.ray_init.runtime_env.env_vars"
    return [f"{'' if name in given else '+'}{key}.{name}='{value}'" for name, value in env.items()]  # strings


if __name__ == "__main__":
    main()
