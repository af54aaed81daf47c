"""Stage placement across machines (``AQSGD_NODE_RANK``) and the stage prefix on a stage process's log lines.

The end-to-end tests start ``aqsgd train`` processes the way torchrun starts them (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT``, ``LOCAL_RANK``, ``GROUP_RANK``), with ranks deliberately shuffled against
the node ranks, and check which stage each process ran.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import socket
import subprocess
import sys

import pytest

from aqsgd.comm.launch.placement import NODE_RANK_ENV, Claim, positions
from aqsgd.comm.testing import free_port
from aqsgd.errors import SpecError
from aqsgd.logs import prefixed
from aqsgd.parallel.grid import GridLayout


def _claims(*rows: tuple[int, str | None, int]) -> list[Claim]:
    """One claim per started rank (in order): ``(machine number, node rank, local rank)``."""
    return [Claim(rank=r, host=f"host{m}", machine=f"host{m}/group {m}", node_rank=node, local_rank=local)
            for r, (m, node, local) in enumerate(rows)]


# ---------------------------------------------------------------------------- positions
def test_without_node_ranks_every_process_keeps_its_rank():
    assert positions(_claims((1, None, 0), (0, None, 0), (1, None, 1))) == [0, 1, 2]


def test_one_process_per_machine_takes_its_node_rank():
    assert positions(_claims((0, "2", 0), (1, "0", 0), (2, "1", 0))) == [2, 0, 1]


def test_machines_in_node_rank_order_then_local_rank():
    # machine 0 (node 1) holds started ranks 0 and 3, machine 1 (node 0) ranks 1 and 2, local ranks crossed
    assert positions(_claims((0, "1", 1), (1, "0", 1), (1, "0", 0), (0, "1", 0))) == [3, 1, 0, 2]


def test_one_machine_keeps_the_order_of_its_local_ranks():
    # the local launcher: one machine; a node rank set in the environment changes nothing
    assert positions(_claims((0, "0", 0), (0, "0", 1), (0, "0", 2))) == [0, 1, 2]


def test_two_machines_with_one_node_rank_are_named():
    with pytest.raises(SpecError, match=r"AQSGD_NODE_RANK=1 is set on 2 machines: host0 \(rank 0\), "
                                        r"host2 \(ranks 2, 3\); give each machine its own node rank 0\.\.2$"):
        positions(_claims((0, "1", 0), (1, "0", 0), (2, "1", 0), (2, "1", 1)))


def test_a_gap_in_the_node_ranks_is_named():
    with pytest.raises(SpecError, match=r"leaves node rank\(s\) 1 unused \(host0 \(rank 0\): 0; host1 "
                                        r"\(rank 1\): 2\); number the 2 machines 0\.\.1$"):
        positions(_claims((0, "0", 0), (1, "2", 0)))


def test_a_node_rank_on_some_machines_only_is_refused():
    with pytest.raises(SpecError, match=r"set on some machines but not on host1 \(ranks 1, 2\)"):
        positions(_claims((0, "0", 0), (1, None, 0), (1, None, 1)))


@pytest.mark.parametrize("bad", ["x", "-1", "1.5", ""])
def test_a_node_rank_that_is_not_one_is_named(bad):
    with pytest.raises(SpecError, match=rf"AQSGD_NODE_RANK='{re.escape(bad)}' on host1 \(rank 1\) is not a "):
        positions(_claims((0, "0", 0), (1, bad, 0)))


@pytest.mark.parametrize("empty", ["", "  "])
def test_an_empty_node_rank_is_unset(monkeypatch, empty):
    # AQSGD_NODE_RANK=$NODE with NODE unset in a launch script: no placement asked for, as when it is unset
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv(NODE_RANK_ENV, empty)
    claim = Claim.here()
    assert claim.node_rank is None
    assert positions([dataclasses.replace(claim, rank=0), claim]) == [0, 1]
    monkeypatch.setenv(NODE_RANK_ENV, "0")
    assert Claim.here().node_rank == "0"


def test_node_ranks_that_differ_within_a_machine_are_refused():
    with pytest.raises(SpecError, match=r"differs between the processes of host0: 0 \(rank 0\), "
                                        r"1 \(rank 1\)"):
        positions(_claims((0, "0", 0), (0, "1", 1)))


def test_a_process_that_never_publishes_its_claim_is_named():
    # torchrun's agent hosts the store, so every process reaches it; one that died before placement is missing
    import datetime

    import torch.distributed as dist

    from aqsgd.comm.launch.placement import _exchange
    from aqsgd.errors import ConfigMismatchError

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=1))
    mine = _claims((0, "0", 0))[0]
    with pytest.raises(ConfigMismatchError, match=r"^placing the stages: rank\(s\) 1, 2 of 3 did not arrive "
                                                  r"within 1 s; start all 3 processes"):
        _exchange(dist.PrefixStore("test/", store), mine, 3, 1.0)


# ---------------------------------------------------------------------------- log prefix
def test_prefixed_puts_the_stage_before_every_message_and_restores_the_format():
    root = logging.getLogger()
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(self.format(record))

    handler = Keep()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    try:
        logger = logging.getLogger("aqsgd.test_placement")
        logger.setLevel(logging.INFO)
        with prefixed(GridLayout(4, 2).log_prefix(5)):
            logger.info("step %d", 3)
            with prefixed("[inner]"):
                logger.warning("replaced")
            logger.info("outer again")
        logger.info("plain")
    finally:
        root.removeHandler(handler)
    assert records == ["INFO aqsgd.test_placement: [stage 1/4 replica 1] step 3",
                       "WARNING aqsgd.test_placement: [inner] replaced",
                       "INFO aqsgd.test_placement: [stage 1/4 replica 1] outer again",
                       "INFO aqsgd.test_placement: plain"]


def test_log_prefix_names_stage_and_replica():
    assert GridLayout(4).log_prefix(1) == "[stage 1/4 replica 0]"
    assert GridLayout(2, 3).log_prefix(5) == "[stage 1/2 replica 2]"


# ---------------------------------------------------------------------------- torchrun-like processes
# one pipeline of two stages, a few steps of a tiny model
TRAIN = ["train", "--task", "synthetic-lm", "--runtime", "distributed", "--stages", "2",
         "--model-layers", "2", "--max-length", "12", "--max-train-samples", "32", "--max-eval-samples", "8",
         "--micro-batches", "2", "--micro-batch-size", "2", "--epochs", "1", "--warmup-epochs", "0",
         "--timeout", "60", "--no-tensorboard", "--no-progress"]


def _run_ranks(tmp_path, seats: list[tuple[int, int, str | None]], *extra: str,
               timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """``aqsgd train`` in one process per started rank, as torchrun starts them: ``seats[rank]`` is that
    process's ``(GROUP_RANK, LOCAL_RANK, AQSGD_NODE_RANK)``. Returns the finished processes in rank order."""
    port, world = free_port(), len(seats)
    local_sizes = {g: sum(1 for s in seats if s[0] == g) for g, _, _ in seats}
    cmd = [sys.executable, "-m", "aqsgd.cli", *TRAIN, *extra, "--output-dir", str(tmp_path),
           "--run-name", "run", "--cache-dir", str(tmp_path / "cache")]
    procs = []
    for rank, (group, local, node) in enumerate(seats):
        env = {k: v for k, v in os.environ.items() if k != NODE_RANK_ENV}
        env.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(local_sizes[group]), GROUP_RANK=str(group),
                   GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
        if node is not None:
            env[NODE_RANK_ENV] = node
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    done = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return done


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="gloo on the loopback interface 'lo'")
@pytest.mark.slow
def test_stages_follow_the_node_ranks_of_the_machines(tmp_path):
    # two emulated machines of two processes, ranks and local ranks shuffled against the node ranks so that
    # every process lands elsewhere than its started rank would put it: machine A (group 0, node 1) holds
    # started ranks 0 (local 1) and 3 (local 0), machine B (group 1, node 0) ranks 1 (local 0) and 2 (local 1)
    seats = [(0, 1, "1"), (1, 0, "0"), (1, 1, "0"), (0, 0, "1")]
    want = {0: (1, 1), 1: (0, 0), 2: (1, 0), 3: (0, 1)}  # started rank -> (stage, replica)
    assert all(want[r] != GridLayout(2, 2).coords(r) for r in want)
    done = _run_ranks(tmp_path, seats, "--data-parallel", "2")
    for rank, p in enumerate(done):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{p.stderr[-3000:]}"
    host = socket.gethostname()
    for rank, p in enumerate(done):
        stage, replica = want[rank]
        prefix = f"[stage {stage}/2 replica {replica}]"
        lines = [line for line in p.stderr.splitlines() if re.match(r"\d{4}-\d\d-\d\d ", line)]
        stray = [line for line in lines if prefix not in line]
        assert lines and not stray, f"rank {rank}: a line without {prefix}: {stray[:1]}\n{p.stderr[-3000:]}"
        position = replica * 2 + stage
        assert (f"{prefix} {NODE_RANK_ENV}={seats[rank][2]} on {host}: rank {position} of 4 (started as rank "
                f"{rank})") in p.stderr
        # only the last stage of replica 0 writes the metrics: it logs the evaluation and prints the summary
        writes = (stage, replica) == (1, 0)
        evaluates, prints = "eval step" in p.stderr, bool(p.stdout.strip())
        assert evaluates is writes, f"rank {rank}: logs an evaluation: {evaluates}\n{p.stderr[-3000:]}"
        assert prints is writes, f"rank {rank}: prints a summary: {prints}\n{p.stdout[-3000:]}"
    assert (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="gloo on the loopback interface 'lo'")
@pytest.mark.slow
def test_colliding_node_ranks_stop_every_process_with_one_line(tmp_path):
    done = _run_ranks(tmp_path, [(0, 0, "0"), (1, 0, "1"), (2, 0, "1"), (3, 0, "2")], "--data-parallel", "2",
                      timeout=120)
    host = socket.gethostname()
    for rank, p in enumerate(done):
        assert p.returncode == 2, f"rank {rank}:\n{p.stderr[-3000:]}"
        errors = [line for line in p.stderr.splitlines() if line.startswith("aqsgd:")]
        assert errors == [f"aqsgd: error: {NODE_RANK_ENV}=1 is set on 2 machines: {host} (rank 1), {host} "
                          f"(rank 2); give each machine its own node rank 0..3"], p.stderr[-3000:]
        assert "Traceback" not in p.stderr


@pytest.mark.slow
def test_stage_processes_of_the_local_launcher_prefix_their_log_lines(tmp_path):
    # no node rank: every process keeps its rank (nothing said about placement), and each log line of a
    # stage process names its stage
    cmd = [sys.executable, "-m", "aqsgd.cli", *TRAIN, "--output-dir", str(tmp_path), "--run-name", "run",
           "--cache-dir", str(tmp_path / "cache")]
    env = {k: v for k, v in os.environ.items() if k != NODE_RANK_ENV}
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    stage_lines = [line for line in p.stderr.splitlines() if "[pid " in line]
    assert stage_lines, p.stderr[-3000:]
    tags = {re.search(r"\[pid \d+\] (\[stage \d/2 replica 0\]) ", line)[1] for line in stage_lines}
    assert tags == {"[stage 0/2 replica 0]", "[stage 1/2 replica 0]"}, p.stderr[-3000:]
    assert NODE_RANK_ENV not in p.stderr
    assert any("[stage 1/2 replica 0] eval step" in line for line in stage_lines)
