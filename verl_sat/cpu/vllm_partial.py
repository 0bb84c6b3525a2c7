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
"""Abort and resume of in-flight requests on vLLM's CPU build, as verl's partial rollout uses them
(``python -m verl_sat.cpu.vllm_partial --model M``, run by ``make e2e``).

verl's ``vLLMHttpServer`` (a Ray actor around vLLM's ``AsyncLLM``, composed with ``+cpu=e2e`` in float32 and R3)
serves requests through verl's ``FullyAsyncLLMServerClient``, the client that re-submits an aborted request as
prompt plus the tokens so far, and verl's ``GlobalRequestLoadBalancer``. While they decode, the trainer's weight
sync is played by the server calls verl's checkpoint manager makes: ``abort_all_requests``, ``set_global_steps``,
``resume_generation``. Every request must then come back whole (its token budget, a log-prob per token, vLLM's
routes for every row), the aborted ones spanning both weight versions, and the log-probs and routes must be those of
a Transformers forward over the whole sequence: the resumed part conditioned on the part before the abort.
"""

import asyncio
import json
import time

import torch
from omegaconf import DictConfig

from verl_sat.cpu.vllm_r3 import prompts


async def _partial_rollout(config: DictConfig, count: int, max_tokens: int) -> tuple[list[dict], int]:
    """The requests, the abort and the resume (module docstring): per request its prompt, response, log-probs
    (float [R]), routes (uint8 [P + R - 1, layers, top_k]), stop reason and first/last weight version; and how many
    requests the abort found in flight."""
    import ray
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import HFModelConfig
    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient
    from verl.workers.rollout.replica import RolloutMode
    from verl.workers.rollout.router import GlobalRequestLoadBalancer
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

    rollout = omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
    model = omega_conf_to_dataclass(config.actor_rollout_ref.model, HFModelConfig)
    server = ray.remote(vLLMHttpServer).options(name="vllm_server_0_0", max_concurrency=1000, num_cpus=0).remote(
        config=rollout, model_config=model, rollout_mode=RolloutMode.STANDALONE, workers=[], replica_rank=0,
        node_rank=0, gpus_per_node=1, nnodes=1, cuda_visible_devices="0",
    )  # fmt: skip
    await server.launch_server.remote()
    await server.set_global_steps.remote(0)
    balancer = ray.remote(GlobalRequestLoadBalancer).remote(servers={"0": server})
    client = FullyAsyncLLMServerClient(config, load_balancer_handle=balancer)
    batch = prompts(model.hf_config.vocab_size, count)
    params = {"temperature": 1.0, "logprobs": True, "max_tokens": max_tokens, "ignore_eos": True}

    def submit(tag: str) -> list[asyncio.Task]:
        return [
            asyncio.create_task(client.generate(f"{tag}-{i}", prompt_ids=ids, sampling_params=dict(params)))
            for i, ids in enumerate(batch)
        ]

    def in_flight(self) -> int:  # runs in the server actor: requests vLLM's engine holds
        return len(self.engine.output_processor.request_states)

    await asyncio.gather(*submit("warm-up"))  # the whole path warm (the balancer actor, the engine)
    started = time.monotonic()
    await asyncio.gather(*submit("timed"))
    decode_s = time.monotonic() - started  # how long the batch takes
    tasks = submit("request")
    deadline = time.monotonic() + decode_s
    while await server.__ray_call__.remote(in_flight) < count and time.monotonic() < deadline:
        await asyncio.sleep(0.01)  # until every request is admitted (at most one batch's decode time)
    await asyncio.sleep(decode_s / 3)  # mid-decode
    aborted = await server.abort_all_requests.remote()  # the weight sync: in-flight requests end as "aborted"
    await server.set_global_steps.remote(1)  # the new weights' version
    await server.resume_generation.remote()
    outputs = await asyncio.gather(*tasks)  # the client has re-submitted the aborted ones
    samples = [
        {"prompt_ids": ids, "response_ids": out.token_ids, "log_probs": torch.tensor(out.log_probs),
         "routed_experts": out.routed_experts, "stop_reason": out.stop_reason,
         "versions": (out.extra_fields["min_global_steps"], out.extra_fields["max_global_steps"])}
        for ids, out in zip(batch, outputs, strict=True)
    ]  # fmt: skip
    return samples, len(aborted.get("request_ids", []))


def check(model: str, count: int = 8, max_tokens: int = 96) -> dict[str, float]:
    """``count`` requests of ``max_tokens`` tokens, aborted a third of the way through their decode (timed on a
    first batch) and resumed (module docstring). vLLM loads the checkpoint (``load_format=auto``), so both
    "versions" hold the same weights and a resumed sequence must score as one forward. Returns: requests aborted,
    requests resumed across the two versions, the share of requests that came back whole, and the log-prob and route
    agreement with a Transformers float32 forward."""
    import ray
    from transformers import AutoModelForCausalLM

    from verl_sat.cpu.vllm_r3 import mismatch
    from verl_sat.cpu.vllm_reload import hf_scores
    from verl_sat.main import compose_job, use_cpu, with_recipes_searchpath

    args = ["+recipe=sat_gspo_r3", "r3=fsdp", "trainer.device=cpu", "+cpu=e2e",
            f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.rollout.dtype=float32",
            "actor_rollout_ref.rollout.load_format=auto"]  # fmt: skip
    _, config = compose_job(with_recipes_searchpath(args))
    use_cpu()
    ray.init(num_cpus=4, num_gpus=1, runtime_env={"env_vars": dict(config.ray_kwargs.ray_init.runtime_env.env_vars)})
    try:
        samples, aborted = asyncio.run(_partial_rollout(config, count, max_tokens))
    finally:
        ray.shutdown()
    whole = [
        len(s["response_ids"]) == max_tokens and len(s["log_probs"]) == max_tokens and s["stop_reason"] == "length"
        and s["routed_experts"] is not None and len(s["routed_experts"]) == len(s["prompt_ids"]) + max_tokens - 1
        for s in samples
    ]  # fmt: skip
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    hf_log_probs, routes_agree = hf_scores(hf, samples)
    diff = mismatch([s["log_probs"] for s in samples], hf_log_probs)
    return {
        "requests": count,
        "aborted": aborted,
        "resumed_across_versions": sum(s["versions"] == (0, 1) for s in samples),
        "whole": sum(whole) / count,
        "log_prob_mean": diff["mean"],
        "log_prob_max": diff["max"],
        "routes_agree": routes_agree,
    }


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m verl_sat.cpu.vllm_partial", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a prepared workdir's model folder")
    args = parser.parse_args(argv)
    result = check(args.model)
    print(json.dumps(result, indent=1))
    failed = [
        name for name, ok in (
            ("a request in flight at the abort", result["aborted"] >= 1),
            ("every aborted request resumed with the new version",
             result["resumed_across_versions"] == result["aborted"]),
            ("every request whole", result["whole"] == 1.0),
            ("log-probs of the whole sequence (max 1e-3)", result["log_prob_max"] <= 1e-3),
            ("routes of the whole sequence (99%)", result["routes_agree"] >= 0.99),
        ) if not ok
    ]  # fmt: skip
    if failed:
        raise SystemExit(f"vllm_partial: expected {', '.join(failed)}; got {result}")


if __name__ == "__main__":
    main()
