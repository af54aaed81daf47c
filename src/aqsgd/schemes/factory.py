"""Build schemes and caches from names, as configs and the CLI spell them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

import torch

from aqsgd.compress import Codec
from aqsgd.errors import SpecError
from aqsgd.schemes.base import BoundaryScheme, Side
from aqsgd.schemes.cache import ActivationCache, DiskCache, LowBitCache, MemoryCache
from aqsgd.schemes.delta import DeltaScheme
from aqsgd.schemes.direct import DirectScheme
from aqsgd.schemes.feedback import EF21Scheme, EFScheme, SampleState, SlotState

__all__ = ["make_scheme", "make_cache", "SCHEME_NAMES", "CACHE_HELP"]

SCHEME_NAMES = ("direct", "delta", "ef", "ef21")
KEYS = ("slot", "sample")
CACHE_HELP = ("memory[:fp16|bf16|fp32] | disk[:fp16|bf16|fp32] | lowbit<bits>[:block<N>] (e.g. memory, "
              "disk:fp32, lowbit4:block64)")
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def make_cache(spec: str, capacity: int, *, row_shape: Sequence[int] | None = None,
               dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               path: str | Path | None = None) -> ActivationCache:
    """An activation cache from its spec (see ``CACHE_HELP``). ``disk`` needs ``path`` and ``row_shape``."""
    head, _, opt = spec.partition(":")
    if head in ("memory", "disk"):
        if opt and opt not in _DTYPES:
            raise SpecError(f"invalid cache spec {spec!r}: storage dtype {opt!r}; valid: {CACHE_HELP}")
        storage = _DTYPES[opt] if opt else torch.float16
        if head == "memory":
            return MemoryCache(capacity, row_shape, storage_dtype=storage, dtype=dtype, device=device)
        if path is None or row_shape is None:
            raise SpecError(f"cache {spec!r} needs a file path and the row shape")
        return DiskCache(path, capacity, tuple(row_shape), storage_dtype=storage, dtype=dtype, device=device)
    m = re.fullmatch(r"lowbit([1-8])", head)
    if m:
        block = 64
        if opt:
            bm = re.fullmatch(r"block(\d+)", opt)
            if not bm or int(bm.group(1)) < 1:
                raise SpecError(f"invalid cache spec {spec!r}: option {opt!r}; valid: {CACHE_HELP}")
            block = int(bm.group(1))
        if row_shape is None:
            raise SpecError(f"cache {spec!r} needs the row shape")
        return LowBitCache(capacity, tuple(row_shape), bits=int(m.group(1)), block=block, dtype=dtype,
                           device=device)
    raise SpecError(f"invalid cache spec {spec!r}; valid: {CACHE_HELP}")


def make_scheme(
    name: str,
    codec: Codec | str,
    side: Side | str,
    *,
    num_samples: int | None = None,
    cache: str = "memory",
    cache_path: str | Path | None = None,
    row_shape: Sequence[int] | None = None,
    key: str = "slot",
    dtype: torch.dtype = torch.float32,
    label: str = "boundary",
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> BoundaryScheme:
    """One side of one boundary. ``delta`` (and ``ef``/``ef21`` with ``key="sample"``) need ``num_samples``:
    the number of distinct sample ids (the dataset size); the cache is sized for exactly that."""
    common = dict(label=label, seed=seed, device=device)
    if name not in SCHEME_NAMES:
        raise SpecError(f"unknown scheme {name!r}; valid: {', '.join(SCHEME_NAMES)}")
    if key not in KEYS:
        raise SpecError(f"unknown error-feedback key {key!r}; valid: {', '.join(KEYS)}")
    if name == "direct":
        return DirectScheme(codec, side, **common)

    def sized_cache(spec: str) -> ActivationCache:
        if num_samples is None or num_samples < 1:
            raise SpecError(f"scheme {name!r} keeps per-sample state: give num_samples (the dataset size)")
        c = make_cache(spec, num_samples, row_shape=row_shape, dtype=dtype, device=device, path=cache_path)
        c.check_capacity(num_samples)
        return c

    if name == "delta":
        return DeltaScheme(codec, side, cache=sized_cache(cache), **common)
    state = SampleState(sized_cache("memory:fp32")) if key == "sample" else SlotState()
    cls = EFScheme if name == "ef" else EF21Scheme
    return cls(codec, side, state=state, **common)
