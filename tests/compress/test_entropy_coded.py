"""Entropy-coded quantization: the ``step<c>`` scale (a uniform step of c x the group's rms) and the
range-coder stage ``:rc`` over a quantizer's codes (aqsgd.compress.quant / wrappers)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aqsgd.compress import make_codec, rans
from aqsgd.compress.packet import Packet
from aqsgd.compress.wrappers import RansCodec
from aqsgd.errors import PacketError, SpecError


def gaussian(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def rel_mse(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((y.double() - x.double()).square().sum() / x.double().square().sum())


def entropy_bits(codes: np.ndarray) -> float:
    p = np.bincount(codes) / codes.size
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


# -- the step<c> scale ----------------------------------------------------------------------------
@pytest.mark.parametrize("spec,canon", [("q4:step1", "q4:step1"), ("q4:step1.10", "q4:step1.1"),
                                        ("q4:token:step0.5", "q4:token:step0.5"),
                                        ("q4:step1.0:rot128", "q4:rot128:step1"),
                                        ("q4:rc:step1:rot64", "q4:rot64:step1:rc")])
def test_step_and_rc_specs_round_trip(spec, canon):
    c = make_codec(spec)
    assert c.spec == canon and make_codec(c.spec) == c


@pytest.mark.parametrize("fused_on", [True, False])
def test_step_is_c_times_the_group_rms_and_clips_beyond_the_field(fused_on):
    x = gaussian(64, 256)
    x[3, 7] = 40.0  # beyond 7 steps of its row: clipped to the outermost level
    c = make_codec("q4:token:step1.1", backend=None if fused_on else "eager")
    y = c.decode(c.encode(x))
    rms = x.square().mean(dim=1, keepdim=True).sqrt()
    step = c.step(c.quantize(x)[0]).view(-1, 1)
    # the stored (fp16, rounded up) scale is 7 steps of 1.1 rms
    assert torch.all(step >= 1.1 * rms) and torch.allclose(step, 1.1 * rms, rtol=1e-3)
    levels = y / step
    assert torch.allclose(levels, levels.round(), atol=1e-5) and levels.round().abs().max() == 7
    inside = x.abs() < 7 * step
    assert torch.all((y - x)[inside].abs() <= step.expand_as(x)[inside] / 2 * (1 + 1e-6))
    assert torch.isclose(y[3, 7], 7 * step[3, 0])


def test_step_is_at_most_the_max_abs_so_flat_groups_come_back_exactly():
    """A rotated tile holding one loud channel is flat (every |value| equal): with c > 1 a step of c rms would
    send it at +-c x its values; the step is capped at the max-abs instead."""
    x = gaussian(4, 512)
    x[0] = 0.0
    x[0, 5] = 300.0  # one loud channel: its 128-value tile is +-300 / sqrt(128) after the rotation
    c = make_codec("q4:rot128:step1.9")
    y = c.roundtrip(x)
    assert torch.allclose(y[0], x[0], atol=1e-3 * 300)
    g = gaussian(64, 128, seed=3)  # Gaussian rows: max-abs is about 2.5 rms, so the cap does not bind
    q = make_codec("q4:token:step1.9")
    rms = g.square().mean(dim=1).sqrt()
    assert torch.allclose(q.step(q.quantize(g)[0]), 1.9 * rms, rtol=1e-3)


def test_step_fused_and_eager_packets_are_byte_identical():
    x = gaussian(8, 64, 96)
    x[:, 0] = 3.0  # flat rows: the max-abs cap binds for c > 1
    for spec in ("q4:token:step1", "q4:step0.8", "q8:block64:step1.1", "q4:rot64:step1", "q4:token:step1.9",
                 "q4:step2.5"):
        a = make_codec(spec).encode(x).payload
        b = make_codec(spec, backend="eager").encode(x).payload
        assert torch.equal(a, b), spec


def test_step_error_follows_the_uniform_quantizer_not_the_field_width():
    """On Gaussian tiles the error is about step^2 / 12 (in rms units), whatever the code field's width."""
    x = gaussian(512, 128)
    for c_step in (0.5, 1.0, 1.5):
        e4 = rel_mse(x, make_codec(f"q4:rot128:step{c_step}").roundtrip(x))
        e8 = rel_mse(x, make_codec(f"q8:rot128:step{c_step}").roundtrip(x))
        assert abs(e4 - c_step**2 / 12) < 0.1 * c_step**2 / 12
        assert abs(e8 - e4) < 0.01 * e4  # 7 steps = 7 rms or more: nothing Gaussian is clipped


@pytest.mark.parametrize("bad,match", [("q4:step0", r"\(0, 64\]"), ("q4:step65", r"\(0, 64\]"),
                                       ("q4:step1:l2", "conflict"), ("q4:stepx", "unknown quantizer option")])
def test_bad_step_specs_are_one_line(bad, match):
    with pytest.raises(SpecError, match=match) as e:
        make_codec(bad)
    assert "\n" not in str(e.value)


# -- the range coder ------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["q4:rot128:step1", "q4:token:step1.1", "q2:rot64:l2:midrise", "q1:rot64",
                                  "q8:rot64:step1", "q3:rot64:l2:midrise", "q4:block64:l2", "q6:tensor"])
def test_rc_is_lossless_over_the_quantizer(spec):
    x = gaussian(4, 96, 160)
    plain, rc = make_codec(spec), make_codec(spec + ":rc")
    assert isinstance(rc, RansCodec) and not rc.fixed_size and not rc.lossless
    p = rc.encode(x)
    assert torch.equal(rc.decode(p), plain.roundtrip(x))
    assert p.nbytes <= rc.wire_bytes(x.shape)


@pytest.mark.parametrize("spec,width", [("q4:rot128:step1", 4), ("q2:rot64:l2:midrise", 2), ("q8:step1", 8),
                                        ("q3:rot64:l2", 8)])
def test_rc_spends_the_codes_empirical_entropy(spec, width):
    """The payload is the mode byte, the scales, the coder's tables (2**w uint16 frequencies, 16 lanes' uint32
    states and word counts), then its 16-bit words: within a few words per lane of the symbols' empirical
    entropy (each lane's last 16 to 32 bits sit in its final state, in the tables)."""
    x = gaussian(8, 128, 128)
    plain, rc = make_codec(spec), make_codec(spec + ":rc")
    raw = plain.encode(x).payload.numpy()
    head = rc._layout(x.shape)[0]
    body = raw[head:]
    sym = body if width == 8 else ((body[:, None] >> np.arange(0, 8, width)) & ((1 << width) - 1)).reshape(-1)
    ideal = entropy_bits(sym) * sym.size / 8
    p = rc.encode(x).payload
    coded = p.numel() - 1 - head - rans.overhead_bytes(width)
    assert coded % 2 == 0
    assert ideal - 4 * rans.LANES <= coded <= ideal * 1.002 + 2 * rans.LANES
    assert p[0] == RansCodec.MODE == 3


def test_rc_beats_zstd_on_entropy_coded_steps():
    x = gaussian(8, 128, 576)
    rc = make_codec("q4:rot128:step1:rc").encode(x).nbytes
    zs = make_codec("q4:rot128:step1:zstd").encode(x).nbytes
    assert rc < 0.98 * zs  # zstd's Huffman codes whole bits per code byte


def test_rc_single_symbol_and_incompressible_payloads():
    c = make_codec("q4:token:step1:rc")
    x = torch.zeros(16, 64)  # every code the zero level: no coder words at all
    p = c.encode(x)
    assert p.payload[0] == 3 and p.payload.numel() == 1 + 16 * 2 + rans.overhead_bytes(4)
    assert torch.equal(c.decode(p), x)
    u = torch.rand(64, 64, generator=torch.Generator().manual_seed(1)) * 2 - 1  # uniform 8-bit codes
    c8 = make_codec("q8:tensor:rc")
    p = c8.encode(u)
    assert p.payload[0] == 0 and p.payload.numel() == 1 + make_codec("q8:tensor").payload_bytes(u.shape)
    assert torch.equal(c8.decode(p), make_codec("q8:tensor").roundtrip(u))


def _tables_offset(c: RansCodec, shape) -> int:
    return 1 + c._layout(shape)[0]


def _poke(p: torch.Tensor, at: int, dtype: torch.dtype, value: int) -> torch.Tensor:
    n = torch.empty(0, dtype=dtype).element_size()
    return torch.cat([p[:at], torch.tensor([value], dtype=dtype).view(torch.uint8), p[at + n:]])


def _peek(p: torch.Tensor, at: int, dtype: torch.dtype) -> int:
    n = torch.empty(0, dtype=dtype).element_size()
    return int(p[at:at + n].clone().view(dtype))


# offsets in the coder's tables of q4 codes: 16 uint16 frequencies, 16 uint32 states, 16 uint32 counts
_FREQ = 0
_STATE = 32
_COUNT = 32 + 64


@pytest.mark.parametrize("mutate,match", [
    (lambda p, o: p[:o + 10], "does not fit its layout"),
    (lambda p, o: torch.cat([p[:1], p[1:o - 1]]), "shorter than its"),
    (lambda p, o: _poke(p, o + _FREQ, torch.int16, _peek(p, o + _FREQ, torch.int16) + 1), "add up to"),
    (lambda p, o: torch.cat([p[:1].fill_(9), p[1:]]), "mode byte 9"),
    (lambda p, o: torch.cat([p[:1].fill_(2), p[1:]]), "mode byte 2"),  # the range coder's mode before rANS
    (lambda p, o: p[:-2], "announce"),
    (lambda p, o: p[:-1], "does not fit its layout"),
    (lambda p, o: _poke(p, o + _STATE, torch.int32, 5), "below"),
    (lambda p, o: _poke(p, o + _COUNT, torch.int32, _peek(p, o + _COUNT, torch.int32) + 1),
     "announce"),
    (lambda p, o: torch.cat([p[:-1], p[-1:] ^ 0x40]), "corrupt rANS data"),
    (lambda p, o: torch.cat([p[:o + 200], p[o + 200:o + 201] ^ 0x01, p[o + 201:]]), "corrupt rANS data"),
])
def test_rc_corrupt_packets(mutate, match):
    x = gaussian(4, 32, 128)
    c = make_codec("q4:rot128:step1:rc")
    p = c.encode(x)
    bad = Packet(p.family, p.dtype, p.shape, p.fingerprint,
                 mutate(p.payload.clone(), _tables_offset(c, x.shape)))
    with pytest.raises(PacketError, match=match) as e:
        c.decode(bad)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("bad,match", [("q4:step1:rc:zstd", "not with zstd"), ("q4:outlier8:rc", "outlier"),
                                       ("topk0.1:rc", "q<bits> quantizer"), ("fp16:rc", "q<bits> quantizer"),
                                       ("tah:rc", "q<bits> quantizer"), ("q4:rc:rc", "given twice")])
def test_bad_rc_specs_are_one_line(bad, match):
    with pytest.raises(SpecError, match=match) as e:
        make_codec(bad)
    assert "\n" not in str(e.value)
