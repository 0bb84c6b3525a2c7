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
"""verl's ``examples/sat_trainer/run_*.sh``: verl-sat's launch scripts with the recipe spelled out as explicit
overrides of ``python3 -m verl.trainer.main_ppo``.

The overrides are what the recipe changes in verl's composed config (the script's recipe at paper lag 1 and 8, against
verl's defaults), with verl-sat's nested keys mapped to verl's flat ones; the lag's two lag-dependent keys become shell
variables of the script. Keys the script sets itself stay the script's.
"""

import re
import shlex
from pathlib import Path

from omegaconf import OmegaConf

from verl_sat.upstream.edit import UpstreamDriftError

# verl-sat script -> (verl script, what it runs, usage example)
SCRIPTS = {
    "examples/run_qwen3_30b_a3b_sat_gspo_r3_megatron.sh": (
        "examples/sat_trainer/run_qwen3_30b_a3b_sat_gspo_r3_megatron.sh",
        (
            "SAT-GSPO with Megatron's rollout routing replay (R3) in the paper's setup (arXiv 2607.18722, Sec. 5.1,",
            "App. F, Table 9): Qwen3-30B-A3B-Base, SGLang rollout and Megatron training on separate GPU pools,",
            "256 prompts x 16 samples per optimizer step, response cap 32k, 544 optimizer steps.",
        ),
    ),
    "examples/run_qwen2_5_7b_sat_grpo_fsdp.sh": (
        "examples/sat_trainer/run_qwen2_5_7b_sat_grpo_fsdp.sh",
        (
            "SAT-GRPO for a dense model under the FSDP engine: Qwen2.5-7B on one node, vLLM rollout on 4 dedicated",
            "GPUs, the paper's shared settings (arXiv 2607.18722, Table 9) at one node's sizes.",
        ),
    ),
}
LAGS = (1, 8)  # the paper's lags; the script's LAG picks one
# keys whose value follows the lag, and the script variable that holds it (the script sets N=$LAG and
# data.train_batch_size=$((PROMPTS_PER_OPTIMIZER_STEP * N)))
LAG_KEYS = {
    "trainer.v1.separate_async.parameter_sync_step": "$N",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "$PROMPTS_PER_OPTIMIZER_STEP",
}
# (verl-sat's text, verl's) in the script's lines
RENAMES = (("trainer.project_name=verl_sat ", "trainer.project_name=sat_trainer "),)
NESTED_SAT = "actor_rollout_ref.actor.policy_loss.sat."
FLAT_SAT = "actor_rollout_ref.actor.policy_loss.sat_"
_LAUNCH = re.compile(r"^python -m verl_sat\.main(?P<flags>[^\\]*?)\s*\\$")
_OVERRIDE_KEY = re.compile(r"(?:^|\s)\+?([a-z_][\w.]*)=")


def example_scripts(repo: Path) -> dict[str, str]:
    """verl's example scripts, by path, from ``repo``'s ``examples/``."""
    return {target: _convert(repo, source, target, title) for source, (target, title) in SCRIPTS.items()}


def _convert(repo: Path, source: str, target: str, title: tuple[str, ...]) -> str:
    path = repo / source
    if not path.is_file():
        raise UpstreamDriftError(f"{path} not found: run `verl-sat upstream` from a verl-sat source checkout")
    lines = path.read_text().splitlines()
    body = lines[lines.index("set -euo pipefail") :]
    recipe = _variable_default(body, "RECIPE", source)
    lag = _variable_default(body, "LAG", source)
    launch = next((i for i, line in enumerate(body) if _LAUNCH.match(line)), None)
    if launch is None or not body[launch + 1].strip().startswith("+recipe="):
        raise UpstreamDriftError(f"{source}: expected `python -m verl_sat.main ... \\` then a `+recipe=` line")
    flags = _LAUNCH.match(body[launch])["flags"]
    set_by_script = {key for line in body[launch + 2 :] for key in _OVERRIDE_KEY.findall(line)}
    overrides = [
        f"  {key}={value} \\"
        for key, value in recipe_overrides(recipe, shlex.split(flags)).items()
        if key not in set_by_script
    ]
    out = []
    for i, line in enumerate(body):
        if line.startswith("RECIPE="):
            continue
        if line.startswith("LAG="):
            line = f"LAG=${{LAG:-{lag}}}  # paper lag n: 1 or 8"
        elif line.startswith('if [[ "$LAG" == sync ]]'):
            line = (
                f'[[ "$LAG" =~ ^({"|".join(map(str, LAGS))})$ ]] || '
                f'{{ echo "LAG must be {" or ".join(map(str, LAGS))}" >&2; exit 1; }}'
            )
            out.append(line)
            line = "N=$LAG"
        elif i == launch:
            line = f"python3 -m verl.trainer.main_ppo{flags} \\"
        elif i == launch + 1:
            out.extend(overrides)
            continue
        for old, new in RENAMES:
            line = line.replace(old, new)
        out.append(line.replace("${RECIPE}", recipe))
    leftover = sorted(set(re.findall(r"verl[-_]sat|\$\{?RECIPE\b|LAG_CHOICE", "\n".join(out))))
    if leftover:
        raise UpstreamDriftError(f"{source}: {leftover} left after conversion; extend {__name__}")
    header = [
        "#!/usr/bin/env bash",
        *(f"# {line}" for line in title),
        f"# Generated from verl-sat's {source} (recipe {recipe}).",
        "# LAG is the paper's lag n, 1 or 8: n optimizer steps between weight broadcasts, rollout one batch ahead.",
        "# Nothing is downloaded: point the paths below at local copies.",
        "#",
        f"#   LAG={lag} bash {target} [extra verl overrides, e.g. --cfg job]",
    ]
    return "\n".join(header + out) + "\n"


def recipe_overrides(recipe: str, flags: list[str]) -> dict[str, str]:
    """``{key: shell value}`` for every key the recipe changes in verl's config (composed with ``flags``), in verl's
    flat naming, the same at paper lag 1 and 8 but for ``LAG_KEYS``."""
    from verl_sat.main import compose_from_args, with_recipes_searchpath

    def leaves(overrides: list[str]) -> dict[str, object]:
        config = compose_from_args(with_recipes_searchpath([*flags, *overrides]))
        return _flatten(OmegaConf.to_container(config, resolve=False))

    base = leaves([])
    per_lag = {}
    for lag in LAGS:
        config = leaves([f"+recipe={recipe}", f"+lag=lag{lag}"])
        per_lag[lag] = {k: v for k, v in config.items() if not k.startswith("hydra.") and base.get(k, object()) != v}
    keys = sorted(set().union(*per_lag.values()))
    lag_dependent = {k for k in keys if len({repr(per_lag[lag].get(k)) for lag in LAGS}) > 1} - set(LAG_KEYS)
    if lag_dependent:
        raise UpstreamDriftError(f"the lag presets differ in {sorted(lag_dependent)}, not only in {sorted(LAG_KEYS)}")
    rendered = {}
    for key in keys:
        value = per_lag[LAGS[-1]][key]
        if key.endswith("._target_") and str(value).startswith("verl_sat."):
            continue  # verl-sat's config classes: verl's own dataclasses carry the keys upstream
        if key in LAG_KEYS:
            rendered[key] = LAG_KEYS[key]
        elif isinstance(value, str) and "${" in value:
            raise UpstreamDriftError(f"{key}={value}: an interpolation the example cannot spell out")
        else:
            rendered[key.replace(NESTED_SAT, FLAT_SAT)] = _shell_value(value)
    return rendered


def _variable_default(body: list[str], name: str, source: str) -> str:
    for line in body:
        match = re.match(rf"{name}=\$\{{{name}:-([\w.]+)\}}", line)
        if match:
            return match[1]
    raise UpstreamDriftError(f"{source}: no `{name}=${{{name}:-...}}` line")


def _flatten(tree, prefix: str = "") -> dict[str, object]:
    if isinstance(tree, dict) and tree:
        return {k: v for key, sub in tree.items() for k, v in _flatten(sub, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): tree}


def _shell_value(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, list):
        return "'[" + ",".join(_shell_value(v) for v in value) + "]'"
    return shlex.quote(str(value))
