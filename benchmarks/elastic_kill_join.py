"""``python -m benchmarks.elastic_kill_join``: a replica killed mid-run and started again, against the same run.

Two runs of ``aqsgd train --dp-elastic`` on the diloco study's task (MiniLM on BBC, 2 stages x 2 replicas,
800 samples, 4 epochs = 200 steps, boundaries uncompressed, outer steps ``diloco:10:lr1:momentum0:q8`` (or
``--grad-sync``, e.g. the study's streamed setting), evaluated every 50 steps; with ``--replicas 4`` the study's ``minilm-bbc-dp4``: 1,600 samples, so that each
replica still sees 400 and the run is 200 steps), one after the other (never at once: they share the cores):

- ``plain``: uninterrupted;
- ``kill``: at replica 1's step ``--kill-at``, one of its stage processes is killed (SIGKILL); once its
  launcher has reported and ended, and replica 0 has trained ``--alone`` more steps alone, replica 1 is started
  again (``--dp-replica 1 --dp-lighthouse ADDR``) and joins at the next outer step.

Prints, per run, each finishing replica's steps, final evaluation and membership history, and the launch's
``replicas.json`` (who stopped, the steps missed, the error).
"""  # noqa: E501, RUF100 (line 1 is the --help description: __doc__.splitlines()[0])

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEFAULT_SYNC = "diloco:10:lr1:momentum0:q8"


def task(replicas: int = 2, seed: int = 0, sync: str = DEFAULT_SYNC) -> list[str]:
    """The training options of both runs: ``replicas`` replica pipelines of 2 stages, 400 samples each,
    outer steps ``sync``."""
    return ["--task", "bbc", "--model", "minilm", "--max-length", "64",
            "--max-train-samples", str(400 * replicas), "--max-eval-samples", "200", "--stages", "2",
            "--micro-batches", "2", "--micro-batch-size", "4", "--data-parallel", str(replicas),
            "--runtime", "distributed", "--epochs", "4", "--warmup-epochs", "0", "--lr", "2e-4",
            "--forward", "none", "--backward", "none", "--grad-sync", sync,
            "--dp-elastic", "--eval-every", "50", "--checkpoint-every", "0", "--no-progress",
            "--device", "cpu", "--seed", str(seed)]


def _step_of(run: Path) -> int:
    """The last training step in a run's metrics (0 before the first)."""
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    rows = [json.loads(line) for line in lines if line.startswith("{") and line.endswith("}")]
    return max((r.get("step", 0) for r in rows if r.get("kind") == "train"), default=0)


def _wait(what: Callable[[], Any], timeout_s: float = 3600.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (got := what()):
            return got
        time.sleep(0.5)
    raise TimeoutError(f"waited {timeout_s:.0f} s")


def _state(pid: int | str) -> tuple[str, int] | None:
    """``(state, parent pid)`` of a process, None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


def _children(pid: int) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and (s := _state(p)) and s[1] == pid]


def run(out: Path, mode: str, kill_at: int, alone: int, options: list[str]) -> None:
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "aqsgd", "train", *options, "--output-dir", str(out)]
    with open(out / f"{mode}.log", "w") as log:
        main = subprocess.Popen([*cmd, "--run-name", mode], stdout=log, stderr=subprocess.STDOUT)
        base = out / mode
        if mode == "kill":
            _wait(lambda: _step_of(base / "replica1") >= kill_at)
            launcher = int((base / "replica1.pid").read_text())
            victim = max(_children(launcher))
            print(f"kill stage process {victim} of replica 1 at its step {_step_of(base / 'replica1')}, "
                  f"{time.monotonic() - t0:.0f} s", flush=True)
            os.kill(victim, signal.SIGKILL)
            _wait(lambda: (s := _state(launcher)) is None or s[0] == "Z")
            gone = _step_of(base / "replica0")
            _wait(lambda: _step_of(base / "replica0") >= gone + alone)
            address = (base / "lighthouse.txt").read_text().strip()
            print(f"replica 1 started again at replica 0's step {_step_of(base / 'replica0')}, "
                  f"{time.monotonic() - t0:.0f} s", flush=True)
            with open(out / "again.log", "w") as again_log:
                again = subprocess.Popen([*cmd, "--run-name", "kill-again1", "--dp-replica", "1",
                                          "--dp-lighthouse", address],
                                         stdout=again_log, stderr=subprocess.STDOUT)
                again.wait()
        main.wait()
    print(f"{mode}: exit {main.returncode}, {time.monotonic() - t0:.0f} s", flush=True)
    for summary in sorted(out.glob(f"{mode}*/**/summary.json")):
        s = json.loads(summary.read_text())
        print(f"  {summary.parent.relative_to(out)}: steps {s['steps']}, eval {json.dumps(s['eval'])}, "
              f"elastic {json.dumps(s.get('elastic'))}")
    if (base / "replicas.json").exists():
        print("  replicas.json:", json.dumps(json.loads((base / "replicas.json").read_text())))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/elastic-kill-join",
                        help="folder of the two runs (default: %(default)s)")
    parser.add_argument("--kill-at", type=int, default=60, help="replica 1's step at which it is killed")
    parser.add_argument("--alone", type=int, default=20,
                        help="steps replica 0 trains alone before the restart")
    parser.add_argument("--replicas", type=int, default=2, help="replica pipelines (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="the runs' seed (default: %(default)s)")
    parser.add_argument("--grad-sync", default=DEFAULT_SYNC,
                        help="the outer steps, a diloco:... spec (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.replicas < 2:
        parser.error(f"--replicas must be at least 2 (replica 1 is the one killed), got {args.replicas}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for mode in ("plain", "kill"):
        run(out, mode, args.kill_at, args.alone, task(args.replicas, args.seed, args.grad_sync))


if __name__ == "__main__":
    main()
