"""Decoder fuzzing past the CRCs: valid packets of every codec with mutated header fields and payload bytes,
both CRCs recomputed so that the mutations reach the decoders (a buggy or hostile sender computes valid
CRCs too). Receiving must return a tensor of the announced shape and dtype or raise an AqsgdError; any
other exception (RuntimeError from torch, IndexError, OverflowError, ...) is a bug.
"""

import random
import struct
import zlib

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from aqsgd.compress import HEADER_BYTES, Packet, make_codec, parse_header
from aqsgd.compress.packet import DTYPE_CODES
from aqsgd.errors import AqsgdError

SPECS = ["none", "fp32", "fp16", "bf16", "q1", "q2:l2", "q3", "q4:token:stochastic", "q5:block7:midrise",
         "q6:tensor:scale32", "q7:channel", "q8:l2:scale32", "topk0.5", "topk0.1+q3", "topk0.3:tensor+q8",
         "topk0.5+q1", "topk0.2+fp32", "topk0.4+bf16", "topk0.5+q5:block3:scale32"]
# The receiving side's codec comes from its configured spec (make_codec) and decode() checks the packet's
# family and fingerprint against it: take the configured codec whose fingerprint the packet carries.
CODECS = {make_codec(s).fingerprint: make_codec(s) for s in SPECS}
FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
BIG = 2**32 - 1
F32 = torch.float32

# header fields: (offset, struct format)
FIELDS = {"family": (5, "<B"), "dtype": (6, "<B"), "ndim": (7, "<B"), "fingerprint": (8, "<I"),
          "kind": (16, "<B"), "flags": (17, "<B"), "payload_len": (24, "<Q")}
dims = st.one_of(st.integers(0, 12), st.sampled_from([0, 1, 2**16, 2**31 - 1, 2**31, BIG]),
                 st.integers(0, BIG))
values = st.one_of(st.integers(0, 12), st.integers(0, 2**64 - 1))
mutations = st.one_of(
    st.tuples(st.just("field"), st.sampled_from(sorted(FIELDS)), values),
    st.tuples(st.just("fingerprint"), st.sampled_from(sorted(CODECS))),  # another configured codec's packet
    st.tuples(st.just("dim"), st.integers(0, 5), dims),
    st.tuples(st.just("shape"), st.lists(dims, max_size=6)),  # payload resized to what the new shape needs
    st.tuples(st.just("flip"), st.integers(0, 2**20), st.integers(1, 255)),
    st.tuples(st.just("cut"), st.integers(0, 2**20)),
    st.tuples(st.just("append"), st.binary(min_size=1, max_size=9)),
    st.tuples(st.just("garbage"), st.integers(0, 2**32)),  # every payload byte random
)


def _mutate(data: bytes, mutation: tuple) -> bytes:
    """Apply one mutation, then make the payload length field (unless mutated) and both CRCs valid again."""
    head, body = bytearray(data[:HEADER_BYTES]), bytearray(data[HEADER_BYTES:])
    op, *args = mutation
    keep_len = False
    if op == "field":
        offset, fmt = FIELDS[args[0]]
        struct.pack_into(fmt, head, offset, args[1] % 2 ** (8 * struct.calcsize(fmt)))
        keep_len = args[0] == "payload_len"
    elif op == "fingerprint":
        struct.pack_into("<I", head, 8, args[0])
    elif op == "dim":
        struct.pack_into("<I", head, 32 + 4 * args[0], args[1])
    elif op == "shape":
        shape = args[0]
        head[7] = len(shape)
        struct.pack_into("<6I", head, 32, *shape, *[0] * (6 - len(shape)))
        codec = CODECS.get(struct.unpack_from("<I", head, 8)[0])
        dtype = {code: dt for dt, code in DTYPE_CODES.items()}.get(head[6], F32)
        n = codec.payload_bytes(shape, dtype) if codec is not None else len(body)
        if n <= 100_000:
            body = bytearray(random.Random(n).randbytes(n))
    elif op == "flip" and body:
        body[args[0] % len(body)] ^= args[1]
    elif op == "cut":
        body = body[: args[0] % (len(body) + 1)]
    elif op == "append":
        body += args[0]
    elif op == "garbage":
        body = bytearray(random.Random(args[0]).randbytes(len(body)))
    if not keep_len:
        struct.pack_into("<Q", head, 24, len(body))
    if head[17] & 1:
        struct.pack_into("<I", head, 20, zlib.crc32(body))
    struct.pack_into("<I", head, 60, zlib.crc32(head[:60]))
    return bytes(head + body)


def _receive(data: bytes, offset: int) -> None:
    """Parse and decode as a receiver does: from bytes, or (offset > 0) as the transport does, the payload a
    slice at ``offset`` of a larger buffer."""
    if offset == 0:
        packet = Packet.from_bytes(data)
    else:
        header = parse_header(data[:HEADER_BYTES])
        body = data[HEADER_BYTES:]
        shared = torch.zeros(offset + len(body), dtype=torch.uint8)
        if body:
            shared[offset:] = torch.frombuffer(bytearray(body), dtype=torch.uint8)
        packet = Packet.from_header(header, shared[offset:])
    codec = CODECS.get(packet.fingerprint, make_codec("none"))  # an unknown codec: the decode is a mismatch
    y = codec.decode(packet)
    assert y.shape == packet.shape and y.dtype == packet.dtype


# explicit cases: a 0 dim beside 2**32-1 dims (torch's stride computation overflowed), dims whose product
# overflows int64, and a huge announced payload length
@example(spec="none", shape=[2, 3], dtype=F32, seed=0, offset=0, muts=[("shape", [0, BIG, BIG])])
@example(spec="topk0.1+q3", shape=[2, 3], dtype=F32, seed=0, offset=3, muts=[("shape", [BIG, 0, BIG])])
@example(spec="q3", shape=[2, 3], dtype=F32, seed=0, offset=0, muts=[("shape", [BIG] * 6)])
@example(spec="q2:l2", shape=[4], dtype=F32, seed=0, offset=0, muts=[("shape", [2**31, 2**31])])
@example(spec="fp16", shape=[4], dtype=F32, seed=0, offset=0, muts=[("dim", 1, BIG), ("field", "ndim", 3)])
@example(spec="topk0.5", shape=[4], dtype=F32, seed=0, offset=0, muts=[("field", "payload_len", 2**64 - 1)])
@settings(max_examples=2500, derandomize=True, deadline=None)
@given(spec=st.sampled_from(SPECS), shape=st.lists(st.integers(0, 9), max_size=3),
       dtype=st.sampled_from(FLOATS), seed=st.integers(0, 2**16), offset=st.integers(0, 7),
       muts=st.lists(mutations, min_size=1, max_size=3))
def test_mutated_packets_decode_or_raise_library_errors(spec, shape, dtype, seed, offset, muts):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    data = make_codec(spec).encode(x, generator=torch.Generator().manual_seed(seed)).to_bytes()
    for m in muts:
        data = _mutate(data, m)
    try:
        _receive(data, offset)
    except AqsgdError:
        pass
