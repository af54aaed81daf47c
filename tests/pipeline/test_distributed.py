"""Distributed runtime: one process per stage over gloo, against the local runtime and under faults."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from aqsgd.comm.testing import run_processes
from aqsgd.compress import make_codec
from aqsgd.errors import AqsgdError
from aqsgd.train.job import JobConfig, ensure_weights, run_local, run_worker, tiny_lm_recipe


def _worker(rank: int, world: int, job_json: str, overrides: dict | None = None) -> dict:
    job = JobConfig.from_json(job_json)
    if overrides and rank in overrides:
        job = dataclasses.replace(job, **overrides[rank])
    t0 = time.monotonic()
    try:
        return dataclasses.asdict(run_worker(job))
    except AqsgdError as e:
        return {"error": type(e).__name__, "message": str(e), "elapsed": time.monotonic() - t0}


def _job(tmp_path, kind="llama", **kw) -> JobConfig:
    base = dict(recipe=tiny_lm_recipe(kind, layers=4, hidden=32, vocab=64, seq_len=16).to_dict(), num_stages=4,
                steps=5, warmup_steps=2, num_samples=12, seq_len=16, num_microbatches=3, microbatch_size=2,
                forward="delta:q2", backward="direct:q4")
    base.update(kw)
    return ensure_weights(JobConfig(**base), str(tmp_path))


@pytest.mark.parametrize("kind,schedule", [("llama", "1f1b"), ("gpt2", "gpipe")])
def test_distributed_equals_local_with_aqsgd(tmp_path, kind, schedule):
    job = _job(tmp_path, kind, schedule=schedule)
    local = run_local(job)
    ranks = run_processes(_worker, job.num_stages, args=(job.to_json(),), timeout_s=180)
    # Same weights, data, schemes and arithmetic order: bit-identical losses on CPU for untied models.
    # GPT-2 ties its embedding (stage 0) and head (last stage): locally one gradient tensor accumulates both
    # stages' contributions micro-batch by micro-batch, distributed each stage sums its own and an all-reduce
    # adds the two sums. Float addition is not associative, so the tied gradient differs in the last bits
    # (relative ~1e-7) and the losses within a few float32 ulps; 1e-5 relative bounds that over 5 steps.
    if kind == "llama":
        assert ranks[-1]["losses"] == local.losses
    else:
        torch.testing.assert_close(torch.tensor(ranks[-1]["losses"]), torch.tensor(local.losses), rtol=1e-5, atol=0)
    assert all(r["losses"] == [None] * job.steps for r in ranks[:-1])
    # bytes per boundary: the warm-up epoch (2 steps) in full, then one q2 delta forward / q4 gradient backward per micro-batch
    shape = (job.microbatch_size, job.seq_len, 32)
    fw, bw = make_codec("q2").wire_bytes(shape), make_codec("q4").wire_bytes(shape)
    raw = make_codec("none").wire_bytes(shape)
    for stage, r in enumerate(ranks):
        expect_fw = [job.num_microbatches * (raw if s < job.warmup_steps else fw) for s in range(job.steps)]
        expect_bw = [job.num_microbatches * (raw if s < job.warmup_steps else bw) for s in range(job.steps)]
        assert r["bytes_sent"]["forward"] == (expect_fw if stage < 3 else [0] * job.steps)
        assert r["bytes_sent"]["backward"] == (expect_bw if stage > 0 else [0] * job.steps)


def test_dead_stage_stops_every_other_stage_naming_it(tmp_path):
    job = _job(tmp_path, num_stages=3, layers=[2, 1, 1], steps=4, timeout_s=20)
    t0 = time.monotonic()
    ranks = run_processes(_worker, 3, args=(job.to_json(),), timeout_s=120, may_exit=[1],
                          env={"AQSGD_FAULT": "1:2:exit"})
    assert ranks[1] is None
    for r in (ranks[0], ranks[2]):
        assert r["error"] == "PeerFailure" and "stage 1" in r["message"], r
        assert r["elapsed"] < 60
    assert time.monotonic() - t0 < 90


def test_silent_stage_times_out_naming_it(tmp_path):
    job = _job(tmp_path, num_stages=3, layers=[2, 1, 1], steps=4, timeout_s=4)
    ranks = run_processes(_worker, 3, args=(job.to_json(),), timeout_s=120, env={"AQSGD_FAULT": "1:2:hang:12"})
    for r in (ranks[0], ranks[2]):
        assert r["error"] in ("PeerTimeout", "PeerFailure") and "stage 1" in r["message"], r
        assert r["elapsed"] < 12 + 4 + 30  # well before the silent stage would have resumed its work
    assert "error" in ranks[1]  # the stalled stage finds its peers gone when it wakes up


def test_mismatched_settings_fail_at_startup(tmp_path):
    job = _job(tmp_path, num_stages=2, layers=[2, 2])
    ranks = run_processes(_worker, 2, args=(job.to_json(), {1: {"forward": "delta:q4"}}), timeout_s=120)
    for r in ranks:
        assert r["error"] == "ConfigMismatchError"
        assert "forward" in r["message"] and "delta:q4" in r["message"] and "delta:q2" in r["message"]
