"""Leaving the process group at the end of a job: a closing barrier after a clean finish, none after a
failure.

Rank functions live at module level so that spawned children can import them.
"""

from __future__ import annotations

import logging
import time

from aqsgd.comm.launch import leave_process_group
from aqsgd.comm.testing import run_processes


class _Remember(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _leave_rank(rank: int, world: int, clean_ranks: tuple[int, ...], timeout_s: float) -> dict:
    import torch
    import torch.distributed as dist

    handler = _Remember()
    logging.getLogger("aqsgd.comm.launch").addHandler(handler)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)  # the job's work
    start = time.monotonic()
    leave_process_group(clean=rank in clean_ranks, timeout_s=timeout_s)
    return {"sum": t.item(), "initialized": dist.is_initialized(), "warnings": handler.messages,
            "left_s": time.monotonic() - start}


def test_clean_finish_meets_at_a_barrier_and_destroys_the_group():
    out = run_processes(_leave_rank, 3, args=((0, 1, 2), 30.0), timeout_s=90)
    for r in out:
        assert r["sum"] == 3.0
        assert r["initialized"] is False
        assert r["warnings"] == []


def test_a_peer_that_leaves_without_the_barrier_does_not_hang_a_clean_rank():
    # rank 1 failed (no barrier); rank 0 waits at most the barrier's timeout, warns, and still leaves
    r0, r1 = run_processes(_leave_rank, 2, args=((0,), 3.0), timeout_s=90)
    assert r1["initialized"] is False and r1["warnings"] == []
    assert r0["initialized"] is False
    assert len(r0["warnings"]) == 1 and "closing barrier failed" in r0["warnings"][0]
    assert r0["left_s"] < 20
