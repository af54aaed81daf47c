"""The ``numba`` backend: the kernel operations as compiled loops over CPU tensors, one pass each.

The eager quantizer is a chain of whole-tensor PyTorch operations, each a full pass over memory: scale,
multiply-add, clamp, convert, then several shift/or passes to pack the codes. Here one pass reads the input
and writes the packed codes (and, for the max-abs scale, one more pass finds the scales), with the rows split
over the threads. Decoding is one pass from packed codes to the output.

Why numba and not ``torch.compile``: Inductor emits scalar C++ for the byte packing on the CPU (q2 encode
9.2 ms against 5.9 ms eager in our trial) and compiles for ~24 s on first use; numba vectorizes these loops
with LLVM, installs as a wheel from PyPI, compiles in ~1-2 s per kernel and caches the machine code on disk
(``cache=True``), so later processes start at once.

The packets are byte-identical to the eager backend's, and tests hold that for every bit width and
granularity: the scales and the reciprocal step come from the same PyTorch code, the code of a value is
``fma(x, inv, offset)`` (PyTorch's ``addcmul`` on the CPU also rounds once) truncated after clamping to
``[0, qmax]``, and decoding multiplies an exact small integer by the same per-group step.

AQ-SGD's step against an in-memory cache has its own kernels (``delta_*``): the sender's pass reads the
activation and the cache row, quantizes ``x - m``, packs the codes and writes ``m + decode`` back into the row
in the cache's storage format (fp16 through LLVM's ``fptrunc``, which rounds to nearest even as PyTorch does;
bf16 rounded the same way in integer arithmetic); the receiver's pass unpacks, adds and stores. Where the
scale is a max, one more pass finds it from ``x - m`` without materializing it; ``l2`` and ``mean`` scales
materialize ``x - m`` once so that torch computes their means. Neither side allocates ``m``, ``x - m``, the
decoded delta or the sum, and the result is bit-identical to get, encode, decode, add, put.

Without numba the CPU takes the eager backend, after one warning.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings

import numpy as np
import torch

from aqsgd.compress.kernels import register_backend
from aqsgd.compress.kernels.base import STORE_FORMATS, Kernels, RowStore, TopkSampling

log = logging.getLogger(__name__)

__all__ = ["NumbaKernels", "available", "compile_seconds"]

_lock = threading.Lock()
_state: dict = {"kernels": None, "warned": False, "compile_s": {}}


def _load():
    """Import numba and define the kernels once; None (after one warning) where numba is missing."""
    if _state["kernels"] is not None:
        return _state["kernels"] or None
    with _lock:
        if _state["kernels"] is None:
            try:
                from aqsgd.compress.kernels import _numba as k
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


def _np(t: torch.Tensor) -> np.ndarray:
    """The numpy view of a contiguous CPU tensor (fp16/bf16 storage as its uint16 bits)."""
    if t.dtype in (torch.float16, torch.bfloat16):
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _store(store: RowStore) -> tuple[np.ndarray, np.ndarray, int]:
    return _np(store.data), store.ids.numpy(), store.fmt


class NumbaKernels(Kernels):
    """The operations of :mod:`aqsgd.compress.kernels` on CPU tensors, through the compiled loops."""

    name = "numba"

    def max_abs(self, x2: torch.Tensor, by_col: bool) -> torch.Tensor:
        """Max |x| of each column (``by_col``) or row; NaN anywhere in a group gives NaN."""
        return torch.from_numpy(_call("colmax" if by_col else "rowmax", x2.numpy()))

    def quantize_pack(self, x2: torch.Tensor, inv: torch.Tensor, by_col: bool, offset: float, bits: int,
                      qmax: int, out: torch.Tensor | None = None,
                      noise: torch.Tensor | None = None) -> torch.Tensor | None:
        if noise is not None:  # stochastic rounding: the general path's
            return None
        rows, k = x2.shape
        if out is None:
            out = torch.empty(rows, k * bits // 8, dtype=torch.uint8)
        _call("quant_pack", x2.numpy(), inv.numpy(), by_col, np.float32(offset), bits, np.float32(qmax),
              out.numpy())
        return out

    def unpack_dequantize(self, packed: torch.Tensor, step: torch.Tensor, by_col: bool, bits: int, mul: int,
                          low: int) -> torch.Tensor:
        rows = packed.shape[0]
        out = torch.empty(rows, packed.shape[1] * 8 // bits, dtype=torch.float32)
        _call("unpack_dequant", packed.numpy(), step.numpy(), by_col, bits, np.float32(mul), np.float32(low),
              out.numpy())
        return out

    def fwht(self, x2: torch.Tensor, signs: torch.Tensor, c: float, inverse: bool) -> torch.Tensor:
        """Walsh-Hadamard transform of each row: ``H (s * x) * c`` or, with ``inverse``, ``(H x * c) * s``
        (see :mod:`aqsgd.compress.hadamard`)."""
        out = torch.empty_like(x2)
        _call("fwht_rows", x2.numpy(), signs.numpy(), np.float32(c), inverse, out.numpy())
        return out

    # -- TopK
    def topk_rows(self, keys: torch.Tensor, k: int,
                  sampling: TopkSampling) -> tuple[torch.Tensor, torch.Tensor]:
        """TopK selection of :func:`aqsgd.compress.topk.topk_indices` in one compiled pass per row: the
        integer ``keys`` [R, n] (a float's bits), read without their sign bit, and the sample's two
        thresholds; the positions [R, k] (int64, increasing) and a bool per row, False where the sample misled
        (that row is to be ranked in full)."""
        kn = keys.numpy()
        out = np.empty((kn.shape[0], k), dtype=np.int64)
        ok = np.empty(kn.shape[0], dtype=np.bool_)
        _call("topk_rows", kn, _sign_mask(kn), *_sampled(sampling), int(k), out, ok, *_topk_scratch(kn))
        return torch.from_numpy(out), torch.from_numpy(ok)

    def topk_pack(self, x2: torch.Tensor, idx: torch.Tensor, wire: torch.dtype,
                  width: int) -> torch.Tensor | None:
        """TopK's payload in one pass: the values of fp32 ``x2`` [R, n] at the positions ``idx`` [R, k] cast
        to ``wire`` (fp32, fp16 or bf16, rounded as ``Tensor.to`` rounds), then the positions' low ``width``
        bytes, little-endian: byte for byte what gather, cast, index packing and concatenation make. None
        where a kept value or its cast is not finite (the caller's step-by-step path raises the codec's
        error)."""
        if x2.dtype != torch.float32 or wire not in STORE_FORMATS:
            return None
        rows, k = idx.shape
        fmt, payload, vals, index_bytes = _topk_payload(rows, k, wire, width)
        bad = np.empty(rows, dtype=np.bool_)
        _call("topk_pack", x2.numpy(), idx.numpy(), fmt, vals, int(width), index_bytes, bad)
        return None if bad.any() else torch.from_numpy(payload)

    def topk_encode(self, x2: torch.Tensor, k: int, sampling: TopkSampling, wire: torch.dtype,
                    width: int) -> torch.Tensor | None:
        """:meth:`topk_rows` and :meth:`topk_pack` in one kernel, the kept values taken from the selection's
        candidates (``x2`` is read once): the payload, or None where a row's sample misled or a kept value (or
        its cast) is not finite (the caller then takes the general path)."""
        if x2.dtype != torch.float32 or wire not in STORE_FORMATS:
            return None
        keys = x2.view(torch.int32).numpy()
        rows = keys.shape[0]
        fmt, payload, vals, index_bytes = _topk_payload(rows, k, wire, width)
        ok = np.empty(rows, dtype=np.bool_)
        bad = np.empty(rows, dtype=np.bool_)
        _call("topk_encode", keys, _sign_mask(keys), *_sampled(sampling), int(k), fmt, vals, int(width),
              index_bytes, ok, bad, *_topk_scratch(keys))
        return torch.from_numpy(payload) if ok.all() and not bad.any() else None

    # -- the rANS coder (aqsgd.compress.rans)
    def rans_count(self, body: np.ndarray, width: int, shift: int, nsyms: int) -> np.ndarray:
        return _call("rans_count", body, width, shift, nsyms)

    def rans_encode(self, body: np.ndarray, width: int, shift: int, nsym: int, block: int, freq: np.ndarray,
                    cum: np.ndarray, words: np.ndarray, states: np.ndarray, starts: np.ndarray) -> bool:
        _call("rans_encode", body, width, shift, nsym, block, freq, cum, words, states, starts)
        return True

    def rans_decode(self, words: np.ndarray, states: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                    slots: np.ndarray, freq: np.ndarray, cum: np.ndarray, nsym: int, block: int,
                    sym: np.ndarray, bad: np.ndarray) -> bool:
        _call("rans_decode", words, states, starts, ends, slots, freq, cum, nsym, block, sym, bad)
        return True

    def rans_pack(self, sym: np.ndarray, width: int, shift: int, out: np.ndarray) -> bool:
        _call("rans_pack", sym, width, shift, out)
        return True

    # -- AQ-SGD against a cache's rows
    def delta_max_abs(self, x2: torch.Tensor, store: RowStore, rpb: int, by_col: bool) -> torch.Tensor | None:
        """Max ``|x - m|`` of each column (``by_col``) or row of ``x2`` [R, K], ``m`` the store's rows
        (``rpb`` rows of ``x2`` per sample); NaN anywhere in a group gives NaN."""
        if store.device.type != "cpu":
            return None
        return torch.from_numpy(_call("delta_absmax", x2.numpy(), *_store(store)[:2], rpb, store.fmt, by_col))

    def delta(self, x2: torch.Tensor, store: RowStore, rpb: int) -> torch.Tensor | None:
        """``x - m`` (fp32 [R, K])."""
        if store.device.type != "cpu":
            return None
        out = torch.empty_like(x2)
        _call("delta_into", x2.numpy(), *_store(store)[:2], rpb, store.fmt, out.numpy())
        return out

    def delta_encode_update(self, x2: torch.Tensor, store: RowStore, rpb: int, inv: torch.Tensor,
                            by_col: bool, offset: float, bits: int, qmax: int, step: torch.Tensor, mul: int,
                            low: int, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """The sender's step: the codes of ``x - m`` packed as :meth:`quantize_pack` packs them, and each
        stored row set to ``m + (code * mul - low) * step`` rounded to the storage format, as
        ``put(m + decode(...))``."""
        if store.device.type != "cpu":
            return None
        rows, k = x2.shape
        if out is None:
            out = torch.empty(rows, k * bits // 8, dtype=torch.uint8)
        _call("delta_quant_update", x2.numpy(), *_store(store)[:2], rpb, store.fmt, inv.numpy(), by_col,
              np.float32(offset), bits, np.float32(qmax), step.numpy(), np.float32(mul), np.float32(low),
              out.numpy())
        return out

    def delta_decode_update(self, packed: torch.Tensor, store: RowStore, rpb: int, step: torch.Tensor,
                            by_col: bool, bits: int, mul: int, low: int) -> torch.Tensor | None:
        """The receiver's step: each stored row set to ``m + (code * mul - low) * step`` in the storage
        format, and the result (fp32 [R, K]) the stored values, as ``put(m + decode(...))`` returns them."""
        if store.device.type != "cpu":
            return None
        rows = packed.shape[0]
        out = torch.empty(rows, packed.shape[1] * 8 // bits, dtype=torch.float32)
        _call("delta_dequant_update", packed.numpy(), *_store(store)[:2], rpb, store.fmt, step.numpy(),
              by_col, bits, np.float32(mul), np.float32(low), out.numpy())
        return out


_TOPK_LOCAL = threading.local()


def _sign_mask(keys: np.ndarray):
    """All bits of the keys' integer type but the sign bit (a magnitude's key is ``key & mask``)."""
    return keys.dtype.type(np.iinfo(keys.dtype).max)


def _sampled(sampling: TopkSampling) -> tuple[np.ndarray, int, int]:
    return sampling.positions.numpy(), int(sampling.j_lo), int(sampling.j_hi)


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
    fmt = STORE_FORMATS[wire]
    vbytes = rows * k * wire.itemsize
    payload = np.empty(vbytes + rows * k * width, dtype=np.uint8)
    vals = payload[:vbytes].view(np.float32 if fmt == 0 else np.uint16).reshape(rows, k)
    return fmt, payload, vals, payload[vbytes:]


def round_to_storage(v: np.ndarray, store: RowStore) -> None:
    """Round every value of fp32 ``v`` into row 0 of the store as the kernels store values (tests)."""
    _call("round_to_storage", v, _np(store.data), store.fmt)


register_backend("numba", NumbaKernels, runs_on=lambda device: device.type == "cpu" and available(),
                 default_on=("cpu",), rank=10)
