"""The transport's payload checksum as a training option (``--checksum/--no-checksum``, the pipeline section).

One spawned pair of processes (a 2-stage distributed pipeline on gloo) runs several trainers one after
another: stages started with different settings, a run with the default, the same run with ``--no-checksum``,
and a run interrupted after a checkpoint and resumed with the setting flipped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from aqsgd.cli import build_parser
from aqsgd.cli.train import build_config
from aqsgd.comm.testing import run_processes
from aqsgd.errors import ConfigMismatchError
from aqsgd.train.config import TrainConfig
from aqsgd.train.tasks import setup_task
from aqsgd.train.trainer import Trainer


def _cfg(tmp_path: Path, **kw: Any) -> TrainConfig:
    base = dict(task="synthetic-lm", max_train_samples=8, max_eval_samples=4, max_length=12, stages=2,
                micro_batches=2, micro_batch_size=2, epochs=2, warmup_epochs=1, lr=3e-3,
                output_dir=str(tmp_path), progress=False, tensorboard=False, forward="delta:q2",
                backward="ef21:q4", cache_dir=str(tmp_path / "cache"), runtime="distributed", timeout=60.0,
                eval_every=0, checkpoint_every=0)
    base.update(kw)
    return TrainConfig.of(**base)


def _rows(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == kind]


def _worker(rank: int, world: int, cfg_json: str) -> dict[str, Any]:
    cfg = TrainConfig.from_dict(json.loads(cfg_json))
    out: dict[str, Any] = {}
    try:  # refused at start-up, before any pipeline traffic
        Trainer(cfg.replace(checksum=rank == 0, run_name="mixed"))
    except ConfigMismatchError as e:
        out["mixed_error"] = str(e)
    for name, checksum in (("crc", True), ("nocrc", False)):
        trainer = Trainer(cfg.replace(checksum=checksum, run_name=name))
        out[f"{name}_transport"] = trainer.transport.checksum if trainer.transport is not None else None
        trainer.run()
    # 2 steps per epoch: checkpoint at step 2 (after the warm-up) with checksums, "dies" after step 3, resumes
    # from step 2 without them (into the compressed epoch: AQ-SGD cache and EF21 state restored)
    part = cfg.replace(run_name="part", checkpoint_every=2)
    Trainer(part).run(stop_at=3)
    Trainer(part.replace(resume=str(Path(cfg.run.output_dir) / "part"), checksum=False)).run()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("checksum")
    cfg = _cfg(tmp)
    setup_task(cfg)  # the weights file, once, before the processes start
    ranks = run_processes(_worker, 2, args=(cfg.to_json(),), timeout_s=300, pg_timeout_s=120)
    return tmp, ranks


def test_no_checksum_is_a_command_line_option():
    args = ["train", "--runtime", "distributed", "--stages", "2"]
    assert build_config(build_parser().parse_args(args)).pipeline.checksum is True
    assert build_config(build_parser().parse_args([*args, "--no-checksum"])).pipeline.checksum is False
    assert TrainConfig.of(checksum=False).flat()["checksum"] is False


@pytest.mark.slow
def test_stages_with_different_checksum_settings_stop_at_start_up(runs):
    _, ranks = runs
    for r in ranks:
        assert "checksum: rank 0 has True, rank 1 has False" in r["mixed_error"]


def test_no_checksum_reaches_the_transport_and_keeps_the_losses_bit_identical(runs):
    tmp, ranks = runs
    assert [(r["crc_transport"], r["nocrc_transport"]) for r in ranks] == [(True, False)] * 2
    crc, nocrc = _rows(tmp / "crc", "train"), _rows(tmp / "nocrc", "train")
    assert len(crc) == 4 and [r["loss"] for r in nocrc] == [r["loss"] for r in crc]
    # the same wire bytes: the header is fixed
    assert [r["bytes"] for r in nocrc] == [r["bytes"] for r in crc]


def test_checksum_may_change_on_resume(runs):
    tmp, _ = runs
    expect = {r["step"]: r["loss"] for r in _rows(tmp / "crc", "train")}
    got = [(r["step"], r["loss"]) for r in _rows(tmp / "part", "train")]
    assert [s for s, _ in got] == sorted(expect)
    assert all(loss == expect[step] for step, loss in got)
    config = json.loads((tmp / "part" / "config.json").read_text())
    assert config["pipeline"]["checksum"] is False  # the resumed run's own setting
