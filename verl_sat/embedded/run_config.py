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
"""The embedded engine's config: verl's config tree composed with the same recipe group as ``verl_sat.main``: the
recipe, the lag, then the engine's defaults for this scale (``+embedded=default``: sizes, learning rate), then the
user's overrides, which win.

The engine reads an explicit list of verl's keys (``READ_KEYS``); a command-line override of any other key is an
error that names it, never silently ignored. Values the engine cannot honour are refused the same way.
"""

from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

import torch
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException
from verl.utils.tracking import Tracking
from verl.workers.config import PolicyLossConfig

from verl_sat.config import SatConfig
from verl_sat.embedded.prepare import check_prepared
from verl_sat.embedded.schedule import LagSchedule
from verl_sat.main import compose_from_args, split_args, with_recipes_searchpath
from verl_sat.preflight import PreflightError, check_config

_ACTOR, _ROLLOUT, _CORRECTION = (
    "actor_rollout_ref.actor.",
    "actor_rollout_ref.rollout.",
    "algorithm.rollout_correction.",
)
# the embedded engine's own key (not verl's): evaluate every this many optimizer steps, inside a trainer step too
EVAL_EVERY_KEY = "embedded_engine.eval_every_optimizer_steps"
# Every key the embedded engine reads (see docs/local_engine.md). actor.policy_loss.* are read by verl's registered
# losses; its sat.* keys only by the SAT losses, actor.tau_pos / tau_neg only by verl's sapo.
READ_KEYS = frozenset(
    [
        "data.train_batch_size", "data.max_response_length", "data.seed", "data.train_files", "data.val_files",
        "actor_rollout_ref.model.path",
        *(_ROLLOUT + k for k in ("n", "temperature", "top_p", "top_k", "dtype", "enable_rollout_routing_replay",
                                 "val_kwargs.n", "val_kwargs.temperature", "val_kwargs.do_sample")),
        *(_ACTOR + k for k in ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode",
                               "loss_scale_factor", "ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu",
                               "use_dynamic_bsz", "ppo_max_token_len_per_gpu",
                               "ppo_epochs", "shuffle", "use_kl_loss", "kl_loss_type", "kl_loss_coef",
                               "entropy_coeff", "optim.lr", "optim.betas", "optim.weight_decay", "optim.clip_grad",
                               "optim.optimizer", "optim.optimizer_impl", "optim.override_optimizer_config",
                               "optim.lr_warmup_steps_ratio", "optim.lr_warmup_steps", "optim.lr_scheduler_type",
                               "fsdp_config.router_replay._target_", "fsdp_config.router_replay.mode",
                               "policy_loss._target_", "policy_loss.loss_mode", "tau_pos", "tau_neg")),
        *(_ACTOR + "policy_loss." + k for k in PolicyLossConfig.__dataclass_fields__ if not k.startswith("_")),
        *(_ACTOR + "policy_loss.sat." + k for k in SatConfig.__dataclass_fields__ if not k.startswith("_")),
        "algorithm.adv_estimator", "algorithm.norm_adv_by_std_in_grpo",
        *(_CORRECTION + k for k in ("bypass_mode", "rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize",
                                    "rollout_rs", "rollout_rs_threshold", "loss_type")),
        "trainer.total_training_steps", "trainer.test_freq", "trainer.save_freq", "trainer.experiment_name",
        "trainer.project_name", "trainer.logger", "trainer.device", "trainer.val_before_train",
        "trainer.max_actor_ckpt_to_keep", "trainer.use_v1", "trainer.v1.trainer_mode",
        "trainer.v1.separate_async.num_warmup_batches", "trainer.v1.separate_async.parameter_sync_step",
        "trainer.v1.sampler.max_off_policy_threshold", "trainer.v1.sampler.max_off_policy_strategy",
        EVAL_EVERY_KEY,
    ]
)  # fmt: skip
CONFIG_GROUPS = ("recipe", "lag", "r3", "embedded", "radii")
# A re-run may change these and continue the run from its last checkpoint; any other change is refused.
EXTENSIBLE_KEYS = ("trainer.total_training_steps", "trainer.test_freq", "trainer.save_freq", "trainer.logger")
OUTCOME_ESTIMATORS = ("grpo", "grpo_passk", "grpo_vectorized", "rloo", "rloo_vectorized", "opo", "remax_free",
                      "reinforce_plus_plus_baseline")  # fmt: skip
SAT_LOSSES = ("sat", "sat_gspo")
ROLLOUT_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}  # rollout.dtype -> the rollout copy's dtype


class EmbeddedConfigError(ValueError):
    """A config the embedded engine cannot run as written; the message names the key."""


@dataclass(frozen=True)
class RunSettings:
    """What the embedded engine reads from the composed config, checked once."""

    schedule: LagSchedule  # which weights sample which batch
    total_steps: int  # trainer steps
    batch_prompts: int  # data.train_batch_size: prompts per trainer step
    n: int  # rollout.n
    max_response_length: int
    temperature: float
    val_n: int
    val_temperature: float
    val_do_sample: bool
    test_freq: int
    eval_every_optimizer_steps: int | None  # set: evaluate on this optimizer-step grid instead of test_freq
    save_freq: int
    val_before_train: bool
    keep_checkpoints: int
    seed: int
    device: str
    routing_replay: bool
    rollout_dtype: torch.dtype  # rollout.dtype: the rollout engine's copy of the weights (verl's default bfloat16)
    bypass_mode: bool
    rollout_correction: dict  # keyword arguments of verl's rollout-correction helper (decoupled mode)
    use_kl_loss: bool
    loggers: tuple[str, ...]
    project_name: str
    model_path: str
    train_file: str
    test_file: str
    run_dir: Path
    warnings: tuple[str, ...] = field(default=())  # the preflight's warnings, printed by `verl-sat train`

    @property
    def sync_steps(self) -> int:
        return self.schedule.sync_steps

    def __post_init__(self):
        for key, value in (
            ("data.train_batch_size", self.batch_prompts),
            ("actor_rollout_ref.rollout.n", self.n),
            ("trainer.total_training_steps", self.total_steps),
            ("data.max_response_length", self.max_response_length),
            ("actor_rollout_ref.rollout.val_kwargs.n", self.val_n),
        ):
            if not isinstance(value, int) or value < 1:
                raise EmbeddedConfigError(f"{key}={value!r} is invalid: expected a positive integer")
        if self.temperature <= 0:
            raise EmbeddedConfigError(f"actor_rollout_ref.rollout.temperature={self.temperature} must be > 0")
        every = self.eval_every_optimizer_steps
        if every is not None and (not isinstance(every, int) or every < 1):
            raise EmbeddedConfigError(f"{EVAL_EVERY_KEY}={every!r} is invalid: expected a positive integer or null")


def schedule_of(config: DictConfig) -> LagSchedule:
    """The lag regime of ``+lag=...``: verl's ``sync`` mode, or ``separate_async`` with ``num_warmup_batches``
    batches ahead and ``parameter_sync_step`` chunks per trainer step."""
    v1 = config.trainer.get("v1", {})
    mode = v1.get("trainer_mode", "sync")
    if mode == "sync":
        return LagSchedule(ahead=0, sync_steps=1)
    if mode != "separate_async":
        raise EmbeddedConfigError(
            f"trainer.v1.trainer_mode={mode!r} is not supported by the embedded engine: use +lag=sync, a paper lag "
            "(+lag=lag1, +lag=lag8) or a fixed lag (+lag=fixed8)"
        )
    ahead, sync_steps = v1.separate_async.num_warmup_batches, v1.separate_async.parameter_sync_step
    for key, value in (("num_warmup_batches", ahead), ("parameter_sync_step", sync_steps)):
        if not isinstance(value, int) or value < 1:
            raise EmbeddedConfigError(f"trainer.v1.separate_async.{key}={value!r}: expected a positive integer")
    bound = v1.sampler.max_off_policy_threshold
    if bound is not None and bound != ahead + 1:
        raise EmbeddedConfigError(
            f"trainer.v1.sampler.max_off_policy_threshold={bound} does not match "
            f"trainer.v1.separate_async.num_warmup_batches={ahead}: the embedded engine runs the rollout exactly "
            f"{ahead} batch(es) ahead, so every trajectory spans {ahead + 1} weight versions; set the threshold to "
            f"{ahead + 1} (as the +lag presets do)"
        )
    return LagSchedule(ahead=ahead, sync_steps=sync_steps)


def check_read_overrides(overrides: list[str]) -> None:
    """Refuse command-line overrides of keys the embedded engine does not read."""
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        if "." not in key:
            if key.split("@")[0] not in CONFIG_GROUPS:
                raise EmbeddedConfigError(f"config group {key!r} is not known to the embedded engine")
            continue
        if key not in READ_KEYS:
            raise EmbeddedConfigError(
                f"{key} is not read by the embedded engine (it would be ignored); run it on verl with "
                "`python -m verl_sat.main ...`, or see docs/local_engine.md for the keys the engine reads"
            )


def _check_values(config: DictConfig, overrides: list[str]) -> None:
    """Values of read keys that the engine cannot honour, each refused naming the key."""
    actor, rollout = config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout
    correction = config.algorithm.get("rollout_correction", {})
    loss_mode = actor.policy_loss.get("loss_mode", "vanilla")
    given = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    sat_keys = sorted(k for k in given if k.startswith(_ACTOR + "policy_loss.sat."))
    if sat_keys and loss_mode not in SAT_LOSSES:
        raise EmbeddedConfigError(f"{sat_keys[0]} is read only by the SAT losses, not loss_mode={loss_mode!r}")
    checks = [
        (rollout.get("top_p", 1.0) == 1.0, _ROLLOUT + "top_p", "1.0 (the engine samples everything)"),
        (rollout.get("top_k", -1) in (-1, 0, None), _ROLLOUT + "top_k", "-1 (the engine samples everything)"),
        (rollout.get("dtype", "bfloat16") in ROLLOUT_DTYPES, _ROLLOUT + "dtype", f"one of {list(ROLLOUT_DTYPES)}"),
        (actor.optim.get("lr_warmup_steps_ratio", 0.0) == 0.0, _ACTOR + "optim.lr_warmup_steps_ratio",
         "0 (the engine keeps the learning rate constant, as the paper's recipes do)"),
        ((actor.optim.get("lr_warmup_steps") or -1) <= 0, _ACTOR + "optim.lr_warmup_steps", "-1 or 0 (constant lr)"),
        (actor.optim.get("lr_scheduler_type", "constant") == "constant", _ACTOR + "optim.lr_scheduler_type",
         "constant"),
        (config.algorithm.adv_estimator in OUTCOME_ESTIMATORS, "algorithm.adv_estimator",
         f"one of {list(OUTCOME_ESTIMATORS)} (no critic)"),
        (correction.get("loss_type", "ppo_clip") == "ppo_clip", _CORRECTION + "loss_type", "ppo_clip"),
        (not (correction.get("bypass_mode", False) and (correction.get("rollout_is") or correction.get("rollout_rs"))),
         _CORRECTION + "rollout_is", "null in bypass mode (old_log_prob is the rollout's: the weights would be 1)"),
    ]  # fmt: skip
    loggers = [config.trainer.logger] if isinstance(config.trainer.logger, str) else list(config.trainer.logger)
    unknown = [name for name in loggers if name not in Tracking.supported_backend]
    if unknown:
        raise EmbeddedConfigError(f"trainer.logger={loggers}: {unknown[0]!r} is not one of verl's loggers "
                                  f"{Tracking.supported_backend}")  # fmt: skip
    for ok, key, expected in checks:
        if not ok:
            raise EmbeddedConfigError(f"{key}={OmegaConf.select(config, key)!r} is not supported by the embedded "
                                      f"engine: expected {expected}")  # fmt: skip


def _recipe_uses_r3(overrides: list[str]) -> bool:
    """Whether the chosen recipe, directly or through the recipes it builds on, includes the ``/r3`` group."""
    name = next((o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("recipe=")), None)
    while name is not None:
        path = files("verl_sat.recipes").joinpath("recipe", f"{name}.yaml")
        if not path.is_file():
            return False  # unknown recipe: Hydra reports it with the list of valid names
        defaults = OmegaConf.create(path.read_text()).get("defaults", [])
        if any(isinstance(entry, DictConfig) and "/r3" in entry for entry in defaults):
            return True
        name = next((entry for entry in defaults if isinstance(entry, str) and entry != "_self_"), None)
    return False


def engine_overrides(workdir: Path, overrides: list[str]) -> list[str]:
    """The overrides the engine composes: the user's config groups (recipe, lag, ...) and then the engine's defaults
    (which win over the recipe's cluster-scale values), R3 through verl-sat's own hooks (``r3=fsdp``), the workdir's
    files, a run name ``RECIPE-LAG-sSEED``, then the user's key=value overrides (which win over everything)."""
    given = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    groups = [o for o in overrides if "." not in o.lstrip("+~").split("=", 1)[0]]
    values = [o for o in overrides if o not in groups]
    out = [*groups, *([] if "embedded" in given else ["+embedded=default"])]
    if "r3" not in given and _recipe_uses_r3(overrides):
        out.append("r3=fsdp")
    for key, value in (
        ("actor_rollout_ref.model.path", workdir / "model"),
        ("data.train_files", workdir / "data" / "train.parquet"),
        ("data.val_files", workdir / "data" / "test.parquet"),
    ):
        if key not in given:
            out.append(f"{key}={value}")
    if "trainer.experiment_name" not in given:
        choice = {o.lstrip("+").split("=", 1)[0]: o.split("=", 1)[1] for o in overrides if "=" in o}
        seed = choice.get("data.seed", "0")
        out.append(f"trainer.experiment_name={choice.get('recipe', 'default')}-{choice.get('lag', 'sync')}-s{seed}")
    return [*out, *values]


def compose_train_config(workdir: str | Path, args: list[str]) -> tuple[DictConfig, RunSettings]:
    """Compose and check the config of ``verl-sat train``; errors name the key or the command that fixes them."""
    workdir = Path(workdir)
    flags, overrides = split_args(args)
    if flags:
        raise EmbeddedConfigError(f"{flags[0]} is not an option of verl-sat train (only key=value overrides)")
    check_read_overrides(overrides)
    try:
        config = compose_from_args(with_recipes_searchpath(engine_overrides(workdir, overrides)))
        with open_dict(config):
            del config["hydra"]  # the job config only, as verl's --cfg job prints it
        OmegaConf.resolve(config)  # as verl's main_ppo does; a resolver's error names its key
    except (HydraException, OmegaConfBaseException) as err:  # Hydra's message names the key or lists valid recipes
        raise EmbeddedConfigError(str(err)) from err
    try:
        warnings = tuple(check_config(config))
    except PreflightError as err:
        raise EmbeddedConfigError(str(err)) from err
    _check_values(config, overrides)
    device = config.trainer.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise EmbeddedConfigError(f"trainer.device={device!r} but no CUDA device is available; use trainer.device=cpu")
    model_path = Path(config.actor_rollout_ref.model.path)
    if model_path == workdir / "model":
        manifest = check_prepared(workdir)
        longest = manifest["spec"]["max_response_length"]
        if config.data.max_response_length < longest:
            raise EmbeddedConfigError(
                f"data.max_response_length={config.data.max_response_length} is shorter than the "
                f"{manifest.get('task', 'addition')!r} "
                f"task's responses in {workdir} (up to {longest} tokens): use +embedded=long_cot for the chain "
                "task, or raise data.max_response_length"
            )
    schedule = schedule_of(config)
    rollout, trainer, actor = config.actor_rollout_ref.rollout, config.trainer, config.actor_rollout_ref.actor
    batch, mini = config.data.train_batch_size, actor.ppo_mini_batch_size
    if schedule.sync_steps > 1 and batch != schedule.sync_steps * mini:
        raise EmbeddedConfigError(
            f"data.train_batch_size={batch} must equal trainer.v1.separate_async.parameter_sync_step="
            f"{schedule.sync_steps} x actor_rollout_ref.actor.ppo_mini_batch_size={mini} (as verl's separate-async "
            "trainer asserts)"
        )
    correction = config.algorithm.get("rollout_correction", {})
    settings = RunSettings(
        schedule=schedule,
        total_steps=trainer.total_training_steps,
        batch_prompts=batch,
        n=rollout.n,
        max_response_length=config.data.max_response_length,
        temperature=float(rollout.temperature),
        val_n=rollout.val_kwargs.n,
        val_temperature=float(rollout.val_kwargs.temperature),
        val_do_sample=bool(rollout.val_kwargs.do_sample),
        test_freq=trainer.test_freq,
        eval_every_optimizer_steps=OmegaConf.select(config, EVAL_EVERY_KEY),
        save_freq=trainer.save_freq,
        val_before_train=trainer.val_before_train,
        keep_checkpoints=trainer.max_actor_ckpt_to_keep or 1,
        seed=int(config.data.seed or 0),
        device=device,
        routing_replay=rollout.enable_rollout_routing_replay,
        rollout_dtype=ROLLOUT_DTYPES[rollout.get("dtype", "bfloat16")],
        bypass_mode=bool(correction.get("bypass_mode", False)),
        rollout_correction={
            key: correction.get(key)
            for key in (
                "rollout_is",
                "rollout_is_threshold",
                "rollout_is_batch_normalize",
                "rollout_rs",
                "rollout_rs_threshold",
            )
        },  # fmt: skip
        use_kl_loss=bool(actor.use_kl_loss),
        loggers=tuple([trainer.logger] if isinstance(trainer.logger, str) else trainer.logger),
        project_name=trainer.project_name,
        model_path=str(model_path),
        train_file=str(config.data.train_files),
        test_file=str(config.data.val_files),
        run_dir=workdir / "runs" / str(trainer.experiment_name),  # Hydra reads "1" or "nan" as numbers
        warnings=warnings,
    )
    return config, settings
