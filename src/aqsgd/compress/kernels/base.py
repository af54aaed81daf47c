"""What every kernel backend shares: the operations' base class, a cache's row store, the quantizer's 2-D plan
(see :mod:`aqsgd.compress.kernels`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["Kernels", "RowStore", "STORE_FORMATS", "TopkSampling", "index_on", "plan"]

STORE_FORMATS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # a cache row's storage format


def plan(shape: Sequence[int], granularity: str, block: int, bits: int) -> tuple[int, int, bool] | None:
    """``(rows, row_length, scale_per_column)`` of the 2-D view the quantizer's kernels work on, or None where
    they do not apply (the general path): the codes of a row (the last dimension, or for ``blockN`` the
    block, which must divide the tensor) must fill whole bytes (``row_length * bits`` a multiple of 8), so
    that every row's packed codes start on a byte and the rows packed one by one are the general path's
    stream. A row's last group of 8 codes may be short (q8 rows of any length, q4 of even ones)."""
    numel = 1
    for d in shape:
        numel *= int(d)
    if numel == 0 or len(shape) == 0:
        return None
    cols = int(shape[-1])
    if granularity == "block":
        if block * bits % 8 or numel % block:
            return None
        return numel // block, block, False
    if cols * bits % 8:
        return None
    return numel // cols, cols, granularity == "channel"


def index_on(index: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """An index tensor (sample ids, row positions) on ``device``, as int64. From the CPU to a GPU the copy
    goes through pinned memory without blocking: a plain ``.to(device)`` from pageable memory waits for the
    GPU's queue to drain first (CUDA synchronises the stream before such a copy), once per micro-batch and
    boundary side. PyTorch's pinned-memory cache keeps the host block until the copy has run."""
    device = torch.device(device)
    index = index.to(torch.int64)
    if index.device == device or device.type != "cuda" or index.device.type != "cpu":
        return index.to(device)
    return index.pin_memory().to(device, non_blocking=True)


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
        return cls(flat, index_on(ids, storage.device).contiguous(), fmt)


@dataclasses.dataclass(frozen=True)
class TopkSampling:
    """How TopK's sampled selection reads a row (:func:`aqsgd.compress.topk.topk_indices`): the sampled
    ``positions`` (int64, sorted, on the CPU) and the order statistics ``j_lo``, ``j_hi`` of the sample that
    give the lower and upper thresholds."""

    positions: torch.Tensor
    j_lo: int
    j_hi: int


class Kernels:
    """One backend's operations (see the module docstring). Every operation returns None here: a backend
    overrides those it has kernels for."""

    name = "none"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def has(self, operation: str) -> bool:
        """Whether this backend has a kernel for ``operation`` (overrides the base class's method)."""
        return getattr(type(self), operation, None) is not getattr(Kernels, operation, None)

    #: whether :meth:`quantize_pack` takes stochastic rounding's noise
    stochastic = False
    #: whether the scales operations run here (:meth:`max_scales`, :meth:`scales`, :meth:`steps`,
    #: :meth:`unpack_scaled`, :meth:`cast_checked`): codecs ask before allocating their outputs and flags
    fuses_scales = False

    def quantizes(self, dtype: torch.dtype, rounding: str) -> bool:
        """Whether the quantizer's operations run here for inputs of ``dtype`` computed in fp32 (fp32, bf16,
        fp16) with ``rounding`` (nearest, or stochastic where the backend's :meth:`quantize_pack` takes the
        noise; elsewhere stochastic rounding stays on the general path)."""
        return (dtype in (torch.float32, torch.bfloat16, torch.float16)
                and (rounding == "nearest" or (rounding == "stochastic" and self.stochastic)))

    def max_abs(self, x2: torch.Tensor, by_col: bool) -> torch.Tensor | None:
        return None

    # the quantizer's scales in one launch (a device's kernels: no host decision inside)
    def max_scales(self, x2: torch.Tensor, by_col: bool, stored: torch.Tensor, qmax: int,
                   flag: torch.Tensor) -> torch.Tensor | None:
        """Each group's max |x| made into its stored scale, as ``store_scales`` rounds it (fp16 rounded up and
        clamped to 65504, or fp32: ``stored``'s dtype), written into ``stored``; returns ``inv = qmax / (2 *
        stored)`` (0 for a zero scale), fp32. ``flag`` (int32 ``[1]``) is raised (made nonzero) where a scale
        is NaN or Inf: the input held one."""
        return None

    def scales(self, s: torch.Tensor, stored: torch.Tensor, qmax: int, flag: torch.Tensor,
               step: torch.Tensor | None = None, divisor: int = 1) -> torch.Tensor | None:
        """:meth:`max_scales` from given scales ``s`` (fp32 ``[G]``, not negative); with ``step`` (fp32
        ``[G]``), each group's decode step ``stored / divisor`` (correctly rounded) written there too."""
        return None

    def steps(self, stored: torch.Tensor, divisor: int, flag: torch.Tensor) -> torch.Tensor | None:
        """Received stored scales (fp16 or fp32 ``[G]``) to decode steps ``stored / divisor`` (correctly
        rounded), ``flag`` (int32 ``[1]``) raised where a scale is not finite or is negative."""
        return None

    def max_quantize_rows(self, x2: torch.Tensor, stored: torch.Tensor, qmax: int, flag: torch.Tensor,
                          offset: float, bits: int, out: torch.Tensor) -> bool:
        """:meth:`max_scales` by row and :meth:`quantize_pack` with nearest rounding in one operation (on a
        GPU one launch, where two cost two launches' host time): each row's scale into ``stored``, the flag
        raised as there, the codes into ``out`` (``uint8 [R, K * bits / 8]``). The same bytes as the two.
        False where the backend has no such kernel (nothing written)."""
        return False

    def quantize_pack(self, x2: torch.Tensor, inv: torch.Tensor, by_col: bool, offset: float, bits: int,
                      qmax: int, out: torch.Tensor | None = None,
                      noise: torch.Tensor | None = None) -> torch.Tensor | None:
        """The packed codes, written into ``out`` (``uint8 [R, K * bits / 8]``, contiguous) where given. With
        ``noise`` (fp32 ``[R, K]`` in ``[0, 1)``, the uniform draw of the general path, only where
        :attr:`stochastic`), the codes are ``trunc(clamp(fma(x, inv, offset) + noise, 0, qmax))``."""
        return None

    def unpack_dequantize(self, packed: torch.Tensor, step: torch.Tensor, by_col: bool, bits: int, mul: int,
                          low: int) -> torch.Tensor | None:
        return None

    def unpack_scaled(self, packed: torch.Tensor, stored: torch.Tensor, by_col: bool, bits: int, mul: int,
                      low: int, divisor: int, flag: torch.Tensor) -> torch.Tensor | None:
        """:meth:`unpack_dequantize` from the stored scales (fp16 or fp32 ``[G]``): the step of a group is its
        scale divided by ``divisor``, correctly rounded (:func:`~aqsgd.compress.quant.divided`); ``flag``
        (int32 ``[1]``) is raised where a scale is not finite or is negative."""
        return None

    def cast_checked(self, x: torch.Tensor, wire: torch.dtype, flag: torch.Tensor) -> torch.Tensor | None:
        """``x.to(wire)`` (fp16 or bf16, to nearest even) in one launch, ``flag`` (int32 ``[1]``) raised where
        a cast value is NaN or Inf."""
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

    # outlier rows (see aqsgd.compress.wrappers.OutlierCodec)
    def row_sumsq(self, x2: torch.Tensor) -> torch.Tensor | None:
        """Each row's sum of squares, fp32 ``[R]``: within float rounding of ``x2.float().square().sum(1)``
        (a kernel sums in its own order), so a row whose norm lies within rounding of the outlier threshold
        may be chosen differently."""
        return None

    def split_rows(self, x2: torch.Tensor, idx: torch.Tensor, apart: torch.Tensor) -> torch.Tensor | None:
        """The rows of ``x2`` not in ``idx`` (a new tensor), and those in ``idx`` as bf16 bits into
        ``apart``."""
        return None

    # TopK on torch tensors (see aqsgd.compress.topk)
    def topk_select(self, x2: torch.Tensor, k: int) -> torch.Tensor | None:
        """Positions ``[R, k]`` (int64, increasing in each row) of the ``k`` largest magnitudes of each row of
        ``x2``, ties at the k-th magnitude to the lower positions, NaN above Inf."""
        return None

    def topk_payload(self, x2: torch.Tensor, k: int, wire: torch.dtype,
                     width: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """TopK's payload (the kept values cast to ``wire``, then the positions' low ``width`` bytes) and a
        flag tensor, non-zero where a kept value or its cast is not finite."""
        return None

    # TopK's sampled selection and payload (the numba backend's; see aqsgd.compress.topk)
    def topk_rows(self, keys: torch.Tensor, k: int,
                  sampling: TopkSampling) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The sampled selection of each row of ``keys`` [R, n] (a float tensor's bits as the signed integers
        of its width, read without the sign bit): positions ``[R, k]`` (int64, increasing) and a bool per
        row, False where the sample misled (that row is then to be ranked in full)."""
        return None

    def topk_pack(self, x2: torch.Tensor, idx: torch.Tensor, wire: torch.dtype,
                  width: int) -> torch.Tensor | None:
        """TopK's payload for fp32 ``x2`` [R, n] and the positions ``idx`` [R, k]: the kept values cast to
        ``wire`` (fp32, fp16 or bf16), then the positions' low ``width`` bytes; None where a kept value or its
        cast is not finite (the general path raises the codec's error)."""
        return None

    def topk_encode(self, x2: torch.Tensor, k: int, sampling: TopkSampling, wire: torch.dtype,
                    width: int) -> torch.Tensor | None:
        """:meth:`topk_rows` and :meth:`topk_pack` in one operation: the payload, or None where a row's sample
        misled or a kept value is not finite (the caller then takes the general path)."""
        return None

    # the rANS coder of the :rc stage, on host bytes (see aqsgd.compress.rans): no general path
    def rans_count(self, body: np.ndarray, width: int, shift: int, nsyms: int) -> np.ndarray | None:
        """Counts (int64 ``[nsyms]``) of the ``width``-bit symbols of the packed codes ``body``."""
        return None

    def rans_encode(self, body: np.ndarray, width: int, shift: int, nsym: int, block: int, freq: np.ndarray,
                    cum: np.ndarray, words: np.ndarray, states: np.ndarray, starts: np.ndarray) -> bool:
        """Code the ``nsym`` symbols of ``body`` into lanes of ``block`` symbols: each lane's 16-bit words
        into its stretch of ``words``, from ``starts[lane]``, and its final state into ``states`` (the layout
        of :mod:`aqsgd.compress.rans`); False where the backend has no coder."""
        return False

    def rans_decode(self, words: np.ndarray, states: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                    slots: np.ndarray, freq: np.ndarray, cum: np.ndarray, nsym: int, block: int,
                    sym: np.ndarray, bad: np.ndarray) -> bool:
        """Decode each lane's words into its symbols of ``sym`` (one a byte), ``bad[lane]`` set where a lane
        does not end where it should; False where the backend has no coder."""
        return False

    def rans_pack(self, sym: np.ndarray, width: int, shift: int, out: np.ndarray) -> bool:
        """Pack one symbol a byte into ``width``-bit fields of ``out``; False where the backend has no
        coder."""
        return False

    def __repr__(self) -> str:
        return f"<{self.name} kernels on {self.device}>"
