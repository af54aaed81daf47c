"""Names and places of a checkpoint's files, this process's part in writing and reading them, and the
checkpoint's error."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch.distributed as dist

from aqsgd.errors import AqsgdError, PeerFailure
from aqsgd.pipeline.compression import BACKWARD_CHANNEL, FORWARD_CHANNEL

__all__ = [
    "ALGORITHM",
    "COMPLETE",
    "FORMAT",
    "MANIFEST",
    "STEP_DIR",
    "TRAINER",
    "VERSION",
    "CheckpointError",
    "PeerCheckpointError",
    "agree",
    "agreed",
    "raise_agreed",
    "channel_name",
    "one_line",
    "parse_scheme_dir",
    "per_replica_dir",
    "process_of",
    "rank_manifest",
    "relative",
    "replica_of",
    "scheme_dir",
]


class CheckpointError(AqsgdError, ValueError):
    """A checkpoint that is missing, incomplete, damaged or does not fit this run, or one that cannot be
    written."""


FORMAT = "aqsgd-checkpoint"
VERSION = 1
ALGORITHM = "sha256"
MANIFEST = "MANIFEST.json"
COMPLETE = "COMPLETE"
TRAINER = "trainer.json"
STEP_DIR = re.compile(r"step-\d{8,}")
_DIRECTIONS = {FORWARD_CHANNEL: "forward", BACKWARD_CHANNEL: "backward"}
_SCHEME_DIR = re.compile(r"b(\d+)-(forward|backward)-(sender|receiver)")


def rank_manifest(rank: int) -> str:
    return f"rank{rank}.manifest.json"


def channel_name(channel: int) -> str:
    """``"forward"`` or ``"backward"``: the name of a channel in folder names and messages."""
    return _DIRECTIONS[channel]


def scheme_dir(key: tuple[int, int, str]) -> str:
    """The folder name of a boundary scheme ``(boundary, channel, side)``:
    ``b<N>-forward|backward-<side>``."""
    b, channel, side = key
    return f"b{b}-{channel_name(channel)}-{side}"


def parse_scheme_dir(name: str) -> tuple[int, int, str] | None:
    m = _SCHEME_DIR.fullmatch(name)
    if m is None:
        return None
    channel = FORWARD_CHANNEL if m[2] == "forward" else BACKWARD_CHANNEL
    return int(m[1]), channel, m[3]


def per_replica_dir(stage_dir: Path, replica: int, data_parallel: int, *, outer: bool = False) -> Path:
    """Where this replica's own state of a stage lives: the stage folder itself without data parallelism;
    ``replica{r}/`` in it with replicas, and always with outer steps (``outer``: an elastic replica's run, a
    grid of one replica, keeps its own weights in ``replica0/`` beside the agreed ones)."""
    return stage_dir if data_parallel == 1 and not outer else stage_dir / f"replica{replica}"


def replica_of(engine: Any) -> tuple[int, int]:
    """``(replica, data_parallel)`` of this process's engine (``(0, 1)`` without a process grid)."""
    grid = getattr(engine, "grid", None)
    return (grid.replica, grid.data_parallel) if grid is not None else (0, 1)


def process_of(engine: Any) -> tuple[bool, int, int]:
    """``(distributed, rank, world size)`` of this process for checkpointing."""
    distributed = dist.is_initialized() and bool(getattr(engine, "distributed", False))
    return (True, dist.get_rank(), dist.get_world_size()) if distributed else (False, 0, 1)


class PeerCheckpointError(PeerFailure, CheckpointError):
    """The checkpoint error of another process (``rank``), raised by the processes that had none of their own:
    the launcher's forensics follows it to the process at fault, so that the run's one line names the stage
    that could not read or write its part, not whichever stage reported first."""


def agree(error: str | None, distributed: bool) -> str | None:
    """In a distributed run, the first error of any process (every process gets the same answer)."""
    return agreed(error, distributed)[0]


def agreed(error: str | None, distributed: bool) -> tuple[str | None, int | None]:
    """:func:`agree`, with the rank whose error it is (None without a distributed run or an error)."""
    if not distributed:
        return error, None
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next(((e, r) for r, e in enumerate(errors) if e is not None), (None, None))


def raise_agreed(error: str, rank: int | None, *, own: bool) -> None:
    """Raise the agreed checkpoint ``error`` of process ``rank``: as this process's own
    :class:`CheckpointError` where it is (``own``) or without a distributed run, else as a
    :class:`PeerCheckpointError` naming ``rank``."""
    if own or rank is None:
        raise CheckpointError(error)
    raise PeerCheckpointError(error, rank=rank)


_RUST_IO = re.compile(r'message: "([^"]+)"|I/O error: (.+?) \(os error \d+\)')


def one_line(exc: BaseException) -> str:
    """A one-line description of ``exc`` (library errors may span lines; safetensors wraps OS errors)."""
    if isinstance(exc, OSError) and exc.strerror:
        text = exc.strerror
    elif isinstance(exc, KeyError):
        text = f"no entry {exc.args[0]!r}" if exc.args else "missing entry"
    else:
        text = str(exc)
        m = _RUST_IO.search(text)
        # SafetensorError: 'Error while serializing: IoError(Os { code: 28, ..., message: "No space ..." })'
        if m:
            text = m[1] or m[2]
    text = " ".join(text.split())
    if not text:
        text = type(exc).__name__
    return text if len(text) <= 400 else text[:397] + "..."


def relative(path: Path, base: Path) -> str:
    try:
        return path.relative_to(base).as_posix()
    except ValueError:
        return str(path)
