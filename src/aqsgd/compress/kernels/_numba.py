"""numba kernels behind :mod:`aqsgd.compress.kernels.numba` (importing this module needs numba).

Every kernel works on a C-contiguous 2-D view ``[R, K]`` with ``K * bits % 8 == 0``, so each row's packed
codes start on a byte boundary and the rows can be split over threads (a row's last group of 8 codes may be
short). Rows go to threads in contiguous chunks;
each chunk keeps one small code buffer. Codes are packed the same way as :mod:`aqsgd.compress.bitpack`
(code ``j`` at bits ``[j*bits, (j+1)*bits)`` of the little-endian stream), through word views of the code
buffer so that LLVM vectorizes the shifts.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange


# max_threads and threading_layer are for kernels.numba, which reads them from this module
from aqsgd.compress.kernels._numba_common import (_chunks, _f2u, _fma32, _load, _store, _u2f,  # noqa: F401
                                                  max_threads, threading_layer)


@njit(inline="always")
def _code_buffer(k):
    """A chunk's buffer for one row of ``k`` codes and its word views: ``(c, c16, c32, c64)`` as
    :func:`_pack` and :func:`_unpack` take them (``ceil(k / 8)`` words: a row's last group of 8 codes may be
    short, and the lanes past ``k`` are never packed)."""
    c64 = np.empty(-(-k // 8), np.uint64)
    return c64.view(np.uint8), c64.view(np.uint16), c64.view(np.uint32), c64


@njit(inline="always")
def _pack(c, c16, c32, c64, o, r, bits):
    """Pack the codes ``c`` (uint8, at least the row's; c16/c32/c64 are word views of it) into row ``r`` of
    ``o``, whose ``nb`` bytes bound the row (``K * bits / 8``: the row's codes end on a byte)."""
    nb = o.shape[1]
    if bits == 8:
        for j in range(nb):
            o[r, j] = c[j]
    elif bits == 4:
        for j in range(nb):
            v = c16[j]
            o[r, j] = np.uint8((v | (v >> 4)) & 0xFF)
    elif bits == 2:
        for j in range(nb):
            v = c32[j]
            o[r, j] = np.uint8((v | (v >> 6) | (v >> 12) | (v >> 18)) & 0xFF)
    elif bits == 1:
        for j in range(nb):
            v = c64[j]
            o[r, j] = np.uint8((v | (v >> 7) | (v >> 14) | (v >> 21) | (v >> 28) | (v >> 35) | (v >> 42)
                                | (v >> 49)) & 0xFF)
    else:  # 3, 5, 6, 7 bits: 8 codes -> `bits` bytes through one 64-bit word (the last group's up to nb)
        m = np.uint64((1 << bits) - 1)
        for j in range(-(-nb // bits)):
            v = c64[j]
            a = v & m
            for i in range(1, 8):
                a |= (v >> np.uint64((8 - bits) * i)) & (m << np.uint64(bits * i))
            for b in range(min(bits, nb - j * bits)):
                o[r, j * bits + b] = np.uint8((a >> np.uint64(8 * b)) & np.uint64(0xFF))


@njit(inline="always")
def _unpack(p, r, c, c16, c32, c64, bits):
    """Codes of row ``r`` of the packed ``p`` (``nb`` bytes a row) into ``c`` (uint8, at least the row's;
    c16/c32/c64 are word views of it; lanes past the row's codes are left undefined)."""
    nb = p.shape[1]
    if bits == 8:
        for j in range(nb):
            c[j] = p[r, j]
    elif bits == 4:
        for j in range(nb):
            v = np.uint16(p[r, j])
            c16[j] = (v | (v << 4)) & np.uint16(0x0F0F)
    elif bits == 2:
        for j in range(nb):
            v = np.uint32(p[r, j])
            c32[j] = (v | (v << 6) | (v << 12) | (v << 18)) & np.uint32(0x03030303)
    elif bits == 1:
        for j in range(nb):
            v = np.uint64(p[r, j])
            c64[j] = ((v | (v << 7) | (v << 14) | (v << 21) | (v << 28) | (v << 35) | (v << 42) | (v << 49))
                      & np.uint64(0x0101010101010101))
    else:
        m = np.uint64((1 << bits) - 1)
        for j in range(-(-nb // bits)):
            a = np.uint64(0)
            for b in range(min(bits, nb - j * bits)):
                a |= np.uint64(p[r, j * bits + b]) << np.uint64(8 * b)
            v = a & m
            for i in range(1, 8):
                v |= (a << np.uint64((8 - bits) * i)) & (m << np.uint64(8 * i))
            c64[j] = v


@njit(inline="always")
def _merge_parts(part):
    """Column max over the chunks' partial maxima ``part`` [nchunk, K] of magnitude bits (see
    :func:`_absmax_bits`), as fp32: a NaN in any chunk sticks (its bits are above every number's)."""
    res = np.empty(part.shape[1], np.float32)
    for j in range(part.shape[1]):
        mx = part[0, j]
        for ch in range(1, part.shape[0]):
            mx = max(mx, part[ch, j])
        res[j] = _u2f(mx)
    return res


@njit(parallel=True, cache=True)
def _colmax(x, nchunk, per):
    """Max |x| of each column: an integer max over the magnitudes' bits (see :func:`_absmax_bits`; 0.20
    against 0.23 ms for a float compare that keeps NaN, 4096 x 768 at 2 threads, one timing on the AMD VM)."""
    r_, k = x.shape
    part = np.zeros((nchunk, k), np.uint32)
    for ch in prange(nchunk):
        pc = part[ch]
        for r in range(ch * per, min(r_, (ch + 1) * per)):
            xr = x[r]
            for j in range(k):
                pc[j] = max(pc[j], _f2u(xr[j]) & np.uint32(0x7FFFFFFF))
    return _merge_parts(part)


@njit(inline="always")
def _absmax_bits(v, k):
    """Max |v[j]| over a 1-D fp32 view, as the bits of that fp32. With the sign bit cleared, unsigned integer
    order is float order, and every NaN is above +inf: an integer max (which vectorizes, where a float max
    that keeps NaN does not) is the max |v|, or a NaN where the row has one."""
    mx = np.uint32(0)
    for j in range(k):
        mx = max(mx, _f2u(v[j]) & np.uint32(0x7FFFFFFF))
    return mx


@njit(parallel=True, cache=True)
def _rowmax(x, nchunk, per):
    r_, k = x.shape
    res = np.empty(r_, np.float32)
    for ch in prange(nchunk):
        for r in range(ch * per, min(r_, (ch + 1) * per)):
            res[r] = _u2f(_absmax_bits(x[r], k))
    return res


@njit(parallel=True, cache=True)
def _quant_pack(x, inv, by_col, offset, bits, qmax, out, nchunk, per):
    r_, k = x.shape
    for ch in prange(nchunk):
        c, c16, c32, c64 = _code_buffer(k)
        for r in range(ch * per, min(r_, (ch + 1) * per)):
            if by_col:
                for j in range(k):
                    t = min(max(_fma32(x[r, j], inv[j], offset), np.float32(0.0)), qmax)
                    c[j] = np.uint8(np.int32(t))
            else:
                s = inv[r]
                for j in range(k):
                    t = min(max(_fma32(x[r, j], s, offset), np.float32(0.0)), qmax)
                    c[j] = np.uint8(np.int32(t))
            _pack(c, c16, c32, c64, out, r, bits)


@njit(parallel=True, cache=True)
def _unpack_dequant(p, step, by_col, bits, mul, low, out, nchunk, per):
    r_, k = out.shape
    for ch in prange(nchunk):
        c, c16, c32, c64 = _code_buffer(k)
        for r in range(ch * per, min(r_, (ch + 1) * per)):
            _unpack(p, r, c, c16, c32, c64, bits)
            if by_col:
                for j in range(k):
                    out[r, j] = (np.float32(c[j]) * mul - low) * step[j]
            else:
                s = step[r]
                for j in range(k):
                    out[r, j] = (np.float32(c[j]) * mul - low) * s


def colmax(threads, x):
    numba.set_num_threads(threads)
    return _colmax(x, *_chunks(x.shape[0], threads))


def rowmax(threads, x):
    numba.set_num_threads(threads)
    return _rowmax(x, *_chunks(x.shape[0], threads))


def quant_pack(threads, x, inv, by_col, offset, bits, qmax, out):
    numba.set_num_threads(threads)
    _quant_pack(x, inv, by_col, offset, bits, qmax, out, *_chunks(x.shape[0], threads))


def unpack_dequant(threads, p, step, by_col, bits, mul, low, out):
    numba.set_num_threads(threads)
    _unpack_dequant(p, step, by_col, bits, mul, low, out, *_chunks(out.shape[0], threads))


_FWHT_LANES = 16  # rows transformed at once, one per lane: an AVX-512 vector of fp32 (two AVX2 ones)


@njit(inline="always")
def _butterflies(buf, g):
    """The butterflies of the PyTorch path on ``buf`` [g, 16], sixteen rows at once (one per lane, so that
    every addition is a 16-wide vector operation). Three stages at a time where three remain (h, 2h, 4h on
    the 8 values ``j + k h``): each value sees the very additions of the stage-by-stage order, in that order,
    so the result is bit for bit the same, with a third of the loads and stores."""
    h = 1
    while 4 * h < g:
        for i in range(0, g, 8 * h):
            for j in range(i, i + h):
                for lane in range(_FWHT_LANES):
                    v0 = buf[j, lane]
                    v1 = buf[j + h, lane]
                    v2 = buf[j + 2 * h, lane]
                    v3 = buf[j + 3 * h, lane]
                    v4 = buf[j + 4 * h, lane]
                    v5 = buf[j + 5 * h, lane]
                    v6 = buf[j + 6 * h, lane]
                    v7 = buf[j + 7 * h, lane]
                    a0, a1, a2, a3 = v0 + v1, v0 - v1, v2 + v3, v2 - v3  # stage h
                    a4, a5, a6, a7 = v4 + v5, v4 - v5, v6 + v7, v6 - v7
                    b0, b1, b2, b3 = a0 + a2, a1 + a3, a0 - a2, a1 - a3  # stage 2h
                    b4, b5, b6, b7 = a4 + a6, a5 + a7, a4 - a6, a5 - a7
                    buf[j, lane] = b0 + b4  # stage 4h
                    buf[j + h, lane] = b1 + b5
                    buf[j + 2 * h, lane] = b2 + b6
                    buf[j + 3 * h, lane] = b3 + b7
                    buf[j + 4 * h, lane] = b0 - b4
                    buf[j + 5 * h, lane] = b1 - b5
                    buf[j + 6 * h, lane] = b2 - b6
                    buf[j + 7 * h, lane] = b3 - b7
        h *= 8
    while h < g:  # the last one or two stages
        for i in range(0, g, 2 * h):
            for j in range(i, i + h):
                for lane in range(_FWHT_LANES):
                    a = buf[j, lane]
                    b = buf[j + h, lane]
                    buf[j, lane] = a + b
                    buf[j + h, lane] = a - b
        h *= 2


@njit(parallel=True, cache=True)
def _fwht_rows(x, s, c, inverse, out, nchunk, per):
    r_, g = x.shape
    for ch in prange(nchunk):
        buf = np.zeros((g, _FWHT_LANES), np.float32)
        end = min(r_, (ch + 1) * per)
        for r0 in range(ch * per, end, _FWHT_LANES):
            n = min(_FWHT_LANES, end - r0)
            for lane in range(n):
                if inverse:
                    for j in range(g):
                        buf[j, lane] = x[r0 + lane, j]
                else:
                    for j in range(g):
                        buf[j, lane] = x[r0 + lane, j] * s[j]
            _butterflies(buf, g)
            for lane in range(n):
                if inverse:
                    for j in range(g):
                        out[r0 + lane, j] = (buf[j, lane] * c) * s[j]
                else:
                    for j in range(g):
                        out[r0 + lane, j] = buf[j, lane] * c


def fwht_rows(threads, x, s, c, inverse, out):
    numba.set_num_threads(threads)
    _fwht_rows(x, s, c, inverse, out, *_chunks(x.shape[0], threads))


# ---------------------------------------------------------------------------------------------- AQ-SGD, fused
# The sender's and the receiver's step of ``delta`` against an in-memory cache, without materializing m,
# x - m, the decoded delta or m + delta: row r of the [R, K] view of the micro-batch is row (r % rpb) of
# sample ids[r // rpb] in the storage ``st`` [capacity, rpb * K] (fp32, or fp16/bf16 bits as uint16). The
# loops work on 1-D row views: indexing the 2-D arrays inside them kept LLVM from vectorizing (4x slower).

@njit(inline="always")
def _cache_row(st, ids, rpb, r, k):
    o = (r % rpb) * k
    return st[ids[r // rpb], o:o + k]


@njit(parallel=True, cache=True)
def _delta_colmax(x, st, ids, rpb, fmt, nchunk, per):
    r_, k = x.shape
    part = np.zeros((nchunk, k), np.uint32)
    for ch in prange(nchunk):
        pc = part[ch]
        for r in range(ch * per, min(r_, (ch + 1) * per)):
            m, xr = _cache_row(st, ids, rpb, r, k), x[r]
            for j in range(k):
                pc[j] = max(pc[j], _f2u(xr[j] - _load(m, j, fmt)) & np.uint32(0x7FFFFFFF))
    return _merge_parts(part)


@njit(parallel=True, cache=True)
def _delta_rowmax(x, st, ids, rpb, fmt, nchunk, per):
    r_, k = x.shape
    res = np.empty(r_, np.float32)
    for ch in prange(nchunk):
        d = np.empty(k, np.float32)
        for r in range(ch * per, min(r_, (ch + 1) * per)):
            m, xr = _cache_row(st, ids, rpb, r, k), x[r]
            for j in range(k):
                d[j] = xr[j] - _load(m, j, fmt)
            res[r] = _u2f(_absmax_bits(d, k))
    return res


@njit(parallel=True, cache=True)
def _delta_into(x, st, ids, rpb, fmt, out, nchunk, per):
    r_, k = x.shape
    for ch in prange(nchunk):
        for r in range(ch * per, min(r_, (ch + 1) * per)):
            m, xr, orow = _cache_row(st, ids, rpb, r, k), x[r], out[r]
            for j in range(k):
                orow[j] = xr[j] - _load(m, j, fmt)


@njit(parallel=True, cache=True)
def _delta_quant_update(x, st, ids, rpb, fmt, inv, by_col, offset, bits, qmax, step, mul, low, out, nchunk,
                        per):
    r_, k = x.shape
    for ch in prange(nchunk):
        c, c16, c32, c64 = _code_buffer(k)
        mf = np.empty(k, np.float32)
        for r in range(ch * per, min(r_, (ch + 1) * per)):
            m, xr = _cache_row(st, ids, rpb, r, k), x[r]
            for j in range(k):
                mf[j] = _load(m, j, fmt)
            if by_col:
                for j in range(k):
                    t = min(max(_fma32(xr[j] - mf[j], inv[j], offset), np.float32(0.0)), qmax)
                    c[j] = np.uint8(np.int32(t))
            else:
                sc = inv[r]
                for j in range(k):
                    t = min(max(_fma32(xr[j] - mf[j], sc, offset), np.float32(0.0)), qmax)
                    c[j] = np.uint8(np.int32(t))
            _pack(c, c16, c32, c64, out, r, bits)
            # m + decode(code), in the decoder's arithmetic (an exact small integer times the group's step)
            if by_col:
                for j in range(k):
                    _store(m, j, mf[j] + (np.float32(c[j]) * mul - low) * step[j], fmt)
            else:
                sc = step[r]
                for j in range(k):
                    _store(m, j, mf[j] + (np.float32(c[j]) * mul - low) * sc, fmt)


@njit(parallel=True, cache=True)
def _delta_dequant_update(p, st, ids, rpb, fmt, step, by_col, bits, mul, low, out, nchunk, per):
    r_, k = out.shape
    for ch in prange(nchunk):
        c, c16, c32, c64 = _code_buffer(k)
        for r in range(ch * per, min(r_, (ch + 1) * per)):
            m, orow = _cache_row(st, ids, rpb, r, k), out[r]
            _unpack(p, r, c, c16, c32, c64, bits)
            if by_col:
                for j in range(k):
                    orow[j] = _store(m, j, _load(m, j, fmt) + (np.float32(c[j]) * mul - low) * step[j], fmt)
            else:
                sc = step[r]
                for j in range(k):
                    orow[j] = _store(m, j, _load(m, j, fmt) + (np.float32(c[j]) * mul - low) * sc, fmt)


@njit(parallel=False, cache=True)
def _round_to_storage(v, st, fmt):
    """Test hook: every value of fp32 ``v`` rounded into row 0 of ``st``, as the kernels store it."""
    row = st[0]
    for j in range(v.shape[0]):
        _store(row, j, v[j], fmt)


def delta_absmax(threads, x, st, ids, rpb, fmt, by_col):
    numba.set_num_threads(threads)
    fn = _delta_colmax if by_col else _delta_rowmax
    return fn(x, st, ids, rpb, fmt, *_chunks(x.shape[0], threads))


def delta_into(threads, x, st, ids, rpb, fmt, out):
    numba.set_num_threads(threads)
    _delta_into(x, st, ids, rpb, fmt, out, *_chunks(x.shape[0], threads))


def delta_quant_update(threads, x, st, ids, rpb, fmt, inv, by_col, offset, bits, qmax, step, mul, low, out):
    numba.set_num_threads(threads)
    _delta_quant_update(x, st, ids, rpb, fmt, inv, by_col, offset, bits, qmax, step, mul, low, out,
                        *_chunks(x.shape[0], threads))


def delta_dequant_update(threads, p, st, ids, rpb, fmt, step, by_col, bits, mul, low, out):
    numba.set_num_threads(threads)
    _delta_dequant_update(p, st, ids, rpb, fmt, step, by_col, bits, mul, low, out,
                          *_chunks(out.shape[0], threads))


def round_to_storage(threads, v, st, fmt):
    _round_to_storage(v, st, fmt)


# --------------------------------------------------------------------------------------- TopK and rANS
# in modules of their own (one concern each), called through kernels.numba._call like the kernels above
from aqsgd.compress.kernels._numba_rans import count as rans_count  # noqa: E402, F401
from aqsgd.compress.kernels._numba_rans import decode as rans_decode  # noqa: E402, F401
from aqsgd.compress.kernels._numba_rans import encode as rans_encode  # noqa: E402, F401
from aqsgd.compress.kernels._numba_rans import pack as rans_pack  # noqa: E402, F401
from aqsgd.compress.kernels._numba_topk import topk_encode, topk_pack, topk_rows  # noqa: E402, F401
