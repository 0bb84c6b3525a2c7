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
"""Side-by-side timing of the SAT losses against verl's own: ``sat`` vs ``vanilla``, ``sat_gspo`` vs ``gspo``.

Forward + backward of the registered loss on one micro-batch, both losses timed in the same run, interleaved, on the
same stale inputs. Prints the median times and the ratio of medians per shape.

    python benchmarks/bench_losses.py [--device cpu|cuda] [--dtype float32 bfloat16] [--repeats 15]
"""

import argparse
import statistics
import time

import torch
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.workers.config import FSDPActorConfig

from verl_sat.config import SatPolicyLossConfig

SHAPES = [(8, 4096), (32, 8192), (64, 16384)]
PAIRS = [("sat", "vanilla", "token-mean"), ("sat_gspo", "gspo", "seq-mean-token-mean")]


def _inputs(batch: int, length: int, dtype: torch.dtype, device: str):
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(batch, length, generator=gen) * 4
    log_ratio = torch.distributions.StudentT(2.0).sample((batch, length)).clamp(-10, 10) * 0.1
    adv = torch.randn(batch, 1, generator=gen).expand(batch, length).contiguous()
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=gen)
    mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    return [t.to(device) for t in (old.to(dtype), (old + log_ratio).to(dtype), adv.to(dtype), mask)]


def _time_once(fn, old, log_prob, adv, mask, agg, config, device) -> float:
    lp = log_prob.detach().requires_grad_()
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(old, lp, adv, mask, agg, config)[0].backward()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn(old, lp, adv, mask, agg, config)[0].backward()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16", "float64"])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()

    print(f"device={args.device} threads={torch.get_num_threads()} torch={torch.__version__} repeats={args.repeats}")
    print("| loss vs verl | dtype | shape (B x T) | verl median ms | SAT median ms | ratio |")
    print("|---|---|---|---:|---:|---:|")
    worst = 0.0
    for dtype_name in args.dtype:
        dtype = getattr(torch, dtype_name)
        for batch, length in SHAPES:
            inputs = _inputs(batch, length, dtype, args.device)
            for sat_name, verl_name, agg in PAIRS:
                config = FSDPActorConfig(
                    strategy="fsdp",
                    rollout_n=1,
                    ppo_micro_batch_size_per_gpu=1,
                    policy_loss=SatPolicyLossConfig(loss_mode=sat_name),
                )
                fns = {name: get_policy_loss_fn(name) for name in (sat_name, verl_name)}
                times = {sat_name: [], verl_name: []}
                for _ in range(2):  # warm-up
                    for fn in fns.values():
                        _time_once(fn, *inputs, agg, config, args.device)
                for _ in range(args.repeats):  # interleaved so that machine noise hits both
                    for name, fn in fns.items():
                        times[name].append(_time_once(fn, *inputs, agg, config, args.device))
                sat_ms = statistics.median(times[sat_name]) * 1e3
                verl_ms = statistics.median(times[verl_name]) * 1e3
                ratio = sat_ms / verl_ms
                worst = max(worst, ratio)
                print(
                    f"| {sat_name} vs {verl_name} | {dtype_name} | {batch} x {length} "
                    f"| {verl_ms:.2f} | {sat_ms:.2f} | {ratio:.2f}x |",
                    flush=True,
                )
    print(f"worst ratio: {worst:.2f}x")


if __name__ == "__main__":
    main()
