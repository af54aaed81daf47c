"""Rotated tiles, outlier rows and the zstd entropy stage (aqsgd.compress.hadamard / wrappers)."""

from __future__ import annotations

import math

import pytest
import torch

from aqsgd.compress import hadamard, make_codec
from aqsgd.compress.kernels import numba as numba_kernels
from aqsgd.compress.packet import Packet
from aqsgd.compress.wrappers import EntropyCodec, OutlierCodec, RotatedCodec
from aqsgd.errors import NonFiniteError, PacketError, PacketMismatchError, SpecError


def rel_mse(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((y.double() - x.double()).square().sum() / x.double().square().sum())


def sinky(rows: int = 256, d: int = 576, seed: int = 0) -> torch.Tensor:
    """Gaussian rows plus an attention-sink-like row 100x the others and a few loud channels."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, rows // 2, d, generator=g)
    x[:, 0] *= 100.0
    x[..., :5] *= 8.0
    return x


# -- the Hadamard rotation ------------------------------------------------------------------------
@pytest.mark.parametrize("tile", [2, 8, 32, 64, 128])
def test_rotation_is_orthonormal_and_inverts(tile):
    x = torch.randn(37, 128, generator=torch.Generator().manual_seed(tile))
    y = hadamard.rotate(x, tile, seed=5)
    assert y.shape == (37 * 128 // tile, tile)
    assert math.isclose(float(y.square().sum()), float(x.square().sum()), rel_tol=1e-5)
    back = hadamard.unrotate(y, tile, seed=5).view_as(x)
    assert torch.allclose(back, x, atol=1e-5)


def test_rotation_matches_the_hadamard_matrix():
    tile = 8
    h = torch.tensor([[1.0]])
    while h.shape[0] < tile:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    x = torch.randn(3, tile)
    s = hadamard.signs(tile, 7)
    want = (x * s) @ h.T / math.sqrt(tile)
    assert torch.allclose(hadamard.rotate(x, tile, 7), want, atol=1e-6)


@pytest.mark.skipif(not numba_kernels.available(), reason="numba missing")
@pytest.mark.parametrize("tile", [2, 4, 8, 16, 32, 64, 128, 256, 1024])
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 1001])
def test_fused_rotation_is_bit_identical_to_torch(tile, rows):
    # every mix of the kernel's three-stage and single-stage steps (tiles 2 ... 1024), rows around its 16
    # lanes, and values over many magnitudes, so that a changed order of additions would round differently
    g = torch.Generator().manual_seed(rows)
    width = max(128, tile)
    x = torch.randn(rows, width, generator=g) * torch.exp(3 * torch.randn(rows, width, generator=g))
    y = hadamard.rotate(x, tile, 3)
    y_eager = hadamard.rotate(x, tile, 3, backend="eager")
    z_eager = hadamard.unrotate(y_eager, tile, 3, backend="eager")
    assert torch.equal(y, y_eager)
    assert torch.equal(hadamard.unrotate(y, tile, 3), z_eager)


def test_signs_depend_on_the_seed_only():
    assert torch.equal(hadamard.signs(64, 1), hadamard.signs(64, 1))
    assert not torch.equal(hadamard.signs(64, 1), hadamard.signs(64, 2))
    assert set(hadamard.signs(64, 1).tolist()) == {-1.0, 1.0}


@pytest.mark.parametrize("tile", [0, 1, 3, 48, 8192])
def test_bad_tile_is_one_line(tile):
    with pytest.raises(SpecError, match="power of two"):
        hadamard.check_tile(tile)


# -- rot<G> ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec,canon", [
    ("q2:rot64", "q2:rot64"), ("q3:l2:rot64", "q3:rot64:l2"), ("q4:rot32:token", "q4:rot32"),
    ("q4:rot64s3:channel", "q4:rot64s3:channel"), ("q2:rot128:midrise:l2", "q2:rot128:l2:midrise"),
    ("q4:block16:rot64", "q4:rot64:block16"), ("q8:rot64:tensor:scale32", "q8:rot64:tensor:scale32"),
])
def test_rot_spec_round_trips(spec, canon):
    c = make_codec(spec)
    assert isinstance(c, RotatedCodec) and c.spec == canon
    assert make_codec(c.spec) == c


@pytest.mark.parametrize("shape", [(4, 64, 576), (3, 5, 7), (100,), (1, 64), (0, 64)])
@pytest.mark.parametrize("spec", ["q2:rot64:l2", "q4:rot32", "q3:rot8:stochastic"])
def test_rot_exact_wire_bytes(shape, spec):
    c = make_codec(spec)
    x = torch.randn(shape)
    p = c.encode(x, generator=torch.Generator().manual_seed(0))
    tiles = -(-x.numel() // c.tile)
    assert p.nbytes == c.wire_bytes(shape)
    assert p.payload.numel() == (make_codec(c.inner.spec).payload_bytes((tiles, c.tile)) if x.numel() else 0)
    y = c.decode(p)
    assert y.shape == x.shape and y.dtype == x.dtype


def test_rot_beats_per_channel_scales_on_outlier_heavy_rows():
    x = sinky()
    plain, rot = make_codec("q2:l2"), make_codec("q2:rot64:l2")
    assert rel_mse(x, rot.roundtrip(x)) < 0.5 * rel_mse(x, plain.roundtrip(x))


@pytest.mark.parametrize("bits,bound", [(2, 0.30), (3, 0.06), (4, 0.015)])
def test_rot_gaussian_error_near_the_optimal_uniform_quantizer(bits, bound):
    # unit Gaussian: the optimal uniform quantizer reaches 0.119 / 0.037 / 0.0115 at 2 / 3 / 4 bits
    x = torch.randn(64, 768, generator=torch.Generator().manual_seed(bits))
    assert rel_mse(x, make_codec(f"q{bits}:rot64:l2").roundtrip(x)) < bound


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_rot_keeps_the_dtype(dtype):
    x = torch.randn(8, 64).to(dtype)
    y = make_codec("q4:rot64").roundtrip(x)
    assert y.dtype == dtype and rel_mse(x.float(), y.float()) < 0.02


def test_rot_nan_names_the_whole_spec():
    x = torch.randn(4, 64)
    x[1, 3] = float("nan")
    with pytest.raises(NonFiniteError, match="q2:rot64"):
        make_codec("q2:rot64").encode(x)


def test_rot_packet_refused_by_plain_quantizer():
    p = make_codec("q2:rot64").encode(torch.randn(4, 64))
    with pytest.raises(PacketMismatchError):
        make_codec("q2").decode(p)
    with pytest.raises(PacketMismatchError):
        make_codec("q2:rot64s1").decode(p)


# -- outlier<F> -----------------------------------------------------------------------------------
def test_outlier_rows_go_apart_and_come_back():
    x = sinky()
    c = make_codec("q2:l2:outlier8")
    assert isinstance(c, OutlierCodec)
    idx = c.select(x.view(-1, x.shape[-1]))
    assert idx.tolist() == [0, 128]  # the sink rows of both samples, found from the data
    y = c.roundtrip(x)
    assert torch.allclose(y[:, 0], x[:, 0].bfloat16().float())
    assert rel_mse(x, y) < 0.05 * rel_mse(x, make_codec("q2:l2").roundtrip(x))


def test_outlier_bytes_count_the_rows_apart():
    x = sinky(rows=64, d=64)
    c = make_codec("q4:outlier8")
    p = c.encode(x)
    inner = make_codec("q4").payload_bytes((62, 64))
    assert p.payload.numel() == 4 + 2 * 4 + 2 * 2 * 64 + inner
    assert p.nbytes <= c.wire_bytes(x.shape)
    assert not c.fixed_size


def test_outlier_none_found_costs_four_bytes():
    x = torch.randn(32, 64)
    c = make_codec("q4:outlier8")
    assert c.encode(x).payload.numel() == 4 + make_codec("q4").payload_bytes(x.shape)


def test_outlier_count_is_capped():
    x = torch.randn(64, 32)
    x[::2] *= 1000  # half the rows are loud: the median is loud too, so use a tiny factor
    c = make_codec("q4:outlier1.5")
    assert c.select(x).numel() <= OutlierCodec.cap(64) == 4


def test_outlier_inf_is_refused():
    x = torch.randn(8, 16)
    x[2, 2] = float("inf")
    with pytest.raises(NonFiniteError, match="outlier8"):
        make_codec("q4:outlier8").encode(x)


@pytest.mark.parametrize("mutate,match", [
    (lambda p: p[:2], "no outlier count"),
    (lambda p: torch.cat([torch.tensor([99, 0, 0, 0], dtype=torch.uint8), p[4:]]), "announces 99"),
    (lambda p: torch.cat([p[:4], torch.tensor([200, 0, 0, 0], dtype=torch.uint8), p[8:]]), "ascending"),
])
def test_outlier_corrupt_packets(mutate, match):
    x = sinky(rows=64, d=64)[:1]
    c = make_codec("q4:outlier8")
    p = c.encode(x)
    bad = Packet(p.family, p.dtype, p.shape, p.fingerprint, mutate(p.payload.clone()))
    with pytest.raises((PacketError, PacketMismatchError), match=match):
        c.decode(bad)


# -- zstd -----------------------------------------------------------------------------------------
def test_zstd_is_lossless_over_the_inner_codec_and_shrinks_zero_codes():
    x = torch.randn(16, 512) * 0.01
    x[:, :2] = 50.0  # per-channel max scales of the loud channels; the rest round to the zero code
    plain, z = make_codec("q2:token:l2"), make_codec("q2:token:l2:zstd")
    assert isinstance(z, EntropyCodec) and not z.fixed_size
    assert torch.equal(plain.roundtrip(x), z.roundtrip(x))
    x = torch.zeros(16, 512)
    x[:, 0] = 1.0
    assert z.encode(x).payload.numel() < plain.encode(x).payload.numel() / 10


def test_zstd_stores_incompressible_payloads_as_is():
    x = torch.rand(64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1  # uniform 8-bit codes
    c = make_codec("q8:tensor:zstd")
    p = c.encode(x)
    assert p.payload[0] == 0 and p.payload.numel() == 1 + make_codec("q8:tensor").payload_bytes(x.shape)
    assert torch.equal(c.decode(p), make_codec("q8:tensor").roundtrip(x)) and not c.lossless
    assert make_codec("none:zstd").lossless


def test_zstd_levels_and_spec():
    assert make_codec("q2:zstd").spec == "q2:zstd"
    assert make_codec("q2:zstd3").spec == "q2:zstd3"
    assert make_codec("q2:zstd:l2:rot64:outlier4").spec == "q2:rot64:l2:outlier4:zstd"
    with pytest.raises(SpecError, match="1..19"):
        make_codec("q2:zstd0")


@pytest.mark.parametrize("mutate,match", [
    (lambda p: p[:0], "empty payload"),
    (lambda p: torch.cat([torch.tensor([7], dtype=torch.uint8), p[1:]]), "mode byte 7"),
    (lambda p: torch.cat([p[:1], p[1:].flip(0)]), "corrupt zstd frame"),
])
def test_zstd_corrupt_packets(mutate, match):
    x = torch.zeros(16, 512)
    x[:, 0] = 1.0
    c = make_codec("q2:zstd")
    p = c.encode(x)
    assert p.payload[0] == 1
    bad = Packet(p.family, p.dtype, p.shape, p.fingerprint, mutate(p.payload.clone()))
    with pytest.raises(PacketError, match=match):
        c.decode(bad)


# -- composition ----------------------------------------------------------------------------------
@pytest.mark.parametrize("bad,match", [
    ("topk0.1:rot64", "q<bits> quantizers only"), ("fp16:rot64", "q<bits> quantizers only"),
    ("none:outlier4", "lossy codec"), ("q2:rot64:rot32", "given twice"), ("q2:outlier1", "above 1"),
    ("q2:rot63", "power of two"),
])
def test_bad_wrapper_specs_are_one_line(bad, match):
    with pytest.raises(SpecError, match=match) as e:
        make_codec(bad)
    assert "\n" not in str(e.value)


def test_full_stack_round_trip_and_wire_bound():
    x = sinky()
    c = make_codec("q2:rot64:l2:outlier8:zstd")
    p = c.encode(x)
    assert p.nbytes <= c.wire_bytes(x.shape)
    assert rel_mse(x, c.decode(p)) < 0.01
    assert make_codec(c.spec) == c
