"""Codec spec strings, used by configs and the CLI.

=====================================  ==============================================================
spec                                   codec
=====================================  ==============================================================
``none``                               the tensor's own bytes (uncompressed, any dtype)
``fp32`` / ``fp16`` / ``bf16``         cast on the wire
``q<b>[:opt...]``                      uniform symmetric quantization at b = 1..8 bits; options in any
                                       order: ``tensor`` | ``channel`` (default) | ``token`` |
                                       ``block<N>``; ``nearest`` (default) | ``stochastic``;
                                       ``max`` | ``l2`` | ``mean`` (1 bit only); default ``max``,
                                       but ``mean`` for 1 bit with nearest rounding; ``step<c>``: the
                                       step is c x the group's rms (for ``:rc``); ``midtread`` (default) |
                                       ``midrise`` (all 2^b codes, no zero level); ``scale16``
                                       (default) | ``scale32``
``topk<K>[:row|:tensor][+<codec>]``    keep fraction K in (0, 1] of largest magnitudes per row (default)
                                       or per tensor; kept values in fp16 (default) or ``+<codec>``
                                       (``fp32``, ``bf16``, ``q<b>...``; quantizer groups default to rows)
``tah[:tile<G>]``                      TAH-Quant's forward compressor (He et al., 2025): tiles of 64,
                                       pivot swap and Hadamard where a tile has an outlier, asymmetric
                                       min/max per tile, 3 bits for the 20 % lowest-entropy tokens, 4
                                       for the rest
``tah<b>[:tile<G>]``                   its backward quantizer: symmetric max-abs per tile of 32, ``b``
                                       bits (``tah6``); see :mod:`aqsgd.compress.tahquant`
=====================================  ==============================================================

Wrapper options, after any codec's own (see :mod:`aqsgd.compress.wrappers`): ``rot<G>[s<seed>]``
(``q<b>`` only: randomized Hadamard rotation of tiles of G values, one scale per tile by default),
``outlier<F>`` (rows with norm above F x the median go apart in bf16), ``zstd[<level>]`` (lossless
entropy stage), ``rc`` (``q<b>`` only, optionally rotated: the codes through an order-0 rANS coder, lossless).
They compose as ``zstd(outlier(rot(codec)))`` or ``rc(rot(codec))`` whatever their order.

The subspace stage (see :mod:`aqsgd.compress.subspace`), outermost: ``pca<r>`` sends each row's ``r``
coefficients in a basis that the boundary learns from what crosses it, compressed by the rest of the spec;
``refresh<N>`` re-estimates the basis every N compressed messages (default 32, 0: never); ``tile<T>`` gives
each tile of T values of a row a basis of its own (``pca<r>``: r vectors a tile; with TAH-Quant coding the
coefficients, ``tile<T>`` stays TAH's own). It needs a boundary
scheme to hold the basis: ``delta:q4:rot128:step1:rc:pca144``, ``ef:q4:pca192``, ``ef:q4:pca/4:tile64``.

Examples: ``q4``, ``q2:token``, ``q3:block64:stochastic``, ``topk0.1``, ``topk0.1+q8``, ``q3:rot64:l2``,
``q2:l2:outlier8:zstd``.
"""

from __future__ import annotations

import functools
import re

import torch

from aqsgd.compress.base import Codec
from aqsgd.compress.cast import CastCodec, RawCodec
from aqsgd.compress.quant import QuantCodec
from aqsgd.compress.topk import TopKCodec
from aqsgd.compress.wrappers import EntropyCodec, OutlierCodec, RansCodec, RotatedCodec
from aqsgd.errors import SpecError

__all__ = ["make_codec", "SPEC_HELP", "CODEC_NAMES"]

CODEC_NAMES = ("none", "fp32", "fp16", "bf16", "q<bits>", "topk<fraction>", "tah")
SPEC_HELP = (
    "codec spec: none | fp32 | fp16 | bf16 | q<bits 1-8>[:tensor|channel|token|block<N>][:nearest|stochastic]"
    "[:max|l2|mean|step<c>][:midtread|midrise][:scale16|scale32] "
    "| topk<fraction>[:row|tensor][+fp32|fp16|bf16|q<bits>...] "
    "| tah | tah<bits> "
    "(e.g. q4, q2:token, q3:block64:stochastic, topk0.1, topk0.1+q8, q3:rot64:l2, q2:l2:outlier8:zstd); "
    "scale default: max, but mean (mean |x|) for 1 bit with nearest rounding; "
    "wrappers on any codec: :rot<G> (q only), :outlier<F>, :zstd[<level>], :rc (q only, optionally rot); "
    "at a boundary, outermost: :pca<rank>|pca/<divisor>[:tile<T>][:refresh<messages>] (coefficients in a "
    "learned basis; tile: one a tile of T values)"
)
_QUANT_RE = re.compile(r"q(\d+)")
_STEP_RE = re.compile(r"step(\d*\.?\d+)")
_TOPK_RE = re.compile(r"topk(\d*\.?\d+(?:e-?\d+)?)")
_ROT_RE = re.compile(r"rot(\d+)(?:s(\d+))?")
_OUTLIER_RE = re.compile(r"outlier(\d*\.?\d+)")
_ZSTD_RE = re.compile(r"zstd(\d*)")
_TAH_RE = re.compile(r"tah(\d*)")
_RC_RE = re.compile(r"rc")
_PCA_RE = re.compile(r"pca(/?)(\d+)")
_REFRESH_RE = re.compile(r"refresh(\d+)")
_TILE_RE = re.compile(r"tile(\d+)")
_WRAPPERS = (("rot", _ROT_RE), ("outlier", _OUTLIER_RE), ("zstd", _ZSTD_RE), ("rc", _RC_RE))


def _error(spec: str, why: str) -> SpecError:
    return SpecError(f"invalid codec spec {spec!r}: {why}. Valid: {SPEC_HELP}")


def _parse_quant(spec: str, text: str, default_granularity: str = "channel") -> QuantCodec:
    head, *opts = text.split(":")
    m = _QUANT_RE.fullmatch(head)
    if not m:
        raise _error(spec, f"{head!r} is not q<bits>")
    kw: dict = {"granularity": default_granularity}
    seen: dict[str, str] = {}

    def setopt(group: str, key: str, value: object, opt: str) -> None:
        if group in seen:
            raise _error(spec, f"options {seen[group]!r} and {opt!r} conflict")
        seen[group] = opt
        kw[key] = value

    for opt in opts:
        if opt in ("tensor", "channel", "token"):
            setopt("granularity", "granularity", opt, opt)
        elif opt.startswith("block"):
            size = opt[5:]
            if not size.isdigit() or int(size) < 1:
                raise _error(spec, f"block size in {opt!r} must be a positive integer")
            setopt("granularity", "granularity", "block", opt)
            kw["block"] = int(size)
        elif opt in ("nearest", "stochastic"):
            setopt("rounding", "rounding", opt, opt)
        elif opt in ("max", "l2", "mean"):
            setopt("scale", "scale", opt, opt)
        elif m_step := _STEP_RE.fullmatch(opt):
            setopt("scale", "scale", "step", opt)
            kw["step_rms"] = float(m_step.group(1))
        elif opt in ("midtread", "midrise"):
            setopt("grid", "grid", opt, opt)
        elif opt in ("scale16", "scale32"):
            setopt("scale_dtype", "scale_dtype", torch.float16 if opt == "scale16" else torch.float32, opt)
        else:
            raise _error(spec, f"unknown quantizer option {opt!r}")
    try:
        return QuantCodec(int(m.group(1)), **kw)
    except ValueError as e:
        raise _error(spec, str(e)) from None


def _parse_topk(spec: str, text: str) -> TopKCodec:
    base, plus, inner = text.partition("+")
    head, *opts = base.split(":")
    m = _TOPK_RE.fullmatch(head)
    if not m:
        raise _error(spec, f"{head!r} is not topk<fraction>")
    per = "row"
    if len(opts) > 1 or (opts and opts[0] not in ("row", "tensor")):
        raise _error(spec, f"TopK options are 'row' or 'tensor', got {':'.join(opts)!r}")
    if opts:
        per = opts[0]
    values = None
    if plus:
        if inner in ("fp32", "fp16", "bf16"):
            values = CastCodec(inner)
        elif inner.startswith("q"):
            values = _parse_quant(spec, inner, default_granularity="token")
        else:
            raise _error(spec, f"TopK values codec must be fp32, fp16, bf16 or q<bits>..., got {inner!r}")
    try:
        return TopKCodec(float(m.group(1)), per=per, values=values)
    except ValueError as e:
        raise _error(spec, str(e)) from None


def make_codec(spec: str, *, backend: str | None = None) -> Codec:
    """Build the codec named by ``spec``; raises :class:`SpecError` (a ValueError) naming valid choices.
    ``backend``: the kernels it computes with (:mod:`aqsgd.compress.kernels`: ``eager``, ``numba``,
    ``triton`` or any registered backend; None, the default: the device's own), for tests and benchmarks
    that compare them; not part of the spec (the bytes are the same)."""
    # checked before the cache, which would raise TypeError for an unhashable spec (a list, ...)
    if not isinstance(spec, str):
        raise SpecError(f"codec spec must be a string, got {type(spec).__name__}. Valid: {SPEC_HELP}")
    if backend is None:
        return _make_codec(spec)
    try:
        return _make_codec(spec).using(backend)
    except ValueError as e:
        raise SpecError(str(e)) from None


@functools.lru_cache(maxsize=256)
def _make_codec(spec: str) -> Codec:
    text = spec.strip().lower()
    toks = text.split(":")
    pca = [t for t in toks if _PCA_RE.fullmatch(t)]
    refresh = [t for t in toks if _REFRESH_RE.fullmatch(t)]
    if pca or refresh:
        # tile<T> is the subspace's, but TAH-Quant's own where TAH codes the coefficients
        tile = [] if toks[0].startswith("tah") else [t for t in toks if _TILE_RE.fullmatch(t)]
        stage = set(pca + refresh + tile)
        return _make_subspace(spec, [t for t in toks if t not in stage], pca, refresh, tile)
    wrappers: dict[str, re.Match] = {}
    core: list[str] = []
    for tok in text.split(":"):
        name, m = next(((n, hit) for n, rx in _WRAPPERS if (hit := rx.fullmatch(tok))), (None, None))
        if name is None:
            core.append(tok)
        elif name in wrappers:
            raise _error(spec, f"option {name!r} given twice")
        else:
            wrappers[name] = m
    rot = (int(wrappers["rot"].group(1)), int(wrappers["rot"].group(2) or 0)) if "rot" in wrappers else None
    outlier = float(wrappers["outlier"].group(1)) if "outlier" in wrappers else None
    zstd = int(wrappers["zstd"].group(1) or 1) if "zstd" in wrappers else None
    rc = "rc" in wrappers
    if rot is None and outlier is None and zstd is None and not rc:
        return _make_core(spec, text)
    if rc and (zstd is not None or outlier is not None):
        raise _error(spec, "rc codes a quantizer's codes (optionally rotated): not with zstd or outlier<F>")
    text = ":".join(core)
    if rot is not None and not (text.startswith("q") and "+" not in text):
        raise _error(spec, "rot<G> applies to q<bits> quantizers only")
    try:
        codec = (_parse_quant(spec, text, default_granularity="token") if rot is not None
                 else _make_core(spec, text))
        if rot is not None:
            codec = RotatedCodec(codec, rot[0], rot[1])
        if outlier is not None:
            if isinstance(codec, RawCodec):
                raise SpecError("outlier rows need a lossy codec to set apart from, not 'none'")
            codec = OutlierCodec(codec, outlier)
        if zstd is not None:
            codec = EntropyCodec(codec, zstd)
        if rc:
            codec = RansCodec(codec)
    except SpecError as e:
        if str(e).startswith("invalid codec spec"):
            raise
        raise _error(spec, str(e)) from None
    return codec


def _make_subspace(spec: str, rest: list[str], pca: list[str], refresh: list[str], tile: list[str]) -> Codec:
    from aqsgd.compress.subspace import DEFAULT_REFRESH, SubspaceCodec

    for name, given in (("pca", pca), ("refresh", refresh), ("tile", tile)):
        if len(given) > 1:
            raise _error(spec, f"option {name!r} given twice")
    if not pca:
        if tile:
            raise _error(spec, "tile<T> cuts a pca<r> basis into tiles of T values: give pca<r> too")
        raise _error(spec, "refresh<N> sets how often a pca<r> basis is re-estimated: give pca<r> too")
    if not rest:
        raise _error(spec, "pca<r> needs a codec for the coefficients, e.g. q4:pca64")
    relative, number = _PCA_RE.fullmatch(pca[0]).groups()  # type: ignore[union-attr]
    every = int(_REFRESH_RE.fullmatch(refresh[0]).group(1)) if refresh else DEFAULT_REFRESH  # type: ignore[union-attr]
    width = int(_TILE_RE.fullmatch(tile[0]).group(1)) if tile else None  # type: ignore[union-attr]
    inner = _make_codec(":".join(rest))
    try:
        if relative:
            return SubspaceCodec(inner, None, every, divisor=int(number), tile=width)
        return SubspaceCodec(inner, int(number), every, tile=width)
    except SpecError as e:
        raise _error(spec, str(e)) from None


def _make_core(spec: str, text: str) -> Codec:
    if text == "none":
        return RawCodec()
    if text in ("fp32", "fp16", "bf16"):
        return CastCodec(text)
    if text.startswith("topk"):
        return _parse_topk(spec, text)
    if text.startswith("q"):
        return _parse_quant(spec, text)
    if text.startswith("tah"):
        return _parse_tah(spec, text)
    raise _error(spec, "unknown codec name")


def _parse_tah(spec: str, text: str) -> Codec:
    head, *opts = text.split(":")
    m = _TAH_RE.fullmatch(head)
    if not m:
        raise _error(spec, f"{head!r} is not tah or tah<bits>")
    from aqsgd.compress.tahquant import TahQuantCodec

    kw: dict = {}
    for opt in opts:
        if opt.startswith("tile") and opt[4:].isdigit():
            kw["tile"] = int(opt[4:])
        else:
            raise _error(spec, f"unknown TAH-Quant option {opt!r} (valid: tile<G>)")
    try:
        return TahQuantCodec(int(m.group(1)) if m.group(1) else None, **kw)
    except ValueError as e:
        raise _error(spec, str(e)) from None
