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
"""``verl-sat train`` at test size: exact lag, every recipe family trains through verl's registered losses, SAT and
R3 metrics land in metrics.jsonl, resume after an interruption, and the documented errors."""

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from verl_sat import cli
from verl_sat.embedded import run_files
from verl_sat.embedded import train as train_module
from verl_sat.embedded.run_config import EmbeddedConfigError, compose_train_config
from verl_sat.embedded.train import train

SMALL = ["data.train_batch_size=4", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.val_kwargs.n=2",
         "actor_rollout_ref.actor.optim.lr=1e-2"]  # fmt: skip


def run(workdir, *overrides, steps=3, **freqs):
    args = [*SMALL, f"trainer.total_training_steps={steps}", f"trainer.test_freq={freqs.get('test', steps)}",
            f"trainer.save_freq={freqs.get('save', steps)}", *overrides]  # fmt: skip
    config, settings = compose_train_config(workdir, args)
    summary = train(config, settings, progress=False)
    return settings, summary, run_files.read_metrics(settings.run_dir / "metrics.jsonl")


def final_weights(settings):
    return torch.load(run_files.checkpoints(settings.run_dir / "checkpoints")[-1], weights_only=True)["model"]


@pytest.mark.parametrize(
    ("lag_args", "lag"),
    [(["+lag=sync"], 0), (["+lag=lag1"], 1),
     (["+lag=lag1", "trainer.v1.separate_async.num_warmup_batches=3", "trainer.v1.sampler.max_off_policy_threshold=4"],
      3)],
)  # fmt: skip
def test_lag_is_exact(tiny_workdir, lag_args, lag):
    settings, _, records = run(tiny_workdir, "+recipe=grpo", *lag_args, f"trainer.experiment_name=lag{lag}", steps=6)
    steps = [r for r in records if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert [r["rollout/policy_version"] for r in steps] == [max(0, s - 1 - lag) for s in range(1, 7)]
    assert [r["rollout/version_gap"] for r in steps] == [min(s - 1, lag) for s in range(1, 7)]
    assert all(r["rollout/version_gap"] == lag for r in steps[lag:])  # equal to L after warm-up


@pytest.mark.parametrize(
    ("recipe", "loss_metric"),
    [("grpo", "actor/pg_clipfrac"), ("gspo", "actor/pg_clipfrac"), ("dppo", "actor/pg_clipfrac"),
     ("sat_grpo", "actor/sat_gate_rate"), ("sat_gspo", "actor/sat_gate_rate"), ("gspo_r3", "actor/r3_route_flip_frac"),
     ("sat_grpo_r3", "actor/sat_gate_rate"), ("sat_gspo_r3", "actor/sat_gate_rate")],
)  # fmt: skip
def test_each_recipe_trains_and_logs(tiny_workdir, recipe, loss_metric):
    settings, summary, records = run(tiny_workdir, f"+recipe={recipe}", "+lag=lag1")  # run name RECIPE-lag1-s0
    assert settings.run_dir.name == f"{recipe}-lag1-s0"
    initial = AutoModelForCausalLM.from_pretrained(tiny_workdir / "model").state_dict()
    trained = final_weights(settings)
    assert any(not torch.equal(initial[k], trained[k]) for k in initial), "the weights did not change"
    last = records[-1]
    assert loss_metric in last and "actor/pg_loss" in last and "actor/grad_norm" in last
    if recipe.startswith("sat"):
        for key in ("actor/sat_gate_rate", "actor/sat_q", "actor/sat_eff_lower_radius", "actor/sat_min_factor"):
            assert key in last
        assert 0.0 < last["actor/sat_gate_rate"] < 1.0
    if recipe.endswith("_r3"):
        assert last["actor/r3_layers_replayed"] == 2.0 and 0.0 <= last["actor/r3_route_flip_frac"] < 1.0
    else:
        assert "actor/r3_route_flip_frac" not in last
    assert last["actor/mismatch_abs_log_ratio"] > 0.0  # bf16 rollout vs fp32 trainer: the mismatch is real
    assert summary["steps_done"] == 3 and summary["last_step"] == 3
    assert (settings.run_dir / "curves.png").stat().st_size > 0
    assert list((settings.run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_sync_trains_on_policy_with_engine_mismatch_only(tiny_workdir):
    """At lag 0 the first epoch's ratio differs from 1 only through bf16 vs fp32 (and routing)."""
    _, _, records = run(tiny_workdir, "+recipe=grpo", "+lag=sync", "trainer.experiment_name=sync-mismatch", steps=2)
    first = records[1]
    assert first["rollout/version_gap"] == 0 and 0.0 < first["actor/mismatch_abs_log_ratio"] < 0.05


def test_resume_after_interruption(tiny_workdir, monkeypatch):
    name = ["+recipe=sat_gspo", "+lag=lag1", "trainer.experiment_name=resume", "trainer.max_actor_ckpt_to_keep=2"]
    real_update, calls = train_module.ppo_update, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real_update(*args, **kwargs)

    monkeypatch.setattr(train_module, "ppo_update", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(tiny_workdir, *name, steps=6, test=2, save=2)
    run_dir = tiny_workdir / "runs" / "resume"
    assert [p.name for p in run_files.checkpoints(run_dir / "checkpoints")] == ["global_step_2.pt"]
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "reward/me')  # a line cut by a crash
    monkeypatch.setattr(train_module, "ppo_update", real_update)
    _, summary, records = run(tiny_workdir, *name, steps=6, test=2, save=2)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5, 6]  # step 3 redone once, nothing duplicated
    assert [r["step"] for r in records if run_files.ACCURACY in r] == [0, 2, 4, 6]
    assert [r["rollout/version_gap"] for r in records[1:]] == [0, 1, 1, 1, 1, 1]
    assert [p.name for p in run_files.checkpoints(run_dir / "checkpoints")] == ["global_step_4.pt", "global_step_6.pt"]
    assert not list(run_dir.rglob("*.tmp"))
    assert summary["steps_done"] == 6
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    _, again, records_again = run(tiny_workdir, *name, steps=6, test=2, save=2)  # finished: nothing re-run
    assert again == summary and records_again == records


def test_prompt_order_is_seeded_and_covers_the_split(tiny_workdir):
    from transformers import AutoTokenizer

    from verl_sat.embedded.rollout import PromptSet

    prompts = PromptSet.load(
        str(tiny_workdir / "data" / "train.parquet"), AutoTokenizer.from_pretrained(tiny_workdir / "model")
    )
    epoch = [i for step in range(1, 21) for i in prompts.for_step(step, 4, seed=0)]
    assert sorted(epoch) == list(range(len(prompts)))  # 80 prompts = 20 steps of 4: each once per epoch
    assert prompts.for_step(3, 4, seed=0) == prompts.for_step(3, 4, seed=0) != prompts.for_step(3, 4, seed=1)


def cli_error(capsys, *argv):
    assert cli.main(list(argv)) == 2
    return capsys.readouterr().err


def test_unknown_recipe_lists_the_valid_ones(tiny_workdir, capsys):
    err = cli_error(capsys, "train", "--workdir", str(tiny_workdir), "+recipe=sat_gpso")
    assert "sat_gpso" in err and "sat_gspo_r3" in err and "grpo" in err


def test_missing_and_stale_workdir_name_the_prepare_command(tiny_workdir, tmp_path, capsys):
    err = cli_error(capsys, "train", "--workdir", str(tmp_path / "nowhere"), "+recipe=grpo")
    assert f"verl-sat prepare --workdir {tmp_path / 'nowhere'}" in err
    stale = tmp_path / "stale"
    shutil.copytree(tiny_workdir, stale, ignore=shutil.ignore_patterns("runs"))
    manifest = json.loads((stale / "prepare.json").read_text())
    (stale / "prepare.json").write_text(json.dumps({**manifest, "format": 0}))
    err = cli_error(capsys, "train", "--workdir", str(stale), "+recipe=grpo")
    assert "format 0" in err and f"verl-sat prepare --workdir {stale}" in err


@pytest.mark.parametrize(
    ("override", "named"),
    [("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", "actor_rollout_ref.actor.megatron"),
     ("+actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.use_kl_loss"),
     ("actor_rollout_ref.actor.optim.lr_warmup_steps=10", "actor_rollout_ref.actor.optim.lr_warmup_steps"),
     ("trainer.v1.trainer_mode=colocate_async", "trainer.v1.trainer_mode"),
     ("trainer.v1.sampler.max_off_policy_threshold=3", "trainer.v1.sampler.max_off_policy_threshold"),
     ("actor_rollout_ref.actor.policy_loss.sat.quantile=1.5", "actor_rollout_ref.actor.policy_loss.sat.quantile"),
     ("trainer.device=cuda:0", "trainer.device")],
)  # fmt: skip
def test_unsupported_or_bad_keys_are_named(tiny_workdir, override, named):
    recipe = "+recipe=sat_gspo" if "sat." in override else "+recipe=grpo"
    lag = [] if "trainer_mode" in override else ["+lag=lag8"]
    if named == "trainer.device" and torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(EmbeddedConfigError, match=named.replace(".", r"\.")):
        compose_train_config(tiny_workdir, [recipe, *lag, override])


def test_decoupled_recipe_is_refused(tiny_workdir):
    with pytest.raises(EmbeddedConfigError, match=r"bypass_mode=false"):
        compose_train_config(tiny_workdir, ["+recipe=tis"])


def test_rerun_with_another_config_is_refused(tiny_workdir):
    run(tiny_workdir, "+recipe=grpo", "trainer.experiment_name=fixed", steps=1)
    with pytest.raises(EmbeddedConfigError, match=r"actor\.optim\.lr"):
        run(
            tiny_workdir,
            "+recipe=grpo",
            "trainer.experiment_name=fixed",
            "actor_rollout_ref.actor.optim.lr=0.5",
            steps=1,
        )


def test_summary_rule_by_hand():
    records = [{"step": 0, run_files.ACCURACY: 0.2}, *({"step": s, run_files.MISMATCH: 0.1 * s} for s in range(1, 11)),
               {"step": 5, run_files.ACCURACY: 0.5}, {"step": 10, run_files.ACCURACY: 0.24}]  # fmt: skip
    summary = run_files.summarize(records, total_steps=10)
    assert (summary["best_accuracy"], summary["best_step"]) == (0.5, 5)
    assert (summary["last_accuracy"], summary["last_step"], summary["initial_accuracy"]) == (0.24, 10, 0.2)
    assert summary["collapsed"] is True  # 0.24 < 0.5 x 0.5
    assert summary["last_epoch_mismatch"] == pytest.approx(1.0)  # mean over the last 10% of 10 steps: step 10
    assert run_files.summarize([*records[:-1], {"step": 10, run_files.ACCURACY: 0.25}], 10)["collapsed"] is False
