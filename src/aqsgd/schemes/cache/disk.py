"""Disk backend: rows in a sparse ``numpy.memmap`` file, read ahead on one background thread."""

from __future__ import annotations

import collections
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
from safetensors.torch import save_file
from torch import Tensor

from aqsgd.errors import CacheError
from aqsgd.schemes.cache.base import (
    _DTYPE_NAMES,
    _STORAGE_DTYPES,
    _TENSORS_FILE,
    ActivationCache,
    _check_dtype,
)

__all__ = ["DiskCache"]

_ROWS_FILE = "rows.bin"
# numpy dtype of the memmap file for each storage dtype (numpy has no bfloat16: keep its bit pattern).
_NUMPY_STORAGE: dict[torch.dtype, type[np.generic]] = {
    torch.float16: np.float16,
    torch.bfloat16: np.uint16,
    torch.float32: np.float32,
}


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


def _noop() -> None:
    return None


def _to_host(t: Tensor) -> Tensor:
    """A contiguous host copy of ``t`` (``t`` itself on the CPU, if contiguous). From a GPU: a non-blocking
    copy into pinned memory, then a wait for an event recorded after it (not for the whole device)."""
    if not t.is_cuda:
        return t.contiguous()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(t.device))
    done.synchronize()
    return host


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

    When ``device`` is CUDA, reads and writes go through pinned host memory: prefetched rows are pinned
    on the worker thread and copied to the device with ``non_blocking=True`` (on the caller's stream, so
    whatever reads them is ordered after the copy); a ``put`` copies its rows non-blocking into a pinned
    buffer and waits only for that copy before writing the file.

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
        # the worker pins memory for a CUDA cache: it works on that device (not on device 0 by default)
        init, args = (torch.cuda.set_device, (self.device,)) if self._pin else (None, ())
        self._executor: ThreadPoolExecutor | None = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="aqsgd-diskcache", initializer=init, initargs=args
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
            host = _to_host(stored)
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

