"""SIGINT (Ctrl-C) and SIGTERM stop a run cleanly wherever they land, on a local run, the launcher of a
distributed run or one of its stages: one line saying where the run stands and which checkpoint continues it,
exit status 130 / 143, no traceback, no process left behind, the run directory unlocked."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aqsgd.comm.testing import child_processes
from aqsgd.train.rundir import RunDirLock

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals and /proc")


def _launcher_grace() -> float:
    """Seconds a distributed run may take to stop: PyTorch's launcher forwards the signal, then kills a stage
    that has not ended (one blocked in a collective on a peer that is gone) after its shutdown timeout: ours
    of 3 s from torch 2.12 on, its own 30 s before."""
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig

    return 20.0 if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)} else 45.0

LONG = ["--task", "synthetic-lm", "--stages", "2", "--max-train-samples", "64", "--max-eval-samples", "8",
        "--max-length", "12", "--micro-batches", "2", "--micro-batch-size", "4", "--epochs", "200",
        "--checkpoint-every", "2", "--eval-every", "0", "--no-progress", "--no-tensorboard"]


def _start(tmp_path, *extra):
    cmd = [sys.executable, "-m", "aqsgd.cli", "train", *LONG, *extra, "--output-dir", str(tmp_path),
           "--run-name", "run", "--cache-dir", str(tmp_path / "cache")]
    # its own session: a signal to its process group is what Ctrl-C in a terminal sends
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _wait_for_checkpoint(proc, run: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if any(run.glob("checkpoints/step-*[0-9]")) and (run / "metrics.jsonl").exists() and \
                (run / "metrics.jsonl").read_text().count("\n") >= 3:
            return
        time.sleep(0.1)
    raise AssertionError("training did not get under way")


def _stop(proc, send) -> tuple[str, float]:
    pids = [proc.pid, *child_processes(proc.pid)]
    t0 = time.monotonic()
    send()
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    elapsed = time.monotonic() - t0
    time.sleep(0.5)
    alive = [p for p in pids if Path(f"/proc/{p}").exists() and "Z" not in Path(f"/proc/{p}/stat").read_text()
             .rsplit(")", 1)[1].split()[0]]
    assert not alive, f"processes left behind: {alive}"
    return err, elapsed


def _check(err: str, code: int, rc: int, run: Path, signame: str, who: str = "") -> str:
    assert rc == code, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("aqsgd:")]
    assert len(lines) == 1, err[-3000:]
    for noise in ("Traceback", "terminate called", "SignalException", "KeyboardInterrupt"):
        assert noise not in err, err[-3000:]
    line = lines[0]
    assert line.startswith(f"aqsgd: {who}interrupted ({signame}) after step "), line
    newest = sorted(p for p in (run / "checkpoints").glob("step-*") if not p.name.endswith(".tmp"))[-1]
    assert line.endswith(f"the last complete checkpoint is {newest} (continue with `aqsgd train --resume "
                         f"{run}`)")
    RunDirLock(run).release()  # the run directory is unlocked (a held lock raises RunDirError)
    return line


def test_ctrl_c_on_a_local_run(tmp_path):
    proc = _start(tmp_path)
    _wait_for_checkpoint(proc, tmp_path / "run")
    err, elapsed = _stop(proc, lambda: os.killpg(proc.pid, signal.SIGINT))
    line = _check(err, 130, proc.returncode, tmp_path / "run", "SIGINT")
    assert " of 1600; " in line and elapsed < 20
    step = int(line.split("after step ")[1].split(" ")[0])
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == step  # the last step it names is the last one trained and logged


def test_sigterm_on_a_local_run(tmp_path):
    proc = _start(tmp_path)
    _wait_for_checkpoint(proc, tmp_path / "run")
    err, _ = _stop(proc, lambda: proc.send_signal(signal.SIGTERM))
    _check(err, 143, proc.returncode, tmp_path / "run", "SIGTERM")


@pytest.mark.slow
def test_ctrl_c_on_a_distributed_run(tmp_path):
    """Ctrl-C reaches the launcher and every stage process at once (one process group)."""
    proc = _start(tmp_path, "--runtime", "distributed")
    _wait_for_checkpoint(proc, tmp_path / "run")
    err, elapsed = _stop(proc, lambda: os.killpg(proc.pid, signal.SIGINT))
    _check(err, 130, proc.returncode, tmp_path / "run", "SIGINT")
    assert elapsed < _launcher_grace()


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_every_stage(tmp_path):
    """Only the launcher gets it (a job scheduler's stop): it forwards it to the stages and ends with them."""
    proc = _start(tmp_path, "--runtime", "distributed")
    _wait_for_checkpoint(proc, tmp_path / "run")
    err, elapsed = _stop(proc, lambda: proc.send_signal(signal.SIGTERM))
    _check(err, 143, proc.returncode, tmp_path / "run", "SIGTERM")
    assert elapsed < _launcher_grace()


@pytest.mark.slow
def test_sigterm_to_one_stage_names_it(tmp_path):
    proc = _start(tmp_path, "--runtime", "distributed", "--timeout", "20")
    _wait_for_checkpoint(proc, tmp_path / "run")
    stages = [p for p in child_processes(proc.pid)
              if b"resource_tracker" not in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(stages) == 2, stages
    err, elapsed = _stop(proc, lambda: os.kill(stages[1], signal.SIGTERM))  # started in rank order
    _check(err, 143, proc.returncode, tmp_path / "run", "SIGTERM", who="stage 1 was ")
    assert elapsed < _launcher_grace()
