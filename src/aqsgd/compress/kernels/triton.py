"""The ``triton`` backend: the codecs' operations as Triton kernels, one read and one write each (TopK: five
reads in five launches).

What runs here: max-abs per group, quantize-and-pack (nearest and stochastic rounding, every bit width 1-8,
channel/token/block groups, ``midrise``), unpack-and-dequantize, the Hadamard tiles of ``rot<G>``, TopK's
exact selection and its cast payload (fp32 input), the outlier rows' norms and split, and AQ-SGD's fused
sender and receiver steps against fp32/fp16/bf16 cache rows. What does not: the means of the
``l2``/``step``/``mean`` scales (PyTorch's reductions, whose order a kernel would not reproduce), entropy
stages (host), the fused AQ-SGD step with stochastic rounding (step by step). The host decisions around the
kernels are deferred on CUDA (the finite-scale checks, TopK's finite-value flag: device flags the packet
carries, see :mod:`aqsgd.compress.kernels`); the outlier count still synchronises.

Launches, not bytes, set an encode's cost on a GPU for activations of a few MB: each PyTorch operation is one
launch and tens of microseconds of host time there. So the quantizer's scales are made inside the kernels:
the max kernel's last step stores each group's scale at the payload's head (fp16 rounded up and clamped, or
fp32), writes ``inv`` and raises the NaN/Inf flag (``max_scales``; ``scales`` for ``l2``/``step``), and the
decode kernel reads the stored scales, divides them and flags bad ones itself (``unpack_scaled``). A ``q4``
encode is then two launches plus two allocations and a zeroed flag, where it was about twenty operations; a
decode one launch, where it was about twelve (counted on the CPU under the interpreter). Scales by row
(``token``, ``blockN``) take one launch for the scales and the codes (``row_max_quant_pack``: a program owns
whole rows); scales by column two or three (the column max over row ranges, their reduction with the scales,
then the codes: a column's max needs every row before any code). TopK's selection is three histogram passes,
a count and the write: five launches (it was eight, with a launch of its own for each pass's pick, which the
next kernel's programs now make for themselves). The scale arithmetic
is PyTorch's, operation for operation: ``store_scales``'s rounding, ``reciprocal(2 * s) * qmax`` and the
decode's ``s / divisor`` correctly rounded (``tl.math.div_rn``; Triton 3.2's flushes fp32 subnormals, which
only a ``scale32`` scale below 1.2e-38 could be).

The kernels themselves are in :mod:`aqsgd.compress.kernels._triton_jit` (imported at first use), and every
launch has floating-point contraction off (:class:`_Unfused`): ``tests/compress/triton_compile_cases.py``
compiles each for an H100 without a GPU and reads the rounding in its PTX.

Each kernel works on the quantizer's 2-D view ``[R, K]`` (``K * bits % 8 == 0``: every row's codes start
on a byte), a tile of rows times a tile of *groups of 8 codes* per program: 8 codes of ``bits`` bits fill
exactly ``bits`` bytes, so every group packs into a 64-bit word (code ``i`` shifted to bit ``bits * i``) whose
low ``bits`` bytes are stored, the layout of :func:`~aqsgd.compress.bitpack.pack_bits`. A row's last group may
be short (``K % 8`` codes: q8 rows of any length, such as TopK's kept values): each byte is stored or loaded
only where it lies inside the row's ``K * bits / 8``. Quantizing is ``trunc(clamp(fma(x, inv, offset), 0,
qmax))`` with one rounding (``tl.fma``), as the CPU computes it, so the bytes equal the numba and eager
backends' on the CPU; decoding is ``(code * mul - low) * step`` (exact small integers, then one rounding).
There is no host synchronisation inside a kernel launch.

Bit for bit: the Hadamard butterflies are the PyTorch path's additions in the same order (the products by
the +-1 signs are exact, so contracting one into an fma changes nothing); stochastic rounding adds the
codec's noise, drawn as the general path draws it, after the fma's single rounding; TopK compares the
magnitudes' bits as integers (the CPU's tie rule: the lowest positions); bf16 and fp16 casts round to nearest
even as PyTorch does. One exception: the outlier rows' sums of squares run in the kernel's order, equal to
PyTorch's to rounding only (see :class:`~aqsgd.compress.wrappers.OutlierCodec`).

On a machine without a GPU the kernels run on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``
set before ``triton`` is imported): the tests compare their bytes with the other backends' that way. Triton is
not a dependency of aqsgd: it comes with PyTorch's CUDA builds.
"""

from __future__ import annotations

import functools
import os

import torch

from aqsgd.compress.kernels import register_backend
from aqsgd.compress.kernels.base import STORE_FORMATS, Kernels, RowStore

__all__ = ["TritonKernels", "available", "interpreting"]

_BLOCK_R = 16  # rows per program
_BLOCK_G = 16  # groups of 8 codes per program (128 values of a row)
_BLOCK_K = 128  # values per step of the max kernels
_SCALE_BLOCK = 1024  # scales per program of the scales kernel
_CAST_BLOCK = 4096  # values per program of the cast kernel
_FWHT_VALUES = 4096  # values per program of the Hadamard kernel (rows of a tile each)
_TOPK_CHUNK = 16384  # values of a row per program of the TopK kernels
_TOPK_BLOCK = 1024  # values per step within a chunk
_TOPK_CBLOCK = 128  # chunk counts summed per step
# The radix digits of the 31-bit magnitude key, (shift, bits, mask of the digits above it), from the top: by
# default 8 bits (four passes, 256 bins). What a histogram costs depends on Triton's lowering: 3.2-3.6
# count with warp ballots, about 3,000 PTX instructions per 1,024 keys at 2,048 bins and 860 at 256
# (compiled for sm_90); 3.9 with one shared-memory atomic per key whatever the bins. Measured on an H200 with
# Triton 3.6 (the GPU check, 2026-11-30, docs/bench-codecs.md): the four 8-bit passes took 92 us of device
# time where the three 11-bit passes took 435 us. AQSGD_TOPK_DIGIT_BITS=11 keeps the three passes
# (unmeasured on 3.9).
TOPK_DIGIT_BITS = (11, 8)


@functools.lru_cache(maxsize=None)
def topk_digits(bits: int) -> tuple[tuple[int, int, int], ...]:
    """The digits of ``bits`` bits each (the last one what is left), from the key's top bit down."""
    out, top = [], 31
    while top > 0:
        nbits = min(bits, top)
        out.append((top - nbits, nbits, (0x7FFFFFFF >> top) << top))
        top -= nbits
    return tuple(out)


def _topk_digits() -> tuple[tuple[int, int, int], ...]:
    text = os.environ.get("AQSGD_TOPK_DIGIT_BITS", "8")
    if not text.isdigit() or int(text) not in TOPK_DIGIT_BITS:
        raise ValueError(f"AQSGD_TOPK_DIGIT_BITS={text}: one of {', '.join(map(str, TOPK_DIGIT_BITS))}")
    return topk_digits(int(text))


_TOPK_BINS = 2048  # the most bins of a digit (the histograms' row stride)


def interpreting() -> bool:
    """Whether Triton runs its kernels in its interpreter (on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


def available(device: torch.device | str) -> bool:
    """Whether the kernels run on ``device`` here: a CUDA device with Triton installed, or the CPU under the
    interpreter."""
    device = torch.device(device)
    if device.type == "cuda":
        return _triton_importable() and torch.cuda.is_available()
    return device.type == "cpu" and interpreting() and _triton_importable()


@functools.lru_cache(maxsize=None)
def _kernels() -> dict[str, _Unfused]:
    """The ``@triton.jit`` kernels (:mod:`aqsgd.compress.kernels._triton_jit`), imported at first use."""
    from aqsgd.compress.kernels._triton_jit import KERNELS

    return {name: _Unfused(kernel) for name, kernel in KERNELS.items()}


class _Unfused:
    """A kernel that launches with floating-point contraction off (``enable_fp_fusion=False``). Triton
    compiles ``a * b + c`` into one fma by default (3.2 to 3.9 at least), one rounding where the PyTorch and
    numba paths round twice: the AQ-SGD cache update ``m + level * step`` would then write other bits on a GPU
    than on the CPU. An explicit ``tl.fma`` (the quantizer's single rounding, as the CPU's ``addcmul``) stays
    one (``tests/compress/triton_compile_cases.py`` reads both in the compiled code)."""

    __slots__ = ("kernel",)

    def __init__(self, kernel) -> None:
        self.kernel = kernel

    def __getitem__(self, grid):
        return functools.partial(self.kernel[grid], enable_fp_fusion=False)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# programs a column max aims at: its columns' programs times row splits (an H100 has 132 SMs)
_MAX_PROGRAMS = 512


def _row_splits(rows: int, k: int) -> tuple[int, int]:
    """How a column max splits its rows: ``(splits, rows per split)``, the rows per split a multiple of
    ``_BLOCK_R``; one split where the columns alone give ``_MAX_PROGRAMS`` programs or the rows are few."""
    want = max(1, min(_cdiv(rows, _BLOCK_R), _MAX_PROGRAMS // _cdiv(k, _BLOCK_K)))
    chunk = max(_cdiv(_cdiv(rows, want), _BLOCK_R), 1) * _BLOCK_R
    return max(_cdiv(rows, chunk), 1), chunk


def _col_splits(rows: int, k: int) -> tuple[int, int]:
    """How a row max splits its columns: ``(splits, columns per split)``, a multiple of ``_BLOCK_K``; one
    split unless the rows are so few that they alone give under ``_MAX_PROGRAMS / 8`` programs (a
    4096 x 768 activation has 256 and is not split; TopK's kept values, 80 rows of 39,322, have 5)."""
    programs = _cdiv(rows, _BLOCK_R)
    if programs >= _MAX_PROGRAMS // 8:
        return 1, k
    want = max(1, min(_cdiv(k, _BLOCK_K), _MAX_PROGRAMS // programs))
    chunk = max(_cdiv(_cdiv(k, want), _BLOCK_K), 1) * _BLOCK_K
    return max(_cdiv(k, chunk), 1), chunk


def _finish_colmax(part: torch.Tensor, out: torch.Tensor, stored: torch.Tensor, flag: torch.Tensor,
                   qmax: float, *, scales: bool) -> None:
    """``out`` from the partial column maxes ``part`` ``[splits, K]`` (``colmax_finish``)."""
    splits, k = part.shape
    _kernels()["colmax_finish"][(_cdiv(k, _BLOCK_K),)](part, out, stored, flag, splits, k, qmax,
                                                       SCALES=scales, HALF=stored.dtype == torch.float16,
                                                       BLOCK_K=_BLOCK_K)


def _bf16(store: RowStore) -> bool:
    return store.data.dtype == torch.bfloat16


def _storage(store: RowStore) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache rows as the kernels address them (bf16 as its int16 bits, rounded by hand: Triton's own
    conversion does not round to nearest even everywhere) and the ids."""
    return (store.data.view(torch.int16) if _bf16(store) else store.data), store.ids


class TritonKernels(Kernels):
    """The operations of :mod:`aqsgd.compress.kernels` as Triton kernels (see the module docstring); the
    numpy TopK operations (the numba backend's) are left out: TopK runs through :meth:`topk_select` and
    :meth:`topk_payload` here."""

    name = "triton"

    def max_abs(self, x2: torch.Tensor, by_col: bool) -> torch.Tensor:
        rows, k = x2.shape
        out = torch.empty(k if by_col else rows, dtype=torch.float32, device=x2.device)
        self._max(x2, by_col, out, out, out, 0.0, scales=False)
        return out

    def max_scales(self, x2: torch.Tensor, by_col: bool, stored: torch.Tensor, qmax: int,
                   flag: torch.Tensor) -> torch.Tensor:
        rows, k = x2.shape
        inv = torch.empty(k if by_col else rows, dtype=torch.float32, device=x2.device)
        self._max(x2, by_col, inv, stored, flag, float(qmax), scales=True)
        return inv

    @staticmethod
    def _max(x2: torch.Tensor, by_col: bool, out: torch.Tensor, stored: torch.Tensor, flag: torch.Tensor,
             qmax: float, *, scales: bool) -> None:
        rows, k = x2.shape
        half = stored.dtype == torch.float16
        if not by_col:
            splits, chunk = _col_splits(rows, k)
            if splits == 1:
                _kernels()["rowmax"][(_cdiv(rows, _BLOCK_R),)](x2, out, stored, flag, rows, k, qmax,
                                                               SCALES=scales, HALF=half, BLOCK_R=_BLOCK_R,
                                                               BLOCK_K=_BLOCK_K)
                return
            part = torch.empty(splits, rows, dtype=torch.float32, device=x2.device)
            _kernels()["rowmax_partial"][(_cdiv(rows, _BLOCK_R), splits)](x2, part, rows, k, chunk,
                                                                          BLOCK_R=_BLOCK_R, BLOCK_K=_BLOCK_K)
            _finish_colmax(part, out, stored, flag, qmax, scales=scales)  # the rows are part's columns
            return
        splits, chunk = _row_splits(rows, k)
        part = out if splits == 1 else torch.empty(splits, k, dtype=torch.float32, device=x2.device)
        _kernels()["colmax"][(_cdiv(k, _BLOCK_K), splits)](
            x2, part, stored, flag, rows, k, qmax, chunk, SCALES=scales, HALF=half, PARTIAL=splits > 1,
            BLOCK_R=_BLOCK_R, BLOCK_K=_BLOCK_K)
        if splits > 1:
            _finish_colmax(part, out, stored, flag, qmax, scales=scales)

    def scales(self, s: torch.Tensor, stored: torch.Tensor, qmax: int, flag: torch.Tensor,
               step: torch.Tensor | None = None, divisor: int = 1) -> torch.Tensor:
        inv = torch.empty(s.shape[0], dtype=torch.float32, device=s.device)
        _kernels()["scales"][(_cdiv(s.shape[0], _SCALE_BLOCK),)](
            s, stored, inv, inv if step is None else step, flag, s.shape[0], float(qmax), float(divisor),
            HALF=stored.dtype == torch.float16, STEP=step is not None, BLOCK=_SCALE_BLOCK)
        return inv

    def steps(self, stored: torch.Tensor, divisor: int, flag: torch.Tensor) -> torch.Tensor:
        step = torch.empty(stored.shape[0], dtype=torch.float32, device=stored.device)
        _kernels()["steps"][(_cdiv(stored.shape[0], _SCALE_BLOCK),)](stored, step, flag, stored.shape[0],
                                                                     float(divisor), BLOCK=_SCALE_BLOCK)
        return step

    stochastic = True
    fuses_scales = True

    def max_quantize_rows(self, x2: torch.Tensor, stored: torch.Tensor, qmax: int, flag: torch.Tensor,
                          offset: float, bits: int, out: torch.Tensor) -> bool:
        rows, k = x2.shape
        if _col_splits(rows, k)[0] > 1:  # few long rows: the max split over the columns, then quant_pack
            return False
        _kernels()["row_max_quant_pack"][(_cdiv(rows, _BLOCK_R),)](
            x2, stored, flag, out, rows, k, float(offset), float(qmax), HALF=stored.dtype == torch.float16,
            BITS=bits, BLOCK_R=_BLOCK_R, BLOCK_K=_BLOCK_K, BLOCK_G=_BLOCK_G)
        return True

    def quantize_pack(self, x2: torch.Tensor, inv: torch.Tensor, by_col: bool, offset: float, bits: int,
                      qmax: int, out: torch.Tensor | None = None,
                      noise: torch.Tensor | None = None) -> torch.Tensor:
        """The packed codes (see :class:`~aqsgd.compress.kernels.Kernels`). Stochastic rounding reads the
        caller's ``noise``, the very tensor the general path draws (same generator, shape and order) and adds
        to the fma's result before clamping and truncating, as that path does: the bytes are the general
        path's. The kernel draws no random numbers of its own."""
        rows, k = x2.shape
        if out is None:
            out = torch.empty(rows, k * bits // 8, dtype=torch.uint8, device=x2.device)
        grid = (_cdiv(rows, _BLOCK_R), _cdiv(_cdiv(k, 8), _BLOCK_G))
        _kernels()["quant_pack"][grid](x2, inv, x2 if noise is None else noise, out, rows, k, float(offset),
                                       float(qmax), BY_COL=by_col, BITS=bits, NOISE=noise is not None,
                                       BLOCK_R=_BLOCK_R, BLOCK_G=_BLOCK_G)
        return out

    def unpack_dequantize(self, packed: torch.Tensor, step: torch.Tensor, by_col: bool, bits: int, mul: int,
                          low: int) -> torch.Tensor:
        return self._unpack(packed, step, by_col, bits, mul, low, 1, step, scales=False)

    def unpack_scaled(self, packed: torch.Tensor, stored: torch.Tensor, by_col: bool, bits: int, mul: int,
                      low: int, divisor: int, flag: torch.Tensor) -> torch.Tensor:
        return self._unpack(packed, stored, by_col, bits, mul, low, divisor, flag, scales=True)

    @staticmethod
    def _unpack(packed: torch.Tensor, step: torch.Tensor, by_col: bool, bits: int, mul: int, low: int,
                divisor: int, flag: torch.Tensor, *, scales: bool) -> torch.Tensor:
        rows = packed.shape[0]
        k = packed.shape[1] * 8 // bits
        out = torch.empty(rows, k, dtype=torch.float32, device=packed.device)
        grid = (_cdiv(rows, _BLOCK_R), _cdiv(_cdiv(k, 8), _BLOCK_G))
        _kernels()["unpack_dequant"][grid](packed, step, out, flag, rows, k, float(mul), float(low),
                                           float(divisor), BY_COL=by_col, BITS=bits, SCALES=scales,
                                           BLOCK_R=_BLOCK_R, BLOCK_G=_BLOCK_G)
        return out

    def cast_checked(self, x: torch.Tensor, wire: torch.dtype, flag: torch.Tensor) -> torch.Tensor | None:
        if x.dtype != torch.float32 or wire not in (torch.float16, torch.bfloat16) or not x.is_contiguous():
            return None
        y = torch.empty(x.shape, dtype=wire, device=x.device)
        n = x.numel()
        bf16 = wire == torch.bfloat16
        _kernels()["cast_checked"][(_cdiv(n, _CAST_BLOCK),)](x, y.view(torch.int16) if bf16 else y, flag, n,
                                                             BF16=bf16, BLOCK=_CAST_BLOCK)
        return y

    def fwht(self, x2: torch.Tensor, signs: torch.Tensor, c: float, inverse: bool) -> torch.Tensor:
        """Walsh-Hadamard transform of each row: ``H (s * x) * c`` or, with ``inverse``, ``(H x * c) * s``
        (see :mod:`aqsgd.compress.hadamard`), one program per ``_FWHT_VALUES / G`` rows held in registers.
        Every output is the same sequence of IEEE additions and subtractions as the PyTorch and numba paths
        compute, then the same multiplications: the results are bit-identical."""
        rows, g = x2.shape
        out = torch.empty_like(x2)
        block_r = max(1, min(_FWHT_VALUES // g, 1 << max(0, rows - 1).bit_length()))
        _kernels()["fwht_rows"][(_cdiv(rows, block_r),)](x2, signs, out, float(c), rows, G=g,
                                                         LOG_G=g.bit_length() - 1, INVERSE=inverse,
                                                         BLOCK_R=block_r)
        return out

    # -- TopK (aqsgd.compress.topk): exact selection on the device, no host synchronisation
    def _topk_kth(self, xi: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The k-th largest key of each row of the int32 view ``xi`` [R, n] and how many keys equal to it
        are kept (``state[-1]`` [R, 2] int32), each chunk's count of keys above and equal to it
        (``counts``), and the number of chunks. A launch per digit's histogram, each but the first picking
        the previous digit in its programs, then the count, which picks the last: four launches with 11-bit
        digits."""
        rows, n = xi.shape
        k = int(k)
        digits = _topk_digits()
        nchunk = _cdiv(n, _TOPK_CHUNK)
        hist = torch.zeros(len(digits), rows, _TOPK_BINS, dtype=torch.int32, device=xi.device)
        state = torch.empty(len(digits), rows, 2, dtype=torch.int32, device=xi.device)  # each pick
        ks = _kernels()
        from aqsgd.compress.kernels._triton_jit import HIST_MASKED

        for p, (shift, nbits, high) in enumerate(digits):
            before = max(p - 1, 0)  # the pass whose digit this one's programs pick (none for the first)
            pshift, pnbits, _ = digits[before]
            ks["topk_hist"][(rows, nchunk)](xi, hist[before], state[max(p - 2, 0)], state[before], hist[p], n,
                                            _TOPK_CHUNK, k, SHIFT=shift, NB=1 << nbits, HIGH=high, PICK=p > 0,
                                            PSHIFT=pshift, PNB=1 << pnbits, PFIRST=p == 1, MASKED=HIST_MASKED,
                                            BLOCK=_TOPK_BLOCK)
        last = len(digits) - 1
        lshift, lnbits, _ = digits[last]
        counts = torch.empty(rows, nchunk, 2, dtype=torch.int32, device=xi.device)
        ks["topk_count"][(rows, nchunk)](xi, hist[last], state[last - 1], state[last], counts, n, _TOPK_CHUNK,
                                         nchunk, k, PSHIFT=lshift, PNB=1 << lnbits, BLOCK=_TOPK_BLOCK)
        return state[last], counts, nchunk

    def _topk_supported(self, x2: torch.Tensor, k: int) -> bool:
        rows, n = x2.shape
        return (x2.dtype == torch.float32 and x2.is_contiguous() and 0 < k < n < 2**31
                and rows * max(n, 2 * _TOPK_BINS) < 2**31)

    def topk_select(self, x2: torch.Tensor, k: int) -> torch.Tensor | None:
        """Positions ``[R, k]`` (int64, increasing) of the ``k`` largest magnitudes of each row of fp32
        ``x2``, ties at the k-th magnitude to the lower positions and NaN above Inf: the CPU's selection
        (:func:`aqsgd.compress.topk.topk_indices`). None where ``k`` is not in ``(0, n)``."""
        if not self._topk_supported(x2, k):
            return None
        rows, n = x2.shape
        xi = x2.view(torch.int32)
        state, counts, nchunk = self._topk_kth(xi, k)
        idx = torch.empty(rows, k, dtype=torch.int64, device=x2.device)
        _kernels()["topk_write"][(rows, nchunk)](xi, state, counts, idx, idx, idx, idx, n, k, _TOPK_CHUNK,
                                                 nchunk, PACK=False, FMT=0, WIDTH=1, BLOCK=_TOPK_BLOCK,
                                                 CBLOCK=_TOPK_CBLOCK)
        return idx

    def topk_payload(self, x2: torch.Tensor, k: int, wire: torch.dtype,
                     width: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """TopK's payload for fp32 ``x2`` [R, n] with the kept values cast to ``wire`` (fp32, fp16 or bf16):
        the values ``[R, k]`` of :meth:`topk_select`'s positions, then the positions' low ``width`` bytes,
        little-endian, byte for byte what the numba kernel and the step-by-step path write; and a device flag
        (int32 [1]), non-zero where a kept value or its cast is Inf or NaN (the packet is then invalid: the
        caller takes the step-by-step path, which raises)."""
        fmt = STORE_FORMATS.get(wire)
        if fmt is None or not self._topk_supported(x2, k):
            return None
        rows, n = x2.shape
        xi = x2.view(torch.int32)
        state, counts, nchunk = self._topk_kth(xi, k)
        vbytes = rows * k * wire.itemsize
        payload = torch.empty(vbytes + rows * k * width, dtype=torch.uint8, device=x2.device)
        vals = payload[:vbytes].view(torch.float32 if fmt == 0 else torch.int16)
        bad = torch.zeros(1, dtype=torch.int32, device=x2.device)
        _kernels()["topk_write"][(rows, nchunk)](xi, state, counts, vals, vals, payload[vbytes:], bad, n, k,
                                                 _TOPK_CHUNK, nchunk, PACK=True, FMT=fmt, WIDTH=width,
                                                 BLOCK=_TOPK_BLOCK, CBLOCK=_TOPK_CBLOCK)
        return payload, bad

    # -- outlier rows
    def row_sumsq(self, x2: torch.Tensor) -> torch.Tensor | None:
        """Each row's sum of squares (fp32 ``[R]``) of ``x2`` [R, D] (fp32, bf16 or fp16), one read. The sum
        runs in another order than PyTorch's ``square().sum(1)``: the values agree to float rounding, not to
        the bit (see :meth:`~aqsgd.compress.kernels.Kernels.row_sumsq`)."""
        if x2.dtype not in (torch.float32, torch.bfloat16, torch.float16) or not x2.is_contiguous():
            return None
        rows, d = x2.shape
        out = torch.empty(rows, dtype=torch.float32, device=x2.device)
        _kernels()["row_sumsq"][(_cdiv(rows, _BLOCK_R),)](x2, out, rows, d, BLOCK_R=_BLOCK_R,
                                                          BLOCK_K=_BLOCK_K)
        return out

    def split_rows(self, x2: torch.Tensor, idx: torch.Tensor,
                   apart: torch.Tensor) -> torch.Tensor | None:
        """The rows of ``x2`` [R, D] not in ``idx`` (ascending int64 on the device), in order, as a new
        tensor of ``x2``'s dtype; the rows in ``idx`` rounded to bf16 into ``apart`` (int16 ``[k, D]``, the
        bf16 bits), in one pass: the bytes of ``x2[keep]`` and ``x2[idx].to(torch.bfloat16)``."""
        if x2.dtype not in (torch.float32, torch.bfloat16, torch.float16) or not x2.is_contiguous():
            return None
        rows, d = x2.shape
        k = idx.numel()
        rest = torch.empty(rows - k, d, dtype=x2.dtype, device=x2.device)
        if rows * d:
            _kernels()["split_rows"][(rows, _cdiv(d, _BLOCK_K))](x2, idx, rest, apart, d, k, BLOCK_D=_BLOCK_K,
                                                                 BLOCK_I=_BLOCK_K)
        return rest

    # -- AQ-SGD against a cache's rows (the store on the tensors' device)
    def delta_max_abs(self, x2: torch.Tensor, store: RowStore, rpb: int, by_col: bool) -> torch.Tensor | None:
        if store.device != x2.device:
            return None
        rows, k = x2.shape
        out = torch.empty(k if by_col else rows, dtype=torch.float32, device=x2.device)
        if not by_col:
            _kernels()["delta_rowmax"][(_cdiv(rows, _BLOCK_R),)](x2, *_storage(store), out, rows, k, rpb,
                                                                 BF16=_bf16(store), BLOCK_R=_BLOCK_R,
                                                                 BLOCK_K=_BLOCK_K)
            return out
        splits, chunk = _row_splits(rows, k)
        part = out if splits == 1 else torch.empty(splits, k, dtype=torch.float32, device=x2.device)
        _kernels()["delta_colmax"][(_cdiv(k, _BLOCK_K), splits)](
            x2, *_storage(store), part, rows, k, rpb, chunk, BF16=_bf16(store), BLOCK_R=_BLOCK_R,
            BLOCK_K=_BLOCK_K)
        if splits > 1:
            _finish_colmax(part, out, out, out, 0.0, scales=False)
        return out

    def delta(self, x2: torch.Tensor, store: RowStore, rpb: int) -> torch.Tensor | None:
        if store.device != x2.device:
            return None
        rows, k = x2.shape
        out = torch.empty_like(x2)
        grid = (_cdiv(rows, _BLOCK_R), _cdiv(k, _BLOCK_K))
        _kernels()["delta_into"][grid](x2, *_storage(store), out, rows, k, rpb, BF16=_bf16(store),
                                       BLOCK_R=_BLOCK_R, BLOCK_K=_BLOCK_K)
        return out

    def delta_encode_update(self, x2: torch.Tensor, store: RowStore, rpb: int, inv: torch.Tensor,
                            by_col: bool, offset: float, bits: int, qmax: int, step: torch.Tensor, mul: int,
                            low: int, out: torch.Tensor | None = None) -> torch.Tensor | None:
        if store.device != x2.device:
            return None
        rows, k = x2.shape
        if out is None:
            out = torch.empty(rows, k * bits // 8, dtype=torch.uint8, device=x2.device)
        grid = (_cdiv(rows, _BLOCK_R), _cdiv(_cdiv(k, 8), _BLOCK_G))
        _kernels()["delta_quant_update"][grid](x2, *_storage(store), inv, step, out, rows, k, rpb,
                                               float(offset), float(qmax), float(mul), float(low),
                                               BY_COL=by_col, BITS=bits, BF16=_bf16(store), BLOCK_R=_BLOCK_R,
                                               BLOCK_G=_BLOCK_G)
        return out

    def delta_decode_update(self, packed: torch.Tensor, store: RowStore, rpb: int, step: torch.Tensor,
                            by_col: bool, bits: int, mul: int, low: int) -> torch.Tensor | None:
        if store.device != packed.device:
            return None
        rows = packed.shape[0]
        k = packed.shape[1] * 8 // bits
        out = torch.empty(rows, k, dtype=torch.float32, device=packed.device)
        grid = (_cdiv(rows, _BLOCK_R), _cdiv(_cdiv(k, 8), _BLOCK_G))
        _kernels()["delta_dequant_update"][grid](packed, *_storage(store), step, out, rows, k, rpb,
                                                 float(mul), float(low), BY_COL=by_col, BITS=bits,
                                                 BF16=_bf16(store), BLOCK_R=_BLOCK_R, BLOCK_G=_BLOCK_G)
        return out


register_backend("triton", TritonKernels, runs_on=available, default_on=("cuda",), rank=10)
