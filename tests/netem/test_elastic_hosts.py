"""Replicas that come and go on two machines: ``--dp-elastic`` across network namespaces.

Two namespaces joined by a veth link stand for two machines (10.77.0.1 and 10.77.0.2). The lighthouse and
replica 0 run on the first; replica 1 is started later on the second and joins: it reaches replica 0's
manager, takes its state over the stages' gloo groups and averages with it across the link, and both end
with the same weights. Each replica is a plain ``aqsgd train --dp-replica R --dp-lighthouse ADDR`` (the local
launcher spawning its stage processes), so every address a replica listens on and tells its peers is its
machine's address on the route to the lighthouse, and nothing of it listens on loopback alone or on every
interface. Needs root, iproute2 and torchft; skipped elsewhere with the reason."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from aqsgd.bench.netem import NetemCluster, netem_unavailable_reason
from aqsgd.bench.netem.runs import train_argv
from aqsgd.parallel.elastic import elastic_available
from aqsgd.train.rundir import last_logged_step

_REASON = netem_unavailable_reason() or (None if elastic_available() else
                                         "torchft (the elastic extra) not installed")
pytestmark = [pytest.mark.netem, pytest.mark.slow,
              pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

STEPS = 120

# the lighthouse, on the first machine's address: prints its address, then serves until killed
_LIGHTHOUSE = """
import sys, time
from aqsgd.parallel.elastic import Lighthouse
lighthouse = Lighthouse(min_replicas=1, heartbeat_timeout_s=5.0, bind=sys.argv[1] + ":0")
print(lighthouse.address, flush=True)
time.sleep(3600)
"""


def _options(tmp_path: Path, replica: int, lighthouse: str) -> dict:
    return {"task": "synthetic-lm", "model": "tiny-llama", "model_layers": 4, "hidden_size": 32,
            "vocab_size": 64, "max_length": 16, "max_train_samples": 96, "max_eval_samples": 8, "stages": 2,
            "layers": [2, 2], "micro_batches": 2, "micro_batch_size": 2, "forward": "delta:q2",
            "backward": "direct:q4", "warmup_epochs": 0, "epochs": 40, "max_steps": STEPS, "lr": 3e-3,
            "lr_warmup": 0.0, "runtime": "distributed", "data_parallel": 2, "grad_sync": "diloco:4:q8",
            "timeout": 20.0, "eval_every": 0, "checkpoint_every": STEPS, "output_dir": str(tmp_path / "runs"),
            "run_name": f"replica{replica}", "progress": False, "tensorboard": False, "device": "cpu",
            "link": "1gbit,150ms", "dp_elastic": True, "dp_replica": replica, "dp_lighthouse": lighthouse,
            "cache_dir": str(tmp_path / f"cache{replica}")}


def _step_of(run: Path) -> int:
    return last_logged_step(run) or 0


def test_a_replica_on_another_machine_joins(tmp_path):
    from aqsgd.comm.testing import child_processes, listening_sockets

    with NetemCluster(2) as cluster:
        first, second = cluster.address(0), cluster.address(1)
        server = cluster.popen(0, [sys.executable, "-c", _LIGHTHOUSE, first], stdout=subprocess.PIPE,
                               text=True)
        assert server.stdout is not None
        lighthouse = server.stdout.readline().strip()
        assert lighthouse.startswith(f"http://{first}:"), lighthouse
        logs = {r: open(tmp_path / f"replica{r}.log", "w") for r in (0, 1)}  # noqa: SIM115 (closed below)
        try:
            argv = {r: [sys.executable, "-m", "aqsgd", "train",
                        *train_argv(_options(tmp_path, r, lighthouse))] for r in (0, 1)}
            replicas = {0: cluster.popen(0, argv[0], stdout=logs[0], stderr=subprocess.STDOUT)}
            deadline = time.monotonic() + 180
            while _step_of(tmp_path / "runs" / "replica0") < 8:  # replica 0 trains alone for a while
                assert replicas[0].poll() is None and time.monotonic() < deadline, \
                    (tmp_path / "replica0.log").read_text()[-3000:]
                time.sleep(0.2)
            replicas[1] = cluster.popen(1, argv[1], stdout=logs[1], stderr=subprocess.STDOUT)
            # while both train: every socket of every stage process listens on its machine's address
            deadline = time.monotonic() + 180
            while _step_of(tmp_path / "runs" / "replica1") < 2:
                assert replicas[1].poll() is None and time.monotonic() < deadline, \
                    (tmp_path / "replica1.log").read_text()[-3000:]
                time.sleep(0.2)
            listening = {r: [s for pid in child_processes(replicas[r].pid) for s in listening_sockets(pid)]
                         for r in (0, 1)}
            for r, host in ((0, first), (1, second)):
                assert listening[r] and all(a == host for a, _ in listening[r]), (r, listening[r])
            for r in (0, 1):
                assert replicas[r].wait(300) == 0, (tmp_path / f"replica{r}.log").read_text()[-3000:]
        finally:
            for f in logs.values():
                f.close()
            server.kill()
    runs = tmp_path / "runs"
    joined = json.loads((runs / "replica1" / "summary.json").read_text())
    at = joined["elastic"]["joined_at"]
    assert at is not None and at % 4 == 0 and joined["steps"] == STEPS, joined["elastic"]
    for stage in (0, 1):
        ends = [load_file(runs / f"replica{r}" / "checkpoints" / f"step-{STEPS:08d}" / f"stage{stage}" /
                          "model.safetensors") for r in (0, 1)]
        assert ends[1].keys() == ends[0].keys()
        assert all((ends[1][k] == ends[0][k]).all() for k in ends[0]), stage
