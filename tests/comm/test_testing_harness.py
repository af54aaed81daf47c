"""``aqsgd.comm.testing.run_processes``, the harness of the multi-process tests: a rank that hangs is named
with its stack; a rank's result reaches the parent even where its teardown blocks."""

from __future__ import annotations

import time

import pytest

from aqsgd.comm.testing import ProcessTimeout, run_processes


def _hang_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(600)
    return rank


def _stuck_teardown(rank: int, world_size: int) -> int:
    import ctypes

    import torch.distributed as dist

    # a teardown that never returns and holds the GIL meanwhile (PyDLL calls do not release it)
    dist.destroy_process_group = lambda: ctypes.PyDLL(None).sleep(600)
    return rank * 10


@pytest.mark.slow
def test_a_rank_that_hangs_is_named_with_its_stack(capfd):
    with pytest.raises(ProcessTimeout, match=r"ranks \[1\] did not finish"):
        run_processes(_hang_on_rank_one, 2, timeout_s=12)
    assert "_hang_on_rank_one" in capfd.readouterr().err  # the stuck rank's stack, printed before the kill


@pytest.mark.slow
def test_results_arrive_even_where_the_teardown_blocks():
    t0 = time.monotonic()
    assert run_processes(_stuck_teardown, 2, timeout_s=60) == [0, 10]
    assert time.monotonic() - t0 < 45  # collected at once; the stuck children are killed after a grace
