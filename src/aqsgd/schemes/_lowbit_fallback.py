"""Private fallback for :func:`aqsgd.compress.quant.quantize_groups` / ``dequantize_groups``.

:mod:`aqsgd.schemes.cache` imports the two functions from :mod:`aqsgd.compress.quant` and falls back
to this module only while that module (or those names) does not exist. The signatures and the
semantics are the agreed ones, so that a cache written with either implementation decodes the same:

* ``x`` is float ``[G, N]``; every row is one scale group.
* ``scale`` = ``max|x|`` of the row rounded *up* to fp16, so no value is clipped.
* ``bits >= 2``: symmetric mid-tread grid with ``L = 2**(bits-1) - 1`` levels each side,
  ``step = scale / L``, codes ``q = round(x / step) + L`` in ``[0, 2L]`` (``2**bits - 1`` is unused);
  decoding is ``(q - L) * step``.
* ``bits == 1``: two levels ``{-scale, +scale}``; code 1 means ``+scale``.
* Codes are packed densely and little-endian within each row: value ``j`` of a row occupies bits
  ``[j*bits, (j+1)*bits)`` of the row's byte string (bit 0 = least significant bit of byte 0).

Everything is computed in float32 with plain elementwise torch ops, so the result is the same on
CPU and CUDA and does not depend on how many rows are processed together.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["quantize_groups", "dequantize_groups"]

_ROUNDINGS = ("nearest", "stochastic")


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in [1, 8], got {bits!r}")


def _round_up_to_fp16(a: Tensor) -> Tensor:
    """Smallest fp16 value >= ``a`` for each element of the non-negative float32 tensor ``a``."""
    h = a.to(torch.float16)
    too_low = h.to(torch.float32) < a
    # For positive finite fp16 values the bit pattern + 1 is the next representable value up
    # (0x7BFF = 65504 steps to 0x7C00 = +inf, which the caller rejects).
    bumped = (h.view(torch.int16) + 1).view(torch.float16)
    return torch.where(too_low, bumped, h)


def _pack(codes: Tensor, bits: int) -> Tensor:
    """Pack uint8 codes ``[G, N]`` (each < 2**bits) densely, little-endian, into ``[G, ceil(N*bits/8)]``."""
    g, n = codes.shape
    nbytes = (n * bits + 7) // 8
    if bits == 8:
        return codes.contiguous()
    if 8 % bits == 0:
        per = 8 // bits
        padded = torch.nn.functional.pad(codes, (0, nbytes * per - n)).reshape(g, nbytes, per)
        out = padded[..., 0].clone()
        for k in range(1, per):
            out |= padded[..., k] << (k * bits)
        return out
    # General widths (3, 5, 6, 7): expand to bit planes, then gather 8 bits per byte.
    shifts = torch.arange(bits, device=codes.device, dtype=torch.uint8)
    planes = ((codes.unsqueeze(-1) >> shifts) & 1).reshape(g, n * bits)
    planes = torch.nn.functional.pad(planes, (0, nbytes * 8 - n * bits)).reshape(g, nbytes, 8)
    out = planes[..., 0].clone()
    for k in range(1, 8):
        out |= planes[..., k] << k
    return out


def _unpack(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of :func:`_pack`: uint8 codes ``[G, n]``."""
    g = packed.shape[0]
    if bits == 8:
        return packed[:, :n]
    mask = (1 << bits) - 1
    if 8 % bits == 0:
        per = 8 // bits
        parts = [(packed >> (k * bits)) & mask for k in range(per)]
        return torch.stack(parts, dim=-1).reshape(g, packed.shape[1] * per)[:, :n]
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    planes = ((packed.unsqueeze(-1) >> shifts) & 1).reshape(g, packed.shape[1] * 8)
    planes = planes[:, : n * bits].reshape(g, n, bits)
    codes = planes[..., 0].clone()
    for k in range(1, bits):
        codes |= planes[..., k] << k
    return codes


def quantize_groups(
    x: Tensor, bits: int, *, rounding: str = "nearest", generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Quantize each row of ``x`` (float ``[G, N]``) with its own fp16 scale.

    Returns ``(packed, scales)``: uint8 ``[G, ceil(N*bits/8)]`` and fp16 ``[G]``. ``rounding`` is
    ``"nearest"`` (round half to even, deterministic) or ``"stochastic"`` (unbiased; uses
    ``generator`` if given). Raises ``ValueError`` for bad arguments, non-finite input, or a row
    whose ``max|x|`` exceeds the fp16 range.
    """
    _check_bits(bits)
    if rounding not in _ROUNDINGS:
        raise ValueError(f"rounding must be one of {_ROUNDINGS}, got {rounding!r}")
    if not isinstance(x, Tensor) or x.dim() != 2 or not x.is_floating_point():
        raise ValueError("x must be a floating-point tensor of shape [G, N]")
    g, n = x.shape
    xf = x.detach().to(torch.float32)
    amax = xf.abs().amax(dim=1) if n > 0 else xf.new_zeros(g)
    scales = _round_up_to_fp16(amax)
    if g > 0 and not bool(torch.isfinite(scales).all()):
        raise ValueError("quantize_groups: input is non-finite or its magnitude exceeds the fp16 range")
    s = scales.to(torch.float32).unsqueeze(1)
    if bits == 1:
        if rounding == "nearest":
            codes = xf >= 0
        else:
            safe = torch.where(s > 0, s, torch.ones_like(s))
            p_plus = (xf / safe + 1.0) * 0.5
            u = torch.rand(xf.shape, generator=generator, device=xf.device, dtype=torch.float32)
            codes = u < p_plus
        codes = codes.to(torch.uint8)
    else:
        levels = 2 ** (bits - 1) - 1
        step = s / levels
        safe = torch.where(step > 0, step, torch.ones_like(step))  # all-zero rows: x/1 = 0 -> code L
        t = xf / safe
        if rounding == "nearest":
            q = torch.round(t)
        else:
            u = torch.rand(t.shape, generator=generator, device=t.device, dtype=torch.float32)
            q = torch.floor(t + u)
        codes = (q.clamp_(-levels, levels) + levels).to(torch.uint8)
    return _pack(codes, bits), scales


def dequantize_groups(
    packed: Tensor, scales: Tensor, bits: int, n: int, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Decode ``(packed, scales)`` from :func:`quantize_groups` back to float ``[G, n]`` of ``dtype``."""
    _check_bits(bits)
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError("packed must be a uint8 tensor of shape [G, B]")
    g = packed.shape[0]
    if scales.shape != (g,):
        raise ValueError(f"scales must have shape [{g}], got {tuple(scales.shape)}")
    if packed.shape[1] != (n * bits + 7) // 8:
        raise ValueError(
            f"packed has {packed.shape[1]} bytes per row; "
            f"{n} values of {bits} bits need {(n * bits + 7) // 8}"
        )
    codes = _unpack(packed, bits, n).to(torch.float32)
    s = scales.to(torch.float32).unsqueeze(1)
    if bits == 1:
        out = (codes * 2.0 - 1.0) * s
    else:
        levels = 2 ** (bits - 1) - 1
        out = (codes - levels) * (s / levels)
    return out.to(dtype)
