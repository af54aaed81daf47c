"""What the transport's ``isend``/``irecv`` return, and its traffic counters.

A :class:`SendHandle` or :class:`RecvHandle` is completed exactly once by the link's background thread (see
:mod:`aqsgd.comm.workers`), or failed by ``close()``; ``wait()`` returns the outcome on the caller's thread.
Completion is a bare lock rather than a ``threading.Event`` (a visible part of a small message's hand-over).
A link failure raises :class:`~aqsgd.errors.PeerFailure` naming the peer; a peer that is alive but silent
makes ``wait()`` raise :class:`~aqsgd.errors.PeerTimeout` after ``timeout_s`` (measured from the ``wait``
call; the request stays queued and completes if the message comes later). On an emulated link a received
message is not delivered before the arrival time its preamble carries: ``wait``/``done`` hold it back. On a
CUDA transport ``RecvHandle.wait`` marks the payloads as used by the caller's stream (``record_stream``).

:class:`LinkStats` counts one (peer, channel, direction)'s traffic under a :class:`StatsKey`; the transport
keeps them (:attr:`~aqsgd.comm.transport.Transport.stats`).
"""

from __future__ import annotations

import _thread
import dataclasses
import threading
import time
from typing import Any, NamedTuple

import torch

from aqsgd.compress.packet import Packet
from aqsgd.errors import PeerTimeout

__all__ = ["LinkStats", "RecvHandle", "SendHandle", "StatsKey"]

# The aqsgd.comm.transport.Transport that owns a handle (that module imports this one, not the reverse)
_Transport = Any
_FINISH_LOCK = threading.Lock()


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


class _Handle:
    """Completion of one queued operation; set exactly once by a background thread.

    The completion is a bare lock, held from construction until ``_finish`` releases it (a
    ``threading.Event`` costs a condition variable and a lock per waiter: several microseconds on each side
    of every message, a visible part of a small message's hand-over)."""

    _direction = ""

    def __init__(self, transport: _Transport, peer: int, channel: int, stats_key: StatsKey) -> None:
        self._transport = transport
        self.peer = peer
        self.channel = channel
        self._pending = _thread.allocate_lock()
        self._pending.acquire()
        self._finished = False
        self._packets: list[Packet] | None = None
        self._error: BaseException | None = None
        self._deliver_at = 0.0
        self._stats_key = stats_key

    def done(self) -> bool:
        """True once the operation completed or failed (``wait`` then returns or raises at once)."""
        return self._finished and (self._error is not None or time.time() >= self._deliver_at)

    def _finish(
        self, packets: list[Packet] | None = None, error: BaseException | None = None, deliver_at: float = 0.0
    ) -> None:
        with _FINISH_LOCK:  # a background thread and close() may race to finish the same handle
            if self._finished:
                return
            self._packets, self._error, self._deliver_at = packets, error, deliver_at
            self._finished = True
        self._pending.release()

    def _wait(self, timeout: float | None, verb: str) -> list[Packet] | None:
        limit = self._transport.timeout_s if timeout is None else timeout
        t0 = time.monotonic()
        try:
            finished = self._pending.acquire(True, min(max(limit, 0.0), threading.TIMEOUT_MAX))
            if finished:
                self._pending.release()  # later wait() and done() calls see it complete
            if finished and self._error is None:
                # Emulated latency: the message was received but is not delivered before its arrival time.
                # (This is not a failure, so it is not bounded by the timeout.)
                remaining = self._deliver_at - time.time()
                if remaining > 0:
                    time.sleep(remaining)
        finally:
            self._transport._add_wait(self._stats_key, time.monotonic() - t0)
        if not finished:
            peer = self._transport.describe_peer(self.peer)
            raise PeerTimeout(
                f"{peer} did not {verb} {self._transport.channel_name(self.channel)} within {limit:g} s",
                rank=self.peer,
                label=self._transport.peer_labels.get(self.peer),
            )
        if self._error is not None:
            raise self._error
        return self._packets


class SendHandle(_Handle):
    """A queued send. ``wait`` returns once the message has been handed to the peer (and, on an emulated
    link, has left the line). The packets' payloads must not be modified before that."""

    _direction = "send"

    def wait(self, timeout: float | None = None) -> None:
        """Block until sent; raises :class:`PeerFailure`, or :class:`PeerTimeout` after ``timeout``
        seconds (default: the transport's ``timeout_s``)."""
        self._wait(timeout, "accept")


class RecvHandle(_Handle):
    """A posted receive; ``wait`` returns the message's packets."""

    _direction = "recv"

    def wait(self, timeout: float | None = None) -> list[Packet]:
        """Block until the message arrived; raises :class:`PeerFailure`, or :class:`PeerTimeout` after
        ``timeout`` seconds (default: the transport's ``timeout_s``)."""
        packets = self._wait(timeout, "send")
        assert packets is not None
        if self._transport._cuda:
            for p in packets:  # payloads copied on a background thread's stream, now read on the caller's
                if p.payload.is_cuda:
                    p.payload.record_stream(torch.cuda.current_stream(p.payload.device))
        return packets
