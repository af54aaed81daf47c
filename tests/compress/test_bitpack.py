import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from aqsgd.compress.bitpack import pack_bits, packed_nbytes, unpack_bits


def reference_pack(codes: list[int], bits: int) -> list[int]:
    """Bit-by-bit reference of the documented little-endian stream."""
    stream = [(c >> k) & 1 for c in codes for k in range(bits)]
    return [
        sum(stream[8 * i + k] << k for k in range(8) if 8 * i + k < len(stream))
        for i in range(packed_nbytes(len(codes), bits))
    ]


@given(bits=st.integers(1, 8), data=st.data())
def test_pack_matches_reference_stream(bits, data):
    codes = data.draw(st.lists(st.integers(0, 2**bits - 1), max_size=70))
    t = torch.tensor(codes, dtype=torch.uint8)
    packed = pack_bits(t, bits)
    assert packed.numel() == packed_nbytes(len(codes), bits) == -(-len(codes) * bits // 8)
    assert packed.tolist() == reference_pack(codes, bits)
    assert torch.equal(unpack_bits(packed, bits, len(codes)), t)


@pytest.mark.parametrize("bits", range(1, 9))
def test_roundtrip_large(bits):
    g = torch.Generator().manual_seed(bits)
    n = 100_003
    codes = torch.randint(0, 2**bits, (n,), dtype=torch.uint8, generator=g)
    packed = pack_bits(codes, bits)
    assert packed.numel() == (n * bits + 7) // 8
    assert torch.equal(unpack_bits(packed, bits, n), codes)


def test_bad_arguments():
    with pytest.raises(ValueError):
        pack_bits(torch.zeros(4, dtype=torch.uint8), 9)
    with pytest.raises(ValueError):
        pack_bits(torch.zeros(4, dtype=torch.int32), 2)
    with pytest.raises(ValueError):
        unpack_bits(torch.zeros(3, dtype=torch.uint8), 2, 100)
