"""Packets between processes over ``torch.distributed``: background threads, link emulation, accounting.

One *message* carries 0..8 :class:`~aqsgd.compress.packet.Packet` s from one rank to another on one
*channel* (an integer 0..255; :data:`FORWARD` = 0 for activations, :data:`BACKWARD` = 1 for gradients by
convention): a fixed :data:`PREAMBLE_BYTES`-byte preamble and the packets' payloads. ``isend`` and ``irecv``
never block: one background thread per link and direction sends or receives in order, and the caller waits
on the handle it got. The transport is split by concern:

- :mod:`aqsgd.comm.wire`: the wire format (the preamble, its flags and CRC, the channels' tags, when a message
  travels as one gloo message or two) and the parsed header layout a receiver keeps;
- :mod:`aqsgd.comm.handles`: the handles ``isend``/``irecv`` return (:class:`SendHandle`,
  :class:`RecvHandle`);
- :mod:`aqsgd.comm.stats`: the traffic counters (:class:`StatsKey`, :class:`LinkStats`);
- :mod:`aqsgd.comm.workers`: the per-link sender and receiver threads and the sender's pooled message
  buffers, with what keeps a small message's latency low;
- :mod:`aqsgd.comm.core`: what the handles and threads use of the transport that owns them (a protocol, so
  that they need not import this module, which imports them);
- this module: :class:`Transport`, which checks peers and channels, starts and stops the threads, stages GPU
  payloads, paces emulated links and keeps the counters, and :func:`naming_peer_failures`.

The public names among them (``__all__``: the channels, the preamble's size, the handles and counters) are
importable from here and from :mod:`aqsgd.comm`; the wire format's and the threads' internals are not.

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

import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Iterator

import torch
import torch.distributed as dist

from aqsgd.comm.device import HostStager
from aqsgd.comm.handles import RecvHandle, SendHandle
from aqsgd.comm.link import LinkSpec, Pacer
from aqsgd.comm.stats import LinkStats, StatsKey
from aqsgd.comm.wire import _TAG_BASE, BACKWARD, FORWARD, MAX_CHANNEL, MAX_PACKETS, PREAMBLE_BYTES
from aqsgd.comm.workers import _Receiver, _Sender, _SendItem, _Worker
from aqsgd.compress.packet import HEADER_BYTES, Packet
from aqsgd.errors import PeerFailure, TransportError

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

_DEFAULT_CHANNEL_NAMES = {FORWARD: "forward activations", BACKWARD: "backward gradients"}
_JOIN_TIMEOUT_S = 2.0


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

    Packets whose encode deferred its checks (:class:`~aqsgd.compress.packet.DeferredCheck`, on a GPU) are
    checked by the sender thread once their bytes are complete; a failed check sends a *refusal* instead
    (:mod:`aqsgd.comm.wire`): ``SendHandle.wait`` raises the codec's :class:`~aqsgd.errors.NonFiniteError`,
    the peer's ``RecvHandle.wait`` a NonFiniteError naming this rank, and the link stays usable.
    """

    #: the transport reads the packets' deferred checks itself (callers need not, see above)
    reads_deferred_checks = True

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
            # NCCL has no tags: one sub-group per (channel, direction of rank order); see aqsgd.comm.wire.
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
        """Emulate ``spec`` on the link to ``dst`` from its next message on (a link schedule's change, at a
        step boundary). Called before the link's first message it gives the link a pacer even where ``spec``
        is unlimited, so that a later call can slow it down; a link that has started without emulation cannot
        be paced later (a :class:`TransportError`)."""
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

    def _count(self, key: StatsKey, packets: int, payload_bytes: int, busy_s: float = 0.0,
               backlog_s: float = 0.0) -> None:
        with self._stats_lock:
            s = self._stats.get(key)
            if s is None:
                s = self._stats[key] = LinkStats()
            s.busy_s += busy_s
            if backlog_s:  # a received message the link held back (see LinkStats)
                s.backlog_s += backlog_s
                s.backlog_bytes += PREAMBLE_BYTES + payload_bytes
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
