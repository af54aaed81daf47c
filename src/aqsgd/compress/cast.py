"""Uncompressed and cast codecs: ``none`` (the input dtype as is), ``fp32``, ``fp16``, ``bf16``."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from aqsgd.compress import kernels
from aqsgd.compress.base import (
    Codec,
    defer_check,
    defers_checks,
    non_finite_message,
    numel_of,
    raise_non_finite,
)
from aqsgd.compress.packet import Family, Packet, bytes_as
from aqsgd.errors import SpecError

__all__ = ["RawCodec", "CastCodec"]

CAST_WHAT = "input (or its cast to the wire dtype)"  # what a cast codec's NonFiniteError says it refused


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(-1).view(torch.uint8)


class RawCodec(Codec):
    """``none``: the tensor's own bytes, lossless. NaN/Inf pass through unchanged (nothing is computed)."""

    family = Family.RAW

    @property
    def spec(self) -> str:
        return "none"

    @property
    def lossless(self) -> bool:
        return True

    def payload_bytes(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> int:
        return numel_of(shape) * dtype.itemsize

    def _encode(self, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        return _as_bytes(x)

    def _decode(self, packet: Packet) -> torch.Tensor:
        return bytes_as(packet.payload, packet.dtype).view(packet.shape)


class CastCodec(Codec):
    """Cast to ``fp32``/``fp16``/``bf16`` on the wire, back to the input dtype on decode.

    Values that overflow the wire dtype (e.g. > 65504 for fp16) and NaN/Inf raise NonFiniteError.
    """

    family = Family.CAST
    _NAMES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

    def __init__(self, wire: str) -> None:
        if wire not in self._NAMES:
            raise SpecError(f"unknown cast {wire!r}; valid: {sorted(self._NAMES)}")
        self._wire = wire
        self.wire_dtype = self._NAMES[wire]

    @property
    def spec(self) -> str:
        return self._wire

    def payload_bytes(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> int:
        return numel_of(shape) * self.wire_dtype.itemsize

    def _encode(self, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        ops = kernels.for_tensor(x, self.backend) if x.numel() and defers_checks(x.device) else None
        if ops is not None and ops.fuses_scales:  # on a GPU: the cast and its check in one kernel launch
            flag = torch.zeros(1, dtype=torch.int32, device=x.device)
            y = ops.cast_checked(x, self.wire_dtype, flag)
            if y is not None:
                defer_check(flag, non_finite_message(self.spec, CAST_WHAT))
                return _as_bytes(y)
        y = x.to(self.wire_dtype)
        # max |y| is NaN or Inf exactly when some element is (amax propagates NaN); one fast reduction, where
        # torch.isfinite(...).all() is ~40x slower on half tensors
        if y.numel() and defers_checks(y.device):  # the same test as a device flag, read later
            defer_check(~torch.isfinite(y.abs().amax()), non_finite_message(self.spec, CAST_WHAT))
        elif y.numel() and not math.isfinite(float(y.abs().amax())):
            raise_non_finite(self.spec, CAST_WHAT)
        return _as_bytes(y)

    def _decode(self, packet: Packet) -> torch.Tensor:
        return bytes_as(packet.payload, self.wire_dtype).view(packet.shape).to(packet.dtype)
