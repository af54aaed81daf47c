"""``aqsgd train --dp-elastic``: replicas that come and go in a whole run.

Three replica pipelines of two stage processes, each a process group and a run directory of its own; one
stage process of replica 1 is killed mid-run (its pipeline fails fast, the others go on); replica 1 is then
started again alone (``--dp-replica 1 --dp-lighthouse ADDR``), joins at the next outer step and ends with the
same weights as the others. The refusals of bad settings are checked without starting anything."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from aqsgd.errors import SpecError
from aqsgd.train.checkpoint.layout import CheckpointError
from aqsgd.parallel.elastic import elastic_available
from aqsgd.train.rundir import last_logged_step
from aqsgd.train.config import TrainConfig

needs_torchft = pytest.mark.skipif(not elastic_available(),
                                   reason="torchft (the elastic extra) not installed")

STEPS = 200


def _cfg(tmp: Path, **kw) -> TrainConfig:
    base = TrainConfig.of(
        task="synthetic-lm", model="tiny-llama", model_layers=4, hidden_size=32, vocab_size=64, max_length=16,
        max_train_samples=96, max_eval_samples=8, stages=2, layers=[2, 2], micro_batches=2,
        micro_batch_size=2, forward="delta:q2", backward="direct:q4", warmup_epochs=0, epochs=40,
        max_steps=STEPS, lr=3e-3, lr_warmup=0.0, runtime="distributed", data_parallel=3,
        grad_sync="diloco:4:q8", timeout=15.0, eval_every=0, checkpoint_every=STEPS,
        output_dir=str(tmp / "runs"), run_name="elastic", progress=False, tensorboard=False, device="cpu",
        link="1gbit,150ms", dp_elastic=True)
    return base.replace(**kw)


def _train(cfg_json: str, out: str) -> None:
    from aqsgd.train.driver import run_training

    summary = run_training(TrainConfig.from_dict(json.loads(cfg_json)))
    Path(out).write_text(json.dumps(summary))


def _wait(what, timeout_s: float = 180.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (got := what()):
            return got
        time.sleep(0.2)
    raise TimeoutError(what)


def _step_of(run: Path) -> int:
    return last_logged_step(run) or 0


def _launch(tmp: Path, cfg: TrainConfig, out: str) -> dict:
    """Run the launch ``cfg`` to its end in a process of its own (5 minutes at most); its summary."""
    run = multiprocessing.get_context("spawn").Process(target=_train, args=(cfg.to_json(), str(tmp / out)))
    run.start()
    run.join(300)
    if run.is_alive():
        run.kill()
    assert run.exitcode == 0, run.exitcode
    return json.loads((tmp / out).read_text())


def _same_final_weights(runs: list[Path], step: int) -> None:
    """Every stage's weights are equal in the checkpoints of ``step`` of ``runs`` (replicas' run dirs)."""
    for stage in (0, 1):
        ends = [load_file(d / "checkpoints" / f"step-{step:08d}" / f"stage{stage}" / "model.safetensors")
                for d in runs]
        for other in ends[1:]:
            assert other.keys() == ends[0].keys()
            assert all(torch.equal(other[k], ends[0][k]) for k in ends[0]), stage


def _ended(pid: int) -> bool:
    """Whether process ``pid`` has ended (gone, or a zombie its parent has not collected yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@needs_torchft
@pytest.mark.slow
@pytest.mark.parametrize("sync, meets", [("diloco:4:q8", 4), ("diloco:4:fragments2:q8", 2),
                                         ("diloco:4:fragments2:delay1:q8", 2)])
def test_a_replica_killed_then_started_again_joins(tmp_path, sync, meets):
    # (streamed in two fragments, the replicas meet every 2 steps: each fragment's outer step in turn)
    from aqsgd.comm.testing import child_processes

    cfg = _cfg(tmp_path, grad_sync=sync)
    base = tmp_path / "runs" / "elastic"
    ctx = multiprocessing.get_context("spawn")
    run = ctx.Process(target=_train, args=(cfg.to_json(), str(tmp_path / "summary.json")))
    run.start()
    joiner = None
    try:
        _wait(lambda: _step_of(base / "replica1") >= 8)
        launcher = int((base / "replica1.pid").read_text())
        stages = _wait(lambda: child_processes(launcher))
        os.kill(max(stages), signal.SIGKILL)  # one stage process of replica 1 dies without a word
        _wait(lambda: _ended(launcher))  # replica 1's launcher has reported and ended
        gone = _step_of(base / "replica0")
        _wait(lambda: _step_of(base / "replica0") >= gone + 8)  # two outer steps without it
        print("replica 1 gone at replica 0 step", gone, "at", time.time())
        address = (base / "lighthouse.txt").read_text().strip()
        again = cfg.replace(dp_replica=1, dp_lighthouse=address, output_dir=str(tmp_path / "runs"),
                            run_name="replica1-again")
        joiner = ctx.Process(target=_train, args=(again.to_json(), str(tmp_path / "joiner.json")))
        joiner.start()
        print("joiner started", time.time())
        joiner.join(240)
        run.join(240)
        assert joiner.exitcode == 0 and run.exitcode == 0, (joiner.exitcode, run.exitcode)
    finally:
        for p in (run, joiner):
            if p is not None and p.is_alive():
                p.kill()
    summary = json.loads((tmp_path / "summary.json").read_text())
    table = {r["replica"]: r for r in summary["replicas"]}
    assert table[0]["status"] == table[2]["status"] == "finished" and table[1]["status"] == "failed"
    last = table[1]["last_step"]
    assert last is not None and 8 <= last < STEPS and table[1]["missed"] == f"{last + 1}-{STEPS}"
    assert "stage" in table[1]["error"]
    assert json.loads((base / "replicas.json").read_text()) == summary["replicas"]
    # the launch's replicas start together (a first quorum of all three), replica 1 leaves, comes back
    members = [m for _, m in summary["elastic"]["members"]]
    assert members == [[0, 1, 2], [0, 2], [0, 1, 2]], members
    assert summary["elastic"]["joined_at"] is None
    # an elastic replica's metrics count its own samples (2 micro-batches of 2), not the group's global batch
    rows = [json.loads(r) for r in (base / "replica0" / "metrics.jsonl").read_text().splitlines()]
    counted = {round(r["samples_per_s"] * r["time"]["step"], 6) for r in rows if r.get("kind") == "train"}
    assert counted == {4.0}, counted
    joined = json.loads((tmp_path / "joiner.json").read_text())
    at = joined["elastic"]["joined_at"]
    assert at is not None and at % meets == 0 and at > last and joined["steps"] == STEPS
    _same_final_weights([base / "replica0", base / "replica2", tmp_path / "runs" / "replica1-again"], STEPS)


def test_bad_elastic_settings_are_refused_in_one_line(tmp_path):
    cases = {
        "needs --grad-sync diloco": dict(grad_sync="q8"),
        "needs --dp-elastic": dict(dp_elastic=False, dp_replica=0),
        "needs --dp-lighthouse too": dict(dp_replica=0),
        "needs --dp-replica too": dict(dp_lighthouse="http://127.0.0.1:29510"),
        "give 0 to 2": dict(dp_replica=3, dp_lighthouse="http://127.0.0.1:29510"),
        "is no lighthouse address": dict(dp_replica=0, dp_lighthouse="127.0.0.1"),
        "--dp-backend nccl": dict(dp_backend="nccl", device="auto"),
    }
    if not elastic_available():  # (the floor job: torch below torchft's)
        cases["needs torchft"] = {}
    for words, kw in cases.items():
        with pytest.raises(SpecError) as e:
            _cfg(tmp_path, **kw).validate()
        assert words in str(e.value) and "\n" not in str(e.value), (kw, str(e.value))


def test_resuming_a_launch_without_replica_checkpoints_is_refused_in_one_line(tmp_path):
    from aqsgd.train.driver import run_training
    from aqsgd.train.elastic import run_replicas

    (tmp_path / "runs" / "elastic" / "replica0").mkdir(parents=True)
    cfg = _cfg(tmp_path, resume=str(tmp_path / "runs" / "elastic"), run_name=None)
    with pytest.raises(CheckpointError, match=r"^--resume .*elastic: no replica of an elastic launch has a "
                                              r"checkpoint in .*elastic \(replica0 .. replica2\); give the "
                                              r"launch's run directory$"):
        run_replicas(cfg, run_training)


@needs_torchft
@pytest.mark.slow
@pytest.mark.parametrize("sync", ["diloco:4:q8", "diloco:4:fragments2:q8", "diloco:4:fragments2:delay1:q8"])
def test_a_launch_resumed_inside_a_round_continues_it_exactly(tmp_path, sync):
    # 2 replicas x 2 stages, rounds of 4 steps; checkpoints at step 6 (inside the second round; streamed in
    # two fragments: just after fragment 1's outer step, and with delay1 while its averaging is in flight)
    # and 12 (the end). The step-12 checkpoints taken away, the launch resumed from step 6 ends as the first
    # run did.
    steps = 12
    cfg = _cfg(tmp_path, data_parallel=2, max_steps=steps, checkpoint_every=6, link="1gbit", grad_sync=sync)
    base = tmp_path / "runs" / "elastic"
    _launch(tmp_path, cfg, "first.json")
    final = {}
    for r in range(2):
        ckpt = base / f"replica{r}" / "checkpoints" / f"step-{steps:08d}"
        final[r] = [load_file(ckpt / f"stage{s}" / "model.safetensors") for s in range(2)]
        shutil.move(str(ckpt), str(tmp_path / f"first-replica{r}"))  # so that step 6 is the newest
        if "delay" in sync:  # saved with fragment 1's averaging in flight: what it started from, to redo
            outer = load_file(base / f"replica{r}" / "checkpoints" / f"step-{6:08d}" / "stage0" /
                              "replica0" / "outer.safetensors")  # (each replica a run of its own)
            assert outer["pending"].tolist() == [1, 7] and "pending.again" in outer, sorted(outer)
    summary = _launch(tmp_path, cfg.replace(resume=str(base), run_name=None, overwrite=False), "resumed.json")
    assert [row["status"] for row in summary["replicas"]] == ["finished", "finished"]
    for r in range(2):
        rows = [json.loads(x) for x in (base / f"replica{r}" / "metrics.jsonl").read_text().splitlines()]
        assert [x["step"] for x in rows if x.get("kind") == "train"] == list(range(1, steps + 1))
        ckpt = base / f"replica{r}" / "checkpoints" / f"step-{steps:08d}"
        for s in range(2):
            got = load_file(ckpt / f"stage{s}" / "model.safetensors")
            assert got.keys() == final[r][s].keys()
            assert all(torch.equal(got[k], final[r][s][k]) for k in got), (r, s)


def test_a_replica_listens_on_its_address_towards_the_lighthouse(tmp_path):
    from aqsgd.train.driver import _listen_on

    assert _listen_on(_cfg(tmp_path)) == "127.0.0.1"  # the launch's own lighthouse, on loopback
    assert _listen_on(_cfg(tmp_path, dp_replica=1, dp_lighthouse="http://127.0.0.1:29510")) == "127.0.0.1"
    with pytest.raises(SpecError, match=r"^--dp-lighthouse http://no-such-host\.invalid:29510: no route from "
                                        r"this machine to its host \(.+\)$"):
        _listen_on(_cfg(tmp_path, dp_replica=1, dp_lighthouse="http://no-such-host.invalid:29510"))


_REFUSE_COMMIT = '''
import os

if os.environ.get("AQSGD_TEST_REFUSE_COMMIT"):  # replica R's stage 0 says no to its N-th outer step
    replica, nth = (int(v) for v in os.environ["AQSGD_TEST_REFUSE_COMMIT"].split(","))
    from aqsgd.parallel import elastic

    real = elastic.ElasticGroup.commit

    def commit(self):
        if self.replica == replica and self.stage == 0:
            self._tries = getattr(self, "_tries", 0) + 1
            if self._tries == nth:
                self.manager.report_error(RuntimeError("injected: this replica's averaging failed"))
        return real(self)

    elastic.ElasticGroup.commit = commit
'''


@needs_torchft
@pytest.mark.slow
@pytest.mark.parametrize("sync", ["diloco:4:q8", "diloco:4:fragments2:q8", "diloco:4:fragments2:delay1:q8"])
def test_a_replica_whose_outer_step_alone_failed_goes_on_from_the_others_place(tmp_path, sync, capfd,
                                                                               monkeypatch):
    # 2 replicas x 2 stages: replica 1's stage 0 refuses its second outer step after averaging it (a
    # sitecustomize in every process of the launch, the test's only hook), which replica 0 takes. Replica 1
    # finds itself behind at its next quorum, takes replica 0's state there and goes on from its place: both
    # finish, with the same weights; replica 1's metrics skip the steps it did not train as its own.
    steps = 16
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_REFUSE_COMMIT)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("AQSGD_TEST_REFUSE_COMMIT", "1,2")
    cfg = _cfg(tmp_path, data_parallel=2, max_steps=steps, checkpoint_every=steps, link="1gbit",
               grad_sync=sync)
    base = tmp_path / "runs" / "elastic"
    run = multiprocessing.get_context("spawn").Process(target=_train,
                                                       args=(cfg.to_json(), str(tmp_path / "summary.json")))
    run.start()
    run.join(300)
    if run.is_alive():
        run.kill()
    err = capfd.readouterr().err
    assert run.exitcode == 0, err[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [row["status"] for row in summary["replicas"]] == ["finished", "finished"]
    assert summary["replicas"][0]["missed"] is None
    assert "injected: this replica's averaging failed" in err or "another stage of this replica" in err, err
    import re

    behind = re.findall(r"replica 1: behind the others at step (\d+); goes on from their place, after step "
                        r"(\d+)", err)
    assert len(behind) == 2, err[-3000:]  # (each stage process)
    at, after = (int(v) for v in behind[0])
    assert set(behind) == {(str(at), str(after))} and at <= after < steps, behind
    assert summary["replicas"][1]["missed"] == (f"{at}-{after}" if at < after else str(at))
    assert "replica 1: finished, behind the others (took their state) and missed steps " in err
    rows = {r: [json.loads(x) for x in (base / f"replica{r}" / "metrics.jsonl").read_text().splitlines()]
            for r in range(2)}
    trained = {r: [x["step"] for x in rows[r] if x.get("kind") == "train"] for r in range(2)}
    assert trained[0] == list(range(1, steps + 1))
    assert trained[1] == list(range(1, at)) + list(range(after + 1, steps + 1)), (at, after, trained[1])
    _same_final_weights([base / "replica0", base / "replica1"], steps)


@needs_torchft
@pytest.mark.slow
@pytest.mark.parametrize("sync", ["diloco:4:q8", "diloco:4:fragments2:delay1:q8"])
def test_a_replica_without_checkpoints_takes_the_others_state_when_the_launch_resumes(tmp_path, sync):
    # 2 replicas x 2 stages, checkpoints at step 6 and 12 (the end); replica 1's are taken away, and the
    # launch resumed. Replica 0 continues from step 6; replica 1 starts again and takes replica 0's state at
    # their first quorum, before either's first step (replica 0 meets it there, outside an outer step; before,
    # it had no place in the data to give). With a delay replica 1 then takes part in the outer step that was
    # in flight at step 6 (averaged again at step 7) with nothing to add. Both end with the same weights.
    steps = 12
    cfg = _cfg(tmp_path, data_parallel=2, max_steps=steps, checkpoint_every=6, link="1gbit", grad_sync=sync)
    base = tmp_path / "runs" / "elastic"
    _launch(tmp_path, cfg, "first.json")
    shutil.rmtree(base / "replica1" / "checkpoints")
    shutil.rmtree(base / "replica0" / "checkpoints" / f"step-{steps:08d}")
    summary = _launch(tmp_path, cfg.replace(resume=str(base), run_name=None, overwrite=False), "resumed.json")
    assert [row["status"] for row in summary["replicas"]] == ["finished", "finished"]
    joined = json.loads((base / "replica1" / "summary.json").read_text())["elastic"]["joined_at"]
    assert joined == 6, joined  # (replica 0 meets it at its start, resumed after step 6)
    _same_final_weights([base / "replica0", base / "replica1"], steps)


@needs_torchft
@pytest.mark.slow
def test_a_replica_frozen_for_a_while_goes_on_from_the_others_place(tmp_path):
    # 2 replicas x 2 stages; replica 1's stage processes are stopped (SIGSTOP, heartbeats too) inside a
    # round for longer than the heartbeat timeout (10 s: min(--timeout, 10 s)), though not for the
    # pipeline's --timeout (30 s: its own stages wait for each other that long, and would count each other
    # gone), then let go on (SIGCONT): replica 0 goes on alone meanwhile; replica 1 finds itself behind at its
    # next outer step, takes replica 0's state and goes on from its place. Both finish, with the same weights,
    # and replica 1's row says which steps it did not train as its own.
    from aqsgd.comm.testing import child_processes

    steps = 80
    cfg = _cfg(tmp_path, data_parallel=2, max_steps=steps, checkpoint_every=steps, link="1gbit,20ms",
               timeout=30.0)
    base = tmp_path / "runs" / "elastic"
    run = multiprocessing.get_context("spawn").Process(target=_train,
                                                       args=(cfg.to_json(), str(tmp_path / "summary.json")))
    run.start()
    try:
        _wait(lambda: _step_of(base / "replica1") >= 8)
        stages = _wait(lambda: child_processes(int((base / "replica1.pid").read_text())))
        deadline = time.monotonic() + 60
        while _step_of(base / "replica1") % 4 != 1:  # (just after an outer step: in the round's inner steps)
            assert time.monotonic() < deadline, "replica 1 logged no step just after an outer step"
            time.sleep(0.005)
        for pid in stages:
            os.kill(pid, signal.SIGSTOP)
        frozen = time.monotonic()
        frozen_at = _step_of(base / "replica0")
        _wait(lambda: _step_of(base / "replica0") >= frozen_at + 8, timeout_s=25)  # outer steps without it
        for pid in stages:
            os.kill(pid, signal.SIGCONT)
        print(f"replica 1 stopped for {time.monotonic() - frozen:.1f} s")
        run.join(300)
        assert run.exitcode == 0, run.exitcode
    finally:
        if run.is_alive():
            run.kill()
    summary = json.loads((tmp_path / "summary.json").read_text())
    rows = {row["replica"]: row for row in summary["replicas"]}
    assert rows[0]["status"] == rows[1]["status"] == "finished", rows
    assert rows[0]["missed"] is None and rows[1]["missed"], rows
    _same_final_weights([base / "replica0", base / "replica1"], steps)
