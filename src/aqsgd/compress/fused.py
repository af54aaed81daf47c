"""Fused quantize-and-pack and unpack-and-dequantize for CPU tensors, compiled with numba.

The eager quantizer (:mod:`aqsgd.compress.quant`) is a chain of whole-tensor PyTorch operations, each a
full pass over memory: scale, multiply-add, clamp, convert, then several shift/or passes to pack the codes.
Here one pass reads the input and writes the packed codes (and, for the max-abs scale, one more pass finds
the scales), with the rows split over the threads. Decoding is one pass from packed codes to the output.

Why numba and not ``torch.compile``: Inductor emits scalar C++ for the byte packing on the CPU (q2 encode
9.2 ms against 5.9 ms eager in our trial) and compiles for ~24 s on first use; numba vectorizes these loops
with LLVM, installs as a wheel from PyPI, compiles in ~1-2 s per kernel and caches the machine code on disk
(``cache=True``), so later processes start at once.

The packets are byte-identical to the eager path's, and tests hold that for every bit width and
granularity: the scales and the reciprocal step come from the same PyTorch code, the code of a value is
``fma(x, inv, offset)`` (PyTorch's ``addcmul`` on the CPU also rounds once) truncated after clamping to
``[0, qmax]``, and decoding multiplies an exact small integer by the same per-group step.

Used only where it applies: a CPU tensor computed in fp32 (fp32, bf16 or fp16 input), nearest rounding, a
last dimension that is a multiple of 8, and for ``blockN`` a block size that is a multiple of 8 and divides
the tensor. Everything else (stochastic rounding, float64, CUDA tensors, odd shapes) takes the eager path.
Without numba every codec takes the eager path, after one warning. ``AQSGD_FUSED=0`` forces the eager path.

AQ-SGD's step against an in-memory cache has its own kernels (:class:`RowStore`, ``delta_*``): the sender's
pass reads the activation and the cache row, quantizes ``x - m``, packs the codes and writes ``m + decode``
back into the row in the cache's storage format (fp16 through LLVM's ``fptrunc``, which rounds to nearest
even as PyTorch does; bf16 rounded the same way in integer arithmetic); the receiver's pass unpacks, adds and
stores. Where the scale is a max, one more pass finds it from ``x - m`` without materializing it; ``l2`` and
``mean`` scales materialize ``x - m`` once so that torch computes their means. Neither side allocates ``m``,
``x - m``, the decoded delta or the sum, and the result is bit-identical to get, encode, decode, add, put.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

log = logging.getLogger(__name__)

__all__ = ["available", "enabled", "set_enabled", "compile_seconds", "encode", "decode_into", "plan", "fwht",
           "topk_rows", "topk_pack", "topk_encode", "RowStore", "delta_max_abs", "delta_into",
           "delta_encode_update", "delta_decode_update"]

_lock = threading.Lock()
_state: dict = {"enabled": os.environ.get("AQSGD_FUSED", "1") not in ("0", "false", "no", "off"),
                "kernels": None, "warned": False, "compile_s": {}}


def _load():
    """Import numba and define the kernels once; None (after one warning) where numba is missing."""
    if _state["kernels"] is not None:
        return _state["kernels"] or None
    with _lock:
        if _state["kernels"] is None:
            try:
                from aqsgd.compress import _fused_kernels as k
            except ImportError as e:  # numba absent, or built for another numpy
                _state["kernels"] = False
                if not _state["warned"]:
                    _state["warned"] = True
                    warnings.warn(f"fused codec kernels unavailable ({e}); quantization uses the slower "
                                  "eager PyTorch path (pip install numba)", RuntimeWarning, stacklevel=3)
            else:
                _state["kernels"] = k
    return _state["kernels"] or None


def available() -> bool:
    """Whether the numba kernels can be used at all on this machine."""
    return _load() is not None


def enabled() -> bool:
    """Whether codecs take the fused path where it applies (numba present and not switched off)."""
    return _state["enabled"] and available()


def set_enabled(flag: bool) -> bool:
    """Switch the fused path on or off for this process; returns the previous setting (tests, A/B runs)."""
    old = _state["enabled"]
    _state["enabled"] = bool(flag)
    return old


def compile_seconds() -> dict[str, float]:
    """Seconds each kernel's first call took in this process (compile, or load from numba's disk cache)."""
    return dict(_state["compile_s"])


def _call(name: str, *args):
    torch_threads = torch.get_num_threads()
    try:
        return _call_kernel(name, *args)
    finally:
        # numba's OpenMP pool shares the thread setting with torch's: put torch's back
        if torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)


def _call_kernel(name: str, *args):
    k = _load()
    fn = getattr(k, name)
    threads = max(1, min(torch.get_num_threads(), k.max_threads()))
    if name in _state["compile_s"]:
        if _state.get("serialize"):
            with _lock:
                return fn(threads, *args)
        return fn(threads, *args)
    with _lock:
        t0 = time.perf_counter()
        out = fn(threads, *args)
        dt = time.perf_counter() - t0
        _state["compile_s"][name] = dt
        # numba's own 'workqueue' pool (used where neither OpenMP nor TBB loads) aborts the process when two
        # threads launch kernels at once: serialize the calls there
        _state["serialize"] = k.threading_layer() == "workqueue"
    log.info("fused codec kernel %s ready in %.2f s (first call: compile or cache load)", name, dt)
    return out


def plan(shape: Sequence[int], granularity: str, block: int) -> tuple[int, int, bool] | None:
    """``(rows, row_length, scale_per_column)`` of the 2-D view the kernels work on, or None (eager)."""
    numel = 1
    for d in shape:
        numel *= int(d)
    if numel == 0 or len(shape) == 0:
        return None
    cols = int(shape[-1])
    if granularity == "block":
        if block % 8 or numel % block:
            return None
        return numel // block, block, False
    if cols % 8:
        return None
    return numel // cols, cols, granularity == "channel"


def applies(x: torch.Tensor, rounding: str) -> bool:
    return (x.device.type == "cpu" and rounding == "nearest"
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and enabled())


def max_abs(x2: np.ndarray, by_col: bool) -> np.ndarray:
    """Max |x| of each column (``by_col``) or row of a 2-D fp32 array; NaN anywhere in a group gives NaN."""
    return _call("colmax" if by_col else "rowmax", x2)


def encode(x2: np.ndarray, inv: np.ndarray, by_col: bool, offset: float, bits: int, qmax: int,
           out: np.ndarray) -> None:
    """Codes ``trunc(clamp(fma(x, inv, offset), 0, qmax))`` of ``x2`` [R, K], packed into ``out``
    [R, K*bits/8]."""
    _call("quant_pack", x2, inv, by_col, np.float32(offset), bits, np.float32(qmax), out)


def decode_into(packed: np.ndarray, step: np.ndarray, by_col: bool, bits: int, mul: int, low: int,
                out: np.ndarray) -> None:
    """``out[r, j] = (code * mul - low) * step[group]`` from packed codes [R, K*bits/8] into fp32 ``out``
    [R, K]."""
    _call("unpack_dequant", packed, step, by_col, bits, np.float32(mul), np.float32(low), out)


def fwht(x2: np.ndarray, signs: np.ndarray, c: float, inverse: bool, out: np.ndarray) -> None:
    """Walsh-Hadamard transform of each row of fp32 ``x2`` [R, G] into ``out``: ``H (s * x) * c`` or, with
    ``inverse``, ``(H x * c) * s`` (see :mod:`aqsgd.compress.hadamard`)."""
    _call("fwht_rows", x2, signs, np.float32(c), inverse, out)


def topk_rows(keys: np.ndarray, mask: int, pos: np.ndarray, j_lo: int, j_hi: int, k: int,
              out: np.ndarray) -> np.ndarray:
    """TopK selection of :func:`aqsgd.compress.topk.topk_indices` in one compiled pass per row: the integer
    ``keys`` [R, n] (a float's bits), their sign ``mask``, the sampled positions and the order statistics of
    the two thresholds; writes ``out`` [R, k] (int64, increasing positions) and returns a bool per row, False
    where the sample misled (that row is to be ranked in full)."""
    ok = np.empty(keys.shape[0], dtype=np.bool_)
    _call("topk_rows", keys, keys.dtype.type(mask), pos, int(j_lo), int(j_hi), int(k), out, ok,
          *_topk_scratch(keys))
    return ok


_TOPK_LOCAL = threading.local()


def _topk_scratch(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """This thread's candidate buffers for the TopK kernels, one row per kernel thread, kept between calls
    (fresh ones would fault their pages in on every call)."""
    rows, n = keys.shape
    threads = max(1, min(torch.get_num_threads(), rows))
    bufs = getattr(_TOPK_LOCAL, "bufs", None)
    if bufs is None or bufs[0].shape[0] < threads or bufs[0].shape[1] < n or bufs[1].dtype != keys.dtype:
        bufs = _TOPK_LOCAL.bufs = (np.empty((threads, n), np.int64), np.empty((threads, n), keys.dtype))
    return bufs[0][:threads, :n], bufs[1][:threads, :n]


def _topk_payload(rows: int, k: int, wire: torch.dtype,
                  width: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """TopK's payload layout: ``(storage format, payload, values [rows, k] in the wire format's storage view,
    index bytes)``, the values first, as the codec writes them."""
    fmt = _STORE_FORMATS[wire]
    vbytes = rows * k * wire.itemsize
    payload = np.empty(vbytes + rows * k * width, dtype=np.uint8)
    vals = payload[:vbytes].view(np.float32 if fmt == 0 else np.uint16).reshape(rows, k)
    return fmt, payload, vals, payload[vbytes:]


def topk_pack(x: np.ndarray, idx: np.ndarray, wire: torch.dtype, width: int) -> np.ndarray | None:
    """TopK's payload in one pass: the values of fp32 ``x`` [R, n] at the positions ``idx`` [R, k] cast to
    ``wire`` (fp32, fp16 or bf16, rounded as ``Tensor.to`` rounds), then the positions' low ``width`` bytes,
    little-endian: byte for byte what gather, cast, index packing and concatenation make. None where a kept
    value or its cast is not finite (the caller's step-by-step path raises the codec's error)."""
    rows, k = idx.shape
    fmt, payload, vals, index_bytes = _topk_payload(rows, k, wire, width)
    bad = np.empty(rows, dtype=np.bool_)
    _call("topk_pack", x, idx, fmt, vals, int(width), index_bytes, bad)
    return None if bad.any() else payload


def topk_encode(keys: np.ndarray, mask: int, pos: np.ndarray, j_lo: int, j_hi: int, k: int, wire: torch.dtype,
                width: int) -> np.ndarray | None:
    """:func:`topk_rows` and :func:`topk_pack` in one kernel, the kept values taken from the selection's
    candidates (``x`` is read once): the payload, or None where a row's sample misled or a kept value (or its
    cast) is not finite (the caller then takes the general path)."""
    rows = keys.shape[0]
    fmt, payload, vals, index_bytes = _topk_payload(rows, k, wire, width)
    ok = np.empty(rows, dtype=np.bool_)
    bad = np.empty(rows, dtype=np.bool_)
    _call("topk_encode", keys, keys.dtype.type(mask), pos, int(j_lo), int(j_hi), int(k), fmt, vals,
          int(width), index_bytes, ok, bad, *_topk_scratch(keys))
    return payload if ok.all() and not bad.any() else None


# ------------------------------------------------------------------------------ AQ-SGD against a memory cache
_STORE_FORMATS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # the kernels' FMT_* codes


@dataclass(frozen=True)
class RowStore:
    """Rows of an activation cache's CPU storage that a codec's fused AQ-SGD step reads and updates in place.

    ``data`` is the whole storage ``[capacity, n]`` (fp32, or the uint16 bits of fp16/bf16 rows) sharing
    memory with the cache's tensor; ``ids`` (int64) are the rows of the micro-batch, in its order; ``fmt`` is
    the storage format. Built by the cache (:meth:`ActivationCache.row_store`), which has validated the ids.
    """

    data: np.ndarray
    ids: np.ndarray
    fmt: int

    @property
    def row_numel(self) -> int:
        return int(self.data.shape[1])

    @classmethod
    def of(cls, storage: torch.Tensor, ids: torch.Tensor) -> "RowStore | None":
        """The store over ``storage`` [capacity, *row_shape]; None where the kernels cannot update it in place
        (not on the CPU, another dtype, not contiguous) or where they are off."""
        fmt = _STORE_FORMATS.get(storage.dtype)
        if fmt is None or storage.device.type != "cpu" or not storage.is_contiguous() or not enabled():
            return None
        flat = storage.detach().view(storage.shape[0], -1)
        data = flat.numpy() if fmt == 0 else flat.view(torch.int16).numpy().view(np.uint16)
        return cls(data, ids.to(device="cpu", dtype=torch.int64).contiguous().numpy(), fmt)


def delta_max_abs(x2: np.ndarray, store: RowStore, rpb: int, by_col: bool) -> np.ndarray:
    """Max ``|x - m|`` of each column (``by_col``) or row of fp32 ``x2`` [R, K], ``m`` the store's rows
    (``rpb`` rows of ``x2`` per sample); NaN anywhere in a group gives NaN."""
    return _call("delta_absmax", x2, store.data, store.ids, rpb, store.fmt, by_col)


def delta_into(x2: np.ndarray, store: RowStore, rpb: int, out: np.ndarray) -> None:
    """``out = x - m`` (fp32 [R, K])."""
    _call("delta_into", x2, store.data, store.ids, rpb, store.fmt, out)


def delta_encode_update(x2: np.ndarray, store: RowStore, rpb: int, inv: np.ndarray, by_col: bool,
                        offset: float, bits: int, qmax: int, step: np.ndarray, mul: int, low: int,
                        out: np.ndarray) -> None:
    """The sender's step: codes of ``x - m`` packed into ``out`` as :func:`encode` packs them, and each stored
    row set to ``m + (code * mul - low) * step`` rounded to the storage format, as
    ``put(m + decode(...))``."""
    _call("delta_quant_update", x2, store.data, store.ids, rpb, store.fmt, inv, by_col, np.float32(offset),
          bits, np.float32(qmax), step, np.float32(mul), np.float32(low), out)


def delta_decode_update(packed: np.ndarray, store: RowStore, rpb: int, step: np.ndarray, by_col: bool,
                        bits: int, mul: int, low: int, out: np.ndarray) -> None:
    """The receiver's step: each stored row set to ``m + (code * mul - low) * step`` in the storage format,
    and ``out`` (fp32 [R, K]) to the stored values, as ``put(m + decode(...))`` returns them."""
    _call("delta_dequant_update", packed, store.data, store.ids, rpb, store.fmt, step, by_col, bits,
          np.float32(mul), np.float32(low), out)


def round_to_storage(v: np.ndarray, store: RowStore) -> None:
    """Round every value of fp32 ``v`` into row 0 of the store as the kernels store values (tests)."""
    _call("round_to_storage", v, store.data, store.fmt)
