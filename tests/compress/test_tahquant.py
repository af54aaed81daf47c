import math
import struct
import zlib

import pytest
import torch

from aqsgd.compress import HEADER_BYTES, Packet, QuantCodec, make_codec
from aqsgd.compress.tahquant import TahQuantCodec, low_tokens
from aqsgd.errors import NonFiniteError, PacketError, SpecError

SPECS = ["tah", "tah:tile32", "tah:tile2", "tah:tile256", "tah2", "tah3", "tah4", "tah6", "tah8",
         "tah6:tile64"]


def rel_mse(y: torch.Tensor, x: torch.Tensor) -> float:
    return float((y.double() - x.double()).square().sum() / x.double().square().sum())


@pytest.mark.parametrize("spec", SPECS)
def test_spec_round_trip(spec):
    codec = make_codec(spec)
    assert isinstance(codec, TahQuantCodec)
    assert codec.spec == spec
    assert make_codec(codec.spec) == codec


def test_canonical_spec_and_defaults():
    assert TahQuantCodec().spec == "tah" and TahQuantCodec().tile == 64
    assert TahQuantCodec(6).spec == "tah6" and TahQuantCodec(6).tile == 32
    assert TahQuantCodec(tile=64).spec == "tah"
    assert TahQuantCodec(6, tile=32).spec == "tah6"
    assert make_codec("tah6:tile32").spec == "tah6"
    assert make_codec("tah:tile64").spec == "tah"


@pytest.mark.parametrize("bad", ["tah1", "tah9", "tah0", "tah:tile48", "tah:tile1", "tah:tile512", "tah:foo",
                                 "tahx", "tah6:tile0"])
def test_bad_specs(bad):
    with pytest.raises(SpecError):
        make_codec(bad)


@pytest.mark.parametrize("kw", [{"bits": 1}, {"bits": 9}, {"bits": 4.0}, {"bits": True}, {"tile": 3},
                                {"tile": 512}, {"tile": 64.0}])
def test_bad_args(kw):
    with pytest.raises(SpecError):
        TahQuantCodec(**kw)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("shape", [(2, 10, 64), (3, 7, 100), (1, 5), (130,), (), (2, 3, 4, 33), (0, 8),
                                   (4, 0), (5, 1)])
def test_exact_wire_bytes_and_shapes(spec, shape):
    codec = make_codec(spec)
    x = torch.randn(shape)
    packet = codec.encode(x)
    assert packet.nbytes == codec.wire_bytes(shape)
    y = codec.decode(packet)
    assert y.shape == x.shape and y.dtype == x.dtype
    if x.numel():
        assert rel_mse(y, x) < 0.5


def test_wire_bytes_formula():
    codec = make_codec("tah")
    b, s, c = 2, 12, 128
    rows, n, low = b * s, b * s * 2, low_tokens(s)
    expect = 4 * n + math.ceil(rows / 8) + math.ceil(n / 8) + math.ceil(n * 6 / 8) \
        + math.ceil(3 * b * low * c / 8) + math.ceil(4 * b * (s - low) * c / 8)
    assert codec.payload_bytes((b, s, c)) == expect
    assert make_codec("tah6").payload_bytes((b, s, c)) == 2 * rows * 4 + rows * c * 6 // 8


@pytest.mark.parametrize("spec, bound", [("tah", 0.02), ("tah3", 0.045), ("tah4", 0.012), ("tah6", 0.0008)])
def test_relative_mse_gaussian(spec, bound):
    torch.manual_seed(0)
    x = torch.randn(4, 128, 576)
    err = rel_mse(make_codec(spec).roundtrip(x), x)
    assert bound / 4 < err < bound


@pytest.mark.parametrize("spec, bits", [("tah", 4), ("tah", 3), ("tah3", 3), ("tah4", 4), ("tah6", 6)])
def test_beats_per_token_max_with_outlier_channel(spec, bits):
    torch.manual_seed(1)
    x = torch.randn(4, 64, 576)
    x[..., 7] *= 100
    ours = rel_mse(make_codec(spec).roundtrip(x), x)
    plain = rel_mse(QuantCodec(bits, granularity="token").roundtrip(x), x)
    assert ours < 0.7 * plain


def test_pivot_swap_is_undone():
    torch.manual_seed(2)
    x = 0.01 * torch.randn(3, 20, 256)
    pos = torch.randint(0, 64, (3, 20, 4))  # one outlier per tile, anywhere in it
    tiles = x.view(3, 20, 4, 64)
    tiles.scatter_(3, pos.unsqueeze(-1), 50.0 * torch.sign(torch.randn(3, 20, 4, 1)))
    codec = make_codec("tah")
    y = codec.roundtrip(x)
    assert torch.equal(y.view(3, 20, 4, 64).abs().argmax(-1), pos)
    # after the swap the outlier is a constant shift of the Hadamard tile, absorbed by the zero point: the
    # error stays at the scale of the small values, not of the outlier (50 / 7 per step without it)
    assert float((y - x).abs().max()) < 0.02
    assert rel_mse(y, x) < 1e-6


def test_flags_and_pivots_in_packet():
    x = torch.zeros(1, 5, 64)
    x[0, :, 9] = 3.0
    x[0, :, 20] = 1.0  # 3 >= 2 * 1: flagged, pivot 9
    x[0, 4, 20] = 2.0  # 3 < 2 * 2: not flagged
    codec = make_codec("tah")
    p = codec.encode(x).payload
    n = 5
    off = 4 * n + 1
    flags = p[off]
    assert int(flags) == 0b01111  # wire order: token 0 is the one 3-bit token (lowest entropy)...
    pivots = p[off + 1 : off + 1 + math.ceil(6 * n / 8)]
    assert int(pivots[0]) & 63 == 9
    assert torch.allclose(codec.decode(codec.encode(x)), x, atol=0.02)


def test_twenty_percent_low_bit_tokens_lowest_entropy():
    torch.manual_seed(3)
    x = torch.randn(3, 500, 128)
    spiky = torch.stack([torch.randperm(500)[:150] for _ in range(3)])
    for b in range(3):
        x[b, spiky[b], :] *= torch.where(torch.rand(128) < 0.05, 30.0, 0.1)
    codec = make_codec("tah")
    bits = codec.token_bits(codec.encode(x))
    assert bits.shape == (3, 500)
    assert ((bits == 3).sum(1) == 100).all() and ((bits == 4).sum(1) == 400).all()
    p = x.abs() / x.abs().sum(-1, keepdim=True)
    ent = -(p * p.log()).sum(-1)
    for b in range(3):
        assert set(torch.nonzero(bits[b] == 3).view(-1).tolist()) == set(ent[b].argsort()[:100].tolist())
    assert (make_codec("tah6").token_bits(make_codec("tah6").encode(x)) == 6).all()


def test_low_token_count_per_sequence():
    codec = make_codec("tah")
    for s in (1, 4, 5, 9, 10, 512):
        bits = codec.token_bits(codec.encode(torch.randn(2, s, 64)))
        assert int((bits == 3).sum()) == 2 * (s // 5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("spec", ["tah", "tah6"])
def test_low_precision_dtypes(spec, dtype):
    torch.manual_seed(4)
    x = torch.randn(2, 40, 192).to(dtype)
    codec = make_codec(spec)
    packet = codec.encode(x)
    assert packet.nbytes == codec.wire_bytes(x.shape, dtype)
    y = codec.decode(packet)
    assert y.dtype == dtype
    assert rel_mse(y, x) < (0.03 if spec == "tah" else 0.002)


def test_requires_grad_input_and_deterministic():
    x = torch.randn(2, 10, 64, requires_grad=True)
    codec = make_codec("tah")
    a, b = codec.encode(x), codec.encode(x)
    assert torch.equal(a.payload, b.payload)
    assert torch.equal(codec.decode(a), codec.decode(Packet.from_bytes(a.to_bytes())))


def test_constant_and_zero_tiles():
    for spec in ("tah", "tah6"):
        codec = make_codec(spec)
        z = torch.zeros(2, 10, 64)
        assert torch.equal(codec.roundtrip(z), z)
    c = torch.full((2, 10, 64), 3.0)
    assert torch.equal(make_codec("tah").roundtrip(c), c)  # zero point 3 (exact in fp16), scale 0
    # fixpoint: the top code is 2**(b-1) - 1 steps of s / 2**(b-1), so +max|x| comes back one step short
    assert torch.equal(make_codec("tah6").roundtrip(c), torch.full_like(c, 3.0 * 31 / 32))
    assert torch.equal(make_codec("tah6").roundtrip(-c), -c)


@pytest.mark.parametrize("spec", ["tah", "tah6"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_raises(spec, bad):
    x = torch.randn(2, 10, 64)
    x[1, 3, 5] = bad
    with pytest.raises(NonFiniteError):
        make_codec(spec).encode(x)


@pytest.mark.parametrize("spec", ["tah", "tah6"])
def test_beyond_fp16_raises(spec):
    x = torch.randn(2, 10, 64)
    x[0, 0, 0] = -1e6
    with pytest.raises(NonFiniteError, match="fp16"):
        make_codec(spec).encode(x)


def _with_payload(packet: Packet, payload: torch.Tensor) -> Packet:
    return Packet(packet.family, packet.dtype, packet.shape, packet.fingerprint, payload)


def test_corrupted_packets_raise():
    codec = make_codec("tah")
    x = torch.randn(2, 10, 64)
    packet = codec.encode(x)
    n = 20
    # a NaN scale
    p = packet.payload.clone()
    p[2 * n : 2 * n + 2] = torch.tensor([0x00, 0x7E], dtype=torch.uint8)
    with pytest.raises(PacketError, match="scales"):
        codec.decode(_with_payload(packet, p))
    # a negative scale
    p = packet.payload.clone()
    p[2 * n + 1] |= 0x80
    with pytest.raises(PacketError, match="scales"):
        codec.decode(_with_payload(packet, p))
    # an infinite zero point
    p = packet.payload.clone()
    p[0:2] = torch.tensor([0x00, 0x7C], dtype=torch.uint8)
    with pytest.raises(PacketError, match="zero points"):
        codec.decode(_with_payload(packet, p))
    # a token map with the wrong count
    p = packet.payload.clone()
    p[4 * n] ^= 0xFF
    with pytest.raises(PacketError, match="token map"):
        codec.decode(_with_payload(packet, p))
    # a pivot on an untransformed tile (token map: 3 bytes, tile flags: 3 bytes, then the pivots)
    p = packet.payload.clone()
    p[4 * n + 3 : 4 * n + 6] = 0  # no tile flagged
    p[4 * n + 6] |= 1  # but tile 0 carries a pivot
    with pytest.raises(PacketError, match="pivot"):
        codec.decode(_with_payload(packet, p))
    # truncated / oversized payloads
    for bad in (packet.payload[:-1], torch.cat([packet.payload, packet.payload[:1]])):
        with pytest.raises(PacketError):
            codec.decode(_with_payload(packet, bad))
    # another codec's packet
    with pytest.raises(PacketError):
        make_codec("tah:tile32").decode(packet)


def test_fixpoint_corrupted_scale():
    codec = make_codec("tah6")
    packet = codec.encode(torch.randn(2, 10, 64))
    p = packet.payload.clone()
    p[0:2] = torch.tensor([0x00, 0xFC], dtype=torch.uint8)  # -inf
    with pytest.raises(PacketError, match="scales"):
        codec.decode(_with_payload(packet, p))


def test_corrupted_bytes_on_the_wire():
    codec = make_codec("tah")
    data = bytearray(codec.encode(torch.randn(2, 10, 64)).to_bytes())
    data[HEADER_BYTES + 5] ^= 0x10
    with pytest.raises(PacketError):
        Packet.from_bytes(bytes(data))
    # with both CRCs made valid again the payload reaches the decoder: it decodes or raises PacketError
    rng = torch.Generator().manual_seed(0)
    good = codec.encode(torch.randn(2, 10, 64)).to_bytes()
    for _ in range(50):
        body = bytearray(good[HEADER_BYTES:])
        i = int(torch.randint(0, len(body), (1,), generator=rng))
        body[i] ^= int(torch.randint(1, 256, (1,), generator=rng))
        head = bytearray(good[:HEADER_BYTES])
        struct.pack_into("<I", head, 20, zlib.crc32(body))
        struct.pack_into("<I", head, 60, zlib.crc32(bytes(head[:60])))
        try:
            y = codec.decode(Packet.from_bytes(bytes(head + body)))
        except PacketError:
            continue
        assert y.shape == (2, 10, 64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", ["tah", "tah6", "tah:tile32"])
def test_cuda_matches_cpu(spec):
    torch.manual_seed(5)
    x = torch.randn(2, 50, 200)
    codec = make_codec(spec)
    pc, pg = codec.encode(x), codec.encode(x.cuda())
    assert pg.payload.is_cuda and pg.nbytes == pc.nbytes
    yg = codec.decode(pg)
    assert yg.is_cuda
    assert rel_mse(yg.cpu(), x) == pytest.approx(rel_mse(codec.decode(pc), x), rel=0.05)
    assert torch.allclose(codec.decode(Packet.from_bytes(pg.to_bytes())), yg.cpu(), atol=1e-5)
