"""TopK sparsification: keep the fraction K of largest-magnitude values, per row or per tensor.

``topk<K>[:row|:tensor][+<values codec>]``. Per row (the default) the tensor is viewed as
``[shape[0], rest]`` (one row per sample of a micro-batch, as the follow-up study compresses each sample)
and ``k = ceil(K * rest)`` values are kept from each row; per tensor, ``k = ceil(K * numel)`` from the whole.
The kept values are encoded by a second codec (``fp16`` by default; ``fp32``, ``bf16`` or a quantizer such
as ``q8``, whose groups default to rows of kept values) and the positions are stored as unsigned integers
of the narrowest width that can index a row (1, 2, 4 or 8 bytes, little-endian). They are written and read
as the low bytes of int64 positions, so no unsigned 16- or 32-bit tensor (whose support on devices other
than the CPU is limited) is ever made.

Payload: the values codec's payload for the ``[rows, k]`` matrix of kept values, then the indices.
Decoding scatters the values into zeros. NaN/Inf have the largest magnitudes, so they are always kept
and the values codec rejects them.

The kept positions of a row are written in increasing order (the format needs no order, as decoding
scatters; a fixed one makes packets canonical). On the CPU, and wherever the Triton kernels select (fp32
input), a tie at the k-th largest magnitude is broken toward the lower positions, so equal inputs give equal
bytes; elsewhere ``torch.topk`` breaks it.

Selection with the Triton kernels (:mod:`aqsgd.compress.kernels.triton`, on CUDA) finds each row's k-th
largest key by radix selection, three histogram passes over the keys, then writes the kept positions (and,
for a cast of the values, the whole payload) in one more pass after a pass that counts them per chunk: exact,
on the device, no host synchronisation (the check that the kept values are finite is deferred, see
:func:`aqsgd.compress.base.deferring_checks`). Decoding checks that every index lies inside its row: on a GPU
a pending check where the caller collects them (the pipeline runner), the indices clamped into the row
meanwhile.

Selection on the CPU (:func:`topk_indices`) avoids a full ``torch.topk``. Magnitudes are compared as
integers: a float's bits without the sign bit order like its magnitude, with NaN above Inf. Two
thresholds are read off a fixed random sample of each row, a few standard deviations of the sampled count
either side of the k-th largest magnitude. One pass keeps the candidates (at least the lower threshold);
those above the upper threshold are surely kept and the k-th largest key is found among the rest (the
band, a few percent of the row) by a partial sort. A row where the sample misleads (fewer than k
candidates, or more than k above the upper threshold) is ranked in full, so the result is always the
exact top k. The pass runs over chunks on ``torch.get_num_threads()`` threads.
"""

from __future__ import annotations

import functools
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np
import torch

from aqsgd.compress import kernels
from aqsgd.compress.base import (
    Codec,
    defer_check,
    defer_pending_check,
    defers_checks,
    defers_pending_checks,
    non_finite_message,
    numel_of,
)
from aqsgd.compress.cast import CAST_WHAT as _CAST_WHAT
from aqsgd.compress.cast import CastCodec
from aqsgd.compress.packet import Family, Packet, bytes_as
from aqsgd.errors import PacketError, SpecError

__all__ = ["TopKCodec", "index_dtype", "topk_indices"]

_INDEX_DTYPES = ((2**8, torch.uint8), (2**16, torch.uint16), (2**32, torch.uint32))


def index_dtype(n: int) -> torch.dtype:
    """Narrowest unsigned integer dtype that holds every index in ``range(n)``."""
    for limit, dtype in _INDEX_DTYPES:
        if n <= limit:
            return dtype
    return torch.int64


class TopKCodec(Codec):
    """Keep the ``fraction`` largest magnitudes; see the module docstring."""

    family = Family.TOPK

    def __init__(self, fraction: float, *, per: str = "row", values: Codec | None = None) -> None:
        from aqsgd.compress.cast import CastCodec

        if not (isinstance(fraction, (int, float)) and 0.0 < fraction <= 1.0 and math.isfinite(fraction)):
            raise SpecError(f"TopK fraction must be in (0, 1], got {fraction!r}")
        if per not in ("row", "tensor"):
            raise SpecError(f"TopK per must be 'row' or 'tensor', got {per!r}")
        values = values if values is not None else CastCodec("fp16")
        if values.family not in (Family.CAST, Family.QUANT):
            raise SpecError(f"TopK values codec must be a cast or a quantizer, got {values.spec!r}")
        self.fraction = float(fraction)
        self.per = per
        self.values = values

    @property
    def spec(self) -> str:
        s = f"topk{self.fraction:g}"
        if self.per != "row":
            s += ":tensor"
        if self.values.spec != "fp16":
            s += "+" + self.values.spec
        return s

    def layout(self, shape: Sequence[int]) -> tuple[int, int, int]:
        """``(rows, row_length, k)`` for a tensor of this shape."""
        numel = numel_of(shape)
        rows = int(shape[0]) if (self.per == "row" and len(shape) >= 1) else 1
        n = numel // rows if rows else 0
        k = min(n, max(1, math.ceil(self.fraction * n - 1e-9))) if n else 0
        return rows, n, k

    def payload_bytes(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> int:
        rows, n, k = self.layout(shape)
        return self.values.payload_bytes((rows, k), dtype) + rows * k * index_dtype(n).itemsize

    def _encode(self, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        rows, n, k = self.layout(x.shape)
        x2 = x.reshape(rows, n)
        if rows * k == 0:
            return torch.empty(0, dtype=torch.uint8, device=x.device)
        width = index_dtype(n).itemsize
        ops = kernels.for_tensor(x2, self.backend)
        casts = isinstance(self.values, CastCodec) and x2.dtype == torch.float32
        if casts and 0 < k < n:
            # selection, gather, cast and index packing on the device (the Triton backend's)
            done = ops.topk_payload(x2.contiguous(), k, self.values.wire_dtype, width)
            if done is not None and defers_checks(x2.device):  # the flag read later (the cast's error)
                defer_check(done[1], non_finite_message(self.values.spec, _CAST_WHAT))
                return done[0]
            if done is not None and not bool(done[1]):  # else a value is not finite: the steps below raise
                return done[0]
            # the same through the sampled selection, in one kernel (the numba backend's)
            sampling = _sampling(rows, n, k)
            if sampling is not None:
                payload = ops.topk_encode(x2, k, sampling, self.values.wire_dtype, width)
                if payload is not None:
                    return payload
        idx = topk_indices(x2, k, ops=ops)
        if casts:  # gather, cast and index packing in one pass (the numba backend's)
            payload = ops.topk_pack(x2, idx, self.values.wire_dtype, width)
            if payload is not None:
                return payload
        kept = x2.gather(1, idx)
        vals = self.values.encode(kept, generator=generator).payload
        return torch.cat([vals, _index_bytes(idx, width)])

    def _decode(self, packet: Packet) -> torch.Tensor:
        rows, n, k = self.layout(packet.shape)
        out = torch.zeros(rows, n, dtype=packet.dtype, device=packet.payload.device)
        if rows * k == 0:
            return out.view(packet.shape)
        vbytes = self.values.payload_bytes((rows, k), packet.dtype)
        inner = Packet(self.values.family, packet.dtype, (rows, k), self.values.fingerprint,
                       packet.payload[:vbytes])
        kept = self.values.decode(inner)
        # the indices start right after the values, at any byte (odd when e.g. q3 packs an odd count)
        idx = _index_values(packet.payload[vbytes:], index_dtype(n).itemsize).view(rows, k)
        bad = ((idx < 0) | (idx >= n)).any()  # int64 indices (rows over 2**32) can be negative
        if defers_pending_checks(idx.device):
            # a receiver's check on the device, read at the caller's step end; meanwhile no index outside
            # the row reaches the scatter (on CUDA: a device-side assert, the end of the CUDA context)
            defer_pending_check(bad, lambda: self._bad_indices(n))
            idx = idx.clamp(0, n - 1)
        elif bool(bad):
            raise self._bad_indices(n)
        out.scatter_(1, idx, kept)
        return out.view(packet.shape)


    def _bad_indices(self, n: int) -> PacketError:
        return PacketError(f"{self.spec}: packet holds indices outside its row of {n}")


# Magnitude keys: a float's bits without its sign bit, read as a signed integer of the same width, order
# exactly like the magnitudes, with every NaN above Inf (as torch.topk ranks NaN above everything).
_KEYS = {torch.float32: (torch.int32, np.int32), torch.float16: (torch.int16, np.int16),
         torch.bfloat16: (torch.int16, np.int16), torch.float64: (torch.int64, np.int64)}
SAMPLE = 4096  # sampled positions per row
MIN_ROW = 65536  # shorter rows are ranked in full (the sampling does not pay off)
_Z = 4.5  # margin of the thresholds, in standard deviations of the sampled count above the k-th magnitude
_CHUNK = 1 << 17  # keys scanned per task, so that the temporaries stay in cache
_KERNEL_ROWS = 2  # at least this many rows (or one per thread) take the compiled per-row kernel


@functools.lru_cache(maxsize=32)
def _sample_positions(n: int, s: int) -> np.ndarray:
    """``s`` positions in ``range(n)`` drawn with replacement by a fixed generator, sorted (for locality)."""
    return np.sort(np.random.Generator(np.random.PCG64(0x70B4)).integers(0, n, size=s))


_POOL: tuple[int, int, ThreadPoolExecutor] | None = None


def _map(fn, items: list) -> list:
    """``[fn(item) for item in items]`` on ``torch.get_num_threads()`` threads, this one included, each taking
    the next item when done with one (numpy releases the GIL in its loops). The pool belongs to the process
    that made it, so a forked child makes its own."""
    global _POOL
    threads = torch.get_num_threads()
    if threads <= 1 or len(items) <= 1:
        return [fn(item) for item in items]
    if _POOL is None or _POOL[0] != os.getpid() or _POOL[1] != threads:
        _POOL = (os.getpid(), threads, ThreadPoolExecutor(threads - 1))
    results: list = [None] * len(items)
    order = iter(range(len(items)))  # shared: next() on it is atomic under the GIL

    def drain() -> None:
        for i in order:
            results[i] = fn(items[i])

    helpers = [_POOL[2].submit(drain) for _ in range(min(threads, len(items)) - 1)]
    drain()
    for h in helpers:
        h.result()
    return results


_LOCAL = threading.local()


def _scratch(m: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """This thread's reusable buffers for ``m`` keys and ``m`` flags (fresh ones would fault their pages in
    on every call); the flags' buffer runs on past ``m`` for :func:`_positions`."""
    bufs = getattr(_LOCAL, "bufs", None)
    if bufs is None or bufs[0].size < m or bufs[0].dtype != dtype:
        bufs = _LOCAL.bufs = (np.empty(m, dtype=dtype), np.empty(m + m // 8 + 64, dtype=bool))
    return bufs[0][:m], bufs[1][:m]


def _positions(flags: np.ndarray) -> np.ndarray:
    """``np.flatnonzero(flags)`` for a view at the start of a :func:`_scratch` buffer. numpy looks for the
    True entries one by one when at most a tenth of them are True, and runs a branch-free loop over all
    entries above that; between 5 % and 10 % the latter is up to 3x faster, so there the flags are padded
    with enough True entries past their end to cross a tenth, and the padding's positions are cut off."""
    m = flags.size
    count = int(np.count_nonzero(flags))
    if not 0.05 * m < count <= 0.1 * m:
        return np.flatnonzero(flags)
    pad = math.ceil((0.1 * m - count) / 0.9) + 16
    whole = flags.base if flags.base is not None else flags
    if whole.ndim != 1 or whole.size < m + pad or not np.shares_memory(whole[:1], flags[:1]):
        return np.flatnonzero(flags)
    whole[m:m + pad] = True
    return np.flatnonzero(whole[:m + pad])[:count]


def _kernel_rows(rows: int) -> bool:
    """Whether the compiled per-row kernel takes ``rows`` rows (else a few long rows: chunks in parallel)."""
    return rows >= min(torch.get_num_threads(), _KERNEL_ROWS)


def _plan(n: int, k: int, sample: int = SAMPLE, min_row: int = MIN_ROW) -> kernels.TopkSampling | None:
    """The sampled selection of ``k`` of ``n`` (the sampled positions and the order statistics of the sample
    that give the two thresholds), or None where rows of ``n`` are ranked in full."""
    s = min(sample, n)
    mean = k * s / n
    sd = math.sqrt(mean * (1.0 - k / n))
    j_lo, j_hi = math.ceil(mean + _Z * sd + 1), math.floor(mean - _Z * sd - 1)
    if n < min_row or n <= 4 * s or j_lo >= s // 2:
        return None
    return kernels.TopkSampling(torch.from_numpy(_sample_positions(n, s)), j_lo, j_hi)


def _sampling(rows: int, n: int, k: int) -> kernels.TopkSampling | None:
    """:func:`_plan` where :func:`topk_indices` would select ``rows`` rows of ``n`` through the compiled
    kernel at its defaults, else None."""
    return _plan(n, k) if 0 < k < n and _kernel_rows(rows) else None


def topk_indices(x2: torch.Tensor, k: int, *, sample: int = SAMPLE, min_row: int = MIN_ROW,
                 ops: kernels.Kernels | None = None) -> torch.Tensor:
    """Positions ``[rows, k]`` (int64, increasing in each row) of the ``k`` largest magnitudes of each row of
    the 2-D ``x2``; NaN counts as the largest magnitude, then Inf. The set equals that of ``torch.topk`` on
    ``x2.abs()`` up to ties; on the CPU ties at the k-th magnitude go to the lower positions.

    On the CPU, rows of at least ``min_row`` values (and more than ``4 * sample``) with ``k`` below about
    45 % of the row are selected through a sample of ``sample`` positions (see the module docstring); other
    rows are ranked by ``torch.topk`` and put in canonical form, as on other devices (there without the
    tie rule). A backend with a selection kernel (Triton's, for fp32) selects every row itself, with the
    CPU's tie rule."""
    rows, n = x2.shape
    if k <= 0 or k >= n:
        return torch.arange(max(0, min(k, n)), device=x2.device).expand(rows, -1).contiguous()
    ops = ops or kernels.for_tensor(x2)
    if x2.dtype == torch.float32:
        idx = ops.topk_select(x2.contiguous(), k)  # the Triton backend's; None elsewhere
        if idx is not None:
            return idx
    if not kernels.on_host(x2.device) or x2.dtype not in _KEYS:
        return x2.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values
    tdt, ndt = _KEYS[x2.dtype]
    top = ndt(np.iinfo(ndt).max)
    xi = x2.contiguous().view(tdt).numpy()  # numpy from here: it releases the GIL, so threads can share it
    plan = _plan(n, k, sample, min_row)
    if plan is None:
        return torch.from_numpy(_exact(x2, k))
    pos, j_lo, j_hi = plan.positions.numpy(), plan.j_lo, plan.j_hi
    if _kernel_rows(rows):
        # one compiled pass per row, the rows split over the threads (the numba backend's; None elsewhere)
        done = ops.topk_rows(x2.contiguous().view(tdt), k, plan)
        if done is not None:
            picked, ok = done
            for r in np.flatnonzero(~ok.numpy()):  # the sample misled: rank these rows in full
                picked[r] = torch.from_numpy(_exact(x2[r:r + 1], k)[0])
            return picked
    steps = -(-n // _CHUNK)
    size = -(-n // steps)
    chunks = [(c, min(c + size, n)) for c in range(0, n, size)]
    out = np.empty((rows, k), dtype=np.int64)

    def thresholds(r: int) -> tuple[int, int]:
        # the (j_lo+1)-th and (j_hi+1)-th largest sampled keys (keys are >= 0: negation cannot overflow)
        neg = -(xi[r].take(pos) & top)
        part = np.partition(neg, (j_hi, j_lo) if j_hi >= 0 else j_lo)
        return int(-part[j_lo]), int(-part[j_hi]) if j_hi >= 0 else int(top)

    def scan(r: int, t_lo: int, t_hi: int, c0: int,
             c1: int) -> tuple[np.ndarray, np.ndarray, int, np.ndarray]:
        # the candidates of a chunk (key >= t_lo): positions in the row and keys, how many are surely kept
        # (key > t_hi), and the keys of the others (the band, which holds the row's k-th largest key)
        seg, flags = _scratch(c1 - c0, xi.dtype)
        np.bitwise_and(xi[r, c0:c1], top, out=seg)
        cand = _positions(np.greater_equal(seg, t_lo, out=flags))
        keys = seg.take(cand)
        cand += c0
        band = np.compress(keys <= t_hi, keys)
        return cand, keys, cand.size - band.size, band

    def settle(r: int, t_hi: int, parts: list) -> bool:
        # find the row's k-th largest key in its band and write the candidates from it up, in increasing
        # position; False where the sample misled
        need = k - sum(p[2] for p in parts)  # keys to take from the band
        nband = sum(p[3].size for p in parts)
        if need < 0 or nband < need:
            return False
        if need:
            band = np.concatenate([p[3] for p in parts])
            kth = np.partition(band, nband - need)[nband - need]
        else:
            kth = t_hi + 1
        keep = [keys >= kth for _, keys, _, _ in parts]
        counts = [int(np.count_nonzero(m)) for m in keep]
        if sum(counts) != k:  # more keys equal to the k-th than room: keep the first ones
            room = need - int(np.count_nonzero(band > kth))
            for i, (_, keys, _, _) in enumerate(parts):
                eq = keys == kth
                eq &= np.cumsum(eq) <= room
                room -= int(np.count_nonzero(eq))
                keep[i] = (keys > kth) | eq
                counts[i] = int(np.count_nonzero(keep[i]))
        at = 0
        for (cand, _, _, _), m, c in zip(parts, keep, counts):
            np.compress(m, cand, out=out[r, at:at + c])
            at += c
        return True

    def row(r: int) -> bool:
        t_lo, t_hi = thresholds(r)
        return settle(r, t_hi, [scan(r, t_lo, t_hi, c0, c1) for c0, c1 in chunks])

    if rows >= torch.get_num_threads():  # a row per task
        done = _map(row, list(range(rows)))
    else:  # few long rows: their chunks in parallel
        limits = [thresholds(r) for r in range(rows)]
        pieces = [(r, c) for r in range(rows) for c in chunks]
        scanned = _map(lambda piece: scan(piece[0], *limits[piece[0]], *piece[1]), pieces)
        done = [settle(r, limits[r][1], scanned[r * steps:(r + 1) * steps]) for r in range(rows)]
    for r in np.flatnonzero(~np.array(done)):  # the sample misled: rank these rows in full
        out[r] = _exact(x2[r:r + 1], k)[0]
    return torch.from_numpy(out)


def _exact(x2: torch.Tensor, k: int) -> np.ndarray:
    """Full ranking of the rows of ``x2`` (on the CPU, a dtype of ``_KEYS``, ``k < n``) by ``torch.topk``, in
    increasing position. The (k+1)-th largest magnitude tells whether the k-th is tied; rows with a tie or
    a NaN are settled on their keys, ties toward the lower positions."""
    vals, inds = x2.abs().topk(k + 1, dim=1, sorted=False)
    last = vals.argmin(dim=1, keepdim=True)  # the (k+1)-th largest: move the last column into its place
    after = vals.gather(1, last).view(-1)
    unsure = vals.isnan().any(dim=1)
    vals.scatter_(1, last, vals[:, k:].clone())
    inds.scatter_(1, last, inds[:, k:].clone())
    unsure |= vals[:, :k].min(dim=1).values == after
    idx = np.sort(inds[:, :k].numpy(), axis=1)  # numpy's sort is the faster on many short rows
    tdt, ndt = _KEYS[x2.dtype]
    for r in torch.nonzero(unsure).view(-1).tolist():
        row = x2[r].view(tdt).numpy() & ndt(np.iinfo(ndt).max)
        t = int(np.partition(row, row.size - k)[row.size - k])  # the k-th largest key
        eq = row == t
        eq &= np.cumsum(eq) <= k - int(np.count_nonzero(row > t))
        idx[r] = np.flatnonzero((row > t) | eq)
    return idx


def _index_bytes(idx: torch.Tensor, width: int) -> torch.Tensor:
    """The low ``width`` bytes of each (non-negative) int64 index, little-endian, in one flat uint8 tensor."""
    idx = idx.to(torch.int64).contiguous()
    if width == 8:
        return idx.view(torch.uint8).view(-1)
    if width == 1:
        return idx.to(torch.uint8).view(-1)
    return idx.view(-1, 1).view(torch.uint8)[:, :width].reshape(-1)


def _index_values(data: torch.Tensor, width: int) -> torch.Tensor:
    """Inverse of :func:`_index_bytes`: flat int64 indices from ``width`` bytes each."""
    if width == 8:
        return bytes_as(data, torch.int64).view(-1)
    if width == 1:
        return data.to(torch.int64)
    words = data.new_zeros(data.numel() // width, 8)
    words[:, :width] = data.view(-1, width)
    return words.view(torch.int64).view(-1)
