"""Stateful boundary schemes (direct, AQ-SGD delta, EF, EF21) and the per-sample activation caches."""

from aqsgd.schemes.base import BoundaryScheme, Kind, Phase, Side, ids_tag
from aqsgd.schemes.cache import ActivationCache, DiskCache, LowBitCache, MemoryCache
from aqsgd.schemes.delta import DeltaScheme
from aqsgd.schemes.direct import DirectScheme
from aqsgd.schemes.factory import CACHE_HELP, SCHEME_NAMES, make_cache, make_scheme
from aqsgd.schemes.feedback import EF21Scheme, EFScheme, SampleState, SlotState

__all__ = [
    "BoundaryScheme",
    "Phase",
    "Kind",
    "Side",
    "ids_tag",
    "DirectScheme",
    "DeltaScheme",
    "EFScheme",
    "EF21Scheme",
    "SlotState",
    "SampleState",
    "ActivationCache",
    "MemoryCache",
    "DiskCache",
    "LowBitCache",
    "make_scheme",
    "make_cache",
    "SCHEME_NAMES",
    "CACHE_HELP",
]
