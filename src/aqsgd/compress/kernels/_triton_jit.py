"""The Triton kernels of :mod:`aqsgd.compress.kernels.triton`, in a module of their own that imports Triton at
its top: it is imported at the kernels' first use, so that importing aqsgd does not import Triton (a second),
and so that ``TRITON_INTERPRET`` set before that use takes effect. Kernels defined inside a function would see
``triton.language`` as a closure variable, which Triton 3.2 (PyTorch 2.6's) does not resolve when it compiles
for a GPU: they would run under the interpreter and fail on the device. The steps several kernels share are
``@triton.jit`` helpers here, written once and inlined by Triton: the stored scale and ``inv``
(``_stored_scale``, ``_inv``), the byte packing and unpacking of the codes (``_pack_store``,
``_unpack_codes``), bf16 rounding (``_bf16_bits``) and a cache row's address and values (``_cache_row``,
``_load_cache``).

No ``from __future__ import annotations`` here: Triton reads each ``tl.constexpr`` annotation as an object.
What each kernel computes, and why its bytes equal the other backends', is said in
:mod:`aqsgd.compress.kernels.triton`.
"""

import inspect

import triton
import triton.language as tl

# tl.histogram takes a mask from Triton 3.3 or so (3.6 and 3.9 do, 3.2 does not). Triton 3.9 counts each value
# with an atomic add in shared memory: without a mask, the TopK passes after the first put every key outside
# the prefix found so far (nearly all of them) into bin 0, one address, and took them out again after.
HIST_MASKED = "mask" in inspect.signature(tl.histogram).parameters

@triton.jit
def _stored_scale(s, idx, mask, stored_ptr, flag_ptr, HALF: tl.constexpr):
    """The stored scale of each group from its scale ``s`` (fp32, >= 0 or NaN): rounded up to fp16 (clamped to
    65504; ``HALF``) or kept as fp32, written to ``stored_ptr + idx``, returned as fp32; the flag at
    ``flag_ptr`` raised where a scale is NaN or Inf. ``store_scales``'s operations in its order: the same
    bits. (A helper of the kernels below: Triton inlines it.)"""
    tl.atomic_max(flag_ptr, tl.max(((s != s) | (s == float("inf"))).to(tl.int32), axis=0))
    if HALF:
        c = tl.where(s > 65504.0, 65504.0, s)
        h = c.to(tl.float16)
        h = tl.where(h.to(tl.float32) < c, (h.to(tl.int16, bitcast=True) + 1).to(tl.float16, bitcast=True), h)
        tl.store(stored_ptr + idx, h, mask=mask)
        return h.to(tl.float32)
    else:
        tl.store(stored_ptr + idx, s, mask=mask)
        return s


@triton.jit
def _inv(sf, qmax):
    """``qmax / (2 * stored)``, 0 for a zero scale: ``reciprocal(2 * sf) * qmax``, each step correctly
    rounded, as ``QuantCodec._scale_steps`` computes it."""
    return tl.where(sf > 0, tl.math.div_rn(1.0, 2.0 * sf) * qmax, 0.0)


@triton.jit
def _pack_store(out_ptr, code, rows, rmask, groups, K, BITS: tl.constexpr):
    """Store the codes ``[R, G, 8]`` of groups of 8 values (code ``i`` of a group at bits ``[BITS * i, BITS *
    (i + 1))``, a 64-bit word) as the low ``BITS`` bytes of each group's word, into rows of ``K * BITS / 8``
    bytes: the layout of ``pack_bits`` (a row's last group may be short)."""
    lane = tl.arange(0, 8)
    word = tl.sum(code.to(tl.int64) << (lane[None, None, :].to(tl.int64) * BITS), axis=2)  # disjoint bits
    nb = K * BITS // 8
    at = groups * BITS  # each group's first byte in its row
    for b in tl.static_range(BITS):
        tl.store(out_ptr + rows[:, None] * nb + at[None, :] + b,
                 ((word >> (8 * b)) & 0xFF).to(tl.uint8), mask=rmask[:, None] & (at + b < nb)[None, :])


@triton.jit
def _unpack_codes(p_ptr, rows, rmask, groups, K, BITS: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_G: tl.constexpr):
    """The codes ``[R, G, 8]`` (int64) of groups of 8 values packed by ``_pack_store``."""
    nb = K * BITS // 8
    at = groups * BITS  # each group's first byte in its row (a row's last group may be short)
    word = tl.zeros([BLOCK_R, BLOCK_G], dtype=tl.int64)
    for b in tl.static_range(BITS):
        byte = tl.load(p_ptr + rows[:, None] * nb + at[None, :] + b,
                       mask=rmask[:, None] & (at + b < nb)[None, :], other=0)
        word |= byte.to(tl.int64) << (8 * b)
    lane = tl.arange(0, 8)
    return (word[:, :, None] >> (lane[None, None, :].to(tl.int64) * BITS)) & ((1 << BITS) - 1)


@triton.jit
def _bf16_bits(v):
    """The bf16 bits (int32 in ``[0, 0xFFFF]``) of fp32 ``v`` rounded to nearest even, as PyTorch rounds (NaN
    to its canonical 0x7FC0)."""
    u = v.to(tl.int32, bitcast=True)
    b = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    return tl.where(v != v, 0x7FC0, b)


@triton.jit
def _cache_row(ids_ptr, rows, rmask, rpb, K):
    """Where each row of ``x2`` starts in the cache's storage: row ``r`` is segment ``r % rpb`` of sample
    ``r // rpb``, whose cache row is ``ids[r // rpb]`` (``rpb * K`` values)."""
    return (tl.load(ids_ptr + rows // rpb, mask=rmask, other=0) * rpb + rows % rpb) * K


@triton.jit
def _load_cache(st_ptr, where, m, BF16: tl.constexpr):
    """Cache values at ``where`` as fp32 (bf16 stored as its int16 bits)."""
    c = tl.load(st_ptr + where, mask=m, other=0)
    return (c.to(tl.int32) << 16).to(tl.float32, bitcast=True) if BF16 else c.to(tl.float32)


@triton.jit
def scales(s_ptr, stored_ptr, inv_ptr, step_ptr, flag_ptr, G, qmax, divisor, HALF: tl.constexpr,
           STEP: tl.constexpr, BLOCK: tl.constexpr):
    """Each group's stored scale and ``inv`` from given scales (``_stored_scale``, ``_inv``); with ``STEP``,
    also its decode step ``stored / divisor`` (correctly rounded, as ``divided``) into ``step_ptr``: what
    AQ-SGD's sender adds to its cache."""
    g = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    gmask = g < G
    sf = _stored_scale(tl.load(s_ptr + g, mask=gmask, other=0.0), g, gmask, stored_ptr, flag_ptr, HALF)
    tl.store(inv_ptr + g, _inv(sf, qmax), mask=gmask)
    if STEP:
        tl.store(step_ptr + g, tl.math.div_rn(sf, divisor), mask=gmask)


@triton.jit
def steps(stored_ptr, step_ptr, flag_ptr, G, divisor, BLOCK: tl.constexpr):
    """Each received scale's decode step ``stored / divisor`` (correctly rounded), the flag raised where a
    scale is not finite or is negative (a corrupt packet)."""
    g = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    gmask = g < G
    sf = tl.load(stored_ptr + g, mask=gmask, other=0.0).to(tl.float32)
    tl.atomic_max(flag_ptr, tl.max(((sf != sf) | (sf == float("inf")) | (sf < 0)).to(tl.int32), axis=0))
    tl.store(step_ptr + g, tl.math.div_rn(sf, divisor), mask=gmask)


@triton.jit
def _row_max_abs(x_ptr, rows, rmask, K, col0, ncols, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Each of ``rows``' max |x| over its columns ``[col0, col0 + ncols)`` (those below ``K``), NaN where one
    is NaN (a helper of ``rowmax``, ``rowmax_partial`` and ``row_max_quant_pack``: Triton inlines it)."""
    best = tl.zeros([BLOCK_R], dtype=tl.float32)
    nans = tl.zeros([BLOCK_R], dtype=tl.int32)
    for start in range(0, ncols, BLOCK_K):
        cols = col0 + start + tl.arange(0, BLOCK_K)
        m = rmask[:, None] & (cols < K)[None, :]
        x = tl.abs(tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=m, other=0.0))
        nans += tl.sum((x != x).to(tl.int32), axis=1)
        best = tl.maximum(best, tl.max(tl.where(x != x, 0.0, x), axis=1))
    return tl.where(nans > 0, float("nan"), best)


@triton.jit
def rowmax(x_ptr, out_ptr, stored_ptr, flag_ptr, R, K, qmax, SCALES: tl.constexpr, HALF: tl.constexpr,
           BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Each row's max |x| into ``out_ptr``; with ``SCALES``, its stored scale into ``stored_ptr`` and its
    ``inv`` into ``out_ptr`` instead."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    best = _row_max_abs(x_ptr, rows, rmask, K, 0, K, BLOCK_R, BLOCK_K)
    if SCALES:
        best = _inv(_stored_scale(best, rows, rmask, stored_ptr, flag_ptr, HALF), qmax)
    tl.store(out_ptr + rows, best, mask=rmask)


@triton.jit
def rowmax_partial(x_ptr, out_ptr, R, K, CHUNK, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Each row's max |x| over columns ``[j * CHUNK, (j + 1) * CHUNK)`` (``j``: the grid's second axis; CHUNK
    a multiple of BLOCK_K) into row ``j`` of ``out_ptr`` (``[splits, R]``, reduced by ``colmax_finish``),
    NaN where one is NaN. For few long rows: TopK's kept values (80 rows of 39,322) gave ``rowmax`` and
    ``row_max_quant_pack`` 5 programs, each looping over whole rows (655 us on an H200)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    best = _row_max_abs(x_ptr, rows, rmask, K, tl.program_id(1) * CHUNK, CHUNK, BLOCK_R, BLOCK_K)
    tl.store(out_ptr + tl.program_id(1) * R + rows, best, mask=rmask)


@triton.jit
def row_max_quant_pack(x_ptr, stored_ptr, flag_ptr, out_ptr, R, K, offset, qmax, HALF: tl.constexpr,
                       BITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_G: tl.constexpr):
    """``rowmax`` with ``SCALES`` and then ``quant_pack`` by row, in one launch: each program finds its rows'
    maxima, stores their scales, raises the flag, and quantizes and packs the same rows with the ``inv`` it
    made (held in registers, the value ``rowmax`` would write and ``quant_pack`` read): the same bytes."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    best = _row_max_abs(x_ptr, rows, rmask, K, 0, K, BLOCK_R, BLOCK_K)
    inv = _inv(_stored_scale(best, rows, rmask, stored_ptr, flag_ptr, HALF), qmax)[:, None, None]
    lane = tl.arange(0, 8)
    for g0 in range(0, (K + 7) // 8, BLOCK_G):
        groups = g0 + tl.arange(0, BLOCK_G)
        cols = groups[:, None] * 8 + lane[None, :]  # [G, 8]
        m = rmask[:, None, None] & (cols < K)[None, :, :]
        x = tl.load(x_ptr + rows[:, None, None] * K + cols[None, :, :], mask=m, other=0.0)
        t = tl.minimum(tl.maximum(tl.fma(x, inv, offset), 0.0), qmax)
        _pack_store(out_ptr, t.to(tl.int32), rows, rmask, groups, K, BITS)


@triton.jit
def colmax(x_ptr, out_ptr, stored_ptr, flag_ptr, R, K, qmax, CHUNK, SCALES: tl.constexpr, HALF: tl.constexpr,
           PARTIAL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Each column's max |x| over rows ``[j * CHUNK, (j + 1) * CHUNK)`` (``j``: the grid's second axis;
    CHUNK a multiple of BLOCK_R), NaN where one is NaN. ``PARTIAL``: into row ``j`` of ``out_ptr``
    (``[splits, K]``, reduced by ``colmax_finish``); otherwise (one split) into ``out_ptr``, or with
    ``SCALES`` its stored scale and ``inv`` (see ``rowmax``). Splitting the rows keeps a GPU busy: with
    128 columns a program, a 768-wide activation had 6 programs, each looping over every row (315 us on an
    H100 for 4096 rows)."""
    cols = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    cmask = cols < K
    row0 = tl.program_id(1) * CHUNK
    best = tl.zeros([BLOCK_K], dtype=tl.float32)
    nans = tl.zeros([BLOCK_K], dtype=tl.int32)
    for start in range(0, CHUNK, BLOCK_R):
        rows = row0 + start + tl.arange(0, BLOCK_R)
        m = (rows < R)[:, None] & cmask[None, :]
        x = tl.abs(tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=m, other=0.0))
        nans += tl.sum((x != x).to(tl.int32), axis=0)
        best = tl.maximum(best, tl.max(tl.where(x != x, 0.0, x), axis=0))
    best = tl.where(nans > 0, float("nan"), best)
    if PARTIAL:
        tl.store(out_ptr + tl.program_id(1) * K + cols, best, mask=cmask)
    else:
        if SCALES:
            best = _inv(_stored_scale(best, cols, cmask, stored_ptr, flag_ptr, HALF), qmax)
        tl.store(out_ptr + cols, best, mask=cmask)


@triton.jit
def colmax_finish(part_ptr, out_ptr, stored_ptr, flag_ptr, S, K, qmax, SCALES: tl.constexpr,
                  HALF: tl.constexpr, BLOCK_K: tl.constexpr):
    """The column maxes of ``S`` partial rows ``[S, K]`` (``colmax``'s, ``delta_colmax``'s), NaN where one
    is NaN (a max is exact in any order: the same value as one pass); with ``SCALES`` the stored scale and
    ``inv`` as ``colmax``'s last step."""
    cols = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    cmask = cols < K
    best = tl.zeros([BLOCK_K], dtype=tl.float32)
    nans = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in range(0, S):
        p = tl.load(part_ptr + j * K + cols, mask=cmask, other=0.0)
        nans += (p != p).to(tl.int32)
        best = tl.maximum(best, tl.where(p != p, 0.0, p))
    best = tl.where(nans > 0, float("nan"), best)
    if SCALES:
        best = _inv(_stored_scale(best, cols, cmask, stored_ptr, flag_ptr, HALF), qmax)
    tl.store(out_ptr + cols, best, mask=cmask)


@triton.jit
def quant_pack(x_ptr, inv_ptr, noise_ptr, out_ptr, R, K, offset, qmax, BY_COL: tl.constexpr,
               BITS: tl.constexpr, NOISE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr):
    """The codes ``trunc(clamp(fma(x, inv, offset) (+ noise), 0, qmax))`` of each value, packed."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    groups = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    lane = tl.arange(0, 8)
    cols = groups[:, None] * 8 + lane[None, :]  # [G, 8]
    rmask = rows < R
    cmask = cols < K
    m = rmask[:, None, None] & cmask[None, :, :]
    x = tl.load(x_ptr + rows[:, None, None] * K + cols[None, :, :], mask=m, other=0.0)
    if BY_COL:
        inv = tl.load(inv_ptr + cols, mask=cmask, other=0.0)[None, :, :]
    else:
        inv = tl.load(inv_ptr + rows, mask=rmask, other=0.0)[:, None, None]
    t = tl.fma(x, inv, offset)
    if NOISE:  # stochastic rounding: the general path's uniform draw, added after the fma's rounding
        t = t + tl.load(noise_ptr + rows[:, None, None] * K + cols[None, :, :], mask=m, other=0.0)
    t = tl.minimum(tl.maximum(t, 0.0), qmax)
    _pack_store(out_ptr, t.to(tl.int32), rows, rmask, groups, K, BITS)

@triton.jit
def unpack_dequant(p_ptr, step_ptr, out_ptr, flag_ptr, R, K, mul, low, divisor, BY_COL: tl.constexpr,
                   BITS: tl.constexpr, SCALES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr):
    """``(code * mul - low) * step`` of each code. With ``SCALES``, ``step_ptr`` holds the stored scales
    (fp16 or fp32) and the step is ``scale / divisor`` correctly rounded (what ``divided`` computes); the
    flag at ``flag_ptr`` is raised where a scale is not finite or is negative."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    groups = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    rmask = rows < R
    code = _unpack_codes(p_ptr, rows, rmask, groups, K, BITS, BLOCK_R, BLOCK_G)
    lane = tl.arange(0, 8)
    cols = groups[:, None] * 8 + lane[None, :]  # [G, 8]
    m = rmask[:, None, None] & (cols < K)[None, :, :]
    if BY_COL:
        step = tl.load(step_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)[None, :, :]
    else:
        step = tl.load(step_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[:, None, None]
    if SCALES:
        bad = (step != step) | (step == float("inf")) | (step < 0)
        tl.atomic_max(flag_ptr, tl.max(tl.max(tl.max(bad.to(tl.int32), axis=2), axis=1), axis=0))
        step = tl.math.div_rn(step, divisor)
    level = code.to(tl.float32) * mul - low  # a small integer: exact
    tl.store(out_ptr + rows[:, None, None] * K + cols[None, :, :], level * step, mask=m)

# -- AQ-SGD against a cache's rows (where a row's values are: _cache_row)
@triton.jit
def delta_rowmax(x_ptr, st_ptr, ids_ptr, out_ptr, R, K, rpb, BF16: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """Each row's max |x - cache| (NaN where one is NaN) into ``out_ptr``."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    best = tl.zeros([BLOCK_R], dtype=tl.float32)
    nans = tl.zeros([BLOCK_R], dtype=tl.int32)
    for start in range(0, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        m = rmask[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=m, other=0.0)
        c = _load_cache(st_ptr, _cache_row(ids_ptr, rows, rmask, rpb, K)[:, None] + cols[None, :], m, BF16)
        d = tl.abs(x - c)
        nans += tl.sum((d != d).to(tl.int32), axis=1)
        best = tl.maximum(best, tl.max(tl.where(d != d, 0.0, d), axis=1))
    tl.store(out_ptr + rows, tl.where(nans > 0, float("nan"), best), mask=rmask)

@triton.jit
def delta_colmax(x_ptr, st_ptr, ids_ptr, out_ptr, R, K, rpb, CHUNK, BF16: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """Each column's max |x - cache| over rows ``[j * CHUNK, (j + 1) * CHUNK)`` into row ``j`` of ``out_ptr``
    (one split: the maxes; several: ``colmax_finish`` reduces them)."""
    cols = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    cmask = cols < K
    row0 = tl.program_id(1) * CHUNK
    best = tl.zeros([BLOCK_K], dtype=tl.float32)
    nans = tl.zeros([BLOCK_K], dtype=tl.int32)
    for start in range(0, CHUNK, BLOCK_R):
        rows = row0 + start + tl.arange(0, BLOCK_R)
        rmask = rows < R
        m = rmask[:, None] & cmask[None, :]
        x = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=m, other=0.0)
        c = _load_cache(st_ptr, _cache_row(ids_ptr, rows, rmask, rpb, K)[:, None] + cols[None, :], m, BF16)
        d = tl.abs(x - c)
        nans += tl.sum((d != d).to(tl.int32), axis=0)
        best = tl.maximum(best, tl.max(tl.where(d != d, 0.0, d), axis=0))
    tl.store(out_ptr + tl.program_id(1) * K + cols, tl.where(nans > 0, float("nan"), best), mask=cmask)

@triton.jit
def delta_into(x_ptr, st_ptr, ids_ptr, out_ptr, R, K, rpb, BF16: tl.constexpr, BLOCK_R: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """``x - cache`` (fp32) of each value into ``out_ptr``."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    rmask = rows < R
    m = rmask[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=m, other=0.0)
    c = _load_cache(st_ptr, _cache_row(ids_ptr, rows, rmask, rpb, K)[:, None] + cols[None, :], m, BF16)
    tl.store(out_ptr + rows[:, None] * K + cols[None, :], x - c, mask=m)

@triton.jit
def delta_quant_update(x_ptr, st_ptr, ids_ptr, inv_ptr, step_ptr, out_ptr, R, K, rpb, offset, qmax, mul,
                       low, BY_COL: tl.constexpr, BITS: tl.constexpr, BF16: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr):
    """AQ-SGD's sender: the packed codes of ``x - cache``, each cache value set to ``cache + decode``."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    groups = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    lane = tl.arange(0, 8)
    cols = groups[:, None] * 8 + lane[None, :]  # [G, 8]
    rmask = rows < R
    cmask = cols < K
    m = rmask[:, None, None] & cmask[None, :, :]
    x = tl.load(x_ptr + rows[:, None, None] * K + cols[None, :, :], mask=m, other=0.0)
    where = _cache_row(ids_ptr, rows, rmask, rpb, K)[:, None, None] + cols[None, :, :]
    c = _load_cache(st_ptr, where, m, BF16)
    if BY_COL:
        inv = tl.load(inv_ptr + cols, mask=cmask, other=0.0)[None, :, :]
        step = tl.load(step_ptr + cols, mask=cmask, other=0.0)[None, :, :]
    else:
        inv = tl.load(inv_ptr + rows, mask=rmask, other=0.0)[:, None, None]
        step = tl.load(step_ptr + rows, mask=rmask, other=0.0)[:, None, None]
    t = tl.minimum(tl.maximum(tl.fma(x - c, inv, offset), 0.0), qmax)
    code = t.to(tl.int32)
    # the row as put(m + decode(...)) leaves it: one rounding for the level times the step, one for the
    # sum and one into the storage format
    new = c + (code.to(tl.float32) * mul - low) * step
    if BF16:
        tl.store(st_ptr + where, _bf16_bits(new).to(tl.int16), mask=m)
    else:
        tl.store(st_ptr + where, new.to(st_ptr.dtype.element_ty), mask=m)
    _pack_store(out_ptr, code, rows, rmask, groups, K, BITS)

@triton.jit
def delta_dequant_update(p_ptr, st_ptr, ids_ptr, step_ptr, out_ptr, R, K, rpb, mul, low,
                         BY_COL: tl.constexpr, BITS: tl.constexpr, BF16: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr):
    """AQ-SGD's receiver: each cache value set to ``cache + decode``, the stored values into ``out_ptr``."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    groups = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    rmask = rows < R
    code = _unpack_codes(p_ptr, rows, rmask, groups, K, BITS, BLOCK_R, BLOCK_G)
    lane = tl.arange(0, 8)
    cols = groups[:, None] * 8 + lane[None, :]
    cmask = cols < K
    m = rmask[:, None, None] & cmask[None, :, :]
    if BY_COL:
        step = tl.load(step_ptr + cols, mask=cmask, other=0.0)[None, :, :]
    else:
        step = tl.load(step_ptr + rows, mask=rmask, other=0.0)[:, None, None]
    where = _cache_row(ids_ptr, rows, rmask, rpb, K)[:, None, None] + cols[None, :, :]
    c = _load_cache(st_ptr, where, m, BF16)
    new = c + (code.to(tl.float32) * mul - low) * step
    if BF16:
        b = _bf16_bits(new)
        tl.store(st_ptr + where, b.to(tl.int16), mask=m)
        back = (b << 16).to(tl.float32, bitcast=True)
    else:
        stored = new.to(st_ptr.dtype.element_ty)
        tl.store(st_ptr + where, stored, mask=m)
        back = stored.to(tl.float32)
    tl.store(out_ptr + rows[:, None, None] * K + cols[None, :, :], back, mask=m)

# -- Walsh-Hadamard transform of rows of G values (G a power of two), in registers: stage h pairs value j
# with value j + h of each block of 2h (the butterflies of aqsgd.compress.hadamard, in the same order)
@triton.jit
def fwht_rows(x_ptr, s_ptr, out_ptr, c, R, G: tl.constexpr, LOG_G: tl.constexpr, INVERSE: tl.constexpr,
              BLOCK_R: tl.constexpr):
    """The Walsh-Hadamard transform of each row of ``G`` values, the signs applied before (or after)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, G)
    m = (rows < R)[:, None] & (cols < G)[None, :]
    y = tl.load(x_ptr + rows[:, None] * G + cols[None, :], mask=m, other=0.0)
    s = tl.load(s_ptr + cols)[None, :]
    if not INVERSE:
        y = y * s
    for i in tl.static_range(LOG_G):
        # [R, blocks, 2, h] -> [R, blocks, h, 2]: the pair (j, j + h) on the last axis
        v = tl.permute(tl.reshape(y, (BLOCK_R, G // (2 << i), 2, 1 << i)), (0, 1, 3, 2))
        a, b = tl.split(v)
        y = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (BLOCK_R, G))
    y = y * c
    if INVERSE:
        y = y * s
    tl.store(out_ptr + rows[:, None] * G + cols[None, :], y, mask=m)

# -- TopK: the k-th largest magnitude key of each row by radix selection (three digits of the 31-bit key,
# each a histogram over the row's keys that share the digits found so far), then the exact selection. The
# digit of a pass is picked from its histogram by every program of the next kernel (the next pass's histogram,
# or the count), each for itself: a 2,048-bin prefix sum is nothing next to a launch, and the pick needs no
# launch of its own. The programs of a row's first chunk store what they picked for the kernel after.
@triton.jit
def _topk_pick(hist_ptr, prev_ptr, row, k, SHIFT: tl.constexpr, NB: tl.constexpr, FIRST: tl.constexpr):
    """The digits found so far with this pass's (``prefix``) and how many keys equal to the prefix's are
    still to take (``need``), from the pass's histogram and the previous pick (``prev``: [R, 2] int32)."""
    bins = tl.arange(0, NB)
    h = tl.load(hist_ptr + row * NB + bins)
    if FIRST:
        prefix = 0
        need = k
    else:
        prefix = tl.load(prev_ptr + row * 2)
        need = tl.load(prev_ptr + row * 2 + 1)
    above = tl.sum(h, axis=0) - tl.cumsum(h, axis=0)  # keys in the bins above each bin
    hit = (above < need) & (above + h >= need)  # the bin of the need-th largest key
    digit = tl.sum(tl.where(hit, bins, 0), axis=0)
    return prefix | (digit << SHIFT), need - tl.sum(tl.where(hit, above, 0), axis=0)

@triton.jit
def topk_hist(x_ptr, phist_ptr, pprev_ptr, state_ptr, hist_ptr, n, chunk, k, SHIFT: tl.constexpr,
              NB: tl.constexpr, HIGH: tl.constexpr, PICK: tl.constexpr, PSHIFT: tl.constexpr,
              PNB: tl.constexpr, PFIRST: tl.constexpr, MASKED: tl.constexpr, BLOCK: tl.constexpr):
    """One radix pass of a row chunk: the histogram of the next digit of the keys that match the prefix."""
    row = tl.program_id(0)
    start = tl.program_id(1) * chunk
    base = x_ptr + row.to(tl.int64) * n
    if PICK:  # the previous pass's digit, from its histogram (phist) and the pick before it (pprev)
        prefix, need = _topk_pick(phist_ptr, pprev_ptr, row, k, PSHIFT, PNB, PFIRST)
        first = tl.program_id(1) == 0
        tl.store(state_ptr + row * 2, prefix, mask=first)
        tl.store(state_ptr + row * 2 + 1, need, mask=first)
        prefix = prefix & HIGH
    else:
        prefix = 0  # the digits found so far: none in the first pass
    acc = tl.zeros([NB], dtype=tl.int32)
    bins = tl.arange(0, NB)
    for off in range(0, chunk, BLOCK):
        at = start + off + tl.arange(0, BLOCK)
        m = (at < n) & (off + tl.arange(0, BLOCK) < chunk)
        key = tl.load(base + at, mask=m, other=0) & 0x7FFFFFFF
        match = m & ((key & HIGH) == prefix)
        digit = tl.where(match, (key >> SHIFT) & (NB - 1), 0)
        if MASKED:  # the keys that match only (HIST_MASKED)
            acc += tl.histogram(digit, NB, mask=match)
        else:  # the keys that do not match were counted in bin 0: take them out again
            acc += tl.histogram(digit, NB) - tl.where(bins == 0, BLOCK - tl.sum(match.to(tl.int32)), 0)
    tl.atomic_add(hist_ptr + row * NB + bins, acc)

@triton.jit
def topk_count(x_ptr, phist_ptr, pprev_ptr, state_ptr, counts_ptr, n, chunk, nchunk, k, PSHIFT: tl.constexpr,
               PNB: tl.constexpr, BLOCK: tl.constexpr):
    """The k-th largest key of each row, then each chunk's count of keys above and equal to it."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    start = c * chunk
    base = x_ptr + row.to(tl.int64) * n
    # the last pass's digit: the k-th largest key, and how many keys equal to it are kept
    kth, ties = _topk_pick(phist_ptr, pprev_ptr, row, k, PSHIFT, PNB, False)
    tl.store(state_ptr + row * 2, kth, mask=c == 0)
    tl.store(state_ptr + row * 2 + 1, ties, mask=c == 0)
    gt = 0
    eq = 0
    for off in range(0, chunk, BLOCK):
        at = start + off + tl.arange(0, BLOCK)
        m = (at < n) & (off + tl.arange(0, BLOCK) < chunk)
        key = tl.load(base + at, mask=m, other=0) & 0x7FFFFFFF
        gt += tl.sum((m & (key > kth)).to(tl.int32), axis=0)
        eq += tl.sum((m & (key == kth)).to(tl.int32), axis=0)
    tl.store(counts_ptr + (row * nchunk + c) * 2, gt)
    tl.store(counts_ptr + (row * nchunk + c) * 2 + 1, eq)

@triton.jit
def topk_write(x_ptr, state_ptr, counts_ptr, idx_ptr, vals_ptr, ib_ptr, bad_ptr, n, k, chunk, nchunk,
               PACK: tl.constexpr, FMT: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr,
               CBLOCK: tl.constexpr):
    """The kept positions of each row chunk in increasing order, or with ``PACK`` the cast payload."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    start = c * chunk
    base = x_ptr + row.to(tl.int64) * n
    kth = tl.load(state_ptr + row * 2)
    ties = tl.load(state_ptr + row * 2 + 1)  # how many keys equal to the k-th are kept: the first ones
    gt = 0
    eq = 0
    for c0 in range(0, c, CBLOCK):  # the chunks before this one
        cc = c0 + tl.arange(0, CBLOCK)
        cm = cc < c
        gt += tl.sum(tl.load(counts_ptr + (row * nchunk + cc) * 2, mask=cm, other=0), axis=0)
        eq += tl.sum(tl.load(counts_ptr + (row * nchunk + cc) * 2 + 1, mask=cm, other=0), axis=0)
    slot = gt + tl.minimum(eq, ties)  # kept values before this chunk
    worst = 0
    for off in range(0, chunk, BLOCK):
        lanes = tl.arange(0, BLOCK)
        at = start + off + lanes
        m = (at < n) & (off + lanes < chunk)
        bits = tl.load(base + at, mask=m, other=0)
        key = bits & 0x7FFFFFFF
        same = m & (key == kth)
        rank = eq + tl.cumsum(same.to(tl.int32), axis=0) - 1  # among the row's keys equal to the k-th
        take = (m & (key > kth)) | (same & (rank < ties))
        where = slot + tl.cumsum(take.to(tl.int32), axis=0) - 1
        take = take & (where < k)  # never past the row's k slots, whatever the counts say
        out = row.to(tl.int64) * k + where
        if PACK:  # the kept values cast to the wire format, then the positions' low WIDTH bytes
            v = bits.to(tl.float32, bitcast=True)
            if FMT == 0:
                tl.store(vals_ptr + out, v, mask=take)
                back = bits
            elif FMT == 1:
                h = v.to(tl.float16)
                tl.store(vals_ptr + out, h.to(tl.int16, bitcast=True), mask=take)
                back = h.to(tl.float32).to(tl.int32, bitcast=True)
            else:  # bf16
                b = _bf16_bits(v)
                tl.store(vals_ptr + out, b.to(tl.int16), mask=take)
                back = b << 16
            # a kept value, or its cast, is Inf or NaN: the magnitude's bits at or above Inf's
            worst = tl.maximum(worst, tl.max(tl.where(take, back & 0x7FFFFFFF, 0), axis=0))
            pos = at.to(tl.int64)
            for b in tl.static_range(WIDTH):
                tl.store(ib_ptr + out * WIDTH + b, ((pos >> (8 * b)) & 0xFF).to(tl.uint8), mask=take)
        else:
            tl.store(idx_ptr + out, at.to(tl.int64), mask=take)
        slot += tl.sum(take.to(tl.int32), axis=0)
        eq += tl.sum(same.to(tl.int32), axis=0)
    if PACK:
        tl.atomic_max(bad_ptr, (worst >= 0x7F800000).to(tl.int32))

# -- outlier rows (aqsgd.compress.wrappers.OutlierCodec)
@triton.jit
def row_sumsq(x_ptr, out_ptr, R, D, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Each row's sum of squares (fp32) into ``out_ptr``."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
    for start in range(0, D, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        m = rmask[:, None] & (cols < D)[None, :]
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * D + cols[None, :], mask=m, other=0.0)
        x = x.to(tl.float32)
        acc += x * x
    tl.store(out_ptr + rows, tl.sum(acc, axis=1), mask=rmask)

@triton.jit
def split_rows(x_ptr, idx_ptr, rest_ptr, apart_ptr, D, k, BLOCK_D: tl.constexpr, BLOCK_I: tl.constexpr):
    """The rows not in ``idx`` into ``rest_ptr``, those in ``idx`` as bf16 bits into ``apart_ptr``."""
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cm = cols < D
    before = 0  # outlier rows above this one
    hit = 0
    for i0 in range(0, k, BLOCK_I):
        ii = i0 + tl.arange(0, BLOCK_I)
        im = ii < k
        v = tl.load(idx_ptr + ii, mask=im, other=-1)
        before += tl.sum((im & (v < r)).to(tl.int32), axis=0)
        hit += tl.sum((im & (v == r)).to(tl.int32), axis=0)
    x = tl.load(x_ptr + r.to(tl.int64) * D + cols, mask=cm, other=0.0)
    hits = tl.zeros([BLOCK_D], dtype=tl.int32) + hit  # > 0: this row goes apart
    tl.store(rest_ptr + (r - before).to(tl.int64) * D + cols, x, mask=cm & (hits == 0))
    b = _bf16_bits(x.to(tl.float32))
    tl.store(apart_ptr + before.to(tl.int64) * D + cols, b.to(tl.int16), mask=cm & (hits > 0))


@triton.jit
def cast_checked(x_ptr, y_ptr, flag_ptr, N, BF16: tl.constexpr, BLOCK: tl.constexpr):
    """``y = x`` (fp32) cast to fp16, or to bf16 bits (``y_ptr`` int16), rounding to nearest even as PyTorch
    does; the flag raised where a cast value is NaN or Inf (the input held one, or it overflowed)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    x = tl.load(x_ptr + i, mask=m, other=0.0)
    if BF16:
        b = _bf16_bits(x)
        bad = (b & 0x7F80) == 0x7F80
        tl.store(y_ptr + i, b.to(tl.int16), mask=m)
    else:
        y = x.to(tl.float16)
        yf = y.to(tl.float32)
        bad = (yf != yf) | (tl.abs(yf) == float("inf"))
        tl.store(y_ptr + i, y, mask=m)
    tl.atomic_max(flag_ptr, tl.max(bad.to(tl.int32), axis=0))


KERNELS = {k.__name__: k for k in (
    scales, rowmax, rowmax_partial, row_max_quant_pack, colmax, colmax_finish, quant_pack, unpack_dequant,
    row_sumsq, split_rows, delta_rowmax, delta_colmax, delta_into, delta_quant_update, delta_dequant_update,
    fwht_rows, topk_hist, topk_count, topk_write, cast_checked, steps)}
