"""Per-sample activation caches for AQ-SGD.

AQ-SGD keeps, at every pipeline boundary, a message cache ``m(xi)``: one row per training sample id
``xi`` in ``[0, capacity)``, every row of the same shape (for example ``[seq, hidden]``). The sender
transmits the compressed *difference* between the new activation and ``m(xi)``; both sides then
update ``m(xi)``. Training is only correct if the sender's and the receiver's caches stay
**bit-identical**, which this module guarantees through one contract:

    ``put(ids, rows)`` returns exactly the tensor a later ``get(ids)`` returns
    (same values bit for bit, same dtype, same device).

The stored representation may be coarser than the rows handed in (fp16 storage, low-bit codes), so
schemes must continue with the *return value of* ``put`` rather than with their own ``rows``. Every
backend is deterministic: two caches given the same sequence of puts return bit-identical gets, on
CPU and on CUDA.

Backends
--------
:class:`MemoryCache`
    One preallocated tensor ``[capacity, *row_shape]`` in the storage dtype (fp16 by default, as in
    the AQ-SGD reference implementation; bf16 and fp32 are supported) on ``device``, plus a bool
    visited mask. Allocated at construction, or at the first ``put`` when ``row_shape`` is ``None``.
:class:`DiskCache`
    Rows live in a ``numpy.memmap`` file (created sparse; bf16 is stored as its uint16 bit
    patterns), so RAM stays bounded whatever the capacity; the visited mask is in RAM.
    ``prefetch(ids)`` reads rows on one background thread; ``get`` with the same ids uses that
    result. Consistency rule: ``put`` writes synchronously in the caller's thread and first drops
    every held prefetch whose ids overlap the put, so a ``get`` always sees the latest ``put``.
:class:`LowBitCache`
    The cache itself stored quantized (the reference's "delta-lowbits" idea): each flattened row is
    split into blocks of ``block`` consecutive values with one fp16 scale per block and bit-packed
    ``bits``-bit codes (:func:`aqsgd.compress.quant.quantize_groups`).

Common rules
------------
* ``ids`` is a 1-D integer tensor of unique ids in ``[0, capacity)``; anything else raises
  :class:`CacheError` (ids are never wrapped around). Calls are validated before anything is
  written, so a rejected ``put`` changes nothing. Empty ``ids`` are allowed.
* ``rows`` must have shape ``[len(ids), *row_shape]``.
* ``get`` of an id that was never put (or was forgotten by ``reset``) raises :class:`CacheError`.
* ``save(directory)`` / ``load(directory)`` write and read safetensors files plus a ``meta.json``
  (no pickle). ``load`` restores into an existing cache of the same backend, capacity, row shape and
  storage format, and raises :class:`CacheError` otherwise.
"""

from __future__ import annotations

import abc
import collections
import json
import math
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from aqsgd.compress.quant import dequantize_groups, quantize_groups
from aqsgd.errors import CacheError

__all__ = [
    "ActivationCache",
    "CacheError",
    "DiskCache",
    "LowBitCache",
    "MemoryCache",
]




_FORMAT = "aqsgd-activation-cache"
_FORMAT_VERSION = 1
_META_FILE = "meta.json"
_TENSORS_FILE = "cache.safetensors"
_ROWS_FILE = "rows.bin"

_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
}
_STORAGE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_COMPUTE_DTYPES = tuple(_DTYPE_NAMES)
# Expected (shape, dtype) of one tensor in a checkpoint.
_TensorSpec = tuple[tuple[int, ...], torch.dtype]
# numpy dtype of the memmap file for each storage dtype (numpy has no bfloat16: keep its bit pattern).
_NUMPY_STORAGE: dict[torch.dtype, type[np.generic]] = {
    torch.float16: np.float16,
    torch.bfloat16: np.uint16,
    torch.float32: np.float32,
}


def _check_dtype(dtype: torch.dtype, what: str, allowed: Sequence[torch.dtype]) -> torch.dtype:
    if dtype not in allowed:
        names = ", ".join(_DTYPE_NAMES[d] for d in allowed)
        raise CacheError(f"{what} must be one of {names}; got {dtype}")
    return dtype


def _check_row_shape(row_shape: Sequence[int]) -> tuple[int, ...]:
    try:
        shape = tuple(int(d) for d in row_shape)
    except (TypeError, ValueError):
        raise CacheError(f"row_shape must be a sequence of positive ints, got {row_shape!r}") from None
    if any(d <= 0 for d in shape):
        raise CacheError(f"row_shape must contain positive sizes only, got {shape}")
    return shape


def _normalize_device(device: torch.device | str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _format_ids(ids: Tensor, limit: int = 8) -> str:
    values = ids[:limit].tolist()
    more = f", ... ({ids.numel()} in all)" if ids.numel() > limit else ""
    return ", ".join(str(v) for v in values) + more


def _copy_file_sparse(src: Path, dst: Path, chunk: int = 1 << 20) -> None:
    """Copy ``src`` to ``dst`` in bounded memory, leaving holes where ``src`` has all-zero chunks."""
    size = src.stat().st_size
    zeros = bytes(chunk)
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while True:
            buf = fin.read(chunk)
            if not buf:
                break
            if buf == zeros[: len(buf)]:
                fout.seek(len(buf), os.SEEK_CUR)
            else:
                fout.write(buf)
        fout.truncate(size)


class ActivationCache(abc.ABC):
    """Rows of a fixed shape keyed by integer sample id in ``[0, capacity)``.

    Attributes:
        capacity: number of ids the cache can hold (valid ids are ``0 .. capacity-1``).
        row_shape: shape of one row; ``None`` until fixed by the first ``put`` where allowed.
        dtype: dtype of the tensors returned by :meth:`get` and :meth:`put`.
        device: device of the tensors returned by :meth:`get` and :meth:`put`.

    Subclasses implement the storage hooks; validation, the visited mask and the checkpoint metadata
    are shared here.
    """

    backend: ClassVar[str]

    capacity: int
    row_shape: tuple[int, ...] | None
    dtype: torch.dtype
    device: torch.device

    def __init__(
        self,
        capacity: int,
        row_shape: Sequence[int] | None,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        num_samples: int | None,
        mask_device: torch.device | None = None,
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise CacheError(f"capacity must be a positive int, got {capacity!r}")
        self.capacity = capacity
        self.row_shape = None if row_shape is None else _check_row_shape(row_shape)
        self.dtype = _check_dtype(dtype, "dtype", _COMPUTE_DTYPES)
        self.device = _normalize_device(device)
        self._visited = torch.zeros(capacity, dtype=torch.bool, device=mask_device or self.device)
        if num_samples is not None:
            self.check_capacity(num_samples)

    # ------------------------------------------------------------------ public API

    def check_capacity(self, num_samples: int) -> None:
        """Raise :class:`CacheError` if ids ``0 .. num_samples-1`` (the dataset) do not all fit."""
        if num_samples > self.capacity:
            raise CacheError(
                f"{type(self).__name__} capacity {self.capacity} is too small for a dataset of "
                f"{num_samples} samples: a capacity of at least {num_samples} is needed"
            )

    def visited(self, ids: Tensor) -> Tensor:
        """Bool tensor ``[len(ids)]`` on ``ids.device``: whether each id has been put."""
        ids = self._check_ids(ids)
        return self._visited[ids.to(self._visited.device)].to(ids.device)

    def get(self, ids: Tensor) -> Tensor:
        """Rows ``[len(ids), *row_shape]`` (``dtype``, on ``device``), bit-identical to their last put."""
        ids = self._check_ids(ids)
        if self.row_shape is None and ids.numel() == 0:
            raise CacheError("get() of no ids before the row shape is known (no put() yet)")
        self._require_visited(ids)
        if ids.numel() == 0:
            return torch.empty((0, *self._shape()), dtype=self.dtype, device=self.device)
        return self._read(ids)

    def put(self, ids: Tensor, rows: Tensor) -> Tensor:
        """Store ``rows`` for ``ids`` and return the stored representation (what ``get(ids)`` will return).

        Use the returned tensor, not ``rows``, for anything the other side of the boundary must
        reproduce: it is rounded to the storage format.
        """
        ids = self._check_ids(ids)
        rows = self._check_rows(ids, rows)
        out = self._write(ids, rows.detach())
        self._visited[ids.to(self._visited.device)] = True
        if out.numel() > 0 and out.device == rows.device and out.data_ptr() == rows.data_ptr():
            out = out.clone()  # never hand the caller's own tensor back
        return out

    def prefetch(self, ids: Tensor) -> None:
        """Hint that ``get(ids)`` follows soon. A no-op for in-memory backends (ids are still validated)."""
        self._check_ids(ids)

    def reset(self) -> None:
        """Forget every row: all ids become unvisited. The row shape and the allocated storage are kept."""
        self._visited.zero_()

    @property
    def nbytes(self) -> int:
        """Bytes of storage: rows (or codes and scales) plus the visited mask."""
        return self._payload_nbytes() + self._visited.numel() * self._visited.element_size()

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write the cache to ``directory`` (created if needed): safetensors data plus ``meta.json``.

        ``meta.json`` is written last, so an interrupted save is never mistaken for a checkpoint.
        """
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        (path / _META_FILE).unlink(missing_ok=True)
        self._save_payload(path)
        (path / _META_FILE).write_text(json.dumps(self._metadata(), indent=2, sort_keys=True) + "\n")

    def load(self, directory: str | os.PathLike[str]) -> None:
        """Replace this cache's contents with a checkpoint written by :meth:`save`.

        Raises :class:`CacheError` if the directory holds no checkpoint, or one written by another
        backend or with a different capacity, row shape or storage format. The compute ``dtype`` and
        ``device`` of this cache are kept (gets are bit-identical when they match the saved ones).
        """
        path = Path(directory)
        meta_path = path / _META_FILE
        try:
            meta = json.loads(meta_path.read_text())
        except FileNotFoundError:
            raise CacheError(f"no activation-cache checkpoint in {path} ({_META_FILE} is missing)") from None
        except json.JSONDecodeError as exc:
            raise CacheError(f"{meta_path} is not valid JSON: {exc}") from None
        if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
            raise CacheError(f"{meta_path} is not an activation-cache checkpoint")
        if meta.get("version") != _FORMAT_VERSION:
            raise CacheError(
                f"{meta_path} has format version {meta.get('version')}, expected {_FORMAT_VERSION}"
            )
        if meta.get("backend") != self.backend:
            raise CacheError(
                f"{path} holds a {meta.get('backend')!r} cache; cannot load it into a {type(self).__name__} "
                f"({self.backend!r})"
            )
        if meta.get("capacity") != self.capacity:
            raise CacheError(
                f"{path} holds a cache of capacity {meta.get('capacity')}, this one has {self.capacity}"
            )
        saved_shape = None if meta.get("row_shape") is None else tuple(meta["row_shape"])
        if saved_shape is not None and self.row_shape is not None and saved_shape != self.row_shape:
            raise CacheError(
                f"{path} holds rows of shape {saved_shape}, this cache has row_shape {self.row_shape}"
            )
        if saved_shape is None and self.row_shape is None and not self._lazy_shape_ok():
            raise CacheError(f"{path} holds no row shape")
        for key, value in self._backend_metadata().items():
            if meta.get(key) != value:
                raise CacheError(
                    f"{path} was saved with {key}={meta.get(key)!r}, this cache has {key}={value!r}"
                )
        self._load_payload(path, saved_shape)

    def __repr__(self) -> str:
        extra = ", ".join(f"{k}={v}" for k, v in self._backend_metadata().items())
        return (
            f"{type(self).__name__}(capacity={self.capacity}, row_shape={self.row_shape}, "
            f"dtype={_DTYPE_NAMES[self.dtype]}, device={self.device}, {extra})"
        )

    # ------------------------------------------------------------------ validation helpers

    def _check_ids(self, ids: Tensor) -> Tensor:
        """Validate ``ids`` and return them as int64 (on their own device)."""
        if not isinstance(ids, Tensor):
            raise CacheError(f"ids must be a torch.Tensor, got {type(ids).__name__}")
        if ids.dim() != 1:
            raise CacheError(f"ids must be a 1-D tensor, got shape {tuple(ids.shape)}")
        if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
            raise CacheError(f"ids must have an integer dtype, got {ids.dtype}")
        ids = ids.to(torch.int64)
        if ids.numel() == 0:
            return ids
        out_of_range = (ids < 0) | (ids >= self.capacity)
        ordered = torch.sort(ids).values
        repeated = ordered[1:] == ordered[:-1]
        bad_range, bad_dup = torch.stack([out_of_range.any(), repeated.any()]).tolist()
        if bad_range:
            first = int(ids[out_of_range][0])
            raise CacheError(
                f"sample id {first} is out of range for a cache of capacity {self.capacity} "
                f"(valid ids are 0..{self.capacity - 1})"
            )
        if bad_dup:
            first = int(ordered[1:][repeated][0])
            raise CacheError(f"sample id {first} appears more than once in one call; ids must be unique")
        return ids

    def _check_rows(self, ids: Tensor, rows: Tensor) -> Tensor:
        if not isinstance(rows, Tensor):
            raise CacheError(f"rows must be a torch.Tensor, got {type(rows).__name__}")
        if not rows.is_floating_point():
            raise CacheError(f"rows must have a floating-point dtype, got {rows.dtype}")
        n = ids.numel()
        if self.row_shape is None:
            if rows.dim() < 2 or rows.shape[0] != n:
                raise CacheError(
                    f"rows have shape {tuple(rows.shape)}; expected [len(ids)={n}, *row_shape] "
                    f"with at least one row dimension"
                )
            self._allocate(_check_row_shape(rows.shape[1:]))
        expected = (n, *self._shape())
        if tuple(rows.shape) != expected:
            raise CacheError(
                f"rows have shape {tuple(rows.shape)} but this cache expects {expected} "
                f"(len(ids)={n}, row_shape={self.row_shape})"
            )
        return rows

    def _require_visited(self, ids: Tensor) -> None:
        if ids.numel() == 0:
            return
        seen = self._visited[ids.to(self._visited.device)]
        if not bool(seen.all()):
            missing = ids[~seen.to(ids.device)]
            raise CacheError(
                f"sample ids [{_format_ids(missing)}] have not been put into this cache "
                f"(get() needs an earlier put() of every id)"
            )

    def _shape(self) -> tuple[int, ...]:
        assert self.row_shape is not None
        return self.row_shape

    def _metadata(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "version": _FORMAT_VERSION,
            "backend": self.backend,
            "capacity": self.capacity,
            "row_shape": None if self.row_shape is None else list(self.row_shape),
            "dtype": _DTYPE_NAMES[self.dtype],
            **self._backend_metadata(),
        }

    def _load_tensors(self, path: Path, expected: dict[str, _TensorSpec]) -> dict[str, Tensor]:
        """Load ``cache.safetensors`` and check every tensor's shape and dtype against ``expected``."""
        file = path / _TENSORS_FILE
        try:
            tensors = load_file(str(file))
        except FileNotFoundError:
            raise CacheError(f"{file} is missing") from None
        except Exception as exc:  # safetensors raises its own error types for damaged files
            raise CacheError(f"cannot read {file}: {exc}") from None
        for name, (shape, dtype) in expected.items():
            t = tensors.get(name)
            if t is None or tuple(t.shape) != shape or t.dtype != dtype:
                got = None if t is None else (tuple(t.shape), t.dtype)
                raise CacheError(f"{file}: tensor {name!r} should be {(shape, dtype)}, found {got}")
        return tensors

    # ------------------------------------------------------------------ backend hooks

    def _lazy_shape_ok(self) -> bool:
        """Whether this backend may stay without a row shape (restoring an empty, never-used cache)."""
        return False

    @abc.abstractmethod
    def _allocate(self, row_shape: tuple[int, ...]) -> None:
        """Fix ``self.row_shape`` and allocate storage (only called while it is ``None``)."""

    @abc.abstractmethod
    def _read(self, ids: Tensor) -> Tensor:
        """Rows of validated, visited, non-empty ``ids`` as ``dtype`` on ``device``."""

    @abc.abstractmethod
    def _write(self, ids: Tensor, rows: Tensor) -> Tensor:
        """Store validated rows and return what :meth:`_read` would return for ``ids``."""

    @abc.abstractmethod
    def _payload_nbytes(self) -> int:
        """Bytes of row storage, excluding the visited mask."""

    @abc.abstractmethod
    def _backend_metadata(self) -> dict[str, Any]:
        """Metadata that must match between a checkpoint and the cache loading it."""

    @abc.abstractmethod
    def _save_payload(self, path: Path) -> None:
        """Write rows and visited mask into the (existing) directory ``path``."""

    @abc.abstractmethod
    def _load_payload(self, path: Path, row_shape: tuple[int, ...] | None) -> None:
        """Read what :meth:`_save_payload` wrote; the metadata has already been checked."""


class MemoryCache(ActivationCache):
    """All rows in one tensor ``[capacity, *row_shape]`` of ``storage_dtype`` on ``device``.

    Args:
        capacity: number of sample ids (dataset size).
        row_shape: shape of one row; ``None`` to fix it (and allocate) at the first :meth:`put`.
        storage_dtype: fp16 (default, as in the AQ-SGD reference), bf16 or fp32.
        dtype: dtype returned by :meth:`get` / :meth:`put`.
        device: where the storage lives and results are returned.
        num_samples: if given, :meth:`check_capacity` is called with it.
    """

    backend: ClassVar[str] = "memory"

    def __init__(
        self,
        capacity: int,
        row_shape: Sequence[int] | None = None,
        *,
        storage_dtype: torch.dtype = torch.float16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        num_samples: int | None = None,
    ) -> None:
        super().__init__(capacity, row_shape, dtype=dtype, device=device, num_samples=num_samples)
        self.storage_dtype = _check_dtype(storage_dtype, "storage_dtype", _STORAGE_DTYPES)
        self._rows: Tensor | None = None
        if self.row_shape is not None:
            self._alloc_rows(self.row_shape)

    def _alloc_rows(self, row_shape: tuple[int, ...]) -> None:
        self._rows = torch.zeros((self.capacity, *row_shape), dtype=self.storage_dtype, device=self.device)

    def _allocate(self, row_shape: tuple[int, ...]) -> None:
        self.row_shape = row_shape
        self._alloc_rows(row_shape)

    def _lazy_shape_ok(self) -> bool:
        return True

    def _read(self, ids: Tensor) -> Tensor:
        assert self._rows is not None
        return self._rows[ids.to(self.device)].to(self.dtype)

    def _write(self, ids: Tensor, rows: Tensor) -> Tensor:
        assert self._rows is not None
        stored = rows.to(device=self.device, dtype=self.storage_dtype)
        self._rows[ids.to(self.device)] = stored
        return stored.to(self.dtype)

    def _payload_nbytes(self) -> int:
        return 0 if self._rows is None else self._rows.numel() * self._rows.element_size()

    def _backend_metadata(self) -> dict[str, Any]:
        return {"storage_dtype": _DTYPE_NAMES[self.storage_dtype]}

    def _save_payload(self, path: Path) -> None:
        tensors = {"visited": self._visited.cpu()}
        if self._rows is not None:
            tensors["rows"] = self._rows.cpu().contiguous()
        save_file(tensors, str(path / _TENSORS_FILE))

    def _load_payload(self, path: Path, row_shape: tuple[int, ...] | None) -> None:
        expected: dict[str, _TensorSpec] = {"visited": ((self.capacity,), torch.bool)}
        if row_shape is not None:
            expected["rows"] = ((self.capacity, *row_shape), self.storage_dtype)
        tensors = self._load_tensors(path, expected)
        if row_shape is None:  # an empty, never-used cache was saved
            self._visited.zero_()
            return
        self.row_shape = row_shape
        self._rows = tensors["rows"].to(self.device)
        self._visited = tensors["visited"].to(self.device)


class LowBitCache(ActivationCache):
    """Rows stored as ``bits``-bit codes with one fp16 scale per block of ``block`` values.

    Each row is flattened and split into blocks of ``block`` consecutive values (the last block is
    zero-padded); every block gets its own scale, so storage per row is
    ``nblocks * (ceil(block*bits/8) + 2)`` bytes. Quantization is round-to-nearest and therefore
    deterministic. Raises :class:`CacheError` (from ``put``) for non-finite rows or values beyond
    the fp16 range.

    Args:
        capacity: number of sample ids (dataset size).
        row_shape: shape of one row; ``None`` to fix it (and allocate) at the first :meth:`put`.
        bits: code width, 1 to 8.
        block: values per scale group.
        dtype: dtype returned by :meth:`get` / :meth:`put`.
        device: where codes and scales live and results are returned.
        num_samples: if given, :meth:`check_capacity` is called with it.
    """

    backend: ClassVar[str] = "lowbit"

    def __init__(
        self,
        capacity: int,
        row_shape: Sequence[int] | None = None,
        *,
        bits: int = 4,
        block: int = 64,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        num_samples: int | None = None,
    ) -> None:
        super().__init__(capacity, row_shape, dtype=dtype, device=device, num_samples=num_samples)
        if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
            raise CacheError(f"bits must be an int in [1, 8], got {bits!r}")
        if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
            raise CacheError(f"block must be a positive int, got {block!r}")
        self.bits = bits
        self.block = block
        self._packed: Tensor | None = None
        self._scales: Tensor | None = None
        if self.row_shape is not None:
            self._alloc_codes(self.row_shape)

    @property
    def _numel(self) -> int:
        return math.prod(self._shape())

    @property
    def _nblocks(self) -> int:
        return -(-self._numel // self.block)

    @property
    def _block_bytes(self) -> int:
        return (self.block * self.bits + 7) // 8

    def _alloc_codes(self, row_shape: tuple[int, ...]) -> None:
        self.row_shape = row_shape
        self._packed = torch.zeros(
            (self.capacity, self._nblocks, self._block_bytes), dtype=torch.uint8, device=self.device
        )
        self._scales = torch.zeros((self.capacity, self._nblocks), dtype=torch.float16, device=self.device)

    def _allocate(self, row_shape: tuple[int, ...]) -> None:
        self._alloc_codes(row_shape)

    def _lazy_shape_ok(self) -> bool:
        return True

    def _decode(self, packed: Tensor, scales: Tensor) -> Tensor:
        """``packed [n, nblocks, block_bytes]``, ``scales [n, nblocks]`` -> rows ``[n, *row_shape]``."""
        n = packed.shape[0]
        flat = dequantize_groups(
            packed.reshape(n * self._nblocks, self._block_bytes),
            scales.reshape(n * self._nblocks),
            self.bits,
            self.block,
            dtype=self.dtype,
        )
        return flat.reshape(n, self._nblocks * self.block)[:, : self._numel].reshape(n, *self._shape())

    def _read(self, ids: Tensor) -> Tensor:
        assert self._packed is not None and self._scales is not None
        idx = ids.to(self.device)
        return self._decode(self._packed[idx], self._scales[idx])

    def _write(self, ids: Tensor, rows: Tensor) -> Tensor:
        assert self._packed is not None and self._scales is not None
        n = ids.numel()
        if n == 0:
            return torch.empty((0, *self._shape()), dtype=self.dtype, device=self.device)
        flat = rows.to(device=self.device, dtype=torch.float32).reshape(n, self._numel)
        flat = torch.nn.functional.pad(flat, (0, self._nblocks * self.block - self._numel))
        try:
            packed, scales = quantize_groups(flat.reshape(n * self._nblocks, self.block), self.bits)
        except ValueError as exc:
            raise CacheError(f"cannot quantize rows: {exc}") from None
        packed = packed.reshape(n, self._nblocks, self._block_bytes)
        scales = scales.reshape(n, self._nblocks)
        idx = ids.to(self.device)
        self._packed[idx] = packed
        self._scales[idx] = scales
        return self._decode(packed, scales)

    def _payload_nbytes(self) -> int:
        if self._packed is None or self._scales is None:
            return 0
        return self._packed.numel() + self._scales.numel() * self._scales.element_size()

    def _backend_metadata(self) -> dict[str, Any]:
        return {"bits": self.bits, "block": self.block}

    def _save_payload(self, path: Path) -> None:
        tensors = {"visited": self._visited.cpu()}
        if self._packed is not None and self._scales is not None:
            tensors["packed"] = self._packed.cpu().contiguous()
            tensors["scales"] = self._scales.cpu().contiguous()
        save_file(tensors, str(path / _TENSORS_FILE))

    def _load_payload(self, path: Path, row_shape: tuple[int, ...] | None) -> None:
        expected: dict[str, _TensorSpec] = {"visited": ((self.capacity,), torch.bool)}
        if row_shape is not None:
            nblocks = -(-math.prod(row_shape) // self.block)
            expected["packed"] = ((self.capacity, nblocks, self._block_bytes), torch.uint8)
            expected["scales"] = ((self.capacity, nblocks), torch.float16)
        tensors = self._load_tensors(path, expected)
        if row_shape is None:
            self._visited.zero_()
            return
        self.row_shape = row_shape
        self._packed = tensors["packed"].to(self.device)
        self._scales = tensors["scales"].to(self.device)
        self._visited = tensors["visited"].to(self.device)


def _noop() -> None:
    return None


class DiskCache(ActivationCache):
    """Rows in a ``numpy.memmap`` file, read ahead on one background thread.

    The file at ``path`` is (re)created sparse with ``capacity * prod(row_shape)`` elements of
    ``storage_dtype`` in C order (bf16 as uint16 bit patterns); only touched pages use disk or page
    cache, and process memory stays bounded. The file belongs to the caller and is not deleted.

    Prefetching and consistency:

    * :meth:`prefetch` submits a read of those rows to a single worker thread
      (``ThreadPoolExecutor(max_workers=1)``). At most ``prefetch_depth`` prefetched batches are
      held; adding one more drops the oldest.
    * :meth:`get` with exactly the same ids (same order) consumes the prefetched batch (waiting for
      it if still in flight); any other get reads synchronously.
    * :meth:`put` writes synchronously in the caller's thread, after dropping every held prefetch
      whose ids overlap the put. A prefetch submitted later reads the new rows. Hence a get always
      returns the latest put of each id. Reads of a dropped prefetch may race with the write; their
      result is discarded.

    When ``device`` is CUDA, prefetched rows are pinned on the worker thread and copied with
    ``non_blocking=True``.

    Use as a context manager or call :meth:`close` to stop the worker thread.
    """

    backend: ClassVar[str] = "disk"

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity: int,
        row_shape: Sequence[int],
        *,
        storage_dtype: torch.dtype = torch.float16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        prefetch_depth: int = 2,
        num_samples: int | None = None,
    ) -> None:
        if row_shape is None:
            raise CacheError("DiskCache needs row_shape up front (it sizes the file)")
        super().__init__(
            capacity,
            row_shape,
            dtype=dtype,
            device=device,
            num_samples=num_samples,
            mask_device=torch.device("cpu"),
        )
        self.storage_dtype = _check_dtype(storage_dtype, "storage_dtype", _STORAGE_DTYPES)
        if isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, int) or prefetch_depth < 0:
            raise CacheError(f"prefetch_depth must be a non-negative int, got {prefetch_depth!r}")
        self.path = Path(path)
        if self.path.is_dir():
            raise CacheError(f"DiskCache path {self.path} is a directory; give a file path")
        self.prefetch_depth = prefetch_depth
        #: Gets served from a prefetched batch / read synchronously (for tuning ``prefetch``).
        self.prefetch_hits = 0
        self.prefetch_misses = 0
        self._np_dtype = _NUMPY_STORAGE[self.storage_dtype]
        self._pin = self.device.type == "cuda" and torch.cuda.is_available()
        self._lock = threading.RLock()
        # Held prefetches, oldest first: ids bytes -> (ids, future of the rows in storage dtype).
        self._pending: collections.OrderedDict[bytes, tuple[np.ndarray, Future[Tensor]]] = (
            collections.OrderedDict()
        )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # mode "w+" (re)creates the file sparse: numpy only writes its last byte.
        self._mm: np.memmap | None = np.memmap(
            self.path, dtype=self._np_dtype, mode="w+", shape=self._file_shape
        )
        self._executor: ThreadPoolExecutor | None = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="aqsgd-diskcache"
        )

    @property
    def _file_shape(self) -> tuple[int, ...]:
        return (self.capacity, *self._shape())

    @property
    def _file_nbytes(self) -> int:
        return math.prod(self._file_shape) * np.dtype(self._np_dtype).itemsize

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has been called."""
        return self._executor is None

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Wait for in-flight reads, stop the worker thread, flush and unmap the file. Idempotent."""
        with self._lock:
            if self._executor is None:
                return
            self._drop_prefetches()
            self._executor.shutdown(wait=True)
            self._executor = None
            if self._mm is not None:
                self._mm.flush()
                self._mm = None

    def __enter__(self) -> DiskCache:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _check_open(self) -> tuple[np.memmap, ThreadPoolExecutor]:
        if self._mm is None or self._executor is None:
            raise CacheError(f"DiskCache {self.path} is closed")
        return self._mm, self._executor

    def _drop_prefetches(self) -> None:
        """Forget every held prefetch and wait until the worker is idle."""
        for _, fut in self._pending.values():
            fut.cancel()
        self._pending.clear()
        if self._executor is not None:
            self._executor.submit(_noop).result()  # single FIFO worker: all earlier reads are done

    # ------------------------------------------------------------------ reads and writes

    def _read_rows(self, ids_np: np.ndarray, pin: bool) -> Tensor:
        """Read rows from the memmap into a CPU tensor of ``storage_dtype`` (runs on either thread)."""
        mm = self._mm
        if mm is None:
            raise CacheError(f"DiskCache {self.path} is closed")
        arr = np.ascontiguousarray(mm[ids_np])
        if self.storage_dtype == torch.bfloat16:
            t = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        else:
            t = torch.from_numpy(arr)
        return t.pin_memory() if pin else t

    def _to_output(self, stored: Tensor) -> Tensor:
        if stored.device != self.device:
            stored = stored.to(self.device, non_blocking=stored.is_pinned())
        return stored.to(self.dtype)

    def prefetch(self, ids: Tensor) -> None:
        """Start reading the rows of ``ids`` on the worker thread (no-op when ``prefetch_depth`` is 0)."""
        ids = self._check_ids(ids)
        with self._lock:
            _, executor = self._check_open()
            if self.prefetch_depth == 0 or ids.numel() == 0:
                return
            ids_np = ids.cpu().numpy()
            key = ids_np.tobytes()
            if key in self._pending:
                self._pending.move_to_end(key)
                return
            while len(self._pending) >= self.prefetch_depth:
                _, (_, old) = self._pending.popitem(last=False)
                old.cancel()
            self._pending[key] = (ids_np, executor.submit(self._read_rows, ids_np, self._pin))

    def _read(self, ids: Tensor) -> Tensor:
        with self._lock:
            self._check_open()
            ids_np = ids.cpu().numpy()
            entry = self._pending.pop(ids_np.tobytes(), None)
            if entry is not None:
                self.prefetch_hits += 1
                stored = entry[1].result()
            else:
                self.prefetch_misses += 1
                stored = self._read_rows(ids_np, pin=False)
            return self._to_output(stored)

    def _write(self, ids: Tensor, rows: Tensor) -> Tensor:
        with self._lock:
            mm, _ = self._check_open()
            ids_np = ids.cpu().numpy()
            for key, (pending_ids, fut) in list(self._pending.items()):
                if np.isin(pending_ids, ids_np, assume_unique=True).any():
                    fut.cancel()
                    del self._pending[key]
            stored = rows.to(self.storage_dtype)
            host = stored.cpu().contiguous()
            if ids_np.size:
                if self.storage_dtype == torch.bfloat16:
                    mm[ids_np] = host.view(torch.int16).numpy().view(np.uint16)
                else:
                    mm[ids_np] = host.numpy()
            return stored.to(self.device).to(self.dtype)

    def reset(self) -> None:
        """Forget every row and every held prefetch. The file keeps its (now unreachable) contents."""
        with self._lock:
            self._check_open()
            self._drop_prefetches()
            super().reset()

    def flush(self) -> None:
        """Write dirty pages of the memmap back to the file."""
        with self._lock:
            mm, _ = self._check_open()
            mm.flush()

    # ------------------------------------------------------------------ storage and checkpoints

    def _allocate(self, row_shape: tuple[int, ...]) -> None:  # pragma: no cover - row_shape is required
        raise CacheError("DiskCache row_shape is fixed at construction")

    def _payload_nbytes(self) -> int:
        return self._file_nbytes

    def _backend_metadata(self) -> dict[str, Any]:
        return {"storage_dtype": _DTYPE_NAMES[self.storage_dtype]}

    def _save_payload(self, path: Path) -> None:
        """Flush the memmap and copy the file chunk-wise (sparse, never loaded whole into RAM)."""
        with self._lock:
            mm, _ = self._check_open()
            mm.flush()
            target = path / _ROWS_FILE
            if not (target.exists() and target.samefile(self.path)):
                _copy_file_sparse(self.path, target)
            save_file({"visited": self._visited.clone()}, str(path / _TENSORS_FILE))

    def _load_payload(self, path: Path, row_shape: tuple[int, ...] | None) -> None:
        source = path / _ROWS_FILE
        if not source.is_file():
            raise CacheError(f"{source} is missing")
        if source.stat().st_size != self._file_nbytes:
            raise CacheError(f"{source} has {source.stat().st_size} bytes, expected {self._file_nbytes}")
        tensors = self._load_tensors(path, {"visited": ((self.capacity,), torch.bool)})
        with self._lock:
            self._check_open()
            self._drop_prefetches()
            if not source.samefile(self.path):
                self._mm = None  # unmap before the file is rewritten
                try:
                    _copy_file_sparse(source, self.path)
                except BaseException:
                    self._visited.zero_()  # the file is half-copied: no row is trustworthy any more
                    raise
                finally:
                    self._mm = np.memmap(self.path, dtype=self._np_dtype, mode="r+", shape=self._file_shape)
            self._visited = tensors["visited"].clone()

