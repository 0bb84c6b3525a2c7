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
"""``verl-sat prepare``: everything the embedded engine needs, built offline and deterministically for a seed.

    DIR/model/            Qwen3-MoE policy + character tokenizer (save_pretrained; verl and transformers load it)
    DIR/data/{train,val,test}.parquet   verl's RL parquet format, scored by verl's GSM8K scorer
    DIR/prepare.json      what was built: task, seed, sizes, band, warm-start steps and evaluations, accuracies

Two tasks (``--task``, ``SPECS``): ``addition``, answered in a few tokens, and ``chain``, a long chain of thought of
20-250 tokens (see ``task.py``); the engine's ``+embedded=long_cot`` defaults run the second.

The warm start stops when greedy accuracy on the validation split lands in the target band (``--band``), so RL
starts with headroom on any machine. The folder is built under ``DIR/.prepare-tmp`` and renamed into place at the
end, so an interrupted run leaves nothing half-written.

By default prepare runs in a child process under ``PORTABLE_FLOATING_POINT``, so that every x86-64 CPU builds the same
model (``prepare.json``'s ``model_sha256``): with each CPU's fastest kernels, last-bit differences grow through the
warm start's sudden rise into where it lands.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from verl_sat.embedded.task import SPLITS, TASKS, make_problems, to_verl_rows
from verl_sat.embedded.tokenizer import build_char_tokenizer
from verl_sat.embedded.warm_start import BandMissed, greedy_accuracy, prompt_set, warm_start

MANIFEST = "prepare.json"
FORMAT = 3  # bump when the files change meaning; `verl-sat train` refuses a workdir of another format
DEFAULT_BAND = (0.30, 0.45)  # greedy validation accuracy after the warm start: headroom for RL

# One code path on every x86-64 CPU, read when a process starts. Measured with native kernels on one machine: the warm
# start landed after 1,575 steps with ATen and MKL at AVX-512, 1,200 with both at AVX2, 575 with ATen alone at AVX2;
# 800 on the machine that trained docs/results.md's earlier cells.
PORTABLE_FLOATING_POINT = {
    "ATEN_CPU_CAPABILITY": "default",  # ATen's kernels without CPU-specific vector code (AVX2, AVX-512)
    "MKL_CBWR": "COMPATIBLE",  # MKL's conditional numerical reproducibility: its baseline code path on every CPU
    "ONEDNN_MAX_CPU_ISA": "SSE41",  # oneDNN's kernels at the x86-64 baseline
    "GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2,-FMA,-AVX512F",  # glibc's libm without its FMA and AVX variants
    "OMP_NUM_THREADS": "2",  # a parallel reduction splits by the thread count: the same count everywhere
    "MKL_NUM_THREADS": "2",
}


class WorkdirError(RuntimeError):
    """A workdir that `verl-sat train` cannot use; the message says which `verl-sat prepare` command to run."""


def check_prepared(workdir: str | Path, band: tuple[float, float] | None = None, task: str | None = None) -> dict:
    """The manifest of a prepared, current workdir (warm-started into ``band`` and holding ``task``, when given), or
    ``WorkdirError`` naming the command that fixes it."""
    workdir = Path(workdir)
    command = f"verl-sat prepare --workdir {workdir}"
    manifest_path = workdir / MANIFEST
    if not manifest_path.is_file():
        raise WorkdirError(f"{workdir} is not prepared (no {MANIFEST}): run `{command}`")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("format") != FORMAT:
        raise WorkdirError(
            f"{workdir} was prepared by another verl-sat version (format {manifest.get('format')}, this one reads "
            f"{FORMAT}): run `{command}` again"
        )
    missing = [name for name in ("model/config.json", *(f"data/{split}.parquet" for split in SPLITS))
               if not (workdir / name).is_file()]  # fmt: skip
    if missing:
        raise WorkdirError(f"{workdir} is incomplete (missing {', '.join(missing)}): run `{command}` again")
    if band is not None and tuple(manifest["band"]) != tuple(band):
        raise WorkdirError(f"{workdir} was warm-started into the band {manifest['band']}, not {list(band)}")
    if task is not None and manifest.get("task", "addition") != task:
        raise WorkdirError(f"{workdir} holds the task {manifest.get('task', 'addition')!r}, not {task!r}")
    return manifest


@dataclass(frozen=True)
class PrepareSpec:
    """Sizes of the task, the policy and the warm start. Defaults: three-digit addition (carries), a 4-layer
    8-expert Qwen3-MoE of 1.8M parameters, warm-started into the band in a few minutes on a 2-core CPU."""

    task: str = "addition"  # one of task.TASKS
    max_operand: int = 999  # operands in [0, max_operand]
    num_terms: int = 2  # operands per problem (chain: the most)
    min_terms: int = 0  # chain: the fewest operands per problem (the count is uniform in [min_terms, num_terms])
    num_train: int = 20_000  # RL prompts and warm-start examples
    num_val: int = 200  # the warm start's stopping split (never trained on)
    num_test: int = 200  # RL's evaluation split (never trained on)
    max_response_length: int = 10  # "#### 1998" plus eos is 10 tokens
    hidden_size: int = 128
    head_dim: int = 32  # 4 query and 2 key-value heads; vLLM's CPU attention takes 32, 64, 80, 96, ... only
    num_layers: int = 4
    num_experts: int = 8
    top_k: int = 2
    warm_start_batch: int = 64
    warm_start_lr: float = 1e-3
    warm_start_eval_every: int = 100  # steps between validation evaluations (halved after an overshoot)
    warm_start_max_steps: int = 20_000
    max_position_embeddings: int = 128  # prompt + response fit with room to spare

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"task={self.task!r}: expected one of {list(TASKS)}")


# the prepared tasks, by `verl-sat prepare --task`: chain's longest response is 230 tokens plus eos, its longest
# prompt 75 tokens; its warm start takes smaller batches at a higher rate (each step costs ~10x addition's tokens) and
# its evaluations half the problems
SPECS = {
    "addition": PrepareSpec(),
    "chain": PrepareSpec(task="chain", max_operand=9, num_terms=24, min_terms=3, num_val=100, num_test=100,
                         max_response_length=256, max_position_embeddings=512, warm_start_batch=32,
                         warm_start_lr=2e-3),
}  # fmt: skip


def floating_point() -> str:
    """``"portable"`` when this process started under ``PORTABLE_FLOATING_POINT``, else ``"native"``."""
    return "portable" if all(os.environ.get(k) == v for k, v in PORTABLE_FLOATING_POINT.items()) else "native"


def weights_sha256(model: torch.nn.Module) -> str:
    """SHA-256 of the model's weights: every state-dict entry's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def build_policy(vocab_size: int, pad_id: int, eos_id: int, spec: PrepareSpec) -> Qwen3MoeForCausalLM:
    config = Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=spec.hidden_size, intermediate_size=2 * spec.hidden_size,
        moe_intermediate_size=spec.hidden_size, num_hidden_layers=spec.num_layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=spec.head_dim, num_experts=spec.num_experts,
        num_experts_per_tok=spec.top_k, norm_topk_prob=True, max_position_embeddings=spec.max_position_embeddings,
        pad_token_id=pad_id,
        eos_token_id=eos_id, bos_token_id=None, tie_word_embeddings=True,
    )  # fmt: skip
    return Qwen3MoeForCausalLM(config)


def prepare(
    workdir: str | Path,
    seed: int = 0,
    spec: PrepareSpec = PrepareSpec(),
    band: tuple[float, float] = DEFAULT_BAND,
    progress: bool = True,
    portable: bool = True,
) -> dict:
    """Build tokenizer, policy, data and warm start into ``workdir``; return the manifest. Raises
    ``warm_start.BandMissed`` (and writes nothing) if the warm start cannot land in ``band``. ``portable``: in a
    child process under ``PORTABLE_FLOATING_POINT`` (the same model on every x86-64 CPU), unless this process runs
    under it already; else with this CPU's fastest kernels."""
    low, high = band
    if not 0.0 <= low <= high <= 1.0:
        raise ValueError(f"--band {low},{high}: expected 0 <= low <= high <= 1")
    if portable and floating_point() != "portable":
        return _prepare_in_portable_process(workdir, seed, spec, band, progress)
    workdir = Path(workdir)
    tmp = workdir / ".prepare-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "data").mkdir(parents=True)
    torch.manual_seed(seed)  # the initial weights (one Python thread; training runs draw from generators)

    problems = make_problems(seed, spec.max_operand, spec.num_terms,
                             {"train": spec.num_train, "val": spec.num_val, "test": spec.num_test},
                             task=spec.task, min_terms=spec.min_terms)  # fmt: skip
    tokenizer = build_char_tokenizer([p.question + p.solution() for split in problems.values() for p in split])
    model = build_policy(len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id, spec)
    for split, rows in problems.items():
        pd.DataFrame(to_verl_rows(rows, split)).to_parquet(tmp / "data" / f"{split}.parquet", index=False)

    test_prompts = prompt_set(tokenizer, problems["test"])
    test_before = greedy_accuracy(model, tokenizer, test_prompts, spec.max_response_length)
    try:
        result = warm_start(model, tokenizer, problems["train"], problems["val"], band, spec, seed, progress)
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    model.save_pretrained(tmp / "model")
    tokenizer.save_pretrained(tmp / "model")
    manifest = {
        "format": FORMAT,
        "task": spec.task,
        "seed": seed,
        "spec": asdict(spec),
        "band": [low, high],
        **{f"num_{split}": len(rows) for split, rows in problems.items()},
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "model_sha256": weights_sha256(model),
        "floating_point": floating_point(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # ATen's kernels: DEFAULT when portable
        "warm_start_steps": result.steps,
        "warm_start_loss_first_last": [result.losses[0], result.losses[-1]] if result.losses else [],
        "warm_start_evaluations": [list(e) for e in result.evaluations],
        "val_accuracy": result.accuracy,
        "test_accuracy_before_warm_start": test_before,
        "test_accuracy": greedy_accuracy(model, tokenizer, test_prompts, spec.max_response_length),
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    for name in ("model", "data", MANIFEST):  # move into place last: a finished prepare is all or nothing
        target = workdir / name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
        (tmp / name).rename(target)
    tmp.rmdir()
    return manifest


def _prepare_in_portable_process(workdir: str | Path, seed: int, spec: PrepareSpec, band: tuple[float, float],
                                 progress: bool) -> dict:  # fmt: skip
    """``prepare`` in ``python -m verl_sat.embedded.prepare`` under ``PORTABLE_FLOATING_POINT``; its progress bar
    shows here, and a missed band is raised here as ``BandMissed``."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        request = {"workdir": str(workdir), "seed": seed, "spec": asdict(spec), "band": list(band),
                   "progress": progress, "result": str(result)}  # fmt: skip
        command = [sys.executable, "-m", "verl_sat.embedded.prepare", json.dumps(request)]
        done = subprocess.run(command, env={**os.environ, **PORTABLE_FLOATING_POINT}, check=False)
        outcome = json.loads(result.read_text()) if result.is_file() else {}
    if "band_missed" in outcome:
        raise BandMissed(outcome["band_missed"])
    if done.returncode != 0 or "manifest" not in outcome:
        raise RuntimeError(f"verl-sat prepare's portable process failed (exit status {done.returncode}); its output "
                           "is above")  # fmt: skip
    return outcome["manifest"]


def _main(request: dict) -> int:
    """The portable process: prepare, then the manifest or the missed band into ``request["result"]``."""
    try:
        manifest = prepare(request["workdir"], request["seed"], PrepareSpec(**request["spec"]),
                           tuple(request["band"]), request["progress"])  # fmt: skip
    except BandMissed as err:
        Path(request["result"]).write_text(json.dumps({"band_missed": str(err)}))
        return 1
    Path(request["result"]).write_text(json.dumps({"manifest": manifest}))
    return 0


if __name__ == "__main__":
    sys.exit(_main(json.loads(sys.argv[1])))
