"""AQ-SGD's fused step against an in-memory cache (``encode_delta``/``decode_delta``) against the step-by-step
path (get, subtract, encode, decode, add, put): the same packets, outputs and cache rows, bit for bit."""

import numpy as np
import pytest
import torch

from aqsgd.compress import kernels
from aqsgd.compress.kernels import numba as fused
from aqsgd.compress.quant import QuantCodec
from aqsgd.errors import CacheError, NonFiniteError, PacketError, PacketMismatchError
from aqsgd.schemes import Side
from aqsgd.schemes.cache.lowbit import LowBitCache
from aqsgd.schemes.cache.memory import MemoryCache
from aqsgd.schemes.delta import DeltaScheme

pytestmark = pytest.mark.skipif(not fused.available(), reason="numba is not installed")

STORAGE = [torch.float16, torch.bfloat16, torch.float32]


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _steps(spec, storage, *, fused_on, steps=4, shape=(6, 16, 24), cap=20, seed=0):
    """Packets, receiver outputs and both caches' storage after ``steps`` train micro-batches whose ids mix
    seen and unseen samples (so the DELTA and RAW packets of one micro-batch both occur)."""
    with kernels.defaulting_to("numba" if fused_on else "eager"):
        snd = DeltaScheme(spec, Side.SENDER, cache=MemoryCache(cap, storage_dtype=storage), seed=3)
        rcv = DeltaScheme(spec, Side.RECEIVER, cache=MemoryCache(cap, storage_dtype=storage), seed=3)
        g = torch.Generator().manual_seed(seed)
        outs, payloads = [], []
        for step in range(steps):
            ids = torch.randperm(cap, generator=g)[: shape[0]]
            x = torch.randn(shape, generator=g) * (1 + step)
            x[:, 0] *= 50  # a sink-like token sets the channel scales
            packets = snd.send(x, ids, phase="train")
            outs.append(rcv.recv(packets, ids, phase="train"))
            payloads.append([p.payload.clone() for p in packets])
        return outs, payloads, _raw(snd.cache._rows.clone()), _raw(rcv.cache._rows.clone())


@pytest.fixture
def fused_calls(monkeypatch):
    """How many sender and receiver steps took the fused path."""
    calls = {"send": 0, "recv": 0}
    enc, dec = QuantCodec.encode_delta, QuantCodec.decode_delta

    def counting_enc(self, x, store):
        out = enc(self, x, store)
        calls["send"] += out is not None
        return out

    def counting_dec(self, packet, store):
        out = dec(self, packet, store)
        calls["recv"] += out is not None
        return out

    monkeypatch.setattr(QuantCodec, "encode_delta", counting_enc)
    monkeypatch.setattr(QuantCodec, "decode_delta", counting_dec)
    return calls


@pytest.mark.parametrize("storage", STORAGE, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("spec", ["q2", "q1", "q3", "q4", "q8", "q2:token", "q4:block8", "q2:tensor",
                                  "q2:l2:midrise", "q5:token:l2", "q1:max", "q2:scale32", "q2:zstd",
                                  "q4:token:step1", "q4:step1.1:rc"])
def test_fused_step_is_bit_identical_to_the_step_by_step_path(spec, storage, fused_calls):
    a = _steps(spec, storage, fused_on=True)
    assert fused_calls["send"] >= 3 and fused_calls["recv"] >= 3  # steps 2..4 all have seen rows
    b = _steps(spec, storage, fused_on=False)
    for ya, yb in zip(a[0], b[0]):
        assert torch.equal(ya, yb)
    for pa, pb in zip(a[1], b[1]):
        assert len(pa) == len(pb) and all(torch.equal(u, v) for u, v in zip(pa, pb))
    assert torch.equal(a[2], b[2]) and torch.equal(a[3], b[3])
    assert torch.equal(a[2], a[3])  # and the two sides agree


@pytest.mark.parametrize("spec, fused_receiver", [("q2:rot64", False), ("q2:outlier4", False),
                                                   ("q2:stochastic", True)])
def test_codecs_without_a_fused_step_take_the_step_by_step_path(spec, fused_receiver, fused_calls):
    """Rotation and outlier rows have no fused step; stochastic rounding has none at the sender, while its
    receiver (decoding is deterministic) does: the sides still agree bit for bit."""
    a = _steps(spec, torch.float16, fused_on=True)
    assert fused_calls["send"] == 0
    assert (fused_calls["recv"] > 0) == fused_receiver
    assert torch.equal(a[2], a[3])


def test_a_wrapped_codec_without_a_fused_step_is_not_decompressed_twice(monkeypatch):
    """``zstd`` over a rotated codec: the receiver's fused attempt declines before decompressing."""
    from aqsgd.compress.wrappers import EntropyCodec

    calls = []
    inner = EntropyCodec._inner
    monkeypatch.setattr(EntropyCodec, "_inner", lambda self, p: calls.append(1) or inner(self, p))
    a = _steps("q2:rot64:zstd", torch.float16, fused_on=True, steps=2)
    assert torch.equal(a[2], a[3])
    # step 2's DELTA packet, decompressed once by each side (the sender decodes it to update its own rows);
    # step 1 sends every row in full
    assert len(calls) == 2


def test_caches_without_in_place_rows_take_the_step_by_step_path():
    ids = torch.tensor([1, 3])
    lowbit = LowBitCache(8, bits=4)
    lowbit.put(ids, torch.randn(2, 4, 8))
    assert lowbit.row_store(ids) is None
    bf16_compute = MemoryCache(8, dtype=torch.bfloat16)
    bf16_compute.put(ids, torch.randn(2, 4, 8))
    assert bf16_compute.row_store(ids) is None  # the kernels compute in fp32 only
    memory = MemoryCache(8)
    memory.put(ids, torch.randn(2, 4, 8))
    store = memory.row_store(ids)
    assert store is not None
    # the eager kernels have no fused step: the codec declines, and the scheme goes step by step
    x = torch.randn(2, 4, 8)
    assert QuantCodec(2, backend="eager").encode_delta(x, store) is None
    assert QuantCodec(2).encode_delta(x, store) is not None


def test_row_store_validates_ids_as_get_does():
    cache = MemoryCache(8)
    cache.put(torch.tensor([0, 1]), torch.randn(2, 4, 8))
    with pytest.raises(CacheError, match="have not been put"):
        cache.row_store(torch.tensor([1, 2]))
    with pytest.raises(CacheError, match="out of range"):
        cache.row_store(torch.tensor([9]))
    with pytest.raises(CacheError, match="more than once"):
        cache.row_store(torch.tensor([1, 1]))


def _pair(spec="q2"):
    snd = DeltaScheme(spec, Side.SENDER, cache=MemoryCache(8), seed=0)
    rcv = DeltaScheme(spec, Side.RECEIVER, cache=MemoryCache(8), seed=0)
    ids = torch.tensor([4, 2])
    x = torch.randn(2, 8, 16)
    rcv.recv(snd.send(x, ids, phase="warmup"), ids, phase="warmup")
    return snd, rcv, ids, x


def test_non_finite_input_raises_and_leaves_the_cache_as_it_was():
    snd, _, ids, x = _pair()
    before = snd.cache._rows.clone()
    x[1, 3, 5] = float("nan")
    with pytest.raises(NonFiniteError):
        snd.send(x, ids, phase="train")
    assert torch.equal(_raw(snd.cache._rows), _raw(before))


def test_corrupt_scales_raise_and_leave_the_receivers_cache_as_it_was():
    snd, rcv, ids, x = _pair()
    [packet] = snd.send(x + 0.1, ids, phase="train")
    packet.payload[:2] = torch.tensor([0x00, 0xFC], dtype=torch.uint8)  # fp16 -inf as the first scale
    before = rcv.cache._rows.clone()
    with pytest.raises(PacketError, match="invalid"):
        rcv.recv([packet], ids, phase="train")
    assert torch.equal(_raw(rcv.cache._rows), _raw(before))


def test_a_packet_of_another_codec_is_refused():
    snd, _, ids, x = _pair("q4")
    _, rcv, _, _ = _pair("q2")
    with pytest.raises(PacketMismatchError, match="another codec"):
        rcv.recv(snd.send(x + 0.1, ids, phase="train"), ids, phase="train")


@pytest.mark.parametrize("storage", [torch.float16, torch.bfloat16])
def test_storage_rounding_matches_torch(storage):
    """The kernels round m + delta to fp16 / bf16 as ``tensor.to(dtype)`` does: every finite fp32 bit pattern
    class (normals, subnormals, values that overflow to inf, ties) over a million random patterns."""
    rng = np.random.default_rng(0)
    v = rng.integers(0, 2**32, size=1_000_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = np.array([65504, 65519.99, 65520, 65536, 2**-24, 2**-25, 3 * 2**-26, 2**-14, -0.0, 0.0, np.inf,
                      -np.inf, 3.3895314e38, 1.0 + 2**-8, 1.0 + 3 * 2**-8], np.float32)
    v = np.concatenate([v[np.isfinite(v)], edges, rng.standard_normal(100_000).astype(np.float32)])
    rows = torch.zeros(1, v.size, dtype=storage)
    store = kernels.RowStore.of(rows, torch.tensor([0]))
    fused.round_to_storage(v, store)
    assert torch.equal(_raw(rows[0]), _raw(torch.from_numpy(v).to(storage)))
