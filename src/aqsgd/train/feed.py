"""The batches of a run as one process feeds them to its stages.

Data parallelism (``data_parallel = D > 1``): every pipeline pass reads a global batch of ``micro_batches x
micro_batch_size x D`` samples (steps per epoch follow from it); replica ``r`` trains on the contiguous shard
``[r B, (r+1) B)`` of it (a partial last batch is split into ``D`` nearly equal shards; a trailing batch with
fewer than ``D`` samples is dropped), so the stages of one replica agree on the sample ids and its AQ-SGD
caches stay consistent. Evaluation is sharded the same way.

Examples of their own lengths (a :class:`~aqsgd.data.datasets.ragged.RaggedDataset`: instruction and chat
data, or padded text taken apart with ``--batching bucket|pack``) are laid out per micro-batch
(:func:`~aqsgd.data.datasets.ragged.collate_ragged`): with ``bucket`` the epoch's order is length-grouped
and a shard's examples sorted longest first before they are cut into micro-batches, so that each is padded
to its own longest example; with ``pack`` they are packed into rows. A causal-LM pass weighs each
micro-batch's mean loss by its share of the pass's loss tokens (``loss_weight``), so that the pass's loss is
the mean over its tokens, as one unsplit batch's would be; evaluation weighs the same way.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch.utils.data import Dataset

from aqsgd.data.datasets import epoch_batches
from aqsgd.data.datasets.base import DictDataset
from aqsgd.data.datasets.batching import epoch_order
from aqsgd.data.datasets.ragged import RaggedDataset, bucketed_order, micro_batches
from aqsgd.data.synthetic import microbatches
from aqsgd.errors import SpecError

if TYPE_CHECKING:
    from aqsgd.train.config import TrainConfig

__all__ = ["DataFeed", "as_batched", "without_full_mask"]

Batch = dict[str, torch.Tensor]


def as_batched(dataset: Dataset, batching: str) -> Dataset:
    """``dataset`` as ``batching`` lays it out: padded text (a :class:`DictDataset` with an
    ``attention_mask``) taken apart into examples of their own lengths for ``bucket`` and ``pack``
    (:meth:`RaggedDataset.from_padded`: the same tokens and ids); anything else as it is."""
    if (batching in ("bucket", "pack") and isinstance(dataset, DictDataset)
            and "attention_mask" in dataset.columns and "input_ids" in dataset.columns):
        info = dict(dataset.info)
        info.setdefault("pad_token_id", 0)
        return RaggedDataset.from_padded(dataset.columns, info=info)
    return dataset


def without_full_mask(batch: Batch) -> Batch:
    """``batch`` without its ``attention_mask`` where that is all ones (no padding: every LM chunk), which is
    what a missing mask means to every model. Otherwise each stage's mask builder checks the mask for padding
    on the stages' device, a host wait per stage and micro-batch on a GPU; one look on the host decides
    here."""
    mask = batch.get("attention_mask")
    if mask is not None and mask.device.type == "cpu" and bool(mask.all()):
        return {k: v for k, v in batch.items() if k != "attention_mask"}
    return batch


def _check_batching(batching: str, train: Dataset) -> None:
    """``--batching`` against the data: packing needs causal-LM examples (a row of several examples is a
    decoder's: an encoder's classifier reads one example's first token), and bucket/pack need text."""
    if batching == "max-length":
        return
    if not isinstance(train, RaggedDataset):
        if not (isinstance(train, DictDataset) and "input_ids" in train.columns):
            raise SpecError(f"--batching {batching} lays out text, and these data are not text "
                            f"({type(train).__name__}); use --batching max-length (or auto)")
        return  # causal-LM chunks: every one already --max-length tokens, nothing padded
    if batching == "pack" and "labels" not in train.tokens:
        raise SpecError("--batching pack puts several examples in one row, which only causal-LM data "
                        "(decoders) can take; these are classification data: use --batching bucket")


class DataFeed:
    """The global batches of each epoch (the same on every process, in the order fixed by seed and epoch),
    this replica's shard of each, cut into micro-batches on the stages' device."""

    def __init__(self, cfg: TrainConfig, train: Dataset, evaluation: Dataset, *, replica: int,
                 device: torch.device | None = None) -> None:
        self.cfg, self.replica = cfg, replica
        self.batching = cfg.pipeline.resolved_batching(train)
        self.train, self.eval = as_batched(train, self.batching), as_batched(evaluation, self.batching)
        self.device = device or torch.device("cpu")
        self.replicas = cfg.pipeline.data_parallel
        self.ragged = isinstance(self.train, RaggedDataset)
        _check_batching(self.batching, self.train)

    def cache_ids(self) -> int:
        """How many ids the boundaries' per-sample state is keyed by: the training set's tokens where only
        real tokens cross (``bucket``, ``pack``), else its samples."""
        if self.ragged and self.batching != "max-length":
            return self.train.num_tokens
        return len(self.train)

    def batches_per_epoch(self) -> int:
        """Global batches of one epoch: a trailing partial batch counts if it has a sample for every
        replica."""
        full, rest = divmod(len(self.train), self.cfg.global_batch_size)
        return full + (1 if rest >= self.replicas else 0)

    def train_batches(self, epoch: int) -> list[Batch]:
        """The global batches of one epoch, in the order fixed by (seed, epoch)."""
        size, seed = self.cfg.global_batch_size, self.cfg.optim.seed
        if self.ragged and self.batching == "bucket":
            shuffled = epoch_order(len(self.train), seed=seed, epoch=epoch)
            order = bucketed_order(self.train.lengths, size, shuffled, seed=seed, epoch=epoch)
            batches: Iterable[Batch] = ({"sample_ids": order[i:i + size]} for i in range(0, len(order), size))
        else:
            batches = epoch_batches(self.train, size, seed=seed, epoch=epoch)
        return [b for b in batches if b["sample_ids"].numel() >= self.replicas]

    def eval_batches(self) -> Iterable[Batch]:
        """The evaluation data's global batches, in order."""
        return epoch_batches(self.eval, self.cfg.global_batch_size, seed=self.cfg.optim.seed, epoch=0,
                             shuffle=False)

    def shard(self, batch: Batch, *, training: bool = True) -> Batch:
        """This replica's contiguous shard of a global batch (the whole batch without data parallelism, and
        the whole evaluation batch for a replica that comes and goes: it has no collective with the others to
        sum its shard's figures with, so it evaluates all of them itself)."""
        if self.replicas == 1 or (not training and self.cfg.pipeline.dp_replica is not None):
            return batch
        return {k: torch.tensor_split(v, self.replicas)[self.replica] for k, v in batch.items()}

    def micro(self, batch: Batch, *, training: bool = True) -> list[Batch]:
        """A (sharded) batch as the micro-batches of one pipeline pass, on the stages' device (of the training
        data, else the evaluation data). Each micro-batch of text says how many of its positions are real
        tokens (``real_tokens``)."""
        if not self.ragged:
            micro = microbatches(self.on_device(batch), self.cfg.pipeline.micro_batches)
            ids = batch.get("input_ids")
            if isinstance(ids, torch.Tensor) and ids.dim() == 2:  # text: count its real tokens on the host
                mask = batch.get("attention_mask")
                counts = torch.ones_like(ids) if mask is None else mask
                for mb, part in zip(micro, torch.tensor_split(counts, len(micro))):
                    mb["real_tokens"] = int(part.sum())
            return micro
        dataset = self.train if training else self.eval
        micro = micro_batches(dataset, batch["sample_ids"], self.batching, self.cfg.pipeline.micro_batches,
                              self.cfg.task.max_length)
        return [self.on_device(mb) for mb in micro]

    @staticmethod
    def weight(micro: list[Batch]) -> int:
        """What a pass's mean loss stands for when passes are averaged: its loss tokens where micro-batches
        are weighed by them, else its samples."""
        if micro and "loss_tokens" in micro[0]:
            return sum(int(mb["loss_tokens"]) for mb in micro)
        return sum(int(mb["sample_ids"].numel()) for mb in micro)

    @staticmethod
    def tokens(passes: list[list[Batch]]) -> int | None:
        """The real tokens of a step's passes (None where the data are not text)."""
        counts = [mb.get("real_tokens") for p in passes for mb in p]
        return None if not counts or None in counts else sum(int(c) for c in counts)  # type: ignore[arg-type]

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
        return {k: v if k in ("sample_ids", "token_ids") or not isinstance(v, torch.Tensor)
                else v.to(self.device, non_blocking=v.is_pinned()) for k, v in batch.items()}
