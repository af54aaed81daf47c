"""Wire format: exact sizes, integrity checks, mismatch detection and decoder fuzzing."""

import dataclasses
import random
import struct
import zlib

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


# -- payloads at any byte offset (the transport slices one shared receive buffer) ----------------------
OFFSET_SPECS = ["none", "fp32", "fp16", "bf16", "q1", "q3", "q2:l2", "q5:token:scale32", "q7:block5:midrise",
                "q8:tensor", "topk0.5", "topk0.5+q3", "topk0.5+q1", "topk0.3:tensor+q8", "topk0.5+fp32",
                "topk0.5+bf16", "topk0.5+q5:block3:scale32"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _at_offset(packet: Packet, offset: int) -> Packet:
    """The same packet with its payload copied to ``offset`` bytes into a larger buffer."""
    n = packet.payload.numel()
    buf = torch.zeros(offset + n + 8, dtype=torch.uint8)
    buf[offset:offset + n] = packet.payload
    return dataclasses.replace(packet, payload=buf[offset:offset + n])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("spec", OFFSET_SPECS)
def test_decode_payload_at_any_byte_offset(spec, dtype):
    codec = make_codec(spec)
    for shape in [(3, 7), (1, 301), (2, 3, 5)]:
        packet = codec.encode(torch.randn(shape, generator=torch.Generator().manual_seed(7)).to(dtype))
        expected = codec.decode(packet)
        for offset in range(1, 8):
            y = codec.decode(_at_offset(packet, offset))
            assert y.dtype == dtype and torch.equal(_bits(y), _bits(expected)), (shape, offset)


@pytest.mark.parametrize("spec", ["none", "fp32"])
def test_aligned_payload_decodes_without_a_copy(spec):
    packet = _at_offset(make_codec(spec).encode(torch.randn(3, 7)), 8)
    assert make_codec(spec).decode(packet).data_ptr() == packet.payload.data_ptr()


def _via_shared_buffer(packets: list[Packet]) -> list[Packet]:
    """What the transport hands the receiver: each payload a slice of one buffer, header by header."""
    shared = torch.cat([p.payload for p in packets])
    out, offset = [], 0
    for p in packets:
        h = parse_header(p.header_bytes())
        out.append(Packet.from_header(h, shared[offset:offset + h.payload_len]))
        offset += h.payload_len
    return out


@pytest.mark.parametrize("codec,row", [("q3", (7,)), ("q2:l2", (3, 7)), ("topk0.5+q3", (301,))])
def test_delta_microbatch_of_seen_and_new_samples_from_one_buffer(codec, row):
    """The reported failure: delta rows, then raw rows in one message, the raw payload at an odd byte."""
    from aqsgd.schemes import make_scheme

    s, r = (make_scheme("delta", codec, side, num_samples=10, cache="memory:fp32")
            for side in ("sender", "receiver"))
    ids = torch.tensor([0, 1, 2, 3])
    r.recv(_via_shared_buffer(s.send(torch.randn(4, *row), ids)), ids)
    ids = torch.tensor([2, 0, 3, 9])  # three seen (delta packet), one new (raw packet)
    x = torch.randn(4, *row)
    packets = _via_shared_buffer(s.send(x, ids))
    assert [p.shape[0] for p in packets] == [3, 1] and packets[1].payload.storage_offset() % 4
    y = r.recv(packets, ids)
    assert torch.equal(y[3], x[3]) and torch.equal(y, s.cache.get(ids))  # the sender's view, exactly


# -- shapes that cannot be tensors -------------------------------------------------------------------
def _forged(codec, dims, dtype_code=1, payload=b"") -> bytes:
    """A header with a valid CRC announcing ``dims`` (the fields a sender could put there)."""
    head = bytearray(codec.encode(torch.zeros(1)).header_bytes(checksum=False))
    head[6], head[7] = dtype_code, len(dims)
    head[24:32] = struct.pack("<Q", len(payload))
    head[32:56] = struct.pack("<6I", *dims, *[0] * (6 - len(dims)))
    head[60:64] = struct.pack("<I", zlib.crc32(bytes(head[:60])))
    return bytes(head) + payload


BIG = 2**32 - 1


@pytest.mark.parametrize("dims", [(0, BIG, BIG), (BIG, 0, BIG, BIG), (BIG, BIG), (2**31, 2**30),
                                  (0, 0, 2**16, 2**16, 2**16, 2**16), (BIG,) * 6], ids=str)
@pytest.mark.parametrize("spec", ["none", "fp16", "q2", "q3:token", "topk0.5", "topk0.5+q3"])
def test_overflowing_shapes_are_packet_errors(spec, dims):
    codec = make_codec(spec)
    data = _forged(codec, dims)
    with pytest.raises(PacketError, match="too large"):
        parse_header(data)
    with pytest.raises(PacketError, match="too large"):
        codec.decode(Packet.from_bytes(data))
    with pytest.raises(PacketError, match="too large"):
        Packet(codec.family, torch.float32, dims, codec.fingerprint, torch.empty(0, dtype=torch.uint8))


@pytest.mark.parametrize("spec", ["none", "fp16", "q2", "q3:token", "topk0.5", "topk0.5+q3"])
def test_largest_empty_shapes_still_decode(spec):
    """The bound rejects only shapes torch cannot stride: an empty (0, 2**30, 2**30) tensor still decodes."""
    codec = make_codec(spec)
    for dims in [(0, 2**30, 2**30), (2**30, 0, 2**30)]:
        y = codec.decode(Packet.from_bytes(_forged(codec, dims)))
        assert y.shape == dims and y.dtype == torch.float32


def test_kind_out_of_range_is_a_packet_error():
    p = make_codec("q2").encode(torch.randn(2, 3))
    with pytest.raises(PacketError, match="kind"):
        p.with_tag(1, kind=256)


@pytest.mark.parametrize("spec", SPECS)
def test_encode_tensor_requiring_grad(spec):
    x = torch.randn(3, 8, requires_grad=True)
    codec = make_codec(spec)
    y, y_detached = (codec.roundtrip(t, generator=torch.Generator().manual_seed(0)) for t in (x, x.detach()))
    assert torch.equal(y, y_detached)


def test_payload_crc_is_zlibs_crc32():
    """The accelerated CRC gives zlib's value (the wire format's), for every layout a tensor can have."""
    from aqsgd.compress.packet import crc32_of_buffer, crc32_of_tensor

    g = torch.Generator().manual_seed(3)
    for n in (0, 1, 7, 64, 4099, 1 << 20):
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        raw = data.numpy().tobytes()
        assert crc32_of_tensor(data) == zlib.crc32(raw) == crc32_of_buffer(raw)
        assert crc32_of_buffer(raw, 12345) == zlib.crc32(raw, 12345)  # continued from an earlier value
    x = torch.randn(6, 10, generator=g)
    assert crc32_of_tensor(x) == zlib.crc32(x.numpy().tobytes())
    assert crc32_of_tensor(x.t()) == zlib.crc32(x.t().contiguous().numpy().tobytes())  # strided


def test_header_takes_a_precomputed_payload_crc():
    from aqsgd.compress.packet import crc32_of_tensor

    p = make_codec("q4").encode(torch.randn(4, 32))
    assert p.header_bytes(payload_crc=crc32_of_tensor(p.payload)) == p.header_bytes()
    assert p.header_bytes(checksum=False, payload_crc=123) == p.header_bytes(checksum=False)  # no CRC sent
    with pytest.raises(PacketError, match="CRC"):
        Packet.from_bytes(p.header_bytes(payload_crc=crc32_of_tensor(p.payload) ^ 1)
                          + p.payload.numpy().tobytes())


@pytest.mark.parametrize("checksum", [True, False])
def test_layout_key_and_fill_header_rebuild_header_bytes(checksum):
    """The transport packs a header's layout once per link and fills in each message's tag and payload CRC:
    the result must be exactly ``header_bytes``, and the key must not depend on the per-message fields."""
    from aqsgd.compress.packet import HEADER_BYTES, fill_header, layout_key, layout_keys, message_fields

    g = torch.Generator().manual_seed(3)
    for spec, shape in (("q2", (4, 16)), ("none", (3,)), ("topk0.1", (8, 32)), ("fp16", ()),
                        ("q4:rot64", (2, 128))):
        base = make_codec(spec).encode(torch.randn(shape, generator=g))
        keys = set()
        for tag, kind in ((0, 0), (0xDEADBEEF, 3), (2**32 + 5, 255)):
            p = base.with_tag(tag, kind=kind)
            want = p.header_bytes(checksum=checksum)
            crc = message_fields(want)[1]
            assert fill_header(layout_key(want), p.tag, crc) == want
            assert (message_fields(want)[0] == p.tag & 0xFFFFFFFF
                    and message_fields(want)[2] == int.from_bytes(want[60:], "little"))
            keys.add(layout_key(p.with_tag(tag, kind=0).header_bytes(checksum=checksum)))
        assert len(keys) == 1  # the tag is not part of the key
        assert sum(map(len, layout_key(want))) == 52
        two = want + base.header_bytes(checksum=checksum)
        # several headers in one call
        assert layout_keys(two, 2) == layout_key(two) + layout_key(two, HEADER_BYTES)
