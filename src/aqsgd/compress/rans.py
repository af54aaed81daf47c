"""An order-0 rANS coder for a quantizer's packed codes (the codec stage ``:rc``).

rANS (range asymmetric numeral systems, Duda 2013) spends each symbol's information content under a
frequency table, as a range coder does, with one table lookup, one multiply and an occasional 16-bit read per
symbol when decoding. The codes are the symbols: fields of ``width`` bits (1, 2, 4 or 8) of the packed code
bytes, low bits first.

Format of :func:`encode`'s output (little-endian)::

    2**width  uint16  frequencies, adding up to 2**15 (every symbol of the packet has at least 1)
    16        uint32  final state of each lane, in [2**16, 2**32)
    16        uint32  words of each lane
    ...       uint16  the lanes' words, lane 0 first, each in the order its decoder reads them

The symbols are cut into 16 contiguous lanes of ``block`` symbols, ``block`` = ``ceil(n / 16)`` rounded up
to a multiple of 8 (the last lanes may be short or empty). Each lane is coded alone with a 32-bit state that
starts at 2**16 and moves 16 bits at a time, so its decoder must end at 2**16 having read exactly its words
(checked). The lanes let the decoder step through 8 independent states per thread, and two threads split
them; the output does not depend on the thread count.

Why written here and not taken from a package: the range coder of ``constriction`` (used before) decodes at
about 10 ns per symbol through a per-symbol search of its model, which at two threads limited a link to about
120 Mbit/s of packets; no package on PyPI offered a table-driven coder over numpy arrays. This one is a
hundred lines of numba.
"""

from __future__ import annotations

import threading

import numpy as np

from aqsgd.compress import kernels
from aqsgd.compress._rans_layout import LANES, PROB_BITS, STATE_LOW
from aqsgd.compress.kernels import Kernels
from aqsgd.errors import PacketError, SpecError

__all__ = ["LANES", "PROB_BITS", "STATE_LOW", "available", "decode", "encode", "normalize", "overhead_bytes"]

_SCALE = 1 << PROB_BITS
_PER_SHIFT = {1: 3, 2: 2, 4: 1, 8: 0}
_local = threading.local()


def _coder() -> Kernels | None:
    """The host kernels with the coder (:func:`aqsgd.compress.kernels.for_operation`: the numba backend's),
    whatever backend the codec computes with: there is no general path."""
    return kernels.for_operation("rans_encode", "cpu")


def available() -> None:
    """Raise :class:`SpecError` with an install hint where the compiled coder cannot run (numba missing)."""
    if _coder() is None:
        raise SpecError("the rANS stage (:rc) needs numba (pip install numba)")


def _ops() -> Kernels:
    ops = _coder()
    if ops is None:
        available()
    return ops


def overhead_bytes(width: int) -> int:
    """Bytes of :func:`encode`'s output besides the words: the frequencies and the lanes' states and
    counts."""
    return 2 * (1 << width) + 8 * LANES


def normalize(counts: np.ndarray) -> np.ndarray:
    """Frequencies (int64) adding up to ``2**15`` from symbol ``counts``: each count scaled and rounded, every
    present symbol at least 1, the rounding difference taken from (or given to) the most frequent symbols."""
    counts = np.asarray(counts, dtype=np.int64)
    n = int(counts.sum())
    if n == 0:
        freq = np.zeros_like(counts)
        freq[0] = _SCALE  # no symbols: any table will do, none is read
        return freq
    freq = np.where(counts > 0, np.maximum(1, (counts * _SCALE + n // 2) // n), 0)
    diff = _SCALE - int(freq.sum())
    for s in np.argsort(-freq, kind="stable"):  # the first symbol almost always absorbs all of it
        if diff == 0:
            break
        take = max(diff, 1 - int(freq[s]))  # never below 1
        freq[s] += take
        diff -= take
    return freq


def _scratch(name: str, size: int, dtype) -> np.ndarray:
    """This thread's buffer ``name``, kept between calls (fresh ones would fault their pages in each time)."""
    buf = getattr(_local, name, None)
    if buf is None or buf.size < size:
        buf = np.empty(max(size, 1 << 16), dtype=dtype)
        setattr(_local, name, buf)
    return buf[:size]


def _starts(freq: np.ndarray) -> np.ndarray:
    """Each symbol's first slot in the table (the cumulative frequencies before it), uint64 as the kernels
    take."""
    return np.concatenate([[0], np.cumsum(freq)[:-1]]).astype(np.uint64)


def _block(nsym: int) -> int:
    """Symbols per lane: ``ceil(nsym / LANES)`` rounded up to a multiple of 8."""
    per_lane = -(-nsym // LANES)
    return -(-per_lane // 8) * 8


def encode(body: np.ndarray, width: int) -> np.ndarray:
    """The packed codes ``body`` (uint8) coded as ``width``-bit symbols; a uint8 array in the format above."""
    ops = _ops()
    shift = _PER_SHIFT[width]
    nsym = body.size << shift
    freq = normalize(ops.rans_count(body, width, shift, 1 << width))
    cum = _starts(freq)
    block = _block(nsym)
    words = _scratch("words", LANES * (block + 1), np.uint16)  # a spare word per lane (see the kernel)
    states = np.empty(LANES, dtype=np.uint32)
    starts = np.empty(LANES, dtype=np.int64)
    ops.rans_encode(body, width, shift, nsym, block, freq.astype(np.uint64), cum, words, states, starts)
    ends = np.arange(1, LANES + 1, dtype=np.int64) * (block + 1)
    nwords = ends - starts
    head = overhead_bytes(width)
    out = np.empty(head + 2 * int(nwords.sum()), dtype=np.uint8)
    out[: 2 << width].view("<u2")[:] = freq
    out[2 << width : (2 << width) + 4 * LANES].view("<u4")[:] = states
    out[(2 << width) + 4 * LANES : head].view("<u4")[:] = nwords
    w = out[head:].view("<u2")
    at = 0
    for lane in range(LANES):
        w[at : at + nwords[lane]] = words[starts[lane] : ends[lane]]
        at += nwords[lane]
    return out


def decode(data: np.ndarray, width: int, nbody: int, out: np.ndarray | None = None) -> np.ndarray:
    """The ``nbody`` packed code bytes coded in ``data`` (uint8); into ``out`` when given. PacketError where
    ``data`` is malformed or corrupt."""
    shift = _PER_SHIFT[width]
    nsym = nbody << shift
    head = overhead_bytes(width)
    if data.size < head or (data.size - head) % 2:
        raise PacketError(f"rANS data of {data.size} bytes does not fit its layout ({head} bytes of tables, "
                          f"then 2-byte words)")
    table = np.frombuffer(data[:head].tobytes(), dtype=np.uint8)  # aligned copies of the tables
    freq = table[: 2 << width].view("<u2").astype(np.uint64)
    states = table[2 << width : (2 << width) + 4 * LANES].view("<u4")
    nwords = table[(2 << width) + 4 * LANES :].view("<u4").astype(np.int64)
    if int(freq.sum()) != _SCALE:
        raise PacketError(f"rANS frequencies add up to {int(freq.sum())}, not {_SCALE}")
    if int(nwords.sum()) * 2 != data.size - head:
        raise PacketError(f"rANS lanes announce {int(nwords.sum())} words, the data holds "
                          f"{(data.size - head) // 2}")
    if bool((states < STATE_LOW).any()):
        raise PacketError("rANS lane state below 2**16: corrupt data")
    total = int(nwords.sum())
    words = _scratch("dwords", total + 1, np.uint16)  # one more word, read by a lane that ran past its own
    # numpy copies from an unaligned view; the kernel gets aligned ones
    words[:total] = data[head:].view("<u2")
    words[total] = 0
    ends = np.cumsum(nwords)
    starts = ends - nwords
    cum = _starts(freq)
    slots = np.repeat(np.arange(1 << width, dtype=np.uint8), freq.astype(np.int64))
    if out is None:
        out = np.empty(nbody, dtype=np.uint8)
    sym = out if width == 8 else _scratch("sym", nsym, np.uint8)
    bad = np.zeros(LANES, dtype=np.bool_)
    ops = _ops()
    ops.rans_decode(words, states, starts, ends, slots, freq, cum, nsym, _block(nsym), sym, bad)
    if bad.any():
        lanes = np.flatnonzero(bad).tolist()
        raise PacketError(f"corrupt rANS data (lanes {lanes} do not decode to their end)")
    if width != 8:
        ops.rans_pack(sym, width, shift, out)
    return out
