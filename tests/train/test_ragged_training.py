"""Training on examples of their own lengths (``--batching bucket|pack``): no pad token crosses a boundary
(counted in the metrics), and the AQ-SGD cache, keyed by token, stays exact across resume, the runtimes and
data parallelism."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

from aqsgd.comm.testing import run_processes
from aqsgd.data.datasets.base import DictDataset
from aqsgd.data.datasets.ragged import IGNORE_INDEX, RaggedDataset
from aqsgd.errors import SpecError
from aqsgd.train.checkpoint import CheckpointError
from aqsgd.train.config import TrainConfig
from aqsgd.train.feed import DataFeed
from aqsgd.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def examples(n: int, seed: int) -> RaggedDataset:
    """Causal-LM examples of 3..24 tokens, the first half of each a prompt without loss."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 25, (n,), generator=g)
    offsets = torch.zeros(n + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    ids = torch.randint(1, 128, (int(offsets[-1]),), generator=g)
    labels = ids.clone()
    for i in range(n):
        labels[offsets[i]: offsets[i] + lengths[i] // 2] = IGNORE_INDEX
    return RaggedDataset({"input_ids": ids, "labels": labels}, offsets,
                         info={"kind": "causal-lm", "pad_token_id": 0})


def _data() -> tuple[RaggedDataset, RaggedDataset]:
    return examples(32, 0), examples(8, 1)


def _cfg(tmp_path: Path, **kw: Any) -> TrainConfig:
    base = dict(model="tiny-llama", max_length=24, stages=2, micro_batches=2, micro_batch_size=4, epochs=3,
                warmup_epochs=1, lr=3e-3, output_dir=str(tmp_path), progress=False, tensorboard=False,
                forward="delta:q2", backward="direct:q4", cache_dir=str(tmp_path / "cache"),
                checkpoint_every=0, batching="bucket")
    base.update(kw)
    return TrainConfig.of(**base)


def _train_rows(run_dir: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"]


@pytest.mark.parametrize("batching", ["bucket", "pack"])
def test_no_pad_token_crosses_and_resume_is_exact(tmp_path, batching):
    """Every step sends 0 pad tokens (the metrics count them) and a run resumed mid-epoch, with the
    token-keyed AQ-SGD cache restored from its checkpoint, equals the uninterrupted run bit for bit."""
    full = Trainer(_cfg(tmp_path, run_name="full", batching=batching), data=_data()).run()
    rows = _train_rows(tmp_path / "full")
    assert all(r["pad_tokens_sent"] == 0 and r["tokens"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    assert full["batching"] == batching and full["pad_tokens_sent"] == 0
    part = _cfg(tmp_path, run_name="part", batching=batching, checkpoint_every=5)
    Trainer(part, data=_data()).run(stop_at=7)  # 4 steps an epoch: step 5 is inside the first compressed one
    Trainer(part.replace(resume=str(tmp_path / "part")), data=_data()).run()
    assert [r["loss"] for r in _train_rows(tmp_path / "part")] == [r["loss"] for r in rows]


@pytest.mark.parametrize(("forward", "backward"), [
    ("ef:topk0.3", "ef21:topk0.3"),
    ("delta:topk0.3", "direct:q4:rot64:l2:zstd"),
    ("delta:q4:rot128:step1:rc", "direct:q4:l2:outlier8"),
    ("auto", "auto"),
])
def test_every_scheme_takes_examples_of_their_own_lengths(tmp_path, forward, backward):
    """TopK, error feedback (EF, EF21, per token), rotated tiles, outlier rows, the entropy stages and the
    adaptive links train on bucketed examples unchanged, sending no pad token."""
    cfg = _cfg(tmp_path, run_name="s", forward=forward, backward=backward, epochs=2)
    if forward == "auto":  # links are measured between stage processes
        cfg = cfg.replace(runtime="distributed", timeout=120.0)
        ranks = run_processes(_worker, 2, args=(cfg.to_json(),), timeout_s=300, pg_timeout_s=120)
        summary = ranks[-1]["summary"]
    else:
        summary = Trainer(cfg, data=_data()).run()
    rows = _train_rows(tmp_path / "s")
    assert all(r["pad_tokens_sent"] == 0 for r in rows)
    assert summary["compression_ratio"] > 1 and all(r["loss"] is not None for r in rows)


def test_padding_to_max_length_sends_and_counts_the_pads(tmp_path):
    Trainer(_cfg(tmp_path, run_name="max", batching="max-length", epochs=1), data=_data()).run()
    rows = _train_rows(tmp_path / "max")
    # 2 stages: one boundary, each pad position sent forward and its gradient backward
    for r in rows:
        assert r["pad_tokens_sent"] == 2 * (8 * 24 - r["tokens"])


def test_resume_refuses_another_batching(tmp_path):
    Trainer(_cfg(tmp_path, run_name="r", epochs=1, warmup_epochs=0, checkpoint_every=2), data=_data()).run()
    with pytest.raises(CheckpointError, match="batching='bucket' \\(this run: 'pack'\\)"):
        Trainer(_cfg(tmp_path, run_name="r", batching="pack", resume=str(tmp_path / "r")), data=_data()).run()


def _worker(rank: int, world: int, cfg_json: str) -> dict[str, Any]:
    cfg = TrainConfig.from_dict(json.loads(cfg_json))
    trainer = Trainer(cfg, data=_data())
    summary = trainer.run()
    out: dict[str, Any] = {"stage": trainer.grid.stage, "replica": trainer.grid.replica, "summary": summary}
    if trainer.grid.stage == 0:  # the token ids its forward sender's cache holds rows for
        cache = trainer.engine.runners[0].schemes[(0, 0, "sender")].cache
        out["visited"] = torch.nonzero(cache.visited(torch.arange(cache.capacity))).reshape(-1).tolist()
    return out


@pytest.mark.slow
def test_distributed_equals_local_and_replicas_keep_their_own_tokens(tmp_path):
    """A distributed run of 2 stages computes the local run's losses; with 2 replicas each replica's cache
    holds the rows of the examples it was given, whole (a shard is an epoch's: an example may reach either
    replica), together every token of the data set."""
    local = Trainer(_cfg(tmp_path, run_name="local", epochs=2), data=_data()).run()
    dist_cfg = _cfg(tmp_path, run_name="dist", epochs=2, runtime="distributed", timeout=120.0)
    run_processes(_worker, 2, args=(dist_cfg.to_json(),), timeout_s=300, pg_timeout_s=120)
    losses = [r["loss"] for r in _train_rows(tmp_path / "local")]
    assert [r["loss"] for r in _train_rows(tmp_path / "dist")] == losses
    assert local["eval"] is not None

    dp_cfg = _cfg(tmp_path, run_name="dp", epochs=2, runtime="distributed", data_parallel=2, timeout=120.0,
                  micro_batch_size=2)
    ranks = run_processes(_worker, 4, args=(dp_cfg.to_json(),), timeout_s=300, pg_timeout_s=120)
    visited = {r["replica"]: set(r["visited"]) for r in ranks if r["stage"] == 0}
    train = _data()[0]
    assert visited[0] | visited[1] == set(range(train.num_tokens))
    for replica in (0, 1):  # whole examples: every token of an example it was given, none of the others
        for i in range(len(train)):
            held = {t in visited[replica] for t in range(int(train.offsets[i]), int(train.offsets[i + 1]))}
            assert len(held) == 1, (replica, i)


def test_batching_refused_where_it_cannot_apply(tmp_path):
    cfg = _cfg(tmp_path, batching="pack")
    g = torch.Generator().manual_seed(0)
    classes = RaggedDataset({"input_ids": torch.randint(1, 50, (20,), generator=g)}, torch.arange(0, 21, 5),
                            values={"labels": torch.tensor([0, 1, 0, 1])})
    with pytest.raises(SpecError, match="--batching pack puts several examples in one row"):
        DataFeed(cfg, classes, classes, replica=0)

    class Images(Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 4

    with pytest.raises(SpecError, match="--batching bucket lays out text"):
        DataFeed(_cfg(tmp_path), Images(), Images(), replica=0)


def test_padded_classification_is_taken_apart_for_bucket(tmp_path):
    """Padded text (a classification DictDataset) becomes examples of their own lengths, the same tokens."""
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0], [4, 4, 4, 4]])
    padded = DictDataset({"input_ids": ids, "attention_mask": (ids != 0).long(),
                          "labels": torch.tensor([0, 1, 1])})
    feed = DataFeed(_cfg(tmp_path, micro_batches=1), padded, padded, replica=0)
    assert isinstance(feed.train, RaggedDataset) and feed.train.lengths.tolist() == [3, 2, 4]
    [mb] = feed.micro({"sample_ids": torch.tensor([0, 1, 2])})
    assert mb["input_ids"].shape == (3, 4) and mb["real_tokens"] == 9
    assert mb["labels"].tolist() == [1, 0, 1]  # longest first
