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
"""Rollout routing replay (R3) for Hugging Face MoE models.

The rollout engine's expert choices are replayed in the trainer's forward, while the trainer's own router still
produces the weights (its scores gathered at the replayed experts), so the router keeps learning::

    rr = RoutingReplay.attach(model)
    with rr.record() as rec:
        model(input_ids=..., attention_mask=...)
    routes = rec.routed_experts              # int16 [batch, seq, num_hidden_layers, top_k], verl's layout
    with rr.replay(routes):
        out = model(input_ids=..., attention_mask=...)
    rr.detach()

Routes are indexed by absolute decoder-layer index (dense layers keep zero rows); an all-zero row means "no
recorded route, route natively" (unambiguous for ``top_k >= 2``, where a real route names distinct experts; models
with ``top_k = 1`` are refused). Packed input (``[1, nnz]``) takes routes ``[nnz, num_layers, top_k]``.
Replaying the native routes reproduces the native forward bit for bit: each family's score rule is applied exactly
as its own router applies it.

Replay reads nothing back to the host per layer: routes are validated once per ``begin_replay`` on the device (a
route with an expert id out of range is routed natively and counted), flips are counted on the device, and
``replay_metrics`` reads both in one transfer and raises for an out-of-range id. A replayed forward in which an armed
MoE layer did not call its hooked router (a kernel patch that replaced the MoE block's forward, say) raises at
``end_replay``, naming the layer and the module that bypassed the hook.
"""

import re
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

ScoreRule = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def _softmax_then_gather(always_normalize: bool, cast_back: bool) -> ScoreRule:
    """Softmax over all experts (float32), gathered at the routes, renormalised (``norm_topk_prob``)."""

    def rule(router: nn.Module, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
        scores = probs.gather(1, indices)
        if always_normalize or router.norm_topk_prob:
            scores = scores / scores.sum(dim=-1, keepdim=True)
        return scores.to(logits.dtype) if cast_back else scores

    return rule


def _gather_then_softmax(router: nn.Module, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """GPT-OSS: softmax over the selected experts' logits only."""
    selected = logits.gather(1, indices)
    return torch.nn.functional.softmax(selected, dim=1, dtype=selected.dtype)


def _mixtral(router: nn.Module, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    scores = torch.nn.functional.softmax(logits.float(), dim=-1).gather(1, indices)
    return scores / scores.sum(dim=-1, keepdim=True)


# `*TopKRouter` modules return (logits, scores, indices); the rule recomputes `scores` for replayed indices.
TOPK_ROUTER_RULES: dict[str, ScoreRule] = {
    "Qwen2MoeTopKRouter": _softmax_then_gather(always_normalize=False, cast_back=True),
    "Qwen3MoeTopKRouter": _softmax_then_gather(always_normalize=False, cast_back=True),
    "Qwen3NextTopKRouter": _softmax_then_gather(always_normalize=False, cast_back=True),
    "OlmoeTopKRouter": _softmax_then_gather(always_normalize=False, cast_back=True),
    "Qwen3_5MoeTopKRouter": _softmax_then_gather(always_normalize=True, cast_back=True),
    "MixtralTopKRouter": _mixtral,
    "GptOssTopKRouter": _gather_then_softmax,
}
# MoE blocks that choose experts in `route_tokens_to_experts(router_logits)` (sigmoid, score bias, group top-k).
SIGMOID_GROUP_MOE_BLOCKS = ("DeepseekV3MoE", "Glm4MoeMoE")
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class RoutingReplayError(ValueError):
    """Routes that do not fit the model or the input, or a model whose routers are not supported."""


@dataclass
class _RouterSlot:
    """One router (or MoE block) of decoder layer ``layer``: its replay targets and recorded routes."""

    layer: int
    num_experts: int
    top_k: int
    name: str  # the router's (or block's) module path, for errors
    kind: str  # its family's class name (a key of TOPK_ROUTER_RULES or one of SIGMOID_GROUP_MOE_BLOCKS)
    targets: torch.Tensor | None = None  # [N, top_k] long, replayed in this forward (and its recompute)


@dataclass
class Recording:
    """Routes chosen by the forward(s) run inside ``RoutingReplay.record()``."""

    num_layers: int
    top_k: int
    token_shape: tuple[int, ...] = ()
    per_layer: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def routed_experts(self) -> torch.Tensor:
        """int16 ``[*token_shape, num_hidden_layers, top_k]``; layers without a router keep zero rows."""
        if not self.per_layer:
            raise RoutingReplayError("nothing was recorded: run the model inside `with rr.record():`")
        first = next(iter(self.per_layer.values()))
        routes = torch.zeros(first.shape[0], self.num_layers, self.top_k, dtype=torch.int16, device=first.device)
        for layer, chosen in self.per_layer.items():
            routes[:, layer] = chosen
        return routes.reshape(*self.token_shape, self.num_layers, self.top_k)


class RoutingReplay:
    """Record and replay the expert choices of every router of a Hugging Face MoE model (see module docstring).

    Attach once; hooks cost one Python call per router per forward and change nothing outside ``record()`` or
    ``replay()``. Under gradient checkpointing the backward recompute of a replayed forward replays the same routes.
    """

    def __init__(self, model: nn.Module, slots: dict[nn.Module, _RouterSlot], num_layers: int):
        self.model = model
        self.num_layers = num_layers
        self._slots = slots
        self._mode = "native"
        self._recording: Recording | None = None
        self._flips: torch.Tensor | int = 0  # on the device: (token, layer) routes whose native top-k set differs
        self._compared: torch.Tensor | int = 0  # on the device: (token, layer) routes replayed
        self._invalid: torch.Tensor | int = 0  # on the device: (token, layer) routes with an expert id out of range
        self._layers_replayed: set[int] = set()
        self._handles: list = []
        top_ks = {slot.top_k for slot in slots.values()}
        if len(top_ks) != 1:
            raise RoutingReplayError(f"routers disagree on top_k: {sorted(top_ks)}")
        self.top_k = top_ks.pop()
        if self.top_k < 2:
            raise RoutingReplayError(
                f"routing replay needs top_k >= 2, but {type(model).__name__} routes each token to {self.top_k} "
                "expert: in verl's routed_experts layout an all-zero row means 'no recorded route', which with "
                "top_k = 1 cannot be told from 'expert 0'"
            )
        self._expert_limits: dict[torch.device, torch.Tensor] = {}  # per device, see _limits_on

    # ---- construction ------------------------------------------------------------------------------------------
    @classmethod
    def attach(cls, model: nn.Module) -> "RoutingReplay":
        """Find every router of ``model`` and hook it. Raises ``RoutingReplayError`` for unsupported families."""
        config = getattr(model, "config", None)
        num_layers = getattr(getattr(config, "get_text_config", lambda: config)(), "num_hidden_layers", None)
        if num_layers is None:
            raise RoutingReplayError("the model's config has no num_hidden_layers; routes are indexed by layer")
        slots: dict[nn.Module, _RouterSlot] = {}
        unsupported = []
        for name, module in model.named_modules():
            kind = _family(module)
            if kind in SIGMOID_GROUP_MOE_BLOCKS:
                slots[module] = _RouterSlot(_layer_of(name), module.n_routed_experts, module.top_k, name, kind)
            elif kind in TOPK_ROUTER_RULES:
                slots[module] = _RouterSlot(_layer_of(name), module.num_experts, module.top_k, name, kind)
            elif kind.endswith(("TopKRouter", "TopkRouter")) and not _inside_supported_block(name, model):
                unsupported.append(f"{name} ({kind})")
        if unsupported:
            raise RoutingReplayError(
                f"routing replay does not support these routers: {unsupported}; supported: "
                f"{sorted(TOPK_ROUTER_RULES)} and the MoE blocks {list(SIGMOID_GROUP_MOE_BLOCKS)}"
            )
        if not slots:
            raise RoutingReplayError(
                f"no MoE router found in {type(model).__name__}; supported: {sorted(TOPK_ROUTER_RULES)} and the MoE "
                f"blocks {list(SIGMOID_GROUP_MOE_BLOCKS)}"
            )
        replay = cls(model, slots, num_layers)
        replay._install()
        return replay

    def _install(self) -> None:
        self._handles.append(self.model.register_forward_pre_hook(self._capture_token_shape, with_kwargs=True))
        for module, slot in self._slots.items():
            if slot.kind in SIGMOID_GROUP_MOE_BLOCKS:
                module.route_tokens_to_experts = types.MethodType(self._routed_sigmoid_group, module)
            else:
                self._handles.append(module.register_forward_hook(self._routed_topk))

    def detach(self) -> None:
        """Remove every hook: the model routes natively again."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module in self._slots:
            module.__dict__.pop("route_tokens_to_experts", None)

    # ---- public contexts ---------------------------------------------------------------------------------------
    @contextmanager
    def record(self) -> Iterator[Recording]:
        """Record the routes chosen natively by the forward(s) inside the context."""
        self._recording = Recording(self.num_layers, self.top_k)
        self._mode = "record"
        try:
            yield self._recording
        finally:
            self._mode = "native"
            self._recording = None

    @contextmanager
    def replay(self, routed_experts: torch.Tensor) -> Iterator["RoutingReplay"]:
        """Replay ``routed_experts`` (``[batch, seq, L, top_k]`` or packed ``[nnz, L, top_k]``) in the forward(s)
        inside the context, and in their recompute under gradient checkpointing."""
        self.begin_replay(routed_experts)
        try:
            yield self
        except BaseException:
            self.end_replay(check=False)  # the forward's own error, not a second one
            raise
        self.end_replay()

    def begin_replay(self, routed_experts: torch.Tensor) -> None:
        """Arm replay of ``routed_experts`` for the next forward(s) (``replay()`` without the context). They must lie on
        the device the routers compute on, which the first replayed layer checks (not the parameters' device: FSDP1
        without ``use_orig_params`` leaves routers with no parameters, FSDP2's ``offload_policy`` keeps them on the
        host). Expert ids are checked on that device; ``replay_metrics`` raises for one out of range."""
        targets = self._checked_routes(routed_experts)
        for slot in self._slots.values():
            slot.targets = targets[:, slot.layer]
        self._flips, self._compared, self._layers_replayed = 0, 0, set()
        self._mode = "replay"

    def end_replay(self, check: bool = True) -> None:
        """Back to native routing; the targets stay for a backward recompute until the next native forward.

        With ``check``, raise ``RoutingReplayError`` when a router armed by ``begin_replay`` was not called by the
        forward(s) since (its layer trained with its own routing under R3), naming the layer and the MoE block."""
        self._mode = "native"
        if not check:
            return
        bypassed = [slot for slot in self._slots.values() if slot.layer not in self._layers_replayed]
        if bypassed:
            slot = bypassed[0]
            if slot.kind in SIGMOID_GROUP_MOE_BLOCKS:
                what = f"the MoE block {slot.name} ({slot.kind}) did not call its route_tokens_to_experts"
            else:
                block = slot.name.rsplit(".", 1)[0]
                what = (f"the MoE block {block} ({type(self.model.get_submodule(block)).__name__}) did not call its "
                        f"router {slot.name} ({slot.kind})")  # fmt: skip
            raise RoutingReplayError(
                f"routing replay was armed for {len(self._slots)} MoE layers, but in layer {slot.layer} {what}, so "
                f"the layer routed natively under R3 (layers not replayed: {sorted(s.layer for s in bypassed)}). "
                "A kernel or patch that replaces the MoE block's forward (Liger, NPU, a fused MoE kernel) bypasses "
                "the hook: turn it off for routing replay, or set router_replay.mode=disabled"
            )

    def replay_metrics(self) -> dict[str, float]:
        """Of the last replay: fraction of (token, layer) routes where the trainer's native top-k set differs from
        the replayed one, and the number of layers replayed. The one host read of a replay; raises
        ``RoutingReplayError`` when the replayed routes held an expert id out of range."""
        flips, compared, invalid = 0, 0, 0
        if torch.is_tensor(self._compared):  # a layer replayed
            flips, compared, invalid = torch.stack([self._flips, self._compared, self._invalid]).tolist()
        if invalid:
            raise RoutingReplayError(
                f"routed_experts held {invalid} (token, layer) routes with an expert id outside [0, num_experts) of "
                f"their MoE layer (experts per layer: {self._experts_by_layer()}); they were routed natively"
            )
        return {
            "actor/r3_route_flip_frac": flips / compared if compared else 0.0,
            "actor/r3_layers_replayed": float(len(self._layers_replayed)),
        }

    # ---- hooks -------------------------------------------------------------------------------------------------
    def _capture_token_shape(self, module, args, kwargs) -> None:
        if self._recording is None:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs["inputs_embeds"][..., 0]
        self._recording.token_shape = tuple(ids.shape)

    def _routed_topk(self, router: nn.Module, args, output):
        logits, scores, native = output
        indices = self._choose(router, native)
        if indices is native:
            return output
        return logits, TOPK_ROUTER_RULES[self._slots[router].kind](router, logits, indices), indices

    def _routed_sigmoid_group(self, block: nn.Module, router_logits: torch.Tensor):
        native, weights = type(block).route_tokens_to_experts(block, router_logits)
        indices = self._choose(block, native)
        if indices is native:
            return native, weights
        scores = router_logits.sigmoid().gather(1, indices)
        if block.norm_topk_prob:
            scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        return indices, scores * block.routed_scaling_factor

    def _choose(self, module: nn.Module, native: torch.Tensor) -> torch.Tensor:
        """The indices this router uses now: the replayed targets (native on all-zero rows) or its own. Nothing here
        reads the device: the flip counts stay there until ``replay_metrics``."""
        slot = self._slots[module]
        in_backward = torch._C._current_graph_task_id() != -1  # a gradient-checkpointing recompute
        if self._mode == "record" and not in_backward:
            self._recording.per_layer[slot.layer] = native.to(torch.int16)
        if slot.targets is None or (self._mode != "replay" and not in_backward):
            slot.targets = None  # a native forward: earlier targets no longer belong to any pending backward
            return native
        targets = slot.targets
        if targets.device != native.device:  # the device the layer computes on, whatever holds its parameters
            raise RoutingReplayError(
                f"routed_experts are on {targets.device} but layer {slot.layer} routes on {native.device}: move them "
                "with the micro-batch"
            )
        if targets.shape[0] != native.shape[0]:
            raise RoutingReplayError(
                f"routes cover {targets.shape[0]} tokens but layer {slot.layer} routes {native.shape[0]}: pass "
                "routes [batch, seq, L, top_k] for padded input or [nnz, L, top_k] for packed input"
            )
        no_route = (targets == 0).all(dim=-1, keepdim=True)
        indices = torch.where(no_route, native, targets)
        if not in_backward:
            with torch.no_grad():
                replayed = ~no_route.squeeze(-1)
                # top-k sets of distinct experts: equal when every native expert is among the replayed ones
                same = (native.unsqueeze(-1) == indices.unsqueeze(-2)).any(dim=-1).all(dim=-1)
                self._flips = self._flips + torch.count_nonzero(replayed & ~same)
                self._compared = self._compared + torch.count_nonzero(replayed)
                self._layers_replayed.add(slot.layer)
        return indices

    # ---- validation --------------------------------------------------------------------------------------------
    def _checked_routes(self, routes: torch.Tensor) -> torch.Tensor:
        """``routes`` as int64 ``[N, num_layers, top_k]``; the shape is checked here, the expert ids on the device."""
        if routes.dim() < 3 or routes.shape[-2] != self.num_layers or routes.shape[-1] != self.top_k:
            raise RoutingReplayError(
                f"routed_experts has shape {tuple(routes.shape)}; expected [..., num_hidden_layers="
                f"{self.num_layers}, top_k={self.top_k}]"
            )
        flat = routes.reshape(-1, self.num_layers, self.top_k).long()
        # rows with an expert id outside [0, num_experts) of their layer: routed natively, counted on the device and
        # refused by replay_metrics (a device-side assert would leave the CUDA context unusable, without the message)
        valid = torch.logical_and(flat >= 0, flat < self._limits_on(flat.device)).all(dim=-1, keepdim=True)
        self._invalid = torch.count_nonzero(~valid)
        return torch.where(valid, flat, 0)

    def _limits_on(self, device: torch.device) -> torch.Tensor:
        """int64 ``[num_layers, 1]`` on ``device``: the exclusive upper bound of a valid expert id per decoder layer
        (layers without a router: any). Built there once, by fills: a copy from the host would sync on CUDA."""
        if device not in self._expert_limits:
            limits = torch.full((self.num_layers, 1), torch.iinfo(torch.int64).max, dtype=torch.int64, device=device)
            for slot in self._slots.values():
                limits[slot.layer].fill_(slot.num_experts)
            self._expert_limits[device] = limits
        return self._expert_limits[device]

    def _experts_by_layer(self) -> dict[int, int]:
        return {slot.layer: slot.num_experts for slot in sorted(self._slots.values(), key=lambda s: s.layer)}


def _layer_of(module_name: str) -> int:
    match = _LAYER_INDEX.search(module_name)
    if match is None:
        raise RoutingReplayError(f"cannot tell the decoder layer of router {module_name!r}")
    return int(match.group(1))


def _inside_supported_block(name: str, model: nn.Module) -> bool:
    """A router inside a supported MoE block (e.g. DeepSeek-V3's ``gate``) is replayed through its block."""
    parent = name.rsplit(".", 1)[0] if "." in name else ""
    return _family(model.get_submodule(parent)) in SIGMOID_GROUP_MOE_BLOCKS


def _family(module: nn.Module) -> str:
    """The class name that decides how ``module`` routes: the first supported family in its class hierarchy (PEFT's
    LoRA on a router's weight runs the router as a ``torch.nn.utils.parametrize`` subclass,
    ``Parametrized<Router>``), else its own class name."""
    for cls in type(module).__mro__:
        if cls.__name__ in TOPK_ROUTER_RULES or cls.__name__ in SIGMOID_GROUP_MOE_BLOCKS:
            return cls.__name__
    return type(module).__name__
