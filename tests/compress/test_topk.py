import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from aqsgd.compress import HEADER_BYTES, TopKCodec, make_codec
from aqsgd.compress.topk import index_dtype
from aqsgd.errors import NonFiniteError


@pytest.mark.parametrize("n,dtype", [(1, torch.uint8), (256, torch.uint8), (257, torch.uint16),
                                     (65536, torch.uint16), (65537, torch.uint32), (2**32 + 1, torch.int64)])
def test_index_dtype_is_narrowest(n, dtype):
    assert index_dtype(n) == dtype


@given(rows=st.integers(1, 6), cols=st.integers(1, 300), frac=st.sampled_from([0.01, 0.1, 0.3, 1.0]),
       per=st.sampled_from(["row", "tensor"]), seed=st.integers(0, 999))
def test_keeps_largest_magnitudes_with_exact_bytes(rows, cols, frac, per, seed):
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    codec = TopKCodec(frac, per=per)
    packet = codec.encode(x)
    r, n = (rows, cols) if per == "row" else (1, rows * cols)
    k = max(1, math.ceil(frac * n - 1e-9))
    assert packet.nbytes == HEADER_BYTES + r * k * (2 + index_dtype(n).itemsize) == codec.wire_bytes(x.shape)
    y = codec.decode(packet).view(r, n)
    x2 = x.view(r, n)
    kept = y != 0
    assert bool((kept.sum(1) == k).all())
    # kept values are the fp16 roundings of the originals...
    assert torch.equal(y[kept], x2[kept].half().float())
    # ...and no dropped value is larger in magnitude than a kept one in its row
    for i in range(r):
        if k < n:
            assert float(x2[i][~kept[i]].abs().max()) <= float(x2[i][kept[i]].abs().min())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_dtype_preserved_and_quantized_values(dtype):
    x = torch.randn(3, 5, 7).to(dtype)
    for spec in ("topk0.2", "topk0.2+q8", "topk0.2+bf16", "topk0.3:tensor+q4:block4"):
        codec = make_codec(spec)
        p = codec.encode(x)
        y = codec.decode(p)
        assert y.dtype == dtype and y.shape == x.shape and p.nbytes == codec.wire_bytes(x.shape, dtype)
    q8 = make_codec("topk0.2+q8")
    # q8 values: 1 byte each + one fp16 scale per row
    rows, n, k = q8.layout(x.shape)
    assert q8.payload_bytes(x.shape) == rows * k * 1 + rows * 2 + rows * k * 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("spec", ["topk0.1", "topk0.1+q8", "topk0.5:tensor+fp32"])
def test_non_finite_is_always_kept_and_rejected(spec, bad):
    x = torch.randn(2, 100)
    x[1, 17] = bad
    with pytest.raises(NonFiniteError):
        make_codec(spec).encode(x)


def test_topk_one_is_fp16_identity_and_ratio():
    x = torch.randn(4, 64)
    assert torch.equal(make_codec("topk1").roundtrip(x), x.half().float())
    c = make_codec("topk0.1")
    shape = (8, 512, 768)
    k = math.ceil(0.1 * 512 * 768)
    assert c.wire_bytes(shape) == HEADER_BYTES + 8 * k * (2 + 4)


# Value codecs of every kind and bit width. Odd payload sizes (odd bits, or an odd count of kept values
# with one fp16 scale per row) used to leave the indices at an odd byte, where viewing them as uint16/uint32
# failed: `topk0.5+q3` crashed on a (1, 301) tensor.
VALUE_CODECS = ["fp16", "fp32", "bf16"] + [
    f"q{b}{opt}" for b in range(1, 9)
    for opt in ("", ":token", ":channel", ":tensor:l2", ":block5:stochastic", ":midrise:scale32")
]
# odd row lengths, one row, many rows, 3-D; a row of 70001 has uint32 indices (after 35001 fp16 values)
TOPK_CASES = [(v, s) for v in VALUE_CODECS for s in [(1, 301), (3, 1000), (1, 7), (64, 9), (2, 3, 7), (5, 1)]]
TOPK_CASES += [(v, (1, 70001)) for v in ("fp16", "q3", "q8:token")]


@pytest.mark.parametrize("values,shape", TOPK_CASES, ids=str)
def test_every_values_codec_roundtrips_odd_shapes(values, shape):
    g = torch.Generator().manual_seed(len(values) + shape[-1])
    x = torch.randn(shape, generator=g)
    for topk in ("topk0.5", "topk0.1", "topk0.3:tensor"):
        codec = make_codec(f"{topk}+{values}")
        for dtype in (torch.float32, torch.float16):
            xd = x.to(dtype)
            packet = codec.encode(xd, generator=g)
            assert packet.nbytes == codec.wire_bytes(shape, dtype)
            y = codec.decode(packet)
            assert y.shape == x.shape and y.dtype == dtype
            rows, n, k = codec.layout(shape)
            assert int((y.reshape(rows, n) != 0).sum(1).max()) <= k
            assert bool(torch.isfinite(y).all())


@pytest.mark.parametrize("spec,where", [("topk0.1", "topk0.1 (its fp16 part)"),
                                        ("topk0.1+q8", "topk0.1+q8:token (its q8:token part)"),
                                        ("q4:zstd", "q4:zstd")])
def test_a_non_finite_input_is_named_by_the_outer_spec(spec, where):
    from aqsgd.compress import make_codec
    from aqsgd.errors import NonFiniteError

    x = torch.randn(4, 64)
    x[1, 3] = float("nan")
    with pytest.raises(NonFiniteError) as e:
        make_codec(spec).encode(x)
    assert str(e.value).startswith(f"{where}: "), str(e.value)
    assert "holds NaN or Inf" in str(e.value)
