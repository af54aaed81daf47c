import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from aqsgd.compress import HEADER_BYTES, QuantCodec, dequantize_groups, make_codec, quantize_groups
from aqsgd.errors import NonFiniteError

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def n_scales(shape, granularity, block):
    numel = math.prod(shape)
    if numel == 0:
        return 0
    cols = shape[-1] if shape else 1
    if granularity == "tensor":
        return 1
    if granularity == "channel":
        return cols
    if granularity == "token":
        return numel // cols
    return -(-numel // block)


def per_element_scale(codec: QuantCodec, packet) -> torch.Tensor:
    """Each element's stored scale, broadcast from the payload's scale table."""
    shape = packet.shape
    numel = math.prod(shape)
    ns = n_scales(shape, codec.granularity, codec.block)
    scales = packet.payload[: ns * codec.scale_dtype.itemsize].view(codec.scale_dtype).double()
    cols = shape[-1] if shape else 1
    if codec.granularity == "tensor":
        return scales.expand(numel).reshape(shape)
    if codec.granularity == "channel":
        return scales.view(1, -1).expand(numel // cols, cols).reshape(shape)
    if codec.granularity == "token":
        return scales.view(-1, 1).expand(numel // cols, cols).reshape(shape)
    return scales.repeat_interleave(codec.block)[:numel].reshape(shape)


shapes = st.lists(st.integers(1, 9), min_size=1, max_size=4).map(tuple)


@given(
    shape=shapes,
    bits=st.integers(1, 8),
    granularity=st.sampled_from(["tensor", "channel", "token", "block"]),
    block=st.integers(1, 40),
    dtype=st.sampled_from(DTYPES),
    scale_dtype=st.sampled_from([torch.float16, torch.float32]),
    seed=st.integers(0, 2**16),
    magnitude=st.sampled_from([1e-6, 1.0, 1e3]),
    grid=st.sampled_from(["midtread", "midrise"]),
)
def test_nearest_error_within_half_step_and_exact_bytes(shape, bits, granularity, block, dtype, scale_dtype,
                                                         seed, magnitude, grid):
    # max-abs scales at every width (1 bit defaults to mean-|x| scales, which clip by design)
    codec = QuantCodec(bits, granularity=granularity, block=block, scale_dtype=scale_dtype, grid=grid,
                       scale="max")
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * magnitude).to(dtype)
    packet = codec.encode(x)
    numel = math.prod(shape)
    expected = (HEADER_BYTES + n_scales(shape, granularity, block) * scale_dtype.itemsize
                + -(-numel * bits // 8))
    assert packet.nbytes == expected == codec.wire_bytes(shape)
    y = codec.decode(packet)
    assert y.dtype == dtype and y.shape == x.shape
    scale = per_element_scale(codec, packet)
    assert bool((scale >= x.double().abs()).all()), "max scale must not clip"
    half_step = scale * (1.0 / codec.qmax)  # step = 2 * scale / qmax
    # slack: one rounding of the output dtype plus float32 arithmetic
    out_eps = {torch.float16: 2**-11, torch.bfloat16: 2**-8}.get(dtype, 2**-22)
    # ... and, for subnormal outputs, the output dtype's smallest spacing
    fi = torch.finfo(dtype)
    slack = out_eps * x.double().abs() + 1e-6 * half_step + fi.tiny * fi.eps
    err = (y.double() - x.double()).abs()
    # y is rounded to the output dtype: compare against the dtype-rounded exact level as well
    assert bool((err <= half_step + slack + out_eps * scale).all()), float((err - half_step).max())


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_zero_is_exact_and_grid_symmetric(bits):
    x = torch.tensor([[-1.0, 0.0, 1.0, 0.3, -0.3, 0.0]])
    y = QuantCodec(bits, granularity="tensor").roundtrip(x)
    if bits >= 2:
        assert y[0, 1] == 0 and y[0, 5] == 0
    assert torch.equal(y[0, 0], -y[0, 2]) and torch.equal(y[0, 3], -y[0, 4])
    levels = torch.unique(QuantCodec(bits, granularity="tensor").roundtrip(torch.linspace(-1, 1, 1001)))
    assert levels.numel() == (2 if bits == 1 else 2**bits - 1)
    assert torch.allclose(levels, -levels.flip(0))


@pytest.mark.parametrize("bits", [2, 3, 8])
def test_midrise_grid_uses_every_code_and_has_no_zero(bits):
    codec = QuantCodec(bits, granularity="tensor", grid="midrise")
    levels = torch.unique(codec.roundtrip(torch.linspace(-1, 1, 4001)))
    assert levels.numel() == 2**bits and not bool((levels == 0).any())
    assert torch.allclose(levels, -levels.flip(0)) and float(levels.max()) == pytest.approx(1.0, abs=1e-3)
    steps = levels.diff()
    assert torch.allclose(steps, steps.mean().expand_as(steps), rtol=1e-3)  # uniform, step 2 / (2^b - 1)
    assert float(steps.mean()) == pytest.approx(2 / (2**bits - 1), rel=1e-3)
    assert codec.spec == f"q{bits}:tensor:midrise" and make_codec(codec.spec) == codec
    assert codec.wire_bytes((7, 5)) == QuantCodec(bits, granularity="tensor").wire_bytes((7, 5))


@pytest.mark.parametrize("grid", ["midtread", "midrise"])
@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("granularity", ["channel", "block"])
@pytest.mark.slow
def test_stochastic_rounding_is_unbiased(bits, granularity, grid):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, generator=g)
    codec = QuantCodec(bits, granularity=granularity, block=8, rounding="stochastic", grid=grid)
    n = 4000
    acc = torch.zeros(4, 16, dtype=torch.float64)
    for _ in range(n):
        acc += codec.roundtrip(x, generator=g).double()
    mean = acc / n
    packet = codec.encode(x, generator=g)
    step = per_element_scale(codec, packet) * (2.0 / codec.qmax)
    # each draw lies within one step of x with variance <= step^2 / 4: the mean's std <= step / (2 sqrt(n));
    # 5 standard deviations (float32 levels add ~1e-7 relative).
    tol = 5 * step / (2 * math.sqrt(n)) + 1e-6
    assert bool(((mean - x.double()).abs() <= tol).all())
    # nearest rounding of the same data is biased by far more than that tolerance somewhere
    nearest = QuantCodec(bits, granularity=granularity, block=8).roundtrip(x).double()
    assert float((nearest - x.double()).abs().max()) > float(tol.max())


def test_l2_scale_clips_outliers_and_bounds_the_rest():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 32, generator=g)
    x[3, 5] = 40.0
    codec = QuantCodec(4, granularity="channel", scale="l2")
    packet = codec.encode(x)
    y = codec.decode(packet)
    scale = per_element_scale(codec, packet).float()
    inside = x.abs() <= scale
    assert not bool(inside[3, 5])
    assert float(y[3, 5]) == pytest.approx(float(scale[3, 5]), rel=1e-3)  # clipped to the outer level
    assert bool(((y - x).abs()[inside] <= (scale / codec.qmax)[inside] * (1 + 1e-5)).all())
    # on Gaussian data the clipped scale gives a lower mean squared error than max-abs
    x = torch.randn(256, 64, generator=g)
    mse = {m: float((QuantCodec(3, scale=m).roundtrip(x) - x).square().mean()) for m in ("max", "l2")}
    assert mse["l2"] < mse["max"]


@pytest.mark.parametrize("bits, expected", [(2, 0.345), (3, 0.194), (4, 0.108)])
def test_midrise_l2_reaches_the_optimal_uniform_quantizer_error(bits, expected):
    """On Gaussian data the midrise grid with its l2 clipping reaches Max's (1960) optimal uniform quantizer;
    at 2 bits it beats the 3-level midtread grid at its own best clipping (0.436) by a fifth."""
    x = torch.randn(512, 512, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def rel(codec: QuantCodec) -> float:
        return float((codec.roundtrip(x) - x).norm() / x.norm())

    assert rel(QuantCodec(bits, granularity="tensor", scale="l2", grid="midrise",
                          scale_dtype=torch.float32)) \
        == pytest.approx(expected, abs=0.004)
    if bits == 2:
        clipped = x.clamp(-1.2, 1.2)  # the 3-level grid's best clipping for a unit Gaussian, ~1.2
        best_midtread = float((QuantCodec(2, granularity="tensor").roundtrip(clipped) - x).norm() / x.norm())
        assert best_midtread == pytest.approx(0.436, abs=0.004)
        assert rel(QuantCodec(2, scale="l2", grid="midrise")) < 0.8 * best_midtread


def test_fp16_scale_never_overflows_or_underflows_to_clip():
    x = torch.tensor([[1e6, -2.0], [1e-9, 3e-8]], dtype=torch.float32)
    codec = QuantCodec(8, granularity="token")
    packet = codec.encode(x)
    scales = packet.payload[:4].view(torch.float16)
    assert bool(torch.isfinite(scales).all())
    y = codec.decode(packet)
    assert float(y[0, 0]) == pytest.approx(65504.0)  # clamped scale clips, never inf
    assert float(y[0, 1]) == pytest.approx(0.0, abs=65504 / 127)
    assert bool(((y[1] - x[1]).abs() <= float(scales[1].float()) / 127).all())


@pytest.mark.parametrize("spec", ["q2", "q4:token", "q8:block16", "q3:stochastic", "q4:l2"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_raises(spec, bad):
    x = torch.randn(4, 8)
    x[1, 2] = bad
    with pytest.raises(NonFiniteError):
        make_codec(spec).encode(x)


def test_zero_tensor_and_empty_tensor():
    codec = QuantCodec(2)
    assert torch.equal(codec.roundtrip(torch.zeros(3, 4)), torch.zeros(3, 4))
    empty = torch.zeros(0, 4)
    p = codec.encode(empty)
    assert p.nbytes == HEADER_BYTES and codec.decode(p).shape == (0, 4)


def test_compression_ratio_reported():
    codec = make_codec("q2")
    shape = (8, 512, 768)
    raw = 8 * 512 * 768 * 4
    assert codec.ratio(shape) == pytest.approx(raw / (HEADER_BYTES + 768 * 2 + 8 * 512 * 768 // 4))
    assert 15.9 < codec.ratio(shape) < 16.0


@given(g=st.integers(1, 6), n=st.integers(1, 40), bits=st.integers(1, 8), seed=st.integers(0, 1000))
def test_group_helpers_roundtrip_rowwise(g, n, bits, seed):
    x = torch.randn(g, n, generator=torch.Generator().manual_seed(seed))
    packed, scales = quantize_groups(x, bits)
    assert packed.shape == (g, -(-n * bits // 8)) and scales.shape == (g,) and scales.dtype == torch.float16
    y = dequantize_groups(packed, scales, bits, n)
    ref = QuantCodec(bits, granularity="token", scale="max").roundtrip(x)  # the helpers keep max-abs scales
    assert torch.equal(y, ref)
    # rows are independent: quantizing one row alone gives the same bytes
    p0, s0 = quantize_groups(x[:1], bits)
    assert torch.equal(p0[0], packed[0]) and torch.equal(s0, scales[:1])


def test_float64_beyond_fp32_scales_is_rejected_at_encode():
    """Its scale would be stored as Inf and the packet rejected by every receiver: refuse to send it."""
    x = torch.tensor([[1e300, 1.0], [2.0, -3.0]], dtype=torch.float64)
    with pytest.raises(NonFiniteError):
        make_codec("q8:scale32").encode(x)
    y = make_codec("q8").roundtrip(x)  # fp16 scales clip at 65504, as documented
    assert float(y.abs().max()) <= 65504 * 1.01


# -- decoding agrees on every device -------------------------------------------------------------------------
@pytest.mark.parametrize("divisor", [3, 7, 15, 31, 63, 127, 255])
def test_the_step_division_is_the_same_on_a_gpu(divisor):
    """CUDA divides a tensor by a Python number as ``x * (1 / d)``. The decode's step (stored scale / d) goes
    through float64, where that path and the CPU's true division round to the same fp32, for every fp16 scale;
    in fp32 itself the reciprocal path differs (the bug a GPU run found: a packet decoded on the GPU differed
    in its last bit from the same packet decoded on the CPU)."""
    from aqsgd.compress.quant import divided

    every_fp16 = torch.arange(1, 0x7C00, dtype=torch.int16).view(torch.float16)  # every positive finite value
    true = every_fp16.float() / divisor
    assert torch.equal(divided(every_fp16, divisor, torch.float32), true)
    assert torch.equal((every_fp16.double() * (1.0 / divisor)).float(), true)  # CUDA's path, in float64
    in_fp32 = every_fp16.float() * torch.tensor(1.0 / divisor, dtype=torch.float32)  # CUDA's path, in fp32
    assert not torch.equal(in_fp32, true)
    fp32_scales = torch.rand(200_000, generator=torch.Generator().manual_seed(divisor)) * 1e3  # scale32
    assert torch.equal((fp32_scales.double() * (1.0 / divisor)).float(), fp32_scales / divisor)
