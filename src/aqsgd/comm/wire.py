"""The transport's wire format: the message preamble, its flags and CRC, channel tags, the receive size rule.

One *message* carries 0..8 :class:`~aqsgd.compress.packet.Packet` s from one rank to another on one
*channel* (an integer 0..255; :data:`FORWARD` = 0 for activations, :data:`BACKWARD` = 1 for gradients by
convention). It is a *preamble* and the packets' payloads, sent with the same tag:

1. the preamble, a fixed :data:`PREAMBLE_BYTES` = 576-byte uint8 block (no pickle)::

       offset bytes field
       0      4     magic b"AQTP"
       4      1     protocol version (3)
       5      1     number of packets n (0..8)
       6      2     channel
       8      8     sequence number of the message on its (sender, receiver, channel)
       16     8     total payload bytes (sum of the packets' payload lengths)
       24     8     arrival time, float64 wall-clock seconds (0 = deliver at once); see link emulation
       32     1     flags: 0x01 = the payload follows in the same gloo message; 0x02 = the sender checksums
                    CPU payloads (its ``checksum`` setting, which the receiver's must equal); 0x04 = the
                    sender's codec refused the message's tensor (a *refusal*, below)
       33     8     gap, float64 seconds: from the sender's hand-over of its previous message on this link to
                    this one's (0 for the first); the receiver compares it with the gap between their
                    arrivals to see whether the link held them back (:class:`~aqsgd.comm.stats.LinkStats`)
       41     19    reserved (zero)
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
overhead of ``PREAMBLE_BYTES - 64 n`` bytes; :attr:`~aqsgd.comm.transport.Transport.stats` reports both.
Packets carry a CRC-32 of their CPU payloads unless the transport was built with ``checksum=False`` (trusted
links: the sender then clears the packets' checksum flag and the receiver checks nothing but lengths and the
preamble's own CRC).
Both ends of a link must agree: every preamble carries the sender's setting, and a receiver built with the
other one fails the link with a :class:`~aqsgd.errors.PeerFailure` naming the peer (not a silently unchecked
or wrongly checked stream).

A *refusal* stands in for a message whose packets carry a deferred check that failed (a codec on a GPU
does not read NaN/Inf to the host inside its encode: :class:`~aqsgd.compress.packet.DeferredCheck`; the
sender thread reads the flag after the payloads' device-to-host copy, or where it takes the payloads for
the wire). It has flag 0x04, no packets (n = 0), and as its payload the UTF-8 text of the sender's
:class:`~aqsgd.errors.NonFiniteError` (at most :data:`REFUSAL_MAX_BYTES`); it is sized, numbered and split
by the same rules as any message, so both ends stay in step. The sender's ``SendHandle.wait`` raises that
error, the receiver's ``RecvHandle.wait`` a NonFiniteError naming the peer; neither marks the link failed
(it is not a failure of the network), and the next message on the link goes through as usual.

Channels are separated by tags: gloo matches a send to a receive by (peer, tag), and every channel has its
own tag (``_TAG_BASE + channel``), so forward and backward traffic between the same two ranks never mix.
NCCL ignores tags; there the transport instead builds one sub-group per (channel, direction) at
construction (a collective: every rank must construct its Transport with the same ``channels``), so each
NCCL communicator carries one ordered stream of messages and concurrent sends and receives cannot deadlock.

A receiver keeps the last message's parsed header layout (:class:`_Layout`): a pipeline repeats it every
micro-batch, and a message that repeats it needs no header parsing (see :mod:`aqsgd.comm.workers`).
"""

from __future__ import annotations

import struct
import zlib

import numpy as np
import torch

from aqsgd.compress.packet import HEADER_BYTES, Header
from aqsgd.errors import PacketError

__all__ = ["BACKWARD", "FORWARD", "MAX_CHANNEL", "MAX_PACKETS", "PREAMBLE_BYTES", "REFUSAL_MAX_BYTES"]

FORWARD = 0
BACKWARD = 1
MAX_PACKETS = 8
MAX_CHANNEL = 255
_PREFIX = struct.Struct("<4sBBHQQdBd19sI")
_PREFIX_BYTES = _PREFIX.size
_U32 = struct.Struct("<I")
_GAP = struct.Struct("<d")
PREAMBLE_BYTES = _PREFIX_BYTES + MAX_PACKETS * HEADER_BYTES
_MAGIC = b"AQTP"
_VERSION = 3
_FLAG_INLINE = 0x01  # the payload follows the preamble in the same gloo message
_FLAG_CHECKSUM = 0x02  # the sender's checksum setting: its CPU payloads carry a CRC-32
_FLAG_REFUSED = 0x04  # a refusal: the sender's codec refused the tensor; the payload is its error's text
_FLAGS = _FLAG_INLINE | _FLAG_CHECKSUM | _FLAG_REFUSED
REFUSAL_MAX_BYTES = 4096  # the longest error text a refusal carries (cut there)
_INLINE_START = 64 * 1024  # payload bytes a receive can take in one message before any larger one came
_INLINE_MAX = 64 * 1024 * 1024  # beyond this, messages always travel as preamble + payload
_TAG_BASE = 0x7100
assert _PREFIX_BYTES == 64


def _build_preamble(n: int, channel: int, seq: int, total: int, arrival: float, headers: bytes,
                    flags: int = 0, gap: float = 0.0) -> bytes:
    region = headers.ljust(MAX_PACKETS * HEADER_BYTES, b"\0")
    head = _PREFIX.pack(_MAGIC, _VERSION, n, channel, seq, total, arrival, flags, gap, b"", 0)[:60]
    return head + _U32.pack(zlib.crc32(region, zlib.crc32(head))) + region


def _parse_preamble(buf: bytes) -> tuple[int, int, int, int, float]:
    """(n, channel, seq, total, arrival) of a preamble; raises :class:`PacketError` when malformed."""
    if len(buf) != PREAMBLE_BYTES:
        raise PacketError(f"preamble of {len(buf)} bytes, expected {PREAMBLE_BYTES}")
    magic, version, n, channel, seq, total, arrival, flags, _gap, reserved, crc = _PREFIX.unpack(
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


def _preamble_gap(buf: bytes) -> float:
    """The sender's gap between hand-overs that a (checked) preamble carries."""
    return _GAP.unpack_from(buf, 33)[0]


def _next_capacity(capacity: int, need: int, nccl: bool) -> int:
    """The message size a receive can take in one piece after a message of ``need`` bytes went in two."""
    return capacity if nccl else max(capacity, min(need, PREAMBLE_BYTES + _INLINE_MAX))


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
