"""The local runtime: every stage of a pipeline in one process, driven in a valid interleaving of their plans.

:class:`LocalPipeline` runs the same :class:`~aqsgd.pipeline.runner.StageRunner` as the distributed runtime,
with :class:`LocalTransport`'s in-memory FIFO channels in place of a network: the same numerics, no
concurrency.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from aqsgd.compress import Packet
from aqsgd.models.stage import Batch
from aqsgd.pipeline.compression import CompressionConfig
from aqsgd.pipeline.runner import Handle, StageRunner, StepStats, forward_plan
from aqsgd.pipeline.schedule import build_plans, execution_order
from aqsgd.schemes import Phase

__all__ = ["LocalPipeline", "LocalTransport"]


class _Done:
    def __init__(self, value: Any = None) -> None:
        self.value = value

    def wait(self, timeout: float | None = None) -> Any:
        return self.value


class _LocalRecv:
    def __init__(self, queue: collections.deque) -> None:
        self.queue = queue

    def wait(self, timeout: float | None = None) -> list[Packet]:
        if not self.queue:
            raise RuntimeError("local transport: receive before the matching send (schedule out of order)")
        return self.queue.popleft()


class LocalTransport:
    """In-memory FIFO channels between the stages of one process. Use :meth:`view` for one stage's side."""

    def __init__(self) -> None:
        self.queues: dict[tuple[int, int, int], collections.deque] = collections.defaultdict(
            collections.deque)

    def view(self, rank: int) -> _LocalView:
        return _LocalView(self, rank)


class _LocalView:
    def __init__(self, hub: LocalTransport, rank: int) -> None:
        self.hub, self.rank = hub, rank

    def isend(self, packets: Sequence[Packet], dst: int, channel: int) -> Handle:
        self.hub.queues[(self.rank, dst, channel)].append(list(packets))
        return _Done()

    def irecv(self, src: int, channel: int) -> Handle:
        return _LocalRecv(self.hub.queues[(src, self.rank, channel)])


class LocalPipeline:
    """All stages in one process, driven in a valid interleaving of their plans (same numerics as the
    distributed runtime, no concurrency)."""

    def __init__(self, stages: Sequence[nn.Module], compression: CompressionConfig, *, schedule: str = "1f1b",
                 device: torch.device | str = "cpu", autocast: torch.dtype | None = None) -> None:
        self.hub = LocalTransport()
        self.schedule = schedule
        self.runners = [
            StageRunner(m, i, len(stages), compression, self.hub.view(i), schedule=schedule, device=device,
                        autocast=autocast)
            for i, m in enumerate(stages)
        ]

    @property
    def num_stages(self) -> int:
        return len(self.runners)

    def step(self, microbatches: Sequence[Batch], phase: Phase | str = Phase.TRAIN, *,
             loss_scale: float = 1.0, keep_logits: bool = False) -> torch.Tensor:
        """One step of every stage (see :meth:`StageRunner.step`); returns the mean micro-batch loss."""
        phase = Phase(phase)
        s, m = self.num_stages, len(microbatches)
        if phase in (Phase.TRAIN, Phase.WARMUP):
            plans = build_plans(self.schedule, s, m)
        else:
            plans = [forward_plan(i, s, m) for i in range(s)]
        for r, plan in zip(self.runners, plans):
            r.begin_step(microbatches, phase, plan, loss_scale=loss_scale, keep_logits=keep_logits)
        for stage, action in execution_order(plans):
            self.runners[stage].run(action)
        losses = [r.end_step() for r in self.runners]
        loss = losses[-1]
        assert loss is not None
        return loss

    def stats(self) -> list[StepStats]:
        return [r.stats for r in self.runners]
