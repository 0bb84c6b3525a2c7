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
"""The ``verl-sat`` command line."""

import argparse
import sys

from verl_sat.doctor import run_doctor
from verl_sat.recipe_catalog import format_catalog


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``verl-sat <command>``."""
    parser = argparse.ArgumentParser(prog="verl-sat", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("doctor", help="check that `import verl` registers the sat/sat_gspo losses")
    commands.add_parser("recipes", help="list the recipes (+recipe=NAME) and lags (+lag=NAME), one line each")
    prep = commands.add_parser("prepare", help="build the embedded engine's tokenizer, MoE policy and task offline")
    prep.add_argument("--workdir", default="verl_sat_work", help="output folder (default: verl_sat_work)")
    prep.add_argument("--seed", type=int, default=0, help="seed: the same seed gives the same files")
    run = commands.add_parser(
        "train", help="asynchronous RL on this machine: verl-sat train +recipe=NAME [+lag=lagL] [key=value ...]"
    )
    run.add_argument("--workdir", default="verl_sat_work", help="prepared folder (default: verl_sat_work)")
    run.add_argument("overrides", nargs="*", help="Hydra overrides, as for python -m verl_sat.main")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        return run_doctor()
    if args.command == "recipes":
        print(format_catalog())
        return 0
    if args.command == "prepare":
        from verl_sat.embedded.prepare import prepare

        manifest = prepare(args.workdir, args.seed)
        print(
            f"prepared {args.workdir}: {manifest['num_parameters']:,}-parameter MoE policy, "
            f"{manifest['num_train']} train / {manifest['num_test']} test problems; greedy test accuracy "
            f"{manifest['test_accuracy_before_warm_start']:.1%} -> {manifest['test_accuracy']:.1%} after the warm start"
        )
        return 0
    if args.command == "train":
        return _train(args.workdir, args.overrides)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())


def _train(workdir: str, overrides: list[str]) -> int:
    from hydra.errors import HydraException

    from verl_sat.embedded.prepare import WorkdirError
    from verl_sat.embedded.run_config import EmbeddedConfigError, compose_train_config
    from verl_sat.embedded.train import train

    try:
        config, settings = compose_train_config(workdir, overrides)
        summary = train(config, settings)
    except (EmbeddedConfigError, WorkdirError, HydraException) as err:  # Hydra's message lists the valid recipes
        print(f"verl-sat train: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "verl-sat train: interrupted; re-run the same command to resume from the last checkpoint", file=sys.stderr
        )
        return 130
    print(format_summary(settings.run_dir, summary))
    return 0


def format_summary(run_dir, summary: dict) -> str:
    """The few lines ``verl-sat train`` and ``make demo`` print at the end of a run."""

    def pct(value):
        return "n/a" if value is None else f"{value:.1%}"

    mismatch = summary["last_epoch_mismatch"]
    return "\n".join(
        [
            f"run {run_dir}: {summary['steps_done']}/{summary['total_steps']} steps",
            f"  test accuracy (avg@k): start {pct(summary['initial_accuracy'])}, best {pct(summary['best_accuracy'])} "
            f"at step {summary['best_step']}, last {pct(summary['last_accuracy'])} at step {summary['last_step']}",
            f"  collapsed: {summary['collapsed']} ({summary['collapse_rule']}); last-epoch mismatch "
            f"{'n/a' if mismatch is None else f'{mismatch:.4f}'}",
            f"  curves: {run_dir / 'curves.png'}   metrics: {run_dir / 'metrics.jsonl'}",
        ]
    )
