"""The ``eager`` backend: the kernel operations as whole-tensor PyTorch operations, on any device.

The reference the compiled backends are tested against, and the fallback where none is installed. Each
operation is a few passes over memory (a multiply-add, a clamp, a conversion, the shifts of
:mod:`aqsgd.compress.bitpack`); on the CPU its bytes equal the numba and Triton kernels' (``addcmul`` rounds
once there), on CUDA ``addcmul`` rounds twice (see :mod:`aqsgd.compress.kernels`).
"""

from __future__ import annotations

import torch

from aqsgd.compress.bitpack import pack_bits, unpack_bits
from aqsgd.compress.kernels import ANY_DEVICE, register_backend
from aqsgd.compress.kernels.base import Kernels

__all__ = ["EagerKernels"]


def _per_group(v: torch.Tensor, by_col: bool) -> torch.Tensor:
    return v.view(1, -1) if by_col else v.view(-1, 1)


class EagerKernels(Kernels):
    """The operations as whole-tensor PyTorch operations (the module docstring)."""

    name = "eager"

    def max_abs(self, x2: torch.Tensor, by_col: bool) -> torch.Tensor:
        return x2.abs().amax(dim=0 if by_col else 1)

    stochastic = True

    def quantize_pack(self, x2: torch.Tensor, inv: torch.Tensor, by_col: bool, offset: float, bits: int,
                      qmax: int, out: torch.Tensor | None = None,
                      noise: torch.Tensor | None = None) -> torch.Tensor:
        rows, k = x2.shape
        # filled on the device (torch.tensor would copy it from the host: a synchronisation on CUDA)
        off = torch.full((), offset, dtype=torch.float32, device=x2.device)
        t = torch.addcmul(off, x2, _per_group(inv, by_col))
        if noise is not None:
            t.add_(noise)
        t.clamp_(0.0, float(qmax))
        # float -> int8 is vectorized on the CPU where float -> uint8 is not: through a signed type
        codes = t.to(torch.int8).view(torch.uint8) if qmax <= 127 else t.to(torch.int16).to(torch.uint8)
        packed = pack_bits(codes.view(-1), bits).view(rows, k * bits // 8)
        return packed if out is None else out.copy_(packed)

    def unpack_dequantize(self, packed: torch.Tensor, step: torch.Tensor, by_col: bool, bits: int, mul: int,
                          low: int) -> torch.Tensor:
        rows = packed.shape[0]
        k = packed.shape[1] * 8 // bits
        codes = unpack_bits(packed.reshape(-1), bits, rows * k).view(rows, k)
        # (code * mul - low) exact in fp32 (small integers), then one rounding: times the group's step
        return codes.to(torch.float32).mul_(float(mul)).sub_(float(low)).mul_(_per_group(step, by_col))


register_backend("eager", EagerKernels, runs_on=lambda device: True, default_on=(ANY_DEVICE,))
