"""The quantizer's grids and scales (:mod:`aqsgd.compress.quant`): the levels a code stands for, each scale
group's scale, its storage and the decode step, and how a tensor splits into scale groups.

Grid
    ``midtread`` (default): for ``bits >= 2`` the levels are ``k * step`` for integers ``k`` in ``[-L, L]``,
    ``L = 2**(bits-1) - 1`` and ``step = scale / L``: symmetric about zero, zero exact, ``2**bits - 1`` levels
    (the all-ones code is unused). For ``bits == 1`` the levels are ``{-scale, +scale}``
    (``step = 2 * scale``). ``midrise``: all ``n = 2**bits`` codes, levels ``(k - (n-1)/2) * step`` for codes
    ``k`` in ``[0, n-1]`` with ``step = 2 * scale / (n - 1)``: symmetric, no zero level, the outermost levels
    at ``+-scale`` (for 1 bit the same grid as ``midtread``). At 2 bits this is 4 levels instead of 3; with
    each grid's MSE-optimal clipping the relative error on Gaussian data falls from 0.44 to 0.35
    (3 bits 0.22 -> 0.19, 4 bits 0.11 -> 0.11) for the same bytes. The price: an exact zero is sent as
    +-step/2. With nearest rounding every value inside ``[-scale, scale]`` is reconstructed within half a
    step, on either grid.

Scale (one per group)
    ``max``: the group's max-abs, so nothing is clipped (the AQ-SGD reference's choice). The default for
    ``bits >= 2``, and for 1 bit with stochastic rounding (the only scale under which that is unbiased).
    ``mean`` (1 bit only; the default for 1 bit with nearest rounding): the group's mean absolute value. A
    sign quantizer reconstructs every value at ``+-scale``, and the scale minimizing the group's squared error
    is its mean ``|x|``: relative error 1 - 2/pi = 0.36 on Gaussian data, where max-abs scales give 4 to 15
    (every value sent at the group's extreme: worse than sending zeros).
    ``l2``: ``min(max-abs, c_b * rms)`` with ``c_b`` the clipping multiple that minimizes the mean squared
    error for Gaussian data at ``b`` bits (Banner et al., 2019, "Post-training 4-bit quantization of
    convolution networks for rapid-deployment": 1.71, 2.15, 2.55, 2.94, 3.29, 3.61, 3.92 for 2..8 bits;
    0.80 = E|x|/sigma for 1 bit). Values beyond the scale are clipped to the outermost level. These multiples
    were derived for ``2**b`` levels; on the 3-level ``midtread`` grid at 2 bits the Gaussian optimum is
    nearer 1.2 (kept at 1.71 so that ``q2:l2`` keeps its meaning). On the ``midrise`` grid ``c_b`` is the
    outermost level of the MSE-optimal uniform quantizer of a unit Gaussian (Max, 1960, "Quantizing for
    minimum distortion": 1.49, 2.05, 2.51, 2.92, 3.28, 3.62, 3.95 for 2..8 bits, i.e. (n-1)/2 optimal steps).
    Scales are stored in fp16 by default, rounded *up* to the next fp16 value (so rounding never clips)
    and clamped to 65504 (so they never overflow; larger magnitudes are clipped); ``scale32`` stores fp32.
    ``step<c>``: the quantization step is ``c`` times the group's rms, or its max-abs where that is smaller
    (a flat group, such as a rotated tile holding one loud channel, then comes back exactly), and values
    beyond the outermost level are clipped (scale ``min(c * rms, max-abs) * qmax / 2``); for ``c <= 1`` the
    max-abs never binds. Meant for entropy coding (``:rc``, or ``:zstd``): with a
    wide code field (``q4``) and a step near one rms the outer codes are rare, so the coded size follows the
    data's entropy rather than the field's width. An entropy-coded uniform quantizer at step ``c`` sigma on a
    Gaussian source: c = 1.0 -> 2.10 bits of entropy at relative error 0.083, c = 1.1 -> 1.98 bits at 0.101,
    against the 4-level ``midrise`` grid's 1.90 bits at 0.119 (Gish and Pierce, 1968: at high rates the
    entropy-coded uniform quantizer is within 0.25 bit of the Shannon bound).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from aqsgd.compress.base import numel_of

__all__ = ["GRANULARITIES", "GRIDS", "L2_CLIP", "L2_CLIP_MIDRISE", "ROUNDINGS", "SCALE_MODES",
           "default_scale_mode", "divided", "qmax", "store_scales"]

GRANULARITIES = ("tensor", "channel", "token", "block")
ROUNDINGS = ("nearest", "stochastic")
GRIDS = ("midtread", "midrise")
SCALE_MODES = ("max", "l2", "mean", "step")
L2_CLIP = {1: 0.80, 2: 1.71, 3: 2.15, 4: 2.55, 5: 2.94, 6: 3.29, 7: 3.61, 8: 3.92}
L2_CLIP_MIDRISE = {1: 0.80, 2: 1.49, 3: 2.05, 4: 2.51, 5: 2.92, 6: 3.28, 7: 3.62, 8: 3.95}
_FP16_MAX = 65504.0
_FP32_MAX = torch.finfo(torch.float32).max


def default_scale_mode(bits: int, rounding: str = "nearest") -> str:
    """Scale estimate used when none is given: ``mean`` for 1 bit with nearest rounding, else ``max``."""
    return "mean" if bits == 1 and rounding == "nearest" else "max"


def qmax(bits: int) -> int:
    """Largest code: 2L for bits >= 2, 1 for bits == 1."""
    return 1 if bits == 1 else 2**bits - 2


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def divided(scales: torch.Tensor, divisor: int, cdt: torch.dtype) -> torch.Tensor:
    """``scales / divisor`` in ``cdt``, correctly rounded on every device, so that a packet decodes to the
    same bits on the CPU and on a GPU (the two sides of an AQ-SGD boundary must agree bit for bit).

    CUDA divides a tensor by a Python number as ``x * (1 / divisor)``, one rounding more than the CPU's true
    division, and the last bit then differs for some scales. In fp32 the quotient is taken in float64 and
    rounded to fp32: a stored scale has at most 24 significant bits and every divisor here is an odd integer
    below 256, so the exact quotient is either an fp32 number or at least 2**-32 (relative) away from every
    fp32 rounding midpoint, far more than float64's error on either path (about 2**-52): both round to the
    correctly rounded fp32 quotient. In float64 the divisor is a tensor on the scales' device, which CUDA
    divides by exactly."""
    if divisor == 1:
        return scales.to(cdt)
    if cdt == torch.float32:
        return scales.to(torch.float64).div_(divisor).to(torch.float32)
    return scales.to(cdt) / scales.new_full((), divisor, dtype=cdt)


def store_scales(s: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """Round scales to their storage dtype without ever rounding down (fp16: also clamp to 65504)."""
    if scale_dtype == torch.float32:
        s32 = s.to(torch.float32)
        if s.dtype == torch.float64:
            low = s32.double() < s
            s32 = torch.where(low, torch.nextafter(s32, _inf_like(s32)), s32)
        return s32
    s16 = s.clamp(max=_FP16_MAX).to(torch.float16)
    low = s16.to(s.dtype) < s.clamp(max=_FP16_MAX)
    return torch.where(low, torch.nextafter(s16, _inf_like(s16)), s16)


def _inf_like(t: torch.Tensor) -> torch.Tensor:
    """+Inf as a 0-d tensor of ``t``'s dtype and device, filled there (``new_tensor`` would copy it from the
    host: a synchronisation on CUDA)."""
    return torch.full((), math.inf, dtype=t.dtype, device=t.device)


class _Groups:
    """How a flat tensor of ``numel`` values splits into scale groups, as 2-D views."""

    def __init__(self, shape: Sequence[int], granularity: str, block: int) -> None:
        self.numel = numel_of(shape)
        self.granularity = granularity
        self.cols = int(shape[-1]) if len(shape) else 1
        if granularity == "block":
            self.block = block
            self.nfull, self.tail = divmod(self.numel, block)
        if granularity == "tensor" or self.numel == 0:
            self.nscales = 1 if self.numel else 0
        elif granularity == "channel":
            self.nscales = self.cols
        elif granularity == "token":
            self.nscales = self.numel // self.cols
        else:
            self.nscales = self.nfull + (1 if self.tail else 0)

    def views(self, flat: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
        """2-D views of ``flat`` and the dim along which each scale group reduces."""
        g = self.granularity
        if g == "tensor":
            return [(flat.view(1, -1), 1)]
        if g == "channel":
            return [(flat.view(-1, self.cols), 0)]
        if g == "token":
            return [(flat.view(-1, self.cols), 1)]
        out = []
        if self.nfull:
            out.append((flat[: self.nfull * self.block].view(self.nfull, self.block), 1))
        if self.tail:
            out.append((flat[self.nfull * self.block :].view(1, self.tail), 1))
        return out

    @staticmethod
    def bcast(s: torch.Tensor, dim: int) -> torch.Tensor:
        return s.view(1, -1) if dim == 0 else s.view(-1, 1)


def _signed_levels(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes -> signed integer levels (int8): ``q - L`` for bits >= 2, ``2q - 1`` for bits == 1."""
    if bits == 1:
        return codes.mul(2).sub_(1).view(torch.int8)
    return codes.sub(2 ** (bits - 1) - 1).view(torch.int8)
