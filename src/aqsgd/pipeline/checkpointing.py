"""Activation checkpointing per stage: each block of a stage recomputes its activations in the backward pass
instead of keeping them (``torch.utils.checkpoint``, non-reentrant), so a stage holds one tensor per block
and micro-batch in flight (the block's input) instead of every intermediate of every block.

The blocks keep their modules and parameter names (their ``forward`` is wrapped on the instance, not the
module replaced), so checkpoints, exports and LoRA adapters are unaffected. The random state is restored for
the recomputation (``preserve_rng_state``), so dropout draws the same masks and the gradients equal those of
the plain stage: turning it on or off changes memory and time, not the numbers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from aqsgd.errors import SpecError

__all__ = ["checkpoint_blocks", "stage_blocks"]


def stage_blocks(stage: nn.Module) -> nn.Module | None:
    """The repeated blocks a stage holds (transformer layers, residual blocks), or None."""
    for name in ("layers", "blocks"):
        blocks = getattr(stage, name, None)
        if isinstance(blocks, (nn.ModuleList, nn.Sequential)) and len(blocks):
            return blocks
    return None


def checkpoint_blocks(stage: nn.Module) -> int:
    """Make every block of ``stage`` recompute its activations in the backward pass (while training with
    gradients; evaluation runs as before); returns the number of blocks."""
    blocks = stage_blocks(stage)
    if blocks is None:
        raise SpecError(f"--activation-checkpointing: {type(stage).__name__} has no blocks to recompute")
    for block in blocks:
        if getattr(block, "_aqsgd_checkpointed", False):
            continue
        plain = block.forward

        def forward(*args: Any, _plain: Any = plain, _block: nn.Module = block, **kwargs: Any) -> Any:
            if _block.training and torch.is_grad_enabled():
                return checkpoint(_plain, *args, use_reentrant=False, **kwargs)
            return _plain(*args, **kwargs)

        block.forward = forward
        block._aqsgd_checkpointed = True
    return len(blocks)
