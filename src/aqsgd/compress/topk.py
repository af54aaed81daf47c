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
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from aqsgd.compress.base import Codec, numel_of
from aqsgd.compress.packet import Family, Packet, bytes_as
from aqsgd.errors import PacketError, SpecError

__all__ = ["TopKCodec", "index_dtype"]

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
        idx = x2.abs().topk(k, dim=1, sorted=False).indices
        kept = x2.gather(1, idx)
        vals = self.values.encode(kept, generator=generator).payload
        return torch.cat([vals, _index_bytes(idx, index_dtype(n).itemsize)])

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
        if bool(((idx < 0) | (idx >= n)).any()):  # int64 indices (rows over 2**32) can be negative
            raise PacketError(f"{self.spec}: packet holds indices outside its row of {n}")
        out.scatter_(1, idx, kept)
        return out.view(packet.shape)


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
