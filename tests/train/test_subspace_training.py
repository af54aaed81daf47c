"""Training with the subspace stage (``pca<r>``) in both directions: an exact resume, each data-parallel
replica's boundary with a basis of its own that its two sides hold identically, and the bases counted in the
traffic."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from aqsgd.comm.testing import run_processes
from aqsgd.train.config import TrainConfig
from aqsgd.train.trainer import Trainer

from test_ragged_training import _cfg, _data, _train_rows  # noqa: I001 (the ragged tests' tiny Llama and data)

pytestmark = pytest.mark.usefixtures("one_thread")

FORWARD, BACKWARD = "delta:q4:pca16:refresh3", "ef:q4:rot64:step1:rc:pca16:refresh3"


def _bases(checkpoint: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {f.parent.relative_to(checkpoint).as_posix(): load_file(str(f))
            for f in sorted(checkpoint.rglob("basis.safetensors"))}


def test_resume_mid_run_is_exact_and_both_sides_hold_one_basis(tmp_path):
    cfg = _cfg(tmp_path, run_name="full", forward=FORWARD, backward=BACKWARD)
    full = Trainer(cfg, data=_data()).run()
    losses = [r["loss"] for r in _train_rows(tmp_path / "full")]
    part = cfg.replace(run_name="part", checkpoint_every=5)
    Trainer(part, data=_data()).run(stop_at=7)  # step 5: inside the first compressed epoch, mid-refresh
    bases = _bases(tmp_path / "part" / "checkpoints" / "step-00000005")
    assert len(bases) == 4  # one boundary, two directions, two sides
    for direction in ("forward", "backward"):
        sides = [v for k, v in bases.items() if f"-{direction}-" in k]
        assert torch.equal(sides[0]["basis"], sides[1]["basis"]) and sides[0]["basis"].shape[0] == 16
        assert sides[0]["version"].item() == sides[1]["version"].item() >= 1
    Trainer(part.replace(resume=str(tmp_path / "part")), data=_data()).run()
    assert [r["loss"] for r in _train_rows(tmp_path / "part")] == losses
    # the bases crossed as packets of their own, counted: more than the data packets alone
    rows = _train_rows(tmp_path / "full")
    assert full["compression_ratio"] > 1 and all(r["pad_tokens_sent"] == 0 for r in rows)


def _worker(rank: int, world: int, cfg_json: str) -> dict[str, Any]:
    cfg = TrainConfig.from_dict(json.loads(cfg_json))
    trainer = Trainer(cfg, data=_data())
    trainer.run()
    out: dict[str, Any] = {"stage": trainer.grid.stage, "replica": trainer.grid.replica, "bases": {}}
    for (b, channel, side), scheme in trainer.engine.runners[trainer.grid.stage].schemes.items():
        if scheme.subspace is not None and scheme.subspace.basis is not None:
            out["bases"][f"{b}-{channel}-{side}"] = scheme.subspace.basis.tolist()
    return out


@pytest.mark.slow
def test_each_replica_boundary_holds_its_own_basis_on_both_sides(tmp_path):
    """2 stages x 2 replicas: a replica's sender estimates its basis from its own shard and sends it to its
    own receiver; the two replicas' bases differ (their data do), each is held identically on both sides."""
    cfg = _cfg(tmp_path, run_name="dp", forward=FORWARD, backward=BACKWARD, epochs=2, runtime="distributed",
               data_parallel=2, timeout=120.0, micro_batch_size=2)
    ranks = run_processes(_worker, 4, args=(cfg.to_json(),), timeout_s=300, pg_timeout_s=120)
    for replica in (0, 1):
        held = {}
        for r in ranks:
            if r["replica"] == replica:
                held.update(r["bases"])
        for channel in (0, 1):
            assert held[f"0-{channel}-sender"] == held[f"0-{channel}-receiver"]
    theirs = [{k: v for r in ranks if r["replica"] == rep for k, v in r["bases"].items()} for rep in (0, 1)]
    assert theirs[0]["0-0-sender"] != theirs[1]["0-0-sender"]
