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
"""Side by side: the SAT losses against verl's own, ``sat`` vs ``vanilla`` and ``sat_gspo`` (the paper's sequence
scores, the carried quantile ``granularity=sequence_carried``, and per-token scores, ``token`` and
``token_ratio_side``) vs ``gspo``.

For each shape, forward + backward of the registered losses on one micro-batch, timed in the same run, interleaved
call by call on the same stale inputs (Python's GC off while timing); prints the medians and the ratio of medians.
Then the host reads and CUDA-syncing operators per call of each loss (``verl_sat.op_audit``), on every SAT granularity
and quantile method.

    python benchmarks/bench_losses.py [--device cpu|cuda] [--dtype float32 bfloat16] [--repeats 100]
"""

import argparse
import gc
import statistics
import time

import torch
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.workers.config import FSDPActorConfig

from verl_sat.config import SatConfig, SatPolicyLossConfig
from verl_sat.op_audit import CudaOpAudit
from verl_sat.sat_math import GRANULARITIES

SHAPES = [(8, 4096), (32, 8192), (64, 16384)]
# (SAT loss, its granularity, verl's counterpart, loss_agg_mode)
PAIRS = [("sat", "sequence", "vanilla", "token-mean"), ("sat_gspo", "sequence", "gspo", "seq-mean-token-mean"),
         ("sat_gspo", "token", "gspo", "seq-mean-token-mean"),
         ("sat_gspo", "token_ratio_side", "gspo", "seq-mean-token-mean"),
         ("sat_gspo", "sequence_carried", "gspo", "seq-mean-token-mean")]  # fmt: skip
SYNC_TARGET = 0  # no more host reads than verl's own loss, and no syncing operator
RATIO_TARGET = {"cpu": 1.5, "cuda": 1.2}


def _inputs(batch: int, length: int, dtype: torch.dtype, device: str):
    """Heavy-tailed stale log-ratios (Student-t, df 2, scale 0.1), per-sequence advantages, ragged masks."""
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(batch, length, generator=gen) * 4
    student = torch.distributions.StudentT(torch.tensor(2.0))
    log_ratio = student.sample((batch, length)).clamp(-10, 10) * 0.1
    adv = torch.randn(batch, 1, generator=gen).expand(batch, length).contiguous()
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=gen)
    mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    return [t.to(device) for t in (old.to(dtype), (old + log_ratio).to(dtype), adv.to(dtype), mask)]


def _config(loss_mode: str, sat: SatConfig | None = None) -> FSDPActorConfig:
    policy_loss = SatPolicyLossConfig(loss_mode=loss_mode, sat=sat or SatConfig())
    return FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, policy_loss=policy_loss)


def _call(name, inputs, agg, config):
    old, log_prob, adv, mask = inputs
    lp = log_prob.detach().requires_grad_()
    loss, metrics = get_policy_loss_fn(name)(old, lp, adv, mask, agg, config)
    loss.backward()
    return metrics


def _time_once(name, inputs, agg, config, device) -> float:
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _call(name, inputs, agg, config)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    _call(name, inputs, agg, config)
    return time.perf_counter() - t0


def time_pairs(device: str, dtypes: list[str], repeats: int, shapes=SHAPES, rows: list | None = None) -> float:
    """Print the timing table; return the worst ratio (and append each row to ``rows``, when given)."""
    print("| loss vs verl | dtype | shape (B x T) | verl median ms | SAT median ms | ratio |")
    print("|---|---|---|---:|---:|---:|")
    worst = 0.0
    for dtype_name in dtypes:
        for batch, length in shapes:
            inputs = _inputs(batch, length, getattr(torch, dtype_name), device)
            for sat_name, granularity, verl_name, agg in PAIRS:
                configs = {sat_name: _config(sat_name, SatConfig(granularity=granularity)),
                           verl_name: _config(verl_name)}  # fmt: skip
                times = {sat_name: [], verl_name: []}
                gc.collect()
                gc.disable()
                try:
                    for i in range(repeats + 5):  # 5 warm-up rounds; interleaved so that machine noise hits both
                        for name, config in configs.items():
                            elapsed = _time_once(name, inputs, agg, config, device)
                            if i >= 5:
                                times[name].append(elapsed)
                finally:
                    gc.enable()
                sat_ms = statistics.median(times[sat_name]) * 1e3
                verl_ms = statistics.median(times[verl_name]) * 1e3
                ratio = sat_ms / verl_ms
                worst = max(worst, ratio)
                if rows is not None:
                    rows.append({"loss": sat_name, "granularity": granularity, "verl": verl_name, "dtype": dtype_name,
                                 "batch": batch, "length": length, "verl_ms": verl_ms, "sat_ms": sat_ms,
                                 "ratio": ratio})  # fmt: skip
                label = sat_name if sat_name == "sat" else f"{sat_name} ({granularity})"
                print(f"| {label} vs {verl_name} | {dtype_name} | {batch} x {length} | {verl_ms:.2f} | {sat_ms:.2f} "
                      f"| {ratio:.2f}x |", flush=True)  # fmt: skip
    return worst


def count_syncs(device: str) -> int:
    """Print host reads and CUDA-syncing / non-deterministic operators per call (forward + backward,
    ``verl_sat.op_audit``); return the largest excess of reads over verl's own count."""
    inputs = _inputs(8, 4096, torch.float32, device)
    verl_reads = {}
    for name, agg in (("vanilla", "token-mean"), ("gspo", "seq-mean-token-mean")):
        with CudaOpAudit() as audit:
            _call(name, inputs, agg, _config(name))
        verl_reads[name] = len(audit.reads)
    print(
        "\n| loss | granularity | quantile_method | host reads per call | syncing / non-deterministic operators "
        "| verl's counterpart's reads |"
    )
    print("|---|---|---|---:|---|---:|")
    excess = 0
    cases = [("sat", "sequence", "vanilla", "token-mean")] + [
        ("sat_gspo", granularity, "gspo", "seq-mean-token-mean") for granularity in GRANULARITIES
    ]
    for name, granularity, counterpart, agg in cases:
        for method in ("inverted_cdf", "linear"):
            config = _config(name, SatConfig(granularity=granularity, quantile_method=method))
            with CudaOpAudit() as audit:
                _call(name, inputs, agg, config)
            excess = max(excess, len(audit.reads) - verl_reads[counterpart] + len(audit.flagged))
            shown = "-" if name == "sat" else granularity
            print(
                f"| {name} | {shown} | {method} | {len(audit.reads)} | {', '.join(audit.flagged) or 'none'} "
                f"| {counterpart}: {verl_reads[counterpart]} |"
            )
    return excess


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16", "float64"])
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args()

    print(f"device={args.device} threads={torch.get_num_threads()} torch={torch.__version__} repeats={args.repeats}")
    rows: list[dict] = []
    time_pairs(args.device, args.dtype, args.repeats, rows=rows)
    excess = count_syncs(args.device)
    target = RATIO_TARGET.get(args.device, 1.5)
    verdict = {True: "met", False: "MISSED"}
    print()
    for loss, granularity in dict.fromkeys((row["loss"], row["granularity"]) for row in rows):
        worst = max(row["ratio"] for row in rows if (row["loss"], row["granularity"]) == (loss, granularity))
        label = loss if loss == "sat" else f"{loss} ({granularity})"
        print(f"worst time ratio of {label}: {worst:.2f}x (target <= {target}x): {verdict[worst <= target]}")
    print(
        f"most host reads above verl's, plus syncing operators: {excess} (target <= {SYNC_TARGET}): "
        f"{verdict[excess <= SYNC_TARGET]}"
    )


if __name__ == "__main__":
    main()
