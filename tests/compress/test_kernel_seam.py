"""The kernel seam: backends chosen by the tensor's device, or named by a codec; an operation a backend lacks
is None, and the codec then takes its general path with the same bytes."""

from __future__ import annotations

import pytest
import torch

from aqsgd.compress import kernels, make_codec
from aqsgd.compress.kernels import numba as numba_kernels
from aqsgd.errors import SpecError


def test_the_cpu_default_is_numba_where_installed():
    want = "numba" if numba_kernels.available() else "eager"
    assert kernels.for_device("cpu").name == want
    assert kernels.for_tensor(torch.zeros(2)).name == want
    assert kernels.for_device("cpu", "eager").name == "eager"


def test_a_backend_that_cannot_run_here_is_refused():
    with pytest.raises(ValueError, match="unknown kernel backend 'fast'"):
        kernels.for_device("cpu", "fast")
    with pytest.raises(ValueError, match="the numba kernels do not run on cuda"):
        kernels.for_device("cuda", "numba")
    with pytest.raises(SpecError, match="unknown kernel backend 'fast'"):
        make_codec("q2", backend="fast")


def test_using_copies_the_codec_tree_and_keeps_the_cached_one():
    plain = make_codec("q2:rot64:zstd")
    eager = make_codec("q2:rot64:zstd", backend="eager")
    assert plain.backend is None and eager.backend == "eager"
    assert eager.inner.backend == "eager" and eager.inner.inner.backend == "eager"  # zstd(rot(q2))
    assert plain.inner.inner.backend is None and make_codec("q2:rot64:zstd") is plain
    assert eager == plain and eager.spec == plain.spec  # the backend is not part of the spec
    topk = make_codec("topk0.1+q8", backend="eager")
    assert topk.values.backend == "eager"


def test_a_missing_operation_falls_back_to_the_general_path():
    """The base class has no kernels: every codec's bytes are still the eager backend's."""

    class Nothing(kernels.Kernels):
        name = "nothing"

    x = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(1))
    ops = Nothing(torch.device("cpu"))
    codec = make_codec("q3:token")
    assert codec._encode_planned(ops, x, kernels.plan(x.shape, "token", 0, 3)) is None
    assert ops.unpack_dequantize(torch.zeros(2, 3, dtype=torch.uint8), torch.ones(2), False, 3, 1, 3) is None
    assert torch.equal(codec.encode(x).payload, make_codec("q3:token", backend="eager").encode(x).payload)


def test_defaulting_to_is_scoped():
    before = kernels.for_device("cpu").name
    with kernels.defaulting_to("eager"):
        assert kernels.for_device("cpu").name == "eager"
    assert kernels.for_device("cpu").name == before
    with pytest.raises(ValueError, match="unknown kernel backend"):
        with kernels.defaulting_to("fast"):
            pass


def test_row_store_holds_the_cache_storage_as_torch_tensors():
    rows = torch.zeros(5, 2, 8, dtype=torch.float16)
    store = kernels.RowStore.of(rows, torch.tensor([3, 1]))
    assert store.data.shape == (5, 16) and store.data.data_ptr() == rows.data_ptr()
    assert store.ids.dtype == torch.int64 and store.device == rows.device and store.fmt == 1
    assert kernels.RowStore.of(torch.zeros(3, 4, dtype=torch.int32), torch.tensor([0])) is None
    assert kernels.RowStore.of(torch.zeros(4, 3).t(), torch.tensor([0])) is None  # not contiguous


@pytest.mark.parametrize("spec", ["q2:stochastic", "q3:token:stochastic", "q1:block16:stochastic"])
def test_stochastic_rounding_through_a_kernel_reads_the_general_paths_draw(spec):
    """The eager backend's quantize_pack takes the noise (as Triton's does); the numba backend leaves
    stochastic rounding to the general path. Same generator, same bytes; a generator on another device is
    refused."""
    from aqsgd.errors import CodecError

    x = torch.randn(4, 3, 32, generator=torch.Generator().manual_seed(1))
    assert kernels.for_device("cpu", "eager").quantizes(torch.float32, "stochastic")
    assert not kernels.Kernels(torch.device("cpu")).quantizes(torch.float32, "stochastic")
    got = make_codec(spec, backend="eager").encode(x, generator=torch.Generator().manual_seed(3)).payload
    ref = make_codec(spec).quantize(x, torch.Generator().manual_seed(3))
    want = make_codec(spec).encode(x, generator=torch.Generator().manual_seed(3)).payload
    assert torch.equal(got, want) and torch.equal(got[: ref[0].numel() * 2], ref[0].view(torch.uint8))
    if torch.cuda.is_available():
        with pytest.raises(CodecError, match="needs a generator on that device"):
            make_codec(spec, backend="eager").encode(x, generator=torch.Generator("cuda"))


class _Recording(kernels.Kernels):
    """A backend of the test's own: the eager kernels' quantizer, each call recorded."""

    name = "recording"
    calls: list[str] = []

    def max_abs(self, x2, by_col):
        self.calls.append("max_abs")
        return kernels.for_device(self.device, "eager").max_abs(x2, by_col)

    def quantize_pack(self, x2, inv, by_col, offset, bits, qmax, out=None, noise=None):
        self.calls.append("quantize_pack")
        eager = kernels.for_device(self.device, "eager")
        return eager.quantize_pack(x2, inv, by_col, offset, bits, qmax, out, noise)


@pytest.fixture
def recording():
    """The recording backend registered for the CPU, unregistered after the test."""
    _Recording.calls = []
    kernels.register_backend("recording", _Recording, runs_on=lambda device: device.type == "cpu")
    try:
        yield _Recording
    finally:
        kernels.unregister_backend("recording")


def test_a_backend_defined_outside_the_library_registers_and_serves_a_codec(recording):
    x = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(2))
    assert "recording" in kernels.backends() and kernels.available("recording", "cpu")
    assert not kernels.available("recording", "meta")
    got = make_codec("q3:token", backend="recording").encode(x)
    assert recording.calls == ["max_abs", "quantize_pack"]
    assert torch.equal(got.payload, make_codec("q3:token", backend="eager").encode(x).payload)
    assert kernels.for_device("cpu").name != "recording"  # not registered as a default


def test_a_registered_default_serves_codecs_that_name_no_backend(recording):
    kernels.register_backend("recording", _Recording, runs_on=lambda device: device.type == "cpu",
                             default_on=("cpu",), rank=1000)
    assert kernels.for_device("cpu").name == "recording"
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    make_codec("q4").encode(x)
    assert recording.calls == ["max_abs", "quantize_pack"]
    assert kernels.for_device("cuda" if torch.cuda.is_available() else "meta").name != "recording"


def test_an_unregistered_backend_is_refused_again():
    kernels.register_backend("recording", _Recording, runs_on=lambda device: True)
    kernels.unregister_backend("recording")
    assert "recording" not in kernels.backends()
    with pytest.raises(SpecError, match="unknown kernel backend 'recording'; valid: eager, numba, triton"):
        make_codec("q2", backend="recording")
    with pytest.raises(ValueError, match="unknown kernel backend 'recording'"):
        make_codec("topk0.1").using("recording")


@pytest.mark.skipif(not numba_kernels.available(), reason="numba is not installed")
@pytest.mark.slow
def test_topk_and_rans_fast_paths_are_kernel_operations():
    """TopK's one-pass payload and the rANS coder are reached through the seam: a backend that has them
    (here the numba backend's, recorded) serves them to the codecs."""

    calls = []

    class Spying(numba_kernels.NumbaKernels):
        name = "spying"

        def topk_encode(self, *args, **kwargs):
            calls.append("topk_encode")
            return super().topk_encode(*args, **kwargs)

        def rans_encode(self, *args, **kwargs):
            calls.append("rans_encode")
            return super().rans_encode(*args, **kwargs)

    kernels.register_backend("spying", Spying, runs_on=lambda device: device.type == "cpu",
                             default_on=("cpu",), rank=1000)
    try:
        x = torch.randn(2, 70000, generator=torch.Generator().manual_seed(4))
        assert make_codec("topk0.1").roundtrip(x).shape == x.shape
        assert kernels.for_operation("rans_encode", "cpu").name == "spying"
        make_codec("q4:rc").encode(x)
    finally:
        kernels.unregister_backend("spying")
    assert calls == ["topk_encode", "rans_encode"]
    assert kernels.for_operation("rans_encode", "cpu").name == "numba"
    with kernels.defaulting_to("eager"):  # the coder has no general path: found whatever the default
        assert kernels.for_operation("rans_encode", "cpu").name == "numba"
    assert kernels.for_operation("no_such_operation", "cpu") is None


def test_only_the_seam_knows_device_types():
    """Codecs ask the seam where a tensor lives (host memory, a device whose reads wait) instead of testing
    the device's type themselves."""
    import pathlib

    import aqsgd.compress as compress

    root = pathlib.Path(compress.__file__).parent
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if "kernels" not in p.relative_to(root).parts
                 and ('.type == "' in p.read_text() or '.type != "' in p.read_text())]
    assert offenders == []
    assert kernels.on_host("cpu") and not kernels.on_host("meta")
    assert not kernels.host_reads_wait("cpu")
