"""One training run across the namespaces, apart from the namespaces themselves: its command line
(:func:`train_argv`), where each rank sits on the chain (:func:`snake_nodes`, :func:`sync_link_load`), its
processes while they train (:class:`NetemRun`, for fault injection from outside), how each ended
(:class:`StageOutcome`) and the steps it logged (:func:`train_rows`).
:meth:`~aqsgd.bench.netem.cluster.NetemCluster.run_train` starts it."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aqsgd.train.config import options

__all__ = ["NetemRun", "StageOutcome", "snake_nodes", "sync_link_load", "train_argv", "train_rows"]

log = logging.getLogger("aqsgd.bench.netem.cluster")  # the cluster's logger: one name for its messages


@dataclasses.dataclass
class StageOutcome:
    """How one rank's process ended: exit code (negative: killed by that signal; None: still running when the
    deadline passed and then killed), seconds from start to exit, its result, and for a failure the error it
    ended with (the last exception line of its log, e.g. ``aqsgd.errors.PeerTimeout: stage 1 did not ...``, or
    the ``aqsgd: error: ...`` line of the command) plus the tail of its log. ``result``: the run's
    ``summary.json`` for the rank that writes the metrics, ``{}`` for the others, when they exited cleanly."""

    stage: int  # the rank (the stage, without data parallelism)
    returncode: int | None
    elapsed_s: float
    result: dict[str, Any] | None
    error: str | None
    log_tail: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.result is not None


def train_argv(opts: Mapping[str, Any]) -> list[str]:
    """``aqsgd train`` options, given by their flat names (:meth:`~aqsgd.train.config.TrainConfig.of`), as its
    command line: ``{"max_length": 16, "progress": False, "layers": [2, 1]}`` is ``--max-length 16
    --no-progress --layers 2,1``; None is ``none``."""
    by_flat = {o.flat: o for o in options()}
    argv: list[str] = []
    for name, value in opts.items():
        if name not in by_flat:
            raise ValueError(f"unknown training option {name!r}; see `aqsgd train --help`")
        o = by_flat[name]
        if o.base is bool and value is not None:
            argv.append(o.flag if value else "--no-" + o.flag[2:])
        elif value is None:
            argv += [o.flag, "none"]
        elif o.is_list:
            argv += [o.flag, ",".join(str(v) for v in value)]
        else:
            argv += [o.flag, str(value)]
    return argv


def train_rows(run_dir: str | Path) -> list[dict[str, Any]]:
    """The ``"kind": "train"`` rows of a run's ``metrics.jsonl``, in file order (a resumed run appends after
    the rows it kept: a step can appear twice, the later row is the one that counts)."""
    text = (Path(run_dir) / "metrics.jsonl").read_text()
    return [row for row in map(json.loads, text.splitlines()) if row.get("kind") == "train"]


class NetemRun:
    """The processes of one :meth:`NetemCluster.run_train` while they run, for its ``during`` callback (fault
    injection from outside the processes)."""

    def __init__(self, procs: list[subprocess.Popen], started: float, run_dir: Path) -> None:
        self.procs = procs
        self.started = started
        self.run_dir = run_dir

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (default SIGKILL) to the rank's process (SIGSTOP freezes it: it keeps its connections
        open and answers nothing)."""
        log.info("sending signal %d to rank %d (pid %d)", sig, rank, self.procs[rank].pid)
        with contextlib.suppress(ProcessLookupError):
            self.procs[rank].send_signal(sig)

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def steps_done(self) -> int:
        """The last optimizer step in the run's ``metrics.jsonl`` (0 before the first; rows that an earlier
        run left in the directory count until the trainer truncates or replaces them)."""
        try:
            text = (self.run_dir / "metrics.jsonl").read_text()
        except FileNotFoundError:
            return 0
        lines = text.splitlines(keepends=True)
        rows = [json.loads(line) for line in lines if line.endswith("\n")]  # a line being written is left out
        return max((r["step"] for r in rows if r.get("kind") == "train"), default=0)

    def wait_for_step(self, step: int, *, timeout_s: float = 60.0) -> int:
        """Block until the metrics show optimizer step ``step`` done (e.g. to strike at a given step); returns
        the last step seen. Returns early when every process has exited; raises TimeoutError."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            done = self.steps_done()
            if done >= step or not self.running():
                return done
            time.sleep(0.02)
        raise TimeoutError(f"step {step} was not done within {timeout_s:g} s")


def snake_nodes(stages: int, replicas: int = 1) -> list[int]:
    """The chain node of each rank (``rank = replica * stages + stage``, :mod:`aqsgd.parallel.grid`):
    replicas lie along the chain alternately forwards and backwards (``0 1 | 3 2 | 4 5 ...``), so that every
    pipeline boundary is one dedicated link and replica ``r``'s last (or first) stage is the neighbour of
    replica ``r+1``'s."""
    if stages < 1 or replicas < 1:
        raise ValueError(f"stages and replicas must be >= 1, got {stages} and {replicas}")
    return [r * stages + (s if r % 2 == 0 else stages - 1 - s) for r in range(replicas)
            for s in range(stages)]


def sync_link_load(stages: int, replicas: int = 1) -> int:
    """How many stages' gradient synchronizations cross the busiest link of the chain under
    :func:`snake_nodes` (each stage's replicas talk along the stretch of chain between them): the factor by
    which the ideal model stretches the sync time. 0 without data parallelism."""
    if replicas < 2:
        return 0
    nodes = snake_nodes(stages, replicas)
    spans = [(min(g), max(g)) for g in ([nodes[r * stages + s] for r in range(replicas)]
                                        for s in range(stages))]
    return max(sum(lo <= link < hi for lo, hi in spans) for link in range(stages * replicas - 1))
