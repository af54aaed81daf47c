"""What the transport's ``isend``/``irecv`` return.

A :class:`SendHandle` or :class:`RecvHandle` is completed exactly once by the link's background thread (see
:mod:`aqsgd.comm.workers`), or failed by ``close()``; ``wait()`` returns the outcome on the caller's thread.
Completion is a bare lock rather than a ``threading.Event`` (a visible part of a small message's hand-over).
A link failure raises :class:`~aqsgd.errors.PeerFailure` naming the peer; a peer that is alive but silent
makes ``wait()`` raise :class:`~aqsgd.errors.PeerTimeout` after ``timeout_s`` (measured from the ``wait``
call; the request stays queued and completes if the message comes later). On an emulated link a received
message is not delivered before the arrival time its preamble carries: ``wait``/``done`` hold it back. On a
CUDA transport ``RecvHandle.wait`` marks the payloads as used by the caller's stream (``record_stream``).

A handle adds the time its caller spent in ``wait()`` to its link's :class:`~aqsgd.comm.stats.LinkStats`.
It knows its transport as a :class:`~aqsgd.comm.core.TransportCore` (the transport imports this module).
"""

from __future__ import annotations

import _thread
import threading
import time
from typing import TYPE_CHECKING

import torch

from aqsgd.comm.stats import StatsKey
from aqsgd.compress.packet import Packet
from aqsgd.errors import PeerTimeout

if TYPE_CHECKING:
    from aqsgd.comm.core import TransportCore

__all__ = ["RecvHandle", "SendHandle"]

_FINISH_LOCK = threading.Lock()


class _Handle:
    """Completion of one queued operation; set exactly once by a background thread.

    The completion is a bare lock, held from construction until ``_finish`` releases it (a
    ``threading.Event`` costs a condition variable and a lock per waiter: several microseconds on each side
    of every message, a visible part of a small message's hand-over)."""

    _direction = ""

    def __init__(self, transport: TransportCore, peer: int, channel: int, stats_key: StatsKey) -> None:
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
