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
"""The hot paths on one GPU (``make gpu-check``), in a few minutes on one H200:

1. Host syncs. Each SAT surrogate, verl's ``agg_loss`` and the backward under ``torch.cuda.set_sync_debug_mode
   ("error")`` and ``torch.use_deterministic_algorithms(True)`` (nothing may sync or raise); the registered losses
   under ``"warn"``, counting syncs: one (the metrics read) against verl's three reads (``gspo``: and its
   ``torch.tensor(0.0, device=...)``, a host-to-device copy). An R3 forward + backward under
   ``"warn"`` against the same model's native one (transformers' own expert dispatch syncs; R3 may add only its one
   metrics read).
2. ``sat`` / ``vanilla`` and ``sat_gspo`` / ``gspo``, forward + backward timed with CUDA events at 8 x 4096,
   32 x 8192 and 64 x 16384 tokens, in bf16 and fp32 (``benchmarks/bench_losses.py``).
3. R3 replay against native routing, forward + backward, on a mid-size Hugging Face Qwen3-MoE built from a config
   (8 layers, 64 experts, hidden 1024, 8,192 tokens; ``benchmarks/bench_routing_replay.py``).

What it needs on a bare GPU machine (PyTorch with CUDA, transformers; no network, no Ray):

- this repository as the working directory, on ``PYTHONPATH`` (verl-sat is imported from the tree);
- verl 0.9.1 and the small pure-Python packages its loss and config modules import, carried as wheels:
  ``make gpu-wheels`` puts them in ``.whl/`` here (verl, tensordict, pyvers, omegaconf, antlr4-python3-runtime,
  codetiming, orjson, importlib_metadata, for CPython 3.12 on x86-64); there, install them with
  ``python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl``;
- no Ray: verl imports ``ray`` at module level (``verl.protocol``) only for the annotation ``ray.ObjectRef``, and
  ``transfer_queue`` (which needs Ray) behind a fallback. Before importing verl this script puts a stub ``ray`` module
  holding that one name in ``sys.modules`` and blocks ``transfer_queue``; nothing here calls Ray.

    PYTHONPATH=.:/tmp/site python3 benchmarks/gpu_check.py --out $OUT       # the full check on CUDA
    python benchmarks/gpu_check.py --device cpu --quick                     # the same code on this CPU (a test runs it)

On the CPU the sync checks run through ``verl_sat.op_audit.CudaOpAudit`` instead of CUDA's sync debug mode. The
results are printed as Markdown tables and written to ``OUT/gpu_check.json``.
"""

import argparse
import json
import os
import sys
import types
import warnings
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmarks
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # verl_sat from this tree


def stub_ray() -> None:
    """A ``ray`` module with the one name verl's import chain reads (``ray.ObjectRef``), and no ``transfer_queue``
    (verl falls back to its mock); verl's plugin loader skips installed plugins (verl-sat is imported directly)."""
    ray = types.ModuleType("ray")
    ray.ObjectRef = type("ObjectRef", (), {})
    ray.__verl_sat_stub__ = True
    sys.modules["ray"] = ray
    sys.modules["transfer_queue"] = None
    os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")


stub_ray()

import torch  # noqa: E402
from bench_losses import _config, _inputs, time_pairs  # noqa: E402
from bench_routing_replay import _qwen3_moe, overhead  # noqa: E402
from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn  # noqa: E402

import verl_sat.losses  # noqa: E402, F401  (registers sat and sat_gspo)
from verl_sat.config import SatConfig  # noqa: E402
from verl_sat.op_audit import CudaOpAudit  # noqa: E402
from verl_sat.routing_replay import RoutingReplay  # noqa: E402
from verl_sat.sat_math import sat_gspo_surrogate, sat_token_surrogate  # noqa: E402

CASES = [("sat", "token", "vanilla", "token-mean")] + [
    ("sat_gspo", granularity, "gspo", "seq-mean-token-mean")
    for granularity in ("sequence", "sequence_uniform", "token")
]
R3_SIZES = {"full": (8, 64, 1024, 8192), "quick": (2, 8, 64, 256)}  # layers, experts, hidden, tokens


@contextmanager
def sync_count(device: str):
    """Count host syncs inside the block: CUDA's sync debug mode (``"warn"``) on a GPU, the op audit's reads and
    syncing operators on the CPU. Yields a list that holds one entry per sync when the block ends."""
    found: list[str] = []
    if device == "cuda":
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield found
                torch.cuda.synchronize()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        found += [str(w.message).splitlines()[0] for w in caught if "synchronizing" in str(w.message)]
    else:
        with CudaOpAudit() as audit:
            yield found
        found += audit.reads + audit.syncing


@contextmanager
def no_sync(device: str):
    """Fail on any host sync inside the block (CUDA's sync debug mode ``"error"``; the op audit on the CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
    else:
        with sync_count(device) as found:
            yield
        if found:
            raise RuntimeError(f"host syncs: {found}")


@contextmanager
def deterministic_algorithms():
    """``torch.use_deterministic_algorithms(True)`` inside the block (an operator without a deterministic CUDA
    kernel raises)."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def loss_syncs(device: str, batch: int, length: int) -> list[dict]:
    """Section 1 for the losses: the surrogates with ``agg_loss`` and backward under "error" and deterministic
    algorithms; the registered losses' syncs per call against verl's."""
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        old, log_prob, adv, mask = _inputs(batch, length, dtype, device)
        for name, granularity, nominal, agg in CASES:
            gate = SatConfig(granularity=granularity) if name == "sat_gspo" else SatConfig()
            lp = log_prob.detach().requires_grad_()
            with no_sync(device), deterministic_algorithms():
                if name == "sat":
                    out = sat_token_surrogate(lp, old, adv, mask, 0.2, 0.2, 3.0, gate)
                else:
                    out = sat_gspo_surrogate(lp, old, adv, mask, 0.2, 0.2, gate, granularity)
                agg_loss(out.loss_mat, out.mask, agg).backward()
            counts = {}
            for loss in (name, nominal):
                lp = log_prob.detach().requires_grad_()
                config = _config(loss, gate)
                with sync_count(device) as found:
                    pg_loss, _ = get_policy_loss_fn(loss)(old, lp, adv, mask, agg, config)
                    pg_loss.backward()
                counts[loss] = len(found)
            rows.append({"loss": name, "granularity": granularity, "dtype": str(dtype).removeprefix("torch."),
                         "surrogate_syncs": 0, "loss_syncs": counts[name], "verl_syncs": counts[nominal]})  # fmt: skip
    return rows


def r3_syncs(device: str, layers: int, experts: int, hidden: int, tokens: int) -> dict:
    """Section 1 for R3: syncs of a native and a replayed forward + backward of the same model."""
    torch.manual_seed(0)
    model = _qwen3_moe(layers=layers, experts=experts, hidden=hidden).to(device)
    ids = torch.randint(0, 512, (1, tokens), device=device)
    rr = RoutingReplay.attach(model)
    with torch.no_grad(), rr.record() as recording:
        model(input_ids=ids)
    routes = recording.routed_experts.reshape(tokens, layers, -1)

    def forward_backward():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    forward_backward()  # warm-up
    with sync_count(device) as native:
        forward_backward()
    with sync_count(device) as replayed:
        with rr.replay(routes):
            forward_backward()
    with sync_count(device) as metrics_read:
        rr.replay_metrics()
    return {"layers": layers, "native_syncs": len(native), "replay_syncs": len(replayed),
            "metrics_read_syncs": len(metrics_read), "native_kinds": sorted(set(native))}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats (a test of the script)")
    parser.add_argument("--out", default=None, help="folder for gpu_check.json")
    args = parser.parse_args()
    size = "quick" if args.quick else "full"
    print(f"device={args.device} torch={torch.__version__} "
          f"gpu={torch.cuda.get_device_name() if args.device == 'cuda' else '-'}")  # fmt: skip
    results = {
        "device": args.device,
        "torch": torch.__version__,
        "ray_stub": getattr(sys.modules["ray"], "__verl_sat_stub__", False),
    }

    print("\n## Host syncs per call (forward + backward)\n")
    results["loss_syncs"] = loss_syncs(args.device, *((8, 512) if args.quick else (32, 8192)))
    print(
        "| loss | granularity | dtype | surrogate + agg_loss + backward, 'error' + deterministic | registered loss "
        "| verl |"
    )
    print("|---|---|---|---|---:|---:|")
    for row in results["loss_syncs"]:
        print(f"| {row['loss']} | {row['granularity']} | {row['dtype']} | no sync | {row['loss_syncs']} | "
              f"{row['verl_syncs']} |")  # fmt: skip
    results["r3_syncs"] = [r3_syncs(args.device, layers, *R3_SIZES[size][1:]) for layers in (2, 6)]
    print("\n| R3, MoE layers | native forward + backward | replayed | metrics read |\n|---:|---:|---:|---:|")
    for row in results["r3_syncs"]:
        print(f"| {row['layers']} | {row['native_syncs']} | {row['replay_syncs']} | {row['metrics_read_syncs']} |")

    print("\n## Loss time, SAT against verl\n")
    shapes = [(4, 256), (8, 512)] if args.quick else None
    dtypes = ["float32"] if args.quick else ["float32", "bfloat16"]
    results["worst_loss_ratio"] = time_pairs(args.device, dtypes, 3 if args.quick else 100,
                                             **({"shapes": shapes} if shapes else {}))  # fmt: skip

    print("\n## R3 replay against native routing, forward + backward\n")
    layers, experts, hidden, tokens = R3_SIZES[size]
    native, replay = overhead(2 if args.quick else 15, args.device, layers, experts, hidden, tokens)
    print("| model | tokens | native ms | replay ms | ratio |\n|---|---:|---:|---:|---:|")
    print(f"| Qwen3-MoE {layers} layers, {experts} experts, top-2, hidden {hidden} | {tokens} | {native:.1f} | "
          f"{replay:.1f} | {replay / native:.3f}x |")  # fmt: skip
    results["r3_time"] = {"layers": layers, "experts": experts, "hidden": hidden, "tokens": tokens,
                          "native_ms": native, "replay_ms": replay}  # fmt: skip

    failures = [f"{r['loss']}/{r['granularity']}/{r['dtype']}: {r['loss_syncs']} syncs"
                for r in results["loss_syncs"] if r["loss_syncs"] > 1]  # fmt: skip
    failures += [f"R3 with {r['layers']} layers: {r['replay_syncs']} syncs against {r['native_syncs']} native"
                 for r in results["r3_syncs"] if r["replay_syncs"] > r["native_syncs"]]  # fmt: skip
    results["failures"] = failures
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_check.json").write_text(json.dumps(results, indent=1))
    print("\nsync checks: " + ("all met" if not failures else "FAILED: " + "; ".join(failures)))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
