"""``aqsgd bench codecs --cache-path``: the AQ-SGD cache path per micro-batch against ``x.clone()``.

What one boundary of the ``delta`` scheme (AQ-SGD) does per micro-batch in ``TRAIN``, with the library's own
objects (:func:`aqsgd.schemes.make_scheme` builds both sides, with the cache the trainer would build from the
same spec):

* sender: ``m = cache.get(ids)``, ``d = a - m``, ``packet = encode(d)``, ``m' = m + decode(packet)``,
  ``cache.put(ids, m')`` (:meth:`DeltaScheme.send`);
* receiver: ``m = cache.get(ids)``, ``m' = m + decode(packet)``, ``cache.put(ids, m')``, and the output
  (:meth:`DeltaScheme.recv`).

Rates are bytes of the fp32 activation per second. ``clone`` is ``a.clone()`` of the same activations, in the
same run, interleaved with the two sides (medians over repeats after warm-up, as in ``bench codecs``), and
``copy`` is ``dst.copy_(a)`` into a buffer allocated once: the copy alone, without the clone's fresh
allocation. The step cycles over ``microbatches`` micro-batches of distinct sample ids, each with two versions
of its activation that alternate between visits, so the cache rows, activations and deltas come from memory as
they do in training rather than staying in the CPU's caches; the clone and the copy cycle over the same
activations. The components (get, subtract, encode, decode, add, put) are timed alone as well, on a third
cache of the same spec.

Where the cache keeps its rows in CPU memory (``memory``) and the codec is a plain quantizer, the two sides
run as one fused pass over the rows (:meth:`Codec.encode_delta` / :meth:`Codec.decode_delta`): the
components then describe the step-by-step path, which the same rounds also time whole with the fused kernels
switched off (``eager_sender_ms`` / ``eager_receiver_ms``, on a fourth pair), so the gain is a ratio measured
side by side.

:func:`bench_prefetch` measures the disk cache's read-ahead the way the stage runner uses it
(:meth:`StageRunner._prefetch`: ``prefetch`` of micro-batch ``k + 1`` when micro-batch ``k`` arrives, before
its forward), with the file's pages dropped from the OS page cache before each step (``cold``) or left in
it (``warm``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import math
import mmap
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from aqsgd.bench.codecs import machine_description
from aqsgd.bench.timing import interleaved_medians, sync
from aqsgd.compress import kernels, make_codec
from aqsgd.schemes import DeltaScheme, DiskCache, Phase, make_cache, make_scheme

__all__ = ["DEFAULT_CACHES", "CachePathRow", "PrefetchRow", "CachePair", "bench_cache_path", "bench_prefetch",
           "check_specs", "drop_file_pages", "markdown_table", "resident_fraction",
           "write_cache_path_json"]

DEFAULT_CACHES = ("memory", "lowbit4", "disk")
MICROBATCHES = 4  # micro-batches of distinct sample ids a step cycles over
DEFAULT_CODEC = "q2"  # AQ-SGD's fw2 setting: 2-bit deltas forward


@dataclass
class CachePathRow:
    cache: str
    codec: str
    device: str
    shape: list[int]
    microbatches: int
    sender_gbps: float
    receiver_gbps: float
    clone_gbps: float
    sender_vs_clone: float
    receiver_vs_clone: float
    sender_ms: float
    receiver_ms: float
    clone_ms: float
    get_ms: float
    sub_ms: float
    encode_ms: float
    decode_ms: float
    add_ms: float
    put_ms: float
    cache_bytes_per_sample: int
    wire_bytes: int
    caches_identical: bool
    # the same two paths with the fused kernels off, in the same rounds (a fourth pair of the same spec); None
    # where they were not compared (not on the CPU, or the kernels unavailable)
    eager_sender_ms: float | None = None
    eager_receiver_ms: float | None = None
    fused: bool = False  # whether the sender's step ran the fused AQ-SGD kernels (memory cache, q<b> codec)
    # ``dst.copy_(a)`` into a buffer allocated once: the memory's copy rate without the clone's allocation (a
    # fresh 12 MB tensor comes from the OS and faults its pages in, which can take several times the copy)
    copy_gbps: float | None = None
    sender_vs_copy: float | None = None
    receiver_vs_copy: float | None = None


@dataclass
class PrefetchRow:
    cache: str
    codec: str
    device: str
    shape: list[int]
    microbatches: int
    pages: str  # "cold": the file's pages dropped before every step; "warm": left in the page cache
    prefetch: bool
    pages_dropped: bool  # whether the drop worked (no page of the file resident at the step's start)
    resident_before: float | None  # median fraction of the file's pages resident at the step's start
    max_get_wait_ms: float  # median over steps of the step's slowest wait inside cache.get()
    step_read_wait_ms: float  # median over steps of the summed waits at get()
    step_ms: float  # median step time (stand-in forwards and sender paths included)
    forward_ms: float  # median stand-in forward per micro-batch
    hits: int  # gets served by a prefetch, per step
    misses: int  # gets read synchronously, per step
    hidden: float | None  # 1 - wait with prefetch / wait without, same pages state (prefetch rows only)


def _activations(shape: Sequence[int], k: int, device: torch.device, seed: int) -> list[list[torch.Tensor]]:
    """``k`` micro-batches, each in two versions (the second: the first plus 10 % noise), like
    ``bench codecs``' tensor: Gaussian with every (width/8)-th channel scaled 8x."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for _ in range(k):
        x = torch.randn(tuple(shape), generator=g, device=device)
        x[..., :: max(1, shape[-1] // 8)] *= 8.0
        out.append([x, x + 0.1 * torch.randn(tuple(shape), generator=g, device=device)])
    return out


def check_specs(codecs: Sequence[str], caches: Sequence[str]) -> None:
    """:class:`~aqsgd.errors.SpecError` for an invalid codec or cache spec, before anything is measured."""
    for codec in codecs:
        make_codec(codec)
    with tempfile.TemporaryDirectory(prefix="aqsgd-cachepath-") as tmp:
        for spec in caches:
            c = make_cache(spec, 1, row_shape=(1,), path=Path(tmp) / "check.bin")
            if isinstance(c, DiskCache):
                c.close()


class CachePair:
    """Sender and receiver ``delta`` schemes of one boundary, built by :func:`make_scheme` as the trainer
    builds them, over ``microbatches`` micro-batches of ``shape[0]`` distinct sample ids each, filled by a
    ``WARMUP`` pass. :meth:`send` / :meth:`recv` run one ``TRAIN`` micro-batch through the real schemes."""

    def __init__(self, cache: str, codec: str, shape: Sequence[int], *, microbatches: int = MICROBATCHES,
                 device: torch.device | str = "cpu", seed: int = 0, cache_dir: str | Path | None = None,
                 activations: list[list[torch.Tensor]] | None = None, backend: str | None = None) -> None:
        """``backend``: the codec's kernel backend (:mod:`aqsgd.compress.kernels`; None: the device's)."""
        self.cache_spec = cache
        self.device = torch.device(device)
        self.shape = tuple(int(n) for n in shape)
        b = self.shape[0]
        self.microbatches = microbatches
        self.capacity = microbatches * b
        perm = torch.randperm(self.capacity, generator=torch.Generator().manual_seed(seed))
        # scattered ids, as shuffled
        self.ids = [perm[i * b:(i + 1) * b].clone() for i in range(microbatches)]
        self.xs = activations if activations is not None else _activations(self.shape, microbatches,
                                                                           self.device, seed)
        self.visits = [0] * microbatches
        self.schemes: dict[str, DeltaScheme] = {}
        for side in ("sender", "receiver"):
            path = None if cache_dir is None else Path(cache_dir) / f"cachepath-{cache}-{side}.bin"
            s = make_scheme("delta", make_codec(codec, backend=backend), side, num_samples=self.capacity,
                            cache=cache, cache_path=path,
                            row_shape=self.shape[1:], dtype=torch.float32, label=f"bench {cache} {side}",
                            seed=seed, device=self.device)
            assert isinstance(s, DeltaScheme)
            self.schemes[side] = s
        self.sender, self.receiver = self.schemes["sender"], self.schemes["receiver"]
        for k in range(microbatches):  # the uncompressed first epoch fills both caches (visit 0)
            self.receiver.recv(self.sender.send(self.activation(k), self.ids[k], phase=Phase.WARMUP, slot=k),
                               self.ids[k], phase=Phase.WARMUP, slot=k)
            self.visits[k] += 1

    def activation(self, k: int) -> torch.Tensor:
        """The activation of micro-batch ``k`` at its next visit (the two versions alternate)."""
        return self.xs[k][self.visits[k] % 2]

    def send(self, k: int) -> list:
        packets = self.sender.send(self.activation(k), self.ids[k], phase=Phase.TRAIN, slot=k)
        self.visits[k] += 1
        return packets

    def recv(self, k: int, packets: list) -> torch.Tensor:
        return self.receiver.recv(packets, self.ids[k], phase=Phase.TRAIN, slot=k)

    def identical(self) -> bool:
        """Whether both sides' caches hold bit-identical rows for every sample."""
        every = torch.arange(self.capacity)
        return bool(torch.equal(self.sender.cache.get(every), self.receiver.cache.get(every)))

    def close(self) -> None:
        for s in self.schemes.values():
            if isinstance(s.cache, DiskCache):
                s.cache.close()


def _cache_bytes_per_sample(pair: CachePair) -> int:
    c = pair.sender.cache
    visited = c.capacity  # the mask is a byte per sample
    return (c.nbytes - visited) // c.capacity


def bench_cache_path(codecs: Sequence[str] = (DEFAULT_CODEC,), caches: Sequence[str] = DEFAULT_CACHES, *,
                     shape: Sequence[int] = (8, 512, 768), device: str | torch.device = "cpu",
                     microbatches: int = MICROBATCHES, repeats: int = 15, warmup: int = 3, seed: int = 0,
                     cache_dir: str | Path | None = None) -> list[CachePathRow]:
    """One row per codec and cache spec (``memory``, ``lowbit4``, ``disk``, ... as ``--cache`` spells them).
    Disk caches go to ``cache_dir`` (default: a temporary folder, removed afterwards); their reads here come
    from the OS page cache (the rows were just written): :func:`bench_prefetch` measures reads from the
    disk."""
    device = torch.device(device)
    shape = tuple(int(n) for n in shape)
    xs = _activations(shape, microbatches, device, seed)
    nbytes = math.prod(shape) * 4
    rows = []
    if cache_dir is not None:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="aqsgd-cachepath-", dir=cache_dir) as tmp:
        for codec in codecs:
            for spec in caches:
                pair = CachePair(spec, codec, shape, microbatches=microbatches, device=device, seed=seed,
                                 cache_dir=tmp, activations=xs)
                probe = CachePair(spec, codec, shape, microbatches=microbatches, device=device, seed=seed,
                                  cache_dir=Path(tmp) / "probe", activations=xs)
                eager = None
                if kernels.on_host(device) and kernels.for_device(device).name != "eager":
                    eager = CachePair(spec, codec, shape, microbatches=microbatches, device=device, seed=seed,
                                      cache_dir=Path(tmp) / "eager", activations=xs, backend="eager")
                try:
                    rows.append(_measure(pair, probe, eager, nbytes, repeats=repeats, warmup=warmup,
                                         seed=seed))
                finally:
                    for p in (pair, probe, eager):
                        if p is not None:
                            p.close()
    return rows


def _sides(pair: CachePair) -> tuple[Callable[[], None], Callable[[], None]]:
    """The pair's sender and receiver paths as two calls that run in turn: ``recv`` consumes the packets that
    ``send`` made just before, then moves on to the next micro-batch."""
    state: dict[str, Any] = {"k": 0, "packets": None}

    def send() -> None:
        state["packets"] = pair.send(state["k"])

    def recv() -> None:
        pair.recv(state["k"], state["packets"])
        state["k"] = (state["k"] + 1) % pair.microbatches

    return send, recv


def _measure(pair: CachePair, probe: CachePair, eager: CachePair | None, nbytes: int, *, repeats: int,
             warmup: int, seed: int) -> CachePathRow:
    k_count, device = pair.microbatches, pair.device
    send, recv = _sides(pair)

    clone_k = _Cycle(k_count)

    def clone() -> None:
        pair.activation(clone_k.next()).clone()

    copy_k = _Cycle(k_count)
    copy_dst = torch.empty_like(pair.activation(0))

    def copy() -> None:
        copy_dst.copy_(pair.activation(copy_k.next()))

    # components alone, on the probe's sender cache, with inputs prepared from it
    cache, codec = probe.sender.cache, probe.sender.codec
    g = torch.Generator(device=device).manual_seed(seed)
    ms = [cache.get(ids) for ids in probe.ids]
    ds = [probe.xs[k][1] - ms[k] for k in range(k_count)]
    packets = [codec.encode(d, generator=g) for d in ds]
    dhats = [codec.decode(p) for p in packets]
    cyc = {name: _Cycle(k_count) for name in ("get", "sub", "encode", "decode", "add", "put")}
    fns: dict[str, Callable[[], object]] = {
        "clone": clone,
        "copy": copy,
        "send": send,
        "recv": recv,
        "get": lambda: cache.get(probe.ids[cyc["get"].next()]),
        "sub": lambda: (lambda k: probe.xs[k][1] - ms[k])(cyc["sub"].next()),
        "encode": lambda: codec.encode(ds[cyc["encode"].next()], generator=g),
        "decode": lambda: codec.decode(packets[cyc["decode"].next()]),
        "add": lambda: (lambda k: ms[k] + dhats[k])(cyc["add"].next()),
        "put": lambda: (lambda k: cache.put(probe.ids[k], ms[k]))(cyc["put"].next()),
    }
    if eager is not None:
        eager_send, eager_recv = _sides(eager)
        fns["eager_send"], fns["eager_recv"] = eager_send, eager_recv
    t = interleaved_medians(fns, device=device, warmup=warmup, repeats=repeats)
    codec = pair.sender.codec
    fused_steps: list[bool] = []

    def spy(x: torch.Tensor, store: Any) -> Any:  # did the sender's step take the fused path?
        out = type(codec).encode_delta(codec, x, store)
        fused_steps.append(out is not None)
        return out

    codec.encode_delta = spy  # type: ignore[method-assign]
    try:
        sent = pair.send(0)
    finally:
        del codec.encode_delta
    pair.recv(0, sent)
    clone_gbps = nbytes / t["clone"] / 1e9
    snd, rcv = nbytes / t["send"] / 1e9, nbytes / t["recv"] / 1e9
    return CachePathRow(
        cache=pair.cache_spec, codec=pair.sender.codec.spec, device=str(device), shape=list(pair.shape),
        microbatches=k_count, sender_gbps=snd, receiver_gbps=rcv, clone_gbps=clone_gbps,
        sender_vs_clone=snd / clone_gbps, receiver_vs_clone=rcv / clone_gbps,
        sender_ms=t["send"] * 1e3, receiver_ms=t["recv"] * 1e3, clone_ms=t["clone"] * 1e3,
        get_ms=t["get"] * 1e3, sub_ms=t["sub"] * 1e3, encode_ms=t["encode"] * 1e3,
        decode_ms=t["decode"] * 1e3, add_ms=t["add"] * 1e3, put_ms=t["put"] * 1e3,
        cache_bytes_per_sample=_cache_bytes_per_sample(pair), wire_bytes=sum(p.nbytes for p in sent),
        caches_identical=pair.identical() and (eager is None or eager.identical()),
        eager_sender_ms=t["eager_send"] * 1e3 if eager is not None else None,
        eager_receiver_ms=t["eager_recv"] * 1e3 if eager is not None else None,
        fused=any(fused_steps),
        copy_gbps=nbytes / t["copy"] / 1e9, sender_vs_copy=t["copy"] / t["send"],
        receiver_vs_copy=t["copy"] / t["recv"],
    )


class _Cycle:
    def __init__(self, n: int) -> None:
        self.n, self.i = n, -1

    def next(self) -> int:
        self.i = (self.i + 1) % self.n
        return self.i


# ------------------------------------------------------------------------------------------------- page cache

def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


_MADV_DONTNEED = 4  # Linux


def resident_fraction(path: str | Path) -> float | None:
    """Fraction of the file's pages in the OS page cache (``mincore`` on a fresh read-only mapping), or
    ``None`` where that cannot be asked (not Linux, no libc)."""
    libc = _libc()
    size = os.path.getsize(path)
    if libc is None or size == 0 or not hasattr(mmap, "MAP_SHARED"):
        return None
    pages = -(-size // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                return None
            return sum(v & 1 for v in vec) / pages
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def drop_file_pages(cache: DiskCache) -> bool:
    """Write the disk cache's dirty pages back, unmap them from this process (``madvise(MADV_DONTNEED)`` on
    the cache's memmap: pages mapped by a process are not evicted) and drop the file from the OS page cache
    (``posix_fadvise(POSIX_FADV_DONTNEED)``). True when no page of the file is resident afterwards (as far as
    ``mincore`` tells); False where the platform cannot do it (tmpfs, not Linux): reads are then warm."""
    cache.flush()
    fd = os.open(cache.path, os.O_RDONLY)
    try:
        os.fsync(fd)
        mm = getattr(cache, "_mm", None)  # the cache's numpy memmap (private: no public way to unmap pages)
        libc = _libc()
        if mm is not None and libc is not None:
            addr, length = mm.ctypes.data, mm.nbytes
            if addr % mmap.PAGESIZE == 0:
                libc.madvise(addr, -(-length // mmap.PAGESIZE) * mmap.PAGESIZE, _MADV_DONTNEED)
        if not hasattr(os, "posix_fadvise"):
            return False
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    left = resident_fraction(cache.path)
    return left is not None and left == 0.0


# --------------------------------------------------------------------------------------------------- prefetch

def bench_prefetch(codec: str = DEFAULT_CODEC, cache: str = "disk", *, shape: Sequence[int] = (8, 512, 768),
                   device: str | torch.device = "cpu", microbatches: int = MICROBATCHES, repeats: int = 7,
                   seed: int = 0,
                   cache_dir: str | Path | None = None, forward: bool = True) -> list[PrefetchRow]:
    """Steps of ``microbatches`` sender micro-batches through a disk-cached ``delta`` scheme, in the runner's
    order: ``prefetch(ids[0])`` at the step's start, then per micro-batch ``k``: ``prefetch(ids[k + 1])`` (as
    on its arrival), the stand-in forward (one ``width x width`` linear layer on the micro-batch, when
    ``forward``), and ``send`` (whose ``cache.get`` consumes the prefetch). Without prefetch the same steps
    make no ``prefetch`` call. Four modes (cold/warm pages x with/without prefetch), interleaved step by step;
    ``repeats`` steps each. The wait is the time spent inside the scheme's ``cache.get``."""
    device = torch.device(device)
    shape = tuple(int(n) for n in shape)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    weight = torch.randn(shape[-1], shape[-1], generator=g, device=device) / math.sqrt(shape[-1])
    modes = [("cold", False), ("cold", True), ("warm", False), ("warm", True)]
    samples: dict[tuple[str, bool], dict[str, list]] = {
        m: {"wait": [], "max_wait": [], "step": [], "fwd": [], "resident": [], "dropped": [], "hits": [],
            "misses": []} for m in modes}
    if cache_dir is not None:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="aqsgd-prefetch-", dir=cache_dir) as tmp:
        pair = CachePair(cache, codec, shape, microbatches=microbatches, device=device, seed=seed,
                         cache_dir=tmp)
        disk = pair.sender.cache
        if not isinstance(disk, DiskCache):
            pair.close()
            raise ValueError(f"prefetch is measured on a disk cache, not {cache!r}")
        waits: list[float] = []
        real_get = disk.get

        def timed_get(ids: torch.Tensor) -> torch.Tensor:  # what the scheme's send() waits for at its get()
            t0 = time.perf_counter()
            out = real_get(ids)
            sync(device)
            waits.append(time.perf_counter() - t0)
            return out

        disk.get = timed_get  # type: ignore[method-assign]
        try:
            for rep in range(repeats + 1):  # the first round is warm-up
                for pages, prefetch in modes:
                    dropped = drop_file_pages(disk) if pages == "cold" else False
                    resident = resident_fraction(disk.path)
                    waits.clear()
                    hits0, misses0 = disk.prefetch_hits, disk.prefetch_misses
                    fwd: list[float] = []
                    sync(device)
                    t_step = time.perf_counter()
                    if prefetch:
                        pair.sender.prefetch(pair.ids[0])
                    for k in range(microbatches):
                        if prefetch and k + 1 < microbatches:
                            pair.sender.prefetch(pair.ids[k + 1])
                        if forward:
                            t0 = time.perf_counter()
                            torch.nn.functional.linear(pair.activation(k), weight)
                            sync(device)
                            fwd.append(time.perf_counter() - t0)
                        pair.send(k)
                    sync(device)
                    step = time.perf_counter() - t_step
                    if rep == 0:
                        continue
                    s = samples[(pages, prefetch)]
                    s["wait"].append(sum(waits))
                    s["max_wait"].append(max(waits))
                    s["step"].append(step)
                    s["fwd"].extend(fwd)
                    s["resident"].append(resident)
                    s["dropped"].append(dropped)
                    s["hits"].append(disk.prefetch_hits - hits0)
                    s["misses"].append(disk.prefetch_misses - misses0)
        finally:
            disk.get = real_get  # type: ignore[method-assign]
            pair.close()
    rows = []
    for pages, prefetch in modes:
        s = samples[(pages, prefetch)]
        resident = [r for r in s["resident"] if r is not None]
        rows.append(PrefetchRow(
            cache=cache, codec=pair.sender.codec.spec, device=str(device), shape=list(shape),
            microbatches=microbatches, pages=pages, prefetch=prefetch, pages_dropped=all(s["dropped"]),
            resident_before=statistics.median(resident) if resident else None,
            max_get_wait_ms=statistics.median(s["max_wait"]) * 1e3,
            step_read_wait_ms=statistics.median(s["wait"]) * 1e3,
            step_ms=statistics.median(s["step"]) * 1e3,
            forward_ms=statistics.median(s["fwd"]) * 1e3 if s["fwd"] else 0.0,
            hits=round(statistics.median(s["hits"])), misses=round(statistics.median(s["misses"])),
            hidden=None,
        ))
    by_mode = {(r.pages, r.prefetch): r for r in rows}
    for r in rows:
        if r.prefetch:
            base = by_mode[(r.pages, False)].step_read_wait_ms
            r.hidden = 1 - r.step_read_wait_ms / base if base > 0 else None
    return rows


def write_cache_path_json(rows: list[CachePathRow], prefetch: list[PrefetchRow], path: str | Path, *,
                          device: torch.device, command: str, config: dict[str, Any]) -> None:
    out = {
        "benchmark": "codecs-cache-path",
        "command": command,
        "machine": machine_description(device),
        "config": config,
        "rows": [asdict(r) for r in rows],
        "prefetch": [asdict(r) for r in prefetch],
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1))


def _opt(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def markdown_table(d: dict[str, Any]) -> list[str]:
    """The two tables of a :func:`write_cache_path_json` file as markdown (for docs/bench-codecs.md)."""
    out = ["| cache | codec | fused | sender GB/s | receiver GB/s | clone GB/s | sender / clone | "
           "receiver / clone | copy GB/s | sender / copy | receiver / copy "
           "| send / recv ms | unfused send / recv ms | get | a − m | encode | decode | m + d | put (ms) "
           "| cache bytes / sample |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        parts = " | ".join(f"{r[k]:.2f}"
                           for k in ("get_ms", "sub_ms", "encode_ms", "decode_ms", "add_ms", "put_ms"))
        unfused = ("-" if r.get("eager_sender_ms") is None
                   else f"{r['eager_sender_ms']:.2f} / {r['eager_receiver_ms']:.2f}")
        out.append(f"| `{r['cache']}` | `{r['codec']}` | {'yes' if r.get('fused') else 'no'} | "
                   f"{r['sender_gbps']:.2f} | {r['receiver_gbps']:.2f} | "
                   f"{r['clone_gbps']:.1f} | {r['sender_vs_clone']:.3f} | {r['receiver_vs_clone']:.3f} | "
                   f"{_opt(r.get('copy_gbps'), '.1f')} | {_opt(r.get('sender_vs_copy'), '.3f')} | "
                   f"{_opt(r.get('receiver_vs_copy'), '.3f')} | "
                   f"{r['sender_ms']:.2f} / {r['receiver_ms']:.2f} | {unfused} | {parts} | "
                   f"{r['cache_bytes_per_sample']:,} |")
    if d.get("prefetch"):
        out += ["", "| cache | pages | prefetch | resident at step start | read wait, ms / step "
                "| slowest get, ms | hidden | step ms | stand-in forward, ms / micro-batch | hits / misses |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for r in d["prefetch"]:
            res = "-" if r["resident_before"] is None else f"{r['resident_before']:.0%}"
            hidden = "-" if r["hidden"] is None else f"{r['hidden']:.0%}"
            out.append(f"| `{r['cache']}` | {r['pages']} | {'yes' if r['prefetch'] else 'no'} | {res} | "
                       f"{r['step_read_wait_ms']:.2f} | {r['max_get_wait_ms']:.2f} | {hidden} | "
                       f"{r['step_ms']:.1f} | "
                       f"{r['forward_ms']:.1f} | {r['hits']}/{r['misses']} |")
    return out
