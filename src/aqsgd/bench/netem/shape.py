"""How one direction of a link between two namespaces is shaped (:class:`LinkShape`): a rate for the kernel's
``tbf``, and the delay, jitter and loss that the user-space wire (:mod:`aqsgd.bench.netem_wire`) applies where
the kernel has no ``sch_netem`` (see :mod:`aqsgd.bench.netem.cluster`, Shaping)."""

from __future__ import annotations

import dataclasses
import json

__all__ = ["LinkShape"]


@dataclasses.dataclass(frozen=True)
class LinkShape:
    """How one direction of a link is shaped: ``rate_mbit`` (None: unlimited, veth speed; kernel ``tbf``),
    one-way ``delay_ms`` with uniform ``jitter_ms`` (reorders frames, like netem; TCP copes) and random
    ``loss_pct`` (100: the direction is cut). Delay, jitter and loss below 100% go through the user-space
    wire (:mod:`aqsgd.bench.netem_wire`)."""

    rate_mbit: float | None = None
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss_pct: float = 0.0

    def __post_init__(self) -> None:
        if self.rate_mbit is not None and not self.rate_mbit > 0:
            raise ValueError(f"rate_mbit must be > 0 or None, got {self.rate_mbit}")
        if self.delay_ms < 0 or self.jitter_ms < 0 or self.jitter_ms > self.delay_ms:
            raise ValueError(f"need 0 <= jitter_ms <= delay_ms, got delay {self.delay_ms}, jitter "
                             f"{self.jitter_ms}")
        if not 0 <= self.loss_pct <= 100:
            raise ValueError(f"loss_pct must be in [0, 100], got {self.loss_pct}")

    @property
    def impaired(self) -> bool:
        """Whether the wire must do something (delay, jitter or loss) in this direction."""
        return bool(self.delay_ms or self.jitter_ms or self.loss_pct)

    def describe(self) -> str:
        parts = [f"{self.rate_mbit:g} Mbit/s" if self.rate_mbit else "unlimited"]
        if self.delay_ms or self.jitter_ms:
            parts.append(f"{self.delay_ms:g}±{self.jitter_ms:g} ms" if self.jitter_ms
                         else f"{self.delay_ms:g} ms")
        if self.loss_pct:
            parts.append(f"{self.loss_pct:g}% loss")
        return ", ".join(parts)

    def tc_commands(self, ns: str, dev: str) -> list[list[str]]:
        """The tc command lines that put this shape's rate on ``dev`` in namespace ``ns`` (after a root
        delete; none without a rate)."""
        if not self.rate_mbit:
            return []
        rate_bytes = self.rate_mbit * 1e6 / 8
        burst = max(4096, int(rate_bytes * 1e-3))  # 1 ms at line rate
        limit = max(256 * 1024, int(rate_bytes * 0.1))  # >= 100 ms of queue: no tail drops on TCP bursts
        return [["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf",
                 "rate", f"{int(self.rate_mbit * 1000)}kbit", "burst", str(burst), "limit", str(limit)]]

    def impairment_json(self) -> str:
        return json.dumps({"delay_ms": self.delay_ms, "jitter_ms": self.jitter_ms, "loss_pct": self.loss_pct})
