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
"""``verl-sat prepare``: offline, deterministic tokenizer, MoE policy, verl-format task data, and a warm start that
lands in its accuracy band or says it missed."""

import json

import pandas as pd
import pytest
import torch
from conftest import TINY_BAND, TINY_PREPARE
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.utils.reward_score import default_compute_score

from verl_sat import cli
from verl_sat.embedded.prepare import (
    MANIFEST,
    SPECS,
    PrepareSpec,
    WorkdirError,
    check_prepared,
    prepare,
    weights_sha256,
)
from verl_sat.embedded.task import SPLITS, make_problems, to_verl_rows
from verl_sat.embedded.tokenizer import build_char_tokenizer
from verl_sat.embedded.warm_start import BandMissed
from verl_sat.routing_replay import RoutingReplay


@pytest.fixture(scope="module")
def workdir(tiny_workdir):
    return tiny_workdir


def test_writes_a_loadable_model_and_tokenizer(workdir):
    tokenizer = AutoTokenizer.from_pretrained(workdir / "model")
    model = AutoModelForCausalLM.from_pretrained(workdir / "model")
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.config.num_experts == 4
    text = tokenizer.apply_chat_template([{"role": "user", "content": "3+4="}], add_generation_prompt=True,
                                         tokenize=False)  # fmt: skip
    assert text == "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text and tokenizer.unk_token_id not in ids
    assert RoutingReplay.attach(model).num_layers == 2  # a real MoE: the R3 recipes can replay it


def test_three_disjoint_splits_in_verl_format_read_by_rlhf_dataset(workdir):
    frames = {split: pd.read_parquet(workdir / "data" / f"{split}.parquet") for split in SPLITS}
    assert {split: len(frame) for split, frame in frames.items()} == {"train": 60, "val": 20, "test": 20}
    questions = {split: {row[0]["content"] for row in frame["prompt"]} for split, frame in frames.items()}
    assert all(len(q) == len(frames[s]) for s, q in questions.items())  # no repeats within a split
    assert questions["train"].isdisjoint(questions["val"] | questions["test"])
    assert questions["val"].isdisjoint(questions["test"])
    row = frames["test"].iloc[0]
    assert row["data_source"] == "openai/gsm8k"
    assert row["reward_model"]["ground_truth"] == str(sum(row["extra_info"]["terms"]))
    tokenizer = AutoTokenizer.from_pretrained(workdir / "model")
    config = OmegaConf.create({"prompt_key": "prompt", "max_prompt_length": 32, "truncation": "error",
                               "cache_dir": str(workdir / "cache")})  # fmt: skip
    dataset = RLHFDataset(str(workdir / "data" / "train.parquet"), tokenizer, config)
    assert len(dataset) == len(frames["train"])
    assert dataset[0]["reward_model"]["ground_truth"] == frames["train"].iloc[0]["reward_model"]["ground_truth"]


def test_verl_scores_correct_and_wrong_answers(workdir):
    row = pd.read_parquet(workdir / "data" / "test.parquet").iloc[0]
    truth = row["reward_model"]["ground_truth"]
    assert default_compute_score(row["data_source"], f"#### {truth}", truth) == 1.0
    assert default_compute_score(row["data_source"], f"#### {int(truth) + 1}", truth) == 0.0
    assert default_compute_score(row["data_source"], truth, truth) == 0.0  # no "####": format not met


def test_default_task_needs_carries():
    """Three-digit addition: most problems carry, so the task is not memorised by rote and leaves RL room."""
    spec = PrepareSpec()
    problems = make_problems(0, spec.max_operand, spec.num_terms, {"train": 2000, "val": 0, "test": 0})["train"]
    carries = sum(any((a // 10**d) % 10 + (b // 10**d) % 10 >= 10 for d in range(3)) for a, b in
                  (p.terms for p in problems))  # fmt: skip
    assert carries / len(problems) > 0.6
    assert max(p.answer for p in problems) > 1000 and len(set(problems)) == len(problems)


def test_chain_task_is_a_long_chain_of_thought_graded_by_verl():
    """The long-CoT task as ``verl-sat prepare --task chain`` draws it: responses (reference + eos, in the character
    tokenizer's tokens) averaging over 100 tokens, spread from about 20 to 230, all within ``max_response_length``;
    the running sum of each line is right and verl's GSM8K scorer grades the last ``####`` line: the reference
    scores 1, a wrong total 0, a line of working without the total 0. The addition task draws as it always did."""
    spec = SPECS["chain"]
    problems = make_problems(0, spec.max_operand, spec.num_terms, {"train": 2000, "val": 0, "test": 0},
                             task="chain", min_terms=spec.min_terms)["train"]  # fmt: skip
    tokenizer = build_char_tokenizer([p.question + p.solution() for p in problems])
    lengths = [len(tokenizer(p.solution() + tokenizer.eos_token, add_special_tokens=False)["input_ids"])
               for p in problems]  # fmt: skip
    assert sum(lengths) / len(lengths) > 100 and min(lengths) < 40 and max(lengths) <= spec.max_response_length
    assert torch.tensor(lengths, dtype=torch.float).std() > 40
    assert {len(p.terms) for p in problems} == set(range(spec.min_terms, spec.num_terms + 1))
    for problem in problems[:50]:
        lines = problem.solution().split("\n")
        total = problem.terms[0]
        for line, term in zip(lines[:-1], problem.terms[1:], strict=True):
            total += term
            assert line.endswith(f"={total}") and f"{term}=" in line
        assert lines[-1] == f"#### {problem.answer}"
    row = to_verl_rows(problems[:1], "test")[0]
    truth, solution = row["reward_model"]["ground_truth"], problems[0].solution()
    assert default_compute_score(row["data_source"], solution, truth) == 1.0
    assert default_compute_score(row["data_source"], solution.replace(f"#### {truth}", "#### 0"), truth) == 0.0
    assert default_compute_score(row["data_source"], solution.split("\n")[0], truth) == 0.0
    # the addition task's problems are those every committed run trained and was evaluated on (seed 0's first test
    # problems before the chain task existed)
    addition = make_problems(0, 999, 2, {"train": 20_000, "val": 200, "test": 200})
    assert [p.terms for p in addition["test"][:3]] == [(678, 666), (208, 154), (580, 991)]


def test_warm_start_lands_in_its_band_and_records_it(workdir):
    manifest = json.loads((workdir / MANIFEST).read_text())
    low, high = TINY_BAND
    assert manifest["band"] == [low, high] and low <= manifest["val_accuracy"] <= high
    steps, accuracies = zip(*manifest["warm_start_evaluations"], strict=True)
    assert steps[0] == 0 and steps[-1] == manifest["warm_start_steps"] and accuracies[-1] == manifest["val_accuracy"]
    assert all(a < low or a > high for a in accuracies[:-1])  # it stopped at the first evaluation inside the band
    assert manifest["warm_start_loss_first_last"][1] < manifest["warm_start_loss_first_last"][0]
    assert check_prepared(workdir, band=TINY_BAND) == manifest
    with pytest.raises(WorkdirError, match=r"warm-started into the band \[0.25, 0.6\], not \[0.3, 0.45\]"):
        check_prepared(workdir, band=(0.3, 0.45))


def test_portable_floating_point_builds_one_model_whatever_the_cpus_kernels(workdir, tmp_path, monkeypatch):
    """``prepare`` runs in a child process under ``PORTABLE_FLOATING_POINT``: MKL dispatching as on a CPU with AVX2
    only builds the bit-identical data, model (``model_sha256``, the weights' hash) and manifest. The same prepare in
    this process with this CPU's fastest ATen kernels builds another model: the check can see a kernel's
    difference."""
    manifest = json.loads((workdir / MANIFEST).read_text())
    assert manifest["floating_point"] == "portable" and manifest["cpu_capability"] == "DEFAULT"
    first = AutoModelForCausalLM.from_pretrained(workdir / "model").state_dict()
    assert weights_sha256(AutoModelForCausalLM.from_pretrained(workdir / "model")) == manifest["model_sha256"]
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    assert prepare(tmp_path / "avx2", seed=0, spec=TINY_PREPARE, band=TINY_BAND, progress=False) == manifest
    assert json.loads((tmp_path / "avx2" / MANIFEST).read_text()) == manifest
    for split in SPLITS:
        same = pd.read_parquet(tmp_path / "avx2" / "data" / f"{split}.parquet")
        assert same.to_json() == pd.read_parquet(workdir / "data" / f"{split}.parquet").to_json()
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "avx2" / "model").state_dict()
    assert all(torch.equal(first[k], again[k]) for k in first)
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS")
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("this CPU's fastest ATen kernels are the portable ones")
    native = prepare(tmp_path / "native", seed=0, spec=TINY_PREPARE, band=TINY_BAND, progress=False, portable=False)
    assert native["floating_point"] == "native" and native["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert native["model_sha256"] != manifest["model_sha256"]


def test_unreachable_band_fails_clearly_and_writes_nothing(tmp_path, capsys, monkeypatch):
    spec = PrepareSpec(**{**TINY_PREPARE.__dict__, "warm_start_max_steps": 40})
    with pytest.raises(BandMissed, match=r"stopped at its 40 steps with greedy validation accuracy .*below the band"):
        prepare(tmp_path / "w", seed=0, spec=spec, band=(0.95, 1.0), progress=False, portable=False)
    assert not (tmp_path / "w" / MANIFEST).exists() and not (tmp_path / "w" / ".prepare-tmp").exists()
    # the CLI passes the task's spec: the test's small one stands in for it; the portable child process's miss is
    # raised here
    small = spec
    monkeypatch.setattr(
        "verl_sat.embedded.prepare.prepare",
        lambda workdir, seed, spec, band, portable: prepare(
            workdir, seed, spec=small, band=band, progress=False, portable=portable
        ),
    )
    assert cli.main(["prepare", "--workdir", str(tmp_path / "w"), "--band", "0.95,1.0"]) == 1
    err = capsys.readouterr().err
    assert "the warm start missed its band: the warm start stopped at its 40 steps" in err
    native = tmp_path / "native"
    assert cli.main(["prepare", "--workdir", str(native), "--band", "0,1", "--native-floating-point"]) == 0
    assert json.loads((native / MANIFEST).read_text())["floating_point"] == "native"
    with pytest.raises(SystemExit):
        cli.main(["prepare", "--band", "0.6,0.2"])


def test_another_seed_draws_other_problems():
    other = make_problems(1, 9, 2, {"train": 60, "val": 20, "test": 20})["test"]
    assert [p.terms for p in other] != [p.terms for p in make_problems(0, 9, 2, {"train": 60, "val": 20,
                                                                               "test": 20})["test"]]  # fmt: skip
