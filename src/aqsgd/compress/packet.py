"""The wire format: a :class:`Packet` is a fixed 64-byte header plus one contiguous uint8 payload.

``packet.nbytes`` (header + payload) is exactly what crosses the wire. Header layout (little-endian):

====== ===== =====================================================================
offset bytes field
====== ===== =====================================================================
0      4     magic ``b"AQPK"``
4      1     format version (1)
5      1     codec family (see :class:`Family`)
6      1     dtype code of the decoded tensor (see ``DTYPE_CODES``)
7      1     ndim (0..6)
8      4     codec fingerprint: CRC-32 of the codec's canonical spec string
12     4     tag: set by boundary schemes (CRC-32 of the micro-batch's sample ids, ...)
16     1     kind: set by boundary schemes (what the payload means for them)
17     1     flags: bit 0 = the payload CRC field is valid
18     2     reserved (zero)
20     4     CRC-32 of the payload (0 when flag bit 0 is clear)
24     8     payload length in bytes
32     24    shape: 6 x uint32 (unused dims zero)
56     4     reserved (zero)
60     4     CRC-32 of header bytes 0..59
====== ===== =====================================================================

Integrity: the header is always checked (magic, version, CRC). The payload CRC is computed when a packet is
serialized from a CPU payload (``to_bytes``/``header_bytes(checksum=True)``); CUDA payloads travel with
the flag cleared (NCCL/TCP already protect the bytes, and a device-to-host copy just for a checksum
would cost more than the transfer it protects). A header whose dims multiply past ``MAX_SPAN`` (zeros
counted as 1) is rejected as well: no tensor of that shape can exist.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
import zlib
from typing import Callable, Mapping

import torch

try:  # ISA-L's CRC-32 (carry-less multiply): the same value as zlib's, about 13x faster on long payloads
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # a platform without an isal wheel: zlib's (identical results)
    from zlib import crc32 as _crc32

from aqsgd.compress.kernels import on_host
from aqsgd.errors import NonFiniteError, PacketError, PacketMismatchError

__all__ = [
    "Packet",
    "DeferredCheck",
    "PendingChecks",
    "Family",
    "HEADER_BYTES",
    "MAX_NDIM",
    "DTYPE_CODES",
    "Header",
    "parse_header",
    "crc32_of_tensor",
    "crc32_of_buffer",
    "check_shape",
    "bytes_as",
    "fill_header",
    "layout_key",
    "layout_keys",
    "message_fields",
]

MAGIC = b"AQPK"
VERSION = 1
HEADER_BYTES = 64
MAX_NDIM = 6
_FLAG_PAYLOAD_CRC = 1
# Largest product of dims (zeros counted as 1) that a packet may announce. torch computes strides from every
# dim even when another is 0, so (0, 2**32-1, 2**32-1) overflows int64 although it holds nothing; 2**60
# keeps element and byte strides (dtypes of up to 8 bytes) inside int64.
MAX_SPAN = 2**60
_STRUCT = struct.Struct("<4sBBBBIIBBHIQ6III")
assert _STRUCT.size == HEADER_BYTES, _STRUCT.size

DTYPE_CODES: Mapping[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
    torch.uint8: 5,
    torch.int8: 6,
    torch.int16: 7,
    torch.int32: 8,
    torch.int64: 9,
}
_CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


class Family(enum.IntEnum):
    """Codec families; the header's family byte."""

    RAW = 1
    CAST = 2
    QUANT = 3
    TOPK = 4
    ROTATED = 5
    OUTLIER = 6
    ENTROPY = 7
    TAH = 8
    SUBSPACE = 9


@dataclasses.dataclass(frozen=True)
class Header:
    """The decoded fixed-size header of a packet."""

    family: Family
    dtype: torch.dtype
    shape: tuple[int, ...]
    fingerprint: int
    tag: int
    kind: int
    payload_len: int
    payload_crc: int | None


crc32_of_buffer = _crc32
"""CRC-32 of a buffer-protocol object (bytes, a numpy array), optionally continuing from a previous value:
``zlib.crc32``'s result."""


def crc32_of_tensor(t: torch.Tensor) -> int:
    """CRC-32 of a CPU tensor's bytes (zero-copy through the buffer protocol); ``zlib.crc32``'s value."""
    if t.dtype != torch.uint8 or not t.is_contiguous():  # a payload is already contiguous uint8
        t = t.contiguous().view(torch.uint8)
    if t.numel() == 0:
        return 0
    return _crc32(t.numpy())


def check_shape(shape: tuple[int, ...]) -> None:
    """Raise :class:`PacketError` unless ``shape`` is one that torch can build a tensor of (see MAX_SPAN)."""
    span = 1
    for d in shape:
        span *= max(d, 1)
    if span > MAX_SPAN:
        raise PacketError(f"packet shape {tuple(shape)} is too large (its strides would overflow int64)")


def bytes_as(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bytes of a 1-D uint8 tensor viewed as ``dtype``: zero-copy when they are aligned for it.

    A payload may start at any byte: the transport hands each packet a slice of one shared receive buffer,
    and a codec's regions follow each other with no padding (TopK's indices after an odd-sized values
    region). ``Tensor.view(dtype)`` refuses a misaligned storage offset (and device kernels must not read a
    misaligned pointer), so such bytes are first copied to a fresh, aligned buffer.
    """
    size = dtype.itemsize
    if data.storage_offset() % size or data.data_ptr() % size:
        data = data.clone()
    return data.view(dtype)


_MESSAGE_FIELDS = struct.Struct("<12xI4xI36xI")  # tag (offset 12), payload CRC (20), header CRC (60)
_LAYOUT_FIELDS = "12s4x4s4x36s4x"  # the rest: bytes 0..12, 16..20 and 24..60
# of 0..8 headers (a transport message)
_LAYOUTS = [struct.Struct("<" + _LAYOUT_FIELDS * n) for n in range(9)]
_FILL = struct.Struct("<12sI4sI36s")  # a layout with a tag and a payload CRC: the first 60 bytes of a header
_U32 = struct.Struct("<I")


def layout_key(header: bytes | memoryview, offset: int = 0) -> tuple[bytes, bytes, bytes]:
    """The 52 bytes of the header at ``offset`` without the fields that change from one message to the next
    (tag, payload CRC, header CRC), as the three runs of bytes around them: equal keys mean equal codec,
    dtype, shape, kind, flags and length."""
    return _LAYOUTS[1].unpack_from(header, offset)


def layout_keys(headers: bytes | memoryview, n: int) -> tuple[bytes, ...]:
    """The :func:`layout_key` s of ``n`` consecutive headers, concatenated, in one call."""
    layouts = _LAYOUTS[n] if n < len(_LAYOUTS) else struct.Struct("<" + _LAYOUT_FIELDS * n)
    return layouts.unpack_from(headers)


def message_fields(header: bytes | memoryview, offset: int = 0) -> tuple[int, int, int]:
    """``(tag, payload CRC, header CRC)`` of the header at ``offset``, unchecked."""
    return _MESSAGE_FIELDS.unpack_from(header, offset)


def fill_header(key: tuple[bytes, bytes, bytes], tag: int, payload_crc: int) -> bytes:
    """The 64 header bytes of a :func:`layout_key` with this message's tag and payload CRC (0 when the key's
    flags say there is none): ``packet.header_bytes(...)`` without packing every field again."""
    head = _FILL.pack(key[0], tag & 0xFFFFFFFF, key[1], payload_crc, key[2])
    return head + _U32.pack(zlib.crc32(head))


def parse_header(buf: bytes | bytearray | memoryview | torch.Tensor) -> Header:
    """Parse and verify a 64-byte header. Raises :class:`PacketError` on anything malformed."""
    if isinstance(buf, torch.Tensor):
        buf = buf.cpu().contiguous().numpy().tobytes()
    buf = bytes(buf)
    if len(buf) < HEADER_BYTES:
        raise PacketError(f"truncated packet: {len(buf)} bytes, a header alone is {HEADER_BYTES}")
    head = buf[:HEADER_BYTES]
    (magic, version, family, dtype_code, ndim, fingerprint, tag, kind, flags, reserved, payload_crc,
     payload_len, *rest) = _STRUCT.unpack(head)
    dims, reserved2, header_crc = rest[:6], rest[6], rest[7]
    if magic != MAGIC:
        raise PacketError(f"not an aqsgd packet (magic {magic!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise PacketError(f"unsupported packet format version {version} (this build reads {VERSION})")
    if zlib.crc32(head[:60]) != header_crc:
        raise PacketError("corrupted packet header (CRC mismatch)")
    try:
        fam = Family(family)
    except ValueError:
        raise PacketError(f"unknown codec family {family}") from None
    if dtype_code not in _CODE_DTYPES:
        raise PacketError(f"unknown dtype code {dtype_code}")
    if ndim > MAX_NDIM or any(dims[ndim:]) or reserved or reserved2 or flags & ~_FLAG_PAYLOAD_CRC:
        raise PacketError("malformed packet header (ndim, padding or flags out of range)")
    check_shape(dims[:ndim])
    return Header(
        family=fam,
        dtype=_CODE_DTYPES[dtype_code],
        shape=tuple(dims[:ndim]),
        fingerprint=fingerprint,
        tag=tag,
        kind=kind,
        payload_len=payload_len,
        payload_crc=payload_crc if flags & _FLAG_PAYLOAD_CRC else None,
    )


class DeferredCheck:
    """Checks of an encode that were left on the device: one flag per check (a 1-D bool tensor, True where
    the check failed) and the error text each would have raised, in the order the encode made them.

    On a GPU an encode that read a value to decide whether to refuse its input (NaN/Inf, a scale beyond its
    storage dtype) would block the CPU until the GPU caught up. The codec records the decision as a device
    flag instead (see :func:`aqsgd.compress.base.deferring_checks`), and whoever synchronises with the
    packet's bytes anyway reads it (:meth:`failure`): the transport's sender thread after the payload's
    device-to-host copy, the local runtime at the hand-over. Reading costs one small device-to-host copy;
    the result is kept."""

    __slots__ = ("flags", "messages", "_failure")

    def __init__(self, flags: torch.Tensor, messages: tuple[str, ...]) -> None:
        self.flags = flags
        self.messages = messages
        self._failure: str | None | bool = False  # False: not read yet

    @classmethod
    def of(cls, checks: list[tuple[torch.Tensor, str]]) -> DeferredCheck | None:
        """The check of ``(flag, message)`` pairs (0-d or 1-element tensors on one device, nonzero where the
        check failed); None for none."""
        if not checks:
            return None
        if len(checks) == 1:  # any dtype: read as truth values (a cast would be one more launch on a GPU)
            return cls(checks[0][0].reshape(1), (checks[0][1],))
        flags = [f.reshape(1).bool() for f, _ in checks]
        return cls(torch.cat(flags), tuple(m for _, m in checks))

    def failure(self) -> str | None:
        """The error text of the first check that failed, None where all passed (reads the flags once)."""
        if self._failure is False:
            hit = self.flags.tolist()  # the one host synchronisation
            self._failure = next((m for f, m in zip(hit, self.messages) if f), None)
        return self._failure  # type: ignore[return-value]

    def __repr__(self) -> str:
        return f"DeferredCheck({len(self.messages)} checks)"


class PendingChecks:
    """Checks that a receiver left on the device: one flag per check (a 0-d or 1-element tensor, nonzero where
    the check failed) and a function that makes the error an immediate check would have raised, in the order
    they were made. Filled inside :func:`~aqsgd.compress.base.collecting_pending_checks`.

    A sender that defers a check can still refuse to send: its packet carries the flag and the transport reads
    it before the bytes leave (:class:`DeferredCheck`). A receiver cannot refuse what it has received, and
    what it decoded is used at once (the stage's forward or backward runs on it). Its checks on a GPU (are the
    received scales finite and non-negative? the indices inside their rows? does what the low-bit cache stores
    fit fp16?) are therefore read by whoever opened the collector, at a point where it synchronises anyway
    and before anything computed from the decoded tensors becomes permanent: the pipeline runner at the end
    of the step (after waiting for its sends; the loss and the gradient norm are read next), before any
    optimizer step. Until then the decoded tensors of a failed check hold whatever the corrupt bytes say,
    kept inside their shape (an index out of range is clamped, never used); a run that reads the error stops
    there. :meth:`raise_failed` raises the error of the first check that failed, with the immediate check's
    type and text."""

    __slots__ = ("_checks",)

    def __init__(self) -> None:
        self._checks: list[tuple[torch.Tensor, Callable[[], BaseException]]] = []

    def add(self, flag: torch.Tensor, error: Callable[[], BaseException]) -> None:
        """Record a check: ``flag`` nonzero where it failed, ``error()`` the exception to raise then (called
        after the flags were read, so it may read device values of its own)."""
        self._checks.append((flag, error))

    def extend(self, other: PendingChecks) -> None:
        """Record ``other``'s checks after these (``other`` is left as it is)."""
        self._checks.extend(other._checks)

    def __len__(self) -> int:
        return len(self._checks)

    def failure(self) -> BaseException | None:
        """The error of the first check that failed, None where all passed; forgets the checks. One host read
        of the flags per device holding some (on a GPU: waits for the work queued before it)."""
        checks, self._checks = self._checks, []
        if not checks:
            return None
        by_device: dict[torch.device, list[int]] = {}
        for i, (flag, _) in enumerate(checks):
            by_device.setdefault(flag.device, []).append(i)
        hit = [False] * len(checks)
        for where in by_device.values():
            flags = [checks[i][0].reshape(1).bool() for i in where]
            for i, h in zip(where, (flags[0] if len(flags) == 1 else torch.cat(flags)).tolist()):
                hit[i] = h
        return next((error() for (_, error), h in zip(checks, hit) if h), None)

    def raise_failed(self) -> None:
        """Raise the error of the first check that failed (:meth:`failure`); nothing where all passed."""
        error = self.failure()
        if error is not None:
            raise error

    def __repr__(self) -> str:
        return f"PendingChecks({len(self._checks)} checks)"


@dataclasses.dataclass(frozen=True, eq=False)
class Packet:
    """A compressed tensor: header fields and one 1-D uint8 payload (on CPU or on the GPU).

    ``check``: the checks its encode left on the device (:class:`DeferredCheck`), or None; not on the wire
    (a transport reads it before sending, see :meth:`refusal`)."""

    family: Family
    dtype: torch.dtype
    shape: tuple[int, ...]
    fingerprint: int
    payload: torch.Tensor
    tag: int = 0
    kind: int = 0
    check: DeferredCheck | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.payload.dtype != torch.uint8 or self.payload.dim() != 1:
            raise PacketError("packet payload must be a 1-D uint8 tensor")
        if len(self.shape) > MAX_NDIM:
            raise PacketError(f"packets carry at most {MAX_NDIM} dims, got shape {self.shape}")
        if any(d < 0 or d >= 2**32 for d in self.shape):
            raise PacketError(f"dims must fit in uint32, got shape {self.shape}")
        check_shape(self.shape)
        if not 0 <= self.kind <= 255:  # one header byte
            raise PacketError(f"packet kind must be in 0..255, got {self.kind}")
        if self.dtype not in DTYPE_CODES:
            raise PacketError(f"unsupported dtype {self.dtype}")

    def refusal(self) -> str | None:
        """The error text of the check its encode deferred and failed (the :class:`NonFiniteError` an
        immediate check would have raised), or None: the input was fine, or nothing was deferred. Reads the
        device flag once (one synchronisation; free for CPU tensors)."""
        return None if self.check is None else self.check.failure()

    def raise_deferred(self) -> None:
        """Raise the :class:`~aqsgd.errors.NonFiniteError` the encode would have raised had it not deferred
        its checks (:meth:`refusal`); nothing where they passed."""
        message = self.refusal()
        if message is not None:
            raise NonFiniteError(message)

    @property
    def nbytes(self) -> int:
        """Exact bytes on the wire: header plus payload."""
        return HEADER_BYTES + self.payload.numel()

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def with_tag(self, tag: int, kind: int = 0) -> Packet:
        """The same packet with the scheme-level tag and kind set."""
        if not 0 <= kind <= 255:  # the only field that changes and is checked; the rest were checked already
            raise PacketError(f"packet kind must be in 0..255, got {kind}")
        # not dataclasses.replace: it runs every check of __post_init__ again, twice per message on the send
        # path, where each torch call costs microseconds (many more with cold caches)
        packet = object.__new__(type(self))
        packet.__dict__.update(self.__dict__, tag=tag & 0xFFFFFFFF, kind=kind)
        return packet

    def with_check(self, check: DeferredCheck | None) -> Packet:
        """The same packet carrying ``check`` (see :class:`DeferredCheck`)."""
        packet = object.__new__(type(self))
        packet.__dict__.update(self.__dict__, check=check)
        return packet

    def header_bytes(self, *, checksum: bool | None = None, payload_crc: int | None = None) -> bytes:
        """The 64 header bytes. ``checksum`` defaults to True for CPU payloads, False for CUDA.
        ``payload_crc``: the payload's CRC-32 when the caller has it already (not recomputed)."""
        if checksum is None:
            checksum = on_host(self.payload.device)
        if not checksum:
            crc = 0
        elif payload_crc is not None:
            crc = payload_crc
        else:
            crc = crc32_of_tensor(self.payload.cpu())  # the payload itself where it is on the CPU
        dims = list(self.shape) + [0] * (MAX_NDIM - len(self.shape))
        head = _STRUCT.pack(
            MAGIC, VERSION, int(self.family), DTYPE_CODES[self.dtype], len(self.shape),
            self.fingerprint & 0xFFFFFFFF, self.tag & 0xFFFFFFFF, self.kind,
            _FLAG_PAYLOAD_CRC if checksum else 0, 0, crc, self.payload.numel(), *dims, 0, 0,
        )
        return head[:60] + struct.pack("<I", zlib.crc32(head[:60]))

    def to_bytes(self, *, checksum: bool = True) -> bytes:
        """Serialize header + payload (the payload is copied to the host)."""
        return self.header_bytes(checksum=checksum) + self.payload.cpu().numpy().tobytes()

    @classmethod
    def from_header(cls, header: Header, payload: torch.Tensor, *, verify: bool = True) -> Packet:
        """Build a packet from a parsed header and its received payload, verifying length and CRC."""
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise PacketError("packet payload must be a 1-D uint8 tensor")
        if payload.numel() != header.payload_len:
            raise PacketError(
                f"truncated or oversized packet: header announces {header.payload_len} payload bytes, "
                f"got {payload.numel()}"
            )
        if verify and header.payload_crc is not None and on_host(payload.device):
            if crc32_of_tensor(payload) != header.payload_crc:
                raise PacketError("corrupted packet payload (CRC mismatch)")
        return cls(header.family, header.dtype, header.shape, header.fingerprint, payload, header.tag,
                   header.kind)

    @classmethod
    def _from_parsed(cls, header: Header, payload: torch.Tensor, tag: int) -> Packet:
        """A packet from a header that :func:`parse_header` accepted (with this message's ``tag``) and a 1-D
        uint8 ``payload`` of its announced length, without checking them again: the transport's receive
        path, where every torch call is a visible part of a small message's latency. Callers guarantee what
        ``__post_init__`` would check."""
        packet = object.__new__(cls)
        packet.__dict__.update(family=header.family, dtype=header.dtype, shape=header.shape,
                               fingerprint=header.fingerprint, payload=payload, tag=tag, kind=header.kind,
                               check=None)
        return packet

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, *,
                   device: str | torch.device = "cpu") -> Packet:
        """Parse serialized bytes (exactly one packet). Raises :class:`PacketError` on malformed input."""
        data = bytes(data)
        header = parse_header(data)
        body = data[HEADER_BYTES:]
        if len(body) != header.payload_len:
            raise PacketError(
                f"truncated or oversized packet: header announces {header.payload_len} payload bytes, "
                f"got {len(body)}"
            )
        payload = (torch.frombuffer(bytearray(body), dtype=torch.uint8) if body
                   else torch.empty(0, dtype=torch.uint8))
        packet = cls.from_header(header, payload)
        return (packet if on_host(device)
                else dataclasses.replace(packet, payload=payload.to(device)))

    def expect(self, *, tag: int | None = None, kind: int | None = None,
               shape: tuple[int, ...] | None = None, what: str = "packet") -> None:
        """Raise :class:`PacketMismatchError` unless the packet carries the expected tag, kind and shape."""
        if kind is not None and self.kind != kind:
            raise PacketMismatchError(f"{what}: packet kind {self.kind}, receiver expected {kind}")
        if tag is not None and self.tag != (tag & 0xFFFFFFFF):
            raise PacketMismatchError(
                f"{what}: packet was sent for other sample ids (tag {self.tag:#010x}, receiver expected "
                f"{tag & 0xFFFFFFFF:#010x}); sender and receiver are out of step"
            )
        if shape is not None and tuple(self.shape) != tuple(shape):
            raise PacketMismatchError(f"{what}: packet shape {tuple(self.shape)}, receiver expected "
                                      f"{tuple(shape)}")
