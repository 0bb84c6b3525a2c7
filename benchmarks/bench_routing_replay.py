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
"""Routing replay (R3): overhead of replay against native routing, and what replay does to the train-inference gap.

1. Forward + backward time of a small Qwen3-MoE model (4 layers, 16 experts, top-2, 2k tokens), replaying recorded
   routes against native routing, interleaved in one run; prints the ratio of medians (target <= 1.10x).
2. On tiny random Qwen3-MoE, Mixtral and DeepSeek-V3 models with a "rollout" copy (bf16, or router weights
   perturbed): fraction of (token, layer) routes the trainer would flip, and the mean |log-prob gap| of the sampled
   tokens between rollout and trainer with native routing and with replay.

    python benchmarks/bench_routing_replay.py [--repeats 15] [--device cpu|cuda]
"""

import argparse
import copy
import statistics
import time

import torch
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from verl_sat.routing_replay import RoutingReplay


def _qwen3_moe(layers, experts, hidden, vocab=512):
    config = Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                            moe_intermediate_size=hidden // 2, num_hidden_layers=layers, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=hidden // 4, num_experts=experts, num_experts_per_tok=2,
                            norm_topk_prob=True)  # fmt: skip
    return Qwen3MoeForCausalLM(config)


def _tiny(family):
    common = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_experts_per_tok=2)
    if family == "qwen3_moe":
        return _qwen3_moe(3, 8, 32, vocab=64)
    if family == "mixtral":
        return MixtralForCausalLM(MixtralConfig(**common, intermediate_size=32, num_hidden_layers=3,
                                                num_key_value_heads=2, head_dim=8, num_local_experts=8))  # fmt: skip
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**common, intermediate_size=64, moe_intermediate_size=16,
                                                   num_hidden_layers=3, num_key_value_heads=4, n_routed_experts=8,
                                                   n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=None,
                                                   kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                                   v_head_dim=8, n_shared_experts=1))  # fmt: skip
    for module in model.modules():
        if type(module).__name__ == "DeepseekV3TopkRouter":
            torch.nn.init.normal_(module.weight, std=0.5)
    return model


def _log_probs(model, ids):
    logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


# (layers, experts, hidden, tokens): the CPU bench's small model; gpu_check.py times a mid-size one
SMALL = (4, 16, 128, 2048)


def overhead(repeats: int, device: str, layers: int = 4, experts: int = 16, hidden: int = 128, tokens: int = 2048):
    """Median forward + backward ms of a Qwen3-MoE (top-2 of ``experts``, built from a config) on ``tokens`` tokens,
    native routing and replay of its recorded routes, interleaved: ``(native_ms, replay_ms)``."""
    torch.manual_seed(0)
    model = _qwen3_moe(layers=layers, experts=experts, hidden=hidden).to(device)
    ids = torch.randint(0, 512, (4, tokens // 4), device=device)
    rr = RoutingReplay.attach(model)
    with torch.no_grad(), rr.record() as rec:
        model(input_ids=ids)
    routes = rec.routed_experts

    def step(replay: bool) -> float:
        model.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if replay:
            with rr.replay(routes):
                loss = model(input_ids=ids, labels=ids).loss
        else:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    times = {False: [], True: []}
    for _ in range(2):
        step(False), step(True)
    for _ in range(repeats):
        for replay in (False, True):
            times[replay].append(step(replay))
    return tuple(statistics.median(times[k]) * 1e3 for k in (False, True))


def print_overhead(device: str, repeats: int, sizes=SMALL) -> float:
    """Print the overhead table row; return the ratio replay / native."""
    layers, experts, hidden, tokens = sizes
    native, replay = overhead(repeats, device, layers, experts, hidden, tokens)
    print(f"device={device} threads={torch.get_num_threads()} repeats={repeats}")
    print("| model | tokens | native ms | replay ms | ratio |\n|---|---:|---:|---:|---:|")
    print(f"| Qwen3-MoE {layers} layers, {experts} experts, top-2, hidden {hidden} | {tokens} | {native:.1f} | "
          f"{replay:.1f} | {replay / native:.3f}x |")  # fmt: skip
    return replay / native


def gap_table() -> None:
    print("\n| family | rollout copy | flip frac | mean abs log-prob gap, native | with replay |")
    print("|---|---|---:|---:|---:|")
    ids = torch.randint(0, 64, (16, 64), generator=torch.Generator().manual_seed(0))
    for family in ("qwen3_moe", "mixtral", "deepseek_v3"):
        for kind in ("bf16", "perturbed"):
            torch.manual_seed(0)
            trainer = _tiny(family)
            rollout = copy.deepcopy(trainer)
            if kind == "bf16":
                rollout = rollout.to(torch.bfloat16)
            else:
                with torch.no_grad():
                    for name, param in rollout.named_parameters():
                        if name.endswith("gate.weight"):
                            param.add_(torch.randn_like(param) * 0.3 * param.std())
            with torch.no_grad(), RoutingReplay.attach(rollout).record() as rec:
                rollout_lp = _log_probs(rollout, ids)
            rr = RoutingReplay.attach(trainer)
            with torch.no_grad():
                native_lp = _log_probs(trainer, ids)
                with rr.replay(rec.routed_experts):
                    replay_lp = _log_probs(trainer, ids)
            flips = rr.replay_metrics()["actor/r3_route_flip_frac"]
            gap_native = (native_lp - rollout_lp).abs().mean().item()
            gap_replay = (replay_lp - rollout_lp).abs().mean().item()
            print(f"| {family} | {kind} | {flips:.4f} | {gap_native:.5f} | {gap_replay:.5f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    print_overhead(args.device, args.repeats)
    gap_table()


if __name__ == "__main__":
    main()
