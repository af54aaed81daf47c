"""Packets between processes over ``torch.distributed``: background threads, link emulation, accounting.

Wire protocol
-------------
One *message* carries 0..8 :class:`~aqsgd.compress.packet.Packet` s from one rank to another on one
*channel* (an integer 0..255; :data:`FORWARD` = 0 for activations, :data:`BACKWARD` = 1 for gradients by
convention). It is a *preamble* and the packets' payloads, sent with the same tag:

1. the preamble, a fixed :data:`PREAMBLE_BYTES` = 576-byte uint8 block (no pickle)::

       offset bytes field
       0      4     magic b"AQTP"
       4      1     protocol version (2)
       5      1     number of packets n (0..8)
       6      2     channel
       8      8     sequence number of the message on its (sender, receiver, channel)
       16     8     total payload bytes (sum of the packets' payload lengths)
       24     8     arrival time, float64 wall-clock seconds (0 = deliver at once); see link emulation
       32     1     flags: 0x01 = the payload follows in the same gloo message; 0x02 = the sender checksums
                    CPU payloads (its ``checksum`` setting, which the receiver's must equal)
       33     27    reserved (zero)
       60     4     CRC-32 of bytes 0..59 and 64..575
       64     512   the n packets' 64-byte headers, then zeros

2. the packets' payloads concatenated, exactly the announced total.

Most messages are one gloo message (preamble and payloads in one uint8 tensor): every receive is posted with
a buffer of the link's *receive size* (gloo accepts a shorter message into a longer buffer), so the receiver
need not learn the size first. A message longer than the receive size goes as two gloo messages (the
preamble alone, then the payloads, exactly sized) and raises the receive size to its own length (at most
576 bytes + 64 MiB). Both sides keep the receive size of each (sender, receiver, channel) by the same rule
from the same ordered messages, starting at 576 bytes + 64 KiB, and the flag tells the receiver which form
came (a disagreement is a malformed message). A pipeline's messages keep one size, so after the first
(when larger than 64 KiB) each costs one gloo rendezvous. NCCL needs exactly sized receives: there every
message with a payload goes in two parts.

The receiver checks magic, version, CRC, channel and sequence number, parses every header with
:func:`~aqsgd.compress.packet.parse_header` and builds the packets with ``Packet.from_header`` (payload
length and, for CPU payloads, payload CRC). What the wire carries per message is therefore
``PREAMBLE_BYTES + sum(payload bytes)`` = ``sum(packet.nbytes)`` (the codec's wire formula) plus a protocol
overhead of ``PREAMBLE_BYTES - 64 n`` bytes; :attr:`Transport.stats` reports both. Packets carry a CRC-32
of their CPU payloads unless the transport was built with ``checksum=False`` (trusted links: the sender then
clears the packets' checksum flag and the receiver checks nothing but lengths and the preamble's own CRC).
Both ends of a link must agree: every preamble carries the sender's setting, and a receiver built with the
other one fails the link with a :class:`~aqsgd.errors.PeerFailure` naming the peer (not a silently unchecked
or wrongly checked stream).

Channels are separated by tags: gloo matches a send to a receive by (peer, tag), and every channel has its
own tag (``_TAG_BASE + channel``), so forward and backward traffic between the same two ranks never mix.
NCCL ignores tags; there the transport instead builds one sub-group per (channel, direction) at
construction (a collective: every rank must construct its Transport with the same ``channels``), so each
NCCL communicator carries one ordered stream of messages and concurrent sends and receives cannot deadlock.

GPUs
----
``backend="gloo"`` (the default path, also for a CUDA ``device``): the wire is TCP and GPU payloads are
staged through pinned host memory. ``isend`` queues non-blocking device-to-host copies on a side CUDA stream
(after the work already queued on the caller's stream) and records an event; the sender thread waits on that
event, then sends the host bytes, so the copy overlaps the stage's next computation and the bytes on the wire,
payload CRC included, are those of the CPU path. The receiver thread receives into pinned memory, checks the
CRC, copies the payloads to the device on a stream of its own and waits for that copy before it hands the
packets over; ``RecvHandle.wait`` marks them as used by the caller's stream (``record_stream``).
``backend="nccl"``: packets go GPU to GPU through the NCCL sub-groups (no payload CRC: the flag is clear for
device payloads). The CUDA paths are written against documented PyTorch APIs but have not run on a GPU in this
project's CI.

Threads
-------
``isend`` never blocks: one sender thread per (dst, channel) paces and sends messages in FIFO order. On a
*direct* link (no link emulation, gloo, host payloads) ``isend`` itself starts the message with a gloo
``isend`` (its bytes leave as soon as the peer's receive is posted) and the sender thread only waits for its
completion, accounts it and completes the handle.
``irecv`` enqueues a receive request: one receiver thread per (src, channel) serves requests in order, so
several irecvs posted on the same (src, channel) complete in order. A receiver thread only has a
receive outstanding while some request is pending, so an idle transport holds nothing in gloo.
Concurrent use of one gloo process group from several threads is safe for point-to-point operations:
``ProcessGroupGloo::send/recv`` post an unbound buffer on the calling thread and the TCP pair serializes
the writes (the tests run four threads per process on one pair). Over gloo the threads call the process
group's ``send``/``recv`` directly, as ``dist.isend``/``dist.recv`` do after their argument checks (which the
transport has made once, at construction and per link): those checks cost tens of microseconds of Python
per call, about a tenth of a small message's hand-over.

What remains of a message's latency is mostly Python on both sides and one thread hop on the receiver (the
receiver thread, then the caller). The hot paths therefore avoid torch and numpy calls (each costs a
microsecond warm and tens of microseconds when the caches are cold after idling, as a stage's are after
computing): the sender copies each contiguous host payload into the message (a buffer of the link's own,
reused once its send completed) with one ``memmove`` from the tensor's address and takes its CRC from there
(a numpy view of the payload costs 20-30 µs cold), and it packs each header's fixed fields once per layout
(:func:`~aqsgd.compress.packet.layout_key`; a pipeline sends the same codecs, shapes and lengths every
micro-batch), filling in the tag and CRCs per message. The receiver keeps the last message's parsed layout:
when the next message repeats it outside the per-message fields (one ``struct`` call compares them), its
headers need no parsing (the header CRCs and payload CRCs are still checked), the payload views were cut
from the receive buffer before the bytes arrived, and the message's buffer and views are let go only when
the next receive starts. Payload CRCs are ISA-L's (``isal``), zlib's values at about 13x the speed, and
handles complete through a bare lock rather than a ``threading.Event``. The hop itself stays: a caller
blocking in gloo's own wait could not time out without gloo closing the connection, and torch exposes no way
to abort a gloo receive.

Failures
--------
An exception on a background thread (the peer's connection closed, a malformed message) marks the link
failed: the handle being served and every later one on that link raise :class:`~aqsgd.errors.PeerFailure`
naming the peer in ``wait()``. A peer that is alive but silent makes ``wait()`` raise
:class:`~aqsgd.errors.PeerTimeout` after ``timeout_s`` (measured from the ``wait`` call). Gloo's own
timeouts are not used for this: a timed-out gloo operation poisons the whole gloo context. After a timeout
the request stays queued (it completes if the message comes later); callers normally give up and close.
``close()`` fails every queued request, wakes sleeping threads and joins them with a bounded wait; a thread
stuck in a gloo receive for a peer that never sends is left behind as a daemon (logged), never waited on.

Link emulation
--------------
With ``links`` given, each directed link to a destination has a :class:`~aqsgd.comm.link.Pacer` shared
by all channels to it. The sender thread reserves the line for the message's wire bytes (from the time
``isend`` handed the message over), sends at once, then sleeps until the message has left the emulated line;
the preamble carries the wall-clock arrival time (``time.time()``; comparable between processes on one
machine) and ``RecvHandle.wait``/``done`` deliver no earlier. The receiver *thread* does not sleep: a gloo
send only completes once the receiver has posted the matching receive (a rendezvous, even for 100 bytes), so a
sleeping receiver thread would stall the sender and serialize the latency of pipelined messages. The same
rendezvous means a send to a peer that has not posted its ``irecv`` yet waits on the sender thread (the
training thread is not blocked); the message's arrival time was fixed when it was scheduled, so the emulated
timing is that of a buffered network as long as receivers post early. Each message also costs one or two real
rendezvous (~1-4 ms on a loaded machine); since the schedule runs from hand-over times these costs do not
accumulate, but a link is only emulated faithfully while the real path is faster than the emulated one.
:meth:`Transport.set_link` changes a link's setting from its next message on (a schedule such as a link that
drops from 200 to 20 Mbit/s halfway; the trainer applies it at step boundaries).
"""

from __future__ import annotations

import _thread
import collections
import contextlib
import ctypes
import dataclasses
import logging
import queue
import struct
import math
import threading
import time
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, Iterator, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from aqsgd.comm.device import HostStager
from aqsgd.comm.link import LinkSpec, Pacer
from aqsgd.compress.packet import (
    HEADER_BYTES,
    Family,
    Header,
    Packet,
    crc32_of_buffer,
    fill_header,
    layout_key,
    layout_keys,
    message_fields,
    parse_header,
)
from aqsgd.errors import ConfigMismatchError, PacketError, PeerFailure, PeerTimeout, TransportError

__all__ = [
    "BACKWARD",
    "FORWARD",
    "MAX_CHANNEL",
    "MAX_PACKETS",
    "PREAMBLE_BYTES",
    "LinkStats",
    "RecvHandle",
    "SendHandle",
    "StatsKey",
    "Transport",
]

log = logging.getLogger(__name__)

FORWARD = 0
BACKWARD = 1
MAX_PACKETS = 8
MAX_CHANNEL = 255
_PREFIX = struct.Struct("<4sBBHQQdB27sI")
_PREFIX_BYTES = _PREFIX.size
_U32 = struct.Struct("<I")
PREAMBLE_BYTES = _PREFIX_BYTES + MAX_PACKETS * HEADER_BYTES
_MAGIC = b"AQTP"
_VERSION = 2
_FLAG_INLINE = 0x01  # the payload follows the preamble in the same gloo message
_FLAG_CHECKSUM = 0x02  # the sender's checksum setting: its CPU payloads carry a CRC-32
_FLAGS = _FLAG_INLINE | _FLAG_CHECKSUM
_INLINE_START = 64 * 1024  # payload bytes a receive can take in one message before any larger one came
_INLINE_MAX = 64 * 1024 * 1024  # beyond this, messages always travel as preamble + payload
_TAG_BASE = 0x7100
_POOL_MAX_BYTES = 16 * 1024 * 1024  # message buffers a sender link reuses: at most this large,
_POOL_DEPTH = 4  # this many per size,
_POOL_SIZES = 8  # of this many sizes
_LAYOUTS_KEPT = 64  # header layouts a sender link keeps packed
_DEFAULT_CHANNEL_NAMES = {FORWARD: "forward activations", BACKWARD: "backward gradients"}
_JOIN_TIMEOUT_S = 2.0
_FINISH_LOCK = threading.Lock()
_memmove = ctypes.memmove  # (dst address, src address, bytes); releases the GIL
assert _PREFIX_BYTES == 64


class StatsKey(NamedTuple):
    """Key of :attr:`Transport.stats`: the peer's rank, the channel and ``"send"`` or ``"recv"``."""

    peer: int
    channel: int
    direction: str


@dataclasses.dataclass
class LinkStats:
    """Traffic on one (peer, channel, direction).

    ``packet_bytes`` is the sum of ``packet.nbytes`` (headers + payloads), ``overhead_bytes`` the rest of
    the preambles; their sum is what crossed the wire. ``wait_s`` is the time the caller spent blocked in
    ``wait()`` on handles of this link. ``busy_s`` (sends): the time the link was carrying this process's
    messages, each from when it was handed over (or the previous one was done, if later) to its completion,
    so ``wire_bytes / busy_s`` is the throughput the link achieved while in use.
    """

    messages: int = 0
    packets: int = 0
    packet_bytes: int = 0
    overhead_bytes: int = 0
    wait_s: float = 0.0
    busy_s: float = 0.0

    @property
    def wire_bytes(self) -> int:
        return self.packet_bytes + self.overhead_bytes


def _build_preamble(n: int, channel: int, seq: int, total: int, arrival: float, headers: bytes,
                    flags: int = 0) -> bytes:
    region = headers.ljust(MAX_PACKETS * HEADER_BYTES, b"\0")
    head = _PREFIX.pack(_MAGIC, _VERSION, n, channel, seq, total, arrival, flags, b"", 0)[:60]
    return head + _U32.pack(zlib.crc32(region, zlib.crc32(head))) + region


def _parse_preamble(buf: bytes) -> tuple[int, int, int, int, float]:
    """(n, channel, seq, total, arrival) of a preamble; raises :class:`PacketError` when malformed."""
    if len(buf) != PREAMBLE_BYTES:
        raise PacketError(f"preamble of {len(buf)} bytes, expected {PREAMBLE_BYTES}")
    magic, version, n, channel, seq, total, arrival, flags, reserved, crc = _PREFIX.unpack(
        buf[:_PREFIX_BYTES])
    if magic != _MAGIC:
        raise PacketError(f"not an aqsgd transport message (magic {magic!r}, expected {_MAGIC!r})")
    if version != _VERSION:
        raise PacketError(f"unsupported transport protocol version {version} (this build speaks {_VERSION})")
    if zlib.crc32(buf[_PREFIX_BYTES:], zlib.crc32(buf[:60])) != crc:
        raise PacketError("corrupted message preamble (CRC mismatch)")
    if n > MAX_PACKETS or any(reserved) or flags & ~_FLAGS:
        raise PacketError(f"malformed message preamble ({n} packets, at most {MAX_PACKETS})")
    return n, channel, seq, total, arrival


def _next_capacity(capacity: int, need: int, nccl: bool) -> int:
    """The message size a receive can take in one piece after a message of ``need`` bytes went in two."""
    return capacity if nccl else max(capacity, min(need, PREAMBLE_BYTES + _INLINE_MAX))


class _Handle:
    """Completion of one queued operation; set exactly once by a background thread.

    The completion is a bare lock, held from construction until ``_finish`` releases it (a
    ``threading.Event`` costs a condition variable and a lock per waiter: several microseconds on each side
    of every message, a visible part of a small message's hand-over)."""

    _direction = ""

    def __init__(self, transport: Transport, peer: int, channel: int, stats_key: StatsKey) -> None:
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


@dataclasses.dataclass
class _SendItem:
    packets: tuple[Packet, ...]
    handle: SendHandle
    ready: object | None  # a CUDA event after the payloads (or their host copies) are complete, or None
    host: bool  # every payload of ``packets`` is a CPU tensor (pinned host copies included)
    enqueued: float  # time.monotonic() when isend was called: when the message was handed to the link
    staged_from: tuple[Packet, ...] = ()  # GPU packets whose host copies are in flight: kept alive until sent
    works: list[Any] | None = None  # started on the caller's thread (a direct link): the gloo sends in flight
    wire: list[torch.Tensor] = dataclasses.field(default_factory=list)  # their buffers, alive until sent
    error: BaseException | None = None  # starting them failed
    # the link's pooled message buffer it was built in
    buffer: tuple[torch.Tensor, memoryview, int] | None = None


class _Worker(threading.Thread):
    """Base of the per-link background threads: a FIFO of requests, a sticky failure."""

    def __init__(self, transport: Transport, peer: int, channel: int, role: str) -> None:
        super().__init__(name=f"aqsgd-{role}-rank{peer}-ch{channel}", daemon=True)
        self.transport = transport
        self.peer = peer
        self.channel = channel
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.failure: tuple[str, BaseException] | None = None
        self.stats_key = StatsKey(peer, channel, role)
        self.seq = 0
        # The size of the next receive on this link, the same on both sides: a message that fits travels as
        # one gloo message (preamble + payload), a larger one as two, and raises it (see the module
        # docstring).
        self.capacity = PREAMBLE_BYTES if transport._nccl else PREAMBLE_BYTES + _INLINE_START
        # gloo: the process group's own send/recv, called directly (torch.distributed's wrappers around them
        # cost tens of microseconds of Python per call, a large part of a small message's latency)
        self._pg = None
        if not transport._nccl:
            self._pg = transport.group if transport.group is not None else dist.group.WORLD
            self._pg_peer = dist.get_group_rank(self._pg, peer)
            self._tag = _TAG_BASE + channel

    def _error_for(self, message: str, cause: BaseException | None) -> PeerFailure:
        err = PeerFailure(message, rank=self.peer, label=self.transport.peer_labels.get(self.peer))
        err.__cause__ = cause
        return err

    def _fail_link(self, message: str, cause: BaseException) -> None:
        log.warning("%s", message)
        self.failure = (message, cause)

    def _reject(self, handle: _Handle) -> None:
        if self.transport._closing.is_set():
            handle._finish(error=TransportError("the transport was closed before this request was served"))
        else:
            assert self.failure is not None
            handle._finish(error=self._error_for(*self.failure))

    def _sleep_until_wall(self, deadline: float) -> None:
        remaining = deadline - time.time()
        if remaining > 0:
            self.transport._closing.wait(remaining)

    def _group_and_tag(self, direction: str) -> tuple[dist.ProcessGroup | None, int]:
        return self.transport._route(self.peer, self.channel, direction)

    def _isend(self, tensor: torch.Tensor) -> Any:
        """Start sending ``tensor`` to the peer on this link; returns the work to wait for."""
        if self._pg is not None:
            return self._pg.send([tensor], self._pg_peer, self._tag)
        group, tag = self._group_and_tag("send")
        return dist.isend(tensor, self.peer, group=group, tag=tag)

    def _recv_into(self, tensor: torch.Tensor) -> None:
        """Receive the peer's next message on this link into ``tensor`` (blocking; gloo takes a shorter
        message into a longer buffer)."""
        if self._pg is not None:
            self._pg.recv([tensor], self._pg_peer, self._tag).wait()
        else:
            group, tag = self._group_and_tag("recv")
            dist.recv(tensor, self.peer, group=group, tag=tag)

    def run(self) -> None:
        # A CUDA transport's threads work on its device and on a stream of their own, so that their copies
        # and NCCL calls wait for nothing that the training thread queued on its stream.
        device = self.transport.device
        if device.type != "cuda":
            self._serve()
            return
        torch.cuda.set_device(device)
        with torch.cuda.stream(torch.cuda.Stream(device)):
            self._serve()

    def _serve(self) -> None:
        raise NotImplementedError


class _Sender(_Worker):
    def __init__(self, transport: Transport, dst: int, channel: int, pacer: Pacer | None) -> None:
        super().__init__(transport, dst, channel, "send")
        self.pacer = pacer
        # A direct link (no pacing, gloo, host payloads) starts each send on the caller's thread with a gloo
        # isend, so the bytes leave without waiting for this thread; the thread only waits for completion.
        self.direct = pacer is None and not transport._nccl and transport._stager is None
        self._post_lock = threading.Lock()
        self._layouts: dict[tuple, tuple[Family, tuple[bytes, bytes, bytes]]] = {}
        self._free: dict[int, collections.deque] = {}  # message size -> free buffers (see _buffer)
        self._last_done = -math.inf  # when the link's previous message completed (see _busy)

    def post(self, item: _SendItem) -> None:
        """Start ``item`` on the calling thread (a direct link), then queue it for completion."""
        with self._post_lock:
            if self.failure is None and not self.transport._closing.is_set():
                try:
                    item.wire, _ = self._messages(item)
                    item.works = [self._isend(m) for m in item.wire]
                except KeyboardInterrupt:  # Ctrl-C or SIGTERM (aqsgd.interrupts) on the caller's thread:
                    raise  # the process is stopping; it is no failure of the link to blame on the peer
                except BaseException as e:  # noqa: BLE001 - surfaces in the caller's wait()
                    item.error = e
            self.requests.put(item)

    def _serve(self) -> None:
        while True:
            item: _SendItem | None = self.requests.get()
            if item is None:
                return
            if self.failure is not None or self.transport._closing.is_set():
                self._reject(item.handle)
                continue
            try:
                if item.error is not None:
                    raise item.error
                if item.works is None:
                    self._send(item)
                else:
                    for w in item.works:
                        w.wait()
                    item.wire = []
                    self._give_back(item)
                    self.transport._account(self.stats_key, item.packets, self._busy(item))
            except BaseException as e:  # noqa: BLE001 - surfaces in the caller's wait()
                t = self.transport
                if t._closing.is_set():
                    item.handle._finish(error=TransportError("the transport was closed during a send"))
                    continue
                self._fail_link(
                    f"sending {t.channel_name(self.channel)} to {t.describe_peer(self.peer)} failed "
                    f"(the peer is unreachable or crashed): {_first_line(e)}",
                    e,
                )
                self._reject(item.handle)
            else:
                item.handle._finish()

    def _send(self, item: _SendItem) -> None:
        messages, departure = self._messages(item)
        for m in messages:
            self._isend(m).wait()
        self._give_back(item)
        if departure is not None:
            self._sleep_until_wall(departure)
        self.transport._account(self.stats_key, item.packets, self._busy(item))

    def _busy(self, item: _SendItem) -> float:
        """Seconds the link carried ``item``: from its hand-over (or the previous message's end, if later) to
        now, its completion (this sender thread completes its link's messages in order)."""
        now = time.monotonic()
        start = max(item.enqueued, self._last_done)
        self._last_done = now
        return max(0.0, now - start)

    def _buffer(self, size: int) -> tuple[torch.Tensor, memoryview, int]:
        """A host message buffer of ``size`` bytes, its memoryview and its address: a free one of this link's
        pool, else new.

        Pipelines send messages of the same few sizes over and over; a buffer whose send completed is
        reused (:meth:`_give_back`) instead of allocating (and, for large messages, page-faulting) a new one.
        """
        free = self._free.get(size)
        if free:
            try:
                return free.pop()
            except IndexError:  # the sender thread took the last one meanwhile
                pass
        t = torch.empty(size, dtype=torch.uint8)
        return t, memoryview(t.numpy()), t.data_ptr()

    def _give_back(self, item: _SendItem) -> None:
        """Return ``item``'s pooled buffer once its send completed (gloo no longer reads it)."""
        buffer, item.buffer = item.buffer, None
        if buffer is None or len(buffer[1]) > _POOL_MAX_BYTES:
            return
        free = self._free.get(len(buffer[1]))
        if free is None:
            if len(self._free) >= _POOL_SIZES:  # ever-changing sizes: start over
                self._free.clear()
            free = self._free[len(buffer[1])] = collections.deque()
        if len(free) < _POOL_DEPTH:
            free.append(buffer)

    def _layout_key(self, p: Packet, size: int) -> tuple[bytes, bytes, bytes]:
        """The :func:`~aqsgd.compress.packet.layout_key` of ``p``'s header, packed once per layout on this
        link (a pipeline sends the same layout every micro-batch)."""
        key = (p.fingerprint, p.shape, p.dtype, p.kind, size)
        known = self._layouts.get(key)
        if known is None or known[0] is not p.family:
            if len(self._layouts) >= _LAYOUTS_KEPT:  # ever-changing shapes: start over
                self._layouts.clear()
            known = self._layouts[key] = (p.family,
                                          layout_key(p.header_bytes(checksum=self.transport.checksum,
                                                                    payload_crc=0)))
        return known[1]

    def _messages(self, item: _SendItem) -> tuple[list[torch.Tensor], float | None]:
        """The gloo/NCCL messages of ``item`` in order (one or two, see the module docstring) and, on an
        emulated link, the wall-clock time the message has left the line; advances the link's state."""
        t = self.transport
        wire = t._wire_device
        if item.ready is not None:
            item.ready.synchronize()  # type: ignore[attr-defined]
        packets = item.packets
        # host payloads, complete, to a host message
        host = item.host and item.ready is None and wire.type == "cpu"
        sizes, total = [], 0
        for p in packets:  # a loop, not a comprehension and sum(): fewer frames on the latency path
            size = p.payload.nbytes  # 1-D uint8: bytes = elements
            sizes.append(size)
            total += size
        arrival = 0.0
        departure = None
        if self.pacer is not None:
            # Scheduled from the hand-over time, not from when this thread got to it: real per-message
            # costs (gloo rendezvous) then do not accumulate into the emulated schedule.
            slot = self.pacer.schedule(PREAMBLE_BYTES + total, now=item.enqueued)
            now_mono, now_wall = time.monotonic(), time.time()
            departure = now_wall + (slot.depart - now_mono)
            arrival = now_wall + (slot.arrive - now_mono)
        need = PREAMBLE_BYTES + total
        inline = need <= self.capacity
        flags = (_FLAG_INLINE if inline else 0) | (_FLAG_CHECKSUM if t.checksum else 0)
        if inline and host:
            # host payloads into the link's host message buffer, then their CRCs from there: per payload a few
            # attribute reads and one memmove instead of a numpy view (each torch or numpy call costs
            # microseconds warm, tens of them with the caches cold after idling, as a stage's are)
            item.buffer = msg, view, address = self._buffer(need)
            checksum = t.checksum
            offset = PREAMBLE_BYTES
            crcs = []
            for p, size in zip(packets, sizes):
                if size:
                    payload = p.payload
                    # in host memory (item.host), so its address is a host address
                    if payload.is_contiguous():
                        _memmove(address + offset, payload.data_ptr(), size)
                    else:
                        view[offset:offset + size] = payload.numpy().data
                crcs.append(crc32_of_buffer(view[offset:offset + size]) if checksum else 0)
                offset += size
            headers = b"".join(fill_header(self._layout_key(p, size), p.tag, crc)
                               for p, size, crc in zip(packets, sizes, crcs))
            view[:PREAMBLE_BYTES] = _build_preamble(len(packets), self.channel, self.seq, total, arrival,
                                                    headers, flags)
            self.seq += 1
            return [msg], departure
        if host:
            checksum = t.checksum
            hosts = [p.payload.numpy() for p in packets]
            headers = b"".join(fill_header(self._layout_key(p, a.size), p.tag,
                                           crc32_of_buffer(a) if checksum else 0)
                               for p, a in zip(packets, hosts))
        else:
            checksum = None if t.checksum else False  # None: a payload CRC for host bytes
            headers = b"".join(p.header_bytes(checksum=checksum) for p in packets)
        preamble = _build_preamble(len(packets), self.channel, self.seq, total, arrival, headers, flags)
        pre = torch.frombuffer(bytearray(preamble), dtype=torch.uint8)
        if inline:
            if total:
                msg = torch.empty(need, dtype=torch.uint8, device=wire)
                msg[:PREAMBLE_BYTES].copy_(pre)
                offset = PREAMBLE_BYTES
                for p in packets:
                    msg[offset:offset + p.payload.numel()].copy_(p.payload)
                    offset += p.payload.numel()
            else:
                msg = pre.to(wire)
            messages = [msg]
        else:
            if len(packets) == 1:
                payload = packets[0].payload.to(wire)
            else:
                payload = torch.cat([p.payload.to(wire) for p in packets if p.payload.numel()])
            messages = [pre.to(wire), payload.contiguous()]
            self.capacity = _next_capacity(self.capacity, need, t._nccl)
        self.seq += 1
        return messages, departure


class _Layout:
    """The header layout of the last message on a receive link, kept for the next one.

    A pipeline sends the same layout every micro-batch (the same codecs, shapes and payload lengths); what
    changes is each packet's tag (the micro-batch's sample ids), payload CRC and header CRC. When the next
    message's headers equal this layout outside those fields, they need no parsing (their fields were
    checked when the layout was parsed, their CRCs are checked again), and the payload views of an inline
    message were cut from its receive buffer before the bytes arrived: the latency of a small message is
    mostly Python on both sides, several times slower when the caches are cold after idling."""

    __slots__ = ("key", "headers", "total", "spans")

    def __init__(self, key: tuple[bytes, ...], headers: list[Header]) -> None:
        self.key = key
        self.headers = headers
        self.total = sum(h.payload_len for h in headers)
        spans, offset = [], PREAMBLE_BYTES
        for h in headers:
            spans.append((offset, offset + h.payload_len))
            offset += h.payload_len
        self.spans = spans

    def cut(self, buffer: torch.Tensor, host: np.ndarray | None,
            start: int = PREAMBLE_BYTES) -> list[tuple[torch.Tensor, np.ndarray | None]]:
        """This layout's payload views of ``buffer`` (and of its numpy view ``host``), whose payloads begin at
        ``start``: the receive buffer of an inline message, or the payload buffer of a split one (0)."""
        shift = start - PREAMBLE_BYTES
        return [(buffer[a + shift:b + shift], None if host is None else host[a + shift:b + shift])
                for a, b in self.spans]


class _Receiver(_Worker):
    def __init__(self, transport: Transport, src: int, channel: int) -> None:
        super().__init__(transport, src, channel, "recv")
        wire = transport._wire_device
        self._host_wire = wire.type == "cpu"
        self._staged = self._host_wire and transport.device.type == "cuda"  # gloo to a GPU: pinned memory
        self._moved = wire != transport.device
        self._layout: _Layout | None = None
        self._spent: tuple | None = None  # the last message's receive buffer and views (see _recv)

    def _serve(self) -> None:
        while True:
            handle: RecvHandle | None = self.requests.get()
            if handle is None:
                return
            if self.failure is not None or self.transport._closing.is_set():
                self._reject(handle)
                continue
            t = self.transport
            try:
                packets, arrival = self._recv()
            except ConfigMismatchError as e:
                self._fail_link(str(e), e)
                self._reject(handle)
                continue
            except PacketError as e:
                self._fail_link(f"{t.describe_peer(self.peer)} sent a malformed message on "
                                f"{t.channel_name(self.channel)}: {e}", e)
                self._reject(handle)
                continue
            except BaseException as e:  # noqa: BLE001 - surfaces in the caller's wait()
                if t._closing.is_set():
                    handle._finish(error=TransportError("the transport was closed during a receive"))
                    continue
                self._fail_link(
                    f"lost {t.describe_peer(self.peer)} while receiving {t.channel_name(self.channel)} (the "
                    f"peer crashed or closed its connection): {_first_line(e)}",
                    e,
                )
                self._reject(handle)
                continue
            handle._finish(packets, deliver_at=arrival)

    def _recv(self) -> tuple[list[Packet], float]:
        t = self.transport
        self._spent = None  # freed now, not between the last message's arrival and its hand-off
        wire = t._wire_device
        staged = self._staged
        first = torch.empty(self.capacity, dtype=torch.uint8, device=wire, pin_memory=staged)
        host = first.numpy() if self._host_wire else None
        head = memoryview(host)[:PREAMBLE_BYTES] if host is not None else None  # read without a numpy call
        layout = self._layout
        # the payload views of the last message's layout, cut before the bytes arrive (off the latency path)
        cut = (layout.cut(first, host)
               if layout is not None and PREAMBLE_BYTES + layout.total <= self.capacity else None)
        self._recv_into(first)
        buf = head.tobytes() if head is not None else first[:PREAMBLE_BYTES].cpu().numpy().tobytes()
        n, channel, seq, total, arrival = _parse_preamble(buf)
        flags = buf[32]
        need = PREAMBLE_BYTES + total
        inline = need <= self.capacity
        if inline != bool(flags & _FLAG_INLINE):
            raise PacketError(f"message number {seq} of {need} bytes was split differently than this "
                              f"receiver expected (receive size {self.capacity}): the two sides are out "
                              "of step")
        if channel != self.channel:
            raise PacketError(f"message for channel {channel} arrived on channel {self.channel}")
        if seq != self.seq:
            raise PacketError(f"message number {seq} arrived where number {self.seq} was due (out of step)")
        region = buf[_PREFIX_BYTES:_PREFIX_BYTES + n * HEADER_BYTES]
        key = layout_keys(region, n)  # the headers without their per-message fields (tag and CRCs)
        if layout is None or key != layout.key:
            # parse_header checks every field; the layout keeps them for the messages that repeat it
            headers = [parse_header(region[o:o + HEADER_BYTES])
                       for o in range(0, n * HEADER_BYTES, HEADER_BYTES)]
            layout = self._layout = _Layout(key, headers)
            cut = None
        if layout.total != total:
            raise PacketError(f"preamble announces {total} payload bytes, its headers {layout.total}")
        if inline:
            if cut is None:
                cut = layout.cut(first, host)  # the packets' payloads are slices of the one buffer
        else:
            payload = torch.empty(total, dtype=torch.uint8, device=wire, pin_memory=staged)
            self._recv_into(payload)
            cut = layout.cut(payload, payload.numpy() if host is not None else None, start=0)
            self.capacity = _next_capacity(self.capacity, need, t._nccl)
        if not self._host_wire:
            torch.cuda.current_stream(wire).synchronize()
        self.seq += 1
        if bool(flags & _FLAG_CHECKSUM) != t.checksum:  # checked once all of the message is in
            raise ConfigMismatchError(
                f"{t.describe_peer(self.peer)} sends {t.channel_name(self.channel)} "
                f"{'without' if t.checksum else 'with'} payload checksums, this process's transport has "
                f"checksum={t.checksum}: both ends of a link need the same setting (aqsgd train: "
                f"--checksum/--no-checksum on every stage)")
        packets = []
        verify = t.checksum
        for i, h in enumerate(layout.headers):
            o = i * HEADER_BYTES
            tag, payload_crc, header_crc = message_fields(region, o)
            if zlib.crc32(region[o:o + 60]) != header_crc:
                raise PacketError("corrupted packet header (CRC mismatch)")
            body, body_host = cut[i]
            # CPU payloads: their CRC on the host view (no torch call); device payloads carry none
            if verify and body_host is not None and h.payload_crc is not None \
                    and crc32_of_buffer(body_host) != payload_crc:
                raise PacketError("corrupted packet payload (CRC mismatch)")
            packet = Packet._from_parsed(h, body, tag)
            if self._moved:
                # one copy per packet keeps every payload aligned; non-blocking from pinned memory, on this
                # thread's stream, waited for below
                packet = dataclasses.replace(packet, payload=packet.payload.to(t.device, non_blocking=staged))
            packets.append(packet)
        if staged and total:
            torch.cuda.current_stream(t.device).synchronize()
        t._count(self.stats_key, n, total)
        self._spent = first, host, head, cut  # not freed on return: the caller is waiting for these packets
        return packets, arrival


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


class Transport:
    """Sends and receives lists of packets to and from other ranks of a process group.

    ``group``: an initialized process group (default: the world). Ranks in this API are global ranks, as in
    ``dist.send``. ``timeout_s``: default timeout of ``wait()``. ``links``: link emulation, one
    :class:`LinkSpec` for every outgoing link or a ``{dst: LinkSpec}`` dict (links not in it are
    unlimited). ``peer_labels``: names for error messages (``{2: "stage 2"}``). ``channel_names``: names of
    channels for error messages (default: 0 = "forward activations", 1 = "backward gradients").
    ``device``: where received packets are placed. ``backend``: ``"gloo"`` (TCP; GPU payloads are staged
    through pinned host memory, see the module docstring) or ``"nccl"`` (GPU to GPU; needs a CUDA ``device``);
    None: NCCL when ``device`` is CUDA and the group's backend includes NCCL, else gloo. A gloo transport on a
    group without gloo builds a gloo group of the same ranks (collectively). ``channels``: the channels used
    (only needed for NCCL, which builds sub-groups for them at construction, collectively). ``checksum``:
    send a CRC-32 of every CPU payload and check it on receipt (default); False skips both (trusted links).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        timeout_s: float = 60.0,
        links: Mapping[int, LinkSpec] | LinkSpec | None = None,
        peer_labels: Mapping[int, str] | None = None,
        channel_names: Mapping[int, str] | None = None,
        device: str | torch.device = "cpu",
        channels: Sequence[int] = (FORWARD, BACKWARD),
        backend: str | None = None,
        checksum: bool = True,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise TransportError("torch.distributed is not initialized: call dist.init_process_group first")
        if not timeout_s > 0:
            raise TransportError(f"timeout_s must be positive, got {timeout_s}")
        self.group = group
        self.checksum = bool(checksum)
        self.timeout_s = float(timeout_s)
        self.rank = dist.get_rank()
        self.ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
        self.peer_labels: dict[int, str] = dict(peer_labels or {})
        self.channel_names: dict[int, str] = {**_DEFAULT_CHANNEL_NAMES, **dict(channel_names or {})}
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._cuda = self.device.type == "cuda"
        group_backend = str(dist.get_backend(group)).lower()
        if backend is None:
            self._nccl = self.device.type == "cuda" and "nccl" in group_backend
        elif backend not in ("gloo", "nccl"):
            raise TransportError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        elif backend == "nccl" and self.device.type != "cuda":
            raise TransportError(f"the nccl backend moves GPU tensors: it needs a CUDA device, not "
                                 f"{self.device}")
        else:
            self._nccl = backend == "nccl"
        if not self._nccl and "gloo" not in group_backend:
            self.group = dist.new_group(list(self.ranks), backend="gloo")
        self._wire_device = self.device if self._nccl else torch.device("cpu")
        # gloo from a GPU: device-to-host copies of outgoing payloads on a side stream (see isend)
        self._stager = HostStager(self.device) if self.device.type == "cuda" and not self._nccl else None
        self._links = links
        self._pacers: dict[int, Pacer | None] = {}
        self._senders: dict[tuple[int, int], _Sender] = {}
        self._receivers: dict[tuple[int, int], _Receiver] = {}
        self._stats: dict[StatsKey, LinkStats] = {}
        self._lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._closing = threading.Event()
        self._subgroups: dict[tuple[int, bool], dist.ProcessGroup] = {}
        if self._nccl:
            # NCCL has no tags: one sub-group per (channel, direction of rank order); see the module docs.
            for ch in channels:
                self._check_channel(ch)
                for upward in (True, False):
                    self._subgroups[(ch, upward)] = dist.new_group(list(self.ranks), backend="nccl")

    # ---------------------------------------------------------------- naming
    def describe_peer(self, rank: int) -> str:
        """``"stage 2 (rank 2)"`` when a label is known, else ``"rank 2"``."""
        label = self.peer_labels.get(rank)
        return f"{label} (rank {rank})" if label else f"rank {rank}"

    def channel_name(self, channel: int) -> str:
        return self.channel_names.get(channel, f"channel {channel}")

    # ---------------------------------------------------------------- API
    def isend(self, packets: Sequence[Packet], dst: int, channel: int) -> SendHandle:
        """Queue a message of 0..8 packets for ``dst`` on ``channel`` and return at once."""
        packets = tuple(packets)
        if len(packets) > MAX_PACKETS:
            raise TransportError(f"a message carries at most {MAX_PACKETS} packets, got {len(packets)}")
        for p in packets:  # a loop, not all(...): no generator per message on the latency path
            if not isinstance(p, Packet):
                raise TransportError("isend takes a sequence of Packet")
        # a link's worker exists only once its peer and channel were checked (close() forgets them all)
        worker = self._senders.get((dst, channel)) or self._sender(dst, channel)
        packets, staged_from, ready, host = self._stage(packets)
        handle = SendHandle(self, dst, channel, worker.stats_key)
        item = _SendItem(packets, handle, ready, host, time.monotonic(), staged_from)
        if worker.direct:
            worker.post(item)
        else:
            worker.requests.put(item)
        return handle

    def _stage(self, packets: tuple[Packet, ...]) -> tuple[tuple[Packet, ...], tuple[Packet, ...], Any, bool]:
        """``(packets to send, GPU packets to keep alive until then, event to wait on before sending, whether
        every payload to send is in host memory)``.

        CPU payloads: the packets themselves, nothing to keep, no event. GPU payloads over gloo: pinned host
        copies, queued non-blocking on the side stream, and the event after them. GPU payloads over NCCL (or a
        CPU transport given GPU payloads): the packets and an event on the caller's stream, after which their
        bytes are complete."""
        host, cuda = True, False
        for p in packets:
            if not p.payload.is_cpu:
                host = False
                cuda = cuda or p.payload.is_cuda
        if not cuda:
            return packets, (), None, host
        if self._stager is not None:
            hosts, ready = self._stager.to_host([p.payload for p in packets])
            return (tuple(dataclasses.replace(p, payload=h) for p, h in zip(packets, hosts)),
                    packets, ready, True)
        device = next(p.payload.device for p in packets if p.payload.is_cuda)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))
        return packets, (), ready, False

    def irecv(self, src: int, channel: int) -> RecvHandle:
        """Post a receive of the next message from ``src`` on ``channel`` and return at once."""
        worker = self._receivers.get((src, channel)) or self._receiver(src, channel)
        handle = RecvHandle(self, src, channel, worker.stats_key)
        worker.requests.put(handle)
        return handle

    def send(self, packets: Sequence[Packet], dst: int, channel: int, timeout: float | None = None) -> None:
        """``isend(...).wait(timeout)``."""
        self.isend(packets, dst, channel).wait(timeout)

    def recv(self, src: int, channel: int, timeout: float | None = None) -> list[Packet]:
        """``irecv(...).wait(timeout)``."""
        return self.irecv(src, channel).wait(timeout)

    @property
    def stats(self) -> dict[StatsKey, LinkStats]:
        """A snapshot of the traffic counters per (peer, channel, direction)."""
        with self._stats_lock:
            return {k: dataclasses.replace(v) for k, v in self._stats.items()}

    def total_stats(self, direction: str | None = None) -> LinkStats:
        """The counters summed over every link (of one direction, ``"send"`` or ``"recv"``, if given)."""
        total = LinkStats()
        for key, s in self.stats.items():
            if direction is None or key.direction == direction:
                total.messages += s.messages
                total.packets += s.packets
                total.packet_bytes += s.packet_bytes
                total.overhead_bytes += s.overhead_bytes
                total.wait_s += s.wait_s
                total.busy_s += s.busy_s
        return total

    def reset_stats(self) -> None:
        with self._stats_lock:
            self._stats.clear()

    def failed_peers(self) -> list[str]:
        """Labels (or ranks) of the peers whose links have failed so far, for error messages elsewhere."""
        with self._lock:
            workers = [*self._senders.values(), *self._receivers.values()]
        names = []
        for w in workers:
            if w.failure is not None:
                name = self.peer_labels.get(w.peer) or f"rank {w.peer}"
                if name not in names:
                    names.append(name)
        return names

    def close(self, *, failed: bool = False) -> None:
        """Fail queued requests, stop the threads (bounded wait) and forget them. Idempotent. ``failed``: the
        job is ending on an error or an interruption, when a thread still blocked in a peer exchange is
        expected (it is then noted at DEBUG level instead of a warning)."""
        self._closing.set()
        with self._lock:
            workers: list[_Worker] = [*self._senders.values(), *self._receivers.values()]
            self._senders.clear()
            self._receivers.clear()
        for w in workers:
            while True:  # fail what is still queued, then stop
                try:
                    item = w.requests.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    (item.handle if isinstance(item, _SendItem) else item)._finish(
                        error=TransportError("the transport was closed before this request was served")
                    )
            w.requests.put(None)
        deadline = time.monotonic() + _JOIN_TIMEOUT_S
        for w in workers:
            w.join(max(0.0, deadline - time.monotonic()))
            if w.is_alive():
                log.log(logging.DEBUG if failed else logging.WARNING,
                        "%s is still blocked in torch.distributed after close(); leaving it (daemon)", w.name)

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- internals
    def _check_channel(self, channel: int) -> None:
        if not (isinstance(channel, int) and 0 <= channel <= MAX_CHANNEL):
            raise TransportError(f"channel must be an int in 0..{MAX_CHANNEL}, got {channel!r}")

    def _check_peer(self, peer: int) -> None:
        if peer == self.rank:
            raise TransportError(f"rank {peer} is this process: a transport only talks to other ranks")
        if peer not in self.ranks:
            raise TransportError(f"rank {peer} is not in the process group (ranks {list(self.ranks)})")

    def _usable(self, peer: int, channel: int) -> None:
        if self._closing.is_set():
            raise TransportError("the transport is closed")
        self._check_peer(peer)
        self._check_channel(channel)
        if self._nccl and (channel, True) not in self._subgroups:
            raise TransportError(
                f"channel {channel} was not declared in channels=... (NCCL needs its sub-groups up front)"
            )

    def set_link(self, dst: int, spec: LinkSpec) -> None:
        """Emulate ``spec`` on the link to ``dst`` from its next message on (a link schedule's change, at a step
        boundary). Called before the link's first message it gives the link a pacer even where ``spec`` is
        unlimited, so that a later call can slow it down; a link that has started without emulation cannot be
        paced later (a :class:`TransportError`)."""
        self._check_peer(dst)
        with self._lock:
            pacer = self._pacers.get(dst)
            if pacer is not None:
                pacer.retune(spec)
            elif any(d == dst for d, _ in self._senders):
                raise TransportError(f"the link to {self.describe_peer(dst)} started without emulation; "
                                     "set_link before its first message to change it later")
            else:
                self._pacers[dst] = Pacer(spec)

    def _pacer(self, dst: int) -> Pacer | None:
        if dst not in self._pacers:
            spec = self._links.get(dst) if isinstance(self._links, Mapping) else self._links
            self._pacers[dst] = None if spec is None or spec.unlimited else Pacer(spec)
        return self._pacers[dst]

    def _sender(self, dst: int, channel: int) -> _Sender:
        self._usable(dst, channel)
        with self._lock:
            worker = self._senders.get((dst, channel))
            if worker is None:
                worker = self._senders[(dst, channel)] = _Sender(self, dst, channel, self._pacer(dst))
                worker.start()
            return worker

    def _receiver(self, src: int, channel: int) -> _Receiver:
        self._usable(src, channel)
        with self._lock:
            worker = self._receivers.get((src, channel))
            if worker is None:
                worker = self._receivers[(src, channel)] = _Receiver(self, src, channel)
                worker.start()
            return worker

    def _route(self, peer: int, channel: int, direction: str) -> tuple[dist.ProcessGroup | None, int]:
        if not self._nccl:
            return self.group, _TAG_BASE + channel
        sender, receiver = (self.rank, peer) if direction == "send" else (peer, self.rank)
        return self._subgroups[(channel, sender < receiver)], 0

    def _account(self, key: StatsKey, packets: Sequence[Packet], busy_s: float = 0.0) -> None:
        self._count(key, len(packets), sum(p.payload.numel() for p in packets), busy_s)

    def _count(self, key: StatsKey, packets: int, payload_bytes: int, busy_s: float = 0.0) -> None:
        with self._stats_lock:
            s = self._stats.get(key)
            if s is None:
                s = self._stats[key] = LinkStats()
            s.busy_s += busy_s
            s.messages += 1
            s.packets += packets
            s.packet_bytes += payload_bytes + HEADER_BYTES * packets
            s.overhead_bytes += PREAMBLE_BYTES - HEADER_BYTES * packets

    def _add_wait(self, key: StatsKey, seconds: float) -> None:
        with self._stats_lock:
            s = self._stats.get(key)
            if s is None:
                s = self._stats[key] = LinkStats()
            s.wait_s += seconds


_COMM_ERROR_HINTS = ("connection closed", "connection reset", "broken pipe", "gloo", "timed out", "peer")


@contextlib.contextmanager
def naming_peer_failures(transport: Transport | None, what: str,
                         suspects: Sequence[str] = ()) -> Iterator[None]:
    """Turn a collective's communication error (gloo raises a bare RuntimeError naming an address) into a
    :class:`PeerFailure` naming the failed stages: those this process's transport has seen fail, else the
    ``suspects`` (the other members of the collective; exact when there is only one)."""
    try:
        yield
    except PeerFailure:
        raise
    except RuntimeError as e:
        if not any(h in str(e).lower() for h in _COMM_ERROR_HINTS):
            raise
        names = transport.failed_peers() if transport is not None else []
        if names:
            who = " and ".join(names)
        elif len(suspects) == 1:
            who = suspects[0]
        elif suspects:
            who = "one of " + ", ".join(suspects)
        else:
            who = "a peer process"
        raise PeerFailure(f"lost {who} during {what}: {type(e).__name__}: {str(e).splitlines()[0]}") from e
