"""TAH-Quant (He, Cao, He, Bai, Chen, Yuan, Yuan, 2025, "TAH-Quant: Effective Activation Quantization in
Pipeline Parallelism over Slow Network", arXiv 2506.01352) as a codec of its own.

Spec: ``tah`` (the forward scheme, tile 64) or ``tah<b>`` (``b`` in 2..8: the backward scheme at ``b`` bits,
tile 32; ``tah6`` is the paper's backward setting), with ``:tile<G>`` (``G`` a power of two in 2..256) when
the tile differs from that default. Both are fixed-size: the packet length follows from the shape alone.

Forward scheme (``tah``)
    The input is viewed as tokens (every dim but the last) of ``C`` channels, the tokens as sequences of ``S``
    (dim -2; a 1-D input is one token, a 0-D input one value) and each token as tiles of ``G`` consecutive
    channels.

    1. Bit allocation per token. Each token's entropy ``H = -sum p log p`` of ``p = |x| / ||x||_1`` (over
       all its ``C`` channels) is computed; in every sequence the ``L = S // 5`` tokens of lowest entropy
       (ties: the earlier token) get 3 bits, the others 4. ``L`` depends on the shape only, so the size is
       exact.
    2. Pivot swap and Hadamard, per tile. A tile whose largest ``|x|`` is at least twice its second largest
       (and nonzero) is *transformed*: its largest-magnitude entry is swapped with entry 0, then the tile is
       multiplied by ``H_G / sqrt(G)`` (plain Sylvester-Hadamard, no random signs). Row 0 of ``H_G`` is all
       ones, so the outlier, now at index 0, adds the same ``x_0 / sqrt(G)`` to every output: a constant
       shift that the asymmetric zero point below absorbs at no cost, while the other entries are spread
       evenly. Other tiles are quantized as they are.
    3. Asymmetric min/max quantization per tile at the token's ``b`` bits: zero point ``z = min`` (stored in
       fp16, rounded down), scale ``s = (max - z) / (2**b - 1)`` (stored in fp16, rounded up, so nothing is
       clipped), codes ``round((x - z) / s)`` in ``[0, 2**b - 1]``, decoded as ``code * s + z``. Codes are
       computed from the stored fp16 values, so the decoder sees exactly what the encoder rounded against.

    When ``C`` is not a multiple of ``G`` each token is padded to ``ceil(C / G) * G`` channels with one
    value repeated: ``clamp(0, lo, hi)``, ``lo``/``hi`` the last tile's real min and max, so the padding
    never widens that tile's range nor becomes its pivot (the pad's magnitude is the tile's smallest). The
    padded codes are sent and dropped on decode.

Backward scheme (``tah<b>``): "fixpoint"
    TAH-Quant quantizes the gradients of the backward pass with the fixed-point quantizer of the AQ-SGD
    code base it builds on: symmetric, scale ``s = max |x|`` of the group (fp16, rounded up here), code
    ``k = clamp(round(x / s * 2**(b-1)), -2**(b-1), 2**(b-1) - 1)``, decoded as ``k * s / 2**(b-1)``: a
    ``b``-bit two's-complement fraction of the scale. All ``2**b`` codes are used, the grid holds zero, and
    the positive extreme is one step short of ``+s`` (a value at ``+s`` is clipped by one step,
    ``s / 2**(b-1)``). No zero point, no pivot swap, no Hadamard. Groups are tiles of ``G`` channels of each
    token (padded with zeros, which never change a max-abs scale).

Payload (little-endian, regions back to back, no padding between them; ``R`` tokens, ``T = ceil(C / G)``
tiles per token, ``n = R * T`` tiles, ``B = R / S`` sequences)

    ``tah``: ``n`` fp16 zero points, ``n`` fp16 scales, the token map (``R`` bits, bit set = 3-bit token,
    natural token order), the tile flags (``n`` bits, bit set = transformed), the pivot indices (``n``
    fields of ``log2 G`` bits, the original position of the swapped outlier; 0 for tiles not transformed),
    the 3-bit codes (``B * L * T * G`` values), then the 4-bit codes (``B * (S - L) * T * G`` values).
    Zero points, scales, flags, pivots and codes are in *wire order*: first the 3-bit tokens of sequence 0,
    1, ... (each sequence's in ascending position), then the 4-bit tokens in the same way; the token map
    tells the receiver where each goes. Bit fields are packed as :mod:`aqsgd.compress.bitpack` does (LSB
    first), each region starting on a byte. Total ``4 n + ceil(R/8) + ceil(n/8) + ceil(n log2 G / 8) +
    ceil(3 B L T G / 8) + ceil(4 B (S-L) T G / 8)`` bytes. About 3.8 code bits per value plus
    ``(32 + 1 + log2 G) / G`` of side data (0.61 at G = 64): 4.4 bits per value.

    ``tah<b>``: ``n`` fp16 scales, then the ``R * T * G`` codes of ``b`` bits in natural order:
    ``2 n + ceil(b R T G / 8)`` bytes (6.5 bits per value for ``tah6`` at G = 32).

Where we follow the paper's public code (github.com/heguangxin/TAH-Quant) and where we depart
    * Tile: the paper's text uses 32; its code and run script use 64 for the forward and pass 32 for the
      backward. We default to 64 (``tah``) and 32 (``tah<b>``).
    * The pivot swap comes before the Hadamard, and only tiles that pass the 2x test are swapped *and*
      transformed (a per-tile flag); other tiles get neither. The code sends the flags as a bitmap and the
      pivot indices only for flagged tiles (a data-dependent size); we send an index field for every tile
      (0 where unflagged) so the size is exact, at ``log2 G / G`` bits per value (0.09 at G = 64).
    * Entropy: per token over its whole hidden dim, as in the code and the first version of the paper; the
      paper's second version (2026) allocates per tile instead (ambiguous; we follow the code). Lowest
      entropy gets the *lower* width, 20% per sequence, as in the code (which computes the count as
      ``int(S * (1 - 0.8))``, one fewer than ``S // 5`` when the float product falls just short; we use the
      exact ``S // 5``).
    * Zero point and scale are fp16 as in the code, but rounded down/up (the code rounds to nearest and
      rounds against unrounded values) and the codes are computed against the stored values.
    * Backward: the code's "fixpoint" compressor (AQ-SGD's) takes one scale per channel over the whole
      micro-batch (scale dims (0, 1)); the tile size it is handed is not used by that compressor as
      published (TAH-Quant's copy of that module is only in compiled form). We follow the paper's
      "tile 32": one scale per tile of 32 channels of each token. Nearest rounding as in the code.
    * Magnitudes beyond fp16 (a zero point or scale above 65504) raise :class:`NonFiniteError`, as an fp16
      cast does, where the code would send infinities.

NaN/Inf input raises :class:`NonFiniteError` (detected from the per-tile statistics, no extra pass). A
packet with non-finite or negative scales, non-finite zero points, a token map that does not mark exactly
``S // 5`` tokens in every sequence, or a pivot index on an untransformed tile raises :class:`PacketError`.
Encoding and decoding are whole-tensor PyTorch operations (CPU or CUDA) computed in fp32. On a GPU neither
waits for the device: the encode's checks are deferred and the decode's pending (see
:func:`aqsgd.compress.base.deferring_checks`), and the pivot swap and Hadamard run on every tile, the
flagged tiles' results kept (picking those tiles out would count them on the host): the same bits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from aqsgd.compress.base import (
    Codec,
    defer_check,
    defer_pending_check,
    defers_checks,
    defers_pending_checks,
    non_finite_message,
    numel_of,
    raise_non_finite,
)
from aqsgd.compress.bitpack import pack_bits, packed_nbytes, unpack_bits
from aqsgd.compress.hadamard import _fwht_torch
from aqsgd.compress.packet import Family, Packet, bytes_as
from aqsgd.errors import NonFiniteError, PacketError, SpecError

__all__ = ["BACKWARD_TILE", "FORWARD_TILE", "HIGH_BITS", "LOW_BITS", "TahQuantCodec", "low_tokens"]

FORWARD_TILE = 64
BACKWARD_TILE = 32
LOW_BITS = 3
HIGH_BITS = 4
TILE_MIN = 2
TILE_MAX = 256  # pivot indices are packed in at most 8 bits
_INF = math.inf


def low_tokens(seq_len: int) -> int:
    """Tokens per sequence of ``seq_len`` that the forward scheme sends at 3 bits: the lowest 20%."""
    return seq_len // 5


class _Geometry(NamedTuple):
    numel: int
    rows: int  # tokens R
    cols: int  # channels C
    seq: int  # tokens per sequence S
    batch: int  # sequences B
    low: int  # 3-bit tokens per sequence L
    tiles: int  # tiles per token T
    padded: int  # T * G


def _fp16_up(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> the smallest fp16 value >= v (inf beyond 65504, NaN stays NaN)."""
    h = v.to(torch.float16)
    return torch.where(h.float() < v, torch.nextafter(h, _filled(h, _INF)), h)


def _fp16_down(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> the largest fp16 value <= v (-inf below -65504, NaN stays NaN)."""
    h = v.to(torch.float16)
    return torch.where(h.float() > v, torch.nextafter(h, _filled(h, -_INF)), h)


def _filled(t: torch.Tensor, value: float) -> torch.Tensor:
    """``value`` as a 0-d tensor of ``t``'s dtype, filled on its device (``new_tensor`` copies it from the
    host: a synchronisation on CUDA)."""
    return torch.full((), value, dtype=t.dtype, device=t.device)


def _swap_pivot(t: torch.Tensor, piv: torch.Tensor) -> None:
    """In place: swap entry 0 and entry ``piv[i]`` of each row ``i`` of ``t`` (an involution)."""
    col = piv.view(-1, 1)
    first = t[:, :1].clone()
    t[:, :1] = t.gather(1, col)
    t.scatter_(1, col, first)


class TahQuantCodec(Codec):
    """``tah[:tile<G>]`` (forward, 3/4 bits per token by entropy) or ``tah<b>[:tile<G>]`` (backward
    fixpoint)."""

    family = Family.TAH

    def __init__(self, bits: int | None = None, *, tile: int | None = None) -> None:
        if bits is not None and (isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 8):
            raise SpecError(f"TAH-Quant bits must be an integer in 2..8 (or none for the 3/4-bit forward "
                            f"scheme), got {bits!r}")
        self._default_tile = FORWARD_TILE if bits is None else BACKWARD_TILE
        if tile is None:
            tile = self._default_tile
        if (isinstance(tile, bool) or not isinstance(tile, int) or not TILE_MIN <= tile <= TILE_MAX
                or tile & (tile - 1)):
            raise SpecError(f"TAH-Quant tile must be a power of two in {TILE_MIN}..{TILE_MAX}, got {tile!r}")
        self.bits = bits
        self.tile = tile
        self.pivot_bits = tile.bit_length() - 1

    @property
    def spec(self) -> str:
        head = "tah" if self.bits is None else f"tah{self.bits}"
        return head if self.tile == self._default_tile else f"{head}:tile{self.tile}"

    # -- sizes -------------------------------------------------------------------------------------
    def _geometry(self, shape: Sequence[int]) -> _Geometry:
        numel = numel_of(shape)
        cols = int(shape[-1]) if len(shape) else 1
        seq = int(shape[-2]) if len(shape) >= 2 else 1
        if numel == 0:
            return _Geometry(0, 0, cols, seq, 0, 0, 0, 0)
        rows = numel // cols
        tiles = -(-cols // self.tile)
        return _Geometry(numel, rows, cols, seq, rows // seq, low_tokens(seq), tiles, tiles * self.tile)

    def _regions(self, g: _Geometry) -> list[int]:
        """Byte sizes of the payload's regions, in order."""
        n = g.rows * g.tiles
        if self.bits is not None:
            return [2 * n, packed_nbytes(g.rows * g.padded, self.bits)]
        nlow = g.batch * g.low * g.padded
        return [2 * n, 2 * n, packed_nbytes(g.rows, 1), packed_nbytes(n, 1),
                packed_nbytes(n, self.pivot_bits), packed_nbytes(nlow, LOW_BITS),
                packed_nbytes(g.rows * g.padded - nlow, HIGH_BITS)]

    def payload_bytes(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> int:
        g = self._geometry(shape)
        return 0 if g.numel == 0 else sum(self._regions(g))

    # -- shared pieces -----------------------------------------------------------------------------
    def _tiles_of(self, x2: torch.Tensor, g: _Geometry, edge: bool, owned: bool = False) -> torch.Tensor:
        """``x2`` [R, C] as an fp32 [R * T, G] tensor that may be changed in place (a copy unless ``owned``),
        each token padded to ``T * G`` channels."""
        pad = g.padded - g.cols
        if pad == 0:
            if x2.dtype != torch.float32:
                return x2.reshape(-1, self.tile).float()
            return x2.reshape(-1, self.tile) if owned else x2.reshape(-1, self.tile).clone()
        out = x2.new_zeros((g.rows, g.padded), dtype=torch.float32)
        out[:, : g.cols] = x2
        if edge:  # clamp(0, lo, hi) of the last tile's real values: inside its range, never its pivot
            last = out[:, (g.tiles - 1) * self.tile : g.cols]
            fill = torch.minimum(torch.maximum(last.new_zeros(()), last.amin(1)), last.amax(1))
            out[:, g.cols :] = fill.view(-1, 1)
        return out.view(-1, self.tile)

    def _check_stats(self, x: torch.Tensor, *stats: torch.Tensor) -> None:
        """Raise NonFiniteError unless every stored zero point/scale is finite (one host sync), or, where the
        encode defers its checks (on a GPU), record the same two tests as device flags: NaN/Inf in ``x``
        first (they make a statistic non-finite too), then a statistic beyond fp16."""
        ok = torch.stack([torch.isfinite(s).all() for s in stats]).all()
        if defers_checks(x.device):
            defer_check(~torch.isfinite(x.abs().amax()), non_finite_message(self.spec))
            defer_check(~ok, self._range_message())
        elif not bool(ok):
            if bool(torch.isfinite(x).all()):
                raise NonFiniteError(self._range_message())
            raise_non_finite(self.spec)

    def _range_message(self) -> str:
        return f"{self.spec}: magnitudes beyond the fp16 range (65504) of the tile zero points and scales"

    def _hadamard(self, t: torch.Tensor, flag: torch.Tensor, piv: torch.Tensor, inverse: bool,
                  every_row: bool = False) -> None:
        """In place on the flagged rows of ``t``: pivot swap then Hadamard, or (inverse) Hadamard then
        swap. ``every_row``: transform every row and keep the flagged ones' results (the same bits: each row
        is transformed on its own), where picking the flagged rows out would count them on the host (a
        synchronisation on a GPU)."""
        if every_row:
            sub = t.clone()
            if not inverse:
                _swap_pivot(sub, piv)
            sub = _fwht_torch(sub, self.tile).mul_(1.0 / math.sqrt(self.tile))
            if inverse:
                _swap_pivot(sub, piv)
            torch.where(flag.view(-1, 1), sub, t, out=t)
            return
        sel = flag.nonzero().view(-1)
        if sel.numel() == 0:
            return
        sub = t.index_select(0, sel)
        p = piv.index_select(0, sel)
        if not inverse:
            _swap_pivot(sub, p)
        sub = _fwht_torch(sub, self.tile).mul_(1.0 / math.sqrt(self.tile))  # H H = G I: its own inverse
        if inverse:
            _swap_pivot(sub, p)
        t.index_copy_(0, sel, sub)

    def _wire_rows(self, low_mask: torch.Tensor, g: _Geometry) -> torch.Tensor:
        """Natural row index of each wire position, from the [B, S] mask of 3-bit tokens."""
        # stable sort of (not low): each sequence's low tokens first, then its high ones, both ascending
        order = torch.argsort((~low_mask).to(torch.uint8), dim=1, stable=True)
        base = (torch.arange(g.batch, device=low_mask.device) * g.seq).view(-1, 1)
        order = order + base
        return torch.cat([order[:, : g.low].reshape(-1), order[:, g.low :].reshape(-1)])

    # -- encode ------------------------------------------------------------------------------------
    def _encode(self, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        g = self._geometry(x.shape)
        if g.numel == 0:
            return torch.empty(0, dtype=torch.uint8, device=x.device)
        x2 = x.reshape(g.rows, g.cols)
        if self.bits is not None:
            return self._encode_fixpoint(x, x2, g)
        return self._encode_forward(x, x2.float(), g)

    def _encode_fixpoint(self, x: torch.Tensor, x2: torch.Tensor, g: _Geometry) -> torch.Tensor:
        t = self._tiles_of(x2, g, edge=False)
        s16 = _fp16_up(t.abs().amax(1))
        self._check_stats(x, s16)
        half = 2 ** (self.bits - 1)
        s = s16.float().view(-1, 1)
        # a zero scale means an all-zero tile: divide by 1 instead, every code is then the zero level
        k = t.div_(torch.where(s > 0, s, 1.0)).mul_(half).round_().clamp_(-half, half - 1).add_(half)
        codes = pack_bits(k.to(torch.uint8).view(-1), self.bits)
        return torch.cat([s16.view(torch.uint8), codes])

    def _encode_forward(self, x: torch.Tensor, x2: torch.Tensor, g: _Geometry) -> torch.Tensor:
        dev = x2.device
        # 1. entropy of |x| / ||x||_1 per token; the L lowest of every sequence go at 3 bits
        a = x2.abs()
        p = a / a.sum(1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        ent = torch.special.xlogy(p, p).sum(1).neg_().view(g.batch, g.seq)
        del a, p
        lowest = torch.argsort(ent, dim=1, stable=True)[:, : g.low]
        low_mask = torch.zeros((g.batch, g.seq), dtype=torch.bool, device=dev)
        low_mask.scatter_(1, lowest, True)
        wire = self._wire_rows(low_mask, g)
        # 2. pivot swap + Hadamard on the tiles whose largest |x| is at least twice the second largest
        t = self._tiles_of(x2.index_select(0, wire), g, edge=True, owned=True)
        top = t.abs().topk(2, dim=1)
        big, second = top.values[:, 0], top.values[:, 1]
        flag = (big >= 2 * second) & (big > 0)
        piv = torch.where(flag, top.indices[:, 0], 0)
        self._hadamard(t, flag, piv, inverse=False, every_row=defers_checks(dev))
        # 3. asymmetric min/max per tile at the token's width
        nlow_tiles = g.batch * g.low * g.tiles
        qmax = torch.full((t.shape[0],), float(2**HIGH_BITS - 1), device=dev)
        qmax[:nlow_tiles] = 2**LOW_BITS - 1
        z16 = _fp16_down(t.amin(1))
        s16 = _fp16_up((t.amax(1) - z16.float()) / qmax)
        self._check_stats(x, z16, s16)
        s = s16.float().view(-1, 1)
        # s == 0 only for a constant tile (max == z): every code is then 0
        k = t.sub_(z16.float().view(-1, 1)).div_(torch.where(s > 0, s, 1.0)).round_()
        k = torch.minimum(k.clamp_(min=0), qmax.view(-1, 1)).to(torch.uint8).view(-1)
        split = nlow_tiles * self.tile
        return torch.cat([
            z16.view(torch.uint8), s16.view(torch.uint8),
            pack_bits(low_mask.view(-1).to(torch.uint8), 1),
            pack_bits(flag.to(torch.uint8), 1),
            pack_bits(piv.to(torch.uint8), self.pivot_bits),
            pack_bits(k[:split], LOW_BITS),
            pack_bits(k[split:], HIGH_BITS),
        ])

    # -- decode ------------------------------------------------------------------------------------
    def _split(self, packet: Packet, g: _Geometry) -> list[torch.Tensor]:
        out, off = [], 0
        for size in self._regions(g):
            out.append(packet.payload[off : off + size])
            off += size
        return out

    def _decode(self, packet: Packet) -> torch.Tensor:
        g = self._geometry(packet.shape)
        dev = packet.payload.device
        if g.numel == 0:
            return torch.empty(packet.shape, dtype=packet.dtype, device=dev)
        if self.bits is not None:
            t = self._decode_fixpoint(packet, g)
            out = t.view(g.rows, g.padded)[:, : g.cols]
        else:
            t, wire = self._decode_forward(packet, g)
            out = torch.empty((g.rows, g.cols), dtype=torch.float32, device=dev)
            out.index_copy_(0, wire, t.view(g.rows, g.padded)[:, : g.cols])
        out = out.reshape(packet.shape)
        return out if packet.dtype == torch.float32 else out.to(packet.dtype)

    def _decode_fixpoint(self, packet: Packet, g: _Geometry) -> torch.Tensor:
        raw_s, raw_k = self._split(packet, g)
        s16 = bytes_as(raw_s, torch.float16)
        bad = (~torch.isfinite(s16) | (s16 < 0)).any()
        if defers_pending_checks(s16.device):  # a receiver on a GPU: read at the caller's step end
            defer_pending_check(bad, self._bad_fixpoint_scales)
        elif bool(bad):
            raise self._bad_fixpoint_scales()
        half = 2 ** (self.bits - 1)
        k = unpack_bits(raw_k, self.bits, g.rows * g.padded).view(-1, self.tile)
        return k.float().sub_(half).mul_(s16.float().view(-1, 1) / half)

    def _token_mask(self, raw_map: torch.Tensor, g: _Geometry) -> torch.Tensor:
        return unpack_bits(raw_map, 1, g.rows).view(g.batch, g.seq).bool()

    def _decode_forward(self, packet: Packet, g: _Geometry) -> tuple[torch.Tensor, torch.Tensor]:
        raw_z, raw_s, raw_map, raw_flag, raw_piv, raw_lo, raw_hi = self._split(packet, g)
        n = g.rows * g.tiles
        z16, s16 = bytes_as(raw_z, torch.float16), bytes_as(raw_s, torch.float16)
        low_mask = self._token_mask(raw_map, g)
        flag = unpack_bits(raw_flag, 1, n).bool()
        piv = unpack_bits(raw_piv, self.pivot_bits, n).to(torch.int64)
        checks = torch.stack([
            (~torch.isfinite(s16) | (s16 < 0)).any(), (~torch.isfinite(z16)).any(),
            (low_mask.sum(1) != g.low).any(), ((piv != 0) & ~flag).any(),
        ])
        later = defers_pending_checks(checks.device)
        if later:
            # a receiver on a GPU: the flags read at the caller's step end, in this order. Meanwhile nothing
            # goes out of bounds: the wire order is a permutation of each sequence whatever the token map,
            # pivots are below the tile, and unflagged tiles are left as they are.
            for i in range(4):
                defer_pending_check(checks[i], lambda i=i: self._packet_error(i, g))
        else:
            hit = checks.tolist()  # one host sync for all checks
            if any(hit):
                raise self._packet_error(hit.index(True), g)
        nlow = g.batch * g.low * g.padded
        k = torch.cat([unpack_bits(raw_lo, LOW_BITS, nlow),
                       unpack_bits(raw_hi, HIGH_BITS, g.rows * g.padded - nlow)])
        t = k.view(-1, self.tile).float().mul_(s16.float().view(-1, 1)).add_(z16.float().view(-1, 1))
        self._hadamard(t, flag, piv, inverse=True, every_row=later)
        return t, self._wire_rows(low_mask, g)

    def _bad_fixpoint_scales(self) -> PacketError:
        return PacketError(f"{self.spec}: packet holds invalid (non-finite or negative) tile scales")

    def _packet_error(self, which: int, g: _Geometry) -> PacketError:
        """The PacketError of a received packet's ``which``-th check, in :meth:`_decode_forward`'s order."""
        why = ["non-finite or negative tile scales", "non-finite tile zero points",
               f"a token map that does not mark exactly {g.low} 3-bit tokens in every sequence of {g.seq}",
               "a pivot index on a tile that is not transformed"][which]
        return PacketError(f"{self.spec}: packet holds {why}")

    # -- diagnostics -------------------------------------------------------------------------------
    def token_bits(self, packet: Packet) -> torch.Tensor:
        """Code width (uint8) of each token of a packet of this codec, shape ``packet.shape[:-1]``."""
        g = self._geometry(packet.shape)
        shape = tuple(packet.shape[:-1])
        dev = packet.payload.device
        if self.bits is not None or g.numel == 0:
            return torch.full(shape, self.bits or HIGH_BITS, dtype=torch.uint8, device=dev)
        mask = self._token_mask(self._split(packet, g)[2], g)
        return torch.where(mask, LOW_BITS, HIGH_BITS).to(torch.uint8).view(shape)
