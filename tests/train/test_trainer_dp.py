"""The trainer with data parallelism: 2 stages x 2 replicas on gloo.

Two spawned runs of four processes (start-up dominates: every process imports torch and transformers):

* ``dp_resume`` runs several trainers one after another in the same four processes (``run_processes``): a
  world-size mismatch, an uninterrupted run, and a run interrupted after a checkpoint and then resumed;
* ``test_uncompressed_dp_matches_one_pipeline_with_twice_the_micro_batches`` goes through the command line
  (``aqsgd train --runtime distributed --data-parallel 2``, the elastic launcher).
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from aqsgd.comm.testing import run_processes
from aqsgd.errors import ConfigMismatchError, SpecError
from aqsgd.pipeline.partition import partition_model
from aqsgd.train.checkpoint import CheckpointError
from aqsgd.train.config import TrainConfig
from aqsgd.train.tasks import setup_task
from aqsgd.train.feed import DataFeed
from aqsgd.train.trainer import Trainer

S, D = 2, 2


def _cfg(tmp_path: Path, **kw: Any) -> TrainConfig:
    base = dict(task="synthetic-lm", max_train_samples=30, max_eval_samples=10, max_length=12, stages=S,
                micro_batches=2, micro_batch_size=2, epochs=3, warmup_epochs=1, lr=3e-3,
                output_dir=str(tmp_path), progress=False, tensorboard=False, forward="delta:q2",
                backward="direct:q4", cache_dir=str(tmp_path / "cache"), runtime="distributed",
                data_parallel=D, grad_sync="q8", timeout=120.0)
    base.update(kw)
    return TrainConfig.of(**base)


def _rows(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == kind]


def _resume_worker(rank: int, world: int, cfg_json: str) -> dict[str, Any]:
    cfg = TrainConfig.from_dict(json.loads(cfg_json))
    out: dict[str, Any] = {}
    try:  # 4 processes for 2 stages x 1 replica: refused before any collective
        Trainer(cfg.replace(data_parallel=1, run_name="wrong"))
    except ConfigMismatchError as e:
        out["world_error"] = str(e)
    full = Trainer(cfg.replace(run_name="full"))
    out["coords"] = (full.grid.stage, full.grid.replica) if full.grid is not None else None
    out["full"] = full.run()
    # checkpoints at steps 3 and 6 (the second one inside epoch 1, after the warm-up), then "dies" after
    # step 8
    part = cfg.replace(run_name="part", checkpoint_every=3)
    Trainer(part).run(stop_at=8)
    out["resumed"] = Trainer(part.replace(resume=str(Path(cfg.run.output_dir) / "part"))).run()
    return out


@pytest.fixture(scope="module")
def dp_resume(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp")
    cfg = _cfg(tmp)
    setup_task(cfg)  # the weights file, once, before the processes start
    ranks = run_processes(_resume_worker, S * D, args=(cfg.to_json(),), timeout_s=420, pg_timeout_s=120)
    return tmp, cfg, ranks


@pytest.mark.slow
def test_world_size_must_be_stages_times_replicas(dp_resume):
    _, _, ranks = dp_resume
    for r in ranks:
        assert "4 processes for 2 stages x 1 data-parallel replicas" in r["world_error"]
        assert "stages x data_parallel = 2" in r["world_error"]
    assert [r["coords"] for r in ranks] == [(0, 0), (1, 0), (0, 1), (1, 1)]  # rank = replica * S + stage


def test_resume_with_data_parallelism_continues_exactly(dp_resume):
    tmp, _, ranks = dp_resume
    expect = {r["step"]: r["loss"] for r in _rows(tmp / "full", "train")}
    # 30 samples in global batches of 8: three full batches and a partial one (shards of 3 + 3): 4 steps/epoch
    assert sorted(expect) == list(range(1, 13))
    got = [(r["step"], r["loss"]) for r in _rows(tmp / "part", "train")]
    # steps 7 and 8 ran twice (before the interruption and again after resuming from step 6); resuming cut the
    # first records of them from metrics.jsonl, so every step is recorded once
    assert [s for s, _ in got] == list(range(1, 13))
    for step, loss in got:
        # bit-identical on CPU: caches, EF buffers, q8 error buffers restored
        assert loss == expect[step], step
    assert [e["uncompressed"]["loss"] for e in _rows(tmp / "part", "eval")][-1] == \
        [e["uncompressed"]["loss"] for e in _rows(tmp / "full", "eval")][-1]
    # only stage 1 of replica 0 returns a summary with a loss (the others hold no history)
    writers = [i for i, r in enumerate(ranks) if r["full"]["final_train_loss"] is not None]
    assert writers == [1]
    assert ranks[1]["resumed"]["final_train_loss"] == ranks[1]["full"]["final_train_loss"]
    assert ranks[1]["resumed"]["grad_sync_bytes"] == ranks[1]["full"]["grad_sync_bytes"]


def test_checkpoint_layout_per_replica(dp_resume):
    tmp, _, _ = dp_resume
    ckpt = max((tmp / "part" / "checkpoints").glob("step-*"))
    for i in range(S):
        stage = ckpt / f"stage{i}"
        assert (stage / "model.safetensors").exists() and (stage / "optimizer.pt").exists()
        assert not (stage / "schemes").exists()
        for r in range(D):
            own = stage / f"replica{r}"
            assert (own / "grad_sync.safetensors").exists()
            assert not (own / "model.safetensors").exists()  # weights once per stage: replicas are identical
            assert any((own / "schemes").iterdir())
    assert sorted(p.name for p in ckpt.glob("rank*.rng.json")) == [f"rank{r}.rng.json" for r in range(S * D)]


def test_metrics_carry_grad_sync_bytes(dp_resume):
    tmp, cfg, _ = dp_resume
    train = _rows(tmp / "full", "train")
    assert all(r["grad_sync_bytes"] > 0 for r in train)
    warm, compressed = train[0]["grad_sync_bytes"], train[-1]["grad_sync_bytes"]
    # warm-up is the fp32 ring all-reduce (2 (D-1)/D x 4 bytes per value at D = 2, every rank); q8 is
    # about 1/4
    stages = partition_model(setup_task(cfg).recipe.build("meta"), S)
    numel = sum(p.numel() for m in stages for p in m.parameters())
    assert warm == D * 4 * numel
    assert 0.25 < compressed / warm < 0.3
    # boundary bytes are summed over both replica pipelines: fp32 size of every sample's [12, 64] activation
    # and its gradient, for the 8 samples of a global batch (6 in the partial last batch of each epoch)
    samples = [8, 8, 8, 6] * 3
    assert [r["raw_bytes"] for r in train] == [2 * n * 12 * 64 * 4 for n in samples]
    assert set(train[0]["bytes"]) == {"b0.forward", "b0.backward"}
    assert train[0]["ratio"] == pytest.approx(1.0, rel=0.05) and train[-1]["ratio"] > 3


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in _rows(run_dir, "train")]


def test_uncompressed_dp_matches_one_pipeline_with_twice_the_micro_batches(tmp_path):
    quick = dict(max_train_samples=32, max_eval_samples=16, epochs=2, forward="none", backward="none",
                 grad_sync="allreduce")
    cfg = _cfg(tmp_path, run_name="dp", **quick)
    names = ("task", "max_train_samples", "max_eval_samples", "max_length", "stages", "micro_batches",
             "micro_batch_size", "epochs", "warmup_epochs", "lr", "output_dir", "cache_dir", "forward",
             "backward", "runtime", "data_parallel", "grad_sync", "timeout", "run_name")
    flat = cfg.flat()
    argv = [f"--{name.replace('_', '-')}={flat[name]}" for name in names]
    out = subprocess.run([sys.executable, "-m", "aqsgd.cli", "train", *argv, "--no-progress",
                          "--no-tensorboard"],
                         capture_output=True, text=True, timeout=420, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "2 stages x 2 replicas" in out.stdout and "bytes sent between replicas" in out.stdout
    summary = json.loads((tmp_path / "dp" / "summary.json").read_text())
    assert summary["data_parallel"] == D and summary["steps"] == 8

    one = Trainer(_cfg(tmp_path, run_name="one", runtime="local", data_parallel=1,
                       micro_batches=2 * D, **quick)).run()
    assert one["steps"] == summary["steps"]
    dp, single = _losses(tmp_path / "dp"), _losses(tmp_path / "one")
    # Same samples in the same micro-batches (replica r's micro-batch m is the single pipeline's r*M+m), the
    # same averaged gradient, summed in another order: the single pipeline accumulates 1/(DM) of each
    # micro-batch's gradient, each replica 1/M of its own and the all-reduce divides the sum by D; the logged
    # loss is a mean of replica means. Float rounding only: measured max relative difference 1.0e-7 over 8
    # AdamW steps (one fp32 ulp of a loss near 4.7, already at step 1 from the order of the mean). 1e-5 leaves
    # room for rounding to grow through Adam, while a wrong shard, a missed replica or no averaging changes
    # the loss by ~1e-2 (one step at lr 3e-3 moves it by 4e-2).
    torch.testing.assert_close(torch.tensor(dp), torch.tensor(single), rtol=1e-5, atol=0)
    dp_eval = _rows(tmp_path / "dp", "eval")[-1]["uncompressed"]["loss"]
    one_eval = _rows(tmp_path / "one", "eval")[-1]["uncompressed"]["loss"]
    assert dp_eval == pytest.approx(one_eval, rel=1e-5)  # sharded evaluation: the same 16 samples
    assert summary["grad_sync_bytes"] > 0 and one["grad_sync_bytes"] == 0


def _shard_bounds(n: int, parts: int, replica: int) -> tuple[int, int]:
    """The ``[start, stop)`` of a global batch of ``n`` samples that the trainer gives ``replica``."""
    feed = DataFeed(TrainConfig.of(data_parallel=parts), [], [], replica=replica)  # type: ignore[arg-type]
    ids = feed.shard({"sample_ids": torch.arange(n)})["sample_ids"]
    return (int(ids[0]), int(ids[-1]) + 1) if ids.numel() else (n if replica else 0, n if replica else 0)


def test_shards_cover_the_batch_contiguously():
    assert [_shard_bounds(8, 2, r) for r in range(2)] == [(0, 4), (4, 8)]
    assert [_shard_bounds(7, 3, r) for r in range(3)] == [(0, 3), (3, 5), (5, 7)]
    for n in range(1, 12):
        for parts in range(1, 5):
            if n < parts:
                continue  # the trainer drops a batch with fewer samples than replicas
            bounds = [_shard_bounds(n, parts, r) for r in range(parts)]
            assert bounds[0][0] == 0 and bounds[-1][1] == n
            assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
            assert max(b - a for a, b in bounds) - min(b - a for a, b in bounds) <= 1


@pytest.mark.parametrize("field,value,needle", [
    ("data_parallel", 0, "--data-parallel: must be >= 1"),
    ("grad_sync", "q9", "--grad-sync"),
    ("grad_sync", "topk0.1", "--grad-sync"),
    ("grad_bucket_mb", 0.0, "--grad-bucket-mb"),
])
def test_invalid_data_parallel_values_name_the_option(tmp_path, field, value, needle):
    with pytest.raises(SpecError, match=needle):
        _cfg(tmp_path, **{field: value}).validate()


@pytest.mark.parametrize("kw,needle", [
    (dict(dp_link="30mbit", data_parallel=1), "--dp-link: emulates the links between replicas: it needs "
                                              "--data-parallel 2"),
    (dict(dp_link="fast"), "--dp-link"),
])
def test_bad_dp_links_are_refused_in_one_line(tmp_path, kw, needle):
    with pytest.raises(SpecError, match=needle):
        _cfg(tmp_path, **kw).validate()


def test_the_replicas_sync_is_paced_by_dp_link_before_link(tmp_path):
    """The sync's emulated link: --dp-link, else --link's setting, else none; the boundaries keep --link."""
    from aqsgd.comm.link import LinkSpec
    from aqsgd.parallel.grid import GridLayout, ProcessGrid
    from aqsgd.train.linkcontrol import LinkController

    grid = ProcessGrid(GridLayout(S, D), 0, None, None)
    sync = lambda **kw: LinkController(_cfg(tmp_path, **kw).validate()).process_links(grid)  # noqa: E731
    assert sync() == (None, None)
    assert sync(dp_link="30mbit,20ms") == (None, LinkSpec.parse("30mbit,20ms"))
    boundaries, link = sync(link="1gbit", dp_link="30mbit")
    assert link == LinkSpec.parse("30mbit") and set(boundaries.values()) == {LinkSpec.parse("1gbit")}
    assert sync(link="1gbit")[1] == LinkSpec.parse("1gbit")


def test_data_parallel_needs_the_distributed_runtime(tmp_path):
    with pytest.raises(SpecError, match="--data-parallel: 2 replicas need --runtime distributed"):
        _cfg(tmp_path, runtime="local").validate()


def test_resume_refuses_another_number_of_replicas(dp_resume, tmp_path):
    tmp, _, _ = dp_resume
    cfg = _cfg(tmp_path, runtime="local", data_parallel=1, resume=str(tmp / "full"), run_name="other")
    with pytest.raises(CheckpointError, match="data_parallel=2"):
        Trainer(cfg).run()
