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
"""R3 on a real engine's routes: vLLM (its CPU build) samples a MoE model with per-token log-probs and
``routed_experts``; verl's actor worker recomputes those log-probs, with verl-sat's FSDP routing replay on vLLM's
routes or with native routing. The difference is the training-inference mismatch R3 is meant to remove.

Each side runs in its own process (vLLM starts an engine-core process and sets its own threads; verl's worker
initialises a one-rank process group)::

    python -m verl_sat.cpu.vllm_r3 sample --model M --dtype float32 --out samples.pt
    python -m verl_sat.cpu.vllm_r3 replay --model M --samples samples.pt --r3 on --out replay.pt
    python -m verl_sat.cpu.vllm_r3 measure --model M       # both dtypes, with and without R3: one table

``routed_experts`` goes from vLLM's answer into the batch through verl's own ``AgentLoopOutput.as_dict`` (what verl's
v1 agent loop stores for the trainer) and verl's position-id helper; the log-probs come from verl's
``ActorRolloutRefWorker.compute_log_prob`` in its FSDP2 engine, as the trainer calls it.
"""

import argparse
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

PROMPT_SEED = 0
SAMPLING_SEED = 1


def prompts(vocab_size: int, count: int = 8, generator_seed: int = PROMPT_SEED) -> list[list[int]]:
    """``count`` random prompts of 3..10 token ids in ``[1, vocab_size)``, fixed by ``generator_seed``."""
    generator = torch.Generator().manual_seed(generator_seed)
    lengths = torch.randint(3, 11, (count,), generator=generator)
    return [torch.randint(1, vocab_size, (int(n),), generator=generator).tolist() for n in lengths]


def engine(model: str, dtype: str, count: int = 8, **kwargs):
    """vLLM's offline engine (CPU build, eager) on ``model`` in ``dtype``, returning routes, for ``count`` sequences
    at a time; ``kwargs`` go to ``vllm.LLM``."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache; vLLM's CPU default takes a share of RAM
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # no core pinning on a shared 2-core machine
    from vllm import LLM

    return LLM(
        model=model, dtype=dtype, enforce_eager=True, enable_return_routed_experts=True, max_model_len=128,
        max_num_seqs=count, seed=SAMPLING_SEED, skip_tokenizer_init=True, **kwargs,
    )  # fmt: skip


def generate(llm, batch: list[list[int]], max_tokens: int = 12) -> list[dict]:
    """``max_tokens`` tokens sampled at temperature 1 (seeded: the same call gives the same draws) for each prompt of
    ``batch``. Per sample: ``prompt_ids``, ``response_ids``, ``log_probs`` (float64 [R]) and ``routed_experts``
    (vLLM's array, uint8 [P + R - 1, layers, top_k])."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True, seed=SAMPLING_SEED)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in batch], params, use_tqdm=False)
    samples = []
    for ids, output in zip(batch, outputs, strict=True):
        completion = output.outputs[0]
        response = list(completion.token_ids)
        samples.append(
            {
                "prompt_ids": ids,
                "response_ids": response,
                "log_probs": torch.tensor([completion.logprobs[i][t].logprob for i, t in enumerate(response)]),
                "routed_experts": completion.routed_experts,
            }
        )
    return samples


def sample(model: str, dtype: str, max_tokens: int = 12, count: int = 8) -> list[dict]:
    """vLLM's offline engine on ``model`` in ``dtype``: ``count`` prompts, ``max_tokens`` sampled tokens each
    (``generate``)."""
    from transformers import AutoConfig

    batch = prompts(AutoConfig.from_pretrained(model).vocab_size, count)
    return generate(engine(model, dtype, count), batch, max_tokens)


def trainer_batch(samples: list[dict]):
    """The trainer's batch for ``samples``: verl's ``AgentLoopOutput.as_dict`` per sample (routes aligned to prompt
    plus response, int16), stacked as the transfer queue returns variable-length fields (jagged nested tensors)."""
    from tensordict import TensorDict
    from verl.experimental.agent_loop.agent_loop import AgentLoopOutput
    from verl.utils.model import compute_position_id_with_mask

    fields = []
    for s in samples:
        out = AgentLoopOutput(
            prompt_ids=s["prompt_ids"], response_ids=s["response_ids"], response_mask=[1] * len(s["response_ids"]),
            response_logprobs=s["log_probs"].tolist(), routed_experts=s["routed_experts"], metrics={},
        ).as_dict()  # fmt: skip
        out["input_ids"] = torch.cat([out["prompts"], out["responses"]])
        out["loss_mask"] = out["response_mask"]  # as verl's v1 agent loop stores it
        mask = torch.ones_like(out["input_ids"]).unsqueeze(0)
        out["position_ids"] = compute_position_id_with_mask(mask).squeeze(0)
        fields.append(out)

    def jagged(key: str) -> torch.Tensor:
        return torch.nested.as_nested_tensor([f[key] for f in fields], layout=torch.jagged)

    keys = ("input_ids", "position_ids", "prompts", "responses", "response_mask", "loss_mask", "routed_experts")
    return TensorDict({key: jagged(key) for key in keys}, batch_size=[len(fields)])


def replay(model: str, samples: list[dict], r3: bool) -> tuple[list[torch.Tensor], dict]:
    """verl's actor worker (FSDP2, float32, one rank over gloo) computes the log-prob of every sampled token, with
    verl-sat's routing replay of vLLM's routes (``r3``) or with native routing. Returns the per-sample log-probs
    (float32 [R]) and the R3 metrics verl logged (mean over micro-batches; none without ``r3``)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine_workers import ActorRolloutRefWorker
    from verl.workers.utils.padding import response_from_nested

    from verl_sat.main import compose_job, use_cpu, with_recipes_searchpath

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    args = ["+recipe=sat_gspo_r3" if r3 else "+recipe=sat_gspo", "trainer.device=cpu", "+cpu=e2e"]
    args += [f"actor_rollout_ref.model.path={model}", *(["r3=fsdp"] if r3 else [])]
    _, config = compose_job(with_recipes_searchpath(args))
    use_cpu()
    worker = ActorRolloutRefWorker(config=config.actor_rollout_ref, role="actor")
    worker.init_model()
    data = trainer_batch(samples)
    tu.assign_non_tensor(data, calculate_entropy=False, compute_loss=False, temperature=1.0)
    output = worker.compute_log_prob(data)
    log_probs = response_from_nested(output["log_probs"], data["response_mask"])
    metrics = {  # per micro-batch lists: their mean
        key: float(torch.tensor(value, dtype=torch.float64).mean())
        for key, value in tu.get(output, "metrics", {}).items()
        if key.startswith("actor/r3_")
    }
    return list(log_probs.unbind()), metrics


def mismatch(reference: list[torch.Tensor], other: list[torch.Tensor]) -> dict[str, float]:
    """Mean and max |Δ log-prob| over all sampled tokens of two per-sample lists."""
    diff = torch.cat([(a.double() - b.double()).abs() for a, b in zip(reference, other, strict=True)])
    return {"mean": float(diff.mean()), "max": float(diff.max())}


def _run(*args: str) -> None:
    """One step in its own process; its log is shown only if it fails."""
    print(f"vllm_r3 {' '.join(args[:1] + args[3:])}", flush=True)
    done = subprocess.run([sys.executable, "-m", "verl_sat.cpu.vllm_r3", *args], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}\nvllm_r3 {args[0]} failed (exit {done.returncode})")


def measure(model: str, count: int, dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> list[dict]:
    """For each vLLM ``dtype``: ``count`` samples, then verl's actor with and without R3; one row per (dtype, R3)."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in dtypes:
            samples = Path(tmp, f"{dtype}.pt")
            _run("sample", "--model", model, "--dtype", dtype, "--count", str(count), "--out", str(samples))
            vllm_log_probs = [s["log_probs"] for s in torch.load(samples, weights_only=False)]
            for r3 in ("on", "off"):
                out = Path(tmp, f"{dtype}-{r3}.pt")
                _run("replay", "--model", model, "--samples", str(samples), "--r3", r3, "--out", str(out))
                replayed = torch.load(out, weights_only=False)
                rows.append({"dtype": dtype, "r3": r3, **mismatch(vllm_log_probs, replayed["log_probs"]),
                             **replayed["metrics"]})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m verl_sat.cpu.vllm_r3", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("sample", help="vLLM samples with log-probs and routed_experts")
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--count", type=int, default=8, help="prompts (12 sampled tokens each)")
    p.add_argument("--out", required=True)
    p = sub.add_parser("replay", help="verl's actor log-probs of the samples, with or without R3")
    p.add_argument("--model", required=True)
    p.add_argument("--samples", required=True)
    p.add_argument("--r3", choices=["on", "off"], required=True)
    p.add_argument("--out", required=True)
    p = sub.add_parser("measure", help="each dtype, with and without R3: the mismatch table")
    p.add_argument("--model", required=True)
    p.add_argument("--count", type=int, default=32, help="prompts per dtype (12 sampled tokens each)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="vLLM dtypes, comma-separated")
    args = parser.parse_args(argv)
    if args.command == "sample":
        torch.save(sample(args.model, args.dtype, count=args.count), args.out)
    elif args.command == "replay":
        log_probs, metrics = replay(args.model, torch.load(args.samples, weights_only=False), args.r3 == "on")
        torch.save({"log_probs": log_probs, "metrics": metrics}, args.out)
    else:
        rows = measure(args.model, args.count, tuple(args.dtypes.split(",")))
        print(f"\n{args.count} prompts x 12 sampled tokens per dtype; |vLLM log-prob - verl actor log-prob| per token")
        print("| vLLM dtype | R3 | mean abs log-prob diff | max | r3_route_flip_frac | r3_layers_replayed |")
        print("|---|---|---|---|---|---|")
        for row in rows:
            flip, layers = row.get("actor/r3_route_flip_frac", "-"), row.get("actor/r3_layers_replayed", "-")
            print(f"| {row['dtype']} | {row['r3']} | {row['mean']:.3g} | {row['max']:.3g} | {flip} | {layers} |")


if __name__ == "__main__":
    main()
