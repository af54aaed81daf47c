"""``direct``: send ``C(x)``; no state. Warm-up sends full precision."""

from __future__ import annotations

import torch

from aqsgd.compress import Packet
from aqsgd.schemes.base import BoundaryScheme, Kind, Phase

__all__ = ["DirectScheme"]


class DirectScheme(BoundaryScheme):
    name = "direct"

    def _send(self, x: torch.Tensor, ids: torch.Tensor | None, phase: Phase, slot: int) -> list[Packet]:
        if self._probing(slot):
            self._measure(x, x)
        if phase == Phase.WARMUP:
            return [self._tagged(self.raw.encode(x), 0, Kind.RAW)]
        return [self._tagged(self.codec.encode(x, generator=self.generator), 0, Kind.DIRECT)]

    def _recv(self, packets: list[Packet], ids: torch.Tensor | None, phase: Phase, slot: int) -> torch.Tensor:
        kind, codec = (Kind.RAW, self.raw) if phase == Phase.WARMUP else (Kind.DIRECT, self.codec)
        self._expect_kinds(packets, [kind], phase)
        return codec.decode(packets[0])
