"""Distributed runtime: one trainer process per stage over gloo, against the local runtime and under
faults."""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from aqsgd.comm.testing import run_processes
from aqsgd.compress import make_codec
from aqsgd.errors import AqsgdError
from aqsgd.train.config import TrainConfig
from aqsgd.train.tasks import setup_task
from aqsgd.train.trainer import Trainer

HIDDEN = 32


def _cfg(tmp_path: Path, model: str = "tiny-llama", **kw: Any) -> TrainConfig:
    # 12 samples in global batches of 3 x 2: two steps per epoch, so the warm-up epoch is steps 1 and 2
    base = TrainConfig.of(
        task="synthetic-lm", model=model, model_layers=4, hidden_size=HIDDEN, vocab_size=64, max_length=16,
        max_train_samples=12, max_eval_samples=8, stages=4, micro_batches=3, micro_batch_size=2,
        forward="delta:q2", backward="direct:q4", warmup_epochs=1, epochs=3, max_steps=5, lr=1e-3,
        lr_warmup=0.0, runtime="distributed", timeout=60.0, eval_every=0, checkpoint_every=0,
        output_dir=str(tmp_path / "runs"), run_name="distributed", overwrite=True, progress=False,
        tensorboard=False, cache_dir=str(tmp_path / "cache"))
    return base.replace(**kw)


def _fault(stage: int, step: int, action: str, trainer: Trainer, now: int) -> None:
    """Step hook: stage ``stage`` dies (``exit``) or goes silent for 12 s (``hang``) before step ``step``."""
    if trainer.grid is not None and trainer.grid.stage == stage and now == step:
        if action == "exit":
            os._exit(3)
        time.sleep(12.0)


def _worker(rank: int, world: int, cfg_json: str, overrides: dict | None = None,
            fault: tuple[int, int, str] | None = None) -> dict:
    cfg = TrainConfig.from_dict(json.loads(cfg_json))
    if overrides and rank in overrides:
        cfg = cfg.replace(**overrides[rank])
    hooks = [functools.partial(_fault, *fault)] if fault else []
    t0 = time.monotonic()
    try:
        trainer = Trainer(cfg, on_step=hooks)
        summary = trainer.run()
    except AqsgdError as e:
        return {"error": type(e).__name__, "message": str(e), "elapsed": time.monotonic() - t0}
    return {"stage": trainer.grid.stage, "writes_metrics": trainer.writes_metrics, "history": trainer.history,
            "final_train_loss": summary["final_train_loss"]}


def _local(cfg: TrainConfig) -> Trainer:
    """The same run with every stage in this process (the parent, which has no process group)."""
    trainer = Trainer(cfg.replace(runtime="local", run_name="local"))
    trainer.run()
    return trainer


@pytest.mark.parametrize("model,schedule", [("tiny-llama", "1f1b"), ("tiny-gpt2", "gpipe")])
def test_distributed_equals_local_with_aqsgd(tmp_path, model, schedule):
    cfg = _cfg(tmp_path, model, schedule=schedule)
    local = _local(cfg)  # also writes the weights file both runs load (cache_dir/weights)
    ranks = run_processes(_worker, cfg.pipeline.stages, args=(cfg.to_json(),), timeout_s=180)
    steps = cfg.optim.max_steps
    # only the last stage holds the loss and writes the metrics; its rows carry every stage's bytes
    assert [r["writes_metrics"] for r in ranks] == [False, False, False, True]
    assert all(r["history"] == [] and r["final_train_loss"] is None for r in ranks[:-1])
    rows = ranks[-1]["history"]
    assert [r["step"] for r in rows] == [r["step"] for r in local.history] == list(range(1, steps + 1))
    assert [r["phase"] for r in rows] == ["warmup"] * 2 + ["train"] * (steps - 2)
    losses, local_losses = [r["loss"] for r in rows], [r["loss"] for r in local.history]
    assert all(loss is not None for loss in losses)
    # Same weights, data, schemes and arithmetic order: bit-identical losses on CPU for untied models.
    # GPT-2 ties its embedding (stage 0) and head (last stage): locally one gradient tensor accumulates both
    # stages' contributions micro-batch by micro-batch, distributed each stage sums its own and an all-reduce
    # adds the two sums. Float addition is not associative, so the tied gradient differs in the last bits
    # (relative ~1e-7) and the losses within a few float32 ulps; 1e-5 relative bounds that over 5 steps.
    if model == "tiny-llama":
        assert losses == local_losses
    else:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(local_losses), rtol=1e-5, atol=0)
    # bytes per boundary: the warm-up epoch (2 steps) in full, then one q2 delta forward / q4 gradient
    # backward per micro-batch; per stage and step, distributed (each stage's own count, gathered) and
    # local alike
    shape = (cfg.pipeline.micro_batch_size, cfg.task.max_length, HIDDEN)
    fw, bw = make_codec("q2").wire_bytes(shape), make_codec("q4").wire_bytes(shape)
    raw = make_codec("none").wire_bytes(shape)
    m, last = cfg.pipeline.micro_batches, cfg.pipeline.stages - 1
    for history in (rows, local.history):
        for stage in range(cfg.pipeline.stages):
            sent_fw = [row["stages"][stage]["fw_bytes"] for row in history]
            sent_bw = [row["stages"][stage]["bw_bytes"] for row in history]
            expect_fw = [m * (raw if s < 2 else fw) for s in range(steps)]
            expect_bw = [m * (raw if s < 2 else bw) for s in range(steps)]
            assert sent_fw == (expect_fw if stage < last else [0] * steps), stage
            assert sent_bw == (expect_bw if stage > 0 else [0] * steps), stage


def test_dead_stage_stops_every_other_stage_naming_it(tmp_path):
    cfg = _cfg(tmp_path, stages=3, layers=[2, 1, 1], max_steps=4, timeout=20.0)
    setup_task(cfg)  # the weights file, once, before the processes start
    t0 = time.monotonic()
    ranks = run_processes(_worker, 3, args=(cfg.to_json(), None, (1, 3, "exit")), timeout_s=120, may_exit=[1])
    assert ranks[1] is None
    for r in (ranks[0], ranks[2]):
        assert r["error"] == "PeerFailure" and "stage 1" in r["message"], r
        assert r["elapsed"] < 60
    assert time.monotonic() - t0 < 90


@pytest.mark.slow
def test_silent_stage_times_out_naming_it(tmp_path):
    cfg = _cfg(tmp_path, stages=3, layers=[2, 1, 1], max_steps=4, timeout=4.0)
    setup_task(cfg)
    ranks = run_processes(_worker, 3, args=(cfg.to_json(), None, (1, 3, "hang")), timeout_s=120)
    for r in (ranks[0], ranks[2]):
        assert r["error"] in ("PeerTimeout", "PeerFailure") and "stage 1" in r["message"], r
        assert r["elapsed"] < 12 + 4 + 30  # well before the silent stage would have resumed its work
    assert "error" in ranks[1]  # the stalled stage finds its peers gone when it wakes up


def test_mismatched_settings_fail_at_startup(tmp_path):
    cfg = _cfg(tmp_path, stages=2, layers=[2, 2])
    ranks = run_processes(_worker, 2, args=(cfg.to_json(), {1: {"forward": "delta:q4"}}), timeout_s=120)
    for r in ranks:
        assert r["error"] == "ConfigMismatchError"
        assert "forward" in r["message"] and "delta:q4" in r["message"] and "delta:q2" in r["message"]
