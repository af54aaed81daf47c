"""launch_local under faults: the process at fault is named in one line (details in a log file), a frozen
process does not hold the launcher, and a local run listens on loopback only.

Rank functions live at module level so that spawned children can import them.
"""

from __future__ import annotations

import fcntl
import glob
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aqsgd.comm.launch import RankOutcome, find_root_cause, launch_local
from aqsgd.comm.testing import child_processes, listening_sockets
from aqsgd.errors import StageFailedError

LOOPBACK_ADDRESSES = ("127.0.0.1", "::1")


# ---------------------------------------------------------------------------- rank functions
def _pipeline(stats_dir: str, timeouts: dict, faults: dict, steps: int = 100_000) -> int:
    """A forward-only pipeline over the Transport: rank r receives from r-1 and sends to r+1, ``steps`` times.
    ``faults[rank]`` at step 5: ``freeze`` (SIGSTOP itself), ``exit`` (os._exit(3)), ``raise`` (ValueError).
    A rank that fails writes the wall time of its failure to ``stats_dir/failed-RANK``."""
    import datetime

    import torch
    import torch.distributed as dist

    from aqsgd.comm import FORWARD, Transport
    from aqsgd.comm.launch import leave_process_group
    from aqsgd.compress import make_codec

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    fault = faults.get(rank)
    packet = make_codec("none").encode(torch.zeros(64))
    clean = False
    try:
        labels = {r: f"stage {r}" for r in range(world)}
        with Transport(timeout_s=timeouts.get(rank, 20.0), peer_labels=labels) as t:
            for step in range(steps):
                if step == 5 and fault == "freeze":
                    os.kill(os.getpid(), signal.SIGSTOP)
                if step == 5 and fault == "exit":
                    os._exit(3)
                if step == 5 and fault == "raise":
                    raise ValueError(f"boom at step {step}")
                x = t.recv(rank - 1, FORWARD) if rank > 0 else [packet]
                if rank < world - 1:
                    t.send(x, rank + 1, FORWARD)
        clean = True
    except Exception:
        with open(os.path.join(stats_dir, f"failed-{rank}"), "w") as f:
            f.write(repr(time.time()))
        raise
    finally:
        leave_process_group(clean=clean, timeout_s=10)
    return rank


def _listening(_: int) -> dict:
    """After a gloo all-reduce: the TCP sockets this process listens on, and (rank 0) its launcher's."""
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    t = torch.ones(1)
    dist.all_reduce(t)
    out = {"rank": dist.get_rank(), "sum": t.item(), "own": listening_sockets(),
           "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
           "launcher": listening_sockets(os.getppid()) if dist.get_rank() == 0 else None}
    dist.barrier()
    dist.destroy_process_group()
    return out


def _stage_name(rank: int) -> str:
    return f"stage {rank}"


# ---------------------------------------------------------------------------- faults
@pytest.mark.slow
def test_frozen_stage_is_named_and_does_not_hold_the_launcher(tmp_path):
    # stage 1 freezes (SIGSTOP). Stage 3 times out first (after 2 s), naming stage 2, which is alive but
    # blocked on stage 1; stage 2 times out next naming stage 1, stage 0 last. The first process to fail
    # (stage 3) is not at fault, nor the one it names: following the blame leads to the silent, stopped
    # stage 1. Before the fix the launcher named whoever exited first, and only returned after its 30 s
    # SIGTERM grace period.
    stats = tmp_path / "stats"
    stats.mkdir()
    log_path = tmp_path / "failure.log"
    with pytest.raises(StageFailedError) as info:
        launch_local(_pipeline, 4, str(stats), {3: 2.0, 2: 4.0, 0: 6.0}, {1: "freeze"},
                     rank_names=_stage_name, failure_log=log_path)
    returned = time.time()
    e = info.value
    assert e.rank == 1 and e.label == "stage 1"
    message = str(e)
    assert "\n" not in message
    assert message.startswith("stage 1 failed: stopped responding: its process was stopped (SIGSTOP)"), \
        message
    assert "stage 2 reported PeerTimeout: stage 1 (rank 1) did not send" in message, message
    assert message.endswith(f"(details: {log_path})")
    failed = {int(p.name.split("-")[1]): float(p.read_text()) for p in stats.iterdir()}
    assert sorted(failed) == [0, 2, 3]
    assert failed[3] < failed[2] < failed[0]  # the first to fail was stage 3
    late = returned - max(failed.values())
    assert late < 3.0, late  # promptly after the last healthy stage failed
    details = log_path.read_text()
    assert "process at fault: stage 3 (rank 3) -> stage 2 (rank 2) -> stage 1 (rank 1)" in details
    for rank in (0, 2, 3):
        assert f"== stage {rank} (rank {rank}): error" in details
    assert details.count("Traceback (most recent call last)") >= 3
    assert "== stage 1 (rank 1): hung: its process was stopped (SIGSTOP)" in details


def test_crashed_stage_is_named(tmp_path):
    with pytest.raises(StageFailedError) as info:
        launch_local(_pipeline, 3, str(tmp_path), {}, {1: "exit"}, rank_names=_stage_name,
                     failure_log=tmp_path / "failure.log")
    e = info.value
    assert e.rank == 1
    assert str(e).startswith("stage 1 failed: exited with code 3 without reporting an error"), str(e)
    assert "\n" not in str(e)


@pytest.mark.slow
def test_error_of_a_stage_is_named_with_its_traceback_in_the_log(tmp_path, caplog):
    caplog.set_level("DEBUG", logger="aqsgd.comm.launch")
    with pytest.raises(StageFailedError) as info:
        launch_local(_pipeline, 3, str(tmp_path), {}, {2: "raise"}, rank_names=_stage_name,
                     failure_log=tmp_path / "failure.log")
    e = info.value
    assert e.rank == 2 and e.reason == "ValueError: boom at step 5"
    assert str(e) == f"stage 2 failed: ValueError: boom at step 5 (details: {tmp_path / 'failure.log'})"
    details = (tmp_path / "failure.log").read_text()
    assert "== stage 2 (rank 2): error" in details and 'raise ValueError(f"boom at step {step}")' in details
    assert any("boom at step 5" in r.getMessage() and r.levelname == "DEBUG" for r in caplog.records)


def test_a_script_without_a_main_guard_is_told_to_add_one(tmp_path):
    # every spawned process re-imports the main module: a launch at import time would start again in each
    script = tmp_path / "unguarded.py"
    script.write_text("from aqsgd.comm.launch import launch_local\n\n\ndef work():\n    return 1\n\n\n"
                      "launch_local(work, 2)\n")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    # both ranks fail the same way; the earlier report names the rank, which either can be
    assert re.match(r"aqsgd\.errors\.StageFailedError: rank [01] failed: RuntimeError: launch_local was "
                    r"called again while a spawned process imported the main module", last), last
    assert 'if __name__ == "__main__":' in last


def test_default_names_come_from_the_peers_reports(tmp_path):
    # without rank_names, a stage named by a peer's PeerFailure/PeerTimeout keeps that name; the details go to
    # a temp file. The culprit freezes rather than exits: after an exit the elastic launcher tears the run
    # down at its next poll, and a peer that has not reported by then cannot name it (it is "rank 1" then);
    # a frozen process waits for the peer's report, so the name is there every time.
    with pytest.raises(StageFailedError) as info:
        launch_local(_pipeline, 2, str(tmp_path), {0: 2.0}, {1: "freeze"})
    e = info.value
    assert e.rank == 1 and str(e).startswith("stage 1 failed: stopped responding"), str(e)
    # rank 0 is named by no report, so it keeps its rank
    assert "; rank 0 reported PeerTimeout: stage 1 (rank 1) did not accept" in str(e), str(e)
    assert e.log_path and os.path.exists(e.log_path)
    os.remove(e.log_path)


# ---------------------------------------------------------------------------- loopback
def _non_loopback_interface() -> str | None:
    """A network interface with an IPv4 address other than loopback (where gloo would listen if told to)."""
    for _, name in socket.if_nameindex():
        if name.startswith("lo"):
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
        return name
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_local_run_listens_on_loopback_only(monkeypatch):
    # even told otherwise by the environment (GLOO_SOCKET_IFNAME of a real interface), processes started by
    # launch_local listen on loopback only, and so does the launcher (the rendezvous store)
    ifname = _non_loopback_interface()
    if ifname:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", ifname)
    out = launch_local(_listening, 3, 0)
    assert [r["rank"] for r in out] == [0, 1, 2] and all(r["sum"] == 3.0 for r in out)
    for r in out:
        assert r["own"], r  # gloo listens (and rank 0 hosts the workers' store)
        assert all(addr in LOOPBACK_ADDRESSES for addr, _ in r["own"]), r
        assert r["gloo_ifname"] in ("lo", "lo0")
    launcher = out[0]["launcher"]
    assert launcher and all(addr in LOOPBACK_ADDRESSES for addr, _ in launcher), launcher


# ---------------------------------------------------------------------------- the rule
def _err(rank, t, *blames, kind="PeerTimeout"):
    return RankOutcome(rank, "error", kind, "x", tuple(blames), t)


def test_root_cause_follows_blame_to_the_silent_stage():
    outcomes = {0: _err(0, 3.0, 1), 1: RankOutcome(1, "hung"), 2: _err(2, 2.0, 1), 3: _err(3, 1.0, 2)}
    cause = find_root_cause(outcomes)
    assert cause.rank == 1 and cause.path == [3, 2, 1] and not cause.cycle


def test_root_cause_is_an_error_of_its_own():
    outcomes = {0: _err(0, 1.0, 1), 1: _err(1, 1.1, kind="ValueError"), 2: _err(2, 1.0, 1)}
    assert find_root_cause(outcomes).rank == 1


def test_root_cause_of_a_cycle_is_the_one_named_first():
    # stage 0 timed out on stage 1 first; stage 1, when it came back, found stage 0 gone and blamed it
    outcomes = {0: _err(0, 4.0, 1), 1: _err(1, 12.0, 0, kind="PeerFailure"), 2: _err(2, 4.1, 1)}
    cause = find_root_cause(outcomes)
    assert cause.rank == 1 and cause.cycle


def test_root_cause_without_reports_is_the_first_exit():
    outcomes = {0: RankOutcome(0, "terminated"), 1: RankOutcome(1, "exited", detail="exited with code 3"),
                2: RankOutcome(2, "terminated")}
    assert find_root_cause(outcomes, first_exit=1).rank == 1
    assert find_root_cause(outcomes).rank == 1


def test_a_stage_stopped_by_the_launcher_points_to_the_first_exit():
    # stage 2 named stage 3, which the launcher had stopped because stage 0 crashed
    outcomes = {0: RankOutcome(0, "exited"), 1: RankOutcome(1, "terminated"), 2: _err(2, 1.0, 3),
                3: RankOutcome(3, "terminated")}
    cause = find_root_cause(outcomes, first_exit=0)
    assert cause.rank == 0 and cause.path == [2, 3, 0]


def test_a_stage_interrupted_by_the_tear_down_points_to_the_stage_that_died():
    # stage 1 was killed (SIGKILL); the launcher's SIGTERM reached stage 0 before it reported losing stage 1
    sigterm = RankOutcome(0, "error", "Interrupted", "interrupted", (), 1.0, signum=15)
    outcomes = {0: sigterm, 1: RankOutcome(1, "exited", detail="was killed by signal SIGKILL")}
    cause = find_root_cause(outcomes, first_exit=1)
    assert cause.rank == 1 and cause.path == [1]
    # a SIGTERM to one stage: that stage is the first to end, and the cause
    outcomes = {0: sigterm, 1: _err(1, 1.2, 0, kind="PeerFailure")}
    assert find_root_cause(outcomes, first_exit=0).rank == 0
    assert find_root_cause(outcomes).rank == 0


def test_a_stage_that_returned_while_a_peer_waited_is_at_fault():
    outcomes = {0: RankOutcome(0, "ok"), 1: _err(1, 1.0, 0, kind="PeerFailure")}
    assert find_root_cause(outcomes).rank == 0


# ---------------------------------------------------------------------------- the command line
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.slow
def test_cli_frozen_stage_ends_in_one_error_line(tmp_path):
    """`aqsgd train --runtime distributed` with stage 1 frozen mid-training: exit code 2 and exactly one
    `aqsgd: error: stage 1 ...` line, no traceback from the launcher or any stage, promptly."""
    cmd = [sys.executable, "-c", "import sys; from aqsgd.cli import main; sys.exit(main())",
           "train", "--task", "synthetic-lm", "--runtime", "distributed",
           "--stages", "2", "--model-layers", "2", "--max-length", "16", "--max-train-samples", "64",
           # epochs enough that the run is still going when a stage is frozen (32 steps can take under a
           # second)
           "--max-eval-samples", "8", "--micro-batches", "2", "--micro-batch-size", "2", "--epochs", "100",
           "--warmup-epochs", "0", "--timeout", "3", "--no-tensorboard", "--no-progress",
           "--output-dir", str(tmp_path / "out")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    frozen = None
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:  # until training is under way
            metrics = glob.glob(str(tmp_path / "out" / "*" / "metrics.jsonl"))
            if metrics and Path(metrics[0]).read_text().count("\n") >= 1:
                break
            time.sleep(0.1)
        stages = [p for p in child_processes(proc.pid)
                  if b"resource_tracker" not in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(stages) == 2, stages
        frozen = stages[1]  # started in rank order
        os.kill(frozen, signal.SIGSTOP)
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
        if frozen is not None:
            try:
                os.kill(frozen, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert proc.returncode == 2, (out, err)
    errors = [line for line in err.splitlines() if line.startswith("aqsgd: error:")]
    assert len(errors) == 1 and errors[0].startswith("aqsgd: error: stage 1 failed: stopped responding"), err
    assert "Traceback" not in err and "Traceback" not in out, err
    assert elapsed < 3 + 10 + 5, elapsed  # the stage timeout (3 s; gloo's is at least 10 s), then promptly
    log_path = errors[0].rsplit("(details: ", 1)[1].rstrip(")")
    assert "== stage 0 (rank 0): error" in Path(log_path).read_text()
    os.remove(log_path)
