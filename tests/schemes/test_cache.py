"""Tests for aqsgd.schemes.cache: every rule on every backend, plus DiskCache specifics."""

from __future__ import annotations

import json
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from aqsgd.schemes.cache import ActivationCache, CacheError, DiskCache, LowBitCache, MemoryCache

BACKENDS = ("memory", "disk", "lowbit")
ROW = (4, 8)
CAP = 32

Factory = Callable[..., ActivationCache]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a float tensor, so comparisons are bit-exact (-0.0 != 0.0, NaN == NaN)."""
    int_dtype = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(int_dtype)


def assert_bit_identical(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
    assert torch.equal(_bits(a), _bits(b))


def _tolerance(cache: ActivationCache, rows: torch.Tensor) -> float:
    """Largest error the stored representation may introduce for ``rows``."""
    if isinstance(cache, LowBitCache):
        levels = max(2 ** (cache.bits - 1) - 1, 1)
        return float(rows.abs().max()) * 1.001 / levels  # per-block scale <= global max
    if isinstance(cache, (MemoryCache, DiskCache)) and cache.storage_dtype != torch.float32:
        return float(rows.abs().max()) * 2.0**-7
    return 1e-6


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def make(backend: str, tmp_path: Path) -> Iterator[Factory]:
    """Factory for a cache of the parametrized backend; disk caches get their own file and are closed."""
    created: list[DiskCache] = []
    counter = iter(range(10_000))

    def factory(capacity: int = CAP, row_shape: tuple[int, ...] | None = ROW, **kw: Any) -> ActivationCache:
        if backend == "memory":
            return MemoryCache(capacity, row_shape, **kw)
        if backend == "lowbit":
            return LowBitCache(capacity, row_shape, **kw)
        cache = DiskCache(tmp_path / f"rows{next(counter)}.bin", capacity, row_shape, **kw)
        created.append(cache)
        return cache

    yield factory
    for cache in created:
        cache.close()


def ids_of(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


# ---------------------------------------------------------------------- basic contract


def test_put_returns_what_get_returns(make: Factory) -> None:
    cache = make()
    ids = ids_of(5, 0, 31, 7)
    rows = torch.randn(4, *ROW)
    out = cache.put(ids, rows)
    assert out.dtype == torch.float32 and out.shape == (4, *ROW)
    assert_bit_identical(out, cache.get(ids))
    assert (out - rows).abs().max() <= _tolerance(cache, rows)
    # A different order / subset gives the matching rows, bit for bit.
    assert_bit_identical(cache.get(ids_of(31, 5)), out[[2, 0]])


def test_latest_put_wins(make: Factory) -> None:
    cache = make()
    cache.put(ids_of(1, 2), torch.randn(2, *ROW))
    second = cache.put(ids_of(2, 3), torch.randn(2, *ROW) * 3)
    got = cache.get(ids_of(2, 3))
    assert_bit_identical(got, second)


def test_visited(make: Factory) -> None:
    cache = make()
    assert not cache.visited(torch.arange(CAP)).any()
    cache.put(ids_of(3, 9), torch.randn(2, *ROW))
    vis = cache.visited(ids_of(9, 4, 3))
    assert vis.dtype == torch.bool and vis.tolist() == [True, False, True]
    assert cache.visited(ids_of()).shape == (0,)


def test_get_unvisited_raises_naming_id(make: Factory) -> None:
    cache = make()
    cache.put(ids_of(1), torch.randn(1, *ROW))
    with pytest.raises(CacheError, match=r"\b17\b"):
        cache.get(ids_of(1, 17))


@pytest.mark.parametrize("bad", [-1, CAP, CAP + 5])
@pytest.mark.parametrize("op", ["get", "put", "visited", "prefetch"])
def test_out_of_range_ids_raise(make: Factory, bad: int, op: str) -> None:
    cache = make()
    cache.put(ids_of(0), torch.ones(1, *ROW))
    before = cache.get(ids_of(0))
    ids = ids_of(0, bad)
    with pytest.raises(CacheError) as info:
        if op == "put":
            cache.put(ids, torch.zeros(2, *ROW))
        else:
            getattr(cache, op)(ids)
    message = str(info.value)
    assert re.search(rf"(?<![\d-]){bad}\b", message) and str(CAP) in message
    # Nothing was written, not even the valid id of the rejected call; nothing wrapped around.
    assert_bit_identical(cache.get(ids_of(0)), before)
    assert cache.visited(torch.arange(CAP)).sum() == 1


@pytest.mark.parametrize("op", ["get", "put", "visited", "prefetch"])
def test_duplicate_ids_raise(make: Factory, op: str) -> None:
    cache = make()
    cache.put(ids_of(2, 6), torch.randn(2, *ROW))
    ids = ids_of(2, 6, 2)
    with pytest.raises(CacheError, match=r"\b2\b.*more than once"):
        if op == "put":
            cache.put(ids, torch.zeros(3, *ROW))
        else:
            getattr(cache, op)(ids)


@pytest.mark.parametrize(
    "ids", [torch.tensor([[1, 2]]), torch.tensor([1.0, 2.0]), torch.tensor([True, False]), [1, 2]]
)
def test_bad_ids_type_raises(make: Factory, ids: Any) -> None:
    cache = make()
    with pytest.raises(CacheError):
        cache.visited(ids)


@pytest.mark.parametrize("shape", [(2, 4, 9), (3, *ROW), (2, 32), (2, *ROW, 1)])
def test_wrong_row_shape_raises_naming_both(make: Factory, shape: tuple[int, ...]) -> None:
    cache = make()
    with pytest.raises(CacheError) as info:
        cache.put(ids_of(1, 2), torch.zeros(shape))
    message = str(info.value)
    assert str(tuple(shape)) in message and str((2, *ROW)) in message
    assert not cache.visited(ids_of(1, 2)).any()


def test_non_float_rows_raise(make: Factory) -> None:
    cache = make()
    with pytest.raises(CacheError, match="floating"):
        cache.put(ids_of(1), torch.zeros(1, *ROW, dtype=torch.int32))


def test_empty_ids(make: Factory) -> None:
    cache = make()
    empty = ids_of()
    out = cache.put(empty, torch.zeros(0, *ROW))
    assert out.shape == (0, *ROW) and out.dtype == torch.float32
    got = cache.get(empty)
    assert got.shape == (0, *ROW) and got.dtype == torch.float32
    cache.prefetch(empty)
    assert not cache.visited(torch.arange(CAP)).any()


def test_check_capacity(make: Factory) -> None:
    cache = make(capacity=10)
    cache.check_capacity(10)
    cache.check_capacity(3)
    with pytest.raises(CacheError, match=r"11 samples.*at least 11"):
        cache.check_capacity(11)
    with pytest.raises(CacheError, match=r"at least 50"):
        make(capacity=10, num_samples=50)
    assert make(capacity=50, num_samples=50).capacity == 50


@pytest.mark.parametrize("capacity", [0, -3, 2.5, True])
def test_bad_capacity(make: Factory, capacity: Any) -> None:
    with pytest.raises(CacheError, match="capacity"):
        make(capacity=capacity)


def test_reset_forgets(make: Factory) -> None:
    cache = make()
    cache.put(ids_of(1, 2), torch.randn(2, *ROW))
    cache.reset()
    assert not cache.visited(ids_of(1, 2)).any()
    with pytest.raises(CacheError):
        cache.get(ids_of(1))
    out = cache.put(ids_of(2), torch.randn(1, *ROW))
    assert_bit_identical(cache.get(ids_of(2)), out)


def test_put_detaches_and_does_not_alias(make: Factory) -> None:
    kw = {} if isinstance(make(), LowBitCache) else {"storage_dtype": torch.float32}
    cache = make(**kw)
    rows = torch.randn(2, *ROW, requires_grad=True)
    out = cache.put(ids_of(0, 1), rows)
    assert not out.requires_grad
    plain = torch.randn(2, *ROW)
    out = cache.put(ids_of(2, 3), plain)
    kept = out.clone()
    plain.add_(100.0)
    out.add_(100.0)
    assert_bit_identical(cache.get(ids_of(2, 3)), kept)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_compute_dtype(make: Factory, dtype: torch.dtype) -> None:
    cache = make(dtype=dtype)
    out = cache.put(ids_of(4), torch.randn(1, *ROW, dtype=dtype))
    assert out.dtype == dtype
    assert_bit_identical(cache.get(ids_of(4)), out)


def _random_puts(cache: ActivationCache, seed: int, steps: int = 12) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        n = int(torch.randint(1, 6, (), generator=gen))
        ids = torch.randperm(CAP, generator=gen)[:n]
        scale = float(torch.rand((), generator=gen)) * 10
        cache.put(ids, torch.randn(n, *ROW, generator=gen) * scale)


def test_deterministic_across_instances(make: Factory) -> None:
    a, b = make(), make()
    _random_puts(a, seed=3)
    _random_puts(b, seed=3)
    ids = torch.arange(CAP)[a.visited(torch.arange(CAP))]
    assert torch.equal(ids, torch.arange(CAP)[b.visited(torch.arange(CAP))])
    assert_bit_identical(a.get(ids), b.get(ids))


# ---------------------------------------------------------------------- storage dtype


@pytest.mark.parametrize("storage_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_storage_dtype_rounding(tmp_path: Path, kind: str, storage_dtype: torch.dtype) -> None:
    if kind == "memory":
        cache: ActivationCache = MemoryCache(CAP, ROW, storage_dtype=storage_dtype)
    else:
        cache = DiskCache(tmp_path / "r.bin", CAP, ROW, storage_dtype=storage_dtype)
    rows = torch.randn(3, *ROW) * 7
    out = cache.put(ids_of(0, 1, 2), rows)
    assert_bit_identical(out, rows.to(storage_dtype).to(torch.float32))
    assert_bit_identical(cache.get(ids_of(0, 1, 2)), out)
    if isinstance(cache, DiskCache):
        cache.close()


def test_default_storage_is_fp16(tmp_path: Path) -> None:
    assert MemoryCache(4, (2,)).storage_dtype == torch.float16
    with DiskCache(tmp_path / "r.bin", 4, (2,)) as disk:
        assert disk.storage_dtype == torch.float16


def test_bad_storage_dtype() -> None:
    with pytest.raises(CacheError, match="storage_dtype"):
        MemoryCache(4, (2,), storage_dtype=torch.int8)


# ---------------------------------------------------------------------- nbytes


def test_nbytes(tmp_path: Path) -> None:
    mem = MemoryCache(100, (16, 64))
    assert mem.nbytes == 100 * 16 * 64 * 2 + 100
    assert MemoryCache(100, (16, 64), storage_dtype=torch.float32).nbytes == 100 * 16 * 64 * 4 + 100
    with DiskCache(tmp_path / "r.bin", 100, (16, 64)) as disk:
        assert disk.nbytes == mem.nbytes
    low = LowBitCache(100, (16, 64), bits=4, block=64)
    assert low.nbytes == 100 * 16 * (32 + 2) + 100
    assert 0.24 < low.nbytes / mem.nbytes < 0.30
    assert LowBitCache(100, (16, 64), bits=2).nbytes < low.nbytes


# ---------------------------------------------------------------------- lazy row shape


@pytest.mark.parametrize("cls", [MemoryCache, LowBitCache])
def test_lazy_row_shape(cls: type[ActivationCache]) -> None:
    cache = cls(8)
    assert cache.row_shape is None
    with pytest.raises(CacheError):
        cache.get(ids_of())
    with pytest.raises(CacheError, match=r"\b3\b"):
        cache.get(ids_of(3))
    empty_nbytes = cache.nbytes
    out = cache.put(ids_of(3), torch.randn(1, 5, 6))
    assert cache.row_shape == (5, 6) and cache.nbytes > empty_nbytes
    assert_bit_identical(cache.get(ids_of(3)), out)
    with pytest.raises(CacheError, match=r"\(1, 5, 7\).*\(1, 5, 6\)"):
        cache.put(ids_of(4), torch.randn(1, 5, 7))
    with pytest.raises(CacheError):
        cls(8).put(ids_of(1), torch.randn(1))  # a row needs at least one dimension


# ---------------------------------------------------------------------- save / load


def test_save_load_roundtrip(make: Factory, tmp_path: Path) -> None:
    src = make()
    _random_puts(src, seed=11)
    ids = torch.arange(CAP)[src.visited(torch.arange(CAP))]
    expected = src.get(ids)
    src.save(tmp_path / "ckpt")
    meta = json.loads((tmp_path / "ckpt" / "meta.json").read_text())
    assert meta["backend"] == src.backend and meta["capacity"] == CAP and meta["row_shape"] == list(ROW)
    files = {p.name for p in (tmp_path / "ckpt").iterdir()}
    assert files <= {"meta.json", "cache.safetensors", "rows.bin"}  # no pickles

    dst = make()
    dst.put(ids_of(0, 1), torch.randn(2, *ROW))  # contents are replaced, not merged
    dst.load(tmp_path / "ckpt")
    assert torch.equal(dst.visited(torch.arange(CAP)), src.visited(torch.arange(CAP)))
    assert_bit_identical(dst.get(ids), expected)
    # The restored cache keeps working and stays in lockstep with the original.
    rows = torch.randn(2, *ROW)
    assert_bit_identical(dst.put(ids_of(30, 31), rows), src.put(ids_of(30, 31), rows))


def test_load_incompatible_raises(make: Factory, backend: str, tmp_path: Path) -> None:
    src = make()
    src.put(ids_of(1), torch.randn(1, *ROW))
    src.save(tmp_path / "ckpt")
    with pytest.raises(CacheError, match="capacity"):
        make(capacity=CAP + 1).load(tmp_path / "ckpt")
    with pytest.raises(CacheError, match="shape"):
        make(row_shape=(4, 9)).load(tmp_path / "ckpt")
    with pytest.raises(CacheError, match="no activation-cache checkpoint"):
        make().load(tmp_path / "nothing-here")
    other: ActivationCache = (
        LowBitCache(CAP, ROW) if backend != "lowbit" else MemoryCache(CAP, ROW)
    )
    with pytest.raises(CacheError, match="cannot load"):
        other.load(tmp_path / "ckpt")
    if backend == "lowbit":
        with pytest.raises(CacheError, match="bits"):
            make(bits=2).load(tmp_path / "ckpt")
    else:
        with pytest.raises(CacheError, match="storage_dtype"):
            make(storage_dtype=torch.float32).load(tmp_path / "ckpt")


def test_load_rejects_other_backend_dirs(tmp_path: Path) -> None:
    with DiskCache(tmp_path / "r.bin", CAP, ROW) as disk:
        disk.put(ids_of(1), torch.randn(1, *ROW))
        disk.save(tmp_path / "disk")
    MemoryCache(CAP, ROW).save(tmp_path / "mem")
    with pytest.raises(CacheError, match="'disk'"):
        MemoryCache(CAP, ROW).load(tmp_path / "disk")
    with DiskCache(tmp_path / "r2.bin", CAP, ROW) as disk2, pytest.raises(CacheError, match="'memory'"):
        disk2.load(tmp_path / "mem")


def test_lazy_memory_cache_loads_shape(tmp_path: Path) -> None:
    src = MemoryCache(CAP, ROW)
    out = src.put(ids_of(2), torch.randn(1, *ROW))
    src.save(tmp_path / "ckpt")
    dst = MemoryCache(CAP)
    dst.load(tmp_path / "ckpt")
    assert dst.row_shape == ROW
    assert_bit_identical(dst.get(ids_of(2)), out)


def test_load_corrupt_tensors_raises(tmp_path: Path) -> None:
    MemoryCache(CAP, ROW).save(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "cache.safetensors").write_bytes(b"garbage")
    with pytest.raises(CacheError, match="cannot read"):
        MemoryCache(CAP, ROW).load(tmp_path / "ckpt")


# ---------------------------------------------------------------------- LowBitCache specifics


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("row_shape", [(4, 8), (3, 7)])
def test_lowbit_error_bound(bits: int, row_shape: tuple[int, ...]) -> None:
    block = 16
    cache = LowBitCache(8, row_shape, bits=bits, block=block)
    rows = torch.randn(3, *row_shape)
    out = cache.put(ids_of(0, 5, 7), rows)
    assert_bit_identical(cache.get(ids_of(0, 5, 7)), out)
    pad = (0, -rows[0].numel() % block)
    flat_in = torch.nn.functional.pad(rows.reshape(3, -1), pad).reshape(3, -1, block)
    flat_out = torch.nn.functional.pad(out.reshape(3, -1), pad).reshape(3, -1, block)
    amax = flat_in.abs().amax(-1, keepdim=True)
    valid = torch.nn.functional.pad(torch.ones(rows[0].numel()), pad).bool()
    valid = valid.reshape(1, -1, block).expand_as(flat_in)
    if bits == 1:
        err = (flat_out.abs() - amax).abs()
        assert torch.all(err[valid] <= amax.expand_as(flat_in)[valid] * 1e-3 + 1e-6)
    else:
        step = amax / (2 ** (bits - 1) - 1)
        assert torch.all((flat_out - flat_in).abs() <= step * 0.5 * 1.01 + 1e-6)


def test_lowbit_zero_and_nonfinite_rows() -> None:
    cache = LowBitCache(4, (2, 8), block=8)
    out = cache.put(ids_of(1), torch.zeros(1, 2, 8))
    assert torch.equal(out, torch.zeros(1, 2, 8))
    bad = torch.zeros(1, 2, 8)
    bad[0, 0, 0] = float("inf")
    with pytest.raises(CacheError, match="quantize"):
        cache.put(ids_of(2), bad)
    assert not cache.visited(ids_of(2)).item()


@pytest.mark.parametrize("kw", [{"bits": 0}, {"bits": 9}, {"block": 0}])
def test_lowbit_bad_args(kw: dict[str, int]) -> None:
    with pytest.raises(CacheError):
        LowBitCache(4, (8,), **kw)


# ---------------------------------------------------------------------- DiskCache specifics


def test_disk_prefetch_hit(tmp_path: Path) -> None:
    with DiskCache(tmp_path / "r.bin", CAP, ROW) as cache:
        out = cache.put(ids_of(3, 4, 5), torch.randn(3, *ROW))
        cache.prefetch(ids_of(5, 3))
        assert_bit_identical(cache.get(ids_of(5, 3)), out[[2, 0]])
        assert cache.prefetch_hits == 1 and cache.prefetch_misses == 0
        assert_bit_identical(cache.get(ids_of(5, 3)), out[[2, 0]])  # consumed: now a sync read
        assert cache.prefetch_misses == 1


def test_disk_prefetch_depth_drops_oldest(tmp_path: Path) -> None:
    with DiskCache(tmp_path / "r.bin", CAP, ROW, prefetch_depth=2) as cache:
        cache.put(torch.arange(6), torch.randn(6, *ROW))
        for i in range(4):
            cache.prefetch(ids_of(i))
        assert len(cache._pending) == 2
        cache.get(ids_of(0))
        cache.get(ids_of(3))
        assert (cache.prefetch_hits, cache.prefetch_misses) == (1, 1)
    with DiskCache(tmp_path / "z.bin", CAP, ROW, prefetch_depth=0) as cache:
        cache.put(ids_of(0), torch.randn(1, *ROW))
        cache.prefetch(ids_of(0))
        cache.get(ids_of(0))
        assert (cache.prefetch_hits, cache.prefetch_misses) == (0, 1)


def test_disk_put_during_slow_prefetch_is_not_stale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with DiskCache(tmp_path / "r.bin", CAP, ROW) as cache:
        ids = ids_of(1, 2)
        cache.put(ids, torch.zeros(2, *ROW))
        started = threading.Event()
        original = cache._read_rows

        def slow_read(ids_np: np.ndarray, pin: bool) -> torch.Tensor:
            if threading.current_thread() is not threading.main_thread():
                result = original(ids_np, pin)  # the old rows are read...
                started.set()
                time.sleep(0.05)  # ...and handed back late, after the overlapping put
                return result
            return original(ids_np, pin)

        monkeypatch.setattr(cache, "_read_rows", slow_read)
        cache.prefetch(ids)
        assert started.wait(5)
        new = cache.put(ids_of(2), torch.ones(1, *ROW))  # overlaps the in-flight prefetch
        got = cache.get(ids)
        assert torch.equal(got[0], torch.zeros(*ROW))
        assert_bit_identical(got[1:], new)


@pytest.mark.parametrize("seed", range(4))
def test_disk_prefetch_interleaved_matches_reference(tmp_path: Path, seed: int) -> None:
    """Random puts, prefetches, gets and resets against a dict model: never a stale or wrong row."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    capacity, row = 12, (3, 5)
    model: dict[int, torch.Tensor] = {}
    recent: list[list[int]] = []
    with DiskCache(tmp_path / "r.bin", capacity, row, prefetch_depth=rng.choice([1, 2, 3])) as cache:
        for _ in range(300):
            op = rng.random()
            if op < 0.35:
                ids = rng.sample(range(capacity), rng.randint(1, 5))
                out = cache.put(torch.tensor(ids), torch.randn(len(ids), *row, generator=gen))
                for i, k in enumerate(ids):
                    model[k] = out[i].clone()
            elif op < 0.65:
                ids = rng.sample(range(capacity), rng.randint(1, 5))
                cache.prefetch(torch.tensor(ids))
                recent.append(ids)
            elif op < 0.98:
                candidates = [ids for ids in recent[-4:] if all(k in model for k in ids)]
                if candidates and rng.random() < 0.7:
                    ids = rng.choice(candidates)
                elif model:
                    ids = rng.sample(sorted(model), rng.randint(1, min(5, len(model))))
                else:
                    continue
                got = cache.get(torch.tensor(ids))
                assert_bit_identical(got, torch.stack([model[k] for k in ids]))
            else:
                cache.reset()
                model.clear()
            unknown = [k for k in range(capacity) if k not in model]
            if unknown and rng.random() < 0.05:
                with pytest.raises(CacheError):
                    cache.get(torch.tensor(unknown[:2]))
        assert cache.prefetch_hits > 3  # the prefetch path was really exercised


def test_disk_bf16_file_holds_bit_patterns(tmp_path: Path) -> None:
    with DiskCache(tmp_path / "r.bin", 4, (3,), storage_dtype=torch.bfloat16) as cache:
        rows = torch.tensor([[1.0, -2.5, 3.14159]])
        cache.put(ids_of(2), rows)
        cache.flush()
        raw = np.fromfile(tmp_path / "r.bin", dtype=np.uint16).reshape(4, 3)
    expected = rows.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(raw[2], expected[0])
    assert not raw[[0, 1, 3]].any()


def test_disk_close_and_context_manager(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path / "r.bin", 4, (2,))
    with cache as entered:
        assert entered is cache
        entered.put(ids_of(0), torch.ones(1, 2))
        cache.prefetch(ids_of(0))
    assert cache.closed
    cache.close()  # idempotent
    for call in (lambda: cache.get(ids_of(0)), lambda: cache.put(ids_of(1), torch.ones(1, 2)),
                 lambda: cache.prefetch(ids_of(0)), lambda: cache.save(tmp_path / "x")):
        with pytest.raises(CacheError, match="closed"):
            call()


def test_disk_path_must_not_be_directory(tmp_path: Path) -> None:
    with pytest.raises(CacheError, match="directory"):
        DiskCache(tmp_path, 4, (2,))
    with pytest.raises(CacheError, match="row_shape"):
        DiskCache(tmp_path / "r.bin", 4, None)  # type: ignore[arg-type]


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmRSS not found")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc/self/status")
def test_disk_large_capacity_bounded_rss(tmp_path: Path) -> None:
    capacity, row = 100_000, (16, 64)
    file_size = capacity * 16 * 64 * 2
    before = _rss_bytes()
    with DiskCache(tmp_path / "big.bin", capacity, row) as cache:
        assert cache.nbytes >= file_size
        ids = torch.tensor([0, 99_999, 54_321, 7])
        out = cache.put(ids, torch.randn(4, *row))
        cache.prefetch(ids)
        assert_bit_identical(cache.get(ids), out)
        assert_bit_identical(cache.get(ids[[1, 3]]), out[[1, 3]])
        after = _rss_bytes()
        cache.save(tmp_path / "ckpt")
        after_save = _rss_bytes()
        restored = DiskCache(tmp_path / "big2.bin", capacity, row)
        restored.load(tmp_path / "ckpt")
        assert_bit_identical(restored.get(ids), out)
        restored.close()
    assert (tmp_path / "big.bin").stat().st_size == file_size
    assert after - before < file_size // 20, (before, after)
    assert after_save - before < file_size // 20, (before, after_save)
    for name in ("big.bin", "big2.bin", "ckpt/rows.bin"):
        st = (tmp_path / name).stat()
        assert st.st_size == file_size
        if st.st_blocks:  # sparse: only touched pages occupy disk (skip on filesystems without st_blocks)
            assert st.st_blocks * 512 < file_size // 20, name


# ---------------------------------------------------------------------- CUDA (skipped without a GPU)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bit_identical_to_cpu(backend: str, tmp_path: Path) -> None:
    """A CUDA cache (sender) and a CPU cache (receiver) fed the same puts stay bit-identical."""

    def build(device: str, name: str) -> ActivationCache:
        if backend == "memory":
            return MemoryCache(CAP, ROW, device=device)
        if backend == "lowbit":
            return LowBitCache(CAP, ROW, device=device)
        return DiskCache(tmp_path / f"{name}.bin", CAP, ROW, device=device)

    cpu, gpu, restored = build("cpu", "cpu"), build("cuda", "gpu"), build("cpu", "restored")
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):
        ids = torch.randperm(CAP, generator=gen)[:5]
        rows = torch.randn(5, *ROW, generator=gen) * 4
        out_cpu = cpu.put(ids, rows)
        out_gpu = gpu.put(ids.cuda(), rows.cuda())
        assert out_gpu.device.type == "cuda"
        assert_bit_identical(out_gpu.cpu(), out_cpu)
        gpu.prefetch(ids)
        got = gpu.get(ids)
        assert got.device.type == "cuda" and gpu.visited(ids.cuda()).device.type == "cuda"
        assert_bit_identical(got.cpu(), cpu.get(ids))
    gpu.save(tmp_path / "ckpt")
    restored.load(tmp_path / "ckpt")
    everything = torch.arange(CAP)[cpu.visited(torch.arange(CAP))]
    assert_bit_identical(restored.get(everything), cpu.get(everything))
    for cache in (cpu, gpu, restored):
        if isinstance(cache, DiskCache):
            cache.close()
