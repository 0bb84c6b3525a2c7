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
"""``docs/algo/sat.md`` for verl, derived from verl-sat's ``docs/sat.md``: the same page (verl's algo-page shape) with
the plugin's enabling instructions and key table replaced by verl's flat keys, the plugin's own tools left out and
``sat.<name>`` renamed ``sat_<name>``. Anything plugin-specific left over fails generation."""

import re
import textwrap
from dataclasses import fields
from pathlib import Path

from verl_sat.sat_math import SatParams
from verl_sat.upstream.edit import UpstreamDriftError, replace_once
from verl_sat.upstream.sat_patch import FLAT_PREFIX, UPSTREAM_KEY, param_docs

SOURCE = "docs/sat.md"
TARGET = "docs/algo/sat.md"
# exact phrases of docs/sat.md that name the plugin, and what verl's page says instead
SUBSTITUTIONS = (
    ("verl-sat registers it as two verl policy losses", "verl implements it as two policy losses"),
    ("; see [benchmarks.md](benchmarks.md).", "."),
    (" [recipes.md](recipes.md) has all 13 rows.", ""),
    # the mismatch metric of every row is logged by the plugin's wrapper of ppo_loss, which the series leaves out
    (
        "| `actor/mismatch_abs_log_ratio` | the paper's mismatch `d̄π` (Eq. 52): the token-level mean "
        "`\\|log π - log μ\\|` over the active tokens, `μ` the rollout engine's log-prob; logged for every loss, see "
        "below |\n",
        "",
    ),
)
# the plugin's properties paragraph names its own test suite; verl's page says what the PR's test file checks
PROPERTIES_MARKER = "Properties, each a test in `tests/test_sat_properties_on_cpu.py`"
PR_PROPERTIES = (
    "Properties tested in `tests/trainer/ppo/test_sat_policy_loss_on_cpu.py`, through verl's policy-loss registry, "
    "for `sat` and for `sat_gspo` with every granularity, with both quantile methods and under every `loss_agg_mode` "
    "(`token-mean`, `token-sum`, `seq-mean-token-mean`, `seq-mean-token-sum`, `seq-mean-token-sum-norm`): the gate "
    "takes at most `1-alpha` of the active units (length-weighted for `sequence`; with `quantile_method=linear` at "
    "most one unit more, `ceil((1-alpha)(n-1))`, which is one reason the paper's rule is the default); the loss "
    "is never below the nominal one; ungated tokens get exactly the nominal gradient; a gated token whose ratio lies "
    "in the newly cut band `(hi, 1+eps_hi]` or `[1-eps_lo, lo)` gets zero gradient where the nominal rule gives "
    "it one; a NaN token drops out and the loss and its gradient stay finite; an all-masked micro-batch gives a "
    "finite zero loss on the graph. Also tested: the SAT interval lies inside the nominal one (every granularity); "
    "with no staleness, or with nothing gated, the loss and its gradient are bit for bit verl's `vanilla` / `gspo`; "
    "a gated case computed by hand; the once-per-process warning when the gate is structurally empty."
)
# paragraphs about the plugin's own entry points, its mismatch wrapper, its device checks, its measurements and its
# recipes
DROPPED_PARAGRAPH_MARKERS = ("verl_sat.main", "verl_sat.mismatch", "verl_sat.op_audit", "](results.md",
                             "verl-sat's rows")  # fmt: skip
LEFTOVER = re.compile(r"verl-sat|verl_sat|\]\((?!https?://)[^)]*\)")  # plugin names, links to the plugin's pages
HOW_TO_ENABLE = """## How to enable

Set the loss mode and, if needed, the `sat_*` keys of `actor_rollout_ref.actor.policy_loss` (defaults below are the
paper's). SAT's staleness proxy is `log_prob - old_log_prob`, so run the asynchronous v1 trainer in bypass mode:

```bash
python3 -m verl.trainer.main_ppo \\
  algorithm.adv_estimator=grpo \\
  algorithm.rollout_correction.bypass_mode=True \\
  trainer.use_v1=True \\
  actor_rollout_ref.actor.policy_loss.loss_mode=sat_gspo \\
  actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean \\
  actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.2 \\
  actor_rollout_ref.actor.use_dynamic_bsz=true actor_rollout_ref.actor.ppo_max_token_len_per_gpu=34816 \\
  {quantile_key}=0.9 \\
  {granularity_key}=sequence_carried \\
  ...
```

`{granularity_key}=sequence_carried`: at this token budget a micro-batch holds one full-length sequence once
responses reach the cap, where the paper's per-micro-batch quantile cannot gate (see "The scope of the quantile"
above).

For SAT-GRPO use `loss_mode=sat` (`examples/sat_trainer/` aggregate every method with `seq-mean-token-mean`, one
rule for all as in the paper). `examples/sat_trainer/` has the paper's setup
(Qwen3-30B-A3B, Megatron, SGLang) and a dense-model FSDP run.
"""


def docs_page(repo: Path) -> str:
    """verl's ``docs/algo/sat.md`` from ``repo``'s ``docs/sat.md``."""
    source = repo / SOURCE
    if not source.is_file():
        raise UpstreamDriftError(f"{source} not found: run `verl-sat upstream` from a verl-sat source checkout")
    text = source.read_text()
    for old, new in SUBSTITUTIONS:
        text = replace_once(text, old, new, SOURCE)
    sections = re.split(r"(?m)^(?=## )", text)
    kept = []
    for section in sections:
        if section.startswith("## How to enable"):
            section = HOW_TO_ENABLE.format(quantile_key=UPSTREAM_KEY.format("quantile"),
                                           granularity_key=UPSTREAM_KEY.format("granularity")) + "\n"  # fmt: skip
        elif section.startswith("## Keys"):
            section = keys_section() + "\n"
        paragraphs = [p for p in section.split("\n\n") if not any(m in p for m in DROPPED_PARAGRAPH_MARKERS)]
        paragraphs = [_wrap(PR_PROPERTIES) if p.startswith(PROPERTIES_MARKER) else p for p in paragraphs]
        kept.append("\n\n".join(paragraphs))
    page = "".join(kept).rstrip("\n") + "\n"
    for f in fields(SatParams):
        page = re.sub(rf"`sat\.{f.name}\b", f"`{FLAT_PREFIX}{f.name}", page)
    leftover = sorted(set(LEFTOVER.findall(page)))
    if leftover:
        raise UpstreamDriftError(f"{SOURCE} mentions {leftover}, which verl's page cannot: extend {__name__}")
    return page


def _wrap(paragraph: str) -> str:
    return "\n".join(textwrap.wrap(paragraph, width=120, break_on_hyphens=False, break_long_words=False))


def keys_section() -> str:
    """The page's key table: every ``sat_*`` key of verl's ``PolicyLossConfig``, its default and meaning."""
    docs = param_docs()
    rows = "".join(
        f"| `{FLAT_PREFIX}{f.name}` | `{f.default}` | {docs[f.name][1].replace('|', chr(92) + '|')} |\n"
        for f in fields(SatParams)
    )
    return (
        "## Keys (`actor_rollout_ref.actor.policy_loss.sat_*`)\n\n"
        "| key | default | meaning |\n|---|---|---|\n" + rows + "\n"
        "Bad values fail when `PolicyLossConfig` is built, naming the key, the value and the allowed range, e.g.\n"
        f"`{UPSTREAM_KEY.format('quantile')}=1.5 is invalid: expected a float in the open interval (0, 1) with at\n"
        "most 6 decimal places`. The clip radii are verl's own `clip_ratio_low`, `clip_ratio_high` (falling back to\n"
        "`clip_ratio`) and `clip_ratio_c`.\n"
    )
