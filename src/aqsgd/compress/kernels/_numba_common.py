"""What the numba kernels share (:mod:`aqsgd.compress.kernels._numba`, ``_numba_topk``): fp32 fma, fp16 and
bf16 conversions as LLVM intrinsics, loading and storing a cache row's value in its storage format, and how
rows are split over threads (importing this module needs numba)."""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import types as nt
from numba.extending import intrinsic, overload

@intrinsic
def _fma32(typingctx, a, b, c):
    """Fused multiply-add with one rounding (llvm.fma), as PyTorch's CPU ``addcmul`` computes it."""
    sig = nt.float32(nt.float32, nt.float32, nt.float32)

    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return sig, codegen


@intrinsic
def _h2f(typingctx, h):
    """fp16 bits (uint16) to fp32: LLVM's ``fpext half``, exact (F16C's vcvtph2ps on x86)."""
    sig = nt.float32(nt.uint16)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


@intrinsic
def _f2h(typingctx, f):
    """fp32 to fp16 bits (uint16), rounded to nearest even as PyTorch's ``.to(torch.float16)``:
    ``fptrunc``."""
    sig = nt.uint16(nt.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return sig, codegen


@intrinsic
def _u2f(typingctx, u):
    """The fp32 whose bits are ``u`` (uint32)."""
    sig = nt.float32(nt.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@intrinsic
def _f2u(typingctx, f):
    """The bits (uint32) of the fp32 ``f``."""
    sig = nt.uint32(nt.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


# Cache storage formats of the fused AQ-SGD kernels: fp32 rows as they are, fp16 and bf16 rows as uint16 bits.
FMT_FP32, FMT_FP16, FMT_BF16 = 0, 1, 2


def _load(row, j, fmt):
    """``row[j]`` (a 1-D view of the storage) as fp32, for storage format ``fmt``; numba implementation
    below."""


def _store(row, j, v, fmt):
    """Round the fp32 ``v`` to the storage format, write it to ``row[j]``, return the stored value as fp32."""


@overload(_load)
def _load_impl(row, j, fmt):
    if row.dtype == nt.float32:
        return lambda row, j, fmt: row[j]

    def impl(row, j, fmt):
        if fmt == FMT_FP16:
            return _h2f(row[j])
        return _u2f(np.uint32(row[j]) << np.uint32(16))

    return impl


@overload(_store)
def _store_impl(row, j, v, fmt):
    if row.dtype == nt.float32:
        def impl32(row, j, v, fmt):
            row[j] = v
            return v

        return impl32

    def impl(row, j, v, fmt):
        if fmt == FMT_FP16:
            h = _f2h(v)
            row[j] = h
            return _h2f(h)
        # bf16, rounded to nearest even as PyTorch's c10::BFloat16 does (NaN to its canonical 0x7FC0)
        u = _f2u(v)
        b = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        if v != v:
            b = np.uint32(0x7FC0)
        row[j] = np.uint16(b)
        return _u2f(b << np.uint32(16))

    return impl


def max_threads() -> int:
    return numba.config.NUMBA_NUM_THREADS


def threading_layer() -> str:
    return numba.threading_layer()


def _chunks(rows: int, threads: int) -> tuple[int, int]:
    n = min(rows, threads * 4)
    return n, -(-rows // n)
