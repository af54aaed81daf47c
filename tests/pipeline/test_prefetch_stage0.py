"""Disk-cache prefetch in the stage runner: every stage, stage 0 included, reads micro-batch k + 1's cache
rows ahead when micro-batch k's forward starts, once per micro-batch, and every cache read is then a prefetch
hit."""

from __future__ import annotations

import collections

import pytest
import torch

from aqsgd.pipeline.compression import CompressionConfig
from aqsgd.pipeline.partition import partition_model
from aqsgd.pipeline.local import LocalPipeline
from aqsgd.schemes import DeltaScheme
from aqsgd.schemes.cache import DiskCache

from .test_partition import BATCH, CASES, split_batch

STAGES, MICROBATCHES, TRAIN_STEPS = 3, 4, 3


def _run(tmp_path, schedule: str, cache: str, prefetches: list | None = None, monkeypatch=None):
    case = CASES["gpt2"]()
    comp = CompressionConfig.simple("delta:q2", "direct:q4", num_samples=BATCH, cache=cache,
                                    cache_dir=str(tmp_path / "caches") if cache == "disk" else None)
    pipe = LocalPipeline(partition_model(case.model, STAGES), comp, schedule=schedule)
    if prefetches is not None:
        original = DeltaScheme.prefetch

        def recording(self, sample_ids):
            prefetches.append((self, tuple(torch.as_tensor(sample_ids).tolist())))
            return original(self, sample_ids)

        monkeypatch.setattr(DeltaScheme, "prefetch", recording)
    opt = torch.optim.SGD(case.model.parameters(), lr=0.1)
    mbs = split_batch(case.batch, MICROBATCHES)
    losses = []
    for step in range(1 + TRAIN_STEPS):
        if step == 1 and prefetches is not None:
            prefetches.clear()  # count the training steps only: all their rows are in the caches
        opt.zero_grad()
        losses.append(float(pipe.step(mbs, phase="warmup" if step == 0 else "train")))
        opt.step()
    return pipe, mbs, losses


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_every_stage_prefetches_every_microbatch_once(tmp_path, monkeypatch, schedule):
    prefetches: list = []
    pipe, mbs, losses = _run(tmp_path, schedule, "disk", prefetches, monkeypatch)
    try:
        mb_of_ids = {tuple(mb["sample_ids"].tolist()): m for m, mb in enumerate(mbs)}
        for stage, runner in enumerate(pipe.runners):
            deltas = [s for s in runner.schemes.values() if isinstance(s, DeltaScheme)]
            assert deltas, f"stage {stage} has no delta scheme"
            for scheme in deltas:
                assert isinstance(scheme.cache, DiskCache)
                calls = collections.Counter(mb_of_ids[ids] for s, ids in prefetches if s is scheme)
                # every micro-batch of every training step prefetched, none twice
                assert calls == {m: TRAIN_STEPS for m in range(MICROBATCHES)}, (stage, scheme.label, calls)
                # and every cache read was served from its prefetch (stage 0 used to miss all but
                # micro-batch 0)
                assert (scheme.cache.prefetch_hits, scheme.cache.prefetch_misses) == (
                    TRAIN_STEPS * MICROBATCHES, 0), (stage, scheme.label)
        # prefetching changes nothing in the numbers
        _, _, memory_losses = _run(tmp_path, schedule, "memory")
        assert losses == memory_losses
    finally:
        for runner in pipe.runners:
            for s in runner.schemes.values():
                if isinstance(s, DeltaScheme) and isinstance(s.cache, DiskCache):
                    s.cache.close()
