"""When a run writes its checkpoints, and writing one safely among the run's processes.

Checkpoints are written every epoch (``checkpoint_every`` None), every N optimizer steps, never (0), and
besides those at least every ``checkpoint_minutes`` (so that a stopped run loses minutes, not an epoch), and
at the end of training. Every process writes its own stages' files of a checkpoint together
(:func:`~aqsgd.train.checkpoint.save_checkpoint`); a signal that arrives meanwhile is raised once the
checkpoint is complete.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from aqsgd.comm.transport import naming_peer_failures
from aqsgd.interrupts import signals_held
from aqsgd.train.checkpoint import save_checkpoint

if TYPE_CHECKING:
    from aqsgd.comm import Transport
    from aqsgd.train.config import RunSection
    from aqsgd.train.engine import PipelineEngine

__all__ = ["Checkpointer"]

log = logging.getLogger(__name__)


class Checkpointer:
    """The checkpoints of one process of a run in ``run_dir``. ``suspects``: the stages a failed collective
    may have lost, for messages."""

    def __init__(self, run_dir: Path, run: RunSection, *, distributed: bool, transport: Transport | None,
                 suspects: Sequence[str]) -> None:
        self.run_dir, self.run, self.distributed = run_dir, run, distributed
        self.transport, self.suspects = transport, list(suspects)
        self.last = -1  # the step of the last checkpoint written or loaded
        self._at = time.monotonic()  # --checkpoint-minutes counts from here

    def restart_clock(self) -> None:
        """The timed checkpoints count from now (the start of training)."""
        self._at = time.monotonic()

    def due(self, step: int) -> bool:
        """Whether a checkpoint is due after optimizer step ``step``: every ``checkpoint_every`` steps, or
        ``checkpoint_minutes`` after the last one. Every process must call it after every step: distributed,
        the processes agree on the time (one process's clock suffices), so that all write it together."""
        every = self.run.checkpoint_every
        if every and step % every == 0:
            return True
        minutes = self.run.checkpoint_minutes
        if not minutes or every == 0:
            return False
        due = time.monotonic() - self._at >= 60 * minutes
        if self.distributed:
            flag = torch.tensor([1.0 if due else 0.0])
            with naming_peer_failures(self.transport, "deciding on a timed checkpoint", self.suspects):
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            due = bool(flag.item())
        return due

    def save(self, step: int, engine: PipelineEngine, state: dict[str, Any],
             resync: Callable[[], None]) -> None:
        """Write the checkpoint of ``step`` (``state``: the trainer's part), then ``resync`` the processes."""
        with signals_held():
            with naming_peer_failures(self.transport, f"the checkpoint of step {step}", self.suspects):
                path = save_checkpoint(self.run_dir, step, engine, state, keep=self.run.keep_checkpoints)
                resync()
            self.last = step
            self._at = time.monotonic()
            log.info("checkpoint %s", path)
