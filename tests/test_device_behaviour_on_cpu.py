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
"""The hot paths' device behaviour (SAT property 9), checked on the CPU at the ATen level with
``verl_sat.op_audit.CudaOpAudit``: the SAT losses, forward and backward, read the device once (the metrics) and run
no operator that synchronises or is non-deterministic on CUDA; an R3 forward + backward runs no such operator beyond
the same model's native one and reads at most once more, whatever the number of MoE layers; and both run under
``torch.use_deterministic_algorithms(True)``."""

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import AGG_MODES, LOSS_CASES, QUANTILE_METHODS, actor_config, make_stale_batch, sat_overrides
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from verl.trainer.ppo.core_algos import get_policy_loss_fn

from verl_sat.fsdp_engine import micro_batch_routes
from verl_sat.op_audit import CudaOpAudit
from verl_sat.routing_replay import RoutingReplay

CASES = [(*case, method) for case in LOSS_CASES for method in QUANTILE_METHODS]
CASE_IDS = [f"{c[0]}-{c[1]}-{c[3]}" for c in CASES]
BATCHES = {  # a small micro-batch, 64 x 1024 tokens (the earlier quantile's bincount size), and one past 2^17 (a sort)
    "small": lambda: make_stale_batch(30),
    "large": lambda: make_stale_batch(30, num_prompts=16, group=4, length=1024),
    "sorted": lambda: make_stale_batch(30, num_prompts=32, group=4, length=1100),
}


@pytest.fixture
def deterministic():
    """``torch.use_deterministic_algorithms(True)`` for the test, restored after."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def test_the_audit_sees_each_kind_of_operator():
    x, i = torch.arange(6.0), torch.tensor([2, 0, 1])
    with CudaOpAudit() as audit:
        x.sum().item(), float(x[0]), bool(x[1] > 0), x.tolist(), x.cpu()
        x[x > 2], x.nonzero(), torch.masked_select(x, x > 1), x.unique(), torch.where(x > 2), torch.equal(x, x)
        i.bincount(), i.repeat_interleave(i), x.histc()
        i.bincount(weights=x[:3]), x.cumsum(0), x.kthvalue(2), x.median(0)
        x.reshape(2, 3) @ x.reshape(3, 2)
        # none of these syncs or is non-deterministic on CUDA
        torch.topk(x, 2), x.sort(), torch.searchsorted(x, x), x.gather(0, i), i.cumsum(0), torch.count_nonzero(x)
        torch.nonzero_static(x > 2, size=2), x[i], torch.where(x > 2, x, 0.0), i.repeat_interleave(i, output_size=3)
        torch._assert_async(torch.tensor(True), "never")
    assert audit.reads == ["_local_scalar_dense"] * 3 + ["tolist", "cpu"]
    assert audit.syncing == ["index", "nonzero", "masked_select", "_unique2", "nonzero", "equal", "bincount",
                             "repeat_interleave", "histc", "bincount"]  # fmt: skip
    assert audit.nondeterministic == ["histc", "bincount", "cumsum", "kthvalue", "median"]
    assert audit.cublas == ["mm"]


def test_histc_syncs_only_without_a_range():
    """On CUDA ``histc`` reads the input's min and max back only when its range is empty (``min == max``, 0 and 0 by
    default); it is non-deterministic either way."""
    x, empty = torch.arange(6.0), torch.empty(0)
    with CudaOpAudit() as audit:
        x.histc(4), x.histc(4, 3, 3), torch.histc(x, bins=4, min=1.0, max=1.0 + 1e-9)  # float32: 1.0 == 1.0 + 1e-9
    assert audit.syncing == ["histc"] * 3 and audit.nondeterministic == ["histc"] * 3
    with CudaOpAudit() as audit:
        x.histc(4, 0, 6), torch.histc(x, bins=8, min=-1, max=1), x.double().histc(4, 1.0, 1.0 + 1e-9)
        empty.histc(4)  # nothing to read back
    assert audit.syncing == [] and audit.nondeterministic == ["histc"] * 4


def test_the_audit_sees_every_cublas_product():
    """``addbmm`` (a loop of ``addmm_`` inside its CUDA kernel), ``_scaled_mm`` and ``_int_mm`` (cuBLASLt) are cuBLAS
    products too."""
    m, batch = torch.ones(4, 4), torch.ones(3, 4, 4)
    fp8 = torch.ones(16, 32).to(torch.float8_e4m3fn)
    int8 = torch.ones(32, 32, dtype=torch.int8)
    one = torch.tensor(1.0)
    with CudaOpAudit() as audit:
        torch.addbmm(m, batch, batch)
        torch._scaled_mm(fp8, fp8.t(), one, one, out_dtype=torch.float32)
        torch._int_mm(int8, int8)
    assert audit.cublas == ["addbmm", "_scaled_mm", "_int_mm"]


def test_the_audit_sees_index_reduce_and_scatter_reductions():
    """Under deterministic algorithms on CUDA ``index_reduce_`` raises for every reduction, ``scatter_reduce`` for
    ``prod`` and ``scatter_`` for ``reduce="multiply"`` from a tensor; the sums and means take ``index_put``'s
    deterministic path, a scalar source is deterministic."""
    i, src = torch.tensor([0, 1, 0]), torch.ones(3)
    with CudaOpAudit() as audit:
        src.new_zeros(2).index_reduce_(0, i, src, "prod"), src.new_zeros(2).index_reduce(0, i, src, "amax")
        src.new_zeros(2).scatter_reduce(0, i, src, "prod"), src.new_zeros(2).scatter_reduce_(0, i, src, reduce="prod")
        src.new_zeros(2).scatter_(0, i, src, reduce="multiply"), src.new_zeros(2).scatter(0, i, src, reduce="multiply")
        # deterministic on CUDA
        src.new_zeros(2).scatter_reduce(0, i, src, "sum"), src.new_zeros(2).scatter_reduce(0, i, src, "mean")
        src.new_zeros(2).scatter_(0, i, src, reduce="add"), src.new_zeros(2).scatter_(0, i, 2.0, reduce="multiply")
        src.new_zeros(2).scatter_add(0, i, src), src.new_zeros(2).index_add(0, i, src)
    assert audit.nondeterministic == ["index_reduce_", "index_reduce", "scatter_reduce", "scatter_reduce_",
                                      "scatter_", "scatter"]  # fmt: skip


def test_the_audit_sees_syncs_inside_kernels():
    """Operators that read back inside their CUDA kernel, out of the dispatcher's sight: ``isin`` on its sorting path
    (``_unique``), the linalg error checks (``info`` read on the host) and host-side linalg; not their ``_ex`` forms
    without ``check_errors``, nor what checks nothing. ``randperm`` sorts on the device, ``multinomial`` checks its
    probabilities with device-side asserts."""
    a, b, x, one, probs = torch.eye(3) * 2 + 0.1, torch.ones(3, 2), torch.arange(10), torch.ones(2, 1, 1), torch.ones(4)
    low, many, few = torch.linalg.cholesky(a), torch.arange(50), torch.arange(5)
    with CudaOpAudit() as audit:
        torch.isin(x, many), torch.isin(3, x), torch.isin(x, many, invert=True)
        torch.linalg.inv(a), torch.inverse(a), torch.linalg.solve(a, b), torch.linalg.cholesky(a)
        torch.linalg.lu_factor(a), torch.linalg.ldl_factor(a), torch.linalg.inv_ex(a, check_errors=True)
        torch.cholesky(a), torch.cholesky_inverse(low), torch.linalg.eigh(a), torch.linalg.eigvalsh(a)
        torch.linalg.svd(a), torch.linalg.svdvals(a), torch.linalg.lstsq(a, b), torch.linalg.pinv(a)
        torch.linalg.eig(a), torch.linalg.eigvals(a), torch.linalg.matrix_exp(a)
        # none of these syncs on CUDA
        torch.isin(x, few), torch.isin(x, many, assume_unique=True), torch.isin(x, 3)
        torch.linalg.inv_ex(a), torch.linalg.cholesky_ex(a), torch.linalg.solve_ex(a, b), torch.linalg.lu_factor_ex(a)
        torch.linalg.det(a), torch.linalg.slogdet(a), torch.linalg.qr(a), torch.linalg.lu(a)
        torch.linalg.solve_triangular(low, b, upper=False), torch.linalg.matrix_exp(one)
        torch.randperm(10, device=x.device), torch.multinomial(probs, 2), torch.multinomial(probs, 1, True)
    assert audit.syncing == ["isin", "isin", "isin", "_linalg_check_errors", "_linalg_check_errors",
                             "_linalg_check_errors", "_linalg_check_errors", "_linalg_check_errors",
                             "_linalg_check_errors", "linalg_inv_ex", "cholesky", "cholesky_inverse", "_linalg_eigh",
                             "_linalg_eigh", "_linalg_svd", "_linalg_svd", "linalg_lstsq", "linalg_pinv",
                             "linalg_eig", "linalg_eig", "linalg_matrix_exp"]  # fmt: skip


def test_the_audit_sees_device_transfers():
    """Copies between host and device. To the host (``.to("cpu")``, ``.cpu()``, a list of device tensors made a
    tensor, ``copy_`` into a host tensor) they are reads; to the device (``torch.tensor(data, device=...)``,
    ``new_tensor``, ``.to(device)`` of a host tensor, ``copy_`` from one, a copy across devices) they sync. Tensors
    entering the block are on the device, ``x.device`` stands for the device; casts copy nothing, and what runs on host
    tensors alone is not flagged."""
    x = torch.arange(6.0)
    with CudaOpAudit() as audit:
        x.to("cpu"), x.to("cpu", torch.float64), x.to(device="cpu"), x.cpu().tolist()
        torch.tensor([x[0], x[1]]), torch.empty(2, device="cpu").copy_(x[:2]), torch.as_tensor(x, device="cpu")
        torch.tensor([1, 2], device=x.device), torch.as_tensor([1.0], device=x.device), x.new_tensor([1.0, 2.0])
        moved = torch.arange(3).to(x.device)
        torch.tensor([1.0]).to(x), x[:2].copy_(torch.tensor([1.0, 2.0]))
        torch.empty(2, device="meta").copy_(x[:2]), torch.ops.aten._to_copy.default(x, device=torch.device("meta"))
        moved.tolist()  # on the device now
        # no copy between host and device
        x.to(torch.float64), x.double(), x.to(x.device), x.to(x.device, torch.float64), x.to(x), torch.as_tensor(x)
        torch.tensor([], device=x.device), torch.empty(0).to(x.device), x[:0].cpu(), x[:0].tolist()  # empty
        torch.zeros(2, device=x.device), torch.full((2,), 1.0, device=x.device), x.new_zeros(2), x.sum().to(x.dtype)
        host = torch.tensor([3.0, 1.0, 2.0])
        host.tolist(), host[0].item(), host.cpu(), host.to("cpu").numpy(), torch.arange(4).long().tolist()
        host.nonzero(), host.cumsum(0), host.unique(), torch.zeros(2).to("cpu")
    assert audit.reads == ["to", "to", "to", "cpu", "tensor", "tensor", "copy_", "as_tensor", "tolist"]
    assert audit.syncing == ["h2d:tensor", "h2d:as_tensor", "h2d:new_tensor", "h2d:to", "h2d:to", "h2d:copy_",
                             "h2d:copy_", "h2d:_to_copy"]  # fmt: skip
    assert audit.nondeterministic == [] and audit.cublas == []
    assert torch.equal(x, torch.tensor([1.0, 2.0, 2.0, 3.0, 4.0, 5.0]))  # the audited code ran as written


def _audited_loss(loss, config, batch, agg, log_prob=None, mask=None):
    lp = (batch.log_prob if log_prob is None else log_prob).detach().clone().requires_grad_()
    with CudaOpAudit() as audit:
        pg_loss, _ = get_policy_loss_fn(loss)(
            batch.old_log_prob, lp, batch.advantages, batch.response_mask if mask is None else mask, agg, config
        )
        pg_loss.backward()
    return audit


@pytest.mark.parametrize("loss,granularity,nominal,method", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("size", sorted(BATCHES))
def test_sat_losses_read_once_and_run_nothing_that_syncs(loss, granularity, nominal, method, size):
    """Forward + backward, every aggregation, also with NaN and inf inputs and with nothing active: one read (all
    metrics in one transfer, where verl's own losses read three times) and no syncing, non-deterministic or cuBLAS
    operator."""
    config = actor_config(*sat_overrides(loss, granularity,
                                         f"+actor_rollout_ref.actor.policy_loss.sat.quantile_method={method}"),
                          loss_mode=loss)  # fmt: skip
    batch = BATCHES[size]()
    odd = batch.log_prob.clone()
    odd[1, 0], odd[2, 1], odd[3, 2] = float("nan"), float("inf"), float("-inf")
    for agg in AGG_MODES:
        for log_prob, mask in ((None, None), (odd, None), (None, torch.zeros_like(batch.response_mask))):
            audit = _audited_loss(loss, config, batch, agg, log_prob, mask)
            assert audit.reads == ["tolist"], (agg, audit.reads)
            assert audit.flagged == [], (agg, audit.flagged)
    assert len(_audited_loss(nominal, config, batch, "token-mean").reads) == 3  # verl reads its metrics one by one


@pytest.mark.parametrize("loss,granularity,_,method", CASES, ids=CASE_IDS)
def test_sat_losses_run_under_deterministic_algorithms(loss, granularity, _, method, deterministic):
    config = actor_config(*sat_overrides(loss, granularity,
                                         f"+actor_rollout_ref.actor.policy_loss.sat.quantile_method={method}"),
                          loss_mode=loss)  # fmt: skip
    batch = BATCHES["large"]()
    for agg in AGG_MODES:
        lp = batch.fresh_log_prob()
        pg_loss, metrics = get_policy_loss_fn(loss)(
            batch.old_log_prob, lp, batch.advantages, batch.response_mask, agg, config
        )
        pg_loss.backward()
        assert torch.isfinite(pg_loss) and metrics["actor/sat_gate_rate"] > 0


def _moe(num_layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)  # fmt: skip
    return Qwen3MoeForCausalLM(config)


def _forward_backward(model, ids):
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()


@pytest.mark.parametrize("num_layers", [2, 6])
def test_r3_adds_no_syncing_operator_and_at_most_one_read(num_layers):
    """A replayed forward + backward (routes laid out by the FSDP engine's ``micro_batch_routes``, flip metrics read)
    runs no syncing, non-deterministic or cuBLAS operator beyond the native one's (transformers' own expert dispatch
    has some), and reads the device at most once more, with 2 MoE layers as with 6."""
    model = _moe(num_layers)
    ids = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(1))
    rr = RoutingReplay.attach(model)
    with torch.no_grad(), rr.record() as recording:
        model(input_ids=ids)
    packed = recording.routed_experts.reshape(24, num_layers, 2)
    packed[::3, 1] = torch.tensor([3, 5], dtype=torch.int16)  # some flips to count
    with CudaOpAudit() as native:
        _forward_backward(model, ids)
    with CudaOpAudit() as replayed:
        with rr.replay(micro_batch_routes(packed, pad_size=0, sequence_parallel=False)):
            _forward_backward(model, ids)
        metrics = rr.replay_metrics()
    assert metrics["actor/r3_layers_replayed"] == num_layers and metrics["actor/r3_route_flip_frac"] > 0
    extra = Counter(replayed.flagged) - Counter(native.flagged)
    assert not extra, extra
    assert len(replayed.reads) - len(native.reads) <= 1, (native.reads, replayed.reads)


def test_r3_runs_under_deterministic_algorithms(deterministic):
    model = _moe(2)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    rr = RoutingReplay.attach(model)
    with torch.no_grad(), rr.record() as recording:
        model(input_ids=ids)
    with rr.replay(recording.routed_experts):
        _forward_backward(model, ids)
    assert rr.replay_metrics()["actor/r3_route_flip_frac"] == 0.0


def test_the_gpu_check_script_runs_here_without_ray(tmp_path):
    """``benchmarks/gpu_check.py`` (``make gpu-check``) runs every section on this CPU, through the op audit where
    CUDA's sync debug mode would be, with Ray replaced by its stub, as on a bare GPU machine."""
    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--quick", "--out",
                           str(tmp_path), "--wheels", str(tmp_path / "no-wheels")], cwd=repo, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = results["sections"]
    assert results["failures"] == [] and all(entry["status"] == "ok" for entry in sections.values())
    assert sections["imports"]["result"]["ray_stub"] and sections["imports"]["result"]["device"] == "cpu"
    loss_rows = [row for name, entry in sections.items() if name.startswith("loss_syncs_")
                 for row in entry["result"]["rows"]]  # fmt: skip
    assert len(loss_rows) == 8  # 4 losses and granularities x 2 dtypes
    assert all(row["loss_syncs"] == 1 and row["surrogate"] == "no sync" for row in loss_rows)
    # verl reads its metrics one by one; gspo also copies a Python 0.0 to the device, torch.tensor(0.0, device=...)
    assert [row["verl_syncs"] for row in loss_rows] == [3, 3] + [4] * 6
    r3 = [sections[f"r3_syncs_{n}_layers"]["result"] for n in (2, 6)]
    assert [(row["layers"], row["replay_syncs"] - row["native_syncs"]) for row in r3] == [(2, 0), (6, 0)]
    assert sections["r3_time"]["result"]["replay_ms"] > 0 and sections["loss_time_float32"]["result"]["worst_ratio"] > 0
