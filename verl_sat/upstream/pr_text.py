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
"""``PR.md``: the pull request's text in verl's template, with the paper's Table 1, verl-sat's measured paired
comparisons (``docs/images/results/results.json`` and the commands that made it), the key mapping and the files."""

import json
from pathlib import Path

from verl_sat.embedded.cell_stats import num, p_text
from verl_sat.recipe_catalog import PAPER_TABLE_1
from verl_sat.upstream.edit import UpstreamDriftError
from verl_sat.upstream.sat_patch import key_mapping
from verl_sat.upstream.series import DOCS_INDEX

RESULTS = "docs/images/results/results.json"
UPSTREAM_TESTS = (
    "tests/trainer/ppo/test_sat_policy_loss_on_cpu.py",
    "tests/workers/engine/test_fsdp_router_replay_on_cpu.py",
    "tests/trainer/ppo/test_core_algos_on_cpu.py",
    "tests/trainer/ppo/test_dynamic_policy_losses_on_cpu.py",
    "tests/trainer/ppo/test_trainer_logging_on_cpu.py",
    "tests/workers/rollout/test_rollout_logging_on_cpu.py",
)
MOTIVATION = """\
Asynchronous RL trains on tokens sampled by an older policy through a different inference engine (and, for MoE
models, other expert routing). In bypass mode (`algorithm.rollout_correction.bypass_mode=True`) `log_prob -
old_log_prob` is that staleness for every token. SAT (Yang et al., *Stale but Stable: Staleness-Adaptive Trust Regions
for Stabilizing Asynchronous Reinforcement Learning*, arXiv 2607.18722) keeps PPO's / GSPO's clip interval for
ordinary tokens and, for the high-mismatch tail of each micro-batch only (|d| above its alpha-quantile), contracts
the endpoint the token has already drifted toward (Eqs. 13-20). With nothing gated it is exactly `vanilla` / `gspo`.
"""


def pr_markdown(repo: Path, patches: list[tuple[Path, list[str]]], subjects: list[str]) -> str:
    """The text of ``PR.md`` for the written ``patches`` (file, changed paths) and their commit subjects."""
    results_path = repo / RESULTS
    if not results_path.is_file():
        raise UpstreamDriftError(f"{results_path} not found: run `verl-sat upstream` from a verl-sat source checkout")
    results = json.loads(results_path.read_text())
    am_args = " ".join(f"{i:04d}-*.patch" for i in range(1, len(patches) + 1))
    lines = [f"# {subjects[0]}", "", "### What does this PR do?", "", MOTIVATION]
    lines += [
        f"The series has {len(patches)} patches against verl 0.9.1; each after the first can be sent as its own PR,",
        "as `alone/N/0001-*.patch` (patch N generated on its own against 0.9.1: the same change, carrying its own",
        "license-header line), and passes verl's pre-commit, sanity, docs, type-coverage and PR-title checks so:",
        "",
        *(
            f"{i}. `{path.name}`: {subject}"
            for i, ((path, _), subject) in enumerate(zip(patches, subjects, strict=True), 1)
        ),
        "",
        "### The paper's numbers (Table 1: Qwen3-30B-A3B-Base, AIME24 avg@8 of the best checkpoint, one seed)",
        "",
        "| method | lag 1 | lag 8 | last-epoch mismatch lag 1 / lag 8 |",
        "|---|---|---|---|",
        *(
            f"| {row.method} | {row.lag1:.2f} | {row.lag8:.2f}{' (collapses later)' if row.collapses_at_lag8 else ''}"
            f" | {row.mismatch_lag1:.4f} / {row.mismatch_lag8:.4f} |"
            for row in PAPER_TABLE_1.values()
        ),
        "",
        "Lag n = optimizer steps between weight broadcasts, rollout one batch ahead.",
        "",
        "### Measured with the verl plugin form (verl-sat), paired by seed",
        "",
        "At single-machine scale (a 1.8M-parameter Qwen3-MoE on a synthetic verifiable task, verl's losses, estimators",
        "and scorer, tuned only to the paper's mismatch regime), SAT row minus its base row in test accuracy points,",
        "two-sided paired t-test over the seeds, then Holm-adjusted over every test of the table ('-': no test):",
        "",
        "| SAT row | base | lag | seeds | best (p, Holm) | last (p, Holm) | SAT q / radius | intercepted |",
        "|---|---|---|---|---|---|---|---|",
        *(
            f"| {p['recipe']} | {p['base']} | {p['lag_label']} | {len(p['seeds'])} | {100 * p['mean_diff']:+.1f} "
            f"({p_text(p['p_value'])}, {p_text(p['p_holm'])}) | {100 * p['last_mean_diff']:+.1f} "
            f"({p_text(p['last_p_value'])}, {p_text(p['last_p_holm'])}) | {num(p['q_over_radius'], 2)} | "
            f"{num(p['intercepted_frac'])} |"
            for p in results["paired"]
        ),
        "",
        "Made by (verl-sat checkout, `verl-sat prepare --workdir W` first):",
        "",
        "```bash",
        *results["command"],
        "```",
        "",
        "### API and Usage Example",
        "",
        "```bash",
        "# patch 1: SAT-GSPO (loss_mode=sat for SAT-GRPO), in the asynchronous trainer's bypass mode",
        "python3 -m verl.trainer.main_ppo algorithm.rollout_correction.bypass_mode=True trainer.use_v1=True \\",
        "  actor_rollout_ref.actor.policy_loss.loss_mode=sat_gspo \\",
        "  actor_rollout_ref.actor.policy_loss.sat_quantile=0.9 ...",
        "# patch 2: routing replay (R3) for a Hugging Face MoE model under FSDP",
        "python3 -m verl.trainer.main_ppo actor_rollout_ref.rollout.enable_rollout_routing_replay=True \\",
        "  actor_rollout_ref.model.use_remove_padding=True \\",
        "  actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3 ...",
        "# patch 3: the separate-async trainer with rollout only on its standalone replicas starts",
        "python3 -m verl.trainer.main_ppo trainer.v1.trainer_mode=separate_async \\",
        "  actor_rollout_ref.hybrid_engine=False ...",
        "# patch 4: SGLang's HttpServerAdapter(launch_server=True) on a rank that does not start the server, at",
        "# VERL_LOGGING_LEVEL=INFO, no longer raises TypeError",
        "```",
        "",
        "`examples/sat_trainer/` has the paper's setup (Megatron with R3, SGLang) and a dense FSDP run;",
        "`docs/algo/sat.md` documents the rule, every key and every metric.",
        "",
        "### Design & Code Changes",
        "",
        "Key mapping from the plugin's nested block to verl's flat keys (`PolicyLossConfig` fields, as `clip_cov_*`):",
        "",
        "| verl-sat | this PR |",
        "|---|---|",
        *(f"| `{plugin}` | `{upstream}` |" for plugin, upstream in key_mapping()),
        "",
    ]
    for (path, changed), subject in zip(patches, subjects, strict=True):
        lines += [f"`{path.name}` ({subject}):", "", *(f"- `{name}`" for name in changed), ""]
    lines += [
        "The patches are generated from verl-sat's source (`verl-sat upstream --out DIR`): the SAT math module and",
        "the model-level routing replay are copied as they are, the loss functions and the FSDP engine hooks are",
        "copied from the plugin's, and the config fields and YAML keys come from the plugin's hyperparameter",
        "dataclass.",
        "",
        *(
            []
            if any(DOCS_INDEX in changed for _, changed in patches)
            else [
                "Add `docs/algo/sat.md` to the toctree of `docs/index.rst` (generated without a verl checkout,",
                "so not patched).",
                "",
            ]
        ),  # fmt: skip
        "### Test",
        "",
        "Applied to verl 0.9.1's installed package with `git apply`, these pass in a fresh interpreter without",
        "verl-sat importable:",
        "",
        "```bash",
        f"pytest {' '.join(UPSTREAM_TESTS)}",
        "```",
        "",
        f"In a verl checkout: `git am --keep-non-patch {am_args}`, then",
        "`pre-commit run --all-files` (its `autogen-trainer-cfg` hook regenerates",
        "`verl/trainer/config/_generated_*.yaml`, which the patches already carry) and verl's CPU tests",
        "(`pytest tests/**/*_on_cpu.py`). The series, and each of patches 2-4 applied alone, passes offline the",
        "checks verl's CI runs on a pull request: every pre-commit hook (ruff 0.12.2, mypy 1.17.0, the local",
        "hooks), `tests/special_sanity` and `validate_imported_docs.py`, the Sphinx build as `doc.yml` judges it,",
        "`type_coverage_check.py`, `check_api_docs.py verl`, and the PR-title and description checks.",
        "",
        "### Checklist Before Submitting",
        "",
        "- [x] Read the contribute guide; PR title as `[{modules}] {type}: {description}`",
        "- [x] Apply pre-commit checks (`pre-commit run --all-files`)",
        "- [x] Add / update documentation (`docs/algo/sat.md`)",
        "- [x] Add unit tests (CPU) for the new losses, config keys and the FSDP routing replay, and for the logging",
        "  calls of the trainers and rollouts",
        "",
    ]
    return "\n".join(lines)
