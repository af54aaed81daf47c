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
