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
"""``python -m verl_sat.main +recipe=NAME [+lag=lagL] [verl overrides]``: verl's own PPO entry point
(``verl.trainer.main_ppo.main``, its ``hydra.main``) with verl-sat's recipe group on the search path.

Before verl starts Ray, the composed config is checked (``verl_sat.preflight``), also for ``--cfg job``, so that a
dry run fails as the real run would; only Hydra's help flags skip the checks.
"""

import os
import sys
from importlib.util import find_spec

from omegaconf import DictConfig

from verl_sat.preflight import PreflightError, check_config, check_sizes, check_trainer_device

RECIPES_SEARCHPATH = "pkg://verl_sat.recipes"
# verl's PPO entry point and its @hydra.main(config_path="config", config_name="ppo_trainer")
VERL_ENTRY_MODULE, VERL_CONFIG_PATH, VERL_CONFIG_NAME = "verl.trainer.main_ppo", "config", "ppo_trainer"
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


def with_recipes_searchpath(args: list[str]) -> list[str]:
    """Args with verl-sat's recipes appended to ``hydra.searchpath``, flags first (argparse takes the overrides as
    one positional group). The search path the user gave on the command line, or else the one the primary config
    declares (a custom ``--config-path`` config often lists ``pkg://verl.trainer.config`` there), is kept in front."""
    flags, overrides = split_args(args)
    given = [o for o in overrides if o.lstrip("+").startswith("hydra.searchpath=")]
    if given:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        entries = OverridesParser.create().parse_override(given[-1]).value()  # the override's list
        overrides = [o for o in overrides if o not in given]
    else:
        entries = compose_from_args([*flags, "hydra/job_logging=none", "hydra/hydra_logging=none"]).hydra.searchpath
    entries = [*entries, *([] if RECIPES_SEARCHPATH in entries else [RECIPES_SEARCHPATH])]
    return [*flags, f"hydra.searchpath=[{','.join(entries)}]", *overrides]


def compose_from_args(args: list[str]) -> DictConfig:
    """The config verl's entry point will compose for ``args``, composed the way its ``hydra.main`` does it: the
    same search path (verl's ``config`` folder next to ``verl/trainer/main_ppo.py``, or ``--config-path`` /
    ``-cp`` absolute or relative to that file, plus ``--config-dir`` / ``-cd``), config name and overrides. Hydra's
    own helpers build the search path; nothing runs and Hydra's global state is left as it was."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_automatic_config_search_path, get_args_parser
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import SearchPathException
    from hydra.types import RunMode

    parsed = get_args_parser().parse_args(args)
    search_path = create_automatic_config_search_path(
        find_spec(VERL_ENTRY_MODULE).origin, None, parsed.config_path or VERL_CONFIG_PATH
    )
    if parsed.config_dir is not None:
        config_dir = os.path.abspath(parsed.config_dir)
        if not os.path.isdir(config_dir):
            raise SearchPathException(f"Additional config directory '{config_dir}' not found")
        search_path.prepend(provider="command-line", path=f"file://{config_dir}", anchor=SearchPathQuery("schema"))
    global_hydra = GlobalHydra.instance()
    outer = global_hydra.hydra if global_hydra.is_initialized() else None
    try:
        hydra = Hydra.create_main_hydra2(task_name="main_ppo", config_search_path=search_path)
        return hydra.compose_config(parsed.config_name or VERL_CONFIG_NAME, parsed.overrides, run_mode=RunMode.RUN)
    finally:
        global_hydra.clear()
        if outer is not None:
            global_hydra.initialize(outer)


def main() -> None:
    args = with_recipes_searchpath(sys.argv[1:])
    if not any(arg in _HELP_FLAGS for arg in split_args(args)[0]):
        from hydra.errors import HydraException

        try:
            config = compose_from_args(args)
            if config.trainer.get("device") == "cpu":  # before the checks: they may import verl's engines
                args = [*args, *use_cpu(config)]
            for warning in check_config(config):
                print(f"verl-sat: warning: {warning}", file=sys.stderr)
            check_trainer_device(config)
            check_sizes(config)
        except (PreflightError, HydraException) as err:  # Hydra's message lists e.g. the valid recipe names
            sys.exit(f"verl-sat: {err}")
    sys.argv = [sys.argv[0], *args]
    from verl.trainer.main_ppo import main as verl_main

    verl_main()


def use_cpu(config: DictConfig) -> list[str]:
    """A ``trainer.device=cpu`` run: select verl-sat's CPU platform in this process (an import error stops the run
    here, with the real exception) and in every Ray worker; return the overrides that pass it to the workers."""
    import verl_sat.cpu

    os.environ[verl_sat.cpu.PLATFORM_ENV] = verl_sat.cpu.PLATFORM_NAME
    verl_sat.cpu.activate()
    env_vars = config.ray_kwargs.ray_init.runtime_env.get("env_vars")
    prefix = "" if env_vars is not None and verl_sat.cpu.PLATFORM_ENV in env_vars else "+"
    key = f"ray_kwargs.ray_init.runtime_env.env_vars.{verl_sat.cpu.PLATFORM_ENV}"
    return [f"{prefix}{key}={verl_sat.cpu.PLATFORM_NAME}"]


if __name__ == "__main__":
    main()
