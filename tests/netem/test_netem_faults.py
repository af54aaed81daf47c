"""Fault tests over real links: stage processes in network namespaces, gloo over TCP, shaped veth links.

They need root and iproute2 (``ip``, ``tc``); elsewhere they are skipped with the reason. Each takes
10-40 s (process start-up dominates), so they run in the default suite where they can.
"""

from __future__ import annotations

import re
import statistics
import time

import pytest

from aqsgd.bench.netem import (
    LinkShape,
    NetemCluster,
    NetemRun,
    StageOutcome,
    netem_unavailable_reason,
    train_rows,
)

_REASON = netem_unavailable_reason()
pytestmark = [pytest.mark.netem, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

STEP_BYTES = 3 * (2 * 16 * 32 * 4 + 576)  # forward bytes per step at fp32: 3 micro-batches of 2 x 16 x 32


def _options(tmp_path, name: str, **kw) -> dict:
    """``aqsgd train`` options of a small run: a random 4-block Llama (width 32) on one synthetic batch of 3
    micro-batches of 2 x 16 tokens, so every epoch is one optimizer step; AQ-SGD fw2/bw4 after one
    uncompressed epoch; no evaluation, no checkpoints."""
    base: dict = {"task": "synthetic-lm", "model": "tiny-llama", "model_layers": 4, "hidden_size": 32,
                  "vocab_size": 64, "max_length": 16, "max_train_samples": 6, "stages": 2, "micro_batches": 3,
                  "micro_batch_size": 2, "forward": "delta:q2", "backward": "direct:q4", "warmup_epochs": 1,
                  "epochs": 4, "timeout": 20.0, "eval_every": 0, "checkpoint_every": 0, "progress": False,
                  "tensorboard": False, "output_dir": str(tmp_path / "runs"),
                  "cache_dir": str(tmp_path / "cache"), "run_name": name}
    base.update(kw)
    return base


# A PeerTimeout or PeerFailure as a process reports it: by its type in a traceback, or, from the ``aqsgd``
# command (which prints an error's message only), by the transport's wording of a timeout or a lost peer.
_PEER_ERROR = re.compile(r"\bPeer(?:Timeout|Failure)\b|\bdid not \w+ .+ within [\d.]+ s\b|^lost |"
                         r"\bsending .+ failed\b")


def _failed_naming(outcome: StageOutcome, peer: str) -> bool:
    return (outcome.returncode not in (0, None) and outcome.error is not None
            and _PEER_ERROR.search(outcome.error) is not None and peer in outcome.error)


@pytest.mark.slow
def test_cut_link_fails_fast_naming_the_peer(tmp_path):
    """netem-style 100% loss on the only link, for longer than the run's timeout: both stages stop with
    PeerTimeout/PeerFailure naming the other stage, a few seconds after the timeout, no hang."""
    opts = _options(tmp_path, "cut", epochs=2000, timeout=4.0, forward="none", backward="none",
                    warmup_epochs=0)
    cut_at: list[float] = []
    with NetemCluster(2) as cluster:
        def cut(run: NetemRun) -> None:
            run.wait_for_step(2, timeout_s=60)  # training is under way (start-up has collectives of its own)
            cluster.wait_for_traffic(0, 1, 5 * STEP_BYTES, timeout_s=60, run=run)
            cluster.shape_link(0, 1, LinkShape(loss_pct=100))
            cut_at.append(time.monotonic() - run.started)

        out = cluster.run_train(opts, tmp_path / "logs", deadline_s=90, during=cut)
    assert cut_at, "the run ended before the link was cut"
    assert _failed_naming(out[0], "stage 1"), out[0].log_tail
    assert _failed_naming(out[1], "stage 0"), out[1].log_tail
    for o in out:
        assert o.elapsed_s - cut_at[0] < opts["timeout"] + 15, (o.stage, o.elapsed_s, cut_at)


@pytest.mark.slow
def test_killed_stage_stops_the_others_naming_it(tmp_path):
    """SIGKILL the middle of three stages mid-training: its neighbours fail at once naming stage 1.

    Without gradient clipping: clipping all-reduces the stages' gradient norms with a plain gloo
    collective, and a stage that is inside that all-reduce when a peer dies gets gloo's RuntimeError
    ("Connection closed by peer" with the address of whichever rank closed first), not a PeerFailure naming
    the dead stage (seen here on the last stage); that path is the runtime's, not the transport's."""
    opts = _options(tmp_path, "killed", stages=3, layers=[2, 1, 1], epochs=2000, timeout=30.0,
                    max_grad_norm=0.0)
    killed_at: list[float] = []
    with NetemCluster(3) as cluster:
        def kill(run: NetemRun) -> None:
            run.wait_for_step(2, timeout_s=60)  # training is under way (start-up has collectives of its own)
            cluster.wait_for_traffic(1, 2, 5 * STEP_BYTES // 8, timeout_s=60, run=run)
            run.kill(1)
            killed_at.append(time.monotonic() - run.started)

        out = cluster.run_train(opts, tmp_path / "logs", deadline_s=90, during=kill)
    assert killed_at, "the run ended before stage 1 was killed"
    assert out[1].returncode == -9
    for o in (out[0], out[2]):
        assert _failed_naming(o, "stage 1"), o.log_tail
        assert o.elapsed_s - killed_at[0] < 10, (o.stage, o.elapsed_s, killed_at)  # well before the timeout


@pytest.mark.slow
def test_lossy_delayed_link_gives_the_same_losses(tmp_path):
    """1% loss and 50 +- 10 ms delay (reordering) on every link: TCP retransmits, the packets' CRCs pass,
    and the losses equal those over a clean link bit for bit."""
    with NetemCluster(2) as cluster:
        clean = cluster.run_train(_options(tmp_path, "clean", timeout=30.0), tmp_path / "clean",
                                  deadline_s=90)
        cluster.shape_all(LinkShape(delay_ms=50, jitter_ms=10, loss_pct=1))
        lossy = cluster.run_train(_options(tmp_path, "lossy", timeout=30.0), tmp_path / "lossy",
                                  deadline_s=120)
    assert all(o.ok for o in clean + lossy), [(o.stage, o.error) for o in clean + lossy]
    clean_rows, lossy_rows = train_rows(tmp_path / "runs" / "clean"), train_rows(tmp_path / "runs" / "lossy")
    assert [r["loss"] for r in lossy_rows] == [r["loss"] for r in clean_rows]
    assert len(clean_rows) == 4
    # the impairment was really there: every step waits for >= 2 x 40 ms one-way trips (stage 0's step times)
    clean_s, lossy_s = (statistics.median(r["stages"][0]["step_s"] for r in rows)
                        for rows in (clean_rows, lossy_rows))
    assert lossy_s > clean_s + 0.08


def _train_losses(run_dir) -> dict[int, float]:
    """Train losses by step from a run's metrics (a resumed run appends: later rows win)."""
    return {r["step"]: r["loss"] for r in train_rows(run_dir)}


@pytest.mark.slow
def test_resume_after_failure_matches_uninterrupted_run(tmp_path):
    """``aqsgd train`` across two namespaces (AQ-SGD fw2/bw4, checkpoints every 4 steps); stage 1 is killed
    after the step-8 checkpoint, stage 0 stops naming it; restarting both with ``--resume`` continues from the
    last complete checkpoint and every later loss, the final one included, equals an uninterrupted run's."""
    opts = {"task": "synthetic-lm", "max_train_samples": 48, "max_eval_samples": 16, "max_length": 12,
            "stages": 2, "micro_batches": 2, "micro_batch_size": 4, "epochs": 3, "lr": 3e-3,
            "forward": "delta:q2", "backward": "direct:q4", "checkpoint_every": 4, "timeout": 20.0,
            "output_dir": str(tmp_path / "runs"), "cache_dir": str(tmp_path / "cache"), "progress": False,
            "tensorboard": False}
    checkpoint = tmp_path / "runs" / "broken" / "checkpoints" / "step-00000008" / "COMPLETE"
    killed_at: list[float] = []
    with NetemCluster(2) as cluster:
        cluster.shape_all(LinkShape(rate_mbit=100))
        full = cluster.run_train({**opts, "run_name": "full"}, tmp_path / "full", deadline_s=180)

        def kill_after_checkpoint(run: NetemRun) -> None:
            deadline = time.monotonic() + 120
            while not checkpoint.exists() and run.running() and time.monotonic() < deadline:
                time.sleep(0.02)
            if checkpoint.exists():
                run.kill(1)
                killed_at.append(time.monotonic() - run.started)

        broken = cluster.run_train({**opts, "run_name": "broken"}, tmp_path / "broken", deadline_s=180,
                                   during=kill_after_checkpoint)
        resumed = cluster.run_train({**opts, "run_name": "broken",
                                     "resume": str(tmp_path / "runs" / "broken")},
                                    tmp_path / "resumed", deadline_s=180)
    assert all(o.ok for o in full), [(o.stage, o.error) for o in full]
    assert killed_at, "the run ended before the step-8 checkpoint was complete"
    assert broken[1].returncode == -9
    assert broken[0].returncode not in (0, None) and "stage 1" in (broken[0].error or ""), broken[0].log_tail
    assert all(o.ok for o in resumed), [(o.stage, o.error, o.log_tail) for o in resumed]
    # the whole log: warnings can push it out of the tail
    log = (tmp_path / "resumed" / "stage1.log").read_text()
    assert "resumed from" in log and "step 8" in log, resumed[1].log_tail
    expect, got = _train_losses(tmp_path / "runs" / "full"), _train_losses(tmp_path / "runs" / "broken")
    assert sorted(got) == sorted(expect) == list(range(1, 19))
    for step in range(9, 19):  # everything after the checkpoint was recomputed by the resumed processes
        assert got[step] == expect[step], step  # bit-identical on CPU
    assert resumed[1].result["final_train_loss"] == full[1].result["final_train_loss"]
