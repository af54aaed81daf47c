"""The :class:`ActivationCache` contract shared by every backend, and the helpers behind it.

Validation of ids and rows, the visited mask, ``get``/``put``/``reset`` and the checkpoint metadata
(``meta.json`` beside a safetensors file) live here; a backend implements only the storage hooks
(``_allocate``, ``_read``, ``_write``, ``_payload_nbytes``, ``_backend_metadata``, ``_save_payload``,
``_load_payload``). The rules every backend follows are listed in :mod:`aqsgd.schemes.cache`.
"""

from __future__ import annotations

import abc
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from safetensors.torch import load_file
from torch import Tensor

from aqsgd.compress.kernels import RowStore
from aqsgd.errors import CacheError

__all__ = ["ActivationCache"]

_FORMAT = "aqsgd-activation-cache"
_FORMAT_VERSION = 1
_META_FILE = "meta.json"
_TENSORS_FILE = "cache.safetensors"

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
        # The visited mask stays on the host whatever the device: sample ids are host data, so splitting a
        # micro-batch into seen and unseen rows needs no device round trip (and no host sync).
        self._visited = torch.zeros(capacity, dtype=torch.bool, device=mask_device or torch.device("cpu"))
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

    def row_store(self, ids: Tensor) -> RowStore | None:
        """The rows of ``ids`` (all visited; validated as :meth:`get` validates them) as a
        :class:`~aqsgd.compress.kernels.RowStore` that a codec's fused AQ-SGD step reads and updates in place,
        or None where this backend, device or dtype has no such storage: the caller then uses get and put.
        Writing through the store must leave exactly what ``put`` would have stored."""
        return None

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
        # in numpy: a micro-batch has a few ids, where each torch call costs microseconds (this runs several
        # times per micro-batch on both sides of every AQ-SGD boundary); CUDA ids are copied once, as any
        # check syncs
        a = ids.cpu().numpy()
        out_of_range = (a < 0) | (a >= self.capacity)
        if out_of_range.any():
            raise CacheError(
                f"sample id {int(a[out_of_range][0])} is out of range for a cache of capacity "
                f"{self.capacity} (valid ids are 0..{self.capacity - 1})"
            )
        ordered = np.sort(a)
        repeated = ordered[1:] == ordered[:-1]
        if repeated.any():
            raise CacheError(f"sample id {int(ordered[1:][repeated][0])} appears more than once in one call; "
                             "ids must be unique")
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

