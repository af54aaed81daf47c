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
from llvmlite import ir
from numba import njit, prange
from numba.cpython.unsafe.numbers import trailing_zeros
from numba.core import types as nt
from numba.extending import intrinsic, overload


@intrinsic
def _fma32(typingctx, a, b, c):
    """Fused multiply-add with one rounding (llvm.fma), as PyTorch's CPU ``addcmul`` computes it."""
    sig = nt.float32(nt.float32, nt.float32, nt.float32)

    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return sig, codegen


@intrinsic
def _h2f(typingctx, h):
    """fp16 bits (uint16) to fp32: LLVM's ``fpext half``, exact (F16C's vcvtph2ps on x86)."""
    sig = nt.float32(nt.uint16)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


@intrinsic
def _f2h(typingctx, f):
    """fp32 to fp16 bits (uint16), rounded to nearest even as PyTorch's ``.to(torch.float16)``:
    ``fptrunc``."""
    sig = nt.uint16(nt.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return sig, codegen


@intrinsic
def _u2f(typingctx, u):
    """The fp32 whose bits are ``u`` (uint32)."""
    sig = nt.float32(nt.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@intrinsic
def _f2u(typingctx, f):
    """The bits (uint32) of the fp32 ``f``."""
    sig = nt.uint32(nt.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


# Cache storage formats of the fused AQ-SGD kernels: fp32 rows as they are, fp16 and bf16 rows as uint16 bits.
FMT_FP32, FMT_FP16, FMT_BF16 = 0, 1, 2


def _load(row, j, fmt):
    """``row[j]`` (a 1-D view of the storage) as fp32, for storage format ``fmt``; numba implementation
    below."""


def _store(row, j, v, fmt):
    """Round the fp32 ``v`` to the storage format, write it to ``row[j]``, return the stored value as fp32."""


@overload(_load)
def _load_impl(row, j, fmt):
    if row.dtype == nt.float32:
        return lambda row, j, fmt: row[j]

    def impl(row, j, fmt):
        if fmt == FMT_FP16:
            return _h2f(row[j])
        return _u2f(np.uint32(row[j]) << np.uint32(16))

    return impl


@overload(_store)
def _store_impl(row, j, v, fmt):
    if row.dtype == nt.float32:
        def impl32(row, j, v, fmt):
            row[j] = v
            return v

        return impl32

    def impl(row, j, v, fmt):
        if fmt == FMT_FP16:
            h = _f2h(v)
            row[j] = h
            return _h2f(h)
        # bf16, rounded to nearest even as PyTorch's c10::BFloat16 does (NaN to its canonical 0x7FC0)
        u = _f2u(v)
        b = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        if v != v:
            b = np.uint32(0x7FC0)
        row[j] = np.uint16(b)
        return _u2f(b << np.uint32(16))

    return impl


def max_threads() -> int:
    return numba.config.NUMBA_NUM_THREADS


def threading_layer() -> str:
    return numba.threading_layer()


def _chunks(rows: int, threads: int) -> tuple[int, int]:
    n = min(rows, threads * 4)
    return n, -(-rows // n)


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


@njit(inline="always")
def _butterflies(buf, g):
    """The butterflies of the PyTorch path, stage by stage in the same order, on ``buf`` [g, 8]: eight rows
    at once (one per lane), so that every addition is an 8-wide vector operation."""
    h = 1
    while h < g:
        for i in range(0, g, 2 * h):
            for j in range(i, i + h):
                for lane in range(8):
                    a = buf[j, lane]
                    b = buf[j + h, lane]
                    buf[j, lane] = a + b
                    buf[j + h, lane] = a - b
        h *= 2


@njit(parallel=True, cache=True)
def _fwht_rows(x, s, c, inverse, out, nchunk, per):
    r_, g = x.shape
    for ch in prange(nchunk):
        buf = np.zeros((g, 8), np.float32)
        end = min(r_, (ch + 1) * per)
        for r0 in range(ch * per, end, 8):
            n = min(8, end - r0)
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


# -------------------------------------------------------------------------------------------------- TopK
@njit(inline="always")
def _kth_largest(a, j):
    """The ``j``-th largest value of ``a`` (0-based; ``a`` is reordered)."""
    return np.partition(a, a.size - 1 - j)[a.size - 1 - j]


@njit(inline="always")
def _topk_select(keys, mask, pos, j_lo, j_hi, k, cpos, cbits):
    """Find the top ``k`` of one row of integer keys (a float's bits: ``& mask`` clears the sign, so integer
    order is magnitude order, NaN above Inf). Thresholds: the ``j_lo``-th and ``j_hi``-th largest keys at the
    sampled positions ``pos`` (no upper one when ``j_hi < 0``). One pass writes every value whose key is at
    least the lower threshold, its position to ``cpos`` and its bits to ``cbits``: 64 comparisons at a time
    make a bit mask (vectorized), whose set bits are then visited with count-trailing-zeros, so that no branch
    depends on the data (a plain ``if`` per key runs 7x slower at 11 % candidates). The k-th largest key is
    then found in the band between the thresholds. Returns ``(candidates, kth, ties)``: the top k are the
    candidates above ``kth`` and the first ``ties`` equal to it; ``candidates < 0`` where the sample misled
    (the caller ranks the row in full)."""
    n = keys.size
    sample = np.empty(pos.size, keys.dtype)
    for i in range(pos.size):
        sample[i] = keys[pos[i]] & mask
    t_lo = _kth_largest(sample, j_lo)
    t_hi = np.int64(_kth_largest(sample, j_hi)) if j_hi >= 0 else np.int64(mask)
    c = 0
    sure = 0
    full = n - n % 64
    for base in range(0, full, 64):
        m = np.uint64(0)
        for j in range(64):
            m |= np.uint64((keys[base + j] & mask) >= t_lo) << np.uint64(j)
        while m:
            i = base + trailing_zeros(m)
            bits = keys[i]
            cpos[c] = i
            cbits[c] = bits
            c += 1
            sure += np.int64((bits & mask) > t_hi)
            m &= m - np.uint64(1)
    for i in range(full, n):
        bits = keys[i]
        if (bits & mask) >= t_lo:
            cpos[c] = i
            cbits[c] = bits
            c += 1
            sure += np.int64((bits & mask) > t_hi)
    need = k - sure
    nband = c - sure
    if need < 0 or nband < need:
        return -1, np.int64(0), 0
    # the passes over the candidates are branch-free too: a third of them fall in the band, a data-dependent
    # branch per candidate would be mispredicted that often
    if need == 0:
        kth = t_hi + 1
    else:
        band = np.empty(c, keys.dtype)
        b = 0
        for j in range(c):
            key = cbits[j] & mask
            band[b] = key
            b += np.int64(key <= t_hi)
        kth = np.int64(_kth_largest(band[:nband], need - 1))
    ties = k
    for j in range(c):
        ties -= np.int64((cbits[j] & mask) > kth)
    return c, kth, ties


@njit(inline="always")
def _topk_row(keys, mask, pos, j_lo, j_hi, k, out, cpos, cbits):
    """:func:`_topk_select`, then the top k's positions into ``out`` in increasing order (ties at the k-th key
    to the lower positions); False where the sample misled."""
    c, kth, room = _topk_select(keys, mask, pos, j_lo, j_hi, k, cpos, cbits)
    if c < 0:
        return False
    o = 0
    for j in range(c):
        if o == k:
            break
        key = np.int64(cbits[j] & mask)
        tie = np.int64(key == kth) & np.int64(room > 0)
        out[o] = cpos[j]  # written at every step, kept only where o advances
        o += np.int64(key > kth) | tie
        room -= tie
    return o == k


@njit(parallel=True, cache=True)
def _topk_rows(keys, mask, pos, j_lo, j_hi, k, out, ok, cpos, cbits, nchunk, per):
    r_, n = keys.shape
    for ch in prange(nchunk):
        for r in range(ch * per, min(r_, (ch + 1) * per)):
            ok[r] = _topk_row(keys[r], mask, pos, j_lo, j_hi, k, out[r], cpos[ch], cbits[ch])


def _topk_chunks(rows: int, threads: int) -> tuple[int, int]:
    """One chunk of rows per thread: each chunk has a scratch row of candidates (the caller's, reused across
    calls: fresh ones would fault their pages in on every call, a large cost in a VM)."""
    n = min(rows, threads)
    return n, -(-rows // n)


def topk_rows(threads, keys, mask, pos, j_lo, j_hi, k, out, ok, cpos, cbits):
    numba.set_num_threads(threads)
    _topk_rows(keys, mask, pos, j_lo, j_hi, k, out, ok, cpos, cbits, *_topk_chunks(keys.shape[0], threads))


@njit(parallel=True, cache=True)
def _topk_pack(x, idx, fmt, vals, width, ib, bad, nchunk, per):
    r_, k = idx.shape
    for ch in prange(nchunk):
        for r in range(ch * per, min(r_, (ch + 1) * per)):
            xr, ir, vr = x[r], idx[r], vals[r]
            at = r * k * width
            worst = np.uint32(0)
            for j in range(k):
                p = ir[j]
                worst = max(worst, _f2u(_store(vr, j, xr[p], fmt)) & np.uint32(0x7FFFFFFF))
                for b in range(width):
                    ib[at + b] = np.uint8((p >> (8 * b)) & 0xFF)
                at += width
            bad[r] = worst >= np.uint32(0x7F800000)  # a kept value, or its cast, is Inf or NaN


def topk_pack(threads, x, idx, fmt, vals, width, ib, bad):
    numba.set_num_threads(threads)
    _topk_pack(x, idx, fmt, vals, width, ib, bad, *_chunks(idx.shape[0], threads))


@njit(parallel=True, cache=True)
def _topk_encode(keys, mask, pos, j_lo, j_hi, k, fmt, vals, width, ib, ok, bad, cpos2, cbits2, nchunk, per):
    """TopK's payload straight from the selection: each row's kept values (from the candidates' bits, so ``x``
    is read once) cast to ``fmt`` into ``vals`` [R, k] and their positions' low ``width`` bytes into ``ib``.
    ``ok[r]`` False where the sample misled, ``bad[r]`` where a kept value or its cast is not finite."""
    r_, n = keys.shape
    for ch in prange(nchunk):
        cpos, cbits = cpos2[ch], cbits2[ch]
        for r in range(ch * per, min(r_, (ch + 1) * per)):
            c, kth, room = _topk_select(keys[r], mask, pos, j_lo, j_hi, k, cpos, cbits)
            ok[r] = False
            bad[r] = False
            if c < 0:
                continue
            vr = vals[r]
            o = 0
            worst = np.uint32(0)
            for j in range(c):
                if o == k:
                    break
                bits = cbits[j]
                key = np.int64(bits & mask)
                tie = np.int64(key == kth) & np.int64(room > 0)
                take = np.int64(key > kth) | tie
                # written at every step, kept only where o advances; the magnitude only counts where taken
                stored = _f2u(_store(vr, o, _u2f(np.uint32(bits)), fmt)) & np.uint32(0x7FFFFFFF)
                worst = max(worst, stored * np.uint32(take))
                p = cpos[j]
                at = (r * k + o) * width
                for b in range(width):
                    ib[at + b] = np.uint8((p >> (8 * b)) & 0xFF)
                o += take
                room -= tie
            ok[r] = o == k
            bad[r] = worst >= np.uint32(0x7F800000)


def topk_encode(threads, keys, mask, pos, j_lo, j_hi, k, fmt, vals, width, ib, ok, bad, cpos, cbits):
    numba.set_num_threads(threads)
    _topk_encode(keys, mask, pos, j_lo, j_hi, k, fmt, vals, width, ib, ok, bad, cpos, cbits,
                 *_topk_chunks(keys.shape[0], threads))


# -------------------------------------------------------------------------------------------------- rANS
# the :rc stage's coder (aqsgd.compress.rans), called through kernels.numba._call like the kernels above
from aqsgd.compress._rans_kernels import count as rans_count  # noqa: E402, F401
from aqsgd.compress._rans_kernels import decode as rans_decode  # noqa: E402, F401
from aqsgd.compress._rans_kernels import encode as rans_encode  # noqa: E402, F401
from aqsgd.compress._rans_kernels import pack as rans_pack  # noqa: E402, F401
