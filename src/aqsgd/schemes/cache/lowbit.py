"""Low-bit backend: the cache itself stored as bit-packed codes with one fp16 scale per block."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors.torch import save_file
from torch import Tensor

from aqsgd.compress.base import wrapping_pending_errors
from aqsgd.compress.kernels import index_on
from aqsgd.compress.quant import dequantize_groups, quantize_groups
from aqsgd.errors import CacheError
from aqsgd.schemes.cache.base import _TENSORS_FILE, ActivationCache, _TensorSpec

__all__ = ["LowBitCache"]


def _cache_error(exc: BaseException) -> BaseException:
    """What storing rows raises for an error of the quantizer (a ValueError): a CacheError saying so."""
    return CacheError(f"cannot quantize rows: {exc}") if isinstance(exc, ValueError) else exc


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
        idx = index_on(ids, self.device)
        return self._decode(self._packed[idx], self._scales[idx])

    def _write(self, ids: Tensor, rows: Tensor) -> Tensor:
        assert self._packed is not None and self._scales is not None
        n = ids.numel()
        if n == 0:
            return torch.empty((0, *self._shape()), dtype=self.dtype, device=self.device)
        flat = rows.to(device=self.device, dtype=torch.float32).reshape(n, self._numel)
        flat = torch.nn.functional.pad(flat, (0, self._nblocks * self.block - self._numel))
        try:
            # (on a GPU inside a pipeline step its checks are pending, read at the step's end: the same error)
            with wrapping_pending_errors(_cache_error):
                packed, scales = quantize_groups(flat.reshape(n * self._nblocks, self.block), self.bits)
        except ValueError as exc:
            raise _cache_error(exc) from None
        packed = packed.reshape(n, self._nblocks, self._block_bytes)
        scales = scales.reshape(n, self._nblocks)
        idx = index_on(ids, self.device)
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
        self._visited = tensors["visited"].to(self._visited.device)

