"""The transport's traffic counters: one :class:`LinkStats` per (peer, channel, direction), under a
:class:`StatsKey` (:attr:`~aqsgd.comm.transport.Transport.stats`). The link's threads
(:mod:`aqsgd.comm.workers`) and handles (:mod:`aqsgd.comm.handles`) fill them in."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

__all__ = ["BACKLOG_FACTOR", "BACKLOG_SLACK_S", "LinkStats", "StatsKey"]


class StatsKey(NamedTuple):
    """Key of :attr:`~aqsgd.comm.transport.Transport.stats`: the peer's rank, the channel and ``"send"``
    or ``"recv"``."""

    peer: int
    channel: int
    direction: str


BACKLOG_FACTOR = 1.25  # a message arrived held back: its arrival gap exceeds the sender's hand-over gap by
BACKLOG_SLACK_S = 1e-3  # this factor and this many seconds (scheduling noise is not a slow link)


@dataclasses.dataclass
class LinkStats:
    """Traffic on one (peer, channel, direction).

    ``packet_bytes`` is the sum of ``packet.nbytes`` (headers + payloads), ``overhead_bytes`` the rest of
    the preambles; their sum is what crossed the wire. ``wait_s`` is the time the caller spent blocked in
    ``wait()`` on handles of this link. ``busy_s`` (sends): the time the link was carrying this process's
    messages, each from when it was handed over (or the previous one was done, if later) to its completion,
    so ``wire_bytes / busy_s`` is the throughput the link achieved while in use. On a real network a send is
    done once the kernel has taken its bytes, so while a slow link's backlog fits the socket buffers this
    looks faster than the link is.

    ``backlog_bytes`` and ``backlog_s`` (receives): the messages that arrived *held back*, later after the
    previous one than the sender had handed them over (by more than :data:`BACKLOG_FACTOR` and
    :data:`BACKLOG_SLACK_S`), so the link was busy carrying them in between; their wire bytes and the
    seconds between their arrivals. ``backlog_bytes / backlog_s`` is the throughput of a link that is the
    bottleneck, as its receiver sees it: no sender's buffer hides it.
    """

    messages: int = 0
    packets: int = 0
    packet_bytes: int = 0
    overhead_bytes: int = 0
    wait_s: float = 0.0
    busy_s: float = 0.0
    backlog_bytes: int = 0
    backlog_s: float = 0.0

    @property
    def wire_bytes(self) -> int:
        return self.packet_bytes + self.overhead_bytes
