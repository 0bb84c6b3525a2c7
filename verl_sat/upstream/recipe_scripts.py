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
"""The run scripts of the verl-recipe ``sat/`` recipe: verl-sat's ``examples/run_*.sh`` (the paper's setup, and a dense
FSDP run), launched as ``python -m recipe.sat.main`` from a verl checkout's root, everything else as it is."""

from pathlib import Path

from verl_sat.upstream.edit import UpstreamDriftError
from verl_sat.upstream.examples import SCRIPTS
from verl_sat.upstream.recipe_names import RECIPE, renamed

# (verl-sat's text, the recipe's) in the scripts, before the common renames
SCRIPT_PHRASES = (
    ("bash examples/run_", f"bash recipe/{RECIPE}/run_"),
    ("any recipe of `verl-sat recipes`", f"any file of recipe/{RECIPE}/config/recipe/"),
    ("any of `verl-sat recipes`", f"any of recipe/{RECIPE}/config/recipe/"),
    ("(the entry point warns; docs/sat.md).", "(the entry point warns; see the README)."),
    ('(docs/results.md, "Long chain of thought")', "(see the README)"),
    ("trainer.project_name=verl_sat ", f"trainer.project_name={RECIPE} "),
)


def recipe_scripts(repo: Path) -> dict[str, str]:
    """``run_*.sh`` -> its text, from ``repo``'s ``examples/`` (the scripts the core pull request also converts)."""
    scripts = {}
    for source in SCRIPTS:
        path = repo / source
        if not path.is_file():
            raise UpstreamDriftError(f"{path} not found: run `verl-sat upstream` from a verl-sat source checkout")
        text = path.read_text()
        for old, new in SCRIPT_PHRASES:
            text = text.replace(old, new)
        scripts[Path(source).name] = renamed(text, source)
    return scripts
