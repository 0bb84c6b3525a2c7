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
"""verl's ``verl/trainer/config/_generated_ppo*_trainer.yaml``, rebuilt from an edited config tree the way verl's
``scripts/generate_trainer_config.sh`` builds them: the header kept, the body the composed job config (``--cfg job``,
i.e. ``OmegaConf.to_yaml``) from the ``actor_rollout_ref`` line on. For verl 0.9.1's unedited tree this reproduces the
shipped files byte for byte (tested)."""

import re
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from verl_sat.upstream.edit import UpstreamDriftError

CONFIG_DIR = "verl/trainer/config"
GENERATED = (
    "_generated_ppo_trainer.yaml",
    "_generated_ppo_megatron_trainer.yaml",
    "_generated_ppo_veomni_trainer.yaml",
    "_generated_ppo_torchtitan_trainer.yaml",
)
BODY_START = "actor_rollout_ref:"
# the header's second line names the command that made the file: print_cfg.py --cfg job <overrides> ... '<config>.yaml'
_HEADER_COMMAND = re.compile(
    r"print_cfg\.py --cfg job ?(?P<overrides>[^']*)' to flatten the '[^']*/(?P<name>\w+)\.yaml'"
)


def regenerate(tree: Path) -> dict[str, str]:
    """The regenerated text of every generated trainer config under ``tree`` (a checkout root), by path."""
    config_dir = (tree / CONFIG_DIR).resolve()
    return {f"{CONFIG_DIR}/{name}": _regenerate_one(config_dir, name) for name in GENERATED}


def _regenerate_one(config_dir: Path, name: str) -> str:
    shipped = (config_dir / name).read_text()
    header = shipped[: shipped.index("\n" + BODY_START) + 1]
    match = _HEADER_COMMAND.search(header)
    if match is None:
        raise UpstreamDriftError(f"{CONFIG_DIR}/{name}: the header does not name the print_cfg.py command")
    config = _compose(config_dir, match["name"], match["overrides"].split())
    body = OmegaConf.to_yaml(config)
    return header + body[body.index(BODY_START) :]


def _compose(config_dir: Path, config_name: str, overrides: list[str]):
    """Compose without disturbing a Hydra instance the caller has initialized."""
    global_hydra = GlobalHydra.instance()
    outer = global_hydra.hydra if global_hydra.is_initialized() else None
    global_hydra.clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base=None):
            return compose(config_name=config_name, overrides=overrides)
    finally:
        if outer is not None:
            global_hydra.clear()
            global_hydra.initialize(outer)
