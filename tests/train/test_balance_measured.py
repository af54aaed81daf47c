"""``--balance measured`` in the trainer: a stage made four times slower (``--emulate-slow-stage``) gets
fewer blocks; the split is recorded where ``--resume``, ``export`` and ``eval`` read it; the run trains
exactly as one given that split with ``--layers``; both runtimes; one-line errors for bad inputs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from aqsgd.cli import main
from aqsgd.errors import SpecError
from aqsgd.train.config import TrainConfig
from aqsgd.train.resume import resume_settings
from aqsgd.train.trainer import Trainer

# tiny-llama, 4 blocks over 2 stages: the profiled split is 2,2; with stage 1 four times slower, 3,1 makes its
# slowest stage about twice as fast (3 blocks at speed 1 against 1 block at speed 4)
BASE = dict(task="synthetic-lm", max_train_samples=32, max_eval_samples=4, max_length=16, stages=2,
            micro_batches=2, micro_batch_size=4, epochs=1, max_steps=4, warmup_epochs=0, progress=False,
            tensorboard=False, eval_every=0, balance_passes=4)


def _cfg(tmp_path: Path, **kw: Any) -> TrainConfig:
    return TrainConfig.of(**{**BASE, "output_dir": str(tmp_path), **kw})


def _rows(run: Path, kind: str) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == kind]


def test_a_slow_stage_gets_fewer_blocks_and_the_run_is_the_one_of_that_split(tmp_path):
    measured = _cfg(tmp_path, run_name="measured", balance="measured", emulate_slow_stage="1:4",
                    checkpoint_every=2)
    trainer = Trainer(measured)
    assert trainer.balance is not None and trainer.balance["layers"] == [3, 1]
    assert trainer.balance["profiled_layers"] == [2, 2]
    stage_ms = trainer.balance["stage_ms"]
    assert stage_ms[1] > stage_ms[0]  # the slow stage was measured slower
    assert max(trainer.balance["predicted_ms"]) < max(stage_ms)
    assert [r.slowdown for r in trainer.engine.runners.values()] == [1.0, 4.0]
    trainer.run(stop_at=2)  # interrupted after the checkpoint of step 2
    run = tmp_path / "measured"
    saved = json.loads((run / "config.json").read_text())["pipeline"]
    assert saved["layers"] == [3, 1] and saved["balance"] == "measured"
    (row,) = _rows(run, "balance")
    assert row["layers"] == [3, 1] and row["step"] == 0

    # --resume takes the recorded split and does not profile again
    settings = resume_settings(run)
    assert settings["layers"] == [3, 1] and settings["balance"] == "measured"
    resumed = Trainer(TrainConfig.from_flat(settings).replace(resume=str(run), run_name="measured",
                                                             output_dir=str(tmp_path)))
    assert resumed.balance is None
    resumed.run()
    assert _rows(run, "balance") == [row]  # kept, not written twice

    # the same run as --layers 3,1 gives (weights from the same start, the same seed and data)
    plain = Trainer(_cfg(tmp_path, run_name="plain", layers=[3, 1])).run()
    losses = [r["loss"] for r in _rows(run, "train")]
    assert losses == [r["loss"] for r in _rows(tmp_path / "plain", "train")]
    assert len(losses) == 4 and plain["final_train_loss"] == losses[-1]

    # export and eval rebuild the run's stages from its settings
    from aqsgd.train.export import run_model

    model, _, _ = run_model(run)
    assert len(model.model.layers) == 4


def test_the_local_summary_holds_the_profile(tmp_path):
    summary = Trainer(_cfg(tmp_path, run_name="s", balance="measured", max_steps=1, checkpoint_every=0)).run()
    balance = summary["balance"]
    assert balance["balance"] == "measured" and sum(balance["layers"]) == 4
    assert len(balance["stage_ms"]) == 2 and balance["passes"] == 4 and balance["peak_mb"] is None


def test_a_distributed_run_balances_and_records_the_split(tmp_path):
    # each process times its own stage; the split all agree on is recorded (which split it is depends on the
    # timings, which other processes on this machine disturb: the slow benchmark checks the choice)
    argv = ["train", "--task", "synthetic-lm", "--runtime", "distributed", "--stages", "2", "--balance",
            "measured", "--emulate-slow-stage", "1:4", "--balance-passes", "2", "--max-train-samples", "32",
            "--max-eval-samples", "4", "--max-length", "16", "--micro-batches", "2", "--micro-batch-size",
            "4", "--warmup-epochs", "0", "--max-steps", "2", "--eval-every", "0", "--output-dir",
            str(tmp_path), "--run-name", "d", "--no-progress", "--no-tensorboard"]
    assert main(argv) == 0
    run = tmp_path / "d"
    balance = json.loads((run / "summary.json").read_text())["balance"]
    assert balance["profiled_layers"] == [2, 2] and len(balance["stage_ms"]) == 2
    assert all(t > 0 for t in balance["stage_ms"])  # both stages' figures reached the writer
    layers = balance["layers"]
    assert sum(layers) == 4 and min(layers) >= 1
    assert json.loads((run / "config.json").read_text())["pipeline"]["layers"] == layers
    assert resume_settings(run)["layers"] == layers
    assert _rows(run, "balance")[0]["layers"] == layers
    assert [r["step"] for r in _rows(run, "train")] == [1, 2]


@pytest.mark.parametrize("argv, needle", [
    (["--balance", "measured", "--layers", "2,2"], "--balance measured chooses the blocks per stage itself"),
    (["--emulate-slow-stage", "2:2"], "--emulate-slow-stage: stage 2 is not a stage of the 2-stage pipeline"),
    (["--emulate-slow-stage", "1:0.5"], "stage 1: the factor must be a finite number >= 1"),
    (["--emulate-slow-stage", "one"], "--emulate-slow-stage: 'one' is not STAGE:FACTOR"),
    (["--balance", "speed"], "--balance: 'speed' is not one of layers, params, measured"),
    (["--balance-passes", "0"], "--balance-passes: must be >= 1"),
])
def test_bad_inputs_are_one_line_errors(argv, needle, capsys, tmp_path):
    code = main(["train", "--task", "synthetic-lm", "--stages", "2", "--output-dir", str(tmp_path), *argv])
    err = capsys.readouterr().err.strip()
    assert code != 0 and needle in err and len(err.splitlines()) == 1, err


def test_measured_with_a_split_given_from_python_takes_it_unprofiled(tmp_path):
    cfg = _cfg(tmp_path, run_name="given", balance="measured", layers=[1, 3], max_steps=1)
    trainer = Trainer(cfg)
    assert trainer.balance is None and trainer.cfg.pipeline.layers == [1, 3]
    with pytest.raises(SpecError, match="--emulate-slow-stage"):
        _cfg(tmp_path, emulate_slow_stage="0:2,0:3").validate()
