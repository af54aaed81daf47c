"""Optimizer, learning-rate schedule and gradient clipping for the stages one process owns.

Each stage has its own optimizer over its own parameters (a pipeline process never sees the others),
which is the same arithmetic per parameter as one optimizer over the whole model. Global gradient-norm
clipping needs the norm over all stages: each stage computes its squared norm, the values are gathered
in stage order and summed in that order, so local and distributed runs clip identically.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Sequence

import torch
from torch import nn

__all__ = ["param_groups", "make_optimizer", "warmup_linear_decay", "squared_grad_norm", "clip_coefficient"]

_NO_DECAY_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.Embedding)


def param_groups(module: nn.Module, weight_decay: float, exclude: set[int] | None = None) -> list[dict]:
    """Two groups: weight decay on weight matrices, none on biases, norms (incl. RMSNorm) and 1-D params.
    Parameters whose ``id`` is in ``exclude`` are left out (they belong to another stage's optimizer)."""
    decay, no_decay, seen = [], [], set(exclude or ())
    for mod_name, mod in module.named_modules():
        is_norm = isinstance(mod, _NO_DECAY_TYPES[:4]) or "norm" in type(mod).__name__.lower()
        for name, p in mod.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            (no_decay if is_norm or p.ndim < 2 or name.endswith("bias") else decay).append(p)
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def make_optimizer(module: nn.Module, name: str, lr: float, weight_decay: float = 0.0,
                   betas: tuple[float, float] = (0.9, 0.999), momentum: float = 0.0,
                   exclude: set[int] | None = None) -> torch.optim.Optimizer:
    groups = param_groups(module, weight_decay, exclude)
    if not groups:
        groups = [{"params": [], "weight_decay": 0.0}]
    # foreach=None: PyTorch's choice, the multi-tensor kernels on a GPU (a few launches per step instead of
    # ten per parameter), the per-parameter loop on the CPU (the numbers every CPU test and golden loss
    # records)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, foreach=None)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, foreach=None)
    raise ValueError(f"unknown optimizer {name!r}; valid: adamw, sgd")


def warmup_linear_decay(warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """LR multiplier: linear from 0 to 1 over ``warmup_steps``, then linear to 0 at ``total_steps``."""

    def factor(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        if total_steps <= warmup_steps:
            return 1.0
        return max(0.0, (total_steps - step) / (total_steps - warmup_steps))

    return factor


def squared_grad_norm(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """Sum of squared gradient entries, in float64, in parameter order (deterministic), as a 0-dim tensor on
    the gradients' device (the CPU when there are none): reading it is the caller's one host
    synchronisation."""
    total: torch.Tensor | None = None
    for p in params:
        if p.grad is not None:
            sq = p.grad.detach().double().square().sum()
            total = sq if total is None else total + sq
    return torch.zeros((), dtype=torch.float64) if total is None else total


def clip_coefficient(stage_sq_norms: Sequence[float], max_norm: float) -> tuple[float, float]:
    """``(global norm, factor <= 1)`` from per-stage squared norms summed in stage order."""
    total = 0.0
    for v in stage_sq_norms:
        total += float(v)
    norm = math.sqrt(total)
    if max_norm <= 0 or not math.isfinite(norm):
        return norm, 1.0
    return norm, min(1.0, max_norm / (norm + 1e-6))
