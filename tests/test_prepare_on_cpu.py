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
"""``verl-sat prepare``: offline, deterministic tokenizer, MoE policy, verl-format task data and warm start."""

import json

import pandas as pd
import pytest
import torch
from conftest import TINY_PREPARE
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.utils.reward_score import default_compute_score

from verl_sat.embedded.prepare import MANIFEST, PrepareSpec, prepare
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


def test_parquet_in_verl_format_read_by_rlhf_dataset(workdir):
    train = pd.read_parquet(workdir / "data" / "train.parquet")
    test = pd.read_parquet(workdir / "data" / "test.parquet")
    assert len(train) == 100 - 20 and len(test) == 20
    train_q = {row[0]["content"] for row in train["prompt"]}
    assert train_q.isdisjoint({row[0]["content"] for row in test["prompt"]})
    row = test.iloc[0]
    a, b = row["extra_info"]["a"], row["extra_info"]["b"]
    assert row["data_source"] == "openai/gsm8k" and row["reward_model"]["ground_truth"] == str(a + b)
    tokenizer = AutoTokenizer.from_pretrained(workdir / "model")
    config = OmegaConf.create({"prompt_key": "prompt", "max_prompt_length": 32, "truncation": "error",
                               "cache_dir": str(workdir / "cache")})  # fmt: skip
    dataset = RLHFDataset(str(workdir / "data" / "train.parquet"), tokenizer, config)
    assert len(dataset) == len(train)
    item = dataset[0]
    assert item["reward_model"]["ground_truth"] == train.iloc[0]["reward_model"]["ground_truth"]


def test_verl_scores_correct_and_wrong_answers(workdir):
    row = pd.read_parquet(workdir / "data" / "test.parquet").iloc[0]
    truth = row["reward_model"]["ground_truth"]
    assert default_compute_score(row["data_source"], f"#### {truth}", truth) == 1.0
    assert default_compute_score(row["data_source"], f"#### {int(truth) + 1}", truth) == 0.0
    assert default_compute_score(row["data_source"], truth, truth) == 0.0  # no "####": format not met


def test_manifest_and_determinism(workdir, tmp_path):
    manifest = json.loads((workdir / MANIFEST).read_text())
    assert manifest["seed"] == 0 and manifest["spec"]["max_operand"] == 9
    assert 0.0 <= manifest["test_accuracy"] <= 1.0 and len(manifest["warm_start_loss_first_last"]) == 2
    prepare(tmp_path / "again", seed=0, spec=TINY_PREPARE)
    prepare(tmp_path / "other", seed=1, spec=TINY_PREPARE)
    same = pd.read_parquet(tmp_path / "again" / "data" / "test.parquet")
    assert same.equals(pd.read_parquet(workdir / "data" / "test.parquet"))
    first = AutoModelForCausalLM.from_pretrained(workdir / "model").state_dict()
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again" / "model").state_dict()
    assert all(torch.equal(first[k], again[k]) for k in first)
    other = pd.read_parquet(tmp_path / "other" / "data" / "test.parquet")
    assert not other.equals(same)
    assert not (tmp_path / "again" / ".prepare-tmp").exists()


def test_warm_start_learns(tmp_path):
    spec = PrepareSpec(max_operand=9, num_test=20, hidden_size=32, num_layers=2, num_experts=4,
                       warm_start_steps=60, warm_start_batch=32, warm_start_lr=3e-3)  # fmt: skip
    manifest = prepare(tmp_path, seed=0, spec=spec)
    first, last = manifest["warm_start_loss_first_last"]
    assert last < 0.5 * first
