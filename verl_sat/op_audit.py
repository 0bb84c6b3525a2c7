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
"""Which operators a piece of torch code runs that, on CUDA, would read back to the host or raise under
``torch.use_deterministic_algorithms(True)``, seen on any device (the CPU included)::

    with CudaOpAudit() as audit:
        loss, metrics = loss_fn(...)
        loss.backward()
    audit.reads, audit.syncing, audit.nondeterministic

The lists follow PyTorch's CUDA sources (2.x): a host read is a Python-level read of a tensor's value (``.item()``,
``bool()``/``int()``/``float()``, ``.tolist()``, ``.numpy()``, ``.cpu()``), which stalls the stream once; a syncing
operator is one whose CUDA kernel reads a value back to size or check its output (``nonzero`` and everything built on
it: boolean-mask indexing, ``masked_select``, one-argument ``where``; ``bincount``, ``histc`` without a range,
``unique*``, ``equal``, ``repeat_interleave`` without ``output_size``); a non-deterministic operator raises under
deterministic algorithms on CUDA (``torch.use_deterministic_algorithms``' own list), or needs
``CUBLAS_WORKSPACE_CONFIG`` (cuBLAS matrix products). On CUDA, ``torch.cuda.set_sync_debug_mode("error")`` is the
ground truth; this audit is what the CPU can check.
"""

import math
import struct
from collections.abc import Iterable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# Python-level reads of a tensor's value, each one host read (seen as torch functions: on a CPU tensor ``.tolist()``
# and ``.cpu()`` reach no ATen operator).
PYTHON_READS = frozenset(["item", "__bool__", "__int__", "__float__", "__index__", "tolist", "numpy", "cpu"])
# ATen operators whose CUDA kernel reads back to the host (overload packets; conditional ones in _syncs below).
SYNCING_OPS = frozenset(
    ["_local_scalar_dense", "nonzero", "masked_select", "bincount", "unique", "_unique", "_unique2",
     "unique_dim", "unique_consecutive", "unique_dim_consecutive", "equal", "argwhere", "nonzero_numpy",
     # linalg: the info LAPACK/cuSOLVER/MAGMA return is checked on the host, _linalg_check_errors reading
     # info.any().item(). linalg.inv/solve/cholesky/lu_factor/ldl_factor call it after their _ex kernel (seen here,
     # the _ex kernels only with check_errors=True, in _syncs); these call it inside their kernel: cholesky,
     # cholesky_inverse, _linalg_eigh (eigh, eigvalsh), _linalg_svd (svd, svdvals, matrix_rank, 2-norms, cond),
     # linalg_lstsq (MAGMA's gels, its info on the host), linalg_pinv (eigh or svd).
     "_linalg_check_errors", "cholesky", "cholesky_inverse", "_linalg_eigh", "_linalg_svd", "linalg_lstsq",
     "linalg_pinv",
     # linalg_eig (eig, eigvals): MAGMA's geev has no GPU interface, the input is copied to the host and computed
     # there, then info read
     "linalg_eig"]
)  # fmt: skip
# Not syncing in PyTorch 2.x's sources: randperm (random keys sorted on the device with cub; early releases drew small
# permutations on the host and copied them over) and multinomial (its probability checks are _assert_async, a
# device-side assert, since pytorch#134818; before, two .item() reads without replacement or for one sample).
# ATen operators that raise under deterministic algorithms on CUDA (conditional ones in _nondeterministic below).
NONDETERMINISTIC_OPS = frozenset(
    ["histc", "kthvalue", "put_", "put", "nll_loss2d_forward", "nll_loss2d_backward", "embedding_bag",
     "_embedding_bag", "_embedding_bag_backward", "avg_pool3d_backward", "adaptive_avg_pool2d_backward",
     "_adaptive_avg_pool2d_backward", "adaptive_avg_pool3d_backward", "_adaptive_avg_pool3d_backward",
     "max_pool3d_with_indices_backward", "adaptive_max_pool2d_backward", "fractional_max_pool2d_backward",
     "fractional_max_pool3d_backward", "upsample_linear1d_backward", "upsample_bilinear2d_backward",
     "upsample_bicubic2d_backward", "upsample_trilinear3d_backward", "reflection_pad1d_backward",
     "reflection_pad2d_backward", "reflection_pad3d_backward", "replication_pad1d_backward",
     "replication_pad3d_backward", "_ctc_loss_backward", "grid_sampler_2d_backward", "grid_sampler_3d_backward",
     "max_unpool2d", "max_unpool3d",
     # index_reduce_func_cuda_impl alerts for every reduction (prod, mean, amax, amin: atomics), with no
     # deterministic path; the docs' list omits it
     "index_reduce", "index_reduce_"]
)  # fmt: skip
# cuBLAS products: non-deterministic under deterministic algorithms unless CUBLAS_WORKSPACE_CONFIG is set (PyTorch's
# gemm/bgemm raise then). addbmm's CUDA kernel is a loop of addmm_ calls, below the dispatcher (so no "addmm" is seen);
# _scaled_mm and _int_mm run cuBLASLt (scaled_gemm, int8_gemm), which PyTorch does not guard with that check, but which
# are cuBLAS products all the same.
CUBLAS_OPS = frozenset(["mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "_addmm_activation", "_scaled_mm",
                        "_int_mm"])  # fmt: skip


def _name(func) -> str:
    return func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else getattr(func, "__name__", str(func))


def _tensors(values: Iterable) -> list[torch.Tensor]:
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found += _tensors(value)
    return found


def _syncs(name: str, args: tuple, kwargs: dict) -> bool:
    if name in SYNCING_OPS:
        return True
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):  # a boolean mask becomes nonzero()
        return any(t.dtype in (torch.bool, torch.uint8) for t in _tensors(args[1:2]))
    if name == "repeat_interleave":  # the output size read back from the repeats
        return isinstance(args[0], torch.Tensor) and args[0].dim() > 0 and kwargs.get("output_size") is None
    if name == "where":
        return len(args) == 1
    if name == "histc":
        return _histc_reads_its_range(args, kwargs)
    if name == "isin":
        return _isin_runs_unique(args, kwargs)
    if name.endswith("_ex") and "linalg_" in name:  # linalg_inv_ex & co. check info themselves when asked to
        return bool(kwargs.get("check_errors"))
    if name == "linalg_matrix_exp":  # picks each matrix's degree from its norm copied to the host, and nonzero
        return args[0].size(-1) > 1  # (a 1 x 1 matrix is exp)
    return False


def _isin_runs_unique(args: tuple, kwargs: dict) -> bool:
    """``isin`` compares all pairs (no read-back) while ``test_elements`` has fewer than ``10 * elements.numel() **
    0.145`` elements (NumPy's heuristic), else sorts, after ``_unique`` of both unless ``assume_unique``: on CUDA
    ``_unique`` reads the count of unique values back (``isin_Tensor_Tensor_out``, shared by CPU and CUDA)."""
    elements, test_elements = args[0], args[1]
    if not isinstance(test_elements, torch.Tensor) or kwargs.get("assume_unique", False):
        return False  # isin(Tensor, Scalar) is eq / ne
    count = elements.numel() if isinstance(elements, torch.Tensor) else 1
    return count > 0 and test_elements.numel() >= int(10.0 * count**0.145)


def _histc_reads_its_range(args: tuple, kwargs: dict) -> bool:
    """``histc``'s CUDA kernel reads the input's min and max back only when the range it is given is empty: ``min ==
    max`` (both 0 by default) once converted to the accumulate type (float for float16/bfloat16/float32, double for
    float64, int64 for integers), for a non-empty input (``_histc_cuda_template``)."""
    x = args[0]
    low = args[2] if len(args) > 2 else kwargs.get("min", 0)
    high = args[3] if len(args) > 3 else kwargs.get("max", 0)
    if not x.is_floating_point():
        low, high = int(low), int(high)
    elif x.dtype != torch.float64:
        low, high = _as_float32(low), _as_float32(high)
    return low == high and x.numel() > 0


def _as_float32(value: float) -> float:
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def _nondeterministic(name: str, args: tuple, kwargs: dict) -> bool:
    if name in NONDETERMINISTIC_OPS:
        return True
    if name == "bincount":  # with weights
        return (len(args) > 1 and args[1] is not None) or kwargs.get("weights") is not None
    if name in ("cumsum", "cumsum_"):  # floating point or complex
        dtype = kwargs.get("dtype") or args[0].dtype
        return dtype.is_floating_point or dtype.is_complex
    if name in ("median", "nanmedian"):  # with indices
        return len(args) > 1 or "dim" in kwargs
    if name in ("scatter_reduce", "scatter_reduce_"):  # prod (sum and mean take index_put's deterministic path)
        return (args[4] if len(args) > 4 else kwargs.get("reduce")) == "prod"
    if name in ("scatter", "scatter_"):  # reduce="multiply" from a tensor (atomicMul); "add" takes index_put's path,
        src = args[3] if len(args) > 3 else kwargs.get("src")  # and a scalar src is deterministic
        return isinstance(src, torch.Tensor) and (args[4] if len(args) > 4 else kwargs.get("reduce")) == "multiply"
    return False


class _PythonReads(TorchFunctionMode):
    def __init__(self, audit: "CudaOpAudit"):
        super().__init__()
        self.audit = audit

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in PYTHON_READS and name not in ("item", "__bool__", "__int__", "__float__", "__index__"):
            self.audit.reads.append(name)  # the others reach _local_scalar_dense, counted there
        return func(*args, **(kwargs or {}))


class CudaOpAudit(TorchDispatchMode):
    """Records, for the code run inside it, every host read (``reads``), CUDA-syncing operator (``syncing``),
    operator that is not deterministic on CUDA (``nondeterministic``) and cuBLAS product (``cublas``), by name, in
    order. ``ops`` holds every ATen operator seen."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []
        self.syncing: list[str] = []
        self.nondeterministic: list[str] = []
        self.cublas: list[str] = []
        self.ops: list[str] = []
        self._python = _PythonReads(self)

    def __enter__(self):
        self._python.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._python.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        self.ops.append(name)
        if name == "_local_scalar_dense":
            self.reads.append(name)
        elif _syncs(name, args, kwargs):
            self.syncing.append(name)
        if _nondeterministic(name, args, kwargs):
            self.nondeterministic.append(name)
        if name in CUBLAS_OPS:
            self.cublas.append(name)
        return func(*args, **kwargs)

    @property
    def flagged(self) -> list[str]:
        """Syncing and non-deterministic operators and cuBLAS products, in order (a name may repeat)."""
        return [*self.syncing, *self.nondeterministic, *self.cublas]
