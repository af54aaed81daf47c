"""The codec interface: a stateless map ``Tensor -> Packet -> Tensor``.

A codec is built from a spec string (see :mod:`aqsgd.compress.registry`) and is immutable. ``encode``
accepts any floating dtype on any device and ``decode`` returns the same dtype on the payload's device.
``wire_bytes(shape)`` is the exact size of the packet that ``encode`` produces for that shape, header
included, so traffic can be planned (and checked) without encoding anything. Codecs whose size depends on
the data (an entropy stage, outlier rows sent apart, a per-token choice of bit width) set
``fixed_size = False``: for them ``payload_bytes``/``wire_bytes`` are upper bounds, and ``packet.nbytes``
is what really crosses the wire (the header carries the payload length).
"""

from __future__ import annotations

import abc
import contextlib
import copy
import threading
import zlib
from collections.abc import Callable, Iterator
from typing import ClassVar, Sequence

import torch

from aqsgd.compress import kernels
from aqsgd.compress.packet import HEADER_BYTES, MAX_NDIM, DeferredCheck, Family, Packet, PendingChecks
from aqsgd.errors import CodecError, NonFiniteError, PacketMismatchError

__all__ = ["Codec", "FLOAT_DTYPES", "collecting_pending_checks", "deferring_checks", "numel_of"]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def numel_of(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


class Codec(abc.ABC):
    """Stateless compressor of one tensor into one :class:`Packet`."""

    family: ClassVar[Family]
    #: False where the payload size depends on the data; ``payload_bytes`` is then an upper bound
    fixed_size: ClassVar[bool] = True
    #: True where ``encode_delta``/``decode_delta`` can run fused (they may still decline a given tensor)
    has_fused_delta: ClassVar[bool] = False
    #: the kernel backend this codec computes with (:mod:`aqsgd.compress.kernels`); None: the device's default
    backend: str | None = None

    @property
    @abc.abstractmethod
    def spec(self) -> str:
        """Canonical spec string; ``make_codec(codec.spec)`` rebuilds an equal codec."""

    @property
    def fingerprint(self) -> int:
        """CRC-32 of the canonical spec, written into every packet header."""
        return zlib.crc32(self.spec.encode())

    @property
    def lossless(self) -> bool:
        """True when ``decode(encode(x))`` equals ``x`` exactly."""
        return False

    @abc.abstractmethod
    def payload_bytes(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> int:
        """Exact payload size for a tensor of this shape (and input dtype, for dtype-preserving codecs); the
        largest possible size where ``fixed_size`` is False."""

    def wire_bytes(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> int:
        """Exact packet size on the wire, header included (an upper bound where ``fixed_size`` is False)."""
        return HEADER_BYTES + self.payload_bytes(shape, dtype)

    def ratio(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> float:
        """Compression ratio against sending the raw tensor of ``dtype`` (header excluded from neither)."""
        raw = numel_of(shape) * dtype.itemsize
        return raw / self.wire_bytes(shape, dtype)

    def encode(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> Packet:
        """Compress ``x``. Raises :class:`NonFiniteError` for NaN/Inf input, :class:`CodecError` for
        unsupported dtypes or more than 6 dims."""
        if not isinstance(x, torch.Tensor):
            raise CodecError(f"{self.spec}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in FLOAT_DTYPES:
            raise CodecError(f"{self.spec}: cannot encode dtype {x.dtype}; floating dtypes only")
        if x.dim() > MAX_NDIM:
            raise CodecError(f"{self.spec}: tensors of at most {MAX_NDIM} dims, got shape {tuple(x.shape)}")
        # encoding is not differentiable: without detach, in-place and out= ops fail on tensors requiring grad
        try:
            with collecting_checks(self._named) as checks:
                payload = self._encode(x.detach().contiguous(), generator)
        except NonFiniteError as e:  # an inner codec's (TopK's values, a wrapper's): named by this spec
            message = self._named(str(e))
            if message == str(e):
                raise
            raise NonFiniteError(message) from None
        expected = self.payload_bytes(x.shape, x.dtype)
        if self.fixed_size:
            assert payload.numel() == expected, (self.spec, payload.numel(), expected)
        else:
            assert payload.numel() <= expected, (self.spec, payload.numel(), expected)
        return Packet(self.family, x.dtype, tuple(x.shape), self.fingerprint, payload,
                      check=DeferredCheck.of(checks))

    def _named(self, message: str) -> str:
        """An inner codec's NonFiniteError text (``inner-spec: what``) as this codec reports it."""
        inner, _, rest = message.partition(": ")
        if inner == self.spec or not rest:
            return message
        where = self.spec if self.spec.startswith(inner) else f"{self.spec} (its {inner} part)"
        return f"{where}: {rest}"

    def decode(self, packet: Packet) -> torch.Tensor:
        """Decompress a packet produced by an equal codec; :class:`PacketMismatchError` otherwise. Checks of
        the payload's values (scales, indices) raise :class:`~aqsgd.errors.PacketError` at once, or, on a GPU
        inside :func:`collecting_pending_checks`, where that collector is read."""
        self.check_packet(packet)
        return self._decode(packet)

    def check_packet(self, packet: Packet) -> None:
        """Raise :class:`PacketMismatchError` unless an equal codec could have produced ``packet``."""
        if packet.family != self.family or packet.fingerprint != self.fingerprint:
            raise PacketMismatchError(
                f"packet was encoded by another codec (family {packet.family.name}, fingerprint "
                f"{packet.fingerprint:#010x}); this receiver decodes {self.spec!r} ({self.fingerprint:#010x})"
            )
        if packet.dtype not in FLOAT_DTYPES:
            raise PacketMismatchError(f"{self.spec}: packet dtype {packet.dtype} is not a floating dtype")
        expected = self.payload_bytes(packet.shape, packet.dtype)
        if packet.payload.numel() != expected and (self.fixed_size or packet.payload.numel() > expected):
            need = f"needs {expected}" if self.fixed_size else f"allows at most {expected}"
            raise PacketMismatchError(
                f"{self.spec}: payload of {packet.payload.numel()} bytes, shape {packet.shape} {need}"
            )

    # -- AQ-SGD against an in-memory cache, fused (optional) ------------------------------------------
    def encode_delta(self, x: torch.Tensor, store: kernels.RowStore) -> Packet | None:
        """The sender's AQ-SGD step in one go: the packet ``encode(x - m)``, ``m`` the rows of ``store`` (in
        fp32), with every row updated in place to ``m + decode(packet)`` in the store's format. Packet and
        rows are bit-identical to that sequence of calls. None where this codec has no fused step for ``x``:
        the caller then runs the sequence itself."""
        return None

    def decode_delta(self, packet: Packet, store: kernels.RowStore) -> torch.Tensor | None:
        """The receiver's step: rows updated in place to ``m + decode(packet)`` in the store's format,
        returned as fp32 (what ``put`` returns). None where this codec has no fused step for the packet."""
        return None

    def roundtrip(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
        """``decode(encode(x))``."""
        return self.decode(self.encode(x, generator=generator))

    @abc.abstractmethod
    def _encode(self, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor: ...

    @abc.abstractmethod
    def _decode(self, packet: Packet) -> torch.Tensor: ...

    def using(self, backend: str | None) -> Codec:
        """This codec computing with the kernel backend ``backend`` (``eager``, ``numba``, ``triton`` or any
        other registered one; None: the device's default), inner codecs included: a copy, this one is
        unchanged. The packets are the same bytes whatever the backend (on the CPU; see
        :mod:`aqsgd.compress.kernels`)."""
        if backend is not None:
            kernels.check_backend(backend)
        clone = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, Codec):
                setattr(clone, name, value.using(backend))
        clone.backend = backend
        return clone

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and other.spec == self.spec

    def __hash__(self) -> int:
        return hash(self.spec)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"


def non_finite_message(spec: str, what: str = "input") -> str:
    """The text of the :class:`NonFiniteError` of a codec refusing its input."""
    return f"{spec}: {what} holds NaN or Inf; refusing to encode (a diverged step should be caught, not sent)"


def raise_non_finite(spec: str, what: str = "input") -> None:
    raise NonFiniteError(non_finite_message(spec, what))


# -- deferred checks (no host synchronisation inside an encode on a GPU) ----------------------------------
_DEFER: dict[str, bool | None] = {"on": None}  # None: on CUDA tensors; True/False: everywhere/nowhere
_COLLECTING = threading.local()  # .stack: the open collectors of this thread's encodes, innermost last


@contextlib.contextmanager
def deferring_checks(on: bool | None = True) -> Iterator[None]:
    """Within the block, codecs defer (True) or make at once (False) the checks that need a value on the host:
    an encode's checks of its input (NaN/Inf, a scale beyond its storage dtype) and a receiver's checks of
    what it received (a decode's scales and indices, the low-bit cache's range); None restores the default:
    deferred on CUDA tensors, immediate elsewhere (a host read costs nothing on the CPU).

    A deferred encode check is a device flag carried by the packet
    (:class:`~aqsgd.compress.packet.DeferredCheck`): the encode does not raise,
    :meth:`Packet.raise_deferred <aqsgd.compress.packet.Packet.raise_deferred>` raises the same
    :class:`NonFiniteError` later, where the caller synchronises anyway (the transport, the local runtime's
    hand-over). A deferred receiver check is a device flag in the
    :class:`~aqsgd.compress.packet.PendingChecks` of the enclosing :func:`collecting_pending_checks` (the
    pipeline runner's step), read there later; outside one a decode checks at once, on any device. Tests
    force deferral on the CPU with this; it applies to every thread."""
    saved = _DEFER["on"]
    _DEFER["on"] = on
    try:
        yield
    finally:
        _DEFER["on"] = saved


def defers_checks(device: torch.device) -> bool:
    """Whether an encode running now on ``device`` defers its checks: inside an encode (something collects
    them) and, by default, on CUDA (see :func:`deferring_checks`)."""
    if not getattr(_COLLECTING, "stack", None):
        return False
    on = _DEFER["on"]
    return kernels.host_reads_wait(device) if on is None else on


def defer_check(flag: torch.Tensor, message: str) -> None:
    """Record a deferred check of the encode running now: ``flag`` (a 0-d or 1-element bool tensor) is True
    where the check failed, ``message`` the NonFiniteError text. Only where :func:`defers_checks`."""
    _COLLECTING.stack[-1].append((flag, message))


@contextlib.contextmanager
def collecting_checks(rename: Callable[[str], str] | None = None
                      ) -> Iterator[list[tuple[torch.Tensor, str]]]:
    """Collect the checks deferred inside the block (by this thread), their messages passed through
    ``rename`` as the codec would rename the error of an inner codec; they are also handed on to the
    enclosing collector, if any (an outer codec's encode)."""
    stack = getattr(_COLLECTING, "stack", None)
    if stack is None:
        stack = _COLLECTING.stack = []
    checks: list[tuple[torch.Tensor, str]] = []
    stack.append(checks)
    try:
        yield checks
    finally:
        stack.pop()
        if rename is not None:
            checks[:] = [(f, rename(m)) for f, m in checks]
        if stack:
            stack[-1].extend(checks)


# -- pending checks (no host synchronisation inside a decode on a GPU) ------------------------------------
_PENDING = threading.local()  # .stack: this thread's open PendingChecks, innermost last; .wraps: see below


class collecting_pending_checks:  # noqa: N801 - used as a context manager, like contextlib's
    """Within the block (this thread), the checks of received data that a decode, or the low-bit cache
    storing what was decoded, would make on the host are left on the device instead where
    :func:`defers_pending_checks` says so (by default: on CUDA), and recorded in ``pending`` (a fresh
    :class:`~aqsgd.compress.packet.PendingChecks` if None; ``as`` gives it). The caller reads them with
    ``pending.raise_failed()`` before it relies on what was decoded: the same error, later.

    A receiver cannot refuse after the fact as a sender does (see PendingChecks), so only a caller that has
    such a point opens one: the pipeline runner around each receive and send of a step, read at the step's
    end (:meth:`aqsgd.pipeline.runner.StageRunner.end_step`). Without one a decode checks at once on any
    device (on a GPU: one host synchronisation per check). A class rather than a generator: the runner enters
    one for every message, where microseconds count."""

    __slots__ = ("pending",)

    def __init__(self, pending: PendingChecks | None = None) -> None:
        self.pending = PendingChecks() if pending is None else pending

    def __enter__(self) -> PendingChecks:
        stack = getattr(_PENDING, "stack", None)
        if stack is None:
            stack = _PENDING.stack = []
        stack.append(self.pending)
        return self.pending

    def __exit__(self, *exc: object) -> None:
        _PENDING.stack.pop()


def defers_pending_checks(device: torch.device) -> bool:
    """Whether a receiver's check of data on ``device`` is left on the device now: inside
    :func:`collecting_pending_checks` and, by default, on CUDA (see :func:`deferring_checks`)."""
    if not getattr(_PENDING, "stack", None):
        return False
    on = _DEFER["on"]
    return kernels.host_reads_wait(device) if on is None else on


def defer_pending_check(flag: torch.Tensor, error: Callable[[], BaseException]) -> None:
    """Record a receiver's check (only where :func:`defers_pending_checks`): ``flag`` (a 0-d or 1-element
    tensor) nonzero where it failed, ``error()`` the exception the immediate check raises (made after the
    flags were read, as the enclosing :func:`wrapping_pending_errors` rename it)."""
    wraps = getattr(_PENDING, "wraps", None)
    if wraps:
        inner, chain = error, tuple(reversed(wraps))  # innermost first, as nested except clauses would

        def error() -> BaseException:
            e = inner()
            for wrap in chain:
                e = wrap(e)
            return e

    _PENDING.stack[-1].add(flag, error)


@contextlib.contextmanager
def wrapping_pending_errors(wrap: Callable[[BaseException], BaseException]) -> Iterator[None]:
    """The pending checks recorded inside the block raise ``wrap(error)``: what an ``except`` around the
    block would have raised had the check been immediate (the low-bit cache turns a quantizer's error into
    a :class:`~aqsgd.errors.CacheError`)."""
    wraps = getattr(_PENDING, "wraps", None)
    if wraps is None:
        wraps = _PENDING.wraps = []
    wraps.append(wrap)
    try:
        yield
    finally:
        wraps.pop()
