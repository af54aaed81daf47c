"""Wire format: exact sizes, integrity checks, mismatch detection and decoder fuzzing."""

import random

import pytest
import torch

from aqsgd.compress import HEADER_BYTES, Packet, make_codec, parse_header
from aqsgd.errors import AqsgdError, PacketError, PacketMismatchError

SPECS = ["none", "fp32", "fp16", "bf16", "q1", "q2", "q3:token", "q4:block7:stochastic", "q8:l2:scale32",
         "topk0.1", "topk0.3+q4", "topk0.5:tensor+bf16"]


@pytest.mark.parametrize("spec", SPECS)
def test_bytes_roundtrip(spec):
    codec = make_codec(spec)
    x = torch.randn(3, 5, 6)
    packet = codec.encode(x).with_tag(0xDEADBEEF, kind=2)
    data = packet.to_bytes()
    assert len(data) == packet.nbytes == codec.wire_bytes(x.shape)
    back = Packet.from_bytes(data)
    assert (back.tag, back.kind, back.shape, back.dtype) == (0xDEADBEEF, 2, (3, 5, 6), torch.float32)
    assert torch.equal(codec.decode(back), codec.decode(packet))


def test_header_is_fixed_size():
    codec = make_codec("q2")
    for shape in [(), (1,), (2, 3, 4, 5, 6, 7)]:
        p = codec.encode(torch.randn(shape))
        assert len(p.header_bytes()) == HEADER_BYTES
        assert parse_header(p.header_bytes()).shape == tuple(shape)


def test_too_many_dims_is_a_clear_error():
    with pytest.raises(AqsgdError, match="at most 6 dims"):
        make_codec("fp16").encode(torch.zeros([1] * 7))


def test_decode_with_other_codec_is_mismatch():
    p = make_codec("q2").encode(torch.randn(4, 4))
    with pytest.raises(PacketMismatchError, match="another codec"):
        make_codec("q4").decode(p)
    with pytest.raises(PacketMismatchError):
        make_codec("q2:token").decode(p)


def test_expect_names_shape_tag_kind():
    p = make_codec("fp16").encode(torch.randn(2, 3)).with_tag(7, kind=1)
    p.expect(tag=7, kind=1, shape=(2, 3))
    with pytest.raises(PacketMismatchError, match="shape"):
        p.expect(shape=(3, 2))
    with pytest.raises(PacketMismatchError, match="sample ids"):
        p.expect(tag=8)
    with pytest.raises(PacketMismatchError, match="kind"):
        p.expect(kind=0)


@pytest.mark.parametrize("spec", SPECS)
def test_truncated_and_extended_packets(spec):
    data = make_codec(spec).encode(torch.randn(4, 9)).to_bytes()
    for cut in (0, 1, HEADER_BYTES - 1, HEADER_BYTES, len(data) - 1):
        with pytest.raises(PacketError):
            Packet.from_bytes(data[:cut])
    with pytest.raises(PacketError):
        Packet.from_bytes(data + b"\x00")


def _decode_bytes(data: bytes) -> torch.Tensor:
    packet = Packet.from_bytes(data)
    for spec in SPECS:
        codec = make_codec(spec)
        if codec.fingerprint == packet.fingerprint:
            return codec.decode(packet)
    raise PacketMismatchError("no codec")


def test_fuzz_random_bytes():
    rng = random.Random(0)
    for _ in range(3000):
        n = rng.choice([0, 1, 10, 63, 64, 65, 100, 500])
        data = bytes(rng.getrandbits(8) for _ in range(n))
        if rng.random() < 0.5 and n >= 4:
            data = b"AQPK" + data[4:]  # get past the magic check
        with pytest.raises(PacketError):
            _decode_bytes(data)


def test_fuzz_mutated_packets():
    """Byte flips, truncations and splices of valid packets: always a PacketError, never garbage."""
    rng = random.Random(1)
    x = torch.randn(3, 17)
    valid = [make_codec(s).encode(x).to_bytes() for s in SPECS]
    for i in range(4000):
        data = bytearray(rng.choice(valid))
        op = rng.randrange(3)
        if op == 0:
            for _ in range(rng.randint(1, 4)):
                pos = rng.randrange(len(data))
                data[pos] ^= rng.randint(1, 255)
        elif op == 1:
            data = data[: rng.randrange(len(data))]
        else:
            other = rng.choice(valid)
            cut = rng.randrange(1, min(len(data), len(other)))
            data = data[:cut] + other[cut:]
            if bytes(data) in valid:
                continue
        with pytest.raises(PacketError):
            _decode_bytes(bytes(data))


def test_fuzz_valid_crc_with_garbage_payload():
    """Payload garbage that passes the CRC (e.g. a buggy sender): only library errors or a finite tensor."""
    rng = random.Random(2)
    x = torch.randn(2, 33)
    for spec in SPECS:
        codec = make_codec(spec)
        good = codec.encode(x)
        for _ in range(200):
            payload = torch.randint(0, 256, (good.payload.numel(),), dtype=torch.uint8,
                                    generator=torch.Generator().manual_seed(rng.getrandbits(32)))
            bad = Packet(good.family, good.dtype, good.shape, good.fingerprint, payload)
            try:
                y = codec.decode(Packet.from_bytes(bad.to_bytes()))
            except AqsgdError:
                continue
            assert y.shape == x.shape and y.dtype == x.dtype
