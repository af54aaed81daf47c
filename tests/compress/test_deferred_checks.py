"""Deferred checks: with them on (the default on CUDA, forced here on the CPU) a codec does not read its
input's NaN/Inf to the host inside encode; the packet carries a device flag, and reading it raises the
error the immediate check raises. Packets of finite input are the same bytes either way."""

from __future__ import annotations

import pytest
import torch

from aqsgd.compress import make_codec
from aqsgd.compress.base import defers_checks, deferring_checks
from aqsgd.errors import NonFiniteError

SPECS = ["q4", "q2:token", "q3:block16", "q8:scale32", "q4:l2", "q1", "q4:midrise", "fp16", "bf16", "topk0.1",
         "topk0.1+q4", "q4:rot32", "q4:zstd", "q2:token:rc"]


def _bad(value=float("nan"), dtype=torch.float32):
    x = torch.randn(4, 6, 32, generator=torch.Generator().manual_seed(1), dtype=dtype)
    x[2, 3, 7] = value
    return x


@pytest.mark.parametrize("spec", SPECS)
def test_a_deferred_check_raises_what_the_immediate_one_raises(spec):
    codec = make_codec(spec)
    x = _bad()
    with pytest.raises(NonFiniteError) as immediate:
        codec.encode(x)
    assert codec.encode(x.nan_to_num()).check is None  # on the CPU nothing is deferred by default
    with deferring_checks():
        packet = codec.encode(x)  # no error here
        fine = codec.encode(x.nan_to_num())
    assert packet.check is not None and packet.refusal() == str(immediate.value)
    with pytest.raises(NonFiniteError) as later:
        packet.raise_deferred()
    assert str(later.value) == str(immediate.value)
    # tagged by a scheme: the check stays with the packet
    assert packet.with_tag(7, 2).refusal() == str(immediate.value)
    assert fine.refusal() is None
    fine.raise_deferred()
    assert torch.equal(fine.payload, codec.encode(x.nan_to_num()).payload)


@pytest.mark.parametrize("spec,value,what", [("q4:scale32", 1e300, "input (or its fp32 scale)"),
                                             ("fp16", 7e4, "input (or its cast to the wire dtype)"),
                                             ("q4", float("inf"), "input")])
def test_out_of_range_inputs(spec, value, what):
    codec = make_codec(spec)
    x = _bad(value, torch.float64)
    with pytest.raises(NonFiniteError, match=what.replace("(", r"\(").replace(")", r"\)")) as immediate:
        codec.encode(x)
    with deferring_checks():
        assert codec.encode(x).refusal() == str(immediate.value)


def test_fp16_scales_clamped_give_the_same_codes_deferred():
    """Deferred, the general path cannot ask whether a scale was clamped to fp16's range: it always clips,
    which changes no code where nothing was clamped, and gives the immediate path's where something was."""
    codec = make_codec("q4:tensor")
    for x in (torch.randn(3, 16, dtype=torch.float64) * 1e5, torch.randn(3, 16, dtype=torch.float64)):
        with deferring_checks():
            packet = codec.encode(x)
        assert packet.refusal() is None and torch.equal(packet.payload, codec.encode(x).payload)


def test_the_default_defers_on_cuda_only_and_only_inside_an_encode():
    assert not defers_checks(torch.device("cuda"))  # no encode running: nothing would read the flag
    from aqsgd.compress.base import collecting_checks

    with collecting_checks():
        assert defers_checks(torch.device("cuda")) and not defers_checks(torch.device("cpu"))
        with deferring_checks(False):
            assert not defers_checks(torch.device("cuda"))
        with deferring_checks(True):
            assert defers_checks(torch.device("cpu"))


@pytest.mark.parametrize("spec", ["q4", "q2:token:zstd"])
def test_the_fused_aqsgd_step_defers_too(spec):
    from aqsgd.schemes.cache.memory import MemoryCache

    codec = make_codec(spec)
    cache = MemoryCache(8, (6, 32), storage_dtype=torch.float32)
    ids = torch.arange(4)
    cache.put(ids, torch.randn(4, 6, 32))
    x = _bad()
    with pytest.raises(NonFiniteError) as immediate:
        codec.encode_delta(x, cache.row_store(ids))
    with deferring_checks():
        packet = codec.encode_delta(x, cache.row_store(ids))
    assert packet is not None and packet.refusal() == str(immediate.value)


CUDA_SPECS = ["q4", "q2:token", "q8:block64", "q4:midrise", "q3", "fp16", "bf16", "topk0.1"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("spec", CUDA_SPECS)
def test_no_host_synchronisation_inside_an_encode_on_cuda(spec):
    """On a GPU (default backend: Triton) an encode, NaN input included, never waits for the device: torch's
    sync debug mode turns any synchronisation into an error. The packet's check, read after, refuses."""
    codec = make_codec(spec)
    x = _bad().cuda()
    fine = x.nan_to_num()
    codec.encode(fine)  # compile and warm the kernels outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        packet = codec.encode(x)
        good = codec.encode(fine)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert packet.refusal() is not None and good.refusal() is None
    assert torch.equal(good.payload.cpu(), codec.encode(fine.cpu()).payload)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_no_host_synchronisation_inside_the_fused_aqsgd_step_on_cuda():
    from aqsgd.schemes.cache.memory import MemoryCache

    codec = make_codec("q4")
    cache = MemoryCache(8, (6, 32), storage_dtype=torch.float16, device="cuda")
    ids = torch.arange(4, device="cuda")
    cache.put(ids, torch.randn(4, 6, 32, device="cuda"))
    x = _bad().cuda()
    store = cache.row_store(ids)
    assert codec.encode_delta(x.nan_to_num(), store) is not None  # warm
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        packet = codec.encode_delta(x, cache.row_store(ids))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert packet is not None and packet.refusal() is not None
