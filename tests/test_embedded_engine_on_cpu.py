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
"""``verl-sat train`` at test size: reproducible by seed, both lag regimes exact, sampling-time log-probs and routes,
KL and TIS through verl's own code, the staleness split, verl's behaviours (non-finite gradients, loggers, resume and
extension), every Table 1 row, every remedy comparison row through verl's losses and rollout correction, and the
documented errors."""

import json
import shutil

import pytest
import torch
from conftest import ICEPOP, REMEDIES, actor_config
from transformers import AutoModelForCausalLM, AutoTokenizer
from verl.trainer.ppo.core_algos import agg_loss, kl_penalty
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask
from verl.workers.utils import losses as verl_losses

from verl_sat import cli
from verl_sat.embedded import attribution, ppo_update, run_files
from verl_sat.embedded import train as train_module
from verl_sat.embedded.decode import generate
from verl_sat.embedded.rollout import PromptSet
from verl_sat.embedded.run_config import EmbeddedConfigError, compose_train_config
from verl_sat.embedded.train import TIMING_PREFIXES, train
from verl_sat.recipe_catalog import PAPER_TABLE_1, REMEDY_ROWS
from verl_sat.routing_replay import RoutingReplay

# 2 prompts per optimizer step at every lag, 4 responses each
SMALL = ["data.train_batch_size='${verl_sat.lag_batch:2,${trainer.v1.trainer_mode},"
         "${trainer.v1.separate_async.parameter_sync_step}}'", "actor_rollout_ref.rollout.n=4",
         "actor_rollout_ref.rollout.val_kwargs.n=2", "actor_rollout_ref.actor.optim.lr=1e-2",
         "data.max_response_length=8"]  # fmt: skip
PAPER_LAG = {1: ["+lag=lag1"], 3: ["+lag=lag1", "trainer.v1.separate_async.parameter_sync_step=3"]}
FIXED_LAG_3 = ["+lag=fixed8", "trainer.v1.separate_async.num_warmup_batches=3",
               "trainer.v1.sampler.max_off_policy_threshold=4"]  # fmt: skip


def run(workdir, *overrides, steps=3, **freqs):
    args = [*SMALL, f"trainer.total_training_steps={steps}", f"trainer.test_freq={freqs.get('test', steps)}",
            f"trainer.save_freq={freqs.get('save', steps)}", *overrides]  # fmt: skip
    config, settings = compose_train_config(workdir, args)
    summary = train(config, settings, progress=False)
    return settings, summary, run_files.read_metrics(settings.run_dir / "metrics.jsonl")


def final_weights(settings):
    return torch.load(run_files.checkpoints(settings.run_dir / "checkpoints")[-1], weights_only=True)["model"]


def without_timings(records, drop=()):
    return [{k: v for k, v in r.items() if not k.startswith((*TIMING_PREFIXES, *drop))} for r in records]


# ---- reproducible by seed ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lag", [["+lag=sync"], PAPER_LAG[1] + ["trainer.v1.separate_async.parameter_sync_step=2"],
                                 FIXED_LAG_3], ids=["sync", "paper-lag-2", "fixed-lag-3"])  # fmt: skip
def test_same_seed_same_metrics(tiny_workdir, lag):
    """The same seed and config give bit-identical metrics (timings aside) and weights, at any lag."""
    name = lag[-1].rsplit("=", 1)[-1]
    first = run(tiny_workdir, "+recipe=sat_gspo_r3", *lag, f"trainer.experiment_name=rep-a-{name}", steps=4, test=2)
    second = run(tiny_workdir, "+recipe=sat_gspo_r3", *lag, f"trainer.experiment_name=rep-b-{name}", steps=4, test=2)
    assert without_timings(first[2]) == without_timings(second[2])
    a, b = final_weights(first[0]), final_weights(second[0])
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = run(tiny_workdir, "+recipe=sat_gspo_r3", *lag, "data.seed=1", f"trainer.experiment_name=rep-c-{name}",
                steps=4, test=2)  # fmt: skip
    assert without_timings(other[2]) != without_timings(first[2])


def test_losses_with_identical_gradients_give_identical_runs(tiny_workdir):
    """sat_gspo with a floor above every possible q gates nothing, so its gradients are gspo's: the runs match (all
    but SAT's own metrics and the gate diagnostic, which for gspo reports what SAT would gate)."""
    gspo_settings, _, gspo = run(tiny_workdir, "+recipe=gspo", *PAPER_LAG[1], "trainer.experiment_name=same-gspo",
                                 steps=4)  # fmt: skip
    sat_settings, _, sat = run(tiny_workdir, "+recipe=sat_gspo", *PAPER_LAG[1], "trainer.experiment_name=same-sat",
                               "actor_rollout_ref.actor.policy_loss.sat.floor=1e9", steps=4)  # fmt: skip
    assert all(r.get("actor/sat_gate_rate", 0.0) == 0.0 for r in sat)
    drop = ("actor/sat_", "staleness/gated_policy_dominant_frac")
    sat_records, gspo_records = without_timings(sat, drop=drop), without_timings(gspo, drop=drop)
    assert [r.keys() for r in sat_records] == [r.keys() for r in gspo_records]
    for mine, verls in zip(sat_records, gspo_records, strict=True):
        for key, value in mine.items():  # SAT's fractions are exact count ratios, verl's float32 means
            expected = pytest.approx(verls[key], rel=1e-6) if isinstance(value, float) else verls[key]
            assert value == expected, key
    a, b = final_weights(gspo_settings), final_weights(sat_settings)
    assert all(torch.equal(a[k], b[k]) for k in a)


# ---- sampling-time log-probs and routes ----------------------------------------------------------------------------


def test_sampling_time_log_probs_and_routes(tiny_workdir):
    """mu is the tempered log-softmax of the decode step that sampled each token, and the recorded routes are the
    routers' own choices in those forwards."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_workdir / "model")
    model = AutoModelForCausalLM.from_pretrained(tiny_workdir / "model").to(torch.bfloat16).eval()
    prompts = PromptSet.load(str(tiny_workdir / "data" / "train.parquet"), tokenizer)
    logits_seen, routes_seen = [], []
    model.register_forward_hook(lambda module, args, kwargs, out: logits_seen.append(out.logits[:, -1].float()),
                                with_kwargs=True)  # fmt: skip
    routers = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeTopKRouter"]
    for layer, router in enumerate(routers):
        router.register_forward_hook(lambda m, args, out, layer=layer: routes_seen.append((layer, out[2].clone())))
    routing = RoutingReplay.attach(model)
    temperature, rows = 0.7, prompts.prompt_ids[:6]
    out = generate(model, rows, tokenizer.pad_token_id, tokenizer.eos_token_id, 8, temperature,
                   generator=torch.Generator().manual_seed(0), routing=routing)  # fmt: skip
    steps = out.response_mask.shape[1]
    for t in range(min(len(logits_seen), steps)):
        expected = (
            torch.log_softmax(logits_seen[t] / temperature, -1)
            .gather(-1, out.input_ids[:, out.prompt_len + t, None])
            .squeeze(-1)
        )
        valid = out.response_mask[:, t]
        assert torch.equal(out.log_probs[valid, t], expected[valid])
    forwards = len(logits_seen)
    for call in range(forwards):  # prefill: the prompt's positions; then one position per decode step
        for layer in range(len(routers)):
            chosen = routes_seen[call * len(routers) + layer][1].view(len(rows), -1, routing.top_k)
            start = 0 if call == 0 else out.prompt_len + call - 1
            recorded = out.routed_experts[:, start : start + chosen.shape[1], layer].long()
            live = out.attention_mask[:, start : start + chosen.shape[1]]
            assert torch.equal(recorded[live], chosen[live])


# ---- both lag regimes ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lag,versions,gaps",
    [
        (PAPER_LAG[1], [0, 0, 1, 2, 3], [[0], [1], [1], [1], [1]]),
        (PAPER_LAG[3], [0, 0, 1, 2, 3], [[0, 1, 2], [3, 4, 5], [3, 4, 5], [3, 4, 5], [3, 4, 5]]),
        (FIXED_LAG_3, [0, 0, 0, 0, 1], [[0], [1], [2], [3], [3]]),
    ],
    ids=["paper-lag-1", "paper-lag-3", "fixed-lag-3"],
)
def test_realised_gaps_are_exact(tiny_workdir, lag, versions, gaps):
    """Paper lag n: n optimizer steps per broadcast, rollout one batch ahead, gaps n..2n-1 (0..n-1 first); fixed lag L:
    exactly L from step L + 1 on. The batch of a paper-lag-n step holds n mini-batches of the same size."""
    name = "-".join(a.rsplit("=", 1)[-1] for a in lag)
    _, _, records = run(tiny_workdir, "+recipe=grpo", *lag, f"trainer.experiment_name=gaps-{name}", steps=5, test=5)
    steps = [r for r in records if r["step"] > 0]
    assert [r["rollout/policy_version"] for r in steps] == versions
    assert [r["rollout/optimizer_step_gaps"] for r in steps] == gaps
    assert all(r["actor/optimizer_steps"] == len(gaps[0]) for r in steps)
    assert [r[run_files.OPTIMIZER_STEP] for r in steps] == [len(gaps[0]) * r["step"] for r in steps]


@pytest.mark.parametrize(("lag", "batch", "trainer_steps"), [("sync", 16, 200), ("lag1", 16, 200), ("lag8", 128, 25),
                                                              ("fixed8", 16, 200)])  # fmt: skip
def test_embedded_defaults_keep_the_optimizer_step_across_lags(tiny_workdir, lag, batch, trainer_steps):
    """16 prompts per optimizer step, 200 optimizer steps at every lag (evaluation and checkpoints every 40), at
    the calibrated learning rate."""
    config, settings = compose_train_config(tiny_workdir, ["+recipe=grpo", f"+lag={lag}"])
    per_step = settings.schedule.sync_steps
    assert (config.data.train_batch_size, config.actor_rollout_ref.actor.ppo_mini_batch_size) == (batch, 16)
    assert (settings.total_steps, settings.total_steps * per_step) == (trainer_steps, 200)
    assert (settings.test_freq * per_step, settings.save_freq * per_step) == (40, 40)
    assert config.actor_rollout_ref.actor.optim.lr == 3e-5


# ---- KL, TIS, attribution ------------------------------------------------------------------------------------------


def test_kl_term_is_verls_kl_penalty(tiny_workdir):
    """The engine feeds verl's ppo_loss; its KL term is verl's kl_penalty aggregated by agg_loss, on a hand-sized
    micro-batch."""
    actor = actor_config("actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.5",
                         "actor_rollout_ref.actor.kl_loss_type=low_var_kl", loss_mode="vanilla")  # fmt: skip
    prompt_len, response = 3, torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    attention = torch.cat([torch.tensor([[0, 1, 1], [1, 1, 1]]), response.long()], dim=1)
    log_prob = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -0.3, 0.0]], requires_grad=True)
    ref = torch.tensor([[-0.7, -0.9, -2.5], [-0.2, -0.1, 0.0]])
    fields = {"prompts": torch.ones(2, prompt_len, dtype=torch.long), "responses": torch.ones(2, 3, dtype=torch.long),
              "attention_mask": attention, "response_mask": response.long(), "old_log_probs": log_prob.detach(),
              "advantages": torch.tensor([[1.0] * 3, [-1.0] * 3]), "ref_log_prob": ref}  # fmt: skip
    info = {"dp_size": 1, "batch_num_tokens": 5, "global_batch_size": 2}
    loss, metrics = ppo_update.micro_batch_loss(actor, log_prob, None, fields, info, prompt_len)
    mask = response.bool()
    expected_kl = agg_loss(kl_penalty(log_prob.detach(), ref, "low_var_kl"), mask, actor.loss_agg_mode,
                           batch_num_tokens=5, global_batch_size=2, dp_size=1)  # fmt: skip
    assert metrics["kl_loss"].aggregate() == pytest.approx(float(expected_kl))
    assert float(loss) == pytest.approx(metrics["actor/pg_loss"].aggregate() + 0.5 * float(expected_kl))


def record_correction_and_loss_calls(monkeypatch) -> tuple[list, list]:
    """Record, unchanged, every call of verl's rollout-correction helper (kwargs, result) and the fields of every
    micro-batch loss."""
    calls, losses = [], []
    real_helper, real_loss = ppo_update.compute_rollout_correction_and_rejection_mask, ppo_update.micro_batch_loss

    def helper(**kwargs):
        out = real_helper(**kwargs)
        calls.append((kwargs, out))
        return out

    def loss(actor, log_prob, entropy, fields, info, prompt_len):
        losses.append(fields)
        return real_loss(actor, log_prob, entropy, fields, info, prompt_len)

    monkeypatch.setattr(ppo_update, "compute_rollout_correction_and_rejection_mask", helper)
    monkeypatch.setattr(ppo_update, "micro_batch_loss", loss)
    return calls, losses


def test_tis_weights_are_verls_helper(tiny_workdir, monkeypatch):
    """Decoupled mode: old_log_prob is the trainer's own log-prob at the start of the sync cycle (before the update),
    and the IS weights passed to the loss are what verl's rollout-correction helper returns for it and mu."""
    calls, losses = record_correction_and_loss_calls(monkeypatch)
    _, _, records = run(tiny_workdir, "+recipe=grpo_tis", *PAPER_LAG[1], "trainer.experiment_name=tis", steps=1)
    (kwargs, (weights, _, _)), fields = calls[0], losses[0]
    assert kwargs["rollout_is"] == "token" and kwargs["rollout_is_threshold"] == 2.0
    assert torch.equal(fields["rollout_is_weights"], weights.batch["rollout_is_weights"])
    assert torch.equal(fields["old_log_probs"], kwargs["old_log_prob"])
    assert not torch.equal(kwargs["old_log_prob"], kwargs["rollout_log_prob"])  # fp32 trainer vs bf16 decode
    again = compute_rollout_correction_and_rejection_mask(**kwargs)[0].batch["rollout_is_weights"]
    assert torch.equal(again, fields["rollout_is_weights"])
    assert any(k.startswith("rollout_corr/") for k in records[-1])


def test_staleness_split_sums_to_d_and_is_zero_on_policy(tiny_workdir, monkeypatch):
    """Δπ + Δimpl = log pi(j) - log mu on every active token; at lag 0 the first mini-batch of a step trains the
    weights that sampled it, so Δπ is exactly 0 there. With rollout.dtype=float32 the rollout samples with the
    trainer's own weights, and Δimpl is float32 rounding (incremental decode against the full forward), far below
    bf16's."""
    seen = []
    real_add = attribution.StalenessSplit.add

    def add(self, log_prob, at_version, rollout, mask, gated):
        policy, engine = real_add(self, log_prob, at_version, rollout, mask, gated)
        seen.append((log_prob, rollout, mask, policy, engine))
        return policy, engine

    monkeypatch.setattr(attribution.StalenessSplit, "add", add)
    _, _, records = run(tiny_workdir, "+recipe=sat_grpo", "+lag=sync", "trainer.experiment_name=split0", steps=3)
    for log_prob, rollout, mask, policy, engine in seen:
        assert torch.allclose((policy + engine)[mask], (log_prob - rollout)[mask], atol=1e-6)
        assert torch.equal(policy[mask], torch.zeros_like(policy[mask]))  # one mini-batch per step at lag 0
        assert engine[mask].abs().max() > 0  # bf16 decode against the fp32 trainer
    assert all(r["staleness/policy_abs_mean"] == 0.0 and r["staleness/engine_abs_mean"] > 0 for r in records[1:])
    _, _, fp32 = run(tiny_workdir, "+recipe=sat_grpo", "+lag=sync", "actor_rollout_ref.rollout.dtype=float32",
                     "trainer.experiment_name=split0_fp32", steps=1)  # fmt: skip
    assert fp32[1]["staleness/policy_abs_mean"] == 0.0
    assert fp32[1]["staleness/engine_abs_mean"] < 1e-3 * records[1]["staleness/engine_abs_mean"]
    seen.clear()
    _, _, lagged = run(tiny_workdir, "+recipe=sat_grpo", *PAPER_LAG[3], "trainer.experiment_name=split3", steps=3)
    assert all(torch.allclose((p + e)[m], (lp - mu)[m], atol=1e-6) for lp, mu, m, p, e in seen)
    assert lagged[-1]["staleness/policy_abs_mean"] > 0 and 0.0 <= lagged[-1]["staleness/gated_policy_dominant_frac"]


# ---- verl's behaviours ---------------------------------------------------------------------------------------------


def test_non_finite_gradient_skips_the_step(tiny_workdir, monkeypatch):
    real = ppo_update.advantages
    monkeypatch.setattr(ppo_update, "advantages", lambda batch, algo: real(batch, algo) * float("nan"))
    settings, _, records = run(tiny_workdir, "+recipe=grpo", "+lag=sync", "trainer.experiment_name=nan", steps=2)
    initial = AutoModelForCausalLM.from_pretrained(tiny_workdir / "model").state_dict()
    weights = final_weights(settings)
    assert all(torch.equal(weights[k], initial[k]) for k in initial)
    assert [r["actor/skipped_optimizer_steps"] for r in records[1:]] == [1, 1]


def test_loggers_go_through_verls_tracking(tiny_workdir):
    settings, _, records = run(tiny_workdir, "+recipe=grpo", "+lag=sync", "trainer.experiment_name=loggers",
                               "trainer.logger=[console,tensorboard,file]", steps=2)  # fmt: skip
    lines = [json.loads(line) for line in (settings.run_dir / "file_logger" / "from_step_1.jsonl").open()]
    assert [line["step"] for line in lines] == [0, 1, 2]
    assert lines[-1]["data"]["reward/mean"] == records[-1]["reward/mean"]
    assert list((settings.run_dir / "tensorboard").glob("events.out.tfevents.*"))
    with pytest.raises(EmbeddedConfigError, match=r"trainer.logger=\['nope'\]|trainer.logger"):
        run(tiny_workdir, "+recipe=grpo", "trainer.experiment_name=bad-logger", "trainer.logger=[nope]", steps=1)


def test_offline_wandb_goes_through_verls_tracking(tiny_workdir, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    settings, _, records = run(tiny_workdir, "+recipe=grpo", "+lag=sync", "trainer.experiment_name=wandb",
                               "trainer.logger=[console,wandb]", steps=1)  # fmt: skip
    (events,) = (settings.run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    assert b"reward/mean" in events.read_bytes() and b"verl_sat_embedded" in events.read_bytes()


def test_resume_after_interruption(tiny_workdir, monkeypatch):
    name = ["+recipe=sat_gspo", "+lag=lag1", "trainer.experiment_name=resume", "trainer.max_actor_ckpt_to_keep=2"]
    real_step, calls = train_module.train_step, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr(train_module, "train_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(tiny_workdir, *name, steps=6, test=2, save=2)
    run_dir = tiny_workdir / "runs" / "resume"
    assert [p.name for p in run_files.checkpoints(run_dir / "checkpoints")] == ["global_step_2.pt"]
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "reward/me')  # a line cut by a crash
    monkeypatch.setattr(train_module, "train_step", real_step)
    _, summary, records = run(tiny_workdir, *name, steps=6, test=2, save=2)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5, 6]  # step 3 redone once, nothing duplicated
    assert [r["step"] for r in records if run_files.ACCURACY in r] == [0, 2, 4, 6]
    assert [r["rollout/version_gap"] for r in records[1:]] == [0, 1, 1, 1, 1, 1]
    assert [p.name for p in run_files.checkpoints(run_dir / "checkpoints")] == ["global_step_4.pt", "global_step_6.pt"]
    assert not list(run_dir.rglob("*.tmp"))
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    _, again, records_again = run(tiny_workdir, *name, steps=6, test=2, save=2)  # finished: nothing re-run
    assert again == summary and records_again == records
    # the resumed run is the uninterrupted one, bit for bit
    _, _, straight = run(tiny_workdir, *name[:2], "trainer.experiment_name=straight", steps=6, test=2, save=2)
    assert without_timings(straight) == without_timings(records)


def test_a_finished_run_is_extended_by_a_larger_step_count(tiny_workdir):
    name = ["+recipe=grpo", *PAPER_LAG[1], "trainer.experiment_name=extend"]
    run(tiny_workdir, *name, steps=2)
    settings, summary, records = run(tiny_workdir, *name, steps=4, test=1, save=2)  # new total and frequencies
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4] and summary["steps_done"] == 4
    assert [r["step"] for r in records if run_files.ACCURACY in r] == [0, 2, 3, 4]
    with pytest.raises(EmbeddedConfigError, match=r"actor_rollout_ref\.actor\.optim\.lr"):
        run(tiny_workdir, *name, "actor_rollout_ref.actor.optim.lr=0.5", steps=5)


def test_evaluation_on_the_optimizer_step_grid_inside_trainer_steps(tiny_workdir):
    """``embedded_engine.eval_every_optimizer_steps`` evaluates between the optimizer steps of a trainer step (paper
    lag 3: 3 optimizer steps per trainer step), once at the last, and leaves training bit-identical."""
    lag = PAPER_LAG[3]
    settings, summary, records = run(tiny_workdir, "+recipe=gspo", *lag, "trainer.experiment_name=grid",
                                     "embedded_engine.eval_every_optimizer_steps=2", steps=3)  # fmt: skip
    evals = [(run_files.optimizer_step(r), r["step"]) for r in records if run_files.ACCURACY in r]
    assert evals == [(0, 0), (2, 1), (4, 2), (6, 2), (8, 3), (9, 3)]  # 9: the last, off the grid
    trained = [r for r in records if run_files.STEP_SECONDS in r]
    assert [r[run_files.OPTIMIZER_STEP] for r in trained] == [3, 6, 9]
    assert summary["last_step"] == 9 and summary["best_step"] in (0, 2, 4, 6, 8, 9)
    plain_settings, _, plain = run(tiny_workdir, "+recipe=gspo", *lag, "trainer.experiment_name=grid-off", steps=3)
    drop = (run_files.ACCURACY,)
    assert without_timings(trained, drop) == without_timings([r for r in plain if r["step"] > 0], drop)
    a, b = final_weights(settings), final_weights(plain_settings)
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(EmbeddedConfigError, match=r"embedded_engine\.eval_every_optimizer_steps=0"):
        compose_train_config(tiny_workdir, [*SMALL, "+recipe=gspo", "embedded_engine.eval_every_optimizer_steps=0"])


def test_collapse_step_is_the_first_evaluation_that_stays_below_half_the_best():
    evals = [(0, 0.2), (16, 0.4), (32, 0.1), (48, 0.3), (64, 0.19), (80, 0.15)]
    assert run_files.collapse_step(evals) == 64  # 0.3 at 48 is above half of 0.4; from 64 on, below
    assert run_files.collapse_step(evals[:4]) is None
    assert run_files.collapse_step([(0, 0.2)]) is None and run_files.collapse_step([]) is None
    records = [{"step": i, run_files.OPTIMIZER_STEP: s, run_files.ACCURACY: a} for i, (s, a) in enumerate(evals)]
    summary = run_files.summarize(records, total_steps=5)
    assert summary["collapsed"] and summary["collapse_step"] == 64 and summary["best_step"] == 16


# ---- every Table 1 row ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", list(PAPER_TABLE_1))
def test_every_table1_row_trains(tiny_workdir, recipe):
    settings, summary, records = run(tiny_workdir, f"+recipe={recipe}", *PAPER_LAG[1], steps=2)
    last = records[-1]
    assert summary["steps_done"] == 2 and 0.0 <= summary["best_accuracy"] <= 1.0
    initial = AutoModelForCausalLM.from_pretrained(tiny_workdir / "model").state_dict()
    weights = final_weights(settings)
    assert any(not torch.equal(weights[k], initial[k]) for k in initial)
    assert "kl_loss" in last and last["actor/mismatch_abs_log_ratio"] > 0  # the paper's KL, every row
    assert ("actor/sat_gate_rate" in last) == recipe.startswith("sat_")
    assert ("actor/r3_route_flip_frac" in last) == recipe.endswith("_r3")
    assert any(k.startswith("rollout_corr/") for k in last) == ("tis" in recipe)
    for key in ("staleness/policy_abs_mean", "staleness/engine_p90", "staleness/gated_policy_dominant_frac"):
        assert key in last
    assert (settings.run_dir / "curves.png").stat().st_size > 0


def test_token_row_gates_where_the_papers_sequence_scores_cannot(tiny_workdir):
    """Two sequences per micro-batch (``ppo_micro_batch_size_per_gpu=2``): the paper's SAT-GSPO row is structurally
    empty in every micro-batch and trains exactly as GSPO, while the per-token rows gate, and the carried quantile
    can act once its ring holds enough sequences and gates within four steps (and the attribution's gate is the
    loss's). The carried row runs four steps: its gate compares a step's scores with the earlier steps' it carries,
    and at a step whose samples are no staler than those (step 2, where step 1 changed the weights little on one
    machine: mismatch 0.0004 against 0.0010) it can gate nothing; it gated at step 3 there."""
    micro = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"
    runs = {recipe: run(tiny_workdir, f"+recipe={recipe}", *PAPER_LAG[1], micro,
                        f"trainer.experiment_name=micro2-{recipe}", steps=4 if recipe == "sat_gspo_carried" else 2)[1:]
            for recipe in ("gspo", "sat_gspo", "sat_gspo_token", "sat_gspo_ratio_side",
                           "sat_gspo_carried")}  # fmt: skip
    paper = runs["sat_gspo"][1]
    for _, records in runs.values():
        assert all(r["actor/sat_seqs_per_micro_batch"] == 2.0 for r in records if "actor/sat_gate_rate" in r)
    assert all(r["actor/sat_structurally_empty_frac"] == 1.0 and r["actor/sat_gate_rate"] == 0.0
               for r in paper if "actor/sat_gate_rate" in r)  # fmt: skip
    for recipe in ("sat_gspo_token", "sat_gspo_ratio_side"):
        token = runs[recipe][1]
        assert all(r["actor/sat_structurally_empty_frac"] == 0.0 for r in token if "actor/sat_gate_rate" in r)
        assert any(r["actor/sat_gate_rate"] > 0 for r in token if "actor/sat_gate_rate" in r)
    carried = [r for r in runs["sat_gspo_carried"][1] if "actor/sat_gate_rate" in r]
    assert all(r["actor/sat_structurally_empty_frac"] == 0.0 for r in carried[1:])
    assert any(r["actor/sat_gate_rate"] > 0 for r in carried)
    gspo_summary, sat_summary = runs["gspo"][0], runs["sat_gspo"][0]
    assert sat_summary["last_epoch_mismatch"] == pytest.approx(gspo_summary["last_epoch_mismatch"], rel=1e-5)


def test_dynamic_batching_packs_micro_batches_as_verls_engine(tiny_workdir, monkeypatch):
    """``use_dynamic_bsz``: each mini-batch is split by verl's ``prepare_micro_batches`` into
    ``ceil(tokens / budget)`` micro-batches, every one within the token budget, together the mini-batch; the forward
    trimmed to a micro-batch's longest response gives the untrimmed forward's log-probs; the metrics count what was
    formed."""
    seen = []
    real = ppo_update.micro_batches

    def spy(batch, rows, actor, micro):
        parts = real(batch, rows, actor, micro)
        seen.append((batch, rows, parts))
        return parts

    monkeypatch.setattr(ppo_update, "micro_batches", spy)
    budget = 64
    _, _, records = run(tiny_workdir, "+recipe=gspo", *PAPER_LAG[1], "actor_rollout_ref.actor.use_dynamic_bsz=true",
                        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}",
                        "trainer.experiment_name=dynamic-bsz", steps=2)  # fmt: skip
    assert seen
    for batch, rows, parts in seen:
        tokens = batch.attention_mask[rows].sum(-1)
        assert sorted(torch.cat(parts).tolist()) == sorted(rows.tolist())
        assert all(int(batch.attention_mask[part].sum()) <= budget for part in parts)
        assert len(parts) == min(len(rows), -(-int(tokens.sum()) // budget)) > 1
    steps = [r for r in records if "perf/micro_batches" in r]
    assert [r["perf/micro_batches"] for r in steps] == [len(parts) for _, _, parts in seen]
    assert [r["perf/max_sequences_per_micro_batch"] for r in steps] == [max(map(len, p)) for _, _, p in seen]
    model = AutoModelForCausalLM.from_pretrained(tiny_workdir / "model", torch_dtype=torch.float32)
    batch, _, parts = seen[-1]
    for part in parts:
        full, _ = ppo_update.forward(ppo_update.Policy(model), batch, part, 1.0)
        trimmed, _ = ppo_update.forward(ppo_update.Policy(model), batch, part, 1.0, trim=True)
        mask, longest = batch.response_mask[part], int(batch.response_mask[part].sum(-1).max())
        assert torch.allclose(full[mask], trimmed[mask], atol=1e-6) and bool((trimmed[:, longest:] == 0).all())


# ---- the remedy comparison rows ------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", REMEDY_ROWS)
def test_every_remedy_row_trains_through_verl(tiny_workdir, monkeypatch, recipe):
    """A remedy row trains with the registered loss verl's ppo_loss looks up for it. A rollout-correction row runs in
    decoupled mode: verl's helper gets the preset's keys, its IS weights and rejection mask are what the loss gets,
    and its metrics (the preset's own: IcePop's out-of-bounds ratio, each rejection option's masked fraction) are
    logged. A loss row stays in its base row's bypass mode: no correction."""
    remedy, looked_up = REMEDIES[recipe], []
    real_lookup = verl_losses.get_policy_loss_fn

    def lookup(name):
        looked_up.append(name)
        return real_lookup(name)

    monkeypatch.setattr(verl_losses, "get_policy_loss_fn", lookup)
    calls, losses = record_correction_and_loss_calls(monkeypatch)
    settings, summary, records = run(tiny_workdir, f"+recipe={recipe}", *PAPER_LAG[1], steps=1)
    last = records[-1]
    assert summary["steps_done"] == 1 and last["actor/mismatch_abs_log_ratio"] > 0
    assert set(looked_up) == {remedy.loss_mode} and ("actor/sat_gate_rate" in last) == recipe.startswith("sat_")
    if remedy.correction is None:
        assert settings.bypass_mode and calls == [] and not any(k.startswith("rollout_corr/") for k in last)
        return
    (kwargs, (weights, mask, metrics)), (fields,) = calls[0], losses
    preset = remedy.correction_keys()
    assert not settings.bypass_mode and len(calls) == 1
    assert {k: kwargs[k] for k in settings.rollout_correction} == {k: preset[k] for k in settings.rollout_correction}
    assert torch.equal(fields["old_log_probs"], kwargs["old_log_prob"])  # pi_old, recomputed by the trainer
    assert torch.equal(fields["response_mask"], mask.long())  # the rejection mask
    if preset["rollout_is"] is None:
        assert weights is None and "rollout_is_weights" not in fields
    else:
        assert torch.equal(fields["rollout_is_weights"], weights.batch["rollout_is_weights"])
    assert {k: last[k] for k in metrics} == metrics
    own = [f"rollout_corr/rollout_rs_{preset['rollout_rs']}_masked_fraction"] if preset["rollout_rs"] else []
    own += ["rollout_corr/rollout_is_oob_ratio"] if remedy.correction is ICEPOP else []
    assert own and all(key in metrics for key in own)
    if recipe == "gspo_geo_rs":  # +-0.1 % rejects even at gap 0, on the bf16 decode's mismatch alone
        assert 0 < last[own[0]] and int(mask.sum()) < int(kwargs["response_mask"].sum())


# ---- errors --------------------------------------------------------------------------------------------------------


def cli_error(capsys, *argv):
    assert cli.main(list(argv)) == 2
    return capsys.readouterr().err


def test_unknown_recipe_lists_the_valid_ones(tiny_workdir, capsys):
    err = cli_error(capsys, "train", "--workdir", str(tiny_workdir), "+recipe=sat_gpso")
    assert "sat_gpso" in err and "sat_gspo_r3" in err and "grpo_tis" in err


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
     ("trainer.v1.separate_async.hybrid_rollout.enable_switch=true",
      "trainer.v1.separate_async.hybrid_rollout.enable_switch"),  # behind a prefix verl-sat no longer lets through
     ("actor_rollout_ref.actor.policy_loss.sat.quantile=0.5", "actor_rollout_ref.actor.policy_loss.sat.quantile"),
     ("actor_rollout_ref.rollout.top_p=0.9", "actor_rollout_ref.rollout.top_p"),
     ("actor_rollout_ref.rollout.dtype=float16", "actor_rollout_ref.rollout.dtype"),
     ("actor_rollout_ref.actor.optim.lr_warmup_steps=10", "actor_rollout_ref.actor.optim.lr_warmup_steps"),
     ("trainer.v1.trainer_mode=colocate_async", "trainer.v1.trainer_mode"),
     ("trainer.v1.sampler.max_off_policy_threshold=3", "trainer.v1.sampler.max_off_policy_threshold"),
     ("data.train_batch_size=5", "data.train_batch_size"),
     ("trainer.device=cuda:0", "trainer.device")],
)  # fmt: skip
def test_unread_or_bad_keys_are_named(tiny_workdir, override, named):
    lag = [] if "trainer_mode" in override else ["+lag=lag8"]
    if named == "trainer.device" and torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(EmbeddedConfigError, match=named.replace(".", r"\.")):
        compose_train_config(tiny_workdir, ["+recipe=grpo", *lag, override])


def test_rerun_with_another_config_is_refused(tiny_workdir):
    run(tiny_workdir, "+recipe=grpo", "trainer.experiment_name=fixed", steps=1)
    with pytest.raises(EmbeddedConfigError, match=r"actor_rollout_ref\.actor\.clip_ratio_high"):
        run(tiny_workdir, "+recipe=grpo", "trainer.experiment_name=fixed",
            "actor_rollout_ref.actor.clip_ratio_high=0.3", steps=1)  # fmt: skip


def test_prompt_order_is_seeded_and_covers_the_split(tiny_workdir):
    prompts = PromptSet.load(
        str(tiny_workdir / "data" / "train.parquet"), AutoTokenizer.from_pretrained(tiny_workdir / "model")
    )
    epoch = [i for step in range(1, 16) for i in prompts.for_step(step, 4, seed=0)]
    assert sorted(epoch) == list(range(len(prompts)))  # 60 prompts = 15 steps of 4: each once per epoch
    assert prompts.for_step(3, 4, seed=0) == prompts.for_step(3, 4, seed=0) != prompts.for_step(3, 4, seed=1)


def test_summary_rule_by_hand():
    records = [{"step": 0, run_files.ACCURACY: 0.2},
               *({"step": s, run_files.MISMATCH: 0.1 * s, run_files.POLICY_LAG: 0.05 * s} for s in range(1, 11)),
               {"step": 5, run_files.ACCURACY: 0.5}, {"step": 10, run_files.ACCURACY: 0.24}]  # fmt: skip
    summary = run_files.summarize(records, total_steps=10)
    assert (summary["best_accuracy"], summary["best_step"]) == (0.5, 5)
    assert (summary["last_accuracy"], summary["last_step"], summary["initial_accuracy"]) == (0.24, 10, 0.2)
    assert summary["collapsed"] is True  # 0.24 < 0.5 x 0.5
    assert summary["last_epoch_mismatch"] == pytest.approx(1.0)  # mean over the last 10% of 10 steps: step 10
    assert summary["last_policy_lag"] == pytest.approx(0.5) and summary["last_engine_mismatch"] is None
    assert run_files.summarize([*records[:-1], {"step": 10, run_files.ACCURACY: 0.25}], 10)["collapsed"] is False
    assert summary["mean_clip_frac"] is None and summary["seconds_per_optimizer_step"] is None  # nothing trained


def test_summary_run_means_by_hand():
    """Run means average every training step (evaluation excluded); IS out-of-bounds adds both sides; time is per
    optimizer step."""
    clip, high, low = (
        "actor/pg_clipfrac",
        "rollout_corr/rollout_is_ratio_fraction_high",
        "rollout_corr/rollout_is_ratio_fraction_low",
    )
    records = [{"step": 0, run_files.ACCURACY: 0.2},
               {"step": 1, run_files.OPTIMIZER_STEP: 8, run_files.STEP_SECONDS: 4.0, clip: 0.1, high: 0.02, low: 0.01},
               {"step": 2, run_files.OPTIMIZER_STEP: 16, run_files.STEP_SECONDS: 2.0, clip: 0.3, high: 0.04, low: 0.0,
                run_files.ACCURACY: 0.3}]  # fmt: skip
    summary = run_files.summarize(records, total_steps=2)
    assert summary["mean_clip_frac"] == pytest.approx(0.2)
    assert summary["mean_is_out_of_bounds_frac"] == pytest.approx(0.035)
    assert summary["mean_rs_masked_frac"] is None and summary["mean_sat_intercepted_frac"] is None
    assert summary["seconds_per_optimizer_step"] == pytest.approx(6.0 / 16)
