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
    prep.add_argument("--if-needed", action="store_true", help="do nothing if the workdir is prepared and current")
    prep.add_argument("--task", default="addition", choices=("addition", "chain"),
                      help="addition (answers of a few tokens, the default) or chain (a long chain of thought of "
                      "20-250 tokens; train it with +embedded=long_cot)")  # fmt: skip
    prep.add_argument(
        "--band",
        default="0.30,0.45",
        type=_band,
        help="greedy validation accuracy the warm start must land in, LOW,HIGH (default 0.30,0.45)",
    )
    prep.add_argument("--native-floating-point", action="store_true",
                      help="this CPU's fastest kernels (about twice as fast); another CPU may then build another "
                      "model (default: portable floating point, the same model on every x86-64 CPU)")  # fmt: skip
    run = commands.add_parser(
        "train", help="asynchronous RL on this machine: verl-sat train +recipe=NAME [+lag=lagL] [key=value ...]"
    )
    run.add_argument("--workdir", default="verl_sat_work", help="prepared folder (default: verl_sat_work)")
    run.add_argument("overrides", nargs="*", help="Hydra overrides, as for python -m verl_sat.main")
    grid = commands.add_parser("sweep", help="recipes x lags x seeds with the embedded engine, as the paper's Table 1")
    grid.add_argument("--workdir", default="verl_sat_work", help="prepared folder (default: verl_sat_work)")
    grid.add_argument("--name", default="default", help="sweep name: WORKDIR/sweeps/NAME, runs in WORKDIR/runs/NAME")
    grid.add_argument("--recipes", default="grpo,gspo,dppo,sat_gspo,gspo_r3,sat_grpo_r3,sat_gspo_r3",
                      help="comma-separated recipe names (default: the paper's seven)")  # fmt: skip
    grid.add_argument("--lags", default="1,8", help="comma-separated paper lags n: optimizer steps per weight "
                      "broadcast, rollout one batch ahead (0 = synchronous), or fixedL: an exact gap of L optimizer "
                      "steps (default 1,8)")  # fmt: skip
    grid.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    grid.add_argument("--jobs", type=int, default=1, help="cells run in parallel processes (default 1)")
    grid.add_argument("--optimizer-steps", type=int, default=None,
                      help="optimizer steps per run at every lag (default: the engine's, 200); more than a finished "
                      "run of this --name holds extends it from its final checkpoint")  # fmt: skip
    grid.add_argument("--store", default=None, help="folder of finished cells' records: cells found there are "
                      "not run again, new ones are added (commit it to continue a sweep elsewhere)")  # fmt: skip
    grid.add_argument("overrides", nargs="*", help="Hydra overrides applied to every run")
    rep = commands.add_parser("report", help="tables, paired statistics and plots from the cell records of sweeps")
    rep.add_argument("--store", action="append", required=True, help="a folder of cell records (repeatable)")
    rep.add_argument("--out", required=True, help="output folder: results.json/.md/.csv and plots")
    rep.add_argument("--recipes", default=None, help="comma-separated recipes to report (default: all in the stores)")
    rep.add_argument("--lags", default=None, help="comma-separated lags to report, as for sweep (default: all)")
    rep.add_argument(
        "--command", dest="made_by", action="append", default=[], help="a command that made the records (repeatable)"
    )
    e2e = commands.add_parser("e2e", help="verl's own asynchronous trainer on this CPU for a few steps (docs/cpu.md)")
    e2e.add_argument("--workdir", default="verl_sat_work", help="prepared folder (default: verl_sat_work)")
    e2e.add_argument("--runs", default=None, help="comma-separated run names (default: all, see docs/cpu.md)")
    up = commands.add_parser(
        "upstream", help="write SAT and FSDP routing replay as a patch series for verl 0.9.1 and a verl-recipe recipe"
    )
    up.add_argument("--out", required=True, help="output folder: verl/ (000*.patch, PR.md), verl-recipe/ (sat/, PR.md)")
    up.add_argument("--repo", default=None, help="the verl-sat checkout (default: the one this package runs from)")
    up.add_argument("--verl-repo", default=None,
                    help="a verl repository checkout, for verl's license-header list (its wheel lacks it)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.command == "doctor":
        return run_doctor()
    if args.command == "recipes":
        print(format_catalog())
        return 0
    if args.command == "prepare":
        return _prepare(args)
    if args.command == "train":
        return _train(args.workdir, args.overrides)
    if args.command == "sweep":
        return _sweep(args)
    if args.command == "report":
        return _report(args)
    if args.command == "upstream":
        return _upstream(args)
    if args.command == "e2e":
        return _e2e(args)
    parser.error(f"unknown command {args.command!r}")
    return 2


def _band(text: str) -> tuple[float, float]:
    try:
        low, high = (float(v) for v in text.split(","))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH accuracies, e.g. 0.30,0.45; got {text!r}") from err
    if not 0.0 <= low <= high <= 1.0:
        raise argparse.ArgumentTypeError(f"expected 0 <= LOW <= HIGH <= 1, got {text!r}")
    return low, high


def _prepare(args: argparse.Namespace) -> int:
    from verl_sat.embedded.prepare import SPECS, WorkdirError, check_prepared, prepare
    from verl_sat.embedded.warm_start import BandMissed

    if args.if_needed:
        try:
            check_prepared(args.workdir, band=args.band, task=args.task)
            print(f"{args.workdir} is prepared")
            return 0
        except WorkdirError as err:
            print(f"{err}; preparing")
    try:
        manifest = prepare(args.workdir, args.seed, spec=SPECS[args.task], band=args.band,
                           portable=not args.native_floating_point)  # fmt: skip
    except BandMissed as err:
        print(f"verl-sat prepare: the warm start missed its band: {err}", file=sys.stderr)
        return 1
    m, (low, high) = manifest, args.band
    print(
        f"prepared {args.workdir} ({m['task']}): {m['num_parameters']:,}-parameter MoE policy, "
        f"{m['num_train']:,} train / {m['num_val']} val / {m['num_test']} test problems; warm start "
        f"{m['warm_start_steps']} steps to greedy validation accuracy {m['val_accuracy']:.1%} "
        f"(band {low:.0%}-{high:.0%}), test {m['test_accuracy_before_warm_start']:.1%} -> {m['test_accuracy']:.1%}; "
        f"model sha256 {m['model_sha256'][:16]} ({m['floating_point']} floating point)"
    )
    return 0


def _train(workdir: str, overrides: list[str]) -> int:
    from verl_sat.embedded.prepare import WorkdirError
    from verl_sat.embedded.run_config import EmbeddedConfigError, compose_train_config
    from verl_sat.embedded.train import train

    try:
        config, settings = compose_train_config(workdir, overrides)
        for warning in settings.warnings:
            print(f"verl-sat train: warning: {warning}", file=sys.stderr)
        summary = train(config, settings)
    except (EmbeddedConfigError, WorkdirError) as err:
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

    def num(value):
        return "n/a" if value is None else f"{value:.4f}"

    lines = [
        f"run {run_dir}: {summary['steps_done']}/{summary['total_steps']} steps",
        f"  test accuracy (avg@k): start {pct(summary['initial_accuracy'])}, best {pct(summary['best_accuracy'])} "
        f"at step {summary['best_step']}, last {pct(summary['last_accuracy'])} at step {summary['last_step']}",
        f"  collapsed: {summary['collapsed']} ({summary['collapse_rule']})",
        f"  last-epoch mismatch |log pi - log mu| {num(summary['last_epoch_mismatch'])}, split d = policy lag + "
        f"engine (Eq. 2): |policy lag| {num(summary['last_policy_lag'])}, |engine| "
        f"{num(summary['last_engine_mismatch'])} (mean |.| of each part)",
    ]
    if summary.get("last_intercepted_frac") is not None:
        lines.append(f"  SAT intercepted fraction {num(summary['last_intercepted_frac'])}")
    lines.append(f"  curves: {run_dir / 'curves.png'}   metrics: {run_dir / 'metrics.jsonl'}")
    return "\n".join(lines)


def _sweep(args: argparse.Namespace) -> int:
    from verl_sat.embedded.prepare import WorkdirError, check_prepared
    from verl_sat.embedded.run_config import EmbeddedConfigError, compose_train_config
    from verl_sat.embedded.sweep import Cell, StoreMismatch, parse_lag, sweep

    try:
        recipes = [r for r in args.recipes.split(",") if r]
        lags = [v for v in args.lags.split(",") if v]
        lag_specs = [parse_lag(v) for v in lags]
        seeds = [int(v) for v in args.seeds.split(",")]
    except ValueError as err:
        print(f"verl-sat sweep: --lags takes comma-separated integers or fixedL, --seeds integers ({err})",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.optimizer_steps is not None and args.optimizer_steps < 1:
        print(f"verl-sat sweep: --optimizer-steps {args.optimizer_steps}: expected a positive integer", file=sys.stderr)
        return 2
    try:
        check_prepared(args.workdir)
        for recipe in recipes:  # fail before the first cell runs: unknown recipe or key, bad value
            for lag, regime in lag_specs:
                cell = Cell(recipe, lag, seeds[0], regime)
                compose_train_config(args.workdir, [*cell.overrides(args.name, args.optimizer_steps), *args.overrides])
        out = sweep(args.workdir, recipes, lags, seeds, args.overrides, name=args.name, jobs=args.jobs,
                    optimizer_steps=args.optimizer_steps, store=args.store)  # fmt: skip
    except (EmbeddedConfigError, WorkdirError, StoreMismatch) as err:
        print(f"verl-sat sweep: {err}", file=sys.stderr)
        return 2
    print((out / "results.md").read_text())
    print(f"plots: {out}/curves_*.png, {out}/mismatch.png, {out}/attribution.png")
    return 0


def _report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from verl_sat.embedded.cell_stats import read_records, select
    from verl_sat.embedded.report import write_report
    from verl_sat.embedded.sweep import Cell, parse_lag

    try:
        lags = None if args.lags is None else [Cell("-", lag, 0, regime).lag_label
                                               for lag, regime in map(parse_lag, args.lags.split(","))]  # fmt: skip
        records = read_records(args.store)
    except (FileNotFoundError, ValueError) as err:
        print(f"verl-sat report: {err}", file=sys.stderr)
        return 2
    records = select(records, None if args.recipes is None else args.recipes.split(","), lags)
    if not records:
        chosen = f" for --recipes {args.recipes} --lags {args.lags}" if args.recipes or args.lags else ""
        print(f"verl-sat report: no cell records in {', '.join(args.store)}{chosen}", file=sys.stderr)
        return 2
    out = Path(args.out)
    write_report(out, records, args.made_by)
    print((out / "results.md").read_text())
    return 0


def _e2e(args: argparse.Namespace) -> int:
    from pathlib import Path

    from verl_sat.cpu.e2e import RUNS, E2EFailed, format_results, run_e2e
    from verl_sat.embedded.prepare import WorkdirError, check_prepared

    names = [run.folder_name for run in RUNS]
    chosen = names if args.runs is None else args.runs.split(",")
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        print(f"verl-sat e2e: unknown runs {unknown}; the runs are {names}", file=sys.stderr)
        return 2
    try:
        check_prepared(args.workdir)
        results = run_e2e(Path(args.workdir), tuple(run for run in RUNS if run.folder_name in chosen))
    except (WorkdirError, E2EFailed) as err:
        print(f"verl-sat e2e: {err}", file=sys.stderr)
        return 1
    print(format_results(results))
    return 0


def _upstream(args: argparse.Namespace) -> int:
    from pathlib import Path

    from verl_sat.upstream import write_upstream
    from verl_sat.upstream.edit import UpstreamDriftError

    try:
        written = write_upstream(Path(args.out), None if args.repo is None else Path(args.repo),
                                 None if args.verl_repo is None else Path(args.verl_repo))  # fmt: skip
    except UpstreamDriftError as err:
        print(f"verl-sat upstream: {err}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    print(
        f"in a verl v{_verl_version()} checkout: git am --keep-non-patch {args.out}/verl/*.patch; in a verl-recipe "
        f"checkout: cp -r {args.out}/verl-recipe/sat . (see each PR.md)"
    )
    return 0


def _verl_version() -> str:
    from verl_sat.upstream.series import VERL_VERSION

    return VERL_VERSION


if __name__ == "__main__":
    sys.exit(main())
