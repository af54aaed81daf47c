"""Dense, vectorized bit-packing of small unsigned integer codes.

``pack_bits(codes, bits)`` stores ``n`` codes of ``bits`` bits (1..8) in exactly ``ceil(n * bits / 8)``
bytes. Code ``j`` occupies bits ``[j*bits, (j+1)*bits)`` of the little-endian bit stream (bit 0 is the
least significant bit of byte 0). The work is done with a handful of whole-tensor shift/or operations on
integer words, never per element in Python and never through an 8x ``unpackbits`` expansion:

* bits in {1, 2, 4}: ``8 // bits`` codes share a byte. The codes are viewed as one machine word per
  output byte (int64 / int32 / int16), the codes are shifted down next to each other and the low byte is
  kept.
* bits in {3, 5, 6, 7}: groups of 8 codes become ``bits`` bytes. Each group is viewed as one int64,
  each code is moved from bit ``8*i`` to bit ``bits*i``, and the first ``bits`` bytes are kept.
* bits == 8: the codes are the bytes.

Inputs whose length is not a multiple of the group size are zero-padded to it internally, and the output
is cut back to the exact byte count.
"""

from __future__ import annotations

import torch

from aqsgd.compress.packet import bytes_as
from aqsgd.errors import CodecError

__all__ = ["pack_bits", "unpack_bits", "packed_nbytes"]

# For bits dividing 8: (word dtype, codes per word == bytes per word)
_WORD = {1: (torch.int64, 8), 2: (torch.int32, 4), 4: (torch.int16, 2)}
_SPREAD_MASK = {1: 0x0101010101010101, 2: 0x03030303, 4: 0x0F0F}


def packed_nbytes(n: int, bits: int) -> int:
    """Exact number of bytes that ``n`` codes of ``bits`` bits occupy."""
    return (n * bits + 7) // 8


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise CodecError(f"bits must be an integer in 1..8, got {bits!r}")


def _pad_to_multiple(t: torch.Tensor, multiple: int) -> torch.Tensor:
    rem = t.numel() % multiple
    if rem == 0:
        return t
    return torch.cat([t, t.new_zeros(multiple - rem)])


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a 1-D uint8 tensor of codes, each ``< 2**bits``, into ``packed_nbytes(n, bits)`` bytes.

    Codes with bits set above ``bits`` corrupt their neighbours: callers guarantee the range.
    """
    _check_bits(bits)
    if codes.dtype != torch.uint8 or codes.dim() != 1:
        raise CodecError("pack_bits expects a 1-D uint8 tensor")
    n = codes.numel()
    nbytes = packed_nbytes(n, bits)
    if bits == 8:
        return codes.contiguous()
    if n == 0:
        return codes.new_empty(0)
    if bits in _WORD:
        dtype, per = _WORD[bits]
        words = bytes_as(_pad_to_multiple(codes.contiguous(), per), dtype)  # codes may be a slice at any byte
        acc = words.clone()
        for i in range(1, per):
            acc.bitwise_or_(words >> ((8 - bits) * i))
        return acc.to(torch.uint8)[:nbytes]
    # bits in {3, 5, 6, 7}: 8 codes -> `bits` bytes through one int64 per group.
    words = bytes_as(_pad_to_multiple(codes.contiguous(), 8), torch.int64)
    mask = (1 << bits) - 1
    acc = words & mask
    for i in range(1, 8):
        acc.bitwise_or_((words >> ((8 - bits) * i)) & (mask << (bits * i)))
    return acc.view(torch.uint8).view(-1, 8)[:, :bits].reshape(-1)[:nbytes]


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``n`` uint8 codes from ``packed_nbytes(n, bits)`` bytes."""
    _check_bits(bits)
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise CodecError("unpack_bits expects a 1-D uint8 tensor")
    if packed.numel() != packed_nbytes(n, bits):
        raise CodecError(f"{packed.numel()} bytes cannot hold exactly {n} codes of {bits} bits")
    if bits == 8:
        return packed
    if n == 0:
        return packed.new_empty(0)
    if bits in _WORD:
        dtype, per = _WORD[bits]
        p = packed.to(dtype)
        acc = p.clone()
        for i in range(1, per):
            acc.bitwise_or_(p << ((8 - bits) * i))
        acc.bitwise_and_(_SPREAD_MASK[bits])
        return acc.view(torch.uint8)[:n]
    groups = -(-packed.numel() // bits)
    buf = packed.new_zeros(groups, 8)
    buf[:, :bits] = _pad_to_multiple(packed, bits).view(groups, bits)
    words = buf.view(torch.int64).view(-1)
    mask = (1 << bits) - 1
    acc = words & mask
    for i in range(1, 8):
        acc.bitwise_or_((words << ((8 - bits) * i)) & (mask << (8 * i)))
    return acc.view(torch.uint8)[:n]
