"""``<codec>:pca<r>[:tile<T>][:refresh<N>]``: a boundary's learned subspace in front of any codec.

Every tensor crossing a boundary is viewed as rows of its last dimension ``D`` (a token's hidden state, or
its gradient). Those rows are far from isotropic in a pretrained transformer: a few directions hold most of
their energy. The subspace stage sends the ``r`` coefficients ``c = z U^T`` of each row ``z`` in an
orthonormal basis ``U`` (``[r, D]``) instead of its ``D`` values, and the inner codec (a quantizer, rotated
tiles, the range coder, ...) compresses the coefficients ``[rows, r]``; the receiver computes ``c_hat U``.
At ``r = D/4`` a 4-bit quantizer sends one bit per value of ``z``.

``tile<T>``: the row is cut into ``D / T`` tiles of ``T`` consecutive values, each with a basis of its own
(``pca<r>``: ``r`` vectors a tile; ``pca/<k>``: ``ceil(T / k)``), a block-diagonal basis. Its products cost
``T / D`` of a dense basis's (the projection ``2 r T`` operations a row instead of ``2 r D`` at the same
number of coefficients, the sum ``z^T z`` ``2 T D`` instead of ``2 D^2``), for what a tile's basis cannot
hold: the directions that span tiles.

The basis is state of one boundary, one direction: a :class:`Subspace`, held by the boundary scheme on each
side (:mod:`aqsgd.schemes.base`). Only the sender estimates it, from the rows it sends:

* it sums ``z^T z`` over the rows of every message (``D x D``, float64);
* the first basis is the top ``r`` eigenvectors of that sum (``torch.linalg.eigh``), taken at the first
  compressed message (after the warm-up, which it observes: what crosses it in full);
* every ``N`` compressed messages after that (``refresh<N>``, default 32; ``refresh0``: never) the basis is
  refreshed from the rows of those ``N`` messages by two steps of subspace iteration started from the
  current basis (``Q, _ = qr(S U^T)``): it tracks the subspace as training moves it, at ``O(D^2 r)``
  rather than an eigendecomposition's ``O(D^3)``.

A new basis travels once, as a packet of its own ahead of the first message it encodes (:data:`BASIS_CODEC`:
8 bits a value and a scale per vector, ``r x (D + 2)`` bytes, counted in the traffic like every packet); both
sides then compute with the values it decodes to, so their reconstructions are bit-identical. Each basis has a
version, counted on both sides, that is part of the codec's fingerprint in every packet header: a receiver
holding another basis refuses the packet (:class:`~aqsgd.errors.PacketMismatchError`) instead of decoding it
wrongly.

What the subspace leaves out is not lost where the scheme carries an error forward:

* AQ-SGD (``delta``): the cache absorbs only what was sent (``m <- m + c_hat U``), so the part of
  ``x - m`` outside the basis stays in the next visit's delta. It is sent once the basis covers it, and the
  basis is re-estimated from those very deltas: a persistent residual gains energy in their sum until a
  refresh takes it in.
* ``ef`` / ``ef21``: the error (or estimate) is computed against the whole row, so the dropped part is
  added to the next message of its slot (sample), which the basis is refreshed from as well.
* ``direct`` drops it; use it for what tolerates a biased low-rank message.

Payload: the inner codec's payload for the coefficients ``[numel / D, r]``. The projection is a matrix
product (``torch.matmul``: BLAS on the CPU, cuBLAS on CUDA) on every backend; the inner codec computes with
the kernel backend as everywhere else, so the bytes are equal on every backend of a device.
"""

from __future__ import annotations

import copy
import zlib
from typing import Sequence

import torch

from aqsgd.compress.base import Codec, numel_of
from aqsgd.compress.packet import Family, Packet
from aqsgd.compress.quant import QuantCodec
from aqsgd.errors import CodecError, NonFiniteError, PacketMismatchError, SpecError

__all__ = ["SubspaceCodec", "Subspace", "DEFAULT_REFRESH"]

DEFAULT_REFRESH = 32  # compressed messages between two refreshes of the basis
# a basis on the wire: 8 bits a value with a scale per basis vector (about 1 % relative error per vector, a
# tenth of the coefficients' quantizer's at 4 bits: the sides compute with the decoded values, so it costs no
# consistency), half the bytes of fp16
BASIS_CODEC = QuantCodec(8, granularity="token")
_ITERATIONS = 2  # subspace iteration steps per refresh


class Subspace:
    """The basis of one boundary's direction, on one side (see the module's text).

    ``basis``: ``[r, D]`` float32 (with tiles: ``[(D / T) * r_T, T]``, tile by tile), the values
    :data:`BASIS_CODEC` decodes to, or None before the first; ``version``: how many bases there were. The
    sender's sum of ``z^T z`` (with tiles: one a tile, ``[D / T, T, T]``) and its message count since the last
    refresh are its own state (saved in checkpoints, for an exact resume). For reports, the sender records at
    each refresh ``captured``, the new basis's share of the energy of the rows it was estimated from, and
    ``held``, the share that the basis it replaces held of the rows it encoded (what the subspace kept of what
    was sent)."""

    def __init__(self, rank: int | None, refresh: int = DEFAULT_REFRESH, *,
                 divisor: int | None = None, tile: int | None = None) -> None:
        self.rank, self.divisor, self.refresh, self.tile = rank, divisor, refresh, tile
        self.name = f"pca{rank}" if rank is not None else f"pca/{divisor}"
        self.name += f":tile{tile}" if tile else ""
        self.basis: torch.Tensor | None = None
        self.version = 0
        self.spectrum: torch.Tensor | None = None  # eigenvalues of the first estimate, descending
        self.captured: list[float] = []  # each new basis: its share of the rows it was estimated from
        self.held: list[float] = []  # each basis replaced: its share of the rows it encoded meanwhile
        self._sum: torch.Tensor | None = None
        self._messages = 0
        self._unsent: Packet | None = None
        self.learning = False  # set by the scheme: whether the message now encoded is training's

    @property
    def empty(self) -> bool:
        """Whether no row was observed since the last basis (or ever)."""
        return self._sum is None or self._messages == 0

    @property
    def key(self) -> tuple[int | None, int | None, int, int | None]:
        return self.rank, self.divisor, self.refresh, self.tile

    def rank_for(self, d: int) -> int:
        return _rank_for(self.rank, self.divisor, d, self.tile)

    def width(self) -> int | None:
        """The row width ``D`` of the basis held (None before the first)."""
        if self.basis is None:
            return None
        if self.tile is None:
            return int(self.basis.shape[1])
        return self.basis.shape[0] // _rank_for(self.rank, self.divisor, self.tile) * self.tile

    # -- the sender ------------------------------------------------------------------------------------
    def observe(self, z: torch.Tensor) -> None:
        """Add the rows of ``z`` (``[..., D]``) to the sum the next basis is estimated from."""
        d = z.shape[-1]
        if self.basis is not None and d != self.width():
            raise CodecError(f"{self.name}: rows of {d} values, the basis has {self.width()}")
        _tiles_of(d, self.tile, self.name)
        z2 = z.detach().reshape(-1, d).to(torch.float32)
        if self.tile is None:
            if self._sum is None:
                self._sum = torch.zeros((d, d), dtype=torch.float64, device=z2.device)
            elif self._sum.shape[0] != d:
                raise CodecError(f"{self.name}: rows of {d} values after rows of {self._sum.shape[0]}")
            self._sum += (z2.T @ z2).to(torch.float64)
        else:  # one sum a tile: [D / T, T, T]
            t = self.tile
            if self._sum is None:
                self._sum = torch.zeros((d // t, t, t), dtype=torch.float64, device=z2.device)
            elif self._sum.shape[0] * t != d:
                raise CodecError(f"{self.name}: rows of {d} values after rows of {self._sum.shape[0] * t}")
            z3 = z2.view(-1, d // t, t).transpose(0, 1)  # [tiles, rows, T]
            self._sum += torch.bmm(z3.transpose(1, 2), z3).to(torch.float64)
        self._messages += 1

    def due(self) -> bool:
        """Whether the next compressed message needs a new basis first."""
        return self.basis is None or (self.refresh > 0 and self._messages >= self.refresh)

    def renew(self) -> None:
        """Estimate a new basis from the rows observed since the last one, and queue it to be sent."""
        if self._sum is None:
            raise CodecError(f"{self.name}: no rows observed to estimate a basis from")
        s = self._sum
        if not bool(torch.isfinite(s).all()):
            raise NonFiniteError(f"{self.name}: the rows observed hold NaN or Inf; no basis estimated")
        if self.tile is not None:
            u = self._renew_tiles(s)
        else:
            u = self._renew_dense(s)
        packet = BASIS_CODEC.encode(u.to(torch.float32))
        self.basis = BASIS_CODEC.decode(packet)  # what the receiver will hold
        self.version += 1
        self._unsent = packet
        self._sum.zero_()
        self._messages = 0

    def _renew_dense(self, s: torch.Tensor) -> torch.Tensor:
        d = s.shape[0]
        r = self.rank_for(d)
        s = (s + s.T) * 0.5
        trace = float(torch.diagonal(s).sum())
        if self.basis is not None and trace > 0:  # what the basis in use held of the rows it encoded
            old = self.basis.to(s.device, torch.float64)
            self.held.append(float(torch.einsum("rd,de,re->", old, s, old)) / trace)
        if self.basis is None:
            values, vectors = torch.linalg.eigh(s)  # ascending
            self.spectrum = values.flip(0).clamp_min(0).to(torch.float32).cpu()
            u = vectors[:, -r:].flip(1)  # [D, r], descending energy
        else:
            u = self.basis.to(torch.float64).T
            for _ in range(_ITERATIONS):
                u, _r = torch.linalg.qr(s @ u)
        u = _fix_signs(u.T)  # [r, D]
        held = float(torch.einsum("rd,de,re->", u, s, u))
        self.captured.append(held / trace if trace > 0 else 1.0)
        return u

    def _renew_tiles(self, s: torch.Tensor) -> torch.Tensor:
        """:meth:`renew` tile by tile (``s``: ``[tiles, T, T]``): the basis ``[tiles * r_T, T]``."""
        tiles, t = s.shape[0], s.shape[1]
        r = _rank_for(self.rank, self.divisor, t)
        s = (s + s.transpose(1, 2)) * 0.5
        trace = float(torch.diagonal(s, dim1=1, dim2=2).sum())
        if self.basis is not None and trace > 0:
            old = self.basis.to(s.device, torch.float64).view(tiles, r, t)
            self.held.append(float(torch.einsum("nrd,nde,nre->", old, s, old)) / trace)
        if self.basis is None:
            values, vectors = torch.linalg.eigh(s)  # ascending, per tile
            every = values.reshape(-1).sort(descending=True).values  # the tiles' eigenvalues together
            self.spectrum = every.clamp_min(0).to(torch.float32).cpu()
            u = vectors[:, :, -r:].flip(2)  # [tiles, T, r]
        else:
            u = self.basis.to(torch.float64).view(tiles, r, t).transpose(1, 2)
            for _ in range(_ITERATIONS):
                u, _r = torch.linalg.qr(torch.bmm(s, u))
        u = _fix_signs(u.transpose(1, 2).reshape(tiles * r, t))  # [tiles * r, T]
        held = float(torch.einsum("nrd,nde,nre->", u.view(tiles, r, t), s, u.view(tiles, r, t)))
        self.captured.append(held / trace if trace > 0 else 1.0)
        return u

    def take_unsent(self) -> Packet | None:
        """The packet of the basis estimated since the last call (to be sent ahead of the message it
        encodes), or None."""
        packet, self._unsent = self._unsent, None
        return packet

    # -- the receiver ------------------------------------------------------------------------------------
    def install(self, packet: Packet) -> None:
        """Take the basis the sender sent (a :data:`BASIS_CODEC` packet of ``[r, D]``)."""
        shape = packet.shape
        if self.tile is None:
            good = len(shape) == 2 and shape[1] and shape[0] == self.rank_for(shape[1])
        else:
            r = _rank_for(self.rank, self.divisor, self.tile)
            good = len(shape) == 2 and shape[1] == self.tile and shape[0] and shape[0] % r == 0
        if not good:
            raise PacketMismatchError(f"{self.name}: received a basis of shape {tuple(shape)}")
        self.basis = BASIS_CODEC.decode(packet)
        self.version += 1

    # -- checkpoints ---------------------------------------------------------------------------------------
    def mirrored(self) -> dict[str, torch.Tensor]:
        """What both sides hold identically: the basis and its version."""
        if self.basis is None:
            return {"version": torch.tensor([self.version], dtype=torch.int64)}
        return {"basis": self.basis.cpu(), "version": torch.tensor([self.version], dtype=torch.int64)}

    def own(self) -> dict[str, torch.Tensor]:
        """The sender's estimate in progress (empty on a receiver, or before anything was observed)."""
        if self._sum is None:
            return {}
        out = {"sum": self._sum.cpu(), "messages": torch.tensor([self._messages], dtype=torch.int64)}
        if self.spectrum is not None:
            out["spectrum"] = self.spectrum
        if self.captured:
            out["captured"] = torch.tensor(self.captured, dtype=torch.float64)
        if self.held:
            out["held"] = torch.tensor(self.held, dtype=torch.float64)
        return out

    def load(self, mirrored: dict[str, torch.Tensor], own: dict[str, torch.Tensor],
             device: torch.device) -> None:
        self.version = int(mirrored["version"][0])
        self.basis = mirrored["basis"].to(device, torch.float32) if "basis" in mirrored else None
        self._unsent = None
        if "sum" in own:
            self._sum = own["sum"].to(device, torch.float64)
            self._messages = int(own["messages"][0])
        self.spectrum = own.get("spectrum")
        self.captured = own["captured"].tolist() if "captured" in own else []
        self.held = own["held"].tolist() if "held" in own else []


def _rank_for(rank: int | None, divisor: int | None, d: int, tile: int | None = None) -> int:
    """The number of coefficients of a row of ``d`` values: ``rank``, or ``ceil(d / divisor)``;
    :class:`CodecError` above ``d``. With ``tile``: that of each tile, times the tiles."""
    if tile is not None:
        tiles = _tiles_of(d, tile, f"pca{rank}" if rank is not None else f"pca/{divisor}")
        return tiles * _rank_for(rank, divisor, tile)
    r = rank if rank is not None else -(-d // divisor)  # type: ignore[operator]
    if r > d:
        name = f"pca{rank}" if rank is not None else f"pca/{divisor}"
        raise CodecError(f"{name}: rank {r} above the {d} values of a row")
    return r


def _tiles_of(d: int, tile: int | None, name: str) -> int:
    """How many tiles of ``tile`` values a row of ``d`` has; :class:`CodecError` where they do not divide
    it."""
    if tile is None:
        return 1
    if d % tile:
        raise CodecError(f"{name}:tile{tile}: rows of {d} values are not a whole number of tiles of {tile}")
    return d // tile


def _fix_signs(u: torch.Tensor) -> torch.Tensor:
    """Each basis vector's sign chosen so that its largest entry is positive (eigenvectors' signs are
    arbitrary; a fixed rule keeps consecutive bases comparable)."""
    idx = u.abs().argmax(dim=1, keepdim=True)
    return u * torch.sign(u.gather(1, idx)).where(u.gather(1, idx) != 0, torch.ones_like(u[:, :1]))


class SubspaceCodec(Codec):
    """``<inner>:pca<r>[:tile<T>][:refresh<N>]``: coefficients in a boundary's basis, compressed by ``inner``.

    As built from its spec, it describes the stage (rank, refresh, inner codec); a boundary scheme binds it
    to its :class:`Subspace` (:meth:`bound`), which it needs to encode or decode."""

    family = Family.SUBSPACE

    def __init__(self, inner: Codec, rank: int | None, refresh: int = DEFAULT_REFRESH, *,
                 divisor: int | None = None, tile: int | None = None) -> None:
        if (rank is None) == (divisor is None):
            raise SpecError("a subspace takes a rank or a divisor of the row's width, one of them")
        if rank is not None and (not isinstance(rank, int) or rank < 1):
            raise SpecError(f"the subspace rank must be a positive integer, got {rank!r}")
        if divisor is not None and (not isinstance(divisor, int) or divisor < 1):
            raise SpecError(f"the divisor of pca/<k> must be a positive integer, got {divisor!r}")
        if not isinstance(refresh, int) or refresh < 0:
            raise SpecError(f"the refresh interval must be a non-negative integer (0: never), got "
                            f"{refresh!r}")
        if tile is not None and (not isinstance(tile, int) or tile < 1):
            raise SpecError(f"the tile of pca<r>:tile<T> must be a positive integer, got {tile!r}")
        if tile is not None:
            try:
                _rank_for(rank, divisor, tile)
            except CodecError as e:
                raise SpecError(f"{e} (tile{tile})") from None
        if isinstance(inner, SubspaceCodec):
            raise SpecError("pca<r> given twice")
        self.inner, self.rank, self.divisor, self.refresh, self.tile = inner, rank, divisor, refresh, tile
        self.fixed_size = inner.fixed_size  # type: ignore[misc]
        self.state: Subspace | None = None

    @property
    def spec(self) -> str:
        spec = f"{self.inner.spec}:" + (f"pca{self.rank}" if self.rank is not None else f"pca/{self.divisor}")
        spec += f":tile{self.tile}" if self.tile is not None else ""
        return spec if self.refresh == DEFAULT_REFRESH else f"{spec}:refresh{self.refresh}"

    @property
    def fingerprint(self) -> int:
        """The spec's CRC-32 and the basis version: a packet names the basis it was encoded in."""
        version = self.state.version if self.state is not None else 0
        return zlib.crc32(f"{self.spec}#basis{version}".encode())

    def bound(self, state: Subspace) -> SubspaceCodec:
        """This codec computing with ``state``'s basis (a copy; this one is unchanged)."""
        if state.key != self.key:
            raise SpecError(f"{self.spec}: a subspace of another rank or refresh ({state.name}, refresh "
                            f"{state.refresh})")
        clone = copy.copy(self)
        clone.state = state
        return clone

    @property
    def key(self) -> tuple[int | None, int | None, int, int | None]:
        return self.rank, self.divisor, self.refresh, self.tile

    def new_state(self) -> Subspace:
        return Subspace(self.rank, self.refresh, divisor=self.divisor, tile=self.tile)

    def rank_for(self, d: int) -> int:
        return _rank_for(self.rank, self.divisor, d, self.tile)

    def _rows(self, shape: Sequence[int]) -> tuple[int, int]:
        if len(shape) == 0:
            raise CodecError(f"{self.spec}: a tensor with a last dimension (rows of values), not a scalar")
        d = int(shape[-1])
        return (numel_of(shape) // d if d else 0), d

    def payload_bytes(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> int:
        rows, d = self._rows(shape)
        return self.inner.payload_bytes((rows, self.rank_for(d) if d else 0), torch.float32)

    def _basis(self, d: int, device: torch.device) -> torch.Tensor:
        state = self.state
        if state is None:
            raise CodecError(f"{self.spec}: a subspace codec encodes and decodes at a boundary, with the "
                             "basis its scheme holds")
        if state.basis is None:
            raise CodecError(f"{self.spec}: no basis yet")
        u = state.basis
        if state.width() != d:
            raise CodecError(f"{self.spec}: rows of {d} values, the basis has {state.width()}")
        if u.device != device:
            u = state.basis = u.to(device)
        return u

    def _encode(self, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        rows, d = self._rows(x.shape)
        state = self.state
        observed = False
        if state is not None and (state.basis is None or (state.learning and state.due())):
            if state.empty:  # nothing observed yet (no warm-up): the first basis is this message's own
                state.observe(x)
                observed = True
            state.renew()
        r = self.rank_for(d)
        if rows == 0:
            payload = self.inner._encode(x.new_zeros((0, r), dtype=torch.float32), generator)
        else:
            u = self._basis(d, x.device)
            z = x.reshape(rows, d).to(torch.float32)
            if self.tile is None:
                c = z @ u.T
            else:  # tile by tile, the rows' coefficients tile-major
                t = self.tile
                c = torch.einsum("ntd,trd->ntr", z.view(rows, d // t, t), u.view(d // t, -1, t))
                c = c.reshape(rows, r)
            payload = self.inner._encode(c.contiguous(), generator)
        if state is not None and state.learning and not observed:  # after the encode: a refused input adds
            # nothing
            state.observe(x)
        return payload

    def _decode(self, packet: Packet) -> torch.Tensor:
        rows, d = self._rows(packet.shape)
        if rows == 0:
            return torch.zeros(packet.shape, dtype=packet.dtype, device=packet.payload.device)
        u = self._basis(d, packet.payload.device)
        c = self.inner._decode(Packet(self.inner.family, torch.float32, (rows, u.shape[0]),
                                      self.inner.fingerprint, packet.payload)).to(torch.float32)
        if self.tile is None:
            out = (c @ u).view(packet.shape)
        else:
            t = self.tile
            out = torch.einsum("ntr,trd->ntd", c.view(rows, d // t, -1), u.view(d // t, -1, t))
            out = out.reshape(packet.shape)
        return out if packet.dtype == torch.float32 else out.to(packet.dtype)

    def check_packet(self, packet: Packet) -> None:
        if (packet.family == self.family and packet.fingerprint != self.fingerprint
                and self.state is not None):
            raise PacketMismatchError(
                f"{self.spec}: packet encoded in another basis than this receiver's (version "
                f"{self.state.version}): sender and receiver bases are out of step")
        super().check_packet(packet)
