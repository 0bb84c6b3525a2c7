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
"""The verl-recipe ``sat/`` recipe's ``README.md`` (verl-recipe's shape: a "Required verl version" section first),
its ``REQUIRED_VERL.txt`` (pinned to verl 0.9.1, read by verl-recipe's ``install_verl.sh``) and the text of its pull
request, from the recipe's own pieces, the paper's Table 1 and the SAT keys."""

import shlex
from collections.abc import Iterable

from verl_sat.lag_presets import lag_keys
from verl_sat.recipe_catalog import PAPER_TABLE_1, summary
from verl_sat.upstream.docs_page import keys_section
from verl_sat.upstream.pr_text import MOTIVATION
from verl_sat.upstream.recipe_names import FALLBACK, PACKAGE, RECIPE, with_recipe_phrases
from verl_sat.upstream.series import VERL_VERSION

UPSTREAM = "https://github.com/verl-project/verl.git"
# what a reviewer runs from a verl checkout's root with verl 0.9.1 installed: each trainer composes and passes the
# checks
REVIEW_RUNS = {
    "separate_async": ("+recipe=sat_gspo_r3", "r3=fsdp", "+lag=lag8", "data.train_batch_size=64",
                       "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=8"),
    "colocate_async": ("trainer.v1.trainer_mode=colocate_async", "+recipe=sat_gspo_r3", "r3=fsdp", "+lag=lag8",
                       "data.train_batch_size=64"),
    "fully_async": ("--config-name", "fully_async_ppo_trainer", "data.train_batch_size=0",
                    "actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                    "+recipe=sat_gspo_r3", "r3=fsdp", "+lag=lag8"),
}  # fmt: skip
# trainer -> (what it is, how a job selects it)
TRAINERS = {
    "separate_async": ("verl's v1 trainer, rollout on its own GPU pool overlapping training (the presets' default)",
                       "`actor_rollout_ref.rollout.nnodes=.. actor_rollout_ref.rollout.n_gpus_per_node=..`"),
    "colocate_async": ("verl's v1 trainer, one GPU pool where rollout and training take turns",
                       "`trainer.v1.trainer_mode=colocate_async`"),
    "fully_async": ("verl's experimental `fully_async_policy`: rollouter and trainer as separate Ray actors",
                    "`--config-name fully_async_ppo_trainer data.train_batch_size=0 "
                    "actor_rollout_ref.hybrid_engine=false rollout.nnodes=.. rollout.n_gpus_per_node=..`"),
}  # fmt: skip
FILES = (
    ("`config/`", "the Hydra group: `recipe/` (the rows), `method/`, `paper/`, `radii/`, `correction/`, `r3/`, and "
     "`lag/` with each trainer's presets"),
    ("`main.py`", "`python -m recipe.sat.main`: composes as verl's entry point will, runs the checks, starts the "
     "selected trainer's entry point"),
    ("`preflight.py`", "the checks"),
    ("`lag_presets.py`", "`+lag=lagN` / `fixedN` for any N"),
    ("`resolvers.py`", "`${sat.div:...}`, the lag presets' mini-batch"),
    ("`compat.py`", "verl's SAT losses, `sat_*` keys and FSDP routing replay where verl has them, `fallback/`'s "
     "otherwise"),
    (f"`{FALLBACK}/`", "the verl pull request's code for verl 0.9.1, generated from the same source"),
    ("`run_*.sh`", "the paper's setup (Qwen3-30B-A3B-Base, Megatron with R3, SGLang) and a dense FSDP run"),
)  # fmt: skip


def required_verl() -> str:
    """``REQUIRED_VERL.txt``: pinned to verl's release tag, as verl-recipe's ``install_verl.sh`` reads it."""
    return (
        f"# {RECIPE} — pinned to verl release tag v{VERL_VERSION}\n"
        f"UPSTREAM={UPSTREAM}\n"
        "MODE=pinned_tag\n"
        f"TAG=v{VERL_VERSION}\n"
        f"PIP_INSTALL=pip install verl=={VERL_VERSION}\n"
        f"GIT_SETUP=git clone --depth 1 --branch v{VERL_VERSION} {UPSTREAM} verl\n"
        f"NOTES={RECIPE} recipe is developed and tested against verl v{VERL_VERSION}; with a verl that has SAT and "
        "FSDP routing replay it uses verl's own.\n"
    )


def review_command(trainer: str) -> str:
    """The dry run of ``trainer`` a reviewer runs (``--cfg job``: compose, check, print, start nothing)."""
    return shlex.join(["python", "-m", f"{PACKAGE}.main", *REVIEW_RUNS[trainer], "--cfg", "job"])


def readme(configs: dict[str, str], core_pr: str) -> str:
    """``README.md`` for the recipe whose config files are ``configs`` (``config/<group>/<name>.yaml`` -> text);
    ``core_pr`` names the pull request to verl."""
    rows = {path.removeprefix("config/recipe/").removesuffix(".yaml"): text for path, text in configs.items()
            if path.startswith("config/recipe/")}  # fmt: skip
    table = [
        f"| `{name}` | {summary(text)} | {PAPER_TABLE_1[name].scores() if name in PAPER_TABLE_1 else ''} |"
        for name, text in rows.items()
    ]
    trainers = [
        f"| `{trainer}`: {what} | {select} | {_keys(lag_keys(trainer, kind, 8) for kind in ('lag', 'fixed'))} |"
        for trainer, (what, select) in TRAINERS.items()
    ]
    lines = [
        "# SAT: Staleness-Adaptive Trust Region for asynchronous RL",
        "",
        "## Required `verl` version",
        "",
        "See [`REQUIRED_VERL.txt`](REQUIRED_VERL.txt) for the upstream repository, install mode (rolling `main`,",
        "pinned release tag, or pinned git commit), and copy-pastable `pip` / `git` instructions where they exist.",
        "",
        f"This recipe is tested against `verl=={VERL_VERSION}`. That release has neither the SAT policy losses nor",
        f"rollout routing replay (R3) under FSDP: the pull request to verl {core_pr} adds them. Until a verl release",
        f"has them, `{FALLBACK}/` holds the same code, generated from the same source, and `compat.py` uses verl's own",
        f"names where verl has them and `{FALLBACK}/`'s otherwise. Once a release has them, `REQUIRED_VERL.txt` moves",
        f"to it and `{FALLBACK}/` goes.",
        "",
        "## Introduction",
        "",
        MOTIVATION.rstrip("\n"),
        "",
        "This recipe runs every row of the paper's Table 1 on verl's three asynchronous trainers, at the paper's lag n",
        "(n optimizer steps between weight broadcasts, rollout one batch ahead, realised gap n..2n-1), with verl's",
        "Megatron R3 or R3 under FSDP for MoE models.",
        "",
        "## Run",
        "",
        "From the root of a verl checkout whose `recipe/` submodule holds verl-recipe:",
        "",
        "```bash",
        f"pip install verl=={VERL_VERSION}                     # or: cd recipe && ./install_verl.sh --recipe {RECIPE}",
        f"LAG=8 bash recipe/{RECIPE}/run_qwen3_30b_a3b_sat_gspo_r3_megatron.sh   # the paper's setup",
        f"LAG=1 bash recipe/{RECIPE}/run_qwen2_5_7b_sat_grpo_fsdp.sh            # a dense model under FSDP",
        f"python -m {PACKAGE}.main +recipe=sat_gspo_r3 r3=fsdp +lag=lag8 data.train_batch_size=2048 \\",
        "  actor_rollout_ref.rollout.nnodes=1 actor_rollout_ref.rollout.n_gpus_per_node=8 [any verl override]",
        "```",
        "",
        f"`python -m {PACKAGE}.main` is verl's own entry point (`verl.trainer.main_ppo`, or for the fully-async",
        f"configs `verl.experimental.fully_async_policy.fully_async_main`) with `pkg://{PACKAGE}.config` on Hydra's",
        "search path. Before verl starts Ray it composes exactly what verl will compose and checks it",
        "(`preflight.py`): the loss is registered and its config builds, R3 can run, the trainer honours bypass",
        "mode, the lag preset is the selected trainer's, and the sizes and start-up asserts verl checks only once its",
        "workers run hold; each refusal names the keys and the numbers. `--cfg job` runs the same checks, then prints",
        "the config.",
        "",
        "## Trainers and lags",
        "",
        "`+recipe=` is the same on every trainer; `+lag=lagN` (the paper's lag) and `+lag=fixedN` (a fixed gap of N)",
        "select the preset written in the selected trainer's own keys (`config/lag/`, `config/lag/<trainer>/`), for",
        "any N >= 1. The keys that follow N, at N = 8:",
        "",
        "| trainer | select it with | `+lag=lag8` | `+lag=fixed8` |",
        "|---|---|---|---|",
        *trainers,
        "",
        "## Rows (`+recipe=NAME`)",
        "",
        "| recipe | what | paper's Table 1, AIME24 avg@8, lag 1 / lag 8 |",
        "|---|---|---|",
        *table,
        "",
        "The `*_r3` rows take `r3=megatron` (verl's Megatron R3, `--config-name ppo_megatron_trainer`, the default) or",
        "`r3=fsdp` (R3 for Hugging Face MoE models under verl's FSDP engine).",
        "",
        keys_section().rstrip("\n"),
        "",
        "SAT-GSPO takes its sequence quantile over the sequences of one micro-batch: with fewer than",
        "`1 / (1 - sat_quantile)` sequences of similar length in a micro-batch (long responses under a token budget)",
        "it cannot gate and trains as GSPO; the entry point warns, naming the keys. The `sat_gspo_carried` rows take",
        "the quantile over the micro-batch's and the last 256 sequences' scores (`sat_granularity=sequence_carried`)",
        "and gate at one sequence per micro-batch; the `sat_gspo_token` and `sat_gspo_ratio_side` rows score tokens.",
        "",
        f"## On verl {VERL_VERSION}",
        "",
        "With `actor_rollout_ref.hybrid_engine=False`, verl 0.9.1's separate-async trainer raises `TypeError` at its",
        "default `INFO` log level (`logger.info(..., flush=True)`); set `VERL_LOGGING_LEVEL=WARN`, or use a verl with",
        "the pull request's `[trainer] fix:` patch. The run scripts keep verl's default `hybrid_engine`.",
        "",
        "## Files",
        "",
        *(f"- {name}: {what}" for name, what in FILES),
        "",
        "Generated by `verl-sat upstream` from the verl-sat project's source, as is the pull request to verl.",
        "",
    ]
    return "\n".join(lines)


def pr_markdown(files: dict[str, str], core_pr: str) -> str:
    """The verl-recipe pull request's text, for the recipe's ``files`` (path inside ``sat/`` -> text); ``core_pr``
    names the pull request to verl."""
    lines = [
        f"# [recipe] feat: {RECIPE}, the Staleness-Adaptive Trust Region (SAT) for asynchronous RL",
        "",
        "### What does this PR do?",
        "",
        MOTIVATION.rstrip("\n"),
        "",
        f"Adds `{RECIPE}/`: every row of the paper's Table 1 as Hydra pieces, the paper's lag presets for verl's",
        f"three asynchronous trainers, `python -m {PACKAGE}.main` (composes, checks, starts the selected trainer), the",
        f"run scripts of the paper's setup, and `{FALLBACK}/`: the SAT losses and FSDP routing replay that the pull",
        f"request to verl {core_pr} adds, for verl {VERL_VERSION} until a release has them (`compat.py` prefers",
        "verl's).",
        "",
        "### Files",
        "",
        *(f"- `{RECIPE}/{path}` ({text.count(chr(10))} lines)" for path, text in sorted(files.items())),
        "",
        "### Test",
        "",
        "From this repository's root, then from the root of a verl checkout with this repository as `recipe/`:",
        "",
        "```bash",
        f"./install_verl.sh --recipe {RECIPE} --show      # prints: pip install verl=={VERL_VERSION}",
        f"pre-commit run --files $(git ls-files {RECIPE})  # ruff, line length 120",
        f"pip install verl=={VERL_VERSION}",
        *(f"{review_command(trainer)}  # {trainer}" for trainer in REVIEW_RUNS),
        "```",
        "",
        "Each dry run composes the recipe, passes the checks and prints the config. With a verl that has the pull",
        "request to verl, the same runs use verl's losses, keys and FSDP routing replay instead of `fallback/`'s.",
        "",
    ]
    return "\n".join(lines)


def _keys(presets: Iterable[dict[str, object]]) -> str:
    """Table cells: each preset's keys as ``key=value``, the recipe's resolver names in the values."""
    return " | ".join(
        ", ".join(f"`{key}={with_recipe_phrases(str(value))}`" for key, value in keys.items()) for keys in presets
    )
