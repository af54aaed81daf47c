"""Deferred checks: with them on (the default on CUDA, forced here on the CPU) a codec does not read its
input's NaN/Inf to the host inside encode; the packet carries a device flag, and reading it raises the
error the immediate check raises. Packets of finite input are the same bytes either way.

A receiver's checks (a decode's of the received scales and indices, the low-bit cache's of what it stores)
are *pending* where a caller collects them (:func:`collecting_pending_checks`, the pipeline runner's step):
the decode does not raise, the collector's ``raise_failed()`` raises the same error later. Decoded values of
good packets are the same bits either way."""

from __future__ import annotations

import pytest
import torch

from aqsgd.compress import Packet, make_codec
from aqsgd.compress.base import (
    collecting_pending_checks,
    defers_checks,
    defers_pending_checks,
    deferring_checks,
)
from aqsgd.errors import CacheError, CodecError, NonFiniteError, PacketError

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


def test_the_device_waits_fixture_sees_what_would_wait_for_a_gpu(device_waits):
    """The CPU's stand-in for torch's sync debug mode (tests/conftest.py) records a value read to the host and
    the outputs sized by the data, and nothing else."""
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    with device_waits() as waits:
        (x * 2 + 1).abs().amax(dim=0).clamp_(min=1e-3)
        x[torch.tensor([0, 2])]
        x.repeat_interleave(2, dim=0)
        x.view(-1)[:3].sum()
    assert waits == []
    with device_waits() as waits:
        float(x.max())
        bool(x.isnan().any())
        x[x > 0]
        torch.nonzero(x)
        torch.repeat_interleave(torch.tensor([1, 2]))
        torch.unique(x)
    assert waits == ["_local_scalar_dense", "_local_scalar_dense", "index", "nonzero", "repeat_interleave",
                     "_unique2"]


# the same on the CPU by the operations called (the device_waits fixture), for the eager backend: a GPU's
# fallback where Triton is missing (the Triton backend's cases run under Triton's interpreter, in
# triton_cases.py). TopK is left out: on the CPU its selection takes the host's own path.
EAGER_WAIT_FREE = ["q4", "q2:token", "q8:block64", "q4:midrise", "q3", "q1", "fp16", "bf16", "q4:rot32",
                   "q4:stochastic", "q4:l2", "q2:token:l2", "q8:scale32", "q4:tensor", "tah", "tah6"]


@pytest.mark.parametrize("spec", EAGER_WAIT_FREE)
def test_no_operation_that_waits_for_a_gpu_inside_an_eager_encode_or_decode(spec, round_trip_waits):
    x = _bad()
    waits, refused, good, _, pending = round_trip_waits(make_codec(spec, backend="eager"), x.nan_to_num(), x)
    assert waits == []
    assert refused.refusal() is not None and good.refusal() is None and pending.failure() is None


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
    store = cache.row_store(ids)  # (outside the checked region: the cache validates the ids on the host)
    assert codec.encode_delta(x.nan_to_num(), store) is not None  # warm
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        packet = codec.encode_delta(x, store)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert packet is not None and packet.refusal() is not None


# -- a receiver's checks: pending (as on a GPU, forced here on the CPU), read where a caller collects them
NAN16, INF16 = (0x00, 0x7E), (0x00, 0x7C)


def _at(offset, values):
    """A mutation of a payload: ``values`` (bytes) written at ``offset``."""
    def mutate(p):
        p[offset : offset + len(values)] = torch.tensor(values, dtype=torch.uint8)
    return mutate


def _or(offset, mask):
    def mutate(p):
        p[offset] |= mask
    return mutate


def _tah_no_flag_but_a_pivot(p):  # tah of (2, 10, 64): token map at 80 (3 bytes), tile flags at 83 (3 bytes)
    p[83:86] = 0
    p[86] |= 1


def _tah_token_map(p):
    p[80] ^= 0xFF


def _fine():
    return torch.randn(4, 6, 32, generator=torch.Generator().manual_seed(1))


def _loud_row():  # one row 50 times the others: the outlier codecs send it apart (one row of 24)
    x = torch.randn(4, 6, 32, generator=torch.Generator().manual_seed(2))
    x[1, 2] *= 50
    return x


def _tah_input():
    return torch.randn(2, 10, 64, generator=torch.Generator().manual_seed(3))


CORRUPT = {  # name: (spec, input, mutation of its packet's payload): each decode check once
    "q4-nan-scale": ("q4", _fine, _at(0, NAN16)),
    "q4-negative-scale": ("q4", _fine, _or(1, 0x80)),
    "q2:token-inf-scale": ("q2:token", _fine, _at(6, INF16)),
    "q8:scale32-nan-scale": ("q8:scale32", _fine, _at(4, (0x00, 0x00, 0xC0, 0x7F))),
    "q4:midrise-negative-scale": ("q4:midrise", _fine, _or(3, 0x80)),
    "q4:rot32-nan-scale": ("q4:rot32", _fine, _at(2, NAN16)),
    "topk-index-outside-row": ("topk0.1", _fine, _at(160, (250,))),  # 4 x 20 fp16 values, then uint8 indices
    "topk+q4-nan-scale": ("topk0.1+q4", _fine, _at(0, NAN16)),
    "outlier-count-above-cap": ("q4:outlier8", _loud_row, _at(0, (3, 0, 0, 0))),
    "outlier-count-not-the-length": ("q4:outlier8", _loud_row, _at(0, (0, 0, 0, 0))),  # inner size then wrong
    "outlier-index-outside": ("q4:outlier8", _loud_row, _at(4, (30, 0, 0, 0))),
    "outlier-inner-nan-scale": ("q4:outlier8", _loud_row, _at(8 + 64, NAN16)),
    "outlier-fp16-negative-index": ("fp16:outlier8", _loud_row, _at(4, (0, 0, 0, 0x80))),
    "tah-nan-scale": ("tah", _tah_input, _at(40, NAN16)),
    "tah-inf-zero-point": ("tah", _tah_input, _at(0, INF16)),
    "tah-token-map": ("tah", _tah_input, _tah_token_map),
    "tah-pivot-untransformed": ("tah", _tah_input, _tah_no_flag_but_a_pivot),
    "tah6-nan-scale": ("tah6", _tah_input, _at(0, NAN16)),
}


def _with_payload(packet, payload):
    return Packet(packet.family, packet.dtype, packet.shape, packet.fingerprint, payload, packet.tag,
                  packet.kind)


def _corrupt(name):
    spec, make_input, mutate = CORRUPT[name]
    codec = make_codec(spec)
    good = codec.encode(make_input())
    payload = good.payload.clone()
    mutate(payload)
    return codec, good, _with_payload(good, payload)


@pytest.mark.parametrize("name", sorted(CORRUPT))
def test_a_pending_decode_check_raises_what_the_immediate_one_raises(name):
    codec, good, bad = _corrupt(name)
    with pytest.raises(PacketError) as immediate:
        codec.decode(bad)
    with collecting_pending_checks() as pending:  # on the CPU a decode checks at once by default
        with pytest.raises(PacketError) as again:
            codec.decode(bad)
    assert str(again.value) == str(immediate.value) and not pending
    with deferring_checks(), collecting_pending_checks() as pending:
        y = codec.decode(bad)  # no error here, and nothing outside the tensor was touched
    assert y.shape == bad.shape and len(pending)
    with pytest.raises(PacketError) as later:
        pending.raise_failed()
    assert type(later.value) is type(immediate.value) and str(later.value) == str(immediate.value)
    assert pending.failure() is None  # read once
    with deferring_checks(), collecting_pending_checks() as pending:
        fine = codec.decode(good)
    assert len(pending) and pending.failure() is None
    assert torch.equal(fine, codec.decode(good))


def test_without_a_collector_a_decode_checks_at_once_even_deferring():
    codec, _, bad = _corrupt("q4-nan-scale")
    assert not defers_pending_checks(torch.device("cuda"))  # nobody would read the flag
    with deferring_checks(), pytest.raises(PacketError, match="invalid"):
        codec.decode(bad)
    with collecting_pending_checks():
        assert defers_pending_checks(torch.device("cuda")) and not defers_pending_checks(torch.device("cpu"))
        with deferring_checks(False):
            assert not defers_pending_checks(torch.device("cuda"))


def test_an_outlier_payload_of_no_possible_length_raises_at_once_even_deferring():
    codec, good, _ = _corrupt("outlier-index-outside")
    with deferring_checks(), collecting_pending_checks() as pending:
        with pytest.raises(PacketError, match="no outlier count"):
            codec.decode(_with_payload(good, good.payload[:2]))
        with pytest.raises(PacketError, match="payload of"):
            codec.decode(_with_payload(good, good.payload[:-1]))
    assert not pending


def test_outlier_rows_all_apart_decode_alike():
    """A packet whose only row goes apart (one the encoder never makes: it sends no row of a 1-row tensor
    apart, but the format allows it) decodes to that row, checks deferred or not."""
    codec = make_codec("q4:outlier8")
    row = torch.randn(8).to(torch.bfloat16)
    payload = torch.cat([torch.tensor([1, 0, 0, 0, 0, 0, 0, 0], dtype=torch.uint8), row.view(torch.uint8)])
    packet = Packet(codec.family, torch.float32, (1, 8), codec.fingerprint, payload)
    with deferring_checks(), collecting_pending_checks() as pending:
        later = codec.decode(packet)
    assert pending.failure() is None
    assert torch.equal(later, codec.decode(packet)) and torch.equal(later, row.float().view(1, 8))


def test_the_fused_aqsgd_receive_leaves_its_check_pending():
    from aqsgd.schemes.cache.memory import MemoryCache

    codec = make_codec("q4")
    caches = [MemoryCache(8, (6, 32), storage_dtype=torch.float32) for _ in range(2)]
    ids = torch.arange(4)
    for cache in caches:
        cache.put(ids, _fine())
    good = codec.encode(_fine() * 0.1)
    bad = _with_payload(good, good.payload.clone())
    bad.payload[1] |= 0x80
    with pytest.raises(PacketError) as immediate:
        codec.decode_delta(bad, caches[0].row_store(ids))
    with deferring_checks(), collecting_pending_checks() as pending:
        assert codec.decode_delta(bad, caches[0].row_store(ids)) is not None
        fine = codec.decode_delta(good, caches[1].row_store(ids))
    assert str(pending.failure()) == str(immediate.value)
    assert torch.equal(fine, caches[1].get(ids))


@pytest.mark.parametrize("n", [16, 12])  # rows on byte boundaries (the codec's payload), or padded codes
@pytest.mark.parametrize("value", [1e6, float("inf"), float("nan")])
def test_the_lowbit_cache_leaves_its_checks_pending(value, n):
    from aqsgd.compress.quant import quantize_groups
    from aqsgd.schemes.cache.lowbit import LowBitCache

    rows = torch.randn(2, n, generator=torch.Generator().manual_seed(4))
    bad = rows.clone()
    bad[1, 3] = value
    ids = torch.arange(2)
    with pytest.raises(CacheError, match="cannot quantize rows") as immediate:
        LowBitCache(4, (n,), bits=4, block=n).put(ids, bad)
    with pytest.raises(CodecError) as direct:
        quantize_groups(bad, 4)
    cache = LowBitCache(4, (n,), bits=4, block=n)
    with deferring_checks(), collecting_pending_checks() as pending:
        cache.put(ids, bad)
        out = quantize_groups(bad, 4)
    assert len(out) == 2
    first = pending.failure()  # the cache's (wrapped) error; the direct call's follows it
    assert type(first) is CacheError and str(first) == str(immediate.value)
    with deferring_checks(), collecting_pending_checks() as pending:
        quantize_groups(bad, 4)
    error = pending.failure()
    assert type(error) is type(direct.value) and str(error) == str(direct.value)
    # good rows: nothing fails, the same codes and scales
    with deferring_checks(), collecting_pending_checks() as pending:
        stored = cache.put(ids, rows)
        later = quantize_groups(rows, 4)
    assert pending.failure() is None
    assert torch.equal(stored, LowBitCache(4, (n,), bits=4, block=n).put(ids, rows))
    assert all(torch.equal(a, b) for a, b in zip(later, quantize_groups(rows, 4)))


def _cuda_packet(packet):
    return _with_payload(packet, packet.payload.cuda())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", sorted(CORRUPT))
def test_no_host_synchronisation_inside_a_decode_on_cuda(name):
    """On a GPU, inside a collector (the pipeline runner's), a decode of a corrupt packet and of a good one
    never waits for the device; the collector then raises what the CPU's immediate check raises."""
    codec, good, bad = _corrupt(name)
    with pytest.raises(PacketError) as immediate:
        codec.decode(bad)
    good_d, bad_d = _cuda_packet(good), _cuda_packet(bad)
    with collecting_pending_checks():
        codec.decode(good_d)  # compile and warm the kernels (and the rotation's signs) outside the region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with collecting_pending_checks() as pending:
            codec.decode(bad_d)
            fine = codec.decode(good_d)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    error = pending.failure()
    assert type(error) is type(immediate.value) and str(error) == str(immediate.value)
    torch.testing.assert_close(fine.cpu(), codec.decode(good))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("spec", ["q4:rot32", "q4:stochastic", "q4:l2", "q8:scale32", "topk0.1+q4", "tah",
                                  "tah6"])
def test_no_host_synchronisation_inside_encode_and_decode_on_cuda(spec):
    """Encode (NaN input included) and decode on a GPU, the decode's checks collected: no synchronisation; the
    NaN input's packet refuses, the good one decodes close to the CPU's round trip."""
    codec = make_codec(spec)
    x = _bad().cuda()
    fine = x.nan_to_num()
    with collecting_pending_checks():
        codec.decode(codec.encode(fine))  # warm
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        refused = codec.encode(x)
        good = codec.encode(fine)
        with collecting_pending_checks() as pending:
            y = codec.decode(good)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert refused.refusal() is not None and good.refusal() is None and pending.failure() is None
    host = fine.cpu()
    cpu = codec.decode(codec.encode(host))
    assert (y.cpu() - host).norm() <= 1.5 * (cpu - host).norm() + 1e-6 * host.norm()  # (other noise)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("n", [16, 12])
def test_no_host_synchronisation_inside_quantize_groups_on_cuda(n):
    from aqsgd.compress.quant import quantize_groups

    rows = torch.randn(6, n, device="cuda")
    bad = rows.clone()
    bad[1, 3] = float("nan")
    quantize_groups(rows, 4)  # warm
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with collecting_pending_checks() as pending:
            quantize_groups(bad, 4)
            packed, scales = quantize_groups(rows, 4)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert isinstance(pending.failure(), NonFiniteError)
    ref = quantize_groups(rows.cpu(), 4)
    assert torch.equal(scales.cpu(), ref[1])


def _aqsgd_boundary(spec, storage, device):
    from aqsgd.schemes import Side
    from aqsgd.schemes.cache.memory import MemoryCache
    from aqsgd.schemes.delta import DeltaScheme

    return [DeltaScheme(spec, side, cache=MemoryCache(16, storage_dtype=storage, device=device), seed=3,
                        device=device) for side in (Side.SENDER, Side.RECEIVER)]


def _crossing(snd, rcv, x, ids):
    """One training micro-batch across the boundary, the receiver's checks collected as the runner does."""
    packets = snd.send(x, ids, phase="train")
    with collecting_pending_checks() as pending:
        out = rcv.recv(packets, ids, phase="train")
    return packets, out, pending


@pytest.mark.parametrize("storage", [torch.float32, torch.float16], ids=["fp32-rows", "fp16-rows"])
@pytest.mark.parametrize("spec", ["q4", "q2:l2"])
def test_an_aqsgd_boundary_crosses_without_waiting_for_the_device(device, spec, storage):
    """Sender and receiver of an AQ-SGD boundary on ``device`` with sample ids from the CPU (as the data
    loader gives them): a micro-batch of new and seen rows, then one of seen rows only. On a GPU neither side
    waits for the device (the ids go over through pinned memory; the checks are device flags); everywhere the
    two caches end equal and the output is what the CPU computes."""
    dev = device  # the suite's device fixture: cpu, and cuda where there is one
    snd, rcv = _aqsgd_boundary(spec, storage, dev)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(4, 8, 64, generator=g).to(dev) for _ in range(4)]
    batches = [torch.tensor([0, 1, 2, 3]), torch.tensor([2, 3, 4, 5]), torch.tensor([6, 7, 0, 1]),
               torch.tensor([0, 1, 2, 3])]
    for x, ids in zip(xs[:2], batches[:2]):  # warm: first visits, then new and seen (kernels compile)
        _crossing(snd, rcv, x, ids)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        crossed = [_crossing(snd, rcv, x, ids) for x, ids in zip(xs[2:], batches[2:])]
    finally:
        if dev.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    assert all(p.refusal() is None for packets, _, _ in crossed for p in packets)
    assert all(pending.failure() is None for _, _, pending in crossed)
    assert torch.equal(snd.cache._rows, rcv.cache._rows)
    cpu_snd, cpu_rcv = _aqsgd_boundary(spec, storage, torch.device("cpu"))
    for x, ids in zip(xs, batches):
        _, want, _ = _crossing(cpu_snd, cpu_rcv, x.cpu(), ids)
    assert torch.equal(crossed[-1][1].cpu(), want)
