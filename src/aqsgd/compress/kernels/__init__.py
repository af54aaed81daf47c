"""The kernel seam: the named operations codecs are built from, with one implementation per backend.

A codec never branches on hardware. It asks :func:`for_tensor` for the kernels of the tensor's device and
calls their operations; each returns its result, or None where this backend has no kernel for those arguments
(the codec then takes its general, step-by-step PyTorch path, which every backend's result equals byte for
byte).

========== ================= ============================================================================
backend    where             what it is
========== ================= ============================================================================
``eager``  any device        PyTorch operations: the reference every kernel is tested against, and the
                             fallback (:mod:`aqsgd.compress.kernels.eager`)
``numba``  the CPU           compiled loops, one pass per operation (:mod:`aqsgd.compress.kernels.numba`)
``triton`` CUDA              Triton kernels, one read of the input and one write of the output per
                             operation; they also run on CPU tensors under Triton's interpreter
                             (``TRITON_INTERPRET=1``), which is how the tests check them without a GPU
                             (:mod:`aqsgd.compress.kernels.triton`)
========== ================= ============================================================================

The default for a device is the first of its backends that is installed: numba then eager on the CPU,
triton then eager on CUDA. A codec built with ``backend="eager"`` (``make_codec(spec, backend=...)``) uses
that one wherever it runs: benchmarks compare backends side by side that way, and tests compare their packets.

Operations (``x2``: a contiguous fp32 ``[R, K]`` view with ``K % 8 == 0``, whose scale groups are its columns
(``by_col``) or its rows; per-group vectors are fp32 of length ``K`` or ``R``):

* ``max_abs(x2, by_col)``: each group's max ``|x|`` (NaN where the group holds one);
* ``quantize_pack(x2, inv, by_col, offset, bits, qmax)``: the codes ``trunc(clamp(fma(x, inv, offset), 0,
  qmax))``, each row packed into ``K * bits / 8`` bytes as :func:`~aqsgd.compress.bitpack.pack_bits` packs
  (code ``j`` at bits ``[j * bits, (j + 1) * bits)`` of a little-endian stream): ``uint8 [R, K * bits / 8]``;
* ``unpack_dequantize(packed, step, by_col, bits, mul, low)``: ``(code * mul - low) * step`` of each code,
  fp32 ``[R, K]``;
* ``fwht(x2, signs, c, inverse)``: the Walsh-Hadamard transform of each row (:mod:`aqsgd.compress.hadamard`);
* TopK's selection and packing, and AQ-SGD's sender and receiver steps against a cache's rows
  (:class:`RowStore`): ``delta_max_abs``, ``delta``, ``delta_encode_update``, ``delta_decode_update``.

Single rounding where it matters: ``fma`` in every backend that can (PyTorch's ``addcmul`` rounds once on the
CPU), so that the packets of all backends on the CPU are byte-identical, and a Triton kernel on a GPU writes
the CPU's bytes. PyTorch's own ``addcmul`` on CUDA rounds twice: an ``eager`` encode on a GPU may differ from
the CPU's in about one code per million (decoding agrees everywhere).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch

__all__ = ["BACKENDS", "Kernels", "RowStore", "available", "defaulting_to", "for_device", "for_tensor",
           "plan", "STORE_FORMATS"]

BACKENDS = ("eager", "numba", "triton")
_DEFAULTS: dict[str, tuple[str, ...]] = {"cpu": ("numba", "eager"), "cuda": ("triton", "eager")}
STORE_FORMATS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # a cache row's storage format


def plan(shape: Sequence[int], granularity: str, block: int) -> tuple[int, int, bool] | None:
    """``(rows, row_length, scale_per_column)`` of the 2-D view the quantizer's kernels work on, or None where
    they do not apply (the general path): the last dimension (or, for ``blockN``, the block, which must divide
    the tensor) a multiple of 8, so that every row's packed codes start on a byte."""
    numel = 1
    for d in shape:
        numel *= int(d)
    if numel == 0 or len(shape) == 0:
        return None
    cols = int(shape[-1])
    if granularity == "block":
        if block % 8 or numel % block:
            return None
        return numel // block, block, False
    if cols % 8:
        return None
    return numel // cols, cols, granularity == "channel"


@dataclasses.dataclass(frozen=True)
class RowStore:
    """Rows of an activation cache's storage that a codec's fused AQ-SGD step reads and updates in place.

    ``data`` is the whole storage ``[capacity, n]`` (fp32, fp16 or bf16) on the cache's device, sharing memory
    with the cache's tensor; ``ids`` (int64, on the same device) are the rows of the micro-batch, in its
    order; ``fmt`` is the storage format (:data:`STORE_FORMATS`). Built by the cache
    (:meth:`~aqsgd.schemes.cache.base.ActivationCache.row_store`), which has validated the ids.
    """

    data: torch.Tensor
    ids: torch.Tensor
    fmt: int

    @property
    def row_numel(self) -> int:
        return int(self.data.shape[1])

    @property
    def device(self) -> torch.device:
        return self.data.device

    @classmethod
    def of(cls, storage: torch.Tensor, ids: torch.Tensor) -> RowStore | None:
        """The store over ``storage`` [capacity, *row_shape]; None where no kernel could update it in place
        (another dtype, not contiguous)."""
        fmt = STORE_FORMATS.get(storage.dtype)
        if fmt is None or not storage.is_contiguous():
            return None
        flat = storage.detach().view(storage.shape[0], -1)
        return cls(flat, ids.to(device=storage.device, dtype=torch.int64).contiguous(), fmt)


class Kernels:
    """One backend's operations (see the module docstring). Every operation returns None here: a backend
    overrides those it has kernels for."""

    name = "none"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def quantizes(self, dtype: torch.dtype, rounding: str) -> bool:
        """Whether the quantizer's operations run here for inputs of ``dtype`` computed in fp32 (fp32, bf16,
        fp16) with ``rounding`` (nearest only: stochastic rounding stays on the general path)."""
        return dtype in (torch.float32, torch.bfloat16, torch.float16) and rounding == "nearest"

    def max_abs(self, x2: torch.Tensor, by_col: bool) -> torch.Tensor | None:
        return None

    def quantize_pack(self, x2: torch.Tensor, inv: torch.Tensor, by_col: bool, offset: float, bits: int,
                      qmax: int, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """The packed codes, written into ``out`` (``uint8 [R, K * bits / 8]``, contiguous) where given."""
        return None

    def unpack_dequantize(self, packed: torch.Tensor, step: torch.Tensor, by_col: bool, bits: int, mul: int,
                          low: int) -> torch.Tensor | None:
        return None

    def fwht(self, x2: torch.Tensor, signs: torch.Tensor, c: float, inverse: bool) -> torch.Tensor | None:
        return None

    # AQ-SGD against a cache's rows
    def delta_max_abs(self, x2: torch.Tensor, store: RowStore, rpb: int, by_col: bool) -> torch.Tensor | None:
        return None

    def delta(self, x2: torch.Tensor, store: RowStore, rpb: int) -> torch.Tensor | None:
        return None

    def delta_encode_update(self, x2: torch.Tensor, store: RowStore, rpb: int, inv: torch.Tensor,
                            by_col: bool, offset: float, bits: int, qmax: int, step: torch.Tensor, mul: int,
                            low: int, out: torch.Tensor | None = None) -> torch.Tensor | None:
        return None

    def delta_decode_update(self, packed: torch.Tensor, store: RowStore, rpb: int, step: torch.Tensor,
                            by_col: bool, bits: int, mul: int, low: int) -> torch.Tensor | None:
        return None

    # TopK (the numba backend's; see aqsgd.compress.topk)
    def topk_rows(self, *args: Any) -> Any:
        return None

    def topk_pack(self, *args: Any) -> Any:
        return None

    def topk_encode(self, *args: Any) -> Any:
        return None

    def __repr__(self) -> str:
        return f"<{self.name} kernels on {self.device}>"


def available(name: str, device: torch.device | str = "cpu") -> bool:
    """Whether backend ``name`` runs on ``device`` here (installed, and made for that kind of device)."""
    device = torch.device(device)
    if name == "eager":
        return True
    if name == "numba":
        from aqsgd.compress.kernels import numba as backend

        return device.type == "cpu" and backend.available()
    if name == "triton":
        from aqsgd.compress.kernels import triton as backend

        return backend.available(device)
    raise ValueError(f"unknown kernel backend {name!r}; valid: {', '.join(BACKENDS)}")


@functools.lru_cache(maxsize=None)
def _kernels(name: str, device_type: str) -> Kernels:
    device = torch.device(device_type)
    if name == "eager":
        from aqsgd.compress.kernels.eager import EagerKernels

        return EagerKernels(device)
    if name == "numba":
        from aqsgd.compress.kernels.numba import NumbaKernels

        return NumbaKernels(device)
    from aqsgd.compress.kernels.triton import TritonKernels

    return TritonKernels(device)


def for_device(device: torch.device | str, backend: str | None = None) -> Kernels:
    """The kernels for ``device``: ``backend`` where given (a ValueError where it cannot run there), else the
    device's default (module docstring)."""
    device = torch.device(device)
    if backend is not None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown kernel backend {backend!r}; valid: {', '.join(BACKENDS)}")
        if not available(backend, device):
            raise ValueError(f"the {backend} kernels do not run on {device.type} here")
        return _kernels(backend, device.type)
    for name in _DEFAULTS.get(device.type, ("eager",)):
        if available(name, device):
            return _kernels(name, device.type)
    return _kernels("eager", device.type)


@contextlib.contextmanager
def defaulting_to(backend: str, device_type: str = "cpu") -> Iterator[None]:
    """Within the block, ``device_type`` tensors take the ``backend`` kernels wherever no codec names its own:
    for tests that compare backends through code that builds its own codecs (caches, schemes). Codecs name a
    backend with :meth:`~aqsgd.compress.base.Codec.using`; nothing in the library calls this."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; valid: {', '.join(BACKENDS)}")
    saved = _DEFAULTS.get(device_type)
    _DEFAULTS[device_type] = (backend, "eager")
    try:
        yield
    finally:
        if saved is None:
            _DEFAULTS.pop(device_type, None)
        else:
            _DEFAULTS[device_type] = saved


def for_tensor(x: torch.Tensor, backend: str | None = None) -> Kernels:
    """The kernels for ``x``'s device (see :func:`for_device`)."""
    return for_device(x.device, backend)
