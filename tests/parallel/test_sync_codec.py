"""The quantized gradient sync's payloads, made through the codec (the device's kernels), are the bytes and
values of the per-row construction they replaced: scales quantized and codes packed row by row."""

from __future__ import annotations

import pytest
import torch

from aqsgd.compress.bitpack import pack_bits, unpack_bits
from aqsgd.compress.quant import QuantCodec
from aqsgd.parallel.sync import QuantizedSync


def _sync(bits: int, block: int, backend: str | None = None) -> QuantizedSync:
    sync = QuantizedSync.__new__(QuantizedSync)  # the codec's part only: no process group needed
    sync.codec = QuantCodec(bits, granularity="block", block=block).using(backend)
    sync.bits, sync.block = bits, block
    return sync


def _reference_encode(sync: QuantizedSync, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k, c = x.shape
    scales, codes = sync.codec.quantize(x.reshape(-1))
    deq = sync.codec.dequantize(scales, codes, (k * c,), torch.float32).view(k, c)
    sv = scales.view(k, c // sync.block).view(torch.uint8)
    cv = codes.view(k, c)
    return torch.stack([torch.cat([sv[i], pack_bits(cv[i], sync.bits)]) for i in range(k)]), deq


def _reference_decode(sync: QuantizedSync, payloads: torch.Tensor, c: int) -> torch.Tensor:
    # (each row its own tensor: a row at an odd offset cannot be viewed as fp16 scales, which made the
    # per-row decode fail for rows of an odd number of bytes, e.g. q1:block3)
    rows = [r.clone() for r in payloads]
    nsb = c // sync.block
    return torch.stack([sync.codec.dequantize(row[: 2 * nsb].view(torch.float16),
                                              unpack_bits(row[2 * nsb :], sync.bits, c), (c,), torch.float32)
                        for row in rows])


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("block,blocks", [(64, 5), (3, 7), (5, 3)])  # rows of whole bytes, and not
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("backend", ["eager", None])  # None: the device's default (numba on this CPU)
def test_payloads_and_values_are_the_per_row_construction(bits, block, blocks, k, backend):
    sync = _sync(bits, block, backend)
    c = block * blocks
    x = torch.randn(k, c, generator=torch.Generator().manual_seed(bits * 100 + block + k)) * 1e-3
    x[0, :block] = 0.0  # a zero block: scale 0
    payload, deq = sync._encode(x)
    ref_payload, ref_deq = _reference_encode(sync, x)
    assert payload.shape == (k, sync.payload_bytes(c))
    assert torch.equal(payload, ref_payload)
    assert torch.equal(deq, ref_deq)
    assert torch.equal(sync._decode(payload, c), _reference_decode(sync, ref_payload, c))
    assert torch.equal(sync._decode(payload, c), deq)  # what every rank decodes is what the sender kept


def test_non_finite_gradients_are_named():
    with pytest.raises(Exception, match="non-finite|NaN|Inf"):
        _sync(8, 64)._encode(torch.full((2, 64), float("nan")))
