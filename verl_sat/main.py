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

import sys

from verl_sat.preflight import PreflightError, check_config

RECIPES_SEARCHPATH = "pkg://verl_sat.recipes"
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
    """Args with verl-sat's recipes on ``hydra.searchpath`` (kept if the user set one), flags first: argparse
    takes the overrides as one positional group."""
    flags, overrides = split_args(args)
    if not any(arg.startswith(("hydra.searchpath=", "+hydra.searchpath=")) for arg in overrides):
        overrides = [f"hydra.searchpath=[{RECIPES_SEARCHPATH}]", *overrides]
    return [*flags, *overrides]


def compose_from_args(args: list[str]):
    """Compose the config verl's entry point will see, with Hydra's compose API (no side effects)."""
    from hydra import compose, initialize_config_module

    flags, overrides = split_args(args)
    config_name = "ppo_trainer"
    for flag, value in zip(flags, flags[1:], strict=False):
        if flag in ("--config-name", "-cn"):
            config_name = value
    with initialize_config_module("verl.trainer.config", version_base=None):
        return compose(config_name, overrides=overrides)


def main() -> None:
    args = with_recipes_searchpath(sys.argv[1:])
    if not any(arg in _HELP_FLAGS for arg in split_args(args)[0]):
        from hydra.errors import HydraException

        try:
            for warning in check_config(compose_from_args(args)):
                print(f"verl-sat: warning: {warning}", file=sys.stderr)
        except (PreflightError, HydraException) as err:  # Hydra's message lists e.g. the valid recipe names
            sys.exit(f"verl-sat: {err}")
    sys.argv = [sys.argv[0], *args]
    from verl.trainer.main_ppo import main as verl_main

    verl_main()


if __name__ == "__main__":
    main()
