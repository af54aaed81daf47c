"""Randomized Hadamard rotation of tiles: ``y = H_G D x / sqrt(G)`` and its inverse ``x = D H_G y / sqrt(G)``.

A tile is ``G`` consecutive values (``G`` a power of two); ``D`` is a diagonal of random signs drawn from a
seed that sender and receiver share, one sign per position of the row; ``H_G`` is the Sylvester-Hadamard
matrix (``H H = G I``), so the map is orthonormal and its own inverse up to the signs. After the rotation
every value of a tile is a signed average of all ``G`` inputs: one large value (an attention sink's
channel, an outlier feature) is spread over the tile, and the tile looks close to Gaussian, which is the
case a uniform quantizer with an l2 or max scale handles best.

The fast Walsh-Hadamard transform takes ``log2 G`` butterfly stages, ``O(G log G)`` per tile. The CPU path
is one numba pass over the data (:mod:`aqsgd.compress.kernels.numba`); elsewhere (CUDA tensors, no numba, a
codec using the ``eager`` backend) each stage is one PyTorch operation over the whole tensor. Both compute
every output as the same sequence of IEEE additions, subtractions and one final multiplication, so their
results are bit-identical (tested).
"""

from __future__ import annotations

import functools
import math

import torch

from aqsgd.compress import kernels
from aqsgd.errors import SpecError

__all__ = ["signs", "rotate", "unrotate", "check_tile", "TILE_MIN", "TILE_MAX"]

TILE_MIN = 2
TILE_MAX = 4096


def check_tile(tile: int) -> None:
    if not isinstance(tile, int) or tile < TILE_MIN or tile > TILE_MAX or tile & (tile - 1):
        raise SpecError(f"rotation tile must be a power of two in {TILE_MIN}..{TILE_MAX}, got {tile!r}")


@functools.lru_cache(maxsize=64)
def _signs_cpu(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (n,), generator=g, dtype=torch.int64) * 2 - 1).to(torch.float32)


def signs(n: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The ``n`` random signs (fp32 +-1) of seed ``seed``: the same on every machine and device. On a device
    they are copied there once and kept (a host-to-device copy on every rotation would synchronise)."""
    s = _signs_cpu(int(n), int(seed))
    return s if kernels.on_host(device) else _signs_on(int(n), int(seed), torch.device(device))


@functools.lru_cache(maxsize=64)
def _signs_on(n: int, seed: int, device: torch.device) -> torch.Tensor:
    return _signs_cpu(n, seed).to(device)


def _fwht_torch(x: torch.Tensor, tile: int) -> torch.Tensor:
    """Unnormalized Walsh-Hadamard transform of each tile of the rows of ``x`` [R, tile] (a new tensor)."""
    rows = x.shape[0]
    h = 1
    y = x
    while h < tile:
        v = y.view(rows, tile // (2 * h), 2, h)
        a, b = v[:, :, 0, :], v[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return y.view(rows, tile)


def _rows(x: torch.Tensor, tile: int) -> torch.Tensor:
    """``x`` as fp32 [numel / tile, tile] (the caller pads to a multiple of the tile)."""
    flat = x.reshape(-1)
    if flat.dtype != torch.float32:
        flat = flat.to(torch.float32)
    return flat.view(-1, tile)


def _transform(x: torch.Tensor, tile: int, seed: int, inverse: bool,
               backend: str | None = None) -> torch.Tensor:
    x2 = _rows(x, tile)
    s = signs(tile, seed, x2.device)
    c = 1.0 / math.sqrt(tile)
    if x2.shape[0] > 0:
        out = kernels.for_tensor(x2, backend).fwht(x2.contiguous(), s, c, inverse)
        if out is not None:
            return out
    if inverse:
        return _fwht_torch(x2, tile).mul_(c).mul_(s)
    return _fwht_torch(x2 * s, tile).mul_(c)


def rotate(x: torch.Tensor, tile: int, seed: int, backend: str | None = None) -> torch.Tensor:
    """``H D x / sqrt(tile)`` of every tile of ``x`` (numel a multiple of ``tile``): fp32
    [numel/tile, tile]."""
    return _transform(x, tile, seed, inverse=False, backend=backend)


def unrotate(y: torch.Tensor, tile: int, seed: int, backend: str | None = None) -> torch.Tensor:
    """Inverse of :func:`rotate`: ``D H y / sqrt(tile)`` of fp32 ``y`` [numel/tile, tile] (a new tensor)."""
    return _transform(y, tile, seed, inverse=True, backend=backend)
