"""Conformance tests for quantize_groups / dequantize_groups as LowBitCache relies on them.

Run against the shared implementation in ``aqsgd.compress.quant`` (the one :mod:`aqsgd.schemes.cache` uses).
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import aqsgd.compress.quant as shared

IMPLEMENTATIONS: list[ModuleType] = [shared]


@pytest.fixture(params=IMPLEMENTATIONS, ids=lambda m: m.__name__)
def impl(request: pytest.FixtureRequest) -> ModuleType:
    return request.param


def _pack_reference(codes: list[list[int]], bits: int) -> list[list[int]]:
    """Plain-Python dense little-endian packing: value j occupies bits [j*bits, (j+1)*bits)."""
    out = []
    for row in codes:
        nbytes = (len(row) * bits + 7) // 8
        acc = 0
        for j, c in enumerate(row):
            acc |= c << (j * bits)
        out.append([(acc >> (8 * b)) & 0xFF for b in range(nbytes)])
    return out


def _expected_codes(x: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    s = scales.float().unsqueeze(1)
    if bits == 1:
        return (x >= 0).to(torch.int64)
    levels = 2 ** (bits - 1) - 1
    step = torch.where(s > 0, s / levels, torch.ones_like(s))
    return (torch.round(x / step).clamp(-levels, levels) + levels).to(torch.int64)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [1, 7, 64, 65])
def test_layout_and_roundtrip(impl: ModuleType, bits: int, n: int) -> None:
    gen = torch.Generator().manual_seed(bits * 100 + n)
    x = torch.randn(5, n, generator=gen) * torch.tensor([[0.01], [1.0], [3.0], [100.0], [0.0]])
    packed, scales = impl.quantize_groups(x, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (5, (n * bits + 7) // 8)
    assert scales.dtype == torch.float16 and scales.shape == (5,)
    # Scale: max|x| rounded *up* to fp16 (the smallest fp16 value that is >= max|x|).
    amax = x.abs().amax(1)
    assert torch.all(scales.float() >= amax)
    below = (scales.view(torch.int16) - 1).view(torch.float16).float()
    assert torch.all((below < amax) | (scales == 0))
    # Codes and their bit layout.
    codes = _expected_codes(x, scales, bits)
    assert packed.tolist() == _pack_reference(codes.tolist(), bits)
    # Decoding.
    y = impl.dequantize_groups(packed, scales, bits, n)
    assert y.dtype == torch.float32 and y.shape == (5, n)
    s = scales.float().unsqueeze(1)
    if bits == 1:
        assert torch.equal(y, torch.where(codes == 1, s, -s))
    else:
        step = s / (2 ** (bits - 1) - 1)
        assert torch.all((y - x).abs() <= step / 2 * (1 + 1e-5) + 1e-12)
    assert torch.equal(y[4], torch.zeros(n))  # an all-zero group decodes to zeros
    assert impl.dequantize_groups(packed, scales, bits, n, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_stochastic_rounding_is_seeded_and_unbiased(impl: ModuleType) -> None:
    x = torch.full((1, 20_000), 0.3)
    x[0, 0] = 1.0  # fixes the scale at 1.0
    a = impl.quantize_groups(x, 2, rounding="stochastic", generator=torch.Generator().manual_seed(0))
    b = impl.quantize_groups(x, 2, rounding="stochastic", generator=torch.Generator().manual_seed(0))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    y = impl.dequantize_groups(*a, 2, 20_000)
    assert set(y[0, 1:].unique().tolist()) == {0.0, 1.0}
    assert abs(float(y[0, 1:].mean()) - 0.3) < 0.02


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.quantize_groups(torch.zeros(2, 4), 0),
        lambda m: m.quantize_groups(torch.zeros(2, 4), 9),
        lambda m: m.quantize_groups(torch.zeros(8), 4),
        lambda m: m.quantize_groups(torch.zeros(2, 4), 4, rounding="up"),
        lambda m: m.quantize_groups(torch.tensor([[1e6, 0.0]]), 4),
        lambda m: m.quantize_groups(torch.tensor([[float("nan"), 0.0]]), 4),
    ],
)
def test_rejects_bad_input(call: object) -> None:
    with pytest.raises(ValueError):
        call(shared)  # type: ignore[operator]


@settings(max_examples=60, deadline=None)
@given(
    bits=st.integers(1, 8),
    g=st.integers(0, 4),
    n=st.integers(1, 40),
    seed=st.integers(0, 2**31 - 1),
    scale=st.floats(1e-3, 1e3),
)
def test_roundtrip_property(bits: int, g: int, n: int, seed: int, scale: float) -> None:
    x = torch.randn(g, n, generator=torch.Generator().manual_seed(seed)) * scale
    for impl in IMPLEMENTATIONS:
        packed, scales = impl.quantize_groups(x, bits)
        y = impl.dequantize_groups(packed, scales, bits, n)
        assert y.shape == (g, n)
        if g and bits > 1:
            step = scales.float().unsqueeze(1) / (2 ** (bits - 1) - 1)
            assert torch.all((y - x).abs() <= step / 2 * (1 + 1e-5) + 1e-12)
