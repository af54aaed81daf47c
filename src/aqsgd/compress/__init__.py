"""Stateless codecs: ``Tensor -> Packet -> Tensor``. Build one from a spec string with :func:`make_codec`."""

from aqsgd.compress.base import Codec
from aqsgd.compress.bitpack import pack_bits, packed_nbytes, unpack_bits
from aqsgd.compress.cast import CastCodec, RawCodec
from aqsgd.compress.packet import HEADER_BYTES, Family, Packet, parse_header
from aqsgd.compress.quant import QuantCodec, dequantize_groups, quantize_groups
from aqsgd.compress.registry import SPEC_HELP, make_codec
from aqsgd.compress.topk import TopKCodec

__all__ = [
    "Codec",
    "CastCodec",
    "RawCodec",
    "QuantCodec",
    "TopKCodec",
    "Packet",
    "Family",
    "HEADER_BYTES",
    "parse_header",
    "make_codec",
    "SPEC_HELP",
    "pack_bits",
    "unpack_bits",
    "packed_nbytes",
    "quantize_groups",
    "dequantize_groups",
]
