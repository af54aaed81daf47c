"""In-memory backend: every row in one preallocated tensor in the storage dtype."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors.torch import save_file
from torch import Tensor

from aqsgd.compress.kernels import RowStore, index_on
from aqsgd.schemes.cache.base import (
    _DTYPE_NAMES,
    _STORAGE_DTYPES,
    _TENSORS_FILE,
    ActivationCache,
    _check_dtype,
    _TensorSpec,
)

__all__ = ["MemoryCache"]


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

    # index_select / index_copy_ rather than rows[ids] / rows[ids] = ...: the same values, several times
    # faster on the CPU (ids are validated int64 and unique, so index_copy_ is deterministic)
    def _read(self, ids: Tensor) -> Tensor:
        assert self._rows is not None
        return torch.index_select(self._rows, 0, index_on(ids, self.device)).to(self.dtype)

    def _write(self, ids: Tensor, rows: Tensor) -> Tensor:
        assert self._rows is not None
        stored = rows.to(device=self.device, dtype=self.storage_dtype)
        self._rows.index_copy_(0, index_on(ids, self.device), stored)
        return stored.to(self.dtype)

    def row_store(self, ids: Tensor) -> RowStore | None:
        if self._rows is None or self.dtype != torch.float32:
            return None
        ids = self._check_ids(ids)
        self._require_visited(ids)
        return RowStore.of(self._rows, ids) if ids.numel() else None

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
        self._visited = tensors["visited"].to(self._visited.device)

