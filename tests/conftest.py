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
"""Shared fixtures: verl's composed actor config, random stale batches, what each remedy comparison row sets, and what
``verl-sat upstream`` writes with verl 0.9.1's tree the core series was applied to.

No ``tests/__init__.py``: the verl wheel ships a top-level ``tests`` package of its own.
"""

import copy
import functools
import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from verl.trainer.config import RolloutCorrectionConfig
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import ActorConfig

from verl_sat.cli import main as cli_main
from verl_sat.config import SatConfig
from verl_sat.embedded.prepare import PrepareSpec, prepare
from verl_sat.upstream import RECIPE_DIR, VERL_DIR
from verl_sat.upstream.recipe_names import RECIPE
from verl_sat.upstream.recipe_readme import REVIEW_RUNS
from verl_sat.upstream.series import verl_site_root

# The embedded engine at test size: a 2-layer, 4-expert policy on one-digit addition, warm-started into TINY_BAND
# (about 3 s).
TINY_PREPARE = PrepareSpec(max_operand=9, num_train=60, num_val=20, num_test=20, max_response_length=8, hidden_size=32,
                           num_layers=2, num_experts=4, warm_start_batch=16, warm_start_lr=3e-3,
                           warm_start_eval_every=20, warm_start_max_steps=3000)  # fmt: skip
TINY_BAND = (0.25, 0.6)

SAT_TARGET = "actor_rollout_ref.actor.policy_loss._target_=verl_sat.config.SatPolicyLossConfig"

# (registered loss, granularity, verl's nominal counterpart): both losses, every granularity of sat_gspo ("token" for
# sat is its only, per-token rule; the loss itself is called without a granularity key).
LOSS_CASES = [
    ("sat", "token", "vanilla"),
    ("sat_gspo", "sequence", "gspo"),
    ("sat_gspo", "sequence_uniform", "gspo"),
    ("sat_gspo", "token", "gspo"),
    ("sat_gspo", "token_ratio_side", "gspo"),
    ("sat_gspo", "sequence_carried", "gspo"),
]
QUANTILE_METHODS = ["inverted_cdf", "linear"]


@pytest.fixture(autouse=True)
def _no_carried_scores():
    """Every test starts with ``granularity=sequence_carried``'s process-wide ring empty (it is ``sequence`` until a
    call adds to it), and leaves it empty."""
    from verl_sat.sat_math import CARRIED

    CARRIED.clear()
    yield
    CARRIED.clear()


# every loss_agg_mode verl 0.9.1's ActorConfig accepts (its valid_loss_agg_modes)
AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@dataclass(frozen=True)
class Remedy:
    """What a remedy comparison row (``verl_sat.recipe_catalog.REMEDY_ROWS``) changes in the row it is built on."""

    base: str  # the recipe it differs from, in the remedy only
    loss_mode: str  # verl's registered policy loss it trains with
    actor: dict  # actor keys it sets besides the loss
    correction: RolloutCorrectionConfig | None  # verl's rollout-correction preset it carries (None: the base's bypass)

    def correction_keys(self) -> dict | None:
        """``algorithm.rollout_correction`` as the preset sets it (every key verl's config has), or None."""
        if self.correction is None:
            return None
        return {k: v for k, v in asdict(self.correction).items() if not k.startswith("_")}


def _verl_default(key: str):
    return ActorConfig.__dataclass_fields__[key].default


ICEPOP = RolloutCorrectionConfig.decoupled_token_icepop()
REMEDIES = {
    "gspo_icepop": Remedy("gspo", "gspo", {}, ICEPOP),
    "gspo_seq_is_rs": Remedy("gspo", "gspo", {}, RolloutCorrectionConfig.decoupled_seq_is_rs()),
    "gspo_geo_rs": Remedy("gspo", "gspo", {}, RolloutCorrectionConfig.decoupled_geo_rs()),
    "gspo_k3_rs": Remedy("gspo", "gspo", {}, RolloutCorrectionConfig.decoupled_k3_rs()),
    "sapo": Remedy("gspo", "sapo", {key: _verl_default(key) for key in ("tau_pos", "tau_neg")}, None),
    # verl's examples/cispo_trainer and examples/dppo_trainer values; clip_ratio_c as the dppo row
    "cispo": Remedy("gspo", "cispo", {"clip_ratio_low": 10.0, "clip_ratio_high": 0.2}, None),
    "dppo_kl": Remedy("gspo", "dppo_kl", {"clip_ratio_low": 0.05, "clip_ratio_high": 0.05, "clip_ratio_c": 20.0}, None),
    # verl's examples/gmpo_trainer clip
    "geo_mean": Remedy("gspo", "geo_mean", {"clip_ratio_low": 0.4, "clip_ratio_high": 0.4}, None),
    "sat_gspo_icepop": Remedy("sat_gspo", "sat_gspo", {}, ICEPOP),
}


def sat_overrides(loss: str, granularity: str, *extra: str) -> list[str]:
    """Command-line overrides of the sat block for a LOSS_CASES entry (``sat`` takes no granularity key)."""
    keys = [] if loss == "sat" else [f"+actor_rollout_ref.actor.policy_loss.sat.granularity={granularity}"]
    return [*keys, *extra]


def gate_config(loss: str, granularity: str, **keys) -> SatConfig:
    """The ``SatConfig`` a LOSS_CASES entry runs with (``sat`` keeps the default granularity)."""
    return SatConfig(**keys) if loss == "sat" else SatConfig(granularity=granularity, **keys)


def compose_verl(overrides: list[str]):
    """Compose verl 0.9.1's packaged ``ppo_trainer`` config with command-line style overrides (a fresh copy)."""
    return copy.deepcopy(_compose_cached(tuple(overrides)))


@functools.cache
def _compose_cached(overrides: tuple[str, ...]):
    with initialize_config_module("verl.trainer.config", version_base=None):
        return compose("ppo_trainer", overrides=list(overrides))


def actor_config(*overrides: str, loss_mode: str = "sat"):
    """verl's ``FSDPActorConfig`` built with ``omega_conf_to_dataclass``, the SAT policy-loss target set."""
    cfg = compose_verl(
        [
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            SAT_TARGET,
            f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}",
            *overrides,
        ]
    )
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


@dataclass
class StaleBatch:
    """A micro-batch as verl hands it to a policy loss. All tensors ``[B, T]``."""

    old_log_prob: torch.Tensor
    log_prob: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor

    def fresh_log_prob(self) -> torch.Tensor:
        """A leaf copy of ``log_prob`` that requires grad."""
        return self.log_prob.detach().clone().requires_grad_(True)


def make_stale_batch(
    seed: int = 0,
    num_prompts: int = 16,
    group: int = 4,
    length: int = 40,
    scale: float = 0.1,
    dtype: torch.dtype = torch.float32,
) -> StaleBatch:
    """Heavy-tailed log-ratios (Student-t, df=2, plus a per-sequence drift), GRPO-like group-normalised binary
    advantages, ragged right-padded masks (one sequence fully masked)."""
    gen = torch.Generator().manual_seed(seed)
    batch = num_prompts * group
    old = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 4.0
    student = torch.distributions.StudentT(torch.tensor(2.0, dtype=torch.float64))
    torch.manual_seed(seed)
    drift = torch.randn(batch, 1, generator=gen, dtype=torch.float64) * scale
    log_ratio = (student.sample((batch, length)) * scale + drift).clamp(-15.0, 15.0)
    rewards = (torch.rand(num_prompts, group, generator=gen) > 0.5).double()
    adv = (rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + 1e-6)
    adv = adv.reshape(batch, 1).expand(batch, length).clone()
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    lengths[0] = 0
    mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    return StaleBatch(
        old_log_prob=old.to(dtype),
        log_prob=(old + log_ratio).to(dtype),
        advantages=adv.to(dtype),
        response_mask=mask,
    )


def nominal_token_loss(log_prob, old_log_prob, advantages, clip_low, clip_high, clip_ratio_c=3.0):
    """Per-token PPO dual-clip loss with the fixed interval (the nominal rule), written out independently."""
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, -20.0, 20.0))
    ppo = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high))
    return torch.where(advantages < 0, torch.minimum(ppo, -advantages * clip_ratio_c), ppo)


def nominal_gspo_loss(log_prob, old_log_prob, advantages, mask, clip_low, clip_high):
    """Per-token GSPO-token loss with the fixed interval, written out independently (no clamp inside ``s_i``)."""
    log_ratio = log_prob - old_log_prob
    seq = torch.sum(log_ratio * mask, dim=-1) / torch.sum(mask, dim=-1).clamp(min=1)
    rho = torch.exp(torch.clamp(log_prob - log_prob.detach() + seq.detach().unsqueeze(-1), max=10.0))
    return torch.maximum(-advantages * rho, -advantages * torch.clamp(rho, 1 - clip_low, 1 + clip_high))


@functools.cache
def _default_actor_config():
    return actor_config()


@pytest.fixture
def sat_actor_config():
    """Actor config with the SAT target (defaults of the sat block), loss mode ``sat``: a fresh copy per test, which
    may swap its ``policy_loss.sat`` block."""
    return copy.deepcopy(_default_actor_config())


@pytest.fixture(scope="session")
def tiny_workdir(tmp_path_factory):
    """A workdir prepared at test size (shared: tests write their runs under their own experiment names)."""
    path = tmp_path_factory.mktemp("prepared")
    prepare(path, seed=0, spec=TINY_PREPARE, band=TINY_BAND, progress=False)
    return path


@pytest.fixture(scope="session")
def vllm_float32(tiny_workdir, tmp_path_factory):
    """One float32 vLLM engine on the tiny model (``python -m verl_sat.cpu.vllm_reload``): the weight-update
    figures, and the samples it drew before any update (the R3 tests replay them)."""
    out = tmp_path_factory.mktemp("vllm_float32")
    cmd = [sys.executable, "-m", "verl_sat.cpu.vllm_reload", "--model", str(tiny_workdir / "model"),
           "--out", str(out / "reload.json"), "--samples-out", str(out / "samples.pt")]  # fmt: skip
    subprocess.run(cmd, check=True, timeout=600)
    return {"figures": json.loads((out / "reload.json").read_text()), "samples": out / "samples.pt"}


# ---- verl-sat upstream ---------------------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parent.parent
# the slim copy of verl-project/verl-recipe beside the checkout (its README, installer and lint configuration)
VERL_RECIPE = Path(os.environ.get("VERL_RECIPE_SNAPSHOT", REPO.parent / "shared" / "verl-recipe"))
# in an interpreter that must not see the plugin: verl-sat is not importable (and verl's plugin loader skips it)
BLOCK_VERL_SAT = "import sys\nsys.modules['verl_sat'] = None\n"
# runs ``python -m recipe.sat.main`` as ``-m`` does (runpy, as __main__) once per argument list given as JSON, in one
# interpreter; prints what each run printed and how it exited, where verl and the recipe took their SAT pieces from, and
# the FSDP engine verl builds once a worker has built the recipe's router-replay config with mode R3
RECIPE_DRIVER = """
import contextlib, io, json, runpy, sys
try:
    import verl_sat
    blocked = False
except ImportError:
    blocked = True
runs = []
for args in json.loads(sys.argv[1]):
    sys.argv = ["recipe.sat.main", *args]
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module("recipe.sat.main", run_name="__main__", alter_sys=True)
        except SystemExit as exit:
            code = exit.code
        except Exception as error:
            code = repr(error)
    runs.append({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
import verl
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
from verl.workers.engine.base import EngineRegistry
try:
    from recipe.sat import compat
    classes = [f"{c.__module__}.{c.__qualname__}" for c in (compat.SatPolicyLossConfig, compat.FSDPRouterReplayConfig)]
    compat.FSDPRouterReplayConfig(mode="R3")  # what a worker builds for r3=fsdp
    engine = EngineRegistry._engines["language_model"]["fsdp"]["cuda"]
    engine = f"{engine.__module__}.{engine.__qualname__}"
except Exception as error:
    classes = engine = repr(error)
print(json.dumps({
    "blocked": blocked, "verl": verl.__file__, "runs": runs, "classes": classes, "fsdp_engine_with_r3": engine,
    "losses": [getattr(POLICY_LOSS_REGISTRY.get(name), "__module__", None) for name in ("sat", "sat_gspo")],
    "fallback_loaded": sorted(name for name in sys.modules if name.startswith("recipe.sat.fallback")),
}))
"""


def verl_copy(dest: Path) -> Path:
    """verl 0.9.1 as the wheel installed it (``verl/`` and the wheel's ``tests/``), copied to ``dest``."""
    site = verl_site_root()
    for name in ("verl", "tests"):
        shutil.copytree(site / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def git_apply(tree: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "apply", *args], cwd=tree, capture_output=True, text=True)


def without_verl_sat(block: Path, *path: Path) -> dict[str, str]:
    """An environment whose interpreters put ``path`` first on ``sys.path`` and cannot import verl-sat (a
    ``sitecustomize`` written to ``block``)."""
    block.mkdir(parents=True, exist_ok=True)
    (block / "sitecustomize.py").write_text(BLOCK_VERL_SAT)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [*path, block])), "VERL_USE_EXTERNAL_PLUGINS": "none"}


def run_recipe(checkout: Path, env: dict[str, str], *runs: tuple[str, ...]) -> dict:
    """``RECIPE_DRIVER``'s report for ``python -m recipe.sat.main ARGS --cfg job``, each of ``runs``, from
    ``checkout``."""
    proc = subprocess.run([sys.executable, "-c", RECIPE_DRIVER, json.dumps([[*args, "--cfg", "job"] for args in runs])],
                          cwd=checkout, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.fixture(scope="session")
def series(tmp_path_factory):
    """What the CLI's ``upstream`` wrote (its ``--out`` folder), the core series' patches, and a verl checkout made of
    both contributions: verl 0.9.1's tree (``verl/`` and the wheel's ``tests/``) with the series applied (``--check``
    first) and, as its ``recipe/`` submodule, verl-recipe (a copy of ``VERL_RECIPE`` where there is one) with the
    generated recipe laid in."""
    out = tmp_path_factory.mktemp("upstream")
    assert cli_main(["upstream", "--out", str(out)]) == 0
    patches = sorted((out / VERL_DIR).glob("*.patch"))
    tree = verl_copy(tmp_path_factory.mktemp("verl"))
    for patch in patches:
        check = git_apply(tree, "--check", str(patch))
        assert check.returncode == 0, check.stderr
        applied = git_apply(tree, str(patch))
        assert applied.returncode == 0, applied.stderr
    if VERL_RECIPE.is_dir():
        shutil.copytree(VERL_RECIPE, tree / "recipe")
        (tree / "recipe").chmod(0o755)  # the snapshot is read-only
    shutil.copytree(out / RECIPE_DIR / RECIPE, tree / "recipe" / RECIPE)
    return out, patches, tree


@pytest.fixture(scope="session")
def patched_report(series, tmp_path_factory):
    """``run_recipe``'s report from the checkout ``series`` made, without verl-sat: which verl is imported, where the
    SAT losses and the recipe's config classes come from, and the reviewer's dry run of the separate-async trainer."""
    _, _, tree = series
    env = without_verl_sat(tmp_path_factory.mktemp("block"), tree)
    return run_recipe(tree, env, REVIEW_RUNS["separate_async"])
