"""The 2-D process grid of pipeline x data parallelism: ``S`` stages times ``D`` replicas.

Layout
------
``rank = replica * S + stage``: the ranks of one replica pipeline are contiguous (replica 0 is ranks
``0..S-1``, replica 1 is ``S..2S-1``, ...), so with ``D = 1`` the layout is exactly the pipeline-only one
(rank = stage), and a launcher that places consecutive ranks on one host puts a whole pipeline there.
The data-parallel group of stage ``s`` is ``[s, S + s, 2S + s, ...]`` (one rank per replica, in replica
order, so the group rank of a process equals its replica index).

A rank is a position in this grid. Under torchrun it is not necessarily the rank torchrun gave the process:
a job's processes first agree on who takes which rank, following the node rank each machine asks for
(``AQSGD_NODE_RANK``, see :mod:`aqsgd.comm.launch.placement`), and join the default group with it; so
everything here (and every user of ``dist.get_rank()``) sees the placed rank.

Groups
------
:meth:`ProcessGrid.build` creates, with ``torch.distributed.new_group``, first the ``S`` data-parallel
groups in stage order, then the ``D`` pipeline groups in replica order. Every rank creates every group in
that order (torch.distributed requires all ranks to take part in each ``new_group`` call, members or not)
and keeps the two it belongs to. Both use the world group's backend. :meth:`ProcessGrid.new_dp_group` builds
another set of data-parallel groups on a backend of their own (NCCL for the gradient sync of a GPU run, see
:mod:`aqsgd.comm.device`). :class:`GridLayout` is the same arithmetic without any process group, for planning
and tests.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from typing import Any

import torch
import torch.distributed as dist

from aqsgd.errors import ConfigMismatchError

__all__ = ["GridLayout", "ProcessGrid", "check_same_settings"]


@dataclasses.dataclass(frozen=True)
class GridLayout:
    """Rank arithmetic of ``num_stages x data_parallel`` processes (see the module docstring)."""

    num_stages: int
    data_parallel: int = 1

    def __post_init__(self) -> None:
        for name in ("num_stages", "data_parallel"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @classmethod
    def for_world(cls, world_size: int, num_stages: int, data_parallel: int) -> GridLayout:
        """The layout, after checking that ``world_size == num_stages * data_parallel``."""
        layout = cls(num_stages, data_parallel)
        if world_size != layout.world_size:
            raise ConfigMismatchError(
                f"{world_size} processes for {num_stages} stages x {data_parallel} data-parallel replicas; "
                f"start exactly {layout.world_size} (one per stage and replica)")
        return layout

    @property
    def world_size(self) -> int:
        return self.num_stages * self.data_parallel

    def rank(self, stage: int, replica: int) -> int:
        if not (0 <= stage < self.num_stages and 0 <= replica < self.data_parallel):
            raise ValueError(f"no (stage {stage}, replica {replica}) in a "
                             f"{self.num_stages}x{self.data_parallel} grid")
        return replica * self.num_stages + stage

    def coords(self, rank: int) -> tuple[int, int]:
        """``(stage, replica)`` of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        replica, stage = divmod(rank, self.num_stages)
        return stage, replica

    def rank_of_stage(self, replica: int) -> list[int]:
        """The global ranks of replica ``replica``'s pipeline, in stage order."""
        return [self.rank(s, replica) for s in range(self.num_stages)]

    def dp_ranks(self, stage: int) -> list[int]:
        """The global ranks holding stage ``stage``, in replica order (its data-parallel group)."""
        return [self.rank(stage, r) for r in range(self.data_parallel)]

    def label(self, rank: int) -> str:
        stage, replica = self.coords(rank)
        return f"stage {stage}" if self.data_parallel == 1 else f"stage {stage} replica {replica}"

    def log_prefix(self, rank: int) -> str:
        """What every log message of ``rank``'s process starts with: ``[stage 1/4 replica 0]`` (the stage's
        index of the number of stages, the replica's index)."""
        stage, replica = self.coords(rank)
        return f"[stage {stage}/{self.num_stages} replica {replica}]"


class ProcessGrid:
    """This process's place in the grid and its two process groups (see the module docstring).

    Attributes: ``layout``, ``rank``, ``stage``, ``replica``, ``dp_group`` (the replicas of this stage),
    ``pipeline_group`` (the stages of this replica), ``rank_of_stage`` (this replica's pipeline ranks).
    """

    def __init__(self, layout: GridLayout, rank: int, dp_group: Any, pipeline_group: Any) -> None:
        self.layout = layout
        self.rank = rank
        self.stage, self.replica = layout.coords(rank)
        self.dp_group = dp_group
        self.pipeline_group = pipeline_group
        self.rank_of_stage = layout.rank_of_stage(self.replica)

    @classmethod
    def build(cls, num_stages: int, data_parallel: int, *, timeout_s: float | None = None) -> ProcessGrid:
        """Collective: every rank of the default group must call it with the same arguments. ``timeout_s``:
        how long a collective of the new groups waits for a silent peer (torch's default for new groups is
        30 minutes, not the world group's timeout)."""
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call dist.init_process_group first")
        layout = GridLayout.for_world(dist.get_world_size(), num_stages, data_parallel)
        rank = dist.get_rank()
        stage, replica = layout.coords(rank)
        dp_group = pipeline_group = None
        for s in range(layout.num_stages):
            group = new_group(layout.dp_ranks(s), timeout_s)
            if s == stage:
                dp_group = group
        for r in range(layout.data_parallel):
            group = new_group(layout.rank_of_stage(r), timeout_s)
            if r == replica:
                pipeline_group = group
        return cls(layout, rank, dp_group, pipeline_group)

    @property
    def num_stages(self) -> int:
        return self.layout.num_stages

    @property
    def data_parallel(self) -> int:
        return self.layout.data_parallel

    def new_dp_group(self, backend: str, *, timeout_s: float | None = None) -> Any:
        """Collective (every rank, same arguments): the ``S`` data-parallel groups again, in stage order, with
        ``backend`` (a name or a ``cpu:gloo,cuda:nccl`` string); returns this rank's."""
        mine = None
        for s in range(self.layout.num_stages):
            group = new_group(self.layout.dp_ranks(s), timeout_s, backend=backend)
            if s == self.stage:
                mine = group
        return mine

    def peer_labels(self) -> dict[int, str]:
        """A name for every rank, for error messages (``stage 1 replica 0``)."""
        return {r: self.layout.label(r) for r in range(self.layout.world_size)}

    def __repr__(self) -> str:
        return (f"ProcessGrid(rank={self.rank}, stage={self.stage}, replica={self.replica}, "
                f"{self.num_stages}x{self.data_parallel})")


def new_group(ranks: list[int], timeout_s: float | None = None, *, backend: str | None = None) -> Any:
    """``dist.new_group(ranks)`` on ``backend`` (None: the world group's) whose collectives give up after
    ``timeout_s`` seconds (None: torch's default)."""
    kw: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
    if backend is not None:
        kw["backend"] = backend
    return dist.new_group(ranks=ranks, **kw)


def check_same_settings(settings: dict[str, Any], group: Any = None) -> None:
    """All-gather every rank's settings (JSON bytes, no pickle) and raise ConfigMismatchError on any
    difference from rank 0's, naming the setting and the ranks."""
    text = json.dumps(settings, sort_keys=True).encode()
    world = dist.get_world_size(group)
    size = torch.tensor([len(text)], dtype=torch.long)
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    buf = torch.zeros(longest, dtype=torch.uint8)
    buf[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    bufs = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(bufs, buf, group=group)
    every = [json.loads(bytes(b[: int(s.item())].tolist())) for b, s in zip(bufs, sizes)]
    problems = []
    for rank, other in enumerate(every[1:], start=1):
        for key in sorted(set(every[0]) | set(other)):
            if every[0].get(key) != other.get(key):
                problems.append(f"{key}: rank 0 has {every[0].get(key)!r}, rank {rank} has "
                                f"{other.get(key)!r}")
    if problems:
        raise ConfigMismatchError("stage processes were started with different settings: "
                                  + "; ".join(problems[:8]))
