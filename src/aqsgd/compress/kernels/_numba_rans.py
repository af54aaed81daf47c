"""numba kernels of the rANS coder (:mod:`aqsgd.compress.rans`), the numba backend's ``rans_*`` operations
(:mod:`aqsgd.compress.kernels.numba`).

Every kernel reads or writes the quantizer's packed codes directly: symbol ``i`` is the ``width``-bit field
``i % (8 // width)`` (low bits first) of byte ``i // (8 // width)``. The symbols are cut into :data:`LANES`
contiguous lanes of ``block`` symbols (a multiple of 8, so a lane starts on a byte for every width); each lane
is its own rANS stream. A thread takes a group of lanes and steps through them four at a time, side by side,
one symbol per lane in turn with the four states in registers, so that their independent updates overlap in
the CPU (one lane alone is a chain of dependent multiplies and loads).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from aqsgd.compress._rans_layout import LANES, PROB_BITS, STATE_LOW

_U = np.uint64
_PB = _U(PROB_BITS)
_SLOT = _U((1 << PROB_BITS) - 1)
_LOW = _U(STATE_LOW)
_S16 = _U(16)
_W16 = _U(0xFFFF)
_RENORM = _U(32 - PROB_BITS)  # a state at or above freq << this would leave [2**16, 2**32) after coding


@njit(inline="always")
def _field(body, i, width, per_shift):
    per = 1 << per_shift
    return (body[i >> per_shift] >> ((i & (per - 1)) * width)) & ((1 << width) - 1)


@njit(parallel=True, cache=True)
def _byte_counts(body, out, nchunk, per):
    """Counts of each byte value per chunk of ``body`` into ``out[chunk]`` (four interleaved histograms: a run
    of equal bytes then does not wait on its own increments)."""
    for ch in prange(nchunk):
        h = np.zeros((4, 256), np.int64)
        lo, hi = ch * per, min(body.size, (ch + 1) * per)
        b = lo
        while b + 4 <= hi:
            h[0, body[b]] += 1
            h[1, body[b + 1]] += 1
            h[2, body[b + 2]] += 1
            h[3, body[b + 3]] += 1
            b += 4
        for t in range(b, hi):
            h[0, body[t]] += 1
        for v in range(256):
            out[ch, v] = h[0, v] + h[1, v] + h[2, v] + h[3, v]


def count(threads, body, width, per_shift, nsyms):
    """Counts of the ``nsyms`` symbols: a histogram of the code bytes, then of each byte value's fields."""
    numba.set_num_threads(threads)
    nchunk = max(1, min(threads, body.size // 65536 + 1))
    out = np.zeros((nchunk, 256), dtype=np.int64)
    _byte_counts(body, out, nchunk, -(-body.size // nchunk) if body.size else 0)
    hist = out.sum(axis=0)
    if width == 8:
        return hist
    values = np.arange(256)
    mask = (1 << width) - 1
    return sum(np.bincount((values >> (f * width)) & mask, weights=hist, minlength=nsyms)
               for f in range(1 << per_shift)).astype(np.int64)


QUAD = 4  # lanes stepped side by side with their states in registers


def groups(threads: int) -> int:
    """Lane groups (one per thread): 1, 2 or 4, so that a group holds whole quads of lanes."""
    return 4 if threads >= 4 else 2 if threads >= 2 else 1


@njit(inline="always")
def _length(lane, nsym, block):
    return max(0, min(block, nsym - lane * block))


@njit(inline="always")
def _enc_step(x, s, freq, cum, words, p):
    """Symbol ``s`` into state ``x``, first moving its low 16 bits out to ``words[p - 1]`` where needed:
    ``(x, p)``. Branch-free (whether a word moves is data-dependent, so a branch would be mispredicted
    often): the word is always written, and only kept, by moving ``p``, where it is needed."""
    f = freq[s]
    move = _U((x >> _RENORM) >= f)
    words[p - 1] = np.uint16(x & _W16)
    x >>= _S16 * move
    return ((x // f) << _PB) + (x % f) + cum[s], p - np.int64(move)


@njit(inline="always")
def _dec_step(x, table, freq, cum, words, p, last):
    """The next symbol out of state ``x``, then 16 bits in from ``words[p]`` where needed: ``(s, x, p)``.
    Branch-free like :func:`_enc_step`; a lane that reads past its words (corrupt data) reads its
    neighbour's or the last word (``last``) and ends with ``p`` past its end, which the caller reports."""
    slot = x & _SLOT
    s = table[slot]
    x = freq[s] * (x >> _PB) + slot - cum[s]
    move = _U(x < _LOW)
    x = (x << (_S16 * move)) | (_U(words[min(p, last)]) * move)
    return s, x, p + np.int64(move)


@njit(parallel=True, cache=True)
def _encode(body, width, per_shift, nsym, block, freq, cum, words, states, starts, ngroups):
    for g in prange(ngroups):
        for q in range(g * LANES // ngroups, (g + 1) * LANES // ngroups, QUAD):
            i0, i1, i2, i3 = q * block, (q + 1) * block, (q + 2) * block, (q + 3) * block
            common = _length(q + 3, nsym, block)  # the quad's last lane is its shortest
            # a lane's words go backwards from the end of its region of block + 1 words (a lane moves out at
            # most one word per symbol, so the spare word takes the write that _enc_step makes and does not
            # keep)
            x0 = x1 = x2 = x3 = _LOW
            r = block + 1
            p0, p1, p2, p3 = (q + 1) * r, (q + 2) * r, (q + 3) * r, (q + 4) * r
            for j in range(_length(q, nsym, block) - 1, common - 1, -1):
                x0, p0 = _enc_step(x0, _field(body, i0 + j, width, per_shift), freq, cum, words, p0)
            for j in range(_length(q + 1, nsym, block) - 1, common - 1, -1):
                x1, p1 = _enc_step(x1, _field(body, i1 + j, width, per_shift), freq, cum, words, p1)
            for j in range(_length(q + 2, nsym, block) - 1, common - 1, -1):
                x2, p2 = _enc_step(x2, _field(body, i2 + j, width, per_shift), freq, cum, words, p2)
            for j in range(common - 1, -1, -1):
                x0, p0 = _enc_step(x0, _field(body, i0 + j, width, per_shift), freq, cum, words, p0)
                x1, p1 = _enc_step(x1, _field(body, i1 + j, width, per_shift), freq, cum, words, p1)
                x2, p2 = _enc_step(x2, _field(body, i2 + j, width, per_shift), freq, cum, words, p2)
                x3, p3 = _enc_step(x3, _field(body, i3 + j, width, per_shift), freq, cum, words, p3)
            states[q], states[q + 1], states[q + 2], states[q + 3] = x0, x1, x2, x3
            starts[q], starts[q + 1], starts[q + 2], starts[q + 3] = p0, p1, p2, p3


def encode(threads, body, width, per_shift, nsym, block, freq, cum, words, states, starts):
    numba.set_num_threads(threads)
    _encode(body, width, per_shift, nsym, block, freq, cum, words, states, starts, groups(threads))


@njit(parallel=True, cache=True)
def _decode(words, states, starts, ends, table, freq, cum, nsym, block, out, bad, ngroups):
    for g in prange(ngroups):
        for q in range(g * LANES // ngroups, (g + 1) * LANES // ngroups, QUAD):
            i0, i1, i2, i3 = q * block, (q + 1) * block, (q + 2) * block, (q + 3) * block
            x0, x1, x2, x3 = _U(states[q]), _U(states[q + 1]), _U(states[q + 2]), _U(states[q + 3])
            p0, p1, p2, p3 = starts[q], starts[q + 1], starts[q + 2], starts[q + 3]
            e0, e1, e2, e3 = ends[q], ends[q + 1], ends[q + 2], ends[q + 3]
            last = words.size - 1
            common = _length(q + 3, nsym, block)
            for j in range(common):
                out[i0 + j], x0, p0 = _dec_step(x0, table, freq, cum, words, p0, last)
                out[i1 + j], x1, p1 = _dec_step(x1, table, freq, cum, words, p1, last)
                out[i2 + j], x2, p2 = _dec_step(x2, table, freq, cum, words, p2, last)
                out[i3 + j], x3, p3 = _dec_step(x3, table, freq, cum, words, p3, last)
            for j in range(common, _length(q, nsym, block)):
                out[i0 + j], x0, p0 = _dec_step(x0, table, freq, cum, words, p0, last)
            for j in range(common, _length(q + 1, nsym, block)):
                out[i1 + j], x1, p1 = _dec_step(x1, table, freq, cum, words, p1, last)
            for j in range(common, _length(q + 2, nsym, block)):
                out[i2 + j], x2, p2 = _dec_step(x2, table, freq, cum, words, p2, last)
            # a lane decoded right when it ends at the initial state having read exactly its words
            bad[q] = not (x0 == _LOW and p0 == e0)
            bad[q + 1] = not (x1 == _LOW and p1 == e1)
            bad[q + 2] = not (x2 == _LOW and p2 == e2)
            bad[q + 3] = not (x3 == _LOW and p3 == e3)


def decode(threads, words, states, starts, ends, table, freq, cum, nsym, block, out, bad):
    numba.set_num_threads(threads)
    _decode(words, states, starts, ends, table, freq, cum, nsym, block, out, bad, groups(threads))


@njit(parallel=True, cache=True)
def _pack(sym, width, out, nchunk, per):
    """Symbols (one per byte) into ``width``-bit fields of ``out``, low bits first (a loop per width, so that
    each vectorizes)."""
    for ch in prange(nchunk):
        lo, hi = ch * per, min(out.size, (ch + 1) * per)
        if width == 4:
            for b in range(lo, hi):
                out[b] = sym[2 * b] | (sym[2 * b + 1] << 4)
        elif width == 2:
            for b in range(lo, hi):
                out[b] = sym[4 * b] | (sym[4 * b + 1] << 2) | (sym[4 * b + 2] << 4) | (sym[4 * b + 3] << 6)
        else:
            for b in range(lo, hi):
                v = sym[8 * b]
                for f in range(1, 8):
                    v |= sym[8 * b + f] << f
                out[b] = v


def pack(threads, sym, width, per_shift, out):
    numba.set_num_threads(threads)
    nchunk = max(1, min(threads, out.size // 65536 + 1))
    _pack(sym, width, out, nchunk, -(-out.size // nchunk))
