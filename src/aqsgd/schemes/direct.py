"""``direct``: send ``C(x)``; no state. Warm-up sends full precision (``C(x)`` with
:meth:`~aqsgd.schemes.base.BoundaryScheme.compress_warmup`)."""

from __future__ import annotations

import torch

from aqsgd.compress import Packet
from aqsgd.schemes.base import BoundaryScheme, Kind, Phase

__all__ = ["DirectScheme"]


class DirectScheme(BoundaryScheme):
    name = "direct"
    warmup_codec_allowed = True

    def _send(self, x: torch.Tensor, ids: torch.Tensor | None, phase: Phase, slot: int) -> list[Packet]:
        if self._probing(slot):
            self._measure(x, x)
        kind, codec = self._first() if phase == Phase.WARMUP else (Kind.DIRECT, self.codec)
        return [self._tagged(codec.encode(x, generator=self.generator), 0, kind)]

    def _recv(self, packets: list[Packet], ids: torch.Tensor | None, phase: Phase, slot: int) -> torch.Tensor:
        kind, codec = self._first() if phase == Phase.WARMUP else (Kind.DIRECT, self.codec)
        self._expect_kinds(packets, [kind], phase)
        return codec.decode(packets[0])
