"""Fault tests over real links: stage processes in network namespaces, gloo over TCP, shaped veth links.

They need root and iproute2 (``ip``, ``tc``); elsewhere they are skipped with the reason. Each takes
10-40 s (process start-up dominates), so they run in the default suite where they can.
"""

from __future__ import annotations

import json
import statistics
import time

import pytest

from aqsgd.bench.netem import LinkShape, NetemCluster, NetemJob, StageOutcome, netem_unavailable_reason
from aqsgd.train.job import JobConfig, ensure_weights, tiny_lm_recipe

_REASON = netem_unavailable_reason()
pytestmark = [pytest.mark.netem, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

STEP_BYTES = 3 * (2 * 16 * 32 * 4 + 576)  # forward bytes per step at fp32: 3 micro-batches of 2 x 16 x 32


def _job(tmp_path, **kw) -> JobConfig:
    base: dict = {"recipe": tiny_lm_recipe("llama", layers=4, hidden=32, vocab=64, seq_len=16).to_dict(),
                  "num_stages": 2, "steps": 4, "warmup_steps": 1, "num_samples": 12, "seq_len": 16,
                  "num_microbatches": 3, "microbatch_size": 2, "forward": "delta:q2", "backward": "direct:q4",
                  "timeout_s": 20}
    base.update(kw)
    return ensure_weights(JobConfig(**base), str(tmp_path / "weights"))


def _failed_naming(outcome: StageOutcome, peer: str) -> bool:
    return (outcome.returncode not in (0, None) and outcome.error is not None
            and ("PeerTimeout" in outcome.error or "PeerFailure" in outcome.error) and peer in outcome.error)


def test_cut_link_fails_fast_naming_the_peer(tmp_path):
    """netem-style 100% loss on the only link, for longer than the job's timeout: both stages stop with
    PeerTimeout/PeerFailure naming the other stage, a few seconds after the timeout, no hang."""
    job = _job(tmp_path, steps=2000, timeout_s=4, forward="none", backward="none", warmup_steps=0)
    cut_at: list[float] = []
    with NetemCluster(2) as cluster:
        def cut(run: NetemJob) -> None:
            cluster.wait_for_traffic(0, 1, 5 * STEP_BYTES, timeout_s=60, job=run)  # training is under way
            cluster.shape_link(0, 1, LinkShape(loss_pct=100))
            cut_at.append(time.monotonic() - run.started)

        out = cluster.run_job(job, tmp_path / "run", deadline_s=90, during=cut)
    assert cut_at, "the job ended before the link was cut"
    assert _failed_naming(out[0], "stage 1"), out[0].log_tail
    assert _failed_naming(out[1], "stage 0"), out[1].log_tail
    for o in out:
        assert o.elapsed_s - cut_at[0] < job.timeout_s + 15, (o.stage, o.elapsed_s, cut_at)


def test_killed_stage_stops_the_others_naming_it(tmp_path):
    """SIGKILL the middle of three stages mid-training: its neighbours fail at once naming stage 1.

    Without gradient clipping: clipping all-reduces the stages' gradient norms with a plain gloo
    collective, and a stage that is inside that all-reduce when a peer dies gets gloo's RuntimeError
    ("Connection closed by peer" with the address of whichever rank closed first), not a PeerFailure naming
    the dead stage (seen here on the last stage); that path is the runtime's, not the transport's."""
    job = _job(tmp_path, num_stages=3, layers=[2, 1, 1], steps=2000, timeout_s=30, max_grad_norm=0.0)
    killed_at: list[float] = []
    with NetemCluster(3) as cluster:
        def kill(run: NetemJob) -> None:
            cluster.wait_for_traffic(1, 2, 5 * STEP_BYTES // 8, timeout_s=60, job=run)
            run.kill(1)
            killed_at.append(time.monotonic() - run.started)

        out = cluster.run_job(job, tmp_path / "run", deadline_s=90, during=kill)
    assert killed_at, "the job ended before stage 1 was killed"
    assert out[1].returncode == -9
    for o in (out[0], out[2]):
        assert _failed_naming(o, "stage 1"), o.log_tail
        assert o.elapsed_s - killed_at[0] < 10, (o.stage, o.elapsed_s, killed_at)  # well before timeout_s


def test_lossy_delayed_link_gives_the_same_losses(tmp_path):
    """1% loss and 50 +- 10 ms delay (reordering) on every link: TCP retransmits, the packets' CRCs pass,
    and the losses equal those over a clean link bit for bit."""
    job = _job(tmp_path, steps=4, timeout_s=30)
    with NetemCluster(2) as cluster:
        clean = cluster.run_job(job, tmp_path / "clean", deadline_s=90)
        cluster.shape_all(LinkShape(delay_ms=50, jitter_ms=10, loss_pct=1))
        lossy = cluster.run_job(job, tmp_path / "lossy", deadline_s=120)
    assert all(o.ok for o in clean + lossy), [(o.stage, o.error) for o in clean + lossy]
    assert lossy[-1].result.losses == clean[-1].result.losses
    # the impairment was really there: every step waits for >= 2 x 40 ms one-way trips
    assert statistics.median(lossy[0].result.step_s) > statistics.median(clean[0].result.step_s) + 0.08


def _train_losses(run_dir) -> dict[int, float]:
    """Train losses by step from a run's metrics (a resumed run appends: later rows win)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


def test_resume_after_failure_matches_uninterrupted_run(tmp_path):
    """``aqsgd train`` across two namespaces (AQ-SGD fw2/bw4, checkpoints every 4 steps); stage 1 is killed
    after the step-8 checkpoint, stage 0 stops naming it; restarting both with ``--resume`` continues from the
    last complete checkpoint and every later loss, the final one included, equals an uninterrupted run's."""
    args = ["--task", "synthetic-lm", "--max-train-samples", "48", "--max-eval-samples", "16", "--max-length", "12",
            "--stages", "2", "--micro-batches", "2", "--micro-batch-size", "4", "--epochs", "3", "--lr", "3e-3",
            "--forward", "delta:q2", "--backward", "direct:q4", "--checkpoint-every", "4", "--timeout", "20",
            "--output-dir", str(tmp_path / "runs"), "--cache-dir", str(tmp_path / "cache"), "--no-progress",
            "--no-tensorboard"]
    checkpoint = tmp_path / "runs" / "broken" / "checkpoints" / "step-00000008" / "COMPLETE"
    killed_at: list[float] = []
    with NetemCluster(2) as cluster:
        cluster.shape_all(LinkShape(rate_mbit=100))
        full = cluster.run_train([*args, "--run-name", "full"], tmp_path / "full", deadline_s=180)

        def kill_after_checkpoint(run: NetemJob) -> None:
            deadline = time.monotonic() + 120
            while not checkpoint.exists() and run.running() and time.monotonic() < deadline:
                time.sleep(0.02)
            if checkpoint.exists():
                run.kill(1)
                killed_at.append(time.monotonic() - run.started)

        broken = cluster.run_train([*args, "--run-name", "broken"], tmp_path / "broken", deadline_s=180,
                                   during=kill_after_checkpoint)
        resumed = cluster.run_train([*args, "--run-name", "broken", "--resume", str(tmp_path / "runs" / "broken")],
                                    tmp_path / "resumed", deadline_s=180)
    assert all(o.ok for o in full), [(o.stage, o.error) for o in full]
    assert killed_at, "the run ended before the step-8 checkpoint was complete"
    assert broken[1].returncode == -9
    assert broken[0].returncode not in (0, None) and "stage 1" in (broken[0].error or ""), broken[0].log_tail
    assert all(o.ok for o in resumed), [(o.stage, o.error, o.log_tail) for o in resumed]
    assert "resumed from" in resumed[1].log_tail and "step 8" in resumed[1].log_tail
    expect, got = _train_losses(tmp_path / "runs" / "full"), _train_losses(tmp_path / "runs" / "broken")
    assert sorted(got) == sorted(expect) == list(range(1, 19))
    for step in range(9, 19):  # everything after the checkpoint was recomputed by the resumed processes
        assert got[step] == expect[step], step  # bit-identical on CPU
    assert resumed[1].result["final_train_loss"] == full[1].result["final_train_loss"]
