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

The lists follow PyTorch's CUDA sources (2.x). A host read is a copy from the device to the host, which stalls the
stream once: a Python-level read of a tensor's value (``.item()``, ``bool()``/``int()``/``float()``, ``.tolist()``,
``.numpy()``, ``torch.tensor`` of a list of device tensors, one read each) or a move to the host (``.cpu()``,
``.to("cpu")``, ``copy_`` into a host tensor). A syncing operator is one whose CUDA kernel reads a value back to size
or check its output (``nonzero`` and everything built on it: boolean-mask indexing, ``masked_select``, one-argument
``where``; ``bincount``, ``histc`` without a range, ``unique*``, ``isin`` on its sorting path, ``equal``,
``repeat_interleave`` without ``output_size``, the linalg error checks), or a copy from the host to the device, named
``h2d:<call>`` (``torch.tensor(data, device=...)``, ``Tensor.new_tensor``, ``.to(device)`` or ``.cuda()`` of a host
tensor, ``copy_`` from one): blocking, or from pageable memory, which the driver may stage synchronously; only
``non_blocking=True`` from pinned memory is not counted. A non-deterministic operator raises under deterministic
algorithms on CUDA (``torch.use_deterministic_algorithms``' own list, and what PyTorch's sources alert on beyond it),
or needs ``CUBLAS_WORKSPACE_CONFIG`` (cuBLAS matrix products). On CUDA, ``torch.cuda.set_sync_debug_mode("error")`` is
the ground truth; this audit is what the CPU can check.

Where tensors live, as far as the CPU can tell: every tensor that enters the block is taken to be on the device; the
block's host tensors are those it makes on the host (a factory given no ``device`` or a string naming the CPU,
``device="cpu"``; Python data given no ``device``; ``.cpu()``, ``.to("cpu")``) and the outputs of an operator whose
tensor inputs are all host tensors (such an operator runs on the host: nothing of it is flagged). A ``torch.device``
(``x.device``, ``cpu`` here) stands for the device the code runs on; only a string names the host. On a GPU, copies
between devices that differ are seen as such (``_to_copy``, ``copy_``). Not seen: a host tensor that enters the block
(taken for a device one: its move to the device is missed, its ``.tolist()`` counted), ``torch.device("cpu")`` meant
as the host, a host tensor rewrapped in Python (``nn.Parameter`` loses the mark), and copies made inside an operator
(a CPU index tensor indexing a CUDA tensor, a CPU 0-dim tensor that ``torch.where`` moves over).
"""

import math
import struct
from collections.abc import Iterable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

# Python-level reads of a whole tensor, each one host read (seen as torch functions: on the CPU they reach no ATen
# operator); .item(), bool(), int() and float() reach _local_scalar_dense, counted there.
PYTHON_READS = frozenset(["tolist", "numpy"])
# Python-level moves between host and device (on the CPU, .cpu() or .to(x.device) reach no ATen operator) and tensors
# built from data, which lives on the host (torch.tensor(data, device=...) copies it over).
MOVES = frozenset(["cpu", "cuda", "to"])
FROM_DATA = frozenset(["tensor", "as_tensor", "asarray", "new_tensor"])
# ATen operators that copy between host and device, classified in CudaOpAudit._direction.
COPIES = frozenset(["_local_scalar_dense", "copy_", "_to_copy"])
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


def _has_tensor(values: Iterable) -> bool:
    return any(isinstance(v, torch.Tensor) or (isinstance(v, (list, tuple)) and _has_tensor(v)) for v in values)


def _names_host(device) -> bool:
    """A device given as a string naming the CPU. A ``torch.device`` stands for the device the code runs on (on the
    CPU, ``x.device`` is ``cpu`` too)."""
    return isinstance(device, str) and torch.device(device).type == "cpu"


def _pinned(tensor: torch.Tensor) -> bool:
    try:
        return tensor.is_pinned()
    except RuntimeError:  # no accelerator
        return False


def _move_target(name: str, args: tuple, kwargs: dict, is_host) -> tuple[str | None, bool]:
    """Where ``.cpu()``, ``.cuda()`` or ``.to(...)`` sends its tensor ("host", "device" or None: a cast on the same
    device), and whether without blocking."""
    if name == "cpu":
        return "host", False
    if name == "cuda":
        return "device", bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
    device, other = kwargs.get("device"), kwargs.get("other")
    for value in args[1:] if device is None and other is None else ():
        if isinstance(value, torch.Tensor):
            other = value
            break
        if isinstance(value, (str, torch.device)) or type(value) is int:
            device = value
            break
    try:
        non_blocking = torch._C._nn._parse_to(*args[1:], **kwargs)[2]
    except (TypeError, RuntimeError):
        non_blocking = bool(kwargs.get("non_blocking"))
    if other is not None:
        return ("host" if is_host(other) else "device"), non_blocking
    if device is None:
        return None, non_blocking
    return ("host" if _names_host(device) else "device"), non_blocking


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


class _HostTraffic(TorchFunctionMode):
    """The Python-level side of the audit: reads of a whole tensor, moves between host and device, tensors built from
    data, and where factories put what they make."""

    def __init__(self, audit: "CudaOpAudit"):
        super().__init__()
        self.audit = audit

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        audit = self.audit
        if name in PYTHON_READS and args and isinstance(args[0], torch.Tensor):
            if not audit.is_host(args[0]) and args[0].numel():
                audit.reads.append(name)
            return audit._explicitly(func, args, kwargs)
        if name in MOVES and args and isinstance(args[0], torch.Tensor):
            return audit._move(func, name, args, kwargs)
        if name in FROM_DATA:
            return audit._from_data(func, name, args, kwargs)
        out = func(*args, **kwargs)
        if kwargs.get("device") is not None:
            audit._place(out, _names_host(kwargs["device"]))
        elif isinstance(out, torch.Tensor) and not _has_tensor(args) and not _has_tensor(kwargs.values()):
            audit._place(out, torch.get_default_device().type == "cpu")  # a factory given no device
        return out


class CudaOpAudit(TorchDispatchMode):
    """Records, for the code run inside it, every host read (``reads``), CUDA-syncing operator or host-to-device copy
    (``syncing``), operator that is not deterministic on CUDA (``nondeterministic``) and cuBLAS product (``cublas``),
    by name, in order. ``ops`` holds every ATen operator seen; ``is_host`` tells the tensors taken to be on the host."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []
        self.syncing: list[str] = []
        self.nondeterministic: list[str] = []
        self.cublas: list[str] = []
        self.ops: list[str] = []
        self._host = WeakIdKeyDictionary()  # the block's host tensors
        self._explicit = 0  # depth of Python-level calls already counted, whose inner copies are not counted again
        self._python = _HostTraffic(self)

    def __enter__(self):
        self._python.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._python.__exit__(*exc)

    def is_host(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is taken to be on the host (made there inside the block), not on the device."""
        return tensor in self._host

    def _place(self, value, host: bool) -> None:
        for tensor in _tensors([value]):
            if host:
                self._host[tensor] = True
            else:
                self._host.pop(tensor, None)

    def _placed(self, out, src, host: bool):
        """``out`` placed on the host or the device; an alias of ``src`` if the call returned ``src`` itself (a move
        to the CPU's own device) while ``src`` stays where it is."""
        if out is src and self.is_host(src) != host:
            out = torch.ops.aten.alias(out)
        self._place(out, host)
        return out

    def _explicitly(self, func, args: tuple, kwargs: dict):
        self._explicit += 1
        try:
            return func(*args, **kwargs)
        finally:
            self._explicit -= 1

    def _move(self, func, name: str, args: tuple, kwargs: dict):
        src = args[0]
        target, non_blocking = _move_target(name, args, kwargs, self.is_host)
        if target == "host" and not self.is_host(src) and src.numel():  # an empty copy copies nothing
            self.reads.append(name)
        elif target == "device" and self.is_host(src) and src.numel() and not (non_blocking and _pinned(src)):
            self.syncing.append(f"h2d:{name}")
        out = self._explicitly(func, args, kwargs)
        return out if target is None else self._placed(out, src, target == "host")

    def _from_data(self, func, name: str, args: tuple, kwargs: dict):
        """``torch.tensor``, ``torch.as_tensor``, ``torch.asarray``, ``Tensor.new_tensor``: data that is not a device
        tensor is on the host, and copied to the device given (``new_tensor``: its own tensor's by default); a device
        tensor given the host is copied back."""
        base = args[0] if name == "new_tensor" else None
        rest = args[1:] if name == "new_tensor" else args
        data = rest[0] if rest else kwargs.get("data", kwargs.get("obj"))
        device = kwargs.get("device", rest[2] if name == "as_tensor" and len(rest) > 2 else None)
        on_device = isinstance(data, torch.Tensor) and not self.is_host(data)
        if device is not None:
            host = _names_host(device)
        else:
            host = self.is_host(base) if base is not None else not on_device
        if not isinstance(data, torch.Tensor):  # a list of device tensors: each read on its own
            self.reads += [name for tensor in _tensors([data]) if not self.is_host(tensor)]
        out = self._explicitly(func, args, kwargs)
        if host and on_device and out.numel():  # an empty copy (torch.tensor([], device=...)) copies nothing
            self.reads.append(name)
        elif not host and not on_device and out.numel():
            self.syncing.append(f"h2d:{name}")
        return self._placed(out, data, host)

    def _direction(self, name: str, args: tuple, kwargs: dict, on_host: bool) -> str | None:
        """The way a copy goes ("d2h", "h2d" or None): across devices where they differ (on a GPU), else between the
        block's host tensors and the device ones (a ``_to_copy`` on one device is a cast)."""
        if name == "_local_scalar_dense":
            return None if on_host else "d2h"
        if args[0].numel() == 0:  # nothing to copy
            return None
        if name == "copy_":  # copy_(dst, src, non_blocking)
            dst, src = args[0], args[1]
            dst_device = dst.device
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        else:  # _to_copy(src, ..., device=...)
            dst, src = None, args[0]
            dst_device = torch.device(kwargs["device"]) if kwargs.get("device") is not None else src.device
            non_blocking = kwargs.get("non_blocking", False)
        if dst_device != src.device:
            src_host, dst_host = src.device.type == "cpu", dst_device.type == "cpu"
        elif dst is None:  # a cast
            return None
        else:
            src_host, dst_host = self.is_host(src), self.is_host(dst)
        if dst_host and not src_host:
            return "d2h"
        if src_host and not dst_host and not (non_blocking and _pinned(src)):
            return "h2d"
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        self.ops.append(name)
        inputs = _tensors([*args, *kwargs.values()])
        on_host = bool(inputs) and all(self.is_host(t) for t in inputs)
        if name in COPIES:
            direction = self._direction(name, args, kwargs, on_host)
            if direction == "d2h" and not self._explicit:  # a Python-level call counted its own copies
                self.reads.append(name)
            elif direction == "h2d" and not self._explicit:
                self.syncing.append(f"h2d:{name}")
            on_host = on_host and direction != "h2d"
        elif not on_host:  # an operator on host tensors alone runs on the host
            if _syncs(name, args, kwargs):
                self.syncing.append(name)
            if _nondeterministic(name, args, kwargs):
                self.nondeterministic.append(name)
            if name in CUBLAS_OPS:
                self.cublas.append(name)
        out = func(*args, **kwargs)
        if on_host:
            self._place(out, True)
        return out

    @property
    def flagged(self) -> list[str]:
        """Syncing operators and host-to-device copies, non-deterministic operators and cuBLAS products, in order (a
        name may repeat)."""
        return [*self.syncing, *self.nondeterministic, *self.cublas]
