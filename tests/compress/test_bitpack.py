import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from aqsgd.compress.bitpack import pack_bits, packed_nbytes, unpack_bits
from aqsgd.errors import CodecError


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


@pytest.mark.parametrize("bits", range(1, 9))
def test_slices_at_any_byte_offset(bits):
    """Codes or packed bytes that are a slice of a larger buffer, at any offset, give the aligned result."""
    g = torch.Generator().manual_seed(bits)
    buf = torch.randint(0, 2**bits, (120,), dtype=torch.uint8, generator=g)
    for offset in range(8):
        codes = buf[offset:offset + 101]
        packed = pack_bits(codes, bits)
        assert torch.equal(packed, pack_bits(codes.clone(), bits))
        shifted = torch.cat([torch.zeros(offset, dtype=torch.uint8), packed])[offset:]
        assert torch.equal(unpack_bits(shifted, bits, 101), codes)


def test_bad_arguments_are_library_errors():
    with pytest.raises(CodecError):
        pack_bits(torch.zeros(4, dtype=torch.uint8), 0)
    with pytest.raises(CodecError):
        unpack_bits(torch.zeros(2, 2, dtype=torch.uint8), 2, 8)
