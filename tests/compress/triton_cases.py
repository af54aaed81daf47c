"""The Triton kernels, run on CPU tensors under Triton's interpreter: every quantizer's packet and decode byte
for byte equal to the numba and eager backends' (on a GPU the same kernels write the same bytes: ``tl.fma``
rounds once, as the CPU does)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined (at their first use)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from aqsgd.compress import kernels, make_codec  # noqa: E402
from aqsgd.compress.kernels import triton as triton_kernels  # noqa: E402

pytestmark = pytest.mark.skipif(not triton_kernels.available("cpu"), reason="Triton's interpreter is not on")

SPECS = ([f"q{b}" for b in range(1, 9)] + [f"q{b}:token" for b in (1, 2, 3, 5, 8)]
         + [f"q{b}:block64" for b in (2, 4, 7)] + ["q2:midrise", "q3:token:midrise", "q2:l2", "q4:token:l2",
                                                    "q4:token:step1.1", "q2:tensor", "q4:scale32", "q1:max",
                                                    "q3:rot64:l2", "q4:rot8", "q2:rot32:channel:midrise"])


def _data(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.rand(shape[-1], generator=g).mul(4).add(0.01)
    x.view(-1)[::37] *= 25  # outliers, so l2 scales clip
    x.view(-1)[3] = 0.0
    return x


def _recording(monkeypatch, *names: str) -> list[str]:
    """The names of these Triton backend operations, appended to the returned list as they are called."""
    calls: list[str] = []
    for name in names:
        real = getattr(triton_kernels.TritonKernels, name)
        monkeypatch.setattr(triton_kernels.TritonKernels, name,
                            lambda self, *a, _real=real, _name=name, **k: (calls.append(_name)
                                                                           or _real(self, *a, **k)))
    return calls


@pytest.mark.parametrize("spec", SPECS)
def test_packets_and_decodes_equal_the_other_backends(spec):
    x = _data((3, 5, 64))
    packets = {b: make_codec(spec, backend=b).encode(x) for b in ("triton", "eager", "numba")}
    assert torch.equal(packets["triton"].payload, packets["eager"].payload)
    assert torch.equal(packets["triton"].payload, packets["numba"].payload)
    decoded = {b: make_codec(spec, backend=b).decode(packets["eager"]) for b in ("triton", "eager", "numba")}
    assert (torch.equal(decoded["triton"], decoded["eager"])
            and torch.equal(decoded["triton"], decoded["numba"]))


@pytest.mark.parametrize("shape", [(1, 8), (17, 24), (40, 136), (3, 300, 16)])
@pytest.mark.parametrize("bits", [1, 3, 6])
def test_ragged_tiles(shape, bits):
    """Rows and groups that do not fill a program's tile (16 rows x 16 groups of 8)."""
    x = _data(shape, seed=bits)
    for spec in (f"q{bits}", f"q{bits}:token"):
        t = make_codec(spec, backend="triton").encode(x)
        assert torch.equal(t.payload, make_codec(spec, backend="eager").encode(x).payload)
        assert torch.equal(make_codec(spec, backend="triton").decode(t),
                           make_codec(spec, backend="eager").decode(t))


@pytest.mark.parametrize("by_col", [True, False])
def test_max_abs_propagates_nan(by_col):
    ops = kernels.for_device("cpu", "triton")
    x = _data((20, 40))
    x[7, 9] = float("nan")
    x[3, 2] = float("-inf")
    got = ops.max_abs(x, by_col)
    want = kernels.for_device("cpu", "eager").max_abs(x, by_col)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


def test_the_kernels_really_run(monkeypatch):
    calls = _recording(monkeypatch, "max_abs", "quantize_pack", "unpack_dequantize")
    codec = make_codec("q2", backend="triton")
    codec.decode(codec.encode(_data((4, 32))))
    assert calls == ["max_abs", "quantize_pack"]  # the decode reads its scales in its one kernel (below)


def test_bf16_and_fp16_inputs():
    for dtype in (torch.bfloat16, torch.float16):
        x = _data((4, 64)).to(dtype)
        t = make_codec("q4", backend="triton").encode(x)
        assert torch.equal(t.payload, make_codec("q4", backend="eager").encode(x).payload)
        assert make_codec("q4", backend="triton").decode(t).dtype == dtype


# -- AQ-SGD's steps against a memory cache -------------------------------------------------------------------
def _aqsgd_steps(spec, storage, backend, *, steps=3, shape=(6, 4, 24), cap=16, seed=0):
    """Packets, receiver outputs and both caches' storage after ``steps`` micro-batches of seen and new rows,
    every codec computing with ``backend``'s kernels."""
    from aqsgd.schemes import Side
    from aqsgd.schemes.cache.memory import MemoryCache
    from aqsgd.schemes.delta import DeltaScheme

    with kernels.defaulting_to(backend):
        snd = DeltaScheme(spec, Side.SENDER, cache=MemoryCache(cap, storage_dtype=storage), seed=3)
        rcv = DeltaScheme(spec, Side.RECEIVER, cache=MemoryCache(cap, storage_dtype=storage), seed=3)
        g = torch.Generator().manual_seed(seed)
        outs, payloads = [], []
        for step in range(steps):
            ids = torch.randperm(cap, generator=g)[: shape[0]]
            x = torch.randn(shape, generator=g) * (1 + step)
            x[:, 0] *= 30
            packets = snd.send(x, ids, phase="train")
            outs.append(rcv.recv(packets, ids, phase="train"))
            payloads.append([p.payload.clone() for p in packets])
        return outs, payloads, snd.cache._rows.clone(), rcv.cache._rows.clone()


@pytest.mark.parametrize("storage", [torch.float16, torch.bfloat16, torch.float32],
                         ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("spec", ["q2", "q4:token", "q3:block8", "q2:l2:midrise", "q8"])
def test_the_aqsgd_steps_equal_the_other_backends(spec, storage, monkeypatch):
    calls = _recording(monkeypatch, "delta_encode_update", "delta_decode_update")
    tri = _aqsgd_steps(spec, storage, "triton")
    assert calls.count("delta_encode_update") >= 2 and calls.count("delta_decode_update") >= 2
    for other in ("eager", "numba"):  # eager: the step-by-step path (get, encode, decode, add, put)
        ref = _aqsgd_steps(spec, storage, other)
        assert all(torch.equal(a, b) for a, b in zip(tri[0], ref[0])), other
        assert all(torch.equal(a, b) for pa, pb in zip(tri[1], ref[1]) for a, b in zip(pa, pb)), other
        assert torch.equal(tri[2].view(torch.int16) if storage != torch.float32 else tri[2],
                           ref[2].view(torch.int16) if storage != torch.float32 else ref[2]), other
        assert torch.equal(tri[3].view(torch.int16) if storage != torch.float32 else tri[3],
                           ref[3].view(torch.int16) if storage != torch.float32 else ref[3]), other


# -- the Hadamard tiles --------------------------------------------------------------------------------------
@pytest.mark.parametrize("tile", [2, 16, 128, 1024])
@pytest.mark.parametrize("inverse", [False, True])
def test_fwht_bit_identical(tile, inverse):
    import math

    from aqsgd.compress import hadamard

    x = _data((max(1, 2048 // tile) + 3, tile), seed=tile)
    x[0, 1] = -0.0
    s, c = hadamard.signs(tile, 7), 1.0 / math.sqrt(tile)
    got = kernels.for_device("cpu", "triton").fwht(x, s, c, inverse).view(torch.int32)
    assert torch.equal(got, kernels.for_device("cpu", "numba").fwht(x, s, c, inverse).view(torch.int32))
    ref = (hadamard._fwht_torch(x, tile).mul_(c).mul_(s) if inverse
           else hadamard._fwht_torch(x * s, tile).mul_(c))
    assert torch.equal(got, ref.view(torch.int32))


def test_rotated_codecs_take_the_hadamard_kernel(monkeypatch):
    calls = []
    real = triton_kernels.TritonKernels.fwht
    monkeypatch.setattr(triton_kernels.TritonKernels, "fwht",
                        lambda self, *a, **k: calls.append(a[3]) or real(self, *a, **k))
    codec = make_codec("q4:rot16", backend="triton")
    x = _data((4, 48))
    y = codec.decode(codec.encode(x))
    assert calls == [False, True]
    assert torch.equal(y, make_codec("q4:rot16", backend="numba").decode(codec.encode(x)))


# -- TopK ----------------------------------------------------------------------------------------------------
def _ties(shape, seed):
    """Data with many equal magnitudes (so ties at the k-th magnitude are common), a -0.0 and a denormal."""
    x = _data(shape, seed=seed)
    x.view(-1)[::3] = x.view(-1)[::3].round()
    x.view(-1)[1] = -0.0
    x.view(-1)[2] = 1e-40
    return x


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 96 values in steps of 32, so that small rows span several programs."""
    monkeypatch.setattr(triton_kernels, "_TOPK_CHUNK", 96)
    monkeypatch.setattr(triton_kernels, "_TOPK_BLOCK", 32)
    monkeypatch.setattr(triton_kernels, "_TOPK_CBLOCK", 2)


@pytest.fixture(params=["11", "8"])
def digit_bits(request, monkeypatch):
    """Both radix layouts: three passes of 11-bit digits and four of 8 (the default)."""
    monkeypatch.setenv("AQSGD_TOPK_DIGIT_BITS", request.param)


@pytest.mark.parametrize("rows,n,k", [(3, 700, 70), (1, 1000, 1), (2, 300, 299), (4, 64, 16)])
def test_topk_selection_equals_the_cpu_rule(rows, n, k, small_chunks, digit_bits):
    from aqsgd.compress.topk import topk_indices

    x = _ties((rows, n), seed=n)
    got = kernels.for_device("cpu", "triton").topk_select(x, k)
    assert torch.equal(got, topk_indices(x, k, ops=kernels.for_device("cpu", "numba")))
    assert torch.equal(got, topk_indices(x, k, ops=kernels.for_device("cpu", "eager")))


@pytest.mark.parametrize("spec", ["topk0.1", "topk0.05+fp32", "topk0.2+bf16", "topk0.1:tensor", "topk0.1+q8",
                                  "topk0.3+q3:token"])
def test_topk_packets_equal_the_other_backends(spec, small_chunks, digit_bits, monkeypatch):
    calls = _recording(monkeypatch, "topk_payload", "topk_select")
    x = _ties((3, 4, 80), seed=1)
    x[1, 2, 5] = -1e4  # beyond bf16's fine steps, within fp16's range
    packets = {b: make_codec(spec, backend=b).encode(x) for b in ("triton", "eager", "numba")}
    assert calls and calls[0] == ("topk_select" if "+q" in spec else "topk_payload")
    assert torch.equal(packets["triton"].payload, packets["eager"].payload)
    assert torch.equal(packets["triton"].payload, packets["numba"].payload)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the interpreter's numpy, at 7e4 -> fp16
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 7e4])
def test_topk_non_finite_values_raise_as_on_the_cpu(bad):
    from aqsgd.errors import NonFiniteError

    x = _data((2, 64))
    x[1, 9] = bad  # 7e4: finite, but Inf in fp16
    for b in ("triton", "eager"):
        with pytest.raises(NonFiniteError):
            make_codec("topk0.25", backend=b).encode(x)


def test_topk_values_beyond_fp16_pass_in_fp32():
    x = _data((2, 64))
    x[1, 9] = 7e4
    got = make_codec("topk0.25+fp32", backend="triton").encode(x).payload
    assert torch.equal(got, make_codec("topk0.25+fp32", backend="eager").encode(x).payload)


# -- stochastic rounding -------------------------------------------------------------------------------------
STOCHASTIC = ["q2:stochastic", "q4:token:stochastic", "q1:stochastic", "q3:block64:stochastic",
              "q2:stochastic:l2:midrise", "q8:stochastic:tensor"]


@pytest.mark.parametrize("spec", STOCHASTIC)
def test_stochastic_rounding_reads_the_general_paths_draw(spec, monkeypatch):
    noises = []
    real = triton_kernels.TritonKernels.quantize_pack
    monkeypatch.setattr(triton_kernels.TritonKernels, "quantize_pack",
                        lambda self, *a, **k: noises.append(k.get("noise")) or real(self, *a, **k))
    x = _data((3, 5, 64), seed=2)
    packets = {}
    for b in ("triton", "eager", "numba"):  # numba: the general path (its kernel takes no noise)
        g = torch.Generator().manual_seed(5)
        packets[b] = make_codec(spec, backend=b).encode(x, generator=g).payload
    assert len(noises) == 1 and noises[0] is not None and noises[0].numel() == x.numel()
    assert torch.equal(packets["triton"], packets["eager"])
    assert torch.equal(packets["triton"], packets["numba"])
    again = make_codec(spec, backend="triton").encode(x, generator=torch.Generator().manual_seed(6)).payload
    assert not torch.equal(again, packets["triton"])  # the noise is read, not ignored


# -- outlier rows --------------------------------------------------------------------------------------------
def test_row_sums_of_squares_agree_to_rounding():
    """The kernel sums in its own order: equal to PyTorch's sum to float rounding (relative error at most the
    row length times fp32's epsilon), not to the bit."""
    x = _data((37, 300), seed=4)
    got = kernels.for_device("cpu", "triton").row_sumsq(x)
    want = x.double().square().sum(dim=1)
    assert torch.all((got.double() - want).abs() <= want * 300 * torch.finfo(torch.float32).eps)
    half = kernels.for_device("cpu", "triton").row_sumsq(x.to(torch.bfloat16))
    assert torch.allclose(half, x.to(torch.bfloat16).float().square().sum(dim=1), rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("loud", [(), (5,), (1, 9, 30), (0, 3, 8, 12, 20, 33, 40)])
def test_outlier_packets_equal_the_other_backends(loud, dtype, monkeypatch):
    """Rows far from the threshold (norms 20x and more against a factor of 4, or plain), so that the
    selection cannot depend on the summation order; up to the cap of 48 // 16 rows, and beyond it."""
    calls = _recording(monkeypatch, "row_sumsq", "split_rows")
    x = torch.randn(3, 16, 40, generator=torch.Generator().manual_seed(len(loud)))
    for i, r in enumerate(loud):
        x.view(48, 40)[r] *= 20 + 10 * i
    x = x.to(dtype)
    for spec in ("q2:outlier4", "fp16:outlier4", "q3:rot8:token:outlier4"):
        packets = {b: make_codec(spec, backend=b).encode(x) for b in ("triton", "eager", "numba")}
        assert torch.equal(packets["triton"].payload, packets["eager"].payload), spec
        assert torch.equal(packets["triton"].payload, packets["numba"].payload), spec
        assert torch.equal(make_codec(spec, backend="triton").decode(packets["triton"]),
                           make_codec(spec, backend="eager").decode(packets["eager"]))
    assert calls.count("row_sumsq") == 3 and calls.count("split_rows") == (3 if loud else 0)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
@pytest.mark.parametrize("bad", [float("nan"), 7e4])
def test_topk_deferred_check_reads_the_kernels_flag(bad):
    """With the checks deferred (as on a GPU) TopK's kernel flag travels with the packet: the encode does not
    raise, the packet's check raises the error the immediate path raises; finite input: the same bytes."""
    from aqsgd.compress.base import deferring_checks
    from aqsgd.errors import NonFiniteError

    codec = make_codec("topk0.25", backend="triton")
    x = _data((2, 64))
    good = codec.encode(x)
    x[1, 9] = bad
    with pytest.raises(NonFiniteError) as immediate:
        codec.encode(x)
    with deferring_checks():
        packet = codec.encode(x)
        fine = codec.encode(_data((2, 64)))
    assert packet.refusal() == str(immediate.value)
    assert fine.refusal() is None and torch.equal(fine.payload, good.payload)


# -- the scales made and read inside the kernels (an encode whose checks are deferred; every decode) ---------
def _edgy(shape, seed=0):
    """Data whose scales take every branch of their storage: beyond fp16 (clamped), rounded up (fp16 rounds
    1.0001 down), subnormal in fp16, zero, and the l2 scales' clipping."""
    x = _data(shape, seed)
    x[..., 0, 1] = 7e4
    x[..., 1, 2] = 1.0001
    x[..., :, 3] = 3e-7
    x[..., :, 4] = 0.0
    x[..., 2, :] = x[..., 2, :] * 1e-6
    return x


_SCALED = ["q4", "q4:token", "q2:l2", "q4:token:l2", "q4:token:step1.1", "q4:scale32", "q3:block64", "q1",
           "q1:max", "q2:midrise", "q3:token:midrise", "q8", "q2:tensor", "q3:rot64:l2", "q8:token",
           "q2:block8", "q5:token:scale32", "q3:block16:midrise", "q2:rot32:token"]


@pytest.mark.filterwarnings("ignore:divide by zero")  # the interpreter computes 1 / (2 * 0), then drops it
@pytest.mark.parametrize("spec", _SCALED)
def test_scales_made_in_the_kernels_write_the_same_bytes(spec, monkeypatch):
    """Checks deferred (as on a GPU): the scales are made, stored and checked by the max kernel (``max``
    scales; by row, in the launch that quantizes too) or one scales kernel (``l2``, ``step``); packets and
    decodes byte for byte the eager backend's with checks made at once, the kernels really called."""
    from aqsgd.compress.base import deferring_checks

    calls = _recording(monkeypatch, "max_scales", "max_quantize_rows", "scales", "unpack_scaled")
    x = _edgy((3, 6, 64))
    want = make_codec(spec, backend="eager").encode(x)
    with deferring_checks(True):
        got = make_codec(spec, backend="triton").encode(x)
    assert torch.equal(got.payload, want.payload), spec
    assert got.refusal() is None
    decoded = make_codec(spec, backend="triton").decode(want)
    assert torch.equal(decoded, make_codec(spec, backend="eager").decode(want)), spec
    codec = make_codec(spec)
    codec = getattr(codec, "inner", codec)  # a rotation's quantizer
    if codec.granularity == "tensor":  # one scale for the tensor: the general path both ways
        assert calls == []
    elif codec.scale_mode == "mean":  # q1's mean |x|: PyTorch's reduction (its order) makes the scales
        assert calls == ["unpack_scaled"]
    elif codec.scale_mode != "max":
        assert calls == ["scales", "unpack_scaled"], calls
    else:
        by_row = codec.granularity != "channel" and codec.rounding == "nearest"
        assert calls == ["max_quantize_rows" if by_row else "max_scales", "unpack_scaled"], calls


@pytest.mark.filterwarnings("ignore:divide by zero")
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("spec", ["q4", "q4:token", "q2:l2", "q4:scale32"])
def test_the_kernels_flag_refuses_what_the_immediate_check_refuses(spec, bad):
    from aqsgd.compress.base import deferring_checks
    from aqsgd.errors import NonFiniteError

    x = _data((2, 3, 64))
    x[1, 2, 9] = bad
    with pytest.raises(NonFiniteError) as immediate:
        make_codec(spec, backend="eager").encode(x)
    with deferring_checks(True):
        packet = make_codec(spec, backend="triton").encode(x)
    assert packet.refusal() == str(immediate.value)


@pytest.mark.filterwarnings("ignore:invalid value")  # the corrupt scale's decode, computed then refused
@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("inf")])
@pytest.mark.parametrize("spec", ["q4", "q4:token", "q4:scale32"])
def test_a_decode_refuses_bad_scales_at_once_or_pending(spec, bad):
    from aqsgd.compress.base import collecting_pending_checks, deferring_checks
    from aqsgd.compress.packet import Packet
    from aqsgd.errors import PacketError

    codec = make_codec(spec, backend="triton")
    packet = make_codec(spec, backend="eager").encode(_data((2, 3, 64)))
    payload = packet.payload.clone()
    dtype = torch.float32 if "scale32" in spec else torch.float16
    payload[2 * dtype.itemsize: 3 * dtype.itemsize].view(dtype)[0] = bad  # the third scale
    corrupt = Packet(packet.family, packet.dtype, packet.shape, packet.fingerprint, payload)
    with pytest.raises(PacketError) as immediate:
        make_codec(spec, backend="eager").decode(corrupt)
    with pytest.raises(PacketError) as err:
        codec.decode(corrupt)
    assert str(err.value) == str(immediate.value)
    with deferring_checks(True), collecting_pending_checks() as pending:
        codec.decode(corrupt)  # no raise here: the flag waits for the collector's reader
    assert str(pending.failure()) == str(immediate.value)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
@pytest.mark.parametrize("wire", ["fp16", "bf16"])
def test_the_cast_kernel_writes_the_same_bytes_and_flags_the_same_inputs(wire, monkeypatch):
    """Checks deferred (as on a GPU): ``fp16``/``bf16`` cast and check in one kernel. Ties to even,
    subnormals, values that overflow the wire dtype: the bytes of PyTorch's cast; non-finite casts refused
    with the immediate check's text."""
    from aqsgd.compress.base import deferring_checks
    from aqsgd.errors import NonFiniteError

    calls = _recording(monkeypatch, "cast_checked")
    x = _data((3, 5, 64))
    tail = x.view(-1)[-8:]
    tail.copy_(torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-8, 3e-8, -1e-40, 6e4, -1e-3]))
    want = make_codec(wire, backend="eager").encode(x)
    with deferring_checks(True):
        got = make_codec(wire, backend="triton").encode(x)
    assert calls and torch.equal(got.payload, want.payload) and got.refusal() is None
    for bad in (float("nan"), float("inf"), 7e4 if wire == "fp16" else 3.4e38):
        y = x.clone()
        y[1, 2, 3] = bad
        with pytest.raises(NonFiniteError) as immediate:
            make_codec(wire, backend="eager").encode(y)
        with deferring_checks(True):
            packet = make_codec(wire, backend="triton").encode(y)
        assert packet.refusal() == str(immediate.value), bad


@pytest.mark.filterwarnings("ignore:divide by zero")
@pytest.mark.parametrize("storage", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("spec", ["q2", "q4:token", "q3:block8", "q2:l2:midrise", "q8", "q1:max"])
def test_the_aqsgd_steps_with_scales_in_the_kernels_equal_the_other_backends(spec, storage, monkeypatch):
    """Checks deferred (as on a GPU): the sender stores, checks and divides its scales in one ``scales``
    launch, the receiver reads them in one ``steps`` launch; packets, outputs and both caches as the eager
    backend's step-by-step path with the checks made at once."""
    from aqsgd.compress.base import collecting_pending_checks, deferring_checks

    calls = _recording(monkeypatch, "scales", "steps")
    with deferring_checks(True), collecting_pending_checks() as pending:
        tri = _aqsgd_steps(spec, storage, "triton")
    assert pending.failure() is None
    assert calls.count("scales") >= 2 and calls.count("steps") >= 2
    ref = _aqsgd_steps(spec, storage, "eager")
    assert all(torch.equal(a, b) for a, b in zip(tri[0], ref[0]))
    assert all(torch.equal(a, b) for pa, pb in zip(tri[1], ref[1]) for a, b in zip(pa, pb))
    for got, want in ((tri[2], ref[2]), (tri[3], ref[3])):
        assert torch.equal(got.view(torch.int16) if storage != torch.float32 else got,
                           want.view(torch.int16) if storage != torch.float32 else want)


# -- rows whose codes end on a byte but whose last group of 8 codes is short (q8 rows of 10 values: TopK's
# kept values, ``topk0.1+q8:token``) ------------------------------------------------------------------------
_SHORT = [((3, 10), ("q8", "q8:token", "q4", "q4:token:l2")), ((2, 5, 18), ("q8:token", "q4:channel")),
          ((4, 12), ("q2:token", "q6:token", "q6:l2")), ((20, 26), ("q8", "q4:token"))]


@pytest.mark.filterwarnings("ignore:divide by zero")
@pytest.mark.parametrize("shape, specs", _SHORT, ids=lambda v: "x".join(map(str, v)) if v and
                         isinstance(v[0], int) else None)
def test_rows_with_a_short_last_group_equal_the_other_backends(shape, specs, monkeypatch):
    from aqsgd.compress.base import deferring_checks

    calls = _recording(monkeypatch, "quantize_pack", "max_quantize_rows", "max_scales", "scales",
                       "unpack_scaled")
    x = _data(shape)
    for spec in specs:
        want = make_codec(spec, backend="eager").encode(x)
        numba = make_codec(spec, backend="numba").encode(x)
        for deferred in (False, True):  # checks made at once (the CPU's way) or in the kernels (a GPU's)
            calls.clear()
            with deferring_checks(deferred):
                got = make_codec(spec, backend="triton").encode(x)
            assert torch.equal(got.payload, want.payload) and torch.equal(got.payload, numba.payload), spec
            assert set(calls) & {"quantize_pack", "max_quantize_rows"}, (spec, deferred, calls)
        calls.clear()
        decoded = make_codec(spec, backend="triton").decode(want)
        assert calls == ["unpack_scaled"], (spec, calls)
        assert torch.equal(decoded, make_codec(spec, backend="eager").decode(want)), spec


@pytest.mark.parametrize("spec", ["q8", "q4:token", "q6:token"])
def test_the_aqsgd_steps_on_short_rows_equal_the_other_backends(spec, monkeypatch):
    calls = _recording(monkeypatch, "delta_encode_update", "delta_decode_update")
    shape = (6, 2, 12)  # rows of 12 values: a full group of 8 codes and a short one
    tri = _aqsgd_steps(spec, torch.float16, "triton", shape=shape)
    assert calls.count("delta_encode_update") >= 2 and calls.count("delta_decode_update") >= 2
    for other in ("eager", "numba"):
        ref = _aqsgd_steps(spec, torch.float16, other, shape=shape)
        assert all(torch.equal(a, b) for a, b in zip(tri[0], ref[0])), other
        assert all(torch.equal(a, b) for pa, pb in zip(tri[1], ref[1]) for a, b in zip(pa, pb)), other
        assert torch.equal(tri[2].view(torch.int16), ref[2].view(torch.int16)), other
        assert torch.equal(tri[3].view(torch.int16), ref[3].view(torch.int16)), other


# -- no operation that waits for the device: what the CUDA tests check with torch's sync debug mode
# (test_deferred_checks.py), checked here by the operations called (the ``device_waits`` fixture, which
# leaves the interpreter's own copies out). Not covered: the outlier rows' encode and the entropy stages (:rc,
# :zstd), which synchronise by design (kernels' docstring), and the code that runs only on a GPU (pinned
# memory).
_WAIT_FREE = ["q4", "q2:token", "q8:block64", "q4:midrise", "q3", "q1", "fp16", "bf16", "q4:rot32",
              "q4:stochastic", "q4:l2", "q2:token:l2", "q8:scale32", "q4:tensor", "topk0.1", "topk0.1+q4",
              "topk0.1+q8:token", "tah", "tah6"]


@pytest.mark.filterwarnings("ignore:divide by zero", "ignore:overflow encountered in cast")
@pytest.mark.parametrize("spec", _WAIT_FREE)
def test_no_operation_that_waits_for_a_gpu_inside_encode_or_decode(spec, round_trip_waits):
    """Checks deferred and collected, as on a GPU: an encode of NaN input, one of good input and the decode
    of its packet call nothing that would make the host wait; the first packet refuses, the decode equals
    the eager backend's of the same packet."""
    fine = _data((4, 6, 32))
    bad = fine.clone()
    bad[2, 3, 7] = float("nan")
    waits, refused, good, y, pending = round_trip_waits(make_codec(spec, backend="triton"), fine, bad)
    assert waits == []
    assert refused.refusal() is not None and good.refusal() is None and pending.failure() is None
    assert torch.equal(y, make_codec(spec, backend="eager").decode(good))


@pytest.mark.filterwarnings("ignore:divide by zero")
@pytest.mark.parametrize("spec", ["q4", "q2:l2", "q4:token"])
def test_no_operation_that_waits_for_a_gpu_inside_the_fused_aqsgd_steps(spec, device_waits):
    """The sender's and the receiver's fused step against a cache's rows (the rows' store made outside, as
    the scheme makes it), NaN input included (into a cache of its own: a refused send stops the run, and
    the cache it wrote into is not used again): nothing waits; both caches end as the eager backend's
    step-by-step path (get, decode, add, put) leaves the receiver's."""
    from aqsgd.compress.base import collecting_pending_checks, deferring_checks
    from aqsgd.schemes.cache.memory import MemoryCache

    codec = make_codec(spec, backend="triton")
    caches = [MemoryCache(8, (6, 32), storage_dtype=torch.float16) for _ in range(4)]
    ids = torch.arange(4)
    for cache in caches:
        cache.put(ids, _data((4, 6, 32), seed=1))
    x = _data((4, 6, 32), seed=2)
    bad = x.clone()
    bad[1, 2, 3] = float("nan")
    stores = [cache.row_store(ids) for cache in caches]
    with deferring_checks(True), device_waits() as waits:
        refused = codec.encode_delta(bad, stores[0])
        packet = codec.encode_delta(x, stores[1])
        with collecting_pending_checks() as pending:
            codec.decode_delta(packet, stores[2])
    assert waits == []
    assert refused.refusal() is not None and packet.refusal() is None and pending.failure() is None
    caches[3].put(ids, caches[3].get(ids) + make_codec(spec, backend="eager").decode(packet))  # step by step
    assert torch.equal(caches[1].get(ids), caches[2].get(ids))
    assert torch.equal(caches[2].get(ids), caches[3].get(ids))


@pytest.mark.parametrize("spec", ["q4:pca16", "q2:token:pca/4", "q3:rot64:l2:pca24"])
def test_subspace_packets_equal_the_other_backends(spec):
    """The subspace stage projects with a matrix product on every backend; its coefficients go through the
    backend's quantizer kernels: the same bytes (the basis estimated and sent by each sender alike)."""
    from aqsgd.schemes import make_scheme

    sent = {}
    for backend in ("triton", "eager", "numba"):
        send = make_scheme("direct", make_codec(spec, backend=backend), "sender")
        packets = send.send(_data((6, 16, 64)), phase="warmup")
        packets += send.send(_data((4, 8, 64), seed=1)) + send.send(_data((2, 8, 64), seed=2))
        sent[backend] = [p.to_bytes() for p in packets]
    assert sent["triton"] == sent["eager"] == sent["numba"]


# -- few long rows: the row max split over the columns (TopK's kept values, ``topk0.1+q8:token``) ------------
def _launched(monkeypatch, name: str) -> list[tuple]:
    """The grids of the Triton kernel ``name``, appended to the returned list as it is launched."""
    grids: list[tuple] = []
    table = triton_kernels._kernels()
    real = table[name]

    class Recorder:
        def __getitem__(self, grid):
            grids.append(tuple(grid))
            return real[grid]

    monkeypatch.setitem(table, name, Recorder())
    return grids


@pytest.mark.filterwarnings("ignore:divide by zero")
@pytest.mark.parametrize("shape", [(3, 300), (2, 3, 1000), (17, 2100)])
@pytest.mark.parametrize("spec", ["q8:token", "q4:token", "q2:token", "q6:token"])
def test_few_long_rows_split_their_max_and_equal_the_other_backends(shape, spec, monkeypatch):
    """Rows too few to fill a GPU (under 64 programs of 16) have their max split over the columns
    (``rowmax_partial`` then ``colmax_finish``) and are quantized by ``quant_pack`` on a 2-D grid: the same
    bytes as the eager and numba backends, checks made at once or in the kernels; a NaN refused either way."""
    from aqsgd.compress.base import deferring_checks

    rows, k = (shape[0] * (shape[1] if len(shape) == 3 else 1), shape[-1])
    assert triton_kernels._col_splits(rows, k)[0] > 1
    grids = _launched(monkeypatch, "rowmax_partial")
    x = _edgy(shape) if len(shape) == 3 else _data(shape)
    want = make_codec(spec, backend="eager").encode(x)
    numba = make_codec(spec, backend="numba").encode(x)
    for deferred in (False, True):
        with deferring_checks(deferred):
            got = make_codec(spec, backend="triton").encode(x)
        assert torch.equal(got.payload, want.payload) and torch.equal(got.payload, numba.payload), spec
        assert got.refusal() is None
    assert grids and all(g[1] > 1 for g in grids), grids  # the split kernel ran, over several column ranges
    bad = x.clone()
    bad.view(-1)[k + 5] = float("nan")
    with pytest.raises(Exception) as immediate:
        make_codec(spec, backend="eager").encode(bad)
    with deferring_checks(True):
        packet = make_codec(spec, backend="triton").encode(bad)
    assert packet.refusal() == str(immediate.value)


def test_many_rows_keep_one_launch_for_max_and_codes():
    """A 4096 x 768 activation (256 programs of rows) is not split: one launch finds the maxima and packs."""
    assert triton_kernels._col_splits(4096, 768) == (1, 768)
    assert triton_kernels._col_splits(80, 39322)[0] > 1


def test_the_split_row_max_propagates_nan():
    ops = kernels.for_device("cpu", "triton")
    x = _data((3, 700))
    x[1, 650] = float("nan")
    x[2, 3] = float("-inf")
    assert triton_kernels._col_splits(3, 700)[0] > 1
    got, want = ops.max_abs(x, False), kernels.for_device("cpu", "eager").max_abs(x, False)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
