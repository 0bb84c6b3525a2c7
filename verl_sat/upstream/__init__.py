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
"""``verl-sat upstream --out DIR``: two contributions, generated from this package's own source.

- ``DIR/verl/``: SAT and FSDP routing replay as a pull request to verl 0.9.1 (``series`` builds the commits;
  ``sat_patch``, ``r3_patch``, ``docs_page`` and ``examples`` make their files; ``trainer_fix_patch`` and
  ``rollout_fix_patch`` fix verl bugs; ``pr_text`` writes ``PR.md``);
- ``DIR/verl-recipe/``: the ``sat/`` recipe for verl-project/verl-recipe and its ``PR.md`` (``recipe``).
"""

from pathlib import Path

import verl_sat
from verl_sat.upstream import r3_patch, rollout_fix_patch, sat_patch, trainer_fix_patch
from verl_sat.upstream.docs_page import SOURCE as DOCS_SOURCE
from verl_sat.upstream.docs_page import TARGET as DOCS_TARGET
from verl_sat.upstream.docs_page import docs_page
from verl_sat.upstream.edit import UpstreamDriftError
from verl_sat.upstream.examples import example_scripts
from verl_sat.upstream.pr_text import pr_markdown
from verl_sat.upstream.recipe import write_recipe
from verl_sat.upstream.series import Patch, write_series

TEMPLATES = Path(__file__).parent / "templates"
VERL_DIR, RECIPE_DIR = "verl", "verl-recipe"  # under --out: the pull request to verl, the one to verl-recipe
ALONE = "alone"  # under DIR/verl: ALONE/N/0001-*.patch, patch N of the series generated on its own against 0.9.1
SAT_TEST = "tests/trainer/ppo/test_sat_policy_loss_on_cpu.py"
R3_TEST = "tests/workers/engine/test_fsdp_router_replay_on_cpu.py"
LOGGING_TEST = trainer_fix_patch.LOGGING_TEST
ROLLOUT_LOGGING_TEST = rollout_fix_patch.LOGGING_TEST

PATCHES = [
    Patch(
        subject="[algo] feat: SAT (Staleness-Adaptive Trust Region) policy losses sat and sat_gspo",
        body=(
            "Add the token-level `sat` (SAT-GRPO) and sequence-level `sat_gspo` (SAT-GSPO) policy losses of\n"
            "arXiv 2607.18722 next to `vanilla` and `gspo`: PPO's / GSPO's clip interval for ordinary tokens, and for\n"
            "the high-mismatch tail of each micro-batch the endpoint the token has drifted toward is contracted.\n"
            "With nothing gated both are exactly `vanilla` / `gspo`. New `sat_*` keys of `PolicyLossConfig`,\n"
            "validated when the config is built; docs/algo/sat.md; examples/sat_trainer; CPU tests."
        ),
        edits=(sat_patch.CORE_ALGOS, sat_patch.ACTOR_CONFIG, sat_patch.ACTOR_YAML),
        changes=lambda read, repo: {
            **sat_patch.sat_changes(read),
            DOCS_TARGET: docs_page(repo),
            **example_scripts(repo),
            SAT_TEST: (TEMPLATES / Path(SAT_TEST).name).read_text(),
        },
    ),
    Patch(
        subject="[fsdp] feat: rollout routing replay (R3) for Hugging Face MoE models in the FSDP engine",
        body=(
            "The FSDP engine ignored `routed_experts`. With `fsdp_config.router_replay.mode=R3` it now replays the\n"
            "rollout engine's expert choices in the actor's compute_log_prob and update forwards (the router still\n"
            "computes the weights, so it keeps learning), as the Megatron and VeOmni engines do. Model-level replay\n"
            "for Qwen2/3-MoE, Qwen3-Next, Qwen3.5-MoE, OLMoE, Mixtral, GPT-OSS, DeepSeek-V3 and GLM4-MoE;\n"
            "`FSDPActorConfig` refuses R2, fsdp_turbo and unpacked inputs with R3. The worker sets the per-call\n"
            "`enable_routing_replay` flag for the FSDP strategies too, and the engine replays only when both it and\n"
            "the mode say so, as Megatron and VeOmni do. Addresses #3762 and #5392."
        ),
        edits=(r3_patch.FSDP_ENGINE, r3_patch.FSDP_YAML, r3_patch.ACTOR_CONFIG, r3_patch.ENGINE_WORKERS),
        changes=lambda read, repo: {
            **r3_patch.r3_changes(read),
            R3_TEST: (TEMPLATES / Path(R3_TEST).name).read_text(),
        },
    ),
    Patch(
        subject="[trainer] fix: separate-async set-up with hybrid_engine=False raised TypeError (flush= to logging)",
        body=(
            "With `actor_rollout_ref.hybrid_engine=False` (rollout only on the standalone replicas) the v1\n"
            "separate-async trainer's `_setup` called `logger.info(..., flush=True)`; Python's logging refuses the\n"
            "keyword, so at verl's default INFO level the trainer stopped before its first step. The keyword is\n"
            "dropped; a CPU test checks that no logging call under verl/trainer takes print's keywords."
        ),
        edits=(trainer_fix_patch.SEPARATE_ASYNC,),
        changes=lambda read, repo: {
            **trainer_fix_patch.logging_fix_changes(read),
            LOGGING_TEST: (TEMPLATES / Path(LOGGING_TEST).name).read_text(),
        },
    ),
    Patch(
        subject="[rollout] fix: SGLang launch_server_process passed flush= to logging (TypeError at INFO level)",
        body=(
            "On a rank that does not start the server (`node_rank != 0` or not `first_rank_in_node`),\n"
            "`launch_server_process` called `logger.info(..., flush=True)`; Python's logging refuses the keyword, so\n"
            "with `VERL_LOGGING_LEVEL=INFO` or `DEBUG` an `HttpServerAdapter(launch_server=True)` raised TypeError\n"
            "there (verl's own rollout passes `launch_server=False` and does not reach it). The keyword is dropped;\n"
            "a CPU test checks that no logging call under verl/workers/rollout takes print's keywords."
        ),
        edits=(rollout_fix_patch.HTTP_SERVER_ENGINE,),
        changes=lambda read, repo: {
            **rollout_fix_patch.logging_fix_changes(read),
            ROLLOUT_LOGGING_TEST: (TEMPLATES / Path(ROLLOUT_LOGGING_TEST).name).read_text(),
        },
    ),
]


def source_checkout() -> Path:
    """The verl-sat checkout this package runs from (its docs, examples and measured results feed the series)."""
    root = Path(verl_sat.__file__).resolve().parent.parent
    if not (root / DOCS_SOURCE).is_file():
        raise UpstreamDriftError(
            f"{root} is not a verl-sat source checkout (no {DOCS_SOURCE}): pass --repo with the checkout's path"
        )
    return root


def write_upstream(out: Path, repo: Path | None = None, verl_repo: Path | None = None) -> list[Path]:
    """Write the patch series and its ``PR.md`` into ``out/verl``, the ``sat/`` recipe and its ``PR.md`` into
    ``out/verl-recipe``; return the files written. ``verl_repo``: a verl repository checkout, for the files of verl's
    that its wheel lacks (``series.write_series``)."""
    repo = source_checkout() if repo is None else repo
    written = write_series(out / VERL_DIR, repo, PATCHES, verl_repo)
    alone = [  # each patch after the first as its own pull request (carrying its own license line)
        path
        for number, patch in enumerate(PATCHES[1:], start=2)
        for path, _ in write_series(out / VERL_DIR / ALONE / str(number), repo, [patch], verl_repo)
    ]
    pr = out / VERL_DIR / "PR.md"
    pr.write_text(pr_markdown(repo, written, [patch.subject for patch in PATCHES]))
    core_pr = f'(patches "{PATCHES[0].subject}" and "{PATCHES[1].subject}")'
    return [path for path, _ in written] + alone + [pr] + write_recipe(out / RECIPE_DIR, repo, core_pr)
