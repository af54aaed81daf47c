"""numba kernels behind :mod:`aqsgd.compress.fused` (importing this module needs numba).

Every kernel works on a C-contiguous 2-D view ``[R, K]`` with ``K % 8 == 0``, so each row's packed codes
start on a byte boundary and the rows can be split over threads. Rows go to threads in contiguous chunks;
each chunk keeps one small code buffer. Codes are packed the same way as :mod:`aqsgd.compress.bitpack`
(code ``j`` at bits ``[j*bits, (j+1)*bits)`` of the little-endian stream), through word views of the code
buffer so that LLVM vectorizes the shifts.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange
from numba.core import types as nt
from numba.extending import intrinsic


@intrinsic
def _fma32(typingctx, a, b, c):
    """Fused multiply-add with one rounding (llvm.fma), as PyTorch's CPU ``addcmul`` computes it."""
    sig = nt.float32(nt.float32, nt.float32, nt.float32)

    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return sig, codegen


def max_threads() -> int:
    return numba.config.NUMBA_NUM_THREADS


def threading_layer() -> str:
    return numba.threading_layer()


def _chunks(rows: int, threads: int) -> tuple[int, int]:
    n = min(rows, threads * 4)
    return n, -(-rows // n)


@njit(inline="always")
def _pack(c, c16, c32, c64, o, r, bits):
    """Pack the codes ``c`` (uint8 [K]; c16/c32/c64 are word views of it) into row ``r`` of ``o``."""
    k = c.shape[0]
    if bits == 8:
        for j in range(k):
            o[r, j] = c[j]
    elif bits == 4:
        for j in range(k // 2):
            v = c16[j]
            o[r, j] = np.uint8((v | (v >> 4)) & 0xFF)
    elif bits == 2:
        for j in range(k // 4):
            v = c32[j]
            o[r, j] = np.uint8((v | (v >> 6) | (v >> 12) | (v >> 18)) & 0xFF)
    elif bits == 1:
        for j in range(k // 8):
            v = c64[j]
            o[r, j] = np.uint8((v | (v >> 7) | (v >> 14) | (v >> 21) | (v >> 28) | (v >> 35) | (v >> 42)
                                | (v >> 49)) & 0xFF)
    else:  # 3, 5, 6, 7 bits: 8 codes -> `bits` bytes through one 64-bit word
        m = np.uint64((1 << bits) - 1)
        for j in range(k // 8):
            v = c64[j]
            a = v & m
            for i in range(1, 8):
                a |= (v >> np.uint64((8 - bits) * i)) & (m << np.uint64(bits * i))
            for b in range(bits):
                o[r, j * bits + b] = np.uint8((a >> np.uint64(8 * b)) & np.uint64(0xFF))


@njit(inline="always")
def _unpack(p, r, c, c16, c32, c64, bits):
    """Codes of row ``r`` of the packed ``p`` into ``c`` (uint8 [K]; c16/c32/c64 are word views of it)."""
    k = c.shape[0]
    if bits == 8:
        for j in range(k):
            c[j] = p[r, j]
    elif bits == 4:
        for j in range(k // 2):
            v = np.uint16(p[r, j])
            c16[j] = (v | (v << 4)) & np.uint16(0x0F0F)
    elif bits == 2:
        for j in range(k // 4):
            v = np.uint32(p[r, j])
            c32[j] = (v | (v << 6) | (v << 12) | (v << 18)) & np.uint32(0x03030303)
    elif bits == 1:
        for j in range(k // 8):
            v = np.uint64(p[r, j])
            c64[j] = ((v | (v << 7) | (v << 14) | (v << 21) | (v << 28) | (v << 35) | (v << 42) | (v << 49))
                      & np.uint64(0x0101010101010101))
    else:
        m = np.uint64((1 << bits) - 1)
        for j in range(k // 8):
            a = np.uint64(0)
            for b in range(bits):
                a |= np.uint64(p[r, j * bits + b]) << np.uint64(8 * b)
            v = a & m
            for i in range(1, 8):
                v |= (a << np.uint64((8 - bits) * i)) & (m << np.uint64(8 * i))
            c64[j] = v


@njit(parallel=True, cache=True)
def _colmax(x, nchunk, per):
    r_, k = x.shape
    part = np.zeros((nchunk, k), np.float32)
    for ch in prange(nchunk):
        for r in range(ch * per, min(r_, (ch + 1) * per)):
            for j in range(k):
                a = abs(x[r, j])
                if a > part[ch, j] or a != a:
                    part[ch, j] = a
    res = part[0].copy()
    for ch in range(1, nchunk):
        for j in range(k):
            a = part[ch, j]
            if a > res[j] or a != a:
                res[j] = a
    return res


@njit(parallel=True, cache=True)
def _rowmax(x, nchunk, per):
    r_, k = x.shape
    res = np.empty(r_, np.float32)
    for ch in prange(nchunk):
        acc = np.empty(8, np.float32)  # eight lanes, so the loop vectorizes; NaN sticks once seen
        for r in range(ch * per, min(r_, (ch + 1) * per)):
            acc[:] = 0.0
            for j0 in range(0, k, 8):
                for i in range(8):
                    a = abs(x[r, j0 + i])
                    if a > acc[i] or a != a:
                        acc[i] = a
            m = acc[0]
            for i in range(1, 8):
                if acc[i] > m or acc[i] != acc[i]:
                    m = acc[i]
            res[r] = m
    return res


@njit(parallel=True, cache=True)
def _quant_pack(x, inv, by_col, offset, bits, qmax, out, nchunk, per):
    r_, k = x.shape
    for ch in prange(nchunk):
        c64 = np.empty(k // 8, np.uint64)
        c = c64.view(np.uint8)
        c16, c32 = c64.view(np.uint16), c64.view(np.uint32)
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
        c64 = np.empty(k // 8, np.uint64)
        c = c64.view(np.uint8)
        c16, c32 = c64.view(np.uint16), c64.view(np.uint32)
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
