"""The rANS coder of the :rc stage (aqsgd.compress.rans): lossless for every symbol width, its size against
the empirical entropy, output independent of the thread count, frequency tables, corrupt input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aqsgd.compress import rans
from aqsgd.compress.kernels import numba as numba_kernels
from aqsgd.errors import PacketError

pytestmark = pytest.mark.skipif(not numba_kernels.available(), reason="numba is not installed")


def pack(sym: np.ndarray, width: int) -> np.ndarray:
    """Symbols into ``width``-bit fields of bytes, low bits first (the quantizers' packing)."""
    per = 8 // width
    body = np.zeros(sym.size // per, dtype=np.uint8)
    for f in range(per):
        body |= (sym[f::per].astype(np.uint8) << (f * width)).astype(np.uint8)
    return body


def entropy_bytes(sym: np.ndarray) -> float:
    p = np.bincount(sym)
    p = p[p > 0] / sym.size
    return float(-(p * np.log2(p)).sum()) * sym.size / 8


def gaussian_symbols(n: int, width: int, sigma: float, seed: int = 0) -> np.ndarray:
    half = 1 << (width - 1)
    z = np.random.default_rng(seed).standard_normal(n) * sigma
    return (np.clip(np.rint(z), -half + 1, half - 1) + half).astype(np.int64)


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("nbytes", [0, 1, 7, 64, 129, 4097, 50_001])
def test_round_trip(width, nbytes):
    nsym = nbytes * 8 // width
    for sym in (np.random.default_rng(nbytes).integers(0, 1 << width, nsym),
                gaussian_symbols(nsym, width, 0.7, seed=nbytes)):
        body = pack(sym, width)
        assert np.array_equal(rans.decode(rans.encode(body, width), width, nbytes), body)


@settings(max_examples=60, deadline=None)
@given(width=st.sampled_from([1, 2, 4, 8]), data=st.binary(min_size=0, max_size=3000))
def test_round_trip_any_bytes(width, data):
    body = np.frombuffer(data, dtype=np.uint8).copy()
    coded = rans.encode(body, width)
    assert np.array_equal(rans.decode(coded, width, body.size), body)


def test_rare_symbols_and_full_alphabets():
    """Symbols met once among a million get frequency 1 (15 bits each); all 256 byte values present. The size
    is what the 15-bit table allows: here 3.7x the empirical entropy (686 bytes), since the table takes 255 of
    the 32768 slots from the common symbol (0.011 bits on each of a million)."""
    sym = np.zeros(1 << 20, dtype=np.int64)
    sym[::4099] = np.arange(sym[::4099].size) % 255 + 1
    body = sym.astype(np.uint8)
    coded = rans.encode(body, 8)
    assert np.array_equal(rans.decode(coded, 8, body.size), body)
    counts = np.bincount(sym, minlength=256)
    freq = rans.normalize(counts)
    table_bytes = float((counts[counts > 0] * -np.log2(freq[counts > 0] / 2 ** rans.PROB_BITS)).sum()) / 8
    words = coded.size - rans.overhead_bytes(8)
    assert table_bytes - 4 * rans.LANES <= words <= table_bytes * 1.002 + 2 * rans.LANES


@pytest.mark.parametrize("width,sigma", [(4, 1.0), (4, 1.9), (8, 3.0), (2, 0.6), (1, 0.3)])
def test_size_is_the_empirical_entropy(width, sigma):
    """Within 0.2 % (plus a few words per lane) of what the symbols' own histogram allows."""
    sym = gaussian_symbols(1 << 20, width, sigma)
    coded = rans.encode(pack(sym, width), width)
    ideal = entropy_bytes(sym)
    words = coded.size - rans.overhead_bytes(width)
    assert ideal - 4 * rans.LANES <= words <= ideal * 1.002 + 2 * rans.LANES


def test_output_does_not_depend_on_threads():
    body = pack(gaussian_symbols(1 << 18, 4, 1.0), 4)
    old = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 4):
            torch.set_num_threads(t)
            outs.append(rans.encode(body, 4))
            assert np.array_equal(rans.decode(outs[0], 4, body.size), body)
    finally:
        torch.set_num_threads(old)
    assert all(np.array_equal(o, outs[0]) for o in outs)


@pytest.mark.parametrize("counts", [[5, 0, 0, 0], [1, 10**9, 1, 0], [1] * 256, list(range(256)), [3, 1],
                                    [0, 0, 7, 0], [10**6] + [1] * 255, [0] * 16])
def test_normalize(counts):
    freq = rans.normalize(np.array(counts))
    assert int(freq.sum()) == 1 << rans.PROB_BITS
    present = np.array(counts) > 0
    if present.any():
        assert (freq[present] >= 1).all() and (freq[~present] == 0).all()


def test_corrupt_data_is_a_packet_error():
    body = pack(gaussian_symbols(40_000, 4, 1.0), 4)
    coded = rans.encode(body, 4)
    head = rans.overhead_bytes(4)
    for at in (head, head + 1, coded.size // 2, coded.size - 1):
        bad = coded.copy()
        bad[at] ^= 0x21
        with pytest.raises(PacketError, match="corrupt rANS data"):
            rans.decode(bad, 4, body.size)
    with pytest.raises(PacketError, match="does not fit"):
        rans.decode(coded[:head - 1], 4, body.size)
    with pytest.raises(PacketError, match="announce"):
        rans.decode(coded[:-2], 4, body.size)
    with pytest.raises(PacketError, match="corrupt rANS data"):
        rans.decode(coded, 4, body.size + 1)  # more symbols than were coded
