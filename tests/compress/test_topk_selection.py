"""The sampled top-k selection of :mod:`aqsgd.compress.topk` against ``torch.topk``.

Small rows reach the sampled path through ``sample=..., min_row=0``. The reference for positions is the
canonical rule the selection promises on the CPU: the k largest magnitudes (NaN above Inf), ties at the
k-th broken toward the lower positions, positions increasing; the kept values are also checked against
those of ``torch.topk``.

``python tests/compress/test_topk_selection.py [REPEATS [THREADS]]`` times the old selection
(``torch.topk`` on the magnitudes) against the new one on 8x512x768 fp32 (see docs/bench-codecs.md).
"""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aqsgd.compress import make_codec
from aqsgd.compress import topk as topk_module
from aqsgd.compress.topk import topk_indices

FAST = {"sample": 64, "min_row": 0}  # the sampled path on rows of a few hundred values and up


@pytest.fixture(autouse=True, params=["kernel", "numpy"])
def selection_path(request):
    """Every test runs on both selections: the compiled per-row kernel (numba) and the numpy passes."""
    from aqsgd.compress import kernels
    from aqsgd.compress.kernels import numba as numba_kernels

    if request.param == "kernel" and not numba_kernels.available():
        pytest.skip("numba is not installed")
    with kernels.defaulting_to("numba" if request.param == "kernel" else "eager"):
        yield request.param


def canonical(x2: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the k largest magnitudes of each row, ties toward the lower positions, increasing."""
    bits = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
            torch.bfloat16: torch.int16}[x2.dtype]
    keys = x2.view(bits) & torch.iinfo(bits).max  # sign bit off: orders like the magnitude, NaN on top
    order = torch.sort(keys, dim=1, descending=True, stable=True).indices
    return order[:, :k].sort(dim=1).values


def check(x2: torch.Tensor, k: int, idx: torch.Tensor, *, unique: bool = False) -> None:
    rows, n = x2.shape
    assert idx.shape == (rows, k) and idx.dtype == torch.int64
    assert bool((idx.diff(dim=1) > 0).all()), "positions increase in each row"
    assert torch.equal(idx, canonical(x2, k))
    ref = x2.abs().topk(k, dim=1, sorted=False).indices
    mine = x2.gather(1, idx).abs().double().sort(dim=1).values
    theirs = x2.gather(1, ref).abs().double().sort(dim=1).values
    assert torch.equal(mine.nan_to_num(nan=-1.0), theirs.nan_to_num(nan=-1.0)), "the magnitudes of torch.topk"
    if unique:  # no ties: the very same positions as torch.topk
        assert torch.equal(idx, ref.sort(dim=1).values)


def spy_on_fallback(monkeypatch) -> list:
    calls: list = []
    original = topk_module._exact

    def spy(key, k):
        calls.append(key.shape)
        return original(key, k)

    monkeypatch.setattr(topk_module, "_exact", spy)
    return calls


@pytest.mark.parametrize("frac", [0.001, 0.01, 0.1, 0.3])
@pytest.mark.parametrize("shape", [(3, 5000), (1, 20000), (7, 700)])
def test_random_rows_match_torch_topk(monkeypatch, shape, frac):
    calls = spy_on_fallback(monkeypatch)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(shape[1]))
    k = max(1, math.ceil(frac * shape[1]))
    check(x, k, topk_indices(x, k, **FAST), unique=True)
    if frac <= 0.1:  # (at 0.3 a sample of 64 is too coarse to pay off: such rows rank in full by design)
        assert not calls, "the sampled path ranked a row in full"


@pytest.mark.parametrize("frac", [0.01, 0.1])
@pytest.mark.parametrize("per", ["row", "tensor"])
def test_default_path_on_activation_sized_rows(monkeypatch, per, frac):
    calls = spy_on_fallback(monkeypatch)
    x = torch.randn(2, 96, 768, generator=torch.Generator().manual_seed(1))  # rows of 73728 (> MIN_ROW)
    x[..., ::96] *= 8  # a few outlier channels, as in activations
    x2 = x.view(2, -1) if per == "row" else x.view(1, -1)
    k = math.ceil(frac * x2.shape[1])
    check(x2, k, topk_indices(x2, k), unique=True)
    assert not calls


@pytest.mark.parametrize("kind", ["integers", "all_equal", "mostly_zero", "two_levels"])
@pytest.mark.parametrize("frac", [0.001, 0.05, 0.3])
def test_ties_keep_k_equal_values_first_positions_first(kind, frac):
    g = torch.Generator().manual_seed(2)
    n = 30000
    if kind == "integers":
        x = torch.randint(-20, 21, (3, n), generator=g).float()
    elif kind == "all_equal":
        x = torch.full((3, n), -1.5)
    elif kind == "mostly_zero":
        x = torch.zeros(3, n)
        x[:, ::50] = torch.randn(3, n // 50, generator=g)
    else:
        x = torch.where(torch.rand(3, n, generator=g) < 0.02, 4.0, 1.0)
    k = math.ceil(frac * n)
    check(x, k, topk_indices(x, k, **FAST))
    check(x, k, topk_indices(x, k))


@pytest.mark.parametrize("n", [1, 2, 63, 64, 255, 300])
def test_rows_shorter_than_the_sample(n):
    x = torch.randn(2, n, generator=torch.Generator().manual_seed(n))
    for k in sorted({1, max(1, n // 3), n}):
        check(x, k, topk_indices(x, k, sample=4096, min_row=0), unique=True)
        check(x, k, topk_indices(x, k, **FAST), unique=True)


@pytest.mark.parametrize("options", [FAST, {}])
def test_k_of_one_and_k_of_n(options):
    x = torch.randn(3, 4000, generator=torch.Generator().manual_seed(3))
    for k in (1, 2, 3999, 4000):
        check(x, k, topk_indices(x, k, **options), unique=True)
    assert torch.equal(topk_indices(x, 4000, **options), torch.arange(4000).expand(3, 4000))
    assert topk_indices(x, 0, **options).shape == (3, 0)


@pytest.mark.parametrize("k", [1, 3, 40, 400])
def test_nan_and_inf_count_as_the_largest(k):
    x = torch.randn(4, 4000, generator=torch.Generator().manual_seed(4))
    x[0, 17] = float("nan")
    x[1, 5] = float("inf")
    x[1, 3999] = -float("inf")
    x[2, [10, 20]] = torch.tensor([float("nan"), -float("inf")])
    for options in (FAST, {}):
        idx = topk_indices(x, k, **options)
        check(x, k, idx)
        kept = [set(row.tolist()) for row in idx]
        assert 17 in kept[0] and 10 in kept[2]  # NaN first...
        assert (k == 1 and kept[1] == {5}) or {5, 3999} <= kept[1]  # ...then Inf (the lower position first)
        assert k == 1 or 20 in kept[2]


def test_more_nan_than_k_keeps_the_first_nans():
    x = torch.randn(2, 3000, generator=torch.Generator().manual_seed(5))
    x[:, 100:400] = float("nan")
    idx = topk_indices(x, 30, **FAST)
    assert torch.equal(idx, torch.arange(100, 130).expand(2, 30))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("per", ["row", "tensor"])
@pytest.mark.slow
def test_half_and_double_inputs(dtype, per):
    x = torch.randn(4, 6000, generator=torch.Generator().manual_seed(6)).to(dtype)
    x[1, 7] = float("nan")
    x[2, 8] = float("inf")
    x2 = x if per == "row" else x.view(1, -1)
    for frac in (0.01, 0.1):
        k = math.ceil(frac * x2.shape[1])
        check(x2, k, topk_indices(x2, k, **FAST))  # half precision has ties: canonical positions
        check(x2, k, topk_indices(x2, k))


def test_misleading_samples_fall_back_to_a_full_ranking(monkeypatch):
    n, s = 20000, 512
    pos = torch.from_numpy(topk_module._sample_positions(n, s))
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, n, generator=g)
    x[0, pos] = 100.0 + torch.rand(s, generator=g)  # the sample sees only huge values: too few candidates
    x[1, pos] = 1e-6 * torch.rand(s, generator=g)  # only tiny ones: more than k above the upper threshold
    calls = spy_on_fallback(monkeypatch)
    k = 2000
    idx = topk_indices(x, k, sample=s, min_row=0)
    check(x, k, idx, unique=True)
    assert len(calls) == 2 and all(shape == (1, n) for shape in calls)  # rows 0 and 1, not row 2


@pytest.mark.parametrize("per", ["row", "tensor"])
def test_same_positions_on_one_and_two_threads(per):
    x = torch.randn(4, 300000, generator=torch.Generator().manual_seed(8))
    x2 = x if per == "row" else x.view(1, -1)
    k = math.ceil(0.05 * x2.shape[1])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = topk_indices(x2, k)
        torch.set_num_threads(2)
        two = topk_indices(x2, k)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    check(x2, k, two, unique=True)


def test_codec_packets_are_canonical_and_sorted():
    x = torch.randint(-3, 4, (2, 70000), generator=torch.Generator().manual_seed(9)).float()
    for spec in ("topk0.1", "topk0.01:tensor+q8"):
        codec = make_codec(spec)
        first, again = codec.encode(x), codec.encode(x.clone())
        assert first.to_bytes() == again.to_bytes()
        rows, n, k = codec.layout(x.shape)
        vbytes = codec.values.payload_bytes((rows, k), x.dtype)
        idx = topk_module._index_values(first.payload[vbytes:], 4 if n > 65536 else 2).view(rows, k)
        assert torch.equal(idx, canonical(x.view(rows, n), k))


@pytest.mark.parametrize("spec", ["topk0.1", "topk0.01+bf16", "topk0.3+fp32", "topk0.05:tensor",
                                  "topk0.1+q8"])
@pytest.mark.parametrize("data", ["normal", "integers", "misled"])
def test_encode_is_byte_identical_to_the_step_by_step_path(selection_path, spec, data):
    """One kernel selects, gathers, casts and packs the indices (the numba backend's ``topk_encode``), or
    packs after the selection (``topk_pack``): the packets equal those of gather, cast and index packing in
    torch."""

    g = torch.Generator().manual_seed(10)
    n = 70000  # above MIN_ROW: the sampled selection
    if data == "integers":  # ties at the k-th magnitude
        x = torch.randint(-6, 7, (3, n), generator=g).float()
    else:
        x = torch.randn(3, n, generator=g) * 3
    if data == "misled":  # row 1's sample sees only huge values: that row is ranked in full
        pos = torch.from_numpy(topk_module._sample_positions(n, topk_module.SAMPLE))
        x[1, pos] = 1e3 + torch.rand(pos.numel(), generator=g)
    codec = make_codec(spec)
    packet = codec.encode(x)
    reference = make_codec(spec, backend="eager").encode(x)
    assert packet.to_bytes() == reference.to_bytes()
    assert torch.equal(codec.decode(packet), codec.decode(reference))


@pytest.mark.parametrize("spec, value", [("topk0.01", float("nan")), ("topk0.01", float("inf")),
                                         ("topk0.01", 1e6), ("topk0.01+bf16", float("nan"))])
def test_encode_refuses_values_its_wire_cannot_carry(spec, value):
    """A kept NaN/Inf, or a value past fp16's range, raises the values codec's error on every path."""
    from aqsgd.errors import NonFiniteError

    x = torch.randn(2, 70000, generator=torch.Generator().manual_seed(11))
    x[1, 123] = value
    with pytest.raises(NonFiniteError):
        make_codec(spec).encode(x)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 3), n=st.integers(1, 3000), frac=st.floats(0.0005, 1.0),
       sample=st.sampled_from([8, 32, 128, 4096]), dtype=st.sampled_from([torch.float32, torch.float16]),
       data=st.sampled_from(["normal", "integers", "specials"]), seed=st.integers(0, 2**16))
def test_property_equals_the_canonical_top_k(rows, n, frac, sample, dtype, data, seed):
    g = torch.Generator().manual_seed(seed)
    if data == "integers":
        x = torch.randint(-5, 6, (rows, n), generator=g).float()
    else:
        x = torch.randn(rows, n, generator=g) * torch.exp(2 * torch.randn(rows, 1, generator=g))
    if data == "specials":
        specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0])
        where = torch.rand(rows, n, generator=g) < 0.01
        x[where] = specials[torch.randint(0, 5, (int(where.sum()),), generator=g)]
    x = x.to(dtype)
    k = min(n, max(1, math.ceil(frac * n)))
    check(x, k, topk_indices(x, k, sample=sample, min_row=0))


def bench(repeats: int = 15, threads: int = 2) -> None:
    """Old selection (``torch.topk`` on the magnitudes) against the new, interleaved, ``threads`` threads."""
    import time

    def old(x2: torch.Tensor, k: int) -> torch.Tensor:
        return x2.abs().topk(k, dim=1, sorted=False).indices

    torch.set_num_threads(threads)
    x = torch.randn(8, 512, 768, generator=torch.Generator().manual_seed(0))
    x[..., ::96] *= 8
    print(f"torch {torch.__version__}, {threads} threads, median of {repeats} after 3 warm-up")
    cases = [("per-row topk0.1", x.view(8, -1), 0.1), ("per-row topk0.01", x.view(8, -1), 0.01),
             ("per-tensor topk0.01", x.view(1, -1), 0.01), ("per-tensor topk0.1", x.view(1, -1), 0.1)]
    for label, x2, frac in cases:
        k = math.ceil(frac * x2.shape[1] - 1e-9)
        assert torch.equal(old(x2, k).sort(dim=1).values, topk_indices(x2, k))
        times: dict[str, list[float]] = {"old": [], "new": []}
        for i in range(repeats + 3):
            for name, fn in (("old", old), ("new", topk_indices)):
                t0 = time.perf_counter()
                fn(x2, k)
                if i >= 3:
                    times[name].append(time.perf_counter() - t0)
        t_old, t_new = (float(np.median(times[name])) * 1e3 for name in ("old", "new"))
        print(f"{label:20s} k={k:<7d} old {t_old:7.2f} ms  new {t_new:6.2f} ms",
              f"speed-up {t_old / t_new:.1f}x")


if __name__ == "__main__":
    bench(*(int(a) for a in sys.argv[1:3]))  # [repeats [threads]]
