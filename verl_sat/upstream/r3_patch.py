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
"""Patch 2 of the upstream series: rollout routing replay (R3) in verl's FSDP engine, generated from verl-sat's source.

- ``verl/models/transformers/router_replay.py``: ``verl_sat/routing_replay.py`` as it is (model-level record and
  replay for Hugging Face MoE models, pure torch);
- ``verl/workers/engine/fsdp/transformer_impl.py``: ``micro_batch_routes`` and the three routing-replay hooks of
  ``verl_sat.fsdp_engine.RoutingReplayFSDPEngine`` copied into ``FSDPEngineWithLMHead``, called where the plugin's
  overrides call them (after the inputs are packed, before the outputs are read, on the step's metrics), as the
  VeOmni engine arms its replay;
- ``verl/trainer/config/engine/fsdp.yaml``: a ``router_replay`` block (verl's ``EngineRouterReplayConfig``);
- ``verl/workers/config/actor.py``: ``FSDPActorConfig`` refuses what the FSDP engine cannot replay, as
  ``VeOmniActorConfig`` does.
"""

import ast
import builtins
import inspect

import verl_sat.fsdp_engine
import verl_sat.routing_replay
from verl_sat.fsdp_engine import RoutingReplayFSDPEngine
from verl_sat.upstream.edit import (
    UpstreamDriftError,
    definitions_source,
    insert_after,
    insert_before,
    methods_source,
    replace_once,
    standalone_source,
    top_level_names,
)

ROUTER_REPLAY = "verl/models/transformers/router_replay.py"
FSDP_ENGINE = "verl/workers/engine/fsdp/transformer_impl.py"
FSDP_YAML = "verl/trainer/config/engine/fsdp.yaml"
ACTOR_CONFIG = "verl/workers/config/actor.py"
ENGINE_WORKERS = "verl/workers/engine_workers.py"
# verl's worker sets the per-call enable_routing_replay flag from the actor's router_replay mode for Megatron and
# VeOmni only; the patch adds the FSDP strategies, so every worker call carries the flag, and the engine replays only
# when both it and router_replay.mode=R3 say so (the plugin, on an unpatched worker, replays where no flag is set)
WORKER_ANCHOR = "            rr_mode = self.config.actor.veomni.router_replay.mode\n"
WORKER_FSDP_MODE = (
    '        elif actor_strategy in ("fsdp", "fsdp2"):\n'
    "            rr_mode = self.config.actor.fsdp_config.router_replay.mode\n"
)
FLAG_ATTRIBUTE = "_routing_replay_without_flag"
UPSTREAM_FLAG_DEFAULT = f"{FLAG_ATTRIBUTE}: bool = False  # verl's worker sets enable_routing_replay on every call"
WIDTH = 120  # verl's ruff line length
HOOKS = ("_prepare_router_replay_inputs", "_end_router_replay", "_add_router_replay_metrics")
# (the plugin override, the call it makes, the same call in verl's method, verl's anchor, where the call goes)
HOOK_CALLS = (
    (
        "prepare_model_inputs",
        "self._prepare_router_replay_inputs(micro_batch, output_args)",
        "self._prepare_router_replay_inputs(micro_batch, output_args)",
        "        model_inputs.update(extra_args)\n",
        "after",
    ),
    (
        "prepare_model_outputs",
        "self._end_router_replay()",
        "self._end_router_replay()",
        "    def prepare_model_outputs(self, output, output_args, micro_batch: TensorDict, logits_processor_func):\n"
        "        use_remove_padding = tu.get_non_tensor_data("
        'data=micro_batch, key="use_remove_padding", default=True)\n'
        "        pad_mode = tu.get_non_tensor_data("
        'data=micro_batch, key="pad_mode", default=DatasetPadMode.NO_PADDING)\n'
        "        use_fused_kernels",
        "first line",
    ),
    (
        "forward_step",
        'self._add_router_replay_metrics(output["metrics"])',
        "self._add_router_replay_metrics(metrics)",  # verl's forward_step builds `output` from `metrics` after this
        "            # Detach before this lands in forward_backward_batch's output_lst; see detach_tree.\n",
        "before",
    ),
)
LMHEAD_CLASS = "class FSDPEngineWithLMHead(FSDPEngine):\n"
VALUE_HEAD_REGISTRATION = (
    '\n\n@EngineRegistry.register(model_type="value_model", backend=["fsdp", "fsdp2"], device=["cuda", "npu"])\n'
)
FSDP_YAML_BLOCK = """
# Rollout routing replay (R3) for Hugging Face MoE models (verl.models.transformers.router_replay)
router_replay:

  # Target dataclass for this configuration
  _target_: verl.workers.config.EngineRouterReplayConfig

  # Router replay mode: disabled or R3 (the FSDP engine has no R2)
  # - R3: replay the experts the rollout engine chose (``routed_experts``) in the actor's
  #       compute_log_prob and update forwards, while the router still computes the weights.
  #       Requires ``rollout.enable_rollout_routing_replay=True`` and ``model.use_remove_padding=True``.
  mode: disabled
"""
ACTOR_VALIDATION = """
        # Rollout routing replay (R3) under FSDP, as VeOmniActorConfig checks it for VeOmni
        router_replay = self.fsdp_config.router_replay
        if router_replay.mode not in ("disabled", "R3"):
            raise ValueError(
                f"actor_rollout_ref.actor.fsdp_config.router_replay.mode={router_replay.mode!r}: the FSDP engine "
                "replays the rollout engine's routes (R3) only; set mode=R3 or disabled"
            )
        if router_replay.mode == "R3" and self.strategy == "fsdp_turbo":
            raise ValueError(
                "actor_rollout_ref.actor.strategy='fsdp_turbo' has no routing replay: use strategy=fsdp2, or set "
                "actor_rollout_ref.actor.fsdp_config.router_replay.mode=disabled"
            )
        if router_replay.mode == "R3" and not self.use_remove_padding:
            raise ValueError(
                "actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3 replays routes on packed inputs: set "
                "actor_rollout_ref.model.use_remove_padding=True"
            )
"""


def r3_changes(read) -> dict[str, str]:
    """The new text of every file patch 2 touches (``read(path)``: the file as patch 1 left it)."""
    return {
        ROUTER_REPLAY: standalone_source(verl_sat.routing_replay),
        FSDP_ENGINE: _fsdp_engine(read(FSDP_ENGINE)),
        ENGINE_WORKERS: insert_after(read(ENGINE_WORKERS), WORKER_ANCHOR, WORKER_FSDP_MODE, ENGINE_WORKERS),
        FSDP_YAML: read(FSDP_YAML).rstrip("\n") + "\n" + FSDP_YAML_BLOCK,
        ACTOR_CONFIG: insert_after(
            read(ACTOR_CONFIG), '        object.__setattr__(self.engine, "strategy", self.strategy)\n',
            ACTOR_VALIDATION, ACTOR_CONFIG,
        ),
    }  # fmt: skip


def _fsdp_engine(text: str) -> str:
    routes_fn = definitions_source(verl_sat.fsdp_engine, ["micro_batch_routes"])
    hooks = methods_source(RoutingReplayFSDPEngine, list(HOOKS))
    attribute = _class_attribute(RoutingReplayFSDPEngine, "_routing_replay")
    _class_attribute(RoutingReplayFSDPEngine, FLAG_ATTRIBUTE)  # the hooks read it: it must still exist
    text = insert_after(text, "from verl.models.transformers.monkey_patch import apply_monkey_patch\n",
                        "from verl.models.transformers.router_replay import RoutingReplay\n", FSDP_ENGINE)  # fmt: skip
    text = replace_once(text, "    set_ulysses_sequence_parallel_group,\n    ulysses_pad,\n",
                        "    set_ulysses_sequence_parallel_group,\n    slice_input_tensor,\n    ulysses_pad,\n",
                        FSDP_ENGINE)  # fmt: skip
    text = insert_before(text, "class FSDPEngine(BaseEngine):\n", routes_fn + "\n\n\n", FSDP_ENGINE)
    text = insert_after(text, LMHEAD_CLASS, f"    {attribute}\n    {UPSTREAM_FLAG_DEFAULT}\n\n", FSDP_ENGINE)
    divider = "    # ---- rollout routing replay (R3) "
    divider += "-" * (WIDTH - len(divider))
    text = insert_before(text, VALUE_HEAD_REGISTRATION, f"\n{divider}\n\n{hooks}\n", FSDP_ENGINE)
    for override, plugin_call, call, anchor, place in HOOK_CALLS:
        if plugin_call not in inspect.getsource(getattr(RoutingReplayFSDPEngine, override)):
            raise UpstreamDriftError(f"RoutingReplayFSDPEngine.{override} no longer calls {plugin_call}")
        indent = anchor[: len(anchor) - len(anchor.lstrip(" "))]
        if place == "after":
            text = insert_after(text, anchor, f"{indent}{call}\n", FSDP_ENGINE)
        elif place == "before":
            text = insert_before(text, anchor, f"{indent}{call}\n\n", FSDP_ENGINE)
        else:  # the first line of the method the anchor opens
            head, rest = anchor.split("\n", 1)
            text = replace_once(text, anchor, f"{head}\n        {call}\n{rest}", FSDP_ENGINE)
    unbound = _free_names(routes_fn + "\n" + "\n".join(line[4:] for line in hooks.splitlines())) - top_level_names(text)
    if unbound:
        raise UpstreamDriftError(f"the copied routing-replay code uses {sorted(unbound)}, which {FSDP_ENGINE} lacks")
    return text


def _class_attribute(cls: type, name: str) -> str:
    """The source line of the annotated class attribute ``name`` of ``cls``."""
    for line in inspect.getsource(cls).splitlines():
        if line.strip().startswith(f"{name}:"):
            return line.strip()
    raise UpstreamDriftError(f"{cls.__qualname__} has no annotated attribute {name}")


def _free_names(code: str) -> set[str]:
    """Names the code reads at module level scope: loaded names minus those it binds (arguments, locals)."""
    tree = ast.parse(code)
    loaded = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    stored = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    args = {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments) for a in [*n.args, *n.kwonlyargs]}
    return loaded - stored - args - set(dir(builtins))
