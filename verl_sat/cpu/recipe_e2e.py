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
"""``make e2e``'s run of the verl-recipe contribution: six steps of verl's v1 separate_async trainer through
``python -m recipe.sat.main``, on this CPU, from a checkout laid out as verl lays its ``recipe/`` submodule.

The recipe is the one ``verl-sat upstream`` writes (``DIR/verl-recipe/sat``), laid in as ``recipe/sat`` of a fresh
folder; the run starts there, as a verl user runs a recipe. verl-sat's plugin is off in every process
(``VERL_USE_EXTERNAL_PLUGINS=none``): the SAT losses and routing replay come from the recipe (its ``fallback/`` on
verl 0.9.1). Only this package's CPU layer comes in, through verl's own ``VERL_USE_EXTERNAL_MODULES``: a module
written beside the checkout activates ``verl_sat.cpu`` (the platform, verl's FSDP engine for device ``cpu``, the weight
transport) with ``verl_sat.losses`` and ``verl_sat.fsdp_engine`` made unimportable, and records, in every process
that looks a policy loss up in verl's registry, which module the loss and the FSDP engine verl would build come from.
The CPU preset (``recipes/cpu/e2e.yaml``) is composed from a config folder beside the checkout, put first on Hydra's
search path. verl 0.9.1's separate-async set-up passes ``flush=`` to an INFO log call (patch 3 of the core pull
request): the run sets ``VERL_LOGGING_LEVEL=WARN``, which skips that call.

The run must show, from verl's own metrics and the records: SAT gated (``actor/sat_gate_rate`` above 0), routing
replay replayed (``actor/r3_layers_replayed`` above 0), every ``sat_gspo`` lookup returned the recipe's loss, and the
FSDP engine registered for the CPU was the recipe's.
"""

import argparse
import json
import os
import shutil
import sys
import time
import warnings
from importlib.resources import files
from pathlib import Path

from verl_sat.cpu.e2e import (
    FSDP1,
    R3_METRICS,
    REWARD_METRICS,
    SAT_METRICS,
    E2EFailed,
    E2ERun,
    check_sat_acted,
    format_results,
    fresh_folder,
    read_metrics,
    run_with_progress,
)
from verl_sat.upstream import RECIPE_DIR, write_upstream
from verl_sat.upstream.recipe_names import PACKAGE, RECIPE

# Six trainer steps of 16 prompts x 4 responses, one token-budget micro-batch: SAT-GSPO's sequence score is
# length-weighted, and its gate is empty where sequences tied at the top score cover alpha 0.9's rank together.
# Identical responses to one prompt can score alike; at 4 prompts a step (16 sequences, about 1.6 above the rank) a
# prompt's tied responses can cover it, and a CI run gated at neither of 2 steps; at 16 prompts (64 sequences, about
# 6.4 above the rank, 2.7k tokens at most: one micro-batch) one prompt's 4 responses cover it only if much longer
# than the rest
RUN = E2ERun("separate_async", "recipe-sat_gspo_r3-lag1-fsdp1", ("+recipe=sat_gspo_r3", "+lag=lag1", "r3=fsdp", *FSDP1),
             6, False, (*SAT_METRICS, *R3_METRICS, *REWARD_METRICS))  # fmt: skip
PROMPTS_PER_STEP = 16  # the lag-1 batch, written out (the preset's resolver is the plugin's): one optimizer step
LAYER_MODULE = "verl_sat_cpu_layer"  # the module verl imports through VERL_USE_EXTERNAL_MODULES
RECORDS = "loss_lookups.jsonl"  # what the layer module records, beside the checkout
RECORDS_ENV = "VERL_SAT_RECIPE_E2E_RECORDS"
LAYER_SOURCE = f'''"""verl-sat's CPU layer without its losses or routing replay, for the recipe's CPU run
(verl_sat.cpu.recipe_e2e): verl imports it in every process through VERL_USE_EXTERNAL_MODULES."""

import json
import os
import sys

sys.modules["verl_sat.losses"] = None  # the SAT losses must come from the recipe
sys.modules["verl_sat.fsdp_engine"] = None  # and routing replay too

import verl_sat.cpu  # noqa: E402

if verl_sat.cpu.requested():
    verl_sat.cpu.activate()

from verl.trainer.ppo import core_algos  # noqa: E402
from verl.workers.engine.base import EngineRegistry  # noqa: E402

_lookup = core_algos.get_policy_loss_fn


def get_policy_loss_fn(name):
    """verl's lookup, recording where the loss and the FSDP engine for the CPU come from in this process."""
    loss = _lookup(name)
    engine = EngineRegistry._engines.get("language_model", {{}}).get("fsdp", {{}}).get("cpu")
    record = {{"pid": os.getpid(), "loss_mode": name, "loss_module": loss.__module__,
              "fsdp_engine_module": getattr(engine, "__module__", None)}}
    with open(os.environ["{RECORDS_ENV}"], "a") as out:
        out.write(json.dumps(record) + "\\n")
    return loss


core_algos.get_policy_loss_fn = get_policy_loss_fn
'''


def lay_out(folder: Path) -> tuple[Path, Path, Path]:
    """``folder/checkout/recipe/sat`` (the generated recipe), ``folder/layer`` (the CPU layer module and the CPU
    preset as a Hydra config folder); returns the checkout, the layer and the records file."""
    upstream = folder / "upstream"
    with warnings.catch_warnings():  # the core series' files from a verl repository checkout: not the recipe's
        warnings.simplefilter("ignore")
        write_upstream(upstream)
    checkout = folder / "checkout"
    shutil.copytree(upstream / RECIPE_DIR / RECIPE, checkout / "recipe" / RECIPE)
    layer = folder / "layer"
    (layer / "config" / "cpu").mkdir(parents=True)
    (layer / f"{LAYER_MODULE}.py").write_text(LAYER_SOURCE)
    preset = files("verl_sat.recipes").joinpath("cpu", "e2e.yaml").read_text()
    (layer / "config" / "cpu" / "e2e.yaml").write_text(preset)
    return checkout, layer, folder / RECORDS


def command(workdir: Path, layer: Path, metrics: Path, checkpoints: Path, env: dict[str, str]) -> list[str]:
    """``python -m recipe.sat.main`` with the row, the CPU preset (its lag-1 batch written out: the preset's
    ``${verl_sat.lag_batch:...}`` resolver is the plugin's) and the run's paths; ``env`` reaches every Ray worker."""
    return [
        sys.executable, "-m", f"{PACKAGE}.main", f"hydra.searchpath=[file://{layer / 'config'}]", *RUN.recipe_args,
        "+cpu=e2e", "trainer.device=cpu", f"data.train_batch_size={PROMPTS_PER_STEP}",
        f"actor_rollout_ref.model.path={workdir / 'model'}",
        f"data.train_files={workdir / 'data' / 'train.parquet'}", f"data.val_files={workdir / 'data' / 'test.parquet'}",
        f"trainer.total_training_steps={RUN.steps}", f"trainer.default_local_dir={checkpoints}",
        "trainer.project_name=verl_sat_e2e", f"trainer.experiment_name={RUN.folder_name}",
        f"hydra.run.dir={checkpoints.parent / 'hydra'}",
        f"++ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH={metrics}",
        *(f"++ray_kwargs.ray_init.runtime_env.env_vars.{key}={value}" for key, value in env.items()),
    ]  # fmt: skip


def run_recipe_e2e(workdir: Path) -> dict[str, dict]:
    """Lay out, run and check; return the run's metrics per step, as ``verl_sat.cpu.e2e.run_e2e`` does."""
    folder = fresh_folder(workdir / "e2e" / RUN.folder_name)
    checkout, layer, records = lay_out(folder)
    metrics, log = folder / "metrics.jsonl", folder / "log.txt"
    env = {
        "PYTHONPATH": str(layer),
        "VERL_USE_EXTERNAL_PLUGINS": "none",
        "VERL_USE_EXTERNAL_MODULES": LAYER_MODULE,
        "VERL_PLATFORM": "cpu",
        "VERL_LOGGING_LEVEL": "WARN",
        RECORDS_ENV: str(records),
    }
    started = time.monotonic()
    peak = run_with_progress(command(workdir, layer, metrics, folder / "checkpoints", env), log, metrics, RUN.steps,
                             RUN.folder_name, env={**os.environ, **env}, cwd=checkout)  # fmt: skip
    seconds = time.monotonic() - started
    steps = read_metrics(metrics)
    missing = [key for key in RUN.required if not any(key in step for step in steps.values())]
    if missing:
        raise E2EFailed(f"{RUN.folder_name}: verl's metrics lack {missing} (see {metrics})")
    check_sat_acted(RUN, steps, folder)
    if not any(step.get("actor/r3_layers_replayed", 0) > 0 for step in steps.values()):
        raise E2EFailed(f"{RUN.folder_name}: routing replay never replayed a layer (see {metrics})")
    check_sources(records)
    return {RUN.folder_name: {"steps": steps, "seconds": seconds, "peak_pss_bytes": peak, "folder": str(folder)}}


def check_sources(records: Path) -> None:
    """Every ``sat_gspo`` lookup returned the recipe's loss, and the FSDP engine for the CPU was the recipe's."""
    lookups = [json.loads(line) for line in records.read_text().splitlines()] if records.is_file() else []
    sat = [record for record in lookups if record["loss_mode"] == "sat_gspo"]
    if not sat:
        raise E2EFailed(f"no process looked up sat_gspo in verl's registry (records: {records})")
    wrong = [r for r in sat if r["loss_module"] != f"{PACKAGE}.fallback.losses"
             or r["fsdp_engine_module"] != f"{PACKAGE}.fallback.fsdp_engine"]  # fmt: skip
    if wrong:
        raise E2EFailed(f"the loss or the FSDP engine did not come from the recipe: {wrong} (records: {records})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl_sat.cpu.recipe_e2e", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("verl_sat_work"), help="a prepared embedded workdir")
    args = parser.parse_args(argv)
    try:
        results = run_recipe_e2e(args.workdir.resolve())
    except E2EFailed as err:
        print(f"recipe e2e: {err}", file=sys.stderr)
        return 1
    print(format_results(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
