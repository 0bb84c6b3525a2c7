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
"""The second contribution of ``verl-sat upstream``: the verl-recipe pull request adding ``sat/``, written as the folder
to lay into a verl-recipe checkout and the pull request's text. ``recipe_code``, ``recipe_configs``,
``recipe_scripts`` and ``recipe_readme`` make its files."""

import shutil
from pathlib import Path

from verl_sat.upstream.recipe_code import recipe_code
from verl_sat.upstream.recipe_configs import recipe_configs
from verl_sat.upstream.recipe_names import RECIPE
from verl_sat.upstream.recipe_readme import pr_markdown, readme, required_verl
from verl_sat.upstream.recipe_scripts import recipe_scripts


def recipe_files(repo: Path, core_pr: str) -> dict[str, str]:
    """Every file of ``sat/``, by path inside it; ``core_pr`` names the pull request to verl in its texts."""
    configs = recipe_configs()
    return {
        "README.md": readme(configs, core_pr),
        "REQUIRED_VERL.txt": required_verl(),
        **recipe_code(),
        **configs,
        **recipe_scripts(repo),
    }


def write_recipe(out: Path, repo: Path, core_pr: str) -> list[Path]:
    """Write ``out/sat/`` (an old one is removed first) and ``out/PR.md``; return the files written."""
    folder = out / RECIPE
    if folder.exists():
        shutil.rmtree(folder)
    files = recipe_files(repo, core_pr)
    written = []
    for name, text in sorted(files.items()):
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if name.endswith(".sh"):
            path.chmod(0o755)
        written.append(path)
    pr = out / "PR.md"
    pr.write_text(pr_markdown(files, core_pr))
    return [*written, pr]
