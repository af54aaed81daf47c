"""The fused (numba) quantizer against the eager PyTorch path: byte-identical packets, identical decodes."""

import warnings

import pytest
import torch

from aqsgd.compress import kernels
from aqsgd.compress.kernels import numba as fused
from aqsgd.compress.quant import QuantCodec, dequantize_groups, quantize_groups
from aqsgd.compress.registry import make_codec
from aqsgd.errors import NonFiniteError

pytestmark = pytest.mark.skipif(not fused.available(), reason="numba is not installed")


def _both(fn):
    """``fn()`` with the numba kernels and with the eager ones (the CPU's default backend switched)."""
    with kernels.defaulting_to("numba"):
        a = fn()
    with kernels.defaulting_to("eager"):
        b = fn()
    return a, b


def _data(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.rand(shape[-1], generator=g).mul(4).add(0.01)
    x.view(-1)[:: 97] *= 30  # outliers, so l2 scales clip
    x.view(-1)[5] = 0.0
    return x.to(dtype)


GRANS = ["", ":tensor", ":token", ":block64", ":block8"]
OPTIONS = ["", ":l2", ":midrise", ":l2:midrise", ":scale32"]


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("gran", GRANS)
@pytest.mark.parametrize("opt", OPTIONS)
def test_packets_and_decodes_identical(bits, gran, opt):
    if bits == 1 and ":l2" in opt:
        opt = opt.replace(":l2", ":max")
    codec = make_codec(f"q{bits}{gran}{opt}")
    x = _data((3, 16, 96))
    (pa, da), (pb, db) = _both(lambda: (codec.encode(x), codec.decode(codec.encode(x))))
    assert torch.equal(pa.payload, pb.payload)
    assert torch.equal(da, db)
    # decoding the same packet on either path gives the same tensor
    (d1, d2) = _both(lambda: codec.decode(pb))
    assert torch.equal(d1, d2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_identical(dtype):
    codec = make_codec("q4")
    x = _data((4, 64), dtype)
    (pa, da), (pb, db) = _both(lambda: (codec.encode(x), codec.decode(codec.encode(x))))
    assert torch.equal(pa.payload, pb.payload) and da.dtype == dtype and torch.equal(da, db)


def test_large_tensor_identical_default_codecs():
    x = _data((8, 512, 768))
    for spec in ("q2", "q4", "q8", "q1", "q2:l2:midrise"):
        codec = make_codec(spec)
        (pa, da), (pb, db) = _both(lambda: (codec.encode(x), codec.decode(codec.encode(x))))
        assert torch.equal(pa.payload, pb.payload), spec
        assert torch.equal(da, db), spec


@pytest.mark.parametrize("shape", [(5, 7), (3, 12), (130,)])
def test_shapes_outside_the_kernels_take_the_eager_path(shape):
    codec = make_codec("q3:block64")
    x = _data(shape)
    (pa, da), (pb, db) = _both(lambda: (codec.encode(x), codec.decode(codec.encode(x))))
    assert torch.equal(pa.payload, pb.payload) and torch.equal(da, db)


def test_plan():
    assert kernels.plan((2, 3, 16), "channel", 0, 3) == (6, 16, True)
    assert kernels.plan((2, 3, 16), "token", 0, 3) == (6, 16, False)
    assert kernels.plan((2, 3, 16), "tensor", 0, 3) == (6, 16, False)
    assert kernels.plan((4, 16), "block", 32, 3) == (2, 32, False)
    assert kernels.plan((4, 16), "block", 48, 3) is None  # does not divide the tensor
    assert kernels.plan((4, 12), "channel", 0, 3) is None  # rows would not end on a byte
    assert kernels.plan((0, 16), "channel", 0, 3) is None
    # rows whose codes fill whole bytes, though not whole groups of 8 codes: the last group is short
    assert kernels.plan((4, 10), "token", 0, 8) == (4, 10, False)
    assert kernels.plan((4, 10), "channel", 0, 4) == (4, 10, True)
    assert kernels.plan((4, 12), "channel", 0, 6) == (4, 12, True)
    assert kernels.plan((4, 12), "block", 12, 2) == (4, 12, False)
    assert kernels.plan((4, 10), "token", 0, 3) is None and kernels.plan((4, 6), "token", 0, 6) is None


# (shape, specs): rows whose codes end on a byte, but whose last group of 8 codes is short
SHORT_ROWS = [((3, 10), ("q8", "q8:token", "q4", "q4:token:l2", "q4:midrise")),
              ((2, 5, 18), ("q8:token", "q4:channel", "q4:token:scale32")),
              ((4, 12), ("q2:token", "q2", "q6:token", "q6:l2", "q2:l2:midrise")),
              ((2, 26), ("q8", "q4:token"))]


@pytest.mark.parametrize("shape, specs", SHORT_ROWS)
def test_rows_with_a_short_last_group_take_the_kernels(shape, specs, monkeypatch):
    calls = []
    for name in ("quantize_pack", "unpack_dequantize"):
        real = getattr(fused.NumbaKernels, name)
        monkeypatch.setattr(fused.NumbaKernels, name, lambda self, *a, _r=real, _n=name, **k: (
            calls.append(_n) or _r(self, *a, **k)))
    x = _data(shape)
    for spec in specs:
        codec = make_codec(spec)
        calls.clear()
        (pa, da), (pb, db) = _both(lambda: (codec.encode(x), codec.decode(codec.encode(x))))
        assert torch.equal(pa.payload, pb.payload), spec
        assert torch.equal(da, db), spec
        assert calls.count("quantize_pack") == 2 and calls.count("unpack_dequantize") == 1, (spec, calls)


def test_topk_then_q8_quantizes_its_kept_values_in_the_kernels(monkeypatch):
    # 100 values a row, 10 kept: rows of 10 values, which the kernels took only in whole groups of 8 before
    calls = []
    real = fused.NumbaKernels.quantize_pack
    monkeypatch.setattr(fused.NumbaKernels, "quantize_pack",
                        lambda self, *a, **k: calls.append(a[0].shape) or real(self, *a, **k))
    x = _data((4, 100))
    codec = make_codec("topk0.1+q8:token")
    a, b = _both(lambda: codec.encode(x).payload)
    assert torch.equal(a, b)
    assert calls and calls[0][1] % 8, calls
    (da, db) = _both(lambda: codec.decode(codec.encode(x)))
    assert torch.equal(da, db)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("gran", ["", ":token", ":tensor"])
def test_non_finite_input_raises_on_the_fused_path(bad, gran):
    x = _data((4, 32))
    x[2, 3] = bad
    with pytest.raises(NonFiniteError):
        make_codec(f"q2{gran}").encode(x)


def test_scale_beyond_fp16_clips_identically():
    x = _data((4, 32)) * 1e4
    x[0, 0] = 1e6
    codec = make_codec("q4")
    (pa, da), (pb, db) = _both(lambda: (codec.encode(x), codec.decode(codec.encode(x))))
    assert torch.equal(pa.payload, pb.payload) and torch.equal(da, db)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_lowbit_group_helpers_identical(bits):
    x = _data((10, 64))
    (pa, sa), (pb, sb) = _both(lambda: quantize_groups(x, bits))
    assert torch.equal(pa, pb) and torch.equal(sa, sb) and pa.shape == (10, 64 * bits // 8)
    a, b = _both(lambda: dequantize_groups(pa, sa, bits, 64))
    assert torch.equal(a, b)


def test_stochastic_rounding_stays_eager_and_reproducible():
    codec = QuantCodec(2, rounding="stochastic")
    x = _data((4, 32))
    a, b = _both(lambda: codec.encode(x, generator=torch.Generator().manual_seed(3)).payload)
    assert torch.equal(a, b)


def test_input_requiring_grad():
    x = _data((4, 32)).requires_grad_()
    codec = make_codec("q2")
    a, b = _both(lambda: codec.encode(x).payload)
    assert torch.equal(a, b)


def test_threads_do_not_change_the_bytes():
    x = _data((64, 96))
    codec = make_codec("q3")
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = codec.encode(x).payload
        torch.set_num_threads(max(2, old))
        many = codec.encode(x).payload
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, many)


def test_compile_time_is_recorded():
    make_codec("q2").encode(_data((4, 32)))
    secs = fused.compile_seconds()
    assert "quant_pack" in secs and secs["quant_pack"] >= 0


def test_missing_numba_warns_once_and_falls_back(monkeypatch):
    monkeypatch.setitem(fused._state, "kernels", None)
    monkeypatch.setitem(fused._state, "warned", False)
    import builtins

    real_import = builtins.__import__

    def no_numba(name, *a, **k):
        if name == "aqsgd.compress.kernels._numba" or (a and a[2] and "_numba" in a[2]):
            raise ImportError("No module named 'numba'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_numba)
    monkeypatch.delitem(__import__("sys").modules, "aqsgd.compress.kernels._numba", raising=False)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        codec = make_codec("q2")
        x = _data((4, 32))
        p1 = codec.encode(x)
        codec.encode(x)
    msgs = [str(w.message) for w in rec if "fused codec kernels" in str(w.message)]
    assert len(msgs) == 1 and "numba" in msgs[0]
    assert not fused.available()
    monkeypatch.undo()
    assert fused.available()
    assert torch.equal(p1.payload, codec.encode(x).payload)


def test_the_kernels_really_run(monkeypatch):
    calls = []
    real = fused._call
    monkeypatch.setattr(fused, "_call", lambda name, *a: calls.append(name) or real(name, *a))
    codec = make_codec("q2")
    codec.decode(codec.encode(_data((4, 32))))
    make_codec("q2:l2:token").encode(_data((4, 32)))
    assert calls == ["colmax", "quant_pack", "unpack_dequant", "rowmax", "quant_pack"]
    eager = make_codec("q2", backend="eager")
    eager.decode(eager.encode(_data((4, 32))))
    assert len(calls) == 5


def test_torch_thread_setting_survives_a_kernel_call():
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        make_codec("q2").encode(_data((4, 32)))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(old)
