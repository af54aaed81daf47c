"""The quantizer's fused AQ-SGD step against a cache's rows: :class:`QuantDelta`, a base of
:class:`~aqsgd.compress.quant.QuantCodec` (its ``encode_delta``/``decode_delta``).

The sender quantizes ``x - m`` and writes ``m + decode`` back into the cache rows in one pass of the kernels
(:mod:`aqsgd.compress.kernels`: ``delta_max_abs``, ``delta``, ``delta_encode_update``), the receiver adds the
decoded delta in place (``delta_decode_update``): bit-identical to get, encode, decode, add, put. A step
returns None where it does not apply (the caller goes step by step). A room of its own, apart from the
codec's general path; the scale arithmetic is the codec's (its methods, which this base calls).
"""

from __future__ import annotations

from typing import Sequence

import torch

from aqsgd.compress import kernels
from aqsgd.compress.base import collecting_checks, defers_checks, numel_of
from aqsgd.compress.packet import DeferredCheck, Packet, bytes_as

__all__ = ["QuantDelta"]


class QuantDelta:
    """The fused AQ-SGD step of :class:`~aqsgd.compress.quant.QuantCodec` (which defines the attributes and
    the scale arithmetic used here)."""

    has_fused_delta = True

    def _delta_plan(self, shape: Sequence[int], store: kernels.RowStore) -> tuple[int, int, bool, int] | None:
        """``(rows, k, by_col, rows per sample)`` for the fused AQ-SGD step, or None (the caller goes step by
        step)."""
        plan = kernels.plan(shape, self.granularity, self.block, self.bits)
        if plan is None or not shape or int(shape[0]) != store.ids.shape[0]:
            return None
        rows, k, by_col = plan
        n = numel_of(shape) // int(shape[0])
        if n != store.row_numel or n % k:  # a block straddling two samples' rows
            return None
        return rows, k, by_col, n // k

    def encode_delta(self, x: torch.Tensor, store: kernels.RowStore) -> Packet | None:
        with collecting_checks() as checks:
            packet = self._encode_delta(x, store)
        if packet is None or not checks:
            return packet
        return packet.with_check(DeferredCheck.of(checks))

    def _encode_delta(self, x: torch.Tensor, store: kernels.RowStore) -> Packet | None:
        ops = kernels.for_tensor(x, self.backend)
        if (x.numel() == 0 or self.rounding != "nearest" or not ops.quantizes(x.dtype, self.rounding)
                or store.device != x.device):
            return None
        plan = self._delta_plan(x.shape, store)
        if plan is None:
            return None
        rows, k, by_col, rpb = plan
        x2 = self._fp32_rows(x, rows, k)
        if self.scale_mode == "max":
            s = self._planned_scales(x2, x.shape, by_col, lambda: ops.delta_max_abs(x2, store, rpb, by_col))
        else:  # the scale needs a mean of x - m in torch's order: materialize x - m once
            d = ops.delta(x2, store, rpb)
            s = None if d is None else self._planned_scales(d, x.shape, by_col,
                                                            lambda: ops.max_abs(d, by_col))
        if s is None:
            return None
        made = self._device_scale_steps(ops, s, rows, k) if defers_checks(x.device) else None
        if made is not None:
            out, nsb, inv, (mul, low, step) = made
        else:
            stored, inv, _ = self._scale_steps(s, torch.float32)
            mul, low, step = self._levels(stored, torch.float32)
            out, nsb = self._payload(stored, rows, k, x.device)
        packed = ops.delta_encode_update(x2, store, rpb, self._per_group(inv, rows, k, by_col), by_col,
                                         self.qmax / 2.0 + 0.5, self.bits, self.qmax,
                                         self._per_group(step, rows, k, by_col), mul, low,
                                         out=out[nsb:].view(rows, -1))
        if packed is None:
            return None
        return Packet(self.family, torch.float32, tuple(x.shape), self.fingerprint, out)

    def _device_scale_steps(self, ops: kernels.Kernels, s: torch.Tensor, rows: int, k: int
                            ) -> tuple[torch.Tensor, int, torch.Tensor, tuple[int, int, torch.Tensor]] | None:
        """AQ-SGD's sender with its checks deferred: ``(payload, scale bytes, inv, (mul, low, step))`` from
        one kernel that stores the scales ``s`` at the payload's head, checks them and writes ``inv`` and the
        decode steps (the backend's ``scales``); None where the backend has none."""
        if not ops.fuses_scales or self.granularity == "tensor":
            return None
        mul, low, divisor = self._level_terms()
        step = torch.empty(s.numel(), dtype=torch.float32, device=s.device)
        s = s.to(torch.float32).contiguous()
        made = self._scaled_payload(s.numel(), rows, k, s.device, lambda stored, flag: ops.scales(
            s, stored, self.qmax, flag, step=step, divisor=divisor))
        return None if made is None else (*made, (mul, low, step))

    def decode_delta(self, packet: Packet, store: kernels.RowStore) -> torch.Tensor | None:
        self.check_packet(packet)
        device = packet.payload.device
        if packet.dtype != torch.float32 or packet.payload.numel() == 0 or store.device != device:
            return None
        plan = self._delta_plan(packet.shape, store)
        if plan is None:
            return None
        rows, k, by_col, rpb = plan
        nsb = self._groups(packet.shape).nscales * self.scale_dtype.itemsize
        ops = kernels.for_device(device, self.backend)
        mul, low, divisor = self._level_terms()
        step = None
        if ops.fuses_scales:
            flag = torch.zeros(1, dtype=torch.int32, device=device)
            step = ops.steps(bytes_as(packet.payload[:nsb], self.scale_dtype), divisor, flag)
        if step is not None:  # one launch reads, checks and divides the scales
            self._scales_checked(flag)
        else:
            mul, low, step = self._levels(self._checked_scales(packet.payload[:nsb]), torch.float32)
        out = ops.delta_decode_update(
            packet.payload[nsb:].view(rows, -1), store, rpb, self._per_group(step, rows, k, by_col), by_col,
            self.bits, mul, low)
        return None if out is None else out.view(packet.shape)
