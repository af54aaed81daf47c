"""The ``triton`` backend: the codecs' operations as Triton kernels, one read and one write each (TopK: five).

What runs here: max-abs per group, quantize-and-pack (nearest and stochastic rounding, every bit width 1-8,
channel/token/block groups, ``midrise``), unpack-and-dequantize, the Hadamard tiles of ``rot<G>``, TopK's
exact selection and its cast payload (fp32 input), the outlier rows' norms and split, and AQ-SGD's fused
sender and receiver steps against fp32/fp16/bf16 cache rows. What does not: the means of the
``l2``/``step``/``mean`` scales (PyTorch's reductions, whose order a kernel would not reproduce), entropy
stages (host), the fused AQ-SGD step with stochastic rounding (step by step). The host decisions around the
kernels are deferred on CUDA (the finite-scale checks, TopK's finite-value flag: device flags the packet
carries, see :mod:`aqsgd.compress.kernels`); the outlier count and the decode-side scale checks still
synchronise.

Each kernel works on the quantizer's 2-D view ``[R, K]`` (``K % 8 == 0``), a tile of rows times a tile of
*groups of 8 codes* per program: 8 codes of ``bits`` bits fill exactly ``bits`` bytes, so every group packs
into a 64-bit word (code ``i`` shifted to bit ``bits * i``) whose low ``bits`` bytes are stored, the layout of
:func:`~aqsgd.compress.bitpack.pack_bits`. Quantizing is ``trunc(clamp(fma(x, inv, offset), 0, qmax))`` with
one rounding (``tl.fma``), as the CPU computes it, so the bytes equal the numba and eager backends' on the
CPU; decoding is ``(code * mul - low) * step`` (exact small integers, then one rounding). There is no host
synchronisation inside a kernel launch.

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

from aqsgd.compress.kernels.base import STORE_FORMATS, Kernels, RowStore

__all__ = ["TritonKernels", "available", "interpreting"]

_BLOCK_R = 16  # rows per program
_BLOCK_G = 16  # groups of 8 codes per program (128 values of a row)
_BLOCK_K = 128  # values per step of the max kernels
_FWHT_VALUES = 4096  # values per program of the Hadamard kernel (rows of a tile each)
_TOPK_CHUNK = 16384  # values of a row per program of the TopK kernels
_TOPK_BLOCK = 1024  # values per step within a chunk
_TOPK_CBLOCK = 128  # chunk counts summed per step
_TOPK_BINS = 2048
# the radix digits of the 31-bit magnitude key: (shift, bits, mask of the digits above it)
_TOPK_DIGITS = ((20, 11, 0), (9, 11, 0x7FF00000), (0, 9, 0x7FFFFE00))


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
def _kernels():
    """The ``@triton.jit`` kernels, defined at first use (importing triton costs a second)."""
    import triton
    import triton.language as tl

    @triton.jit
    def rowmax(x_ptr, out_ptr, R, K, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < R
        best = tl.zeros([BLOCK_R], dtype=tl.float32)
        nans = tl.zeros([BLOCK_R], dtype=tl.int32)
        for start in range(0, K, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            m = rmask[:, None] & (cols < K)[None, :]
            x = tl.abs(tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=m, other=0.0))
            nans += tl.sum((x != x).to(tl.int32), axis=1)
            best = tl.maximum(best, tl.max(tl.where(x != x, 0.0, x), axis=1))
        best = tl.where(nans > 0, float("nan"), best)
        tl.store(out_ptr + rows, best, mask=rmask)

    @triton.jit
    def colmax(x_ptr, out_ptr, R, K, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        cols = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
        cmask = cols < K
        best = tl.zeros([BLOCK_K], dtype=tl.float32)
        nans = tl.zeros([BLOCK_K], dtype=tl.int32)
        for start in range(0, R, BLOCK_R):
            rows = start + tl.arange(0, BLOCK_R)
            m = (rows < R)[:, None] & cmask[None, :]
            x = tl.abs(tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=m, other=0.0))
            nans += tl.sum((x != x).to(tl.int32), axis=0)
            best = tl.maximum(best, tl.max(tl.where(x != x, 0.0, x), axis=0))
        best = tl.where(nans > 0, float("nan"), best)
        tl.store(out_ptr + cols, best, mask=cmask)

    @triton.jit
    def quant_pack(x_ptr, inv_ptr, noise_ptr, out_ptr, R, K, offset, qmax, BY_COL: tl.constexpr,
                   BITS: tl.constexpr, NOISE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        groups = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
        lane = tl.arange(0, 8)
        cols = groups[:, None] * 8 + lane[None, :]  # [G, 8]
        rmask = rows < R
        cmask = cols < K
        m = rmask[:, None, None] & cmask[None, :, :]
        x = tl.load(x_ptr + rows[:, None, None] * K + cols[None, :, :], mask=m, other=0.0)
        if BY_COL:
            inv = tl.load(inv_ptr + cols, mask=cmask, other=0.0)[None, :, :]
        else:
            inv = tl.load(inv_ptr + rows, mask=rmask, other=0.0)[:, None, None]
        t = tl.fma(x, inv, offset)
        if NOISE:  # stochastic rounding: the general path's uniform draw, added after the fma's rounding
            t = t + tl.load(noise_ptr + rows[:, None, None] * K + cols[None, :, :], mask=m, other=0.0)
        t = tl.minimum(tl.maximum(t, 0.0), qmax)
        code = t.to(tl.int32).to(tl.int64)
        word = tl.sum(code << (lane[None, None, :].to(tl.int64) * BITS), axis=2)  # [R, G]: disjoint bits
        nb = K * BITS // 8
        gm = rmask[:, None] & (groups < K // 8)[None, :]
        for b in tl.static_range(BITS):
            tl.store(out_ptr + rows[:, None] * nb + groups[None, :] * BITS + b,
                     ((word >> (8 * b)) & 0xFF).to(tl.uint8), mask=gm)

    @triton.jit
    def unpack_dequant(p_ptr, step_ptr, out_ptr, R, K, mul, low, BY_COL: tl.constexpr, BITS: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        groups = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
        rmask = rows < R
        gm = rmask[:, None] & (groups < K // 8)[None, :]
        nb = K * BITS // 8
        word = tl.zeros([BLOCK_R, BLOCK_G], dtype=tl.int64)
        for b in tl.static_range(BITS):
            byte = tl.load(p_ptr + rows[:, None] * nb + groups[None, :] * BITS + b, mask=gm, other=0)
            word |= byte.to(tl.int64) << (8 * b)
        lane = tl.arange(0, 8)
        code = (word[:, :, None] >> (lane[None, None, :].to(tl.int64) * BITS)) & ((1 << BITS) - 1)
        cols = groups[:, None] * 8 + lane[None, :]  # [G, 8]
        m = rmask[:, None, None] & (cols < K)[None, :, :]
        if BY_COL:
            step = tl.load(step_ptr + cols, mask=cols < K, other=0.0)[None, :, :]
        else:
            step = tl.load(step_ptr + rows, mask=rmask, other=0.0)[:, None, None]
        level = code.to(tl.float32) * mul - low  # a small integer: exact
        tl.store(out_ptr + rows[:, None, None] * K + cols[None, :, :], level * step, mask=m)

    # -- AQ-SGD against a cache's rows: row r of x2 is segment r % rpb of sample r // rpb, whose cache row is
    # st[ids[r // rpb]] (n = rpb * K values, in the storage's dtype)
    @triton.jit
    def delta_rowmax(x_ptr, st_ptr, ids_ptr, out_ptr, R, K, rpb, BF16: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < R
        best = tl.zeros([BLOCK_R], dtype=tl.float32)
        nans = tl.zeros([BLOCK_R], dtype=tl.int32)
        for start in range(0, K, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            m = rmask[:, None] & (cols < K)[None, :]
            x = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=m, other=0.0)
            where = ((tl.load(ids_ptr + rows // rpb, mask=rmask, other=0) * rpb + rows % rpb) * K)[:, None]
            c = tl.load(st_ptr + where + cols[None, :], mask=m, other=0)
            c = (c.to(tl.int32) << 16).to(tl.float32, bitcast=True) if BF16 else c.to(tl.float32)
            d = tl.abs(x - c)
            nans += tl.sum((d != d).to(tl.int32), axis=1)
            best = tl.maximum(best, tl.max(tl.where(d != d, 0.0, d), axis=1))
        tl.store(out_ptr + rows, tl.where(nans > 0, float("nan"), best), mask=rmask)

    @triton.jit
    def delta_colmax(x_ptr, st_ptr, ids_ptr, out_ptr, R, K, rpb, BF16: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        cols = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
        cmask = cols < K
        best = tl.zeros([BLOCK_K], dtype=tl.float32)
        nans = tl.zeros([BLOCK_K], dtype=tl.int32)
        for start in range(0, R, BLOCK_R):
            rows = start + tl.arange(0, BLOCK_R)
            rmask = rows < R
            m = rmask[:, None] & cmask[None, :]
            x = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=m, other=0.0)
            where = ((tl.load(ids_ptr + rows // rpb, mask=rmask, other=0) * rpb + rows % rpb) * K)[:, None]
            c = tl.load(st_ptr + where + cols[None, :], mask=m, other=0)
            c = (c.to(tl.int32) << 16).to(tl.float32, bitcast=True) if BF16 else c.to(tl.float32)
            d = tl.abs(x - c)
            nans += tl.sum((d != d).to(tl.int32), axis=0)
            best = tl.maximum(best, tl.max(tl.where(d != d, 0.0, d), axis=0))
        tl.store(out_ptr + cols, tl.where(nans > 0, float("nan"), best), mask=cmask)

    @triton.jit
    def delta_into(x_ptr, st_ptr, ids_ptr, out_ptr, R, K, rpb, BF16: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        rmask = rows < R
        m = rmask[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=m, other=0.0)
        where = ((tl.load(ids_ptr + rows // rpb, mask=rmask, other=0) * rpb + rows % rpb) * K)[:, None]
        c = tl.load(st_ptr + where + cols[None, :], mask=m, other=0)
        c = (c.to(tl.int32) << 16).to(tl.float32, bitcast=True) if BF16 else c.to(tl.float32)
        tl.store(out_ptr + rows[:, None] * K + cols[None, :], x - c, mask=m)

    @triton.jit
    def delta_quant_update(x_ptr, st_ptr, ids_ptr, inv_ptr, step_ptr, out_ptr, R, K, rpb, offset, qmax, mul,
                           low, BY_COL: tl.constexpr, BITS: tl.constexpr, BF16: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        groups = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
        lane = tl.arange(0, 8)
        cols = groups[:, None] * 8 + lane[None, :]  # [G, 8]
        rmask = rows < R
        cmask = cols < K
        m = rmask[:, None, None] & cmask[None, :, :]
        x = tl.load(x_ptr + rows[:, None, None] * K + cols[None, :, :], mask=m, other=0.0)
        first = (tl.load(ids_ptr + rows // rpb, mask=rmask, other=0) * rpb + rows % rpb) * K
        where = first[:, None, None] + cols[None, :, :]
        c = tl.load(st_ptr + where, mask=m, other=0)
        c = (c.to(tl.int32) << 16).to(tl.float32, bitcast=True) if BF16 else c.to(tl.float32)
        if BY_COL:
            inv = tl.load(inv_ptr + cols, mask=cmask, other=0.0)[None, :, :]
            step = tl.load(step_ptr + cols, mask=cmask, other=0.0)[None, :, :]
        else:
            inv = tl.load(inv_ptr + rows, mask=rmask, other=0.0)[:, None, None]
            step = tl.load(step_ptr + rows, mask=rmask, other=0.0)[:, None, None]
        t = tl.minimum(tl.maximum(tl.fma(x - c, inv, offset), 0.0), qmax)
        code = t.to(tl.int32)
        # the row as put(m + decode(...)) leaves it: one rounding for the level times the step, one for the
        # sum and one into the storage format
        new = c + (code.to(tl.float32) * mul - low) * step
        if BF16:  # to nearest even, as PyTorch rounds to bf16 (NaN to its canonical 0x7FC0)
            u = new.to(tl.int32, bitcast=True)
            b = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
            tl.store(st_ptr + where, tl.where(new != new, 0x7FC0, b).to(tl.int16), mask=m)
        else:
            tl.store(st_ptr + where, new.to(st_ptr.dtype.element_ty), mask=m)
        word = tl.sum(code.to(tl.int64) << (lane[None, None, :].to(tl.int64) * BITS), axis=2)
        nb = K * BITS // 8
        gm = rmask[:, None] & (groups < K // 8)[None, :]
        for b in tl.static_range(BITS):
            tl.store(out_ptr + rows[:, None] * nb + groups[None, :] * BITS + b,
                     ((word >> (8 * b)) & 0xFF).to(tl.uint8), mask=gm)

    @triton.jit
    def delta_dequant_update(p_ptr, st_ptr, ids_ptr, step_ptr, out_ptr, R, K, rpb, mul, low,
                             BY_COL: tl.constexpr, BITS: tl.constexpr, BF16: tl.constexpr,
                             BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        groups = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
        rmask = rows < R
        gm = rmask[:, None] & (groups < K // 8)[None, :]
        nb = K * BITS // 8
        word = tl.zeros([BLOCK_R, BLOCK_G], dtype=tl.int64)
        for b in tl.static_range(BITS):
            byte = tl.load(p_ptr + rows[:, None] * nb + groups[None, :] * BITS + b, mask=gm, other=0)
            word |= byte.to(tl.int64) << (8 * b)
        lane = tl.arange(0, 8)
        code = (word[:, :, None] >> (lane[None, None, :].to(tl.int64) * BITS)) & ((1 << BITS) - 1)
        cols = groups[:, None] * 8 + lane[None, :]
        cmask = cols < K
        m = rmask[:, None, None] & cmask[None, :, :]
        if BY_COL:
            step = tl.load(step_ptr + cols, mask=cmask, other=0.0)[None, :, :]
        else:
            step = tl.load(step_ptr + rows, mask=rmask, other=0.0)[:, None, None]
        first = (tl.load(ids_ptr + rows // rpb, mask=rmask, other=0) * rpb + rows % rpb) * K
        where = first[:, None, None] + cols[None, :, :]
        c = tl.load(st_ptr + where, mask=m, other=0)
        c = (c.to(tl.int32) << 16).to(tl.float32, bitcast=True) if BF16 else c.to(tl.float32)
        new = c + (code.to(tl.float32) * mul - low) * step
        if BF16:  # to nearest even, as PyTorch rounds to bf16 (NaN to its canonical 0x7FC0)
            u = new.to(tl.int32, bitcast=True)
            b = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
            b = tl.where(new != new, 0x7FC0, b)
            tl.store(st_ptr + where, b.to(tl.int16), mask=m)
            back = (b << 16).to(tl.float32, bitcast=True)
        else:
            stored = new.to(st_ptr.dtype.element_ty)
            tl.store(st_ptr + where, stored, mask=m)
            back = stored.to(tl.float32)
        tl.store(out_ptr + rows[:, None, None] * K + cols[None, :, :], back, mask=m)

    # -- Walsh-Hadamard transform of rows of G values (G a power of two), in registers: stage h pairs value j
    # with value j + h of each block of 2h (the butterflies of aqsgd.compress.hadamard, in the same order)
    @triton.jit
    def fwht_rows(x_ptr, s_ptr, out_ptr, c, R, G: tl.constexpr, LOG_G: tl.constexpr, INVERSE: tl.constexpr,
                  BLOCK_R: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, G)
        m = (rows < R)[:, None] & (cols < G)[None, :]
        y = tl.load(x_ptr + rows[:, None] * G + cols[None, :], mask=m, other=0.0)
        s = tl.load(s_ptr + cols)[None, :]
        if not INVERSE:
            y = y * s
        for i in tl.static_range(LOG_G):
            # [R, blocks, 2, h] -> [R, blocks, h, 2]: the pair (j, j + h) on the last axis
            v = tl.permute(tl.reshape(y, (BLOCK_R, G // (2 << i), 2, 1 << i)), (0, 1, 3, 2))
            a, b = tl.split(v)
            y = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (BLOCK_R, G))
        y = y * c
        if INVERSE:
            y = y * s
        tl.store(out_ptr + rows[:, None] * G + cols[None, :], y, mask=m)

    # -- TopK: the k-th largest magnitude key of each row by radix selection (three digits of the 31-bit key,
    # each a histogram over the row's keys that share the digits found so far), then the exact selection
    @triton.jit
    def topk_hist(x_ptr, state_ptr, hist_ptr, n, chunk, SHIFT: tl.constexpr, NB: tl.constexpr,
                  HIGH: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        start = tl.program_id(1) * chunk
        base = x_ptr + row.to(tl.int64) * n
        prefix = tl.load(state_ptr + row * 2) & HIGH  # the digits found so far (none in the first pass)
        acc = tl.zeros([NB], dtype=tl.int32)
        bins = tl.arange(0, NB)
        for off in range(0, chunk, BLOCK):
            at = start + off + tl.arange(0, BLOCK)
            m = (at < n) & (off + tl.arange(0, BLOCK) < chunk)
            key = tl.load(base + at, mask=m, other=0) & 0x7FFFFFFF
            match = m & ((key & HIGH) == prefix)
            digit = tl.where(match, (key >> SHIFT) & (NB - 1), 0)
            # the keys that do not match were counted in bin 0: take them out again
            acc += tl.histogram(digit, NB) - tl.where(bins == 0, BLOCK - tl.sum(match.to(tl.int32)), 0)
        tl.atomic_add(hist_ptr + row * NB + bins, acc)

    @triton.jit
    def topk_pick(hist_ptr, state_ptr, k, SHIFT: tl.constexpr, NB: tl.constexpr, FIRST: tl.constexpr):
        row = tl.program_id(0)
        bins = tl.arange(0, NB)
        h = tl.load(hist_ptr + row * NB + bins)
        if FIRST:
            prefix = 0
            need = k
        else:
            prefix = tl.load(state_ptr + row * 2)
            need = tl.load(state_ptr + row * 2 + 1)
        above = tl.sum(h, axis=0) - tl.cumsum(h, axis=0)  # keys in the bins above each bin
        hit = (above < need) & (above + h >= need)  # the bin of the need-th largest key
        digit = tl.sum(tl.where(hit, bins, 0), axis=0)
        tl.store(state_ptr + row * 2, prefix | (digit << SHIFT))
        tl.store(state_ptr + row * 2 + 1, need - tl.sum(tl.where(hit, above, 0), axis=0))

    @triton.jit
    def topk_count(x_ptr, state_ptr, counts_ptr, n, chunk, nchunk, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        c = tl.program_id(1)
        start = c * chunk
        base = x_ptr + row.to(tl.int64) * n
        kth = tl.load(state_ptr + row * 2)
        gt = 0
        eq = 0
        for off in range(0, chunk, BLOCK):
            at = start + off + tl.arange(0, BLOCK)
            m = (at < n) & (off + tl.arange(0, BLOCK) < chunk)
            key = tl.load(base + at, mask=m, other=0) & 0x7FFFFFFF
            gt += tl.sum((m & (key > kth)).to(tl.int32), axis=0)
            eq += tl.sum((m & (key == kth)).to(tl.int32), axis=0)
        tl.store(counts_ptr + (row * nchunk + c) * 2, gt)
        tl.store(counts_ptr + (row * nchunk + c) * 2 + 1, eq)

    @triton.jit
    def topk_write(x_ptr, state_ptr, counts_ptr, idx_ptr, vals_ptr, ib_ptr, bad_ptr, n, k, chunk, nchunk,
                   PACK: tl.constexpr, FMT: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr,
                   CBLOCK: tl.constexpr):
        row = tl.program_id(0)
        c = tl.program_id(1)
        start = c * chunk
        base = x_ptr + row.to(tl.int64) * n
        kth = tl.load(state_ptr + row * 2)
        ties = tl.load(state_ptr + row * 2 + 1)  # how many keys equal to the k-th are kept: the first ones
        gt = 0
        eq = 0
        for c0 in range(0, c, CBLOCK):  # the chunks before this one
            cc = c0 + tl.arange(0, CBLOCK)
            cm = cc < c
            gt += tl.sum(tl.load(counts_ptr + (row * nchunk + cc) * 2, mask=cm, other=0), axis=0)
            eq += tl.sum(tl.load(counts_ptr + (row * nchunk + cc) * 2 + 1, mask=cm, other=0), axis=0)
        slot = gt + tl.minimum(eq, ties)  # kept values before this chunk
        worst = 0
        for off in range(0, chunk, BLOCK):
            lanes = tl.arange(0, BLOCK)
            at = start + off + lanes
            m = (at < n) & (off + lanes < chunk)
            bits = tl.load(base + at, mask=m, other=0)
            key = bits & 0x7FFFFFFF
            same = m & (key == kth)
            rank = eq + tl.cumsum(same.to(tl.int32), axis=0) - 1  # among the row's keys equal to the k-th
            take = (m & (key > kth)) | (same & (rank < ties))
            where = slot + tl.cumsum(take.to(tl.int32), axis=0) - 1
            take = take & (where < k)  # never past the row's k slots, whatever the counts say
            out = row.to(tl.int64) * k + where
            if PACK:  # the kept values cast to the wire format, then the positions' low WIDTH bytes
                v = bits.to(tl.float32, bitcast=True)
                if FMT == 0:
                    tl.store(vals_ptr + out, v, mask=take)
                    back = bits
                elif FMT == 1:
                    h = v.to(tl.float16)
                    tl.store(vals_ptr + out, h.to(tl.int16, bitcast=True), mask=take)
                    back = h.to(tl.float32).to(tl.int32, bitcast=True)
                else:  # bf16, to nearest even as PyTorch rounds (NaN to its canonical 0x7FC0)
                    b = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
                    b = tl.where(v != v, 0x7FC0, b)
                    tl.store(vals_ptr + out, b.to(tl.int16), mask=take)
                    back = b << 16
                # a kept value, or its cast, is Inf or NaN: the magnitude's bits at or above Inf's
                worst = tl.maximum(worst, tl.max(tl.where(take, back & 0x7FFFFFFF, 0), axis=0))
                pos = at.to(tl.int64)
                for b in tl.static_range(WIDTH):
                    tl.store(ib_ptr + out * WIDTH + b, ((pos >> (8 * b)) & 0xFF).to(tl.uint8), mask=take)
            else:
                tl.store(idx_ptr + out, at.to(tl.int64), mask=take)
            slot += tl.sum(take.to(tl.int32), axis=0)
            eq += tl.sum(same.to(tl.int32), axis=0)
        if PACK:
            tl.atomic_max(bad_ptr, (worst >= 0x7F800000).to(tl.int32))

    # -- outlier rows (aqsgd.compress.wrappers.OutlierCodec)
    @triton.jit
    def row_sumsq(x_ptr, out_ptr, R, D, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < R
        acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
        for start in range(0, D, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            m = rmask[:, None] & (cols < D)[None, :]
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * D + cols[None, :], mask=m, other=0.0)
            x = x.to(tl.float32)
            acc += x * x
        tl.store(out_ptr + rows, tl.sum(acc, axis=1), mask=rmask)

    @triton.jit
    def split_rows(x_ptr, idx_ptr, rest_ptr, apart_ptr, D, k, BLOCK_D: tl.constexpr, BLOCK_I: tl.constexpr):
        r = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        cm = cols < D
        before = 0  # outlier rows above this one
        hit = 0
        for i0 in range(0, k, BLOCK_I):
            ii = i0 + tl.arange(0, BLOCK_I)
            im = ii < k
            v = tl.load(idx_ptr + ii, mask=im, other=-1)
            before += tl.sum((im & (v < r)).to(tl.int32), axis=0)
            hit += tl.sum((im & (v == r)).to(tl.int32), axis=0)
        x = tl.load(x_ptr + r.to(tl.int64) * D + cols, mask=cm, other=0.0)
        hits = tl.zeros([BLOCK_D], dtype=tl.int32) + hit  # > 0: this row goes apart
        tl.store(rest_ptr + (r - before).to(tl.int64) * D + cols, x, mask=cm & (hits == 0))
        u = x.to(tl.float32).to(tl.int32, bitcast=True)  # bf16 to nearest even, as PyTorch rounds
        b = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
        b = tl.where(x != x, 0x7FC0, b)
        tl.store(apart_ptr + before.to(tl.int64) * D + cols, b.to(tl.int16), mask=cm & (hits > 0))

    return {"rowmax": rowmax, "colmax": colmax, "quant_pack": quant_pack, "unpack_dequant": unpack_dequant,
            "row_sumsq": row_sumsq, "split_rows": split_rows,
            "delta_rowmax": delta_rowmax, "delta_colmax": delta_colmax, "delta_into": delta_into,
            "delta_quant_update": delta_quant_update, "delta_dequant_update": delta_dequant_update,
            "fwht_rows": fwht_rows, "topk_hist": topk_hist, "topk_pick": topk_pick, "topk_count": topk_count,
            "topk_write": topk_write}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
        if by_col:
            _kernels()["colmax"][(_cdiv(k, _BLOCK_K),)](x2, out, rows, k, BLOCK_R=_BLOCK_R, BLOCK_K=_BLOCK_K)
        else:
            _kernels()["rowmax"][(_cdiv(rows, _BLOCK_R),)](x2, out, rows, k, BLOCK_R=_BLOCK_R,
                                                           BLOCK_K=_BLOCK_K)
        return out

    stochastic = True

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
        grid = (_cdiv(rows, _BLOCK_R), _cdiv(k // 8, _BLOCK_G))
        _kernels()["quant_pack"][grid](x2, inv, x2 if noise is None else noise, out, rows, k, float(offset),
                                       float(qmax), BY_COL=by_col, BITS=bits, NOISE=noise is not None,
                                       BLOCK_R=_BLOCK_R, BLOCK_G=_BLOCK_G)
        return out

    def unpack_dequantize(self, packed: torch.Tensor, step: torch.Tensor, by_col: bool, bits: int, mul: int,
                          low: int) -> torch.Tensor:
        rows = packed.shape[0]
        k = packed.shape[1] * 8 // bits
        out = torch.empty(rows, k, dtype=torch.float32, device=packed.device)
        grid = (_cdiv(rows, _BLOCK_R), _cdiv(k // 8, _BLOCK_G))
        _kernels()["unpack_dequant"][grid](packed, step, out, rows, k, float(mul), float(low), BY_COL=by_col,
                                           BITS=bits, BLOCK_R=_BLOCK_R, BLOCK_G=_BLOCK_G)
        return out

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
        are kept (``state`` [R, 2] int32), each chunk's count of keys above and equal to it (``counts``),
        and the number of chunks."""
        rows, n = xi.shape
        k = int(k)
        nchunk = _cdiv(n, _TOPK_CHUNK)
        hist = torch.zeros(len(_TOPK_DIGITS), rows, _TOPK_BINS, dtype=torch.int32, device=xi.device)
        state = torch.empty(rows, 2, dtype=torch.int32, device=xi.device)
        ks = _kernels()
        for p, (shift, nbits, high) in enumerate(_TOPK_DIGITS):
            ks["topk_hist"][(rows, nchunk)](xi, state, hist[p], n, _TOPK_CHUNK, SHIFT=shift, NB=1 << nbits,
                                            HIGH=high, BLOCK=_TOPK_BLOCK)
            ks["topk_pick"][(rows,)](hist[p], state, k, SHIFT=shift, NB=1 << nbits, FIRST=p == 0)
        counts = torch.empty(rows, nchunk, 2, dtype=torch.int32, device=xi.device)
        ks["topk_count"][(rows, nchunk)](xi, state, counts, n, _TOPK_CHUNK, nchunk, BLOCK=_TOPK_BLOCK)
        return state, counts, nchunk

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
        name, grid = (("delta_colmax", (_cdiv(k, _BLOCK_K),)) if by_col
                      else ("delta_rowmax", (_cdiv(rows, _BLOCK_R),)))
        _kernels()[name][grid](x2, *_storage(store), out, rows, k, rpb, BF16=_bf16(store), BLOCK_R=_BLOCK_R,
                               BLOCK_K=_BLOCK_K)
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
        grid = (_cdiv(rows, _BLOCK_R), _cdiv(k // 8, _BLOCK_G))
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
        grid = (_cdiv(rows, _BLOCK_R), _cdiv(k // 8, _BLOCK_G))
        _kernels()["delta_dequant_update"][grid](packed, *_storage(store), step, out, rows, k, rpb,
                                                 float(mul), float(low), BY_COL=by_col, BITS=bits,
                                                 BF16=_bf16(store), BLOCK_R=_BLOCK_R, BLOCK_G=_BLOCK_G)
        return out
