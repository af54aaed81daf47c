"""Uniform symmetric quantization at 1..8 bits with bit-packed codes.

The grids (``midtread``, ``midrise``) and the scale estimates (``max``, ``mean``, ``l2``, ``step<c>``): see
:mod:`aqsgd.compress.quant_scales`, which computes them.

Granularity (which values share a scale)
    ``tensor``: one scale. ``channel``: one per index of the last dim, max over all other dims (the AQ-SGD
    reference's default). ``token``: one per row (all dims but the last). ``blockN``: one per N
    consecutive values of the flattened tensor (the last block may be shorter).

Rounding
    ``nearest`` (default; deterministic) or ``stochastic``: ``floor(x / step + u)``, ``u ~ U[0, 1)``, which is
    unbiased for values inside the scale, as the AQ-SGD convergence theorem assumes.

Payload: the scales (fp16 or fp32, little-endian), then the codes, ``ceil(numel * bits / 8)`` bytes.
NaN/Inf anywhere in the input makes a scale non-finite and raises :class:`NonFiniteError` (no extra
pass over the data is needed to detect it).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from aqsgd.compress import kernels
from aqsgd.compress.base import (
    Codec,
    collecting_checks,
    defer_check,
    defer_pending_check,
    defers_checks,
    defers_pending_checks,
    non_finite_message,
    numel_of,
    raise_non_finite,
)
from aqsgd.compress.bitpack import pack_bits, packed_nbytes, unpack_bits
from aqsgd.compress.packet import Family, Packet, bytes_as
from aqsgd.compress.quant_delta import QuantDelta
from aqsgd.compress.quant_scales import (_FP16_MAX, _FP32_MAX, GRANULARITIES, GRIDS, L2_CLIP, L2_CLIP_MIDRISE,
                                         ROUNDINGS, SCALE_MODES, _compute_dtype, _Groups, _signed_levels,
                                         default_scale_mode, divided, qmax, store_scales)
from aqsgd.errors import CodecError, NonFiniteError, PacketError, SpecError

__all__ = [
    "QuantCodec",
    "GRANULARITIES",
    "GRIDS",
    "quantize_groups",
    "dequantize_groups",
    "L2_CLIP",
    "SCALE_MODES",
    "default_scale_mode",
    "divided",
    "qmax",
    "store_scales",
]

class QuantCodec(QuantDelta, Codec):
    """``q<bits>[:tensor|channel|token|block<N>][:stochastic][:max|l2|mean][:midrise][:scale32]``."""

    family = Family.QUANT

    def __init__(
        self,
        bits: int,
        *,
        granularity: str = "channel",
        block: int = 64,
        rounding: str = "nearest",
        scale: str | None = None,
        scale_dtype: torch.dtype = torch.float16,
        grid: str = "midtread",
        check_finite: bool = True,
        step_rms: float | None = None,
        backend: str | None = None,
    ) -> None:
        if not isinstance(bits, int) or not 1 <= bits <= 8:
            raise SpecError(f"quantization bits must be an integer in 1..8, got {bits!r}")
        if granularity not in GRANULARITIES:
            raise SpecError(f"unknown granularity {granularity!r}; valid: {', '.join(GRANULARITIES)}")
        if granularity == "block" and (not isinstance(block, int) or block < 1):
            raise SpecError(f"block size must be a positive integer, got {block!r}")
        if rounding not in ROUNDINGS:
            raise SpecError(f"unknown rounding {rounding!r}; valid: {', '.join(ROUNDINGS)}")
        default_scale = default_scale_mode(bits, rounding)
        if scale is None:
            scale = default_scale
        if scale not in SCALE_MODES:
            raise SpecError(f"unknown scale estimate {scale!r}; valid: {', '.join(SCALE_MODES)}")
        if (scale == "step") != (step_rms is not None):
            raise SpecError("the 'step' scale takes its multiple of the rms (step_rms), and only it does")
        if scale == "step" and not (isinstance(step_rms, (int, float)) and 0 < step_rms <= 64
                                    and math.isfinite(step_rms)):
            raise SpecError(f"the step multiple of the rms must be a number in (0, 64], got {step_rms!r}")
        if scale == "mean" and bits != 1:
            raise SpecError(f"the 'mean' scale is for 1-bit (sign) quantization, not {bits} bits; "
                            "use max or l2")
        if grid not in GRIDS:
            raise SpecError(f"unknown grid {grid!r}; valid: {', '.join(GRIDS)}")
        if scale_dtype not in (torch.float16, torch.float32):
            raise SpecError(f"scale dtype must be torch.float16 or torch.float32, got {scale_dtype}")
        self.bits = bits
        self.granularity = granularity
        self.block = block if granularity == "block" else 0
        self.rounding = rounding
        self.scale_mode = scale
        self._default_scale = default_scale
        self.scale_dtype = scale_dtype
        self.check_finite = check_finite
        self.grid = grid
        # largest code; both grids put levels qmax/2 steps either side of zero, at -scale .. +scale
        self.qmax = qmax(bits) if grid == "midtread" else 2**bits - 1
        self._l2_clip = (L2_CLIP if grid == "midtread" else L2_CLIP_MIDRISE)[bits]
        self.step_rms = None if step_rms is None else float(step_rms)
        if backend is not None:
            try:
                kernels.check_backend(backend)
            except ValueError as e:
                raise SpecError(str(e)) from None
        self.backend = backend

    @property
    def spec(self) -> str:
        parts = [f"q{self.bits}"]
        if self.granularity == "block":
            parts.append(f"block{self.block}")
        elif self.granularity != "channel":
            parts.append(self.granularity)
        if self.rounding != "nearest":
            parts.append(self.rounding)
        if self.scale_mode == "step":
            parts.append(f"step{self.step_rms:g}")
        elif self.scale_mode != self._default_scale:
            parts.append(self.scale_mode)
        if self.grid != "midtread":
            parts.append(self.grid)
        if self.scale_dtype == torch.float32:
            parts.append("scale32")
        return ":".join(parts)

    def _groups(self, shape: Sequence[int]) -> _Groups:
        return _Groups(shape, self.granularity, self.block)

    def payload_bytes(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> int:
        g = self._groups(shape)
        return g.nscales * self.scale_dtype.itemsize + packed_nbytes(g.numel, self.bits)

    def step(self, scales: torch.Tensor) -> torch.Tensor:
        """Quantization step of each group, from its stored scale."""
        return scales.float() * (2.0 / self.qmax)

    # -- encode ------------------------------------------------------------------------------------
    def _scales(self, x2: torch.Tensor, dim: int) -> torch.Tensor:
        if self.scale_mode == "mean":
            return x2.abs().mean(dim=dim)
        s = x2.abs().amax(dim=dim)
        if self.scale_mode in ("l2", "step"):
            return self._rms_capped(s, x2.square().mean(dim=dim).sqrt())
        return s

    def _rms_capped(self, max_abs: torch.Tensor, rms: torch.Tensor) -> torch.Tensor:
        """The ``l2`` and ``step`` scales: ``min(max-abs, k * rms)``, times ``qmax / 2`` for ``step`` (whose
        ``k`` sets the step, not the outermost level)."""
        if self.scale_mode == "l2":
            return torch.minimum(max_abs, rms * self._l2_clip)
        return torch.minimum(max_abs, rms * self.step_rms) * (self.qmax / 2.0)

    def _encode(self, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        if x.numel() == 0:
            return torch.empty(0, dtype=torch.uint8, device=x.device)
        ops = kernels.for_tensor(x, self.backend)
        if ops.quantizes(x.dtype, self.rounding):
            plan = kernels.plan(x.shape, self.granularity, self.block, self.bits)
            out = None if plan is None else self._encode_planned(ops, x, plan, generator)
            if out is not None:
                return out
        stored, codes = self.quantize(x, generator)
        return torch.cat([stored.view(torch.uint8), pack_bits(codes, self.bits)])

    def _encode_planned(self, ops: kernels.Kernels, x: torch.Tensor, plan: tuple[int, int, bool],
                        generator: torch.Generator | None = None) -> torch.Tensor | None:
        """The payload from the kernels' operations (:mod:`aqsgd.compress.kernels`) on the fp32 ``[rows, k]``
        view; None where the backend has no kernel for them. Stochastic rounding (where the backend takes it)
        draws its noise as the general path does, after the scales, so the bytes are the same."""
        rows, k, by_col = plan
        x2 = self._fp32_rows(x, rows, k)
        if (defers_checks(x.device) and not by_col and self.granularity != "tensor"
                and self.scale_mode == "max" and self.rounding == "nearest" and ops.fuses_scales):
            out = self._max_quantized_rows(ops, x2)
            if out is not None:
                return out
        fused = self._device_scales(ops, x2, x.shape, by_col) if defers_checks(x.device) else None
        if fused is not None:
            out, nsb, inv = fused
        else:
            s = self._planned_scales(x2, x.shape, by_col, lambda: ops.max_abs(x2, by_col))
            if s is None:
                return None
            stored, inv, _ = self._scale_steps(s, torch.float32)
            out, nsb = self._payload(stored, rows, k, x.device)
        noise = None
        if self.rounding == "stochastic":  # the general path's draw: the same generator, shape and order
            noise = self._noise((x2.numel(),), torch.float32, x.device, generator).view(rows, k)
        # codes at t = x / step + qmax / 2, plus 0.5 (nearest) or the noise (stochastic), then truncated
        packed = ops.quantize_pack(x2, self._per_group(inv, rows, k, by_col), by_col,
                                   self.qmax / 2.0 + (0.5 if noise is None else 0.0), self.bits, self.qmax,
                                   out=out[nsb:].view(rows, -1), noise=noise)
        return None if packed is None else out

    def _max_quantized_rows(self, ops: kernels.Kernels, x2: torch.Tensor) -> torch.Tensor | None:
        """The payload of ``max`` scales per row (``token``, ``blockN``) with nearest rounding from one
        operation of the backend (:meth:`~aqsgd.compress.kernels.Kernels.max_quantize_rows`: on a GPU one
        launch, where the scales and the codes took two), the check deferred as a device flag; None where
        the backend has no such operation. Same bytes."""
        rows, k = x2.shape
        nsb = rows * self.scale_dtype.itemsize
        out = torch.empty(nsb + rows * k * self.bits // 8, dtype=torch.uint8, device=x2.device)
        flag = torch.zeros(1, dtype=torch.int32, device=x2.device)
        if not ops.max_quantize_rows(x2, out[:nsb].view(self.scale_dtype), self.qmax, flag,
                                     self.qmax / 2.0 + 0.5, self.bits, out[nsb:].view(rows, -1)):
            return None
        if self.check_finite:
            defer_check(flag, non_finite_message(self.spec))
        return out

    def _device_scales(self, ops: kernels.Kernels, x2: torch.Tensor, shape: Sequence[int], by_col: bool
                       ) -> tuple[torch.Tensor, int, torch.Tensor] | None:
        """``(payload, scale bytes, inv)`` with the scales made, stored at the payload's head and checked by
        the backend's kernels (for ``max``: in the launch that finds the maxima), the check deferred as a
        device flag; None where the backend has no such kernel. For encodes whose checks are deferred (on a
        GPU): the dozen small operations of :meth:`_scale_steps` cost a launch each there. Same bytes."""
        if (not ops.fuses_scales or self.granularity == "tensor"
                or self.scale_mode not in ("max", "l2", "step")):
            return None
        rows, k = x2.shape
        if self.scale_mode == "max":
            return self._scaled_payload(k if by_col else rows, rows, k, x2.device, lambda stored, flag:
                                        ops.max_scales(x2, by_col, stored, self.qmax, flag))
        s = self._planned_scales(x2, shape, by_col, lambda: ops.max_abs(x2, by_col))
        if s is None:
            return None
        s = s.to(torch.float32).contiguous()
        return self._scaled_payload(s.numel(), rows, k, x2.device,
                                    lambda stored, flag: ops.scales(s, stored, self.qmax, flag))

    def _scaled_payload(self, groups: int, rows: int, k: int, device: torch.device, make
                        ) -> tuple[torch.Tensor, int, torch.Tensor] | None:
        """``(payload, scale bytes, inv)``: a payload whose head ``make(stored, flag)`` fills with the stored
        scales of ``groups`` groups by a kernel that raises the int32 ``flag`` on NaN/Inf and returns ``inv``
        (None: the backend has no such kernel); the flag deferred as the encode's check."""
        nsb = groups * self.scale_dtype.itemsize
        out = torch.empty(nsb + rows * k * self.bits // 8, dtype=torch.uint8, device=device)
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        inv = make(out[:nsb].view(self.scale_dtype), flag)
        if inv is None:
            return None
        if self.check_finite:
            defer_check(flag, non_finite_message(self.spec))
        return out, nsb, inv

    def _noise(self, shape: Sequence[int], cdt: torch.dtype, device: torch.device,
               generator: torch.Generator | None) -> torch.Tensor:
        """Stochastic rounding's uniform noise in ``[0, 1)``, one value per element in the flat order."""
        if generator is not None and generator.device.type != device.type:
            raise CodecError(f"{self.spec}: stochastic rounding of a tensor on {device} needs a "
                             f"generator on that device, got one on {generator.device}")
        return torch.rand(tuple(shape), dtype=cdt, device=device, generator=generator)

    @staticmethod
    def _fp32_rows(x: torch.Tensor, rows: int, k: int) -> torch.Tensor:
        """``x`` as the contiguous fp32 ``[rows, k]`` view the kernels read (a copy only where needed)."""
        x2 = x.detach().reshape(rows, k)
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.to(torch.float32).contiguous()
        return x2

    def _planned_scales(self, x2: torch.Tensor, shape: Sequence[int], by_col: bool, max_abs
                        ) -> torch.Tensor | None:
        """Each group's scale, as the general path computes it, from the fp32 view ``x2`` and a kernel's max
        |x| per column or row (``max_abs()``; exact in any order, where a mean is not: that stays torch's).
        None where the kernel is missing."""
        if self.scale_mode == "max":
            s = max_abs()
            if s is None:
                return None
            return s.amax().reshape(1) if self.granularity == "tensor" else s
        if self.scale_mode in ("l2", "step") and self.granularity != "tensor":
            m = max_abs()
            if m is None:
                return None
            # the same view and reduction as the general path's
            rms = x2.square().mean(dim=0 if by_col else 1).sqrt()
            return self._rms_capped(m, rms)
        return torch.cat([self._scales(v, d) for v, d in self._groups(shape).views(x2.view(-1))])

    def _payload(self, stored: torch.Tensor, rows: int, k: int, device: torch.device
                 ) -> tuple[torch.Tensor, int]:
        """An uninitialized payload with the stored scales written at its head, and the scales' byte count."""
        nsb = stored.numel() * self.scale_dtype.itemsize
        out = torch.empty(nsb + rows * k * self.bits // 8, dtype=torch.uint8, device=device)
        out[:nsb] = stored.view(torch.uint8)
        return out, nsb

    @staticmethod
    def _per_group(v: torch.Tensor, rows: int, k: int, by_col: bool) -> torch.Tensor:
        """One fp32 value per column (``by_col``) or per row of the kernels' view, contiguous."""
        if v.numel() != (k if by_col else rows):
            v = v.expand(rows)
        return v.to(torch.float32).contiguous()

    def _scale_steps(self, s: torch.Tensor, cdt: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor, float | None]:
        """Checked stored scales, the reciprocal steps ``qmax / (2 * scale)`` (0 for a zero scale), max
        scale (None where the checks are deferred: the value stays on the device)."""
        if defers_checks(s.device):
            # the same checks as device flags, read where the packet's bytes are synchronised anyway
            smax = None
            if self.check_finite:
                top = s.max()
                defer_check(~torch.isfinite(top), non_finite_message(self.spec))
                if self.scale_dtype == torch.float32:
                    defer_check(top > _FP32_MAX, non_finite_message(self.spec, "input (or its fp32 scale)"))
        else:
            # One host sync for both checks: NaN/Inf anywhere make the largest scale non-finite.
            smax = float(s.max())
        if smax is not None and self.check_finite:
            if not math.isfinite(smax):
                raise_non_finite(self.spec)
            if self.scale_dtype == torch.float32 and smax > _FP32_MAX:
                # float64 input beyond fp32's range: its scale would be stored as Inf, which receivers reject
                raise_non_finite(self.spec, "input (or its fp32 scale)")
        stored = store_scales(s, self.scale_dtype)
        sf = stored.to(cdt)
        inv = torch.where(sf > 0, self.qmax / (2.0 * sf), torch.zeros_like(sf))
        return stored, inv, smax

    def quantize(self, x: torch.Tensor,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(stored scales, flat uint8 codes)`` of a non-empty tensor, before packing."""
        groups = self._groups(x.shape)
        cdt = _compute_dtype(x.dtype)
        flat = x.reshape(-1)
        if flat.dtype != cdt:
            flat = flat.to(cdt)
        views = groups.views(flat)
        raw = [self._scales(v, d) for v, d in views]
        s = raw[0] if len(raw) == 1 else torch.cat(raw)
        stored, inv, smax = self._scale_steps(s, cdt)
        # (checks deferred: clip whenever a scale may have been clamped; the same codes where none was)
        clip = self.scale_mode != "max" or (self.scale_dtype == torch.float16
                                            and (smax is None or smax > _FP16_MAX))
        t = torch.empty_like(flat)
        # t = x / step + qmax / 2 is the fractional code (level k at t = k): +0.5 and floor round to nearest
        # (filled on the device: torch.tensor would copy it from the host, a synchronisation on CUDA)
        offset = torch.full((), self.qmax / 2.0 + (0.5 if self.rounding == "nearest" else 0.0), dtype=cdt,
                            device=x.device)
        start = 0
        tviews = groups.views(t)
        for (v, d), (tv, _) in zip(views, tviews):
            n = tv.shape[1 - d] if d == 0 else tv.shape[0]
            torch.addcmul(offset, v, _Groups.bcast(inv[start : start + n], d), out=tv)
            start += n
        if self.rounding == "stochastic":
            t.add_(self._noise(t.shape, cdt, t.device, generator))
        if clip or self.rounding == "stochastic":
            t.clamp_(0.0, float(self.qmax))
        # t is in [0, qmax + 1): truncation is floor. float -> int8/int16 conversions are vectorized on CPU
        # where float -> uint8 is not (3-6x slower), so convert through a signed type of the same values.
        codes = t.to(torch.int8).view(torch.uint8) if self.qmax <= 127 else t.to(torch.int16).to(torch.uint8)
        return stored, codes

    # -- decode ------------------------------------------------------------------------------------
    def _decode(self, packet: Packet) -> torch.Tensor:
        groups = self._groups(packet.shape)
        out_dtype = packet.dtype
        payload = packet.payload
        nsb = groups.nscales * self.scale_dtype.itemsize
        if groups.numel == 0:
            return torch.empty(packet.shape, dtype=out_dtype, device=payload.device)
        out = self._decode_scaled(payload, nsb, packet.shape, out_dtype)
        if out is not None:
            return out
        scales = self._checked_scales(payload[:nsb])
        return self.dequantize_packed(scales, payload[nsb:], packet.shape, out_dtype)

    def _decode_scaled(self, payload: torch.Tensor, nsb: int, shape: Sequence[int], out_dtype: torch.dtype
                       ) -> torch.Tensor | None:
        """The decoded tensor from one kernel that reads and checks the stored scales itself (the backend's
        ``unpack_scaled``: on a GPU, where each small operation of the general path costs a launch), the
        check pending or read at once as :meth:`_checked_scales` does; None where the backend has none."""
        ops = kernels.for_device(payload.device, self.backend)
        if not ops.fuses_scales or self.granularity == "tensor" or out_dtype == torch.float64:
            return None
        plan = kernels.plan(shape, self.granularity, self.block, self.bits)
        if plan is None:
            return None
        rows, k, by_col = plan
        mul, low, divisor = self._level_terms()
        flag = torch.zeros(1, dtype=torch.int32, device=payload.device)
        out = ops.unpack_scaled(
            payload[nsb:].view(rows, -1), bytes_as(payload[:nsb], self.scale_dtype), by_col, self.bits, mul,
            low, divisor, flag)
        if out is None:
            return None
        self._scales_checked(flag)
        out = out.view(shape)
        return out if out_dtype == torch.float32 else out.to(out_dtype)

    def _checked_scales(self, raw: torch.Tensor) -> torch.Tensor:
        """The received scales, checked (finite, not negative): at once (one host read for both checks), or
        left on the device as a pending check where :func:`~aqsgd.compress.base.defers_pending_checks` (a
        receiver on a GPU; the scales are used as they are, and the caller raises the same PacketError at
        its step's end)."""
        scales = bytes_as(raw, self.scale_dtype)
        bad = (~torch.isfinite(scales) | (scales < 0)).any()
        self._scales_checked(bad)
        return scales

    def _scales_checked(self, bad: torch.Tensor) -> None:
        """A decode's check of its received scales (``bad``: nonzero where one is not finite or negative):
        pending where :func:`~aqsgd.compress.base.defers_pending_checks` (a receiver on a GPU), else read at
        once."""
        if defers_pending_checks(bad.device):
            defer_pending_check(bad, self._bad_scales)
        elif bool(bad):
            raise self._bad_scales()

    def _bad_scales(self) -> PacketError:
        return PacketError(f"{self.spec}: packet holds invalid (non-finite or negative) scales")

    def dequantize_packed(self, scales: torch.Tensor, packed: torch.Tensor, shape: Sequence[int],
                          out_dtype: torch.dtype) -> torch.Tensor:
        """Stored scales and packed codes (flat uint8) to a tensor of ``shape``: the kernels' operation where
        it applies (:mod:`aqsgd.compress.kernels`), else the general path."""
        plan = (kernels.plan(shape, self.granularity, self.block, self.bits) if out_dtype != torch.float64
                else None)
        if plan is not None:
            rows, k, by_col = plan
            mul, low, step = self._levels(scales, torch.float32)
            out = kernels.for_device(packed.device, self.backend).unpack_dequantize(
                packed.view(rows, -1), self._per_group(step, rows, k, by_col), by_col, self.bits, mul, low)
            if out is not None:
                out = out.view(shape)
                return out if out_dtype == torch.float32 else out.to(out_dtype)
        return self.dequantize(scales, unpack_bits(packed, self.bits, numel_of(shape)), shape, out_dtype)

    def _levels(self, scales: torch.Tensor, cdt: torch.dtype) -> tuple[int, int, torch.Tensor]:
        """``(mul, low, step)``: code ``c`` decodes to ``(c * mul - low) * step`` of its group."""
        mul, low, divisor = self._level_terms()
        return mul, low, divided(scales, divisor, cdt)

    def _level_terms(self) -> tuple[int, int, int]:
        """``(mul, low, divisor)``: code ``c`` decodes to ``(c * mul - low) * (scale / divisor)``."""
        if self.grid == "midrise" and self.bits > 1:
            # code c is level (c - qmax/2) * step = (2c - qmax) * scale / qmax: an odd integer times
            # scale / qmax
            return 2, self.qmax, self.qmax
        if self.bits == 1:  # +-1 times the scale
            return 2, 1, 1
        # signed level c - L (an exact small integer) times scale / L
        return 1, self.qmax // 2, self.qmax // 2

    def dequantize(self, scales: torch.Tensor, codes: torch.Tensor, shape: Sequence[int],
                   out_dtype: torch.dtype) -> torch.Tensor:
        """Inverse of :meth:`quantize`: stored scales and flat codes to a tensor of ``shape``."""
        groups = self._groups(shape)
        cdt = _compute_dtype(out_dtype)
        if self.grid == "midrise" and self.bits > 1:
            # code c is level (c - qmax/2) * step = (2c - qmax) * scale / qmax: an odd integer times
            # scale / qmax
            out = codes.to(cdt).mul_(2.0).sub_(self.qmax)
            step = divided(scales, self.qmax, cdt)
        else:
            out = _signed_levels(codes, self.bits).to(cdt)
            # signed level k (an exact small integer) times scale / L; bits == 1: +-1 times the scale
            step = divided(scales, 1 if self.bits == 1 else self.qmax // 2, cdt)
        start = 0
        for v, d in groups.views(out):
            n = v.shape[1 - d] if d == 0 else v.shape[0]
            v.mul_(_Groups.bcast(step[start : start + n], d))
            start += n
        out = out.view(shape)
        return out if out_dtype == cdt else out.to(out_dtype)


# -- row-wise helpers for low-bit storage (each row is one scale group, rows packed independently) ----
def quantize_groups(
    x: torch.Tensor, bits: int, *, rounding: str = "nearest", generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of ``x`` ([G, N], float) as one max-abs group.

    Returns ``(packed, scales)``: uint8 ``[G, ceil(N * bits / 8)]`` (each row packed on its own) and fp16
    ``[G]``. Same grid and rounding as :class:`QuantCodec`.
    """
    if x.dim() != 2:
        raise CodecError(f"quantize_groups expects a 2-D tensor [groups, n], got shape {tuple(x.shape)}")
    # Its checks (magnitudes within fp16, NaN/Inf) are a receiver's where the rows were decoded (the low-bit
    # cache stores m + decode(packet)): pending, on the device, where defers_pending_checks says so.
    later = bool(x.numel()) and defers_pending_checks(x.device)
    if later:  # NaN compares False here too: the codec's check (collected below) reports it
        defer_pending_check(x.abs().amax() > _FP16_MAX, _groups_range_error)
    elif x.numel() and float(x.abs().max()) > _FP16_MAX:  # NaN compares False: the codec reports it below
        raise _groups_range_error()
    codec = QuantCodec(bits, granularity="token", rounding=rounding, scale="max")
    g, n = x.shape
    n8 = -(-n // 8) * 8
    if g * n == 0:
        return (x.new_zeros((g, packed_nbytes(n, bits)), dtype=torch.uint8),
                x.new_zeros(g, dtype=torch.float16))
    if not later:
        return _quantize_groups(codec, x, g, n, n8, bits, generator)
    with collecting_checks() as checks:  # the codec's NaN/Inf check deferred (on CUDA), then made pending
        out = _quantize_groups(codec, x, g, n, n8, bits, generator)
    for flag, message in checks:
        defer_pending_check(flag, lambda m=message: NonFiniteError(m))
    return out


def _groups_range_error() -> CodecError:
    return CodecError(f"quantize_groups: magnitudes above {_FP16_MAX} do not fit fp16 scales")


def _quantize_groups(codec: QuantCodec, x: torch.Tensor, g: int, n: int, n8: int, bits: int,
                     generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    if n8 == n:  # rows end on byte boundaries: the packet's codes are the rows packed one after another
        payload = codec._encode(x.contiguous(), generator)
        return payload[2 * g :].view(g, -1), bytes_as(payload[: 2 * g], torch.float16)
    scales, codes = codec.quantize(x.contiguous(), generator)
    codes = codes.view(g, n)
    if n8 != n:  # zero padding codes, so each row packs on its own and its spare bits are zero
        codes = torch.nn.functional.pad(codes, (0, n8 - n))
    packed = pack_bits(codes.reshape(-1), bits).view(g, n8 * bits // 8)[:, : packed_nbytes(n, bits)]
    return packed.contiguous(), scales


def dequantize_groups(
    packed: torch.Tensor, scales: torch.Tensor, bits: int, n: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_groups`: float ``[G, n]``."""
    g = packed.shape[0]
    n8 = -(-n // 8) * 8
    if n8 == n:
        codec = QuantCodec(bits, granularity="token", scale="max")
        return codec.dequantize_packed(scales.to(torch.float16).reshape(-1), packed.reshape(-1),
                                       (g, n), dtype)
    row = n8 * bits // 8
    if packed.shape[1] != row:
        packed = torch.nn.functional.pad(packed, (0, row - packed.shape[1]))
    codes = unpack_bits(packed.reshape(-1), bits, g * n8).view(g, n8)[:, :n].reshape(-1)
    codec = QuantCodec(bits, granularity="token", scale="max")
    return codec.dequantize(scales.to(torch.float16).reshape(-1), codes, (g, n), dtype)
