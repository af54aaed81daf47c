"""Which scheme and codec compress each boundary, in each direction.

Spelled ``SCHEME:CODEC`` per direction, e.g. forward ``delta:q2`` (AQ-SGD, 2 bits) and backward
``direct:q4``; ``none`` alone means ``direct:none``. Per-boundary overrides map a boundary index
(boundary ``b`` joins stage ``b`` and ``b + 1``) to other settings.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

import torch

from aqsgd.comm.transport import BACKWARD, FORWARD
from aqsgd.compress import make_codec
from aqsgd.errors import SpecError
from aqsgd.schemes import SCHEME_NAMES, BoundaryScheme, make_scheme

__all__ = ["DirectionSpec", "BoundarySpec", "CompressionConfig", "FORWARD_CHANNEL", "BACKWARD_CHANNEL"]

# The channel ids of the two directions (defined once, by the transport they travel on), also the direction in
# the key ``(boundary, channel, side)`` of a boundary scheme.
FORWARD_CHANNEL = FORWARD  # activations, stage b -> b + 1
BACKWARD_CHANNEL = BACKWARD  # activation gradients, stage b + 1 -> b


@dataclasses.dataclass(frozen=True)
class DirectionSpec:
    """One direction of one boundary: a scheme name and a codec spec."""

    scheme: str = "direct"
    codec: str = "none"

    @classmethod
    def parse(cls, text: str) -> DirectionSpec:
        """``none`` | ``CODEC`` (direct) | ``SCHEME:CODEC`` (the codec may contain further colons)."""
        text = text.strip()
        head, sep, rest = text.partition(":")
        if sep and head in SCHEME_NAMES:
            spec = cls(head, rest)
        elif text in SCHEME_NAMES:
            raise SpecError(f"{text!r} needs a codec, e.g. {text}:q2")
        else:
            spec = cls("direct", text)
        make_codec(spec.codec)  # validate early, with the registry's error message
        return spec

    def __str__(self) -> str:
        return f"{self.scheme}:{make_codec(self.codec).spec}"


@dataclasses.dataclass(frozen=True)
class BoundarySpec:
    forward: DirectionSpec = DirectionSpec()
    backward: DirectionSpec = DirectionSpec()


@dataclasses.dataclass
class CompressionConfig:
    """Compression of every boundary, plus what stateful schemes need.

    Attributes:
        default: settings of every boundary without an override.
        per_boundary: boundary index -> settings.
        num_samples: number of distinct sample ids (training-set size), for per-sample state.
        cache: activation cache backend for ``delta`` (see ``aqsgd.schemes.CACHE_HELP``).
        cache_dir: directory for disk caches.
        ef_key: ``slot`` or ``sample`` keying of EF/EF21 state.
        seed: base seed of the schemes' random generators (stochastic rounding).
        warmup: channel -> the codec spec its schemes send the warm-up and AQ-SGD's first visits with
            (:meth:`~aqsgd.schemes.base.BoundaryScheme.compress_warmup`); a channel not in it sends them in
            full.
    """

    default: BoundarySpec = dataclasses.field(default_factory=BoundarySpec)
    per_boundary: dict[int, BoundarySpec] = dataclasses.field(default_factory=dict)
    num_samples: int | None = None
    cache: str = "memory"
    cache_dir: str | None = None
    ef_key: str = "slot"
    seed: int = 0
    warmup: dict[int, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def simple(cls, forward: str = "none", backward: str = "none", **kw: Any) -> CompressionConfig:
        return cls(default=BoundarySpec(DirectionSpec.parse(forward), DirectionSpec.parse(backward)), **kw)

    def for_boundary(self, b: int) -> BoundarySpec:
        return self.per_boundary.get(b, self.default)

    def direction(self, b: int, channel: int) -> DirectionSpec:
        spec = self.for_boundary(b)
        return spec.forward if channel == FORWARD_CHANNEL else spec.backward

    def make(self, b: int, channel: int, side: str, *, row_shape: tuple[int, ...] | None,
             dtype: torch.dtype, device: torch.device | str, replica: int = 0,
             spec: DirectionSpec | None = None) -> BoundaryScheme:
        """The scheme object for one side of one direction of boundary ``b`` (of data-parallel
        ``replica``), with its configured setting or ``spec`` (a link's codec chosen during the run)."""
        d = spec if spec is not None else self.direction(b, channel)
        name = "forward" if channel == FORWARD_CHANNEL else "backward"
        path = None
        if self.cache.startswith("disk"):
            if not self.cache_dir:
                raise SpecError("a disk cache needs cache_dir")
            path = Path(self.cache_dir) / f"boundary{b}-{name}-{side}.bin"
            path.parent.mkdir(parents=True, exist_ok=True)
        scheme = make_scheme(
            d.scheme, d.codec, side, num_samples=self.num_samples, cache=self.cache, cache_path=path,
            row_shape=row_shape, key=self.ef_key, dtype=dtype, label=f"boundary {b} {name}",
            seed=self.scheme_seed(b, channel, replica), device=device,
        )
        if channel in self.warmup:
            scheme.compress_warmup(codec=self.warmup[channel])
        return scheme

    def scheme_seed(self, b: int, channel: int, replica: int = 0) -> int:
        """Seed of one direction's random generator (stochastic rounding, only the sender draws): distinct per
        boundary and direction, and per data-parallel replica, so that the replicas' rounding errors are
        independent and average out in the gradient all-reduce instead of adding up. Replica 0 keeps the seed
        of a run without data parallelism; the others hash, kept to 32 bits (a CPU generator uses no more)."""
        base = self.seed * 1000 + 2 * b + channel
        if replica == 0:
            return base
        digest = hashlib.sha256(f"{base}/replica{replica}".encode()).digest()
        return int.from_bytes(digest[:4], "little")
