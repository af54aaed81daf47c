"""The batches of a run as one process feeds them to its stages.

Data parallelism (``data_parallel = D > 1``): every pipeline pass reads a global batch of ``micro_batches x
micro_batch_size x D`` samples (steps per epoch follow from it); replica ``r`` trains on the contiguous shard
``[r B, (r+1) B)`` of it (a partial last batch is split into ``D`` nearly equal shards; a trailing batch with
fewer than ``D`` samples is dropped), so the stages of one replica agree on the sample ids and its AQ-SGD
caches stay consistent. Evaluation is sharded the same way.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch.utils.data import Dataset

from aqsgd.data.datasets import epoch_batches
from aqsgd.data.synthetic import microbatches

if TYPE_CHECKING:
    from aqsgd.train.config import TrainConfig

__all__ = ["DataFeed", "without_full_mask"]

Batch = dict[str, torch.Tensor]


def without_full_mask(batch: Batch) -> Batch:
    """``batch`` without its ``attention_mask`` where that is all ones (no padding: every LM chunk), which is
    what a missing mask means to every model. Otherwise each stage's mask builder checks the mask for padding
    on the stages' device, a host wait per stage and micro-batch on a GPU; one look on the host decides
    here."""
    mask = batch.get("attention_mask")
    if mask is not None and mask.device.type == "cpu" and bool(mask.all()):
        return {k: v for k, v in batch.items() if k != "attention_mask"}
    return batch


class DataFeed:
    """The global batches of each epoch (the same on every process, in the order fixed by seed and epoch),
    this replica's shard of each, cut into micro-batches on the stages' device."""

    def __init__(self, cfg: TrainConfig, train: Dataset, evaluation: Dataset, *, replica: int,
                 device: torch.device | None = None) -> None:
        self.cfg, self.train, self.eval, self.replica = cfg, train, evaluation, replica
        self.device = device or torch.device("cpu")
        self.replicas = cfg.pipeline.data_parallel

    def batches_per_epoch(self) -> int:
        """Global batches of one epoch: a trailing partial batch counts if it has a sample for every
        replica."""
        full, rest = divmod(len(self.train), self.cfg.global_batch_size)
        return full + (1 if rest >= self.replicas else 0)

    def train_batches(self, epoch: int) -> list[Batch]:
        """The global batches of one epoch, in the order fixed by (seed, epoch)."""
        batches = epoch_batches(self.train, self.cfg.global_batch_size, seed=self.cfg.optim.seed, epoch=epoch)
        return [b for b in batches if b["sample_ids"].numel() >= self.replicas]

    def eval_batches(self) -> Iterable[Batch]:
        """The evaluation data's global batches, in order."""
        return epoch_batches(self.eval, self.cfg.global_batch_size, seed=self.cfg.optim.seed, epoch=0,
                             shuffle=False)

    def shard(self, batch: Batch) -> Batch:
        """This replica's contiguous shard of a global batch (the whole batch without data parallelism)."""
        if self.replicas == 1:
            return batch
        return {k: torch.tensor_split(v, self.replicas)[self.replica] for k, v in batch.items()}

    def micro(self, batch: Batch) -> list[Batch]:
        """A (sharded) batch as the micro-batches of one pipeline pass, on the stages' device."""
        return microbatches(self.on_device(batch), self.cfg.pipeline.micro_batches)

    def passes(self, group: list[Batch]) -> list[list[Batch]]:
        """The pipeline passes of one optimizer step (``grad_accum`` global batches): this replica's
        shards."""
        return [self.micro(self.shard(b)) for b in group]

    def on_device(self, batch: Batch) -> Batch:
        """The batch's tensors on the stages' device (non-blocking from pinned memory). Sample ids stay on the
        host: the boundary schemes and their caches index with them there. An attention mask of ones is left
        out (:func:`without_full_mask`)."""
        batch = without_full_mask(batch)
        if self.device.type == "cpu":
            return batch
        return {k: v if k == "sample_ids" or not isinstance(v, torch.Tensor)
                else v.to(self.device, non_blocking=v.is_pinned()) for k, v in batch.items()}
