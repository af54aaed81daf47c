"""numba kernels of TopK's selection and payload (:mod:`aqsgd.compress.topk`), behind
:mod:`aqsgd.compress.kernels.numba` like those of :mod:`aqsgd.compress.kernels._numba` (importing this module
needs numba), with whose kernels they share ``_numba_common``."""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange
from numba.cpython.unsafe.numbers import trailing_zeros

from aqsgd.compress.kernels._numba_common import _chunks, _f2u, _store, _u2f

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
