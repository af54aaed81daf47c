"""Seeded splits, epoch orders and micro-batches: every process that passes the same seed sees the same.

Randomness comes from numpy's PCG64 keyed by integers (:func:`_rng`), identical on every platform.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from aqsgd.data.datasets.base import DictDataset
from aqsgd.errors import SpecError

__all__ = ["collate", "epoch_batches", "epoch_order", "num_batches", "stratified_split"]


def _rng(*key: int) -> np.random.Generator:
    if any(k < 0 for k in key):
        raise SpecError(f"seed and epoch must be >= 0, got {key}")
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(list(key))))


def stratified_split(labels: Sequence[int] | np.ndarray, eval_fraction: float, seed: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Indices of a seeded, stratified train/eval split, each split in a seeded shuffled order.

    Every class contributes ``round(count * eval_fraction)`` samples to eval. The result depends only
    on the labels, the fraction and the seed (numpy's PCG64, identical on every platform).
    """
    if not 0.0 <= eval_fraction <= 1.0:
        raise SpecError(f"eval_fraction must be in [0, 1], got {eval_fraction}")
    y = np.asarray(labels)
    rng = _rng(seed, 0)
    train: list[np.ndarray] = []
    evals: list[np.ndarray] = []
    for cls in np.unique(y):
        idx = np.flatnonzero(y == cls)
        idx = idx[rng.permutation(len(idx))]
        k = round(len(idx) * eval_fraction)
        evals.append(idx[:k])
        train.append(idx[k:])
    tr = np.concatenate(train) if train else np.zeros(0, dtype=np.int64)
    ev = np.concatenate(evals) if evals else np.zeros(0, dtype=np.int64)
    return tr[_rng(seed, 1).permutation(len(tr))], ev[_rng(seed, 2).permutation(len(ev))]


def epoch_order(n: int, *, seed: int, epoch: int, shuffle: bool = True) -> Tensor:
    """The sample order of one epoch: a permutation of ``range(n)`` fixed by (seed, epoch)."""
    if not shuffle:
        return torch.arange(n, dtype=torch.int64)
    return torch.from_numpy(_rng(seed, epoch).permutation(n).astype(np.int64))


def num_batches(n: int, batch_size: int, *, drop_last: bool = False) -> int:
    """How many batches :func:`epoch_batches` yields for ``n`` samples."""
    if batch_size < 1:
        raise SpecError(f"batch_size must be >= 1, got {batch_size}")
    return n // batch_size if drop_last else math.ceil(n / batch_size)


def collate(items: Sequence[Mapping[str, Any]]) -> dict[str, Tensor]:
    """Stack dataset items into a batch; their ``sample_id`` values become ``sample_ids`` (int64)."""
    if not items:
        raise SpecError("cannot collate an empty batch")
    batch: dict[str, Tensor] = {}
    for key in items[0]:
        if key == "sample_id":
            continue
        values = [it[key] for it in items]
        batch[key] = torch.stack(values) if isinstance(values[0], Tensor) else torch.as_tensor(values)
    batch["sample_ids"] = torch.as_tensor([int(it["sample_id"]) for it in items], dtype=torch.int64)
    return batch


def epoch_batches(
    dataset: Dataset,  # type: ignore[type-arg]
    batch_size: int,
    *,
    seed: int,
    epoch: int,
    shuffle: bool = True,
    drop_last: bool = False,
) -> Iterator[dict[str, Tensor]]:
    """Yield the micro-batches of one epoch in an order fixed by (seed, epoch).

    Every process that passes the same dataset, seed and epoch sees the same batches. The last,
    partial batch is yielded unless ``drop_last``. Each batch holds the stacked item tensors and
    ``sample_ids`` (1-D int64), the ids the AQ-SGD activation cache is indexed by. A
    :class:`DictDataset` (or any dataset with a ``gather(ids)``, as
    :class:`~aqsgd.data.datasets.ragged.RaggedDataset`) is gathered column-wise; any other map-style dataset
    must return dicts with a ``sample_id`` and is collated with :func:`collate`.
    """
    n = len(dataset)  # type: ignore[arg-type]
    num_batches(n, batch_size)  # validates batch_size
    order = epoch_order(n, seed=seed, epoch=epoch, shuffle=shuffle)
    stop = (n // batch_size) * batch_size if drop_last else n
    for start in range(0, stop, batch_size):
        idx = order[start:min(start + batch_size, stop)]
        gather = getattr(dataset, "gather", None)
        if isinstance(dataset, DictDataset) or gather is not None:
            yield (gather or dataset.gather)(idx)
        else:
            yield collate([dataset[int(i)] for i in idx])
