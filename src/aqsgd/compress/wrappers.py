"""Codecs that wrap another codec: a rotation before it, outlier rows beside it, an entropy stage after it.

Spec options (any order, after the inner codec's own options; see :mod:`aqsgd.compress.registry`):

``rot<G>`` (``q<b>`` only)
    Randomized Hadamard rotation of tiles of ``G`` consecutive values (``G`` a power of two, e.g. 32, 64,
    128; the flattened tensor is zero-padded to a multiple of ``G``), then the quantizer on the rotated
    tiles viewed as ``[tiles, G]``. Its granularity refers to that view: one scale per tile by default
    (``token``), or ``tensor``, ``channel`` (per position in the tile), ``block<N>``. The random signs come
    from seed 0, or ``rot<G>s<seed>``; sender and receiver build them from the spec. Rotation spreads one
    large value over its tile, so a tile's scale is set by its energy rather than by its largest entry.
    The packet is the quantizer's payload of ``[ceil(numel / G), G]`` values: exact bytes, fixed size.
``outlier<F>``
    Rows (all dims but the last) whose L2 norm is more than ``F`` times the median row norm are sent apart
    in bf16, their indices in the packet; the inner codec gets the other rows only, so an attention sink
    no longer sets every per-channel scale. At most ``max(1, rows // 16)`` rows (the largest) go apart.
    Chosen from the data of each tensor, no fixed position. Payload: ``uint32`` count, ``uint32`` row
    indices (ascending), bf16 rows, then the inner payload of the remaining rows. Size depends on the data.
    With the Triton kernels the squared row norms are summed in the kernel's order, equal to PyTorch's to
    float rounding: a row whose norm lies within rounding of the threshold (or tied for the cap) may be
    chosen where the CPU would not, and the packet differs from the CPU's; it decodes the same way either
    way, as the receiver reads the indices. The split into the rows apart and the rest is exact. Encoding
    reads the count to the host (it sizes the payload). Decoding on a GPU, where the caller collects pending
    checks (:func:`aqsgd.compress.base.collecting_pending_checks`), takes the count from the payload's length
    (the inner payload's size follows from its shape) and checks the announced count and the indices on the
    device; where two counts would give the same length it reads the count to the host.
``zstd`` / ``zstd<L>``
    A lossless zstandard stage over the inner payload (level ``L``, default 1): AQ-SGD deltas late in
    training are mostly the zero code. Payload: one mode byte (0 = stored as is when zstd would not
    shrink it, 1 = a zstd frame), then the bytes. Size depends on the data; ``packet.nbytes`` counts what
    really crosses the wire. The stage runs on the CPU (device payloads are copied to the host and back).

Composition is fixed, whatever the option order: ``zstd(outlier(rot(inner)))``.
"""

from __future__ import annotations

import functools
import threading
from typing import Sequence

import numpy as np
import torch

from aqsgd.compress import hadamard, kernels, rans
from aqsgd.compress.base import (
    Codec,
    collecting_checks,
    defer_pending_check,
    defers_pending_checks,
    non_finite_message,
    numel_of,
    raise_non_finite,
)
from aqsgd.compress.packet import Family, Packet, bytes_as
from aqsgd.compress.quant import QuantCodec
from aqsgd.errors import NonFiniteError, PacketError, SpecError

__all__ = ["RotatedCodec", "OutlierCodec", "EntropyCodec", "RansCodec"]


def _inner_packet(inner: Codec, dtype: torch.dtype, shape: tuple[int, ...], payload: torch.Tensor) -> Packet:
    return Packet(inner.family, dtype, shape, inner.fingerprint, payload)


class RotatedCodec(Codec):
    """``q<b>[...]:rot<G>[s<seed>]``: randomized Hadamard rotation of tiles, then the quantizer per tile."""

    family = Family.ROTATED

    def __init__(self, inner: QuantCodec, tile: int, seed: int = 0) -> None:
        if not isinstance(inner, QuantCodec):
            raise SpecError(f"rotation applies to q<bits> quantizers, not {inner.spec!r}")
        hadamard.check_tile(tile)
        if not isinstance(seed, int) or seed < 0:
            raise SpecError(f"rotation seed must be a non-negative integer, got {seed!r}")
        self.inner, self.tile, self.seed = inner, tile, seed

    @property
    def spec(self) -> str:
        head, *opts = self.inner.spec.split(":")
        if self.inner.granularity == "token":
            opts.remove("token")
        elif self.inner.granularity == "channel":
            opts.insert(0, "channel")
        rot = f"rot{self.tile}" + (f"s{self.seed}" if self.seed else "")
        return ":".join([head, rot, *opts])

    def _tiles(self, shape: Sequence[int]) -> tuple[int, int]:
        n = numel_of(shape)
        return n, -(-n // self.tile)

    def payload_bytes(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> int:
        _, tiles = self._tiles(shape)
        return self.inner.payload_bytes((tiles, self.tile), torch.float32)

    def _encode(self, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        n, tiles = self._tiles(x.shape)
        if n == 0:
            return torch.empty(0, dtype=torch.uint8, device=x.device)
        flat = x.reshape(-1)
        if tiles * self.tile != n:
            flat = torch.nn.functional.pad(flat.to(torch.float32), (0, tiles * self.tile - n))
        y = hadamard.rotate(flat, self.tile, self.seed, self.backend)
        try:
            with collecting_checks(lambda _: non_finite_message(self.spec)):  # as raised below, if deferred
                return self.inner._encode(y, generator)
        except NonFiniteError:
            raise_non_finite(self.spec)
            raise

    def _decode(self, packet: Packet) -> torch.Tensor:
        n, tiles = self._tiles(packet.shape)
        if n == 0:
            return torch.empty(packet.shape, dtype=packet.dtype, device=packet.payload.device)
        y = self.inner._decode(_inner_packet(self.inner, torch.float32, (tiles, self.tile), packet.payload))
        out = hadamard.unrotate(y, self.tile, self.seed, self.backend).view(-1)[:n].view(packet.shape)
        return out if packet.dtype == torch.float32 else out.to(packet.dtype)


class OutlierCodec(Codec):
    """``<inner>:outlier<F>``: rows with norm above ``F`` x the median row norm go apart in bf16."""

    family = Family.OUTLIER
    fixed_size = False

    def __init__(self, inner: Codec, factor: float) -> None:
        if not factor > 1.0 or factor != factor or factor == float("inf"):
            raise SpecError(f"outlier factor must be a finite number above 1, got {factor!r}")
        self.inner, self.factor = inner, float(factor)

    @property
    def spec(self) -> str:
        return f"{self.inner.spec}:outlier{self.factor:g}"

    @staticmethod
    def _rows(shape: Sequence[int]) -> tuple[int, int]:
        if len(shape) == 0:
            return 1, 1
        d = int(shape[-1])
        return (numel_of(shape) // d if d else 0), d

    @staticmethod
    def cap(rows: int) -> int:
        """Most rows that may go apart."""
        return max(1, rows // 16)

    def payload_bytes(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> int:
        rows, d = self._rows(shape)
        return 4 + self.cap(rows) * (4 + 2 * d) + self.inner.payload_bytes((rows, d), dtype)

    def select(self, x2: torch.Tensor) -> torch.Tensor:
        """Ascending int64 indices of the outlier rows of ``x2`` [R, D]."""
        rows = x2.shape[0]
        sq = kernels.for_tensor(x2, self.backend).row_sumsq(x2) if x2.is_contiguous() else None
        if sq is None:
            sq = x2.float().square().sum(dim=1)
        if not bool(torch.isfinite(sq).all()):
            raise_non_finite(self.spec)
        if rows < 2:
            return torch.empty(0, dtype=torch.int64, device=x2.device)
        med = sq.median()  # the lower median of the squared norms: the same order as the norms'
        idx = torch.nonzero(sq > med * (self.factor * self.factor)).view(-1)
        cap = self.cap(rows)
        if idx.numel() > cap:
            idx = torch.topk(sq, cap).indices.sort().values
        return idx

    def _encode(self, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        rows, d = self._rows(x.shape)
        x2 = x.reshape(rows, d)
        idx = self.select(x2) if x2.numel() else torch.empty(0, dtype=torch.int64, device=x.device)
        k = idx.numel()
        if k:
            apart = x2.new_empty((k, d), dtype=torch.bfloat16)
            rest = (kernels.for_tensor(x2, self.backend).split_rows(x2, idx, apart.view(torch.int16))
                    if x2.is_contiguous() else None)  # one pass (the Triton backend's)
            if rest is None:
                keep = torch.ones(rows, dtype=torch.bool, device=x.device)
                keep[idx] = False
                rest = x2[keep]
                apart = x2.index_select(0, idx).to(torch.bfloat16).contiguous()
        else:
            rest, apart = x2, x2.new_empty((0, d), dtype=torch.bfloat16)
        inner = self.inner._encode(rest.contiguous(), generator)
        head = torch.tensor([k, *idx.tolist()], dtype=torch.int64).to(torch.int32).view(torch.uint8)
        return torch.cat([head.to(x.device), apart.view(-1).view(torch.uint8), inner])

    def _decode(self, packet: Packet) -> torch.Tensor:
        rows, d = self._rows(packet.shape)
        p = packet.payload
        later = defers_pending_checks(p.device)
        k = self._count_of_length(p.numel(), rows, d, packet.dtype) if later else None
        if k is not None:
            # A receiver on a GPU: the count that the payload's length implies, the count and indices it
            # announces checked on the device (pending, read at the caller's step end with the error the
            # immediate checks raise); meanwhile only indices inside the tensor are used.
            idx = bytes_as(p[: 4 + 4 * k], torch.int32).to(torch.int64)  # a copy: the payload may be reused
            announced, idx = idx[:1], idx[1:]
            nbytes, dtype = p.numel(), packet.dtype
            defer_pending_check(announced != k,
                                lambda: self._count_error(int(announced), nbytes, rows, d, dtype))
            if k:
                bad = (idx[1:] <= idx[:-1]).any() | (idx[0] < 0) | (idx[-1] >= rows)
                defer_pending_check(bad, lambda: self._indices_error(rows))
                idx = idx.clamp(0, rows - 1)
        else:  # at once: the count read on the host (a synchronisation on a GPU)
            if p.numel() < 4:
                raise PacketError(f"{self.spec}: payload of {p.numel()} bytes holds no outlier count")
            k = int(bytes_as(p[:4], torch.int32).item())
            error = self._count_error(k, p.numel(), rows, d, packet.dtype, inner=False)
            if error is not None:
                raise error
            idx = bytes_as(p[4 : 4 + 4 * k], torch.int32).to(torch.int64)
            if k and (bool((idx[1:] <= idx[:-1]).any()) or int(idx[0]) < 0 or int(idx[-1]) >= rows):
                raise self._indices_error(rows)
        off = 4 + 4 * k
        nrow = 2 * k * d
        apart = bytes_as(p[off : off + nrow], torch.bfloat16).view(k, d)
        inner = self.inner.decode(_inner_packet(self.inner, packet.dtype, (rows - k, d), p[off + nrow :]))
        if not k:
            return inner.view(packet.shape)
        idx = idx.to(inner.device)
        apart = apart.to(device=inner.device, dtype=inner.dtype)
        if k == rows:  # every row apart (one row in all)
            out = torch.empty((rows, d), dtype=inner.dtype, device=inner.device)
        else:
            # each row not apart takes the next row of the inner tensor, gathered by its rank among them
            # (a mask assignment, out[keep] = inner, would count the rows on the host); then the rows apart
            keep = torch.ones(rows, dtype=torch.int64, device=inner.device).index_fill_(0, idx, 0)
            rank = keep.cumsum_(0).sub_(1).clamp_(0, rows - k - 1)
            out = inner.view(rows - k, d).index_select(0, rank)
        out.index_copy_(0, idx, apart)
        return out.view(packet.shape)

    def _count_of_length(self, nbytes: int, rows: int, d: int, dtype: torch.dtype) -> int | None:
        """The one count of rows apart that a payload of ``nbytes`` can hold (the inner codec's size is fixed
        by its shape); None where no count or several give that length, or the inner size is not fixed."""
        return _counts_by_length(self, rows, d, dtype).get(nbytes) if self.inner.fixed_size else None

    def _count_error(self, k: int, nbytes: int, rows: int, d: int, dtype: torch.dtype, *,
                     inner: bool = True) -> PacketError | None:
        """The error of a payload of ``nbytes`` announcing ``k`` rows apart, as the checks of a decode make
        them in turn (``inner``: the inner codec's check of the size left for it too); None where none
        fails."""
        if not 0 <= k <= min(self.cap(rows), rows):
            return PacketError(f"{self.spec}: packet announces {k} outlier rows; at most {self.cap(rows)} of "
                               f"{rows} rows may go apart")
        if nbytes < 4 + 4 * k + 2 * k * d:
            return PacketError(f"{self.spec}: payload of {nbytes} bytes is too short for {k} outlier rows")
        if inner:
            rest = torch.empty(nbytes - 4 - 4 * k - 2 * k * d, dtype=torch.uint8)
            try:
                self.inner.check_packet(_inner_packet(self.inner, dtype, (rows - k, d), rest))
            except PacketError as e:
                return e
        return None

    def _indices_error(self, rows: int) -> PacketError:
        return PacketError(f"{self.spec}: outlier row indices must be ascending and below {rows}")


@functools.lru_cache(maxsize=256)
def _counts_by_length(codec: OutlierCodec, rows: int, d: int, dtype: torch.dtype) -> dict[int, int | None]:
    """Payload length -> the count of rows apart that gives it (None where several do), for ``codec`` (whose
    inner size is fixed) and a tensor of ``rows`` rows of ``d``: made once per shape, a lookup per decode."""
    out: dict[int, int | None] = {}
    for k in range(min(codec.cap(rows), rows) + 1):
        n = 4 + k * (4 + 2 * d) + codec.inner.payload_bytes((rows - k, d), dtype)
        out[n] = None if n in out else k
    return out


_local = threading.local()


def _zstd():
    try:
        import zstandard
    except ImportError as e:  # a base dependency; only a broken install gets here
        raise SpecError(f"the zstd entropy stage needs the zstandard package ({e}); pip install "
                        "zstandard") from None
    return zstandard


class EntropyCodec(Codec):
    """``<inner>:zstd[<level>]``: the inner payload through zstandard (lossless)."""

    family = Family.ENTROPY
    fixed_size = False
    LEVELS = range(1, 20)
    MODE = 1  # the payload's mode byte when the stage's output is sent (0: the inner payload as is)
    NAME = "zstd"

    def __init__(self, inner: Codec, level: int = 1) -> None:
        if not isinstance(level, int) or level not in self.LEVELS:
            raise SpecError(f"zstd level must be an integer in 1..19, got {level!r}")
        _zstd()
        self.inner, self.level = inner, level

    @property
    def spec(self) -> str:
        return f"{self.inner.spec}:zstd" + (f"{self.level}" if self.level != 1 else "")

    @property
    def lossless(self) -> bool:
        return self.inner.lossless

    def payload_bytes(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> int:
        return 1 + self.inner.payload_bytes(shape, dtype)

    def _ctx(self):
        ctx = getattr(_local, "ctx", None)
        if ctx is None:
            ctx = _local.ctx = {}
        key = self.level
        if key not in ctx:  # zstandard's contexts are not thread-safe: one per thread and level
            z = _zstd()
            ctx[key] = (z.ZstdCompressor(level=self.level, write_checksum=False),
                        z.ZstdDecompressor())
        return ctx[key]

    # the stage itself: bytes in, bytes out (the two methods a lossless stage overrides)
    def _squeeze(self, raw, shape: Sequence[int]) -> bytes | np.ndarray:
        """The stage's output (bytes or a uint8 numpy array) for the inner payload ``raw`` (a uint8 numpy
        array) of a tensor of ``shape``."""
        return self._ctx()[0].compress(memoryview(raw))

    def _expand(self, data, bound: int, shape: Sequence[int]) -> bytes | np.ndarray:
        """Inverse of :meth:`_squeeze` (bytes or a uint8 numpy array): at most ``bound`` bytes of inner
        payload; PacketError where corrupt."""
        try:
            return self._ctx()[1].decompress(memoryview(data), max_output_size=bound)
        except Exception as e:  # zstandard.ZstdError: a corrupt frame
            raise PacketError(f"{self.spec}: corrupt zstd frame ({e})") from None

    def _encode(self, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        return self._compress(self.inner._encode(x, generator), x.shape)

    def _compress(self, raw: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        host = raw.cpu()  # itself where it is on the CPU
        comp = self._squeeze(host.numpy(), shape) if host.numel() else b""
        if len(comp) < host.numel():
            out = torch.empty(1 + len(comp), dtype=torch.uint8)
            out[0] = self.MODE
            out[1:] = torch.from_numpy(comp) if isinstance(comp, np.ndarray) else \
                torch.frombuffer(bytearray(comp), dtype=torch.uint8)
        else:
            out = torch.cat([torch.zeros(1, dtype=torch.uint8), host])
        return out.to(raw.device)

    def _decode(self, packet: Packet) -> torch.Tensor:
        return self.inner.decode(self._inner(packet))

    @property
    def has_fused_delta(self) -> bool:  # type: ignore[override]
        return self.inner.has_fused_delta

    def encode_delta(self, x: torch.Tensor, store) -> Packet | None:
        inner = self.inner.encode_delta(x, store)
        if inner is None:
            return None
        return Packet(self.family, inner.dtype, inner.shape, self.fingerprint,
                      self._compress(inner.payload, x.shape), check=inner.check)

    def decode_delta(self, packet: Packet, store) -> torch.Tensor | None:
        self.check_packet(packet)
        if not kernels.on_host(packet.payload.device) or not self.inner.has_fused_delta:
            return None  # (before decompressing: the caller's decode() would decompress again)
        return self.inner.decode_delta(self._inner(packet), store)

    def _inner(self, packet: Packet) -> Packet:
        """The inner codec's packet inside ``packet`` (decompressed)."""
        p = packet.payload
        if p.numel() < 1:
            raise PacketError(f"{self.spec}: empty payload (no mode byte)")
        host = p.cpu()
        mode = int(host[0])
        bound = self.inner.payload_bytes(packet.shape, packet.dtype)
        if mode == 0:
            inner = host[1:]
        elif mode == self.MODE:
            data = self._expand(host[1:].numpy(), bound, packet.shape)
            if isinstance(data, np.ndarray):
                inner = torch.from_numpy(data)
            else:
                inner = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else host.new_empty(0)
        else:
            raise PacketError(f"{self.spec}: unknown entropy mode byte {mode} (0 = stored, {self.MODE} = "
                              f"{self.NAME})")
        if inner.numel() > bound:
            raise PacketError(f"{self.spec}: inner payload of {inner.numel()} bytes, at most {bound} allowed")
        return _inner_packet(self.inner, packet.dtype, packet.shape, inner.to(p.device))


class RansCodec(EntropyCodec):
    """``q<b>[...][:rot<G>]:rc``: the quantizer's codes through an order-0 rANS coder; its scales as they are.

    The codes are cut into symbols of ``b`` bits where ``b`` divides 8 (q1, q2, q4, q8), else into bytes, and
    coded (:mod:`aqsgd.compress.rans`) under the packet's own symbol frequencies, which the packet carries.
    That spends each symbol's empirical entropy, where zstd's Huffman stage spends whole bits per byte (on
    4-bit codes about 0.1 bit per value more). Payload after the mode byte (3): the scales as the quantizer
    wrote them, then the coder's output (its frequency table, 16 lanes' states and word counts, their 16-bit
    words).
    """

    MODE = 3
    NAME = "rANS coder"

    def __init__(self, inner: Codec) -> None:
        quant = inner.inner if isinstance(inner, RotatedCodec) else inner
        if not isinstance(quant, QuantCodec):
            raise SpecError(f"the rANS coder (:rc) codes a q<bits> quantizer's codes, not {inner.spec!r}")
        rans.available()
        self.inner, self._quant = inner, quant
        self.width = quant.bits if 8 % quant.bits == 0 else 8

    @property
    def spec(self) -> str:
        return f"{self.inner.spec}:rc"

    def _layout(self, shape: Sequence[int]) -> tuple[int, int]:
        """``(scale bytes, code bytes)`` of the inner payload of a tensor of ``shape``."""
        if isinstance(self.inner, RotatedCodec):
            n, tiles = self.inner._tiles(shape)
            shape = (tiles, self.inner.tile) if n else (0,)
        groups = self._quant._groups(shape)
        head = groups.nscales * self._quant.scale_dtype.itemsize
        return head, self._quant.payload_bytes(shape) - head

    def _squeeze(self, raw, shape: Sequence[int]) -> np.ndarray:
        head, _ = self._layout(shape)
        return np.concatenate([raw[:head], rans.encode(raw[head:], self.width)])

    def _expand(self, data, bound: int, shape: Sequence[int]) -> np.ndarray:
        head, nbody = self._layout(shape)
        if data.size < head:
            raise PacketError(f"{self.spec}: rANS-coded payload of {data.size} bytes is shorter than its "
                              f"{head} scale bytes")
        out = np.empty(head + nbody, dtype=np.uint8)
        out[:head] = data[:head]
        try:
            rans.decode(data[head:], self.width, nbody, out=out[head:])
        except PacketError as e:
            raise PacketError(f"{self.spec}: {e}") from None
        return out
