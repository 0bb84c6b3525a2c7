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
"""Shared fixtures: verl's composed actor config, random stale batches, and what each remedy comparison row sets.

No ``tests/__init__.py``: the verl wheel ships a top-level ``tests`` package of its own.
"""

import copy
import functools
import json
import subprocess
import sys
from dataclasses import asdict, dataclass

import pytest
import torch
from hydra import compose, initialize_config_module
from verl.trainer.config import RolloutCorrectionConfig
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import ActorConfig

from verl_sat.config import SatConfig
from verl_sat.embedded.prepare import PrepareSpec, prepare

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
]
QUANTILE_METHODS = ["inverted_cdf", "linear"]
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
