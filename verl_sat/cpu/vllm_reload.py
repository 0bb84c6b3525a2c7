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
"""verl's weight updates into vLLM's CPU build, mended: a worker extension verl's vLLM server already loads
(``actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls``, set by ``+cpu=e2e``).

vLLM's CPU build puts its weights in kernel layouts after the first load, and a second load cannot write into them:

- ``UnquantizedLinearMethod.process_weights_after_loading`` hands a linear's weight to a oneDNN (or sgl-kernel)
  handle and replaces ``layer.weight`` with an empty parameter, so verl's ``model.load_weights`` fails;
- ``UnquantizedFusedMoEMethod._setup_kernel`` prepacks the experts' ``w13_weight``/``w2_weight`` only while its
  ``moe_kernel`` is unset (the first load); a reload writes the checkpoint layout into them and the CPU MoE kernel
  reads it as prepacked, silently.

``VLLMCPUWorkerExtension.update_weights_from_ipc`` therefore, before verl's receiver loads the update, puts those
layers back in checkpoint layout (vLLM's own record of it, ``get_layerwise_info`` / ``restore_layer_on_meta``)
and unsets the experts' kernel; verl's receiver and per-bucket loading (``BucketedWeightReceiver``,
``_update_weights``) then load the update, and vLLM's ``process_weights_after_loading`` repacks everything as on the
first load. The restored linear and expert weights start as NaN, so an update that leaves one of them out fails,
naming it (biases, embeddings and norms are loaded in place, as verl loads them on a GPU). A failed update leaves
the engine unusable; the error stops the run. ``tests/test_vllm_reload_on_cpu.py`` pins the vLLM and verl code this
works around.
"""

from collections.abc import Iterable, Iterator

import torch
from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

from verl_sat.cpu import VLLM_EXTENSION as EXTENSION  # engine_kwargs.vllm.worker_extension_cls


def restore_checkpoint_layout(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Put every layer whose weights vLLM's CPU build repacked (unquantized linears and fused MoE experts) back in
    checkpoint layout, as NaN-filled tensors, and unset the experts' MoE kernel so the next
    ``process_weights_after_loading`` prepacks them again. Returns the restored tensors by qualified name."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import materialize_layer, restore_layer_on_meta

    restored = {}
    for name, layer in model.named_modules():
        method = getattr(layer, "quant_method", None)
        if not isinstance(method, UnquantizedLinearMethod | UnquantizedFusedMoEMethod):
            continue
        info = get_layerwise_info(layer)
        if not info.restore_metadata[0]:  # vLLM records it when it builds the model (initialize_model)
            raise RuntimeError(f"vLLM holds no checkpoint layout for {name!r}: its weights cannot be restored")
        restore_layer_on_meta(layer, info)
        materialize_layer(layer, info)
        if isinstance(method, UnquantizedFusedMoEMethod):
            method.moe_kernel = None  # the first-load path: the experts are prepacked again
        for key in info.restore_metadata[0]:
            param = getattr(layer, key)
            param.data.fill_(float("nan"))
            restored[f"{name}.{key}"] = param
    return restored


def check_loaded(restored: dict[str, torch.Tensor]) -> None:
    """Raise if an update left any restored tensor (partly) unwritten."""
    missed = [name for name, tensor in restored.items() if bool(torch.isnan(tensor).any())]
    if missed:
        raise RuntimeError(f"the weight update did not cover {len(missed)} vLLM parameters, e.g. {missed[:3]}")


class VLLMCPUWorkerExtension(vLLMColocateWorkerExtension):
    """verl's ``vLLMColocateWorkerExtension`` whose weight update works on vLLM's CPU build (module docstring).
    Full-weight updates only: LoRA adapters and quantized models are refused. On any other platform it is verl's
    class unchanged."""

    def update_weights_from_ipc(
        self, peft_config: dict | None = None, base_sync_done: bool = False, use_shm: bool = False
    ) -> None:
        from vllm.model_executor.model_loader.utils import process_weights_after_loading
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return super().update_weights_from_ipc(peft_config, base_sync_done, use_shm)
        if peft_config or self.model_runner.vllm_config.quant_config is not None:
            raise NotImplementedError(
                "verl-sat's CPU weight update (actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls="
                f"{EXTENSION}) loads full unquantized weights; got a LoRA adapter or actor_rollout_ref.rollout."
                "quantization"
            )
        device = self.device if self.device is not None else torch.device("cpu")
        restored = {}
        for model in self._iter_all_models():
            restored.update(restore_checkpoint_layout(model))
        receiver = BucketedWeightReceiver(zmq_handle=self._get_zmq_handle(), device=device, use_shm=use_shm)
        receiver.receive_weights(on_bucket_received=lambda weights, is_last: self._update_weights(weights, None, False))
        check_loaded(restored)
        del restored  # the checkpoint-layout copies: repacking allocates the kernel layouts
        for model, model_config in self._iter_all_models_with_config():
            process_weights_after_loading(model, model_config, device)


def send(llm, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Update ``llm``'s weights (a ``vllm.LLM`` with one worker) as verl's ``ServerAdapter.update_weights`` does on a
    machine without device IPC: the worker's ``update_weights_from_ipc`` receives what verl's
    ``BucketedWeightSender`` puts in shared memory. The sender runs in a daemon thread: if the worker fails, the
    sender waits for an answer that never comes, and the worker's error is raised here."""
    import asyncio
    import threading

    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

    (handle,) = llm.collective_rpc("_get_zmq_handle")
    failure: list[BaseException] = []

    def send_buckets() -> None:
        try:
            sender = BucketedWeightSender(zmq_handle=handle, bucket_size_mb=64, use_shm=True)
            asyncio.run(sender.async_send_weights(iter(named_tensors)))
        except BaseException as err:  # noqa: BLE001 (raised below, in the caller's thread)
            failure.append(err)

    sender = threading.Thread(target=send_buckets, daemon=True)
    sender.start()
    llm.collective_rpc("update_weights_from_ipc", kwargs={"use_shm": True})
    sender.join()
    if failure:
        raise failure[0]


def trainer_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """What verl's FSDP engine sends for ``model`` (a Transformers model): its state dict, experts split per expert
    by verl's ``unfuse_moe_params``."""
    from verl.workers.engine.fsdp.utils import unfuse_moe_params

    return unfuse_moe_params(model.state_dict().items(), model.config.model_type)


@torch.no_grad()
def hf_scores(model: torch.nn.Module, samples: list[dict]) -> tuple[list[torch.Tensor], float]:
    """``model``'s (Transformers, float32) log-prob of each sampled token, and the share of (token, layer) route
    sets of ``samples`` its router picks as well."""
    log_probs, agree, total = [], 0, 0
    top_k = model.config.num_experts_per_tok
    for s in samples:
        ids = torch.tensor([s["prompt_ids"] + s["response_ids"]])
        out = model(input_ids=ids, output_router_logits=True)
        prompt = len(s["prompt_ids"])
        logits = out.logits[0, prompt - 1 : -1].float().log_softmax(-1)
        log_probs.append(logits.gather(-1, torch.tensor(s["response_ids"])[:, None])[:, 0])
        rows = len(s["routed_experts"])
        chosen = torch.stack([r[:rows].topk(top_k, dim=-1).indices for r in out.router_logits], dim=1)  # [rows, L, k]
        vllm = torch.from_numpy(s["routed_experts"]).long()
        agree += int((chosen.sort(-1).values == vllm.sort(-1).values).all(-1).sum())
        total += chosen.shape[0] * chosen.shape[1]
    return log_probs, agree / total


def check(model: str, count: int = 8, noise: float = 0.3, seed: int = 0) -> tuple[dict[str, float], list[dict]]:
    """vLLM's CPU build (float32) with this extension, weights updated through verl's transfer. Returns the figures
    and the samples drawn before any update (``verl_sat.cpu.vllm_r3.generate``):

    - ``identical_*``: the checkpoint's own weights sent back; the same seeded draws must come out unchanged;
    - ``updated_*``: every weight moved by ``noise`` of its standard deviation (one ``torch.Generator``); vLLM's
      log-probs and routes after the update against a Transformers forward of the moved weights, and how far the
      move itself shifts those log-probs (``updated_shift``, what a missed update would show)."""
    import os

    from transformers import AutoConfig, AutoModelForCausalLM

    from verl_sat.cpu.vllm_r3 import engine, generate, mismatch, prompts
    from verl_sat.main import use_cpu

    use_cpu()  # verl's CPU platform here and in vLLM's workers (verl's transfer synchronises its device)
    os.environ.setdefault("VERL_RAY_JOB_ID", f"vllm-reload-check-{os.getpid()}")  # the transfer's socket name
    llm = engine(model, "float32", count, worker_extension_cls=EXTENSION)
    batch = prompts(AutoConfig.from_pretrained(model).vocab_size, count)
    before = generate(llm, batch)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    send(llm, trainer_weights(hf))
    again = generate(llm, batch)
    same = all(a["response_ids"] == b["response_ids"] for a, b in zip(before, again, strict=True))
    identical = mismatch([s["log_probs"] for s in before], [s["log_probs"] for s in again])
    original = {name: p.clone() for name, p in hf.state_dict().items()}
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * noise * p.std())
    send(llm, trainer_weights(hf))
    updated = generate(llm, batch)
    hf_updated, routes_agree = hf_scores(hf, updated)
    hf.load_state_dict(original)
    hf_original, _ = hf_scores(hf, updated)
    vllm_updated = [s["log_probs"] for s in updated]
    figures = {
        "identical_tokens_same": float(same),
        "identical_max": identical["max"],
        "updated_mean": mismatch(vllm_updated, hf_updated)["mean"],
        "updated_max": mismatch(vllm_updated, hf_updated)["max"],
        "updated_routes_agree": routes_agree,
        "updated_shift": mismatch(hf_original, hf_updated)["mean"],
    }
    return figures, before


def main(argv: list[str] | None = None) -> None:
    """``python -m verl_sat.cpu.vllm_reload``: ``check`` on ``--model``, its figures printed (and saved)."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m verl_sat.cpu.vllm_reload", description=check.__doc__)
    parser.add_argument("--model", required=True, help="a prepared workdir's model folder")
    parser.add_argument("--out", help="write the figures here as JSON too")
    parser.add_argument("--samples-out", help="save the samples drawn before any update here (torch.save)")
    args = parser.parse_args(argv)
    figures, samples = check(args.model)
    print(json.dumps(figures, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(figures, f)
    if args.samples_out:
        torch.save(samples, args.samples_out)


if __name__ == "__main__":
    main()
