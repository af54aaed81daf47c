"""The transport's per-link background threads, and the sender's pooled message buffers.

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

A link's thread that meets an exception (the peer's connection closed, a malformed message) marks the link
failed; the request being served and every later one fail with a :class:`~aqsgd.errors.PeerFailure`
naming the peer (see :mod:`aqsgd.comm.handles`). The wire format the threads write and check is
:mod:`aqsgd.comm.wire`'s; the :class:`~aqsgd.comm.transport.Transport` owns the threads, which know it as a
:class:`~aqsgd.comm.core.TransportCore`.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import logging
import math
import queue
import threading
import time
import zlib
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from aqsgd.comm.handles import RecvHandle, SendHandle, _Handle
from aqsgd.comm.link import Pacer
from aqsgd.comm.stats import BACKLOG_FACTOR, BACKLOG_SLACK_S, StatsKey
from aqsgd.comm.wire import (_FLAG_CHECKSUM, _FLAG_INLINE, _FLAG_REFUSED, _INLINE_START, _PREFIX_BYTES,
                             _TAG_BASE, PREAMBLE_BYTES, REFUSAL_MAX_BYTES, _build_preamble, _Layout,
                             _next_capacity, _parse_preamble, _preamble_gap)
from aqsgd.compress.packet import (HEADER_BYTES, Family, Packet, crc32_of_buffer, fill_header, layout_key,
                                   layout_keys, message_fields, parse_header)
from aqsgd.errors import ConfigMismatchError, NonFiniteError, PacketError, PeerFailure, TransportError

if TYPE_CHECKING:
    from aqsgd.comm.core import TransportCore

log = logging.getLogger("aqsgd.comm.transport")  # the transport's logger, for the threads' warnings too

_POOL_MAX_BYTES = 16 * 1024 * 1024  # message buffers a sender link reuses: at most this large,
_POOL_DEPTH = 4  # this many per size,
_POOL_SIZES = 8  # of this many sizes
_LAYOUTS_KEPT = 64  # header layouts a sender link keeps packed
_memmove = ctypes.memmove  # (dst address, src address, bytes); releases the GIL


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
    refused: NonFiniteError | None = None  # a packet's deferred check failed: a refusal went instead


class _Worker(threading.Thread):
    """Base of the per-link background threads: a FIFO of requests, a sticky failure."""

    def __init__(self, transport: TransportCore, peer: int, channel: int, role: str) -> None:
        super().__init__(name=f"aqsgd-{role}-rank{peer}-ch{channel}", daemon=True)
        self.transport = transport
        self.peer = peer
        self.channel = channel
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.failure: tuple[str, BaseException] | None = None
        self.stats_key = StatsKey(peer, channel, role)
        self.seq = 0
        # The size of the next receive on this link, the same on both sides: a message that fits travels as
        # one gloo message (preamble + payload), a larger one as two, and raises it (see
        # :mod:`aqsgd.comm.wire`).
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
    def __init__(self, transport: TransportCore, dst: int, channel: int, pacer: Pacer | None) -> None:
        super().__init__(transport, dst, channel, "send")
        self.pacer = pacer
        # A direct link (no pacing, gloo, host payloads) starts each send on the caller's thread with a gloo
        # isend, so the bytes leave without waiting for this thread; the thread only waits for completion.
        self.direct = pacer is None and not transport._nccl and transport._stager is None
        self._post_lock = threading.Lock()
        self._layouts: dict[tuple, tuple[Family, tuple[bytes, bytes, bytes]]] = {}
        self._free: dict[int, collections.deque] = {}  # message size -> free buffers (see _buffer)
        self._last_done = -math.inf  # when the link's previous message completed (see _busy)
        self._last_enqueued: float | None = None  # when the previous message was handed over (the gap)

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
                    self.transport._account(self.stats_key, () if item.refused else item.packets,
                                            self._busy(item))
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
                item.handle._finish(error=item.refused)  # a refusal is the codec's error, not the link's

    def _send(self, item: _SendItem) -> None:
        messages, departure = self._messages(item)
        for m in messages:
            self._isend(m).wait()
        self._give_back(item)
        if departure is not None:
            self._sleep_until_wall(departure)
        self.transport._account(self.stats_key, () if item.refused else item.packets, self._busy(item))

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
        """The gloo/NCCL messages of ``item`` in order (one or two, see :mod:`aqsgd.comm.wire`) and, on an
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
        gap = 0.0 if self._last_enqueued is None else max(item.enqueued - self._last_enqueued, 0.0)
        self._last_enqueued = item.enqueued
        for p in packets:  # deferred checks: read here, where the payloads are complete (see DeferredCheck)
            if p.check is not None:
                refused = p.refusal()
                if refused is not None:
                    item.refused = NonFiniteError(refused)
                    return self._refusal(refused, gap), None
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
                                                    headers, flags, gap)
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
        preamble = _build_preamble(len(packets), self.channel, self.seq, total, arrival, headers, flags, gap)
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

    def _refusal(self, text: str, gap: float) -> list[torch.Tensor]:
        """The messages of a refusal (see :mod:`aqsgd.comm.wire`): no packets, the error's text as payload,
        sized and numbered as any message."""
        t = self.transport
        body = text.encode("utf-8", "replace")[:REFUSAL_MAX_BYTES]
        need = PREAMBLE_BYTES + len(body)
        inline = need <= self.capacity
        flags = (_FLAG_INLINE if inline else 0) | (_FLAG_CHECKSUM if t.checksum else 0) | _FLAG_REFUSED
        preamble = _build_preamble(0, self.channel, self.seq, len(body), 0.0, b"", flags, gap)
        self.seq += 1
        wire = t._wire_device
        if inline:
            return [torch.frombuffer(bytearray(preamble + body), dtype=torch.uint8).to(wire)]
        self.capacity = _next_capacity(self.capacity, need, t._nccl)
        return [torch.frombuffer(bytearray(preamble), dtype=torch.uint8).to(wire),
                torch.frombuffer(bytearray(body), dtype=torch.uint8).to(wire)]


class _Refusal(Exception):
    """A refusal arrived (see :mod:`aqsgd.comm.wire`): the text of the sender's error."""


class _Receiver(_Worker):
    def __init__(self, transport: TransportCore, src: int, channel: int) -> None:
        super().__init__(transport, src, channel, "recv")
        wire = transport._wire_device
        self._host_wire = wire.type == "cpu"
        self._staged = self._host_wire and transport.device.type == "cuda"  # gloo to a GPU: pinned memory
        self._moved = wire != transport.device
        self._layout: _Layout | None = None
        self._spent: tuple | None = None  # the last message's receive buffer and views (see _recv)
        self._last_arrival: float | None = None  # wall-clock arrival of the previous message (_held_back)
        self._delay = 0.0  # this link's one-way delay relative to an earlier message's (_held_back)
        self._delays: collections.deque[float] = collections.deque(maxlen=_DELAYS_KEPT)

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
            except _Refusal as e:  # the sender's codec refused the tensor: this request fails, the link not
                err = NonFiniteError(f"{t.describe_peer(self.peer)} sent no {t.channel_name(self.channel)}, "
                                     f"its codec refused them: {e}")
                err.sender_message = str(e)  # type: ignore[attr-defined]
                handle._finish(error=err)
                continue
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
        if flags & _FLAG_REFUSED:
            self._refused(first, host, need, total, inline)
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
        t._count(self.stats_key, n, total, backlog_s=self._held_back(arrival, _preamble_gap(buf)))
        self._spent = first, host, head, cut  # not freed on return: the caller is waiting for these packets
        return packets, arrival


    def _refused(self, first: torch.Tensor, host, need: int, total: int, inline: bool) -> None:
        """Take the rest of a refusal and raise :class:`_Refusal` with the sender's error text."""
        t = self.transport
        if inline:
            body = first[PREAMBLE_BYTES:need]
        else:
            body = torch.empty(total, dtype=torch.uint8, device=t._wire_device)
            self._recv_into(body)
            self.capacity = _next_capacity(self.capacity, need, t._nccl)
        self.seq += 1
        t._count(self.stats_key, 0, 0)
        raise _Refusal(body.cpu().numpy().tobytes().decode("utf-8", "replace"))

    def _held_back(self, arrival: float, gap: float) -> float:
        """The seconds the link spent carrying this message if it held it back, else 0.

        Held back: the message arrived later after the previous one than the sender had handed it over
        (``spacing`` against the preamble's ``gap``). The arrival gap ``spacing`` is then the line's time
        on this message if the line was busy until it started; if the line sat idle first, the gap counts that
        idle time too, and the message's own time is its one-way delay above the smallest lately seen (an
        unqueued message's). That delay is known up to a constant, the two clocks' offset, which the
        difference cancels: each message moves it by ``spacing - gap``. The smaller of the two is taken. The
        arrival is now, or the emulated arrival time where that is later."""
        now = max(time.time(), arrival)
        last, self._last_arrival = self._last_arrival, now
        if last is None or gap <= 0.0:  # the sender's first message: nothing to relate it to
            self._delay = 0.0
            self._delays.clear()
            self._delays.append(0.0)
            return 0.0
        spacing = now - last
        self._delay += spacing - gap
        self._delays.append(self._delay)
        if spacing <= gap * BACKLOG_FACTOR + BACKLOG_SLACK_S:
            return 0.0
        return max(0.0, min(spacing, self._delay - min(self._delays)))


_DELAYS_KEPT = 256  # messages whose relative delays give a link's smallest (clocks drift over longer spans)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"
