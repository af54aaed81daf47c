"""The dataset type every task loader returns (:class:`DictDataset`), and the arguments a loader takes."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset

from aqsgd.errors import SpecError

__all__ = ["DictDataset", "PathLike", "TaskArgs", "Transform"]

PathLike = str | os.PathLike[str]
Transform = Callable[[Tensor], Tensor]


class DictDataset(Dataset):  # type: ignore[type-arg]
    """A map-style dataset of named tensor columns that share their first dimension.

    ``dataset[i]`` is ``{column: transform(column[i]), ..., "sample_id": i}``; :meth:`gather` returns a
    whole batch at once (``sample_ids`` instead of ``sample_id``). ``transforms`` map a column name to an
    elementwise function applied on access (e.g. uint8 images to normalised floats), so storage stays
    compact. ``info`` carries metadata such as ``num_labels``, ``label_names``, ``vocab_size``.
    """

    def __init__(self, columns: Mapping[str, Tensor], *, transforms: Mapping[str, Transform] | None = None,
                 info: Mapping[str, Any] | None = None) -> None:
        if not columns:
            raise SpecError("a DictDataset needs at least one column")
        lengths = {k: int(v.shape[0]) for k, v in columns.items()}
        if len(set(lengths.values())) != 1:
            raise SpecError(f"columns differ in length: {lengths}")
        if "sample_id" in columns or "sample_ids" in columns:
            raise SpecError("'sample_id'/'sample_ids' are reserved column names")
        unknown = set(transforms or {}) - set(columns)
        if unknown:
            raise SpecError(f"transforms for unknown columns: {sorted(unknown)}")
        self.columns: dict[str, Tensor] = dict(columns)
        self.transforms: dict[str, Transform] = dict(transforms or {})
        self.info: dict[str, Any] = dict(info or {})
        self._len = next(iter(lengths.values()))

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, Any]:
        i = int(index)
        if not 0 <= i < self._len:
            raise IndexError(f"sample {index} out of range for a dataset of {self._len}")
        item: dict[str, Any] = {k: self._apply(k, v[i]) for k, v in self.columns.items()}
        item["sample_id"] = i
        return item

    def gather(self, indices: Tensor | Sequence[int]) -> dict[str, Tensor]:
        """The batch of the given sample ids: stacked columns plus ``sample_ids`` (1-D int64)."""
        idx = torch.as_tensor(indices, dtype=torch.int64).reshape(-1)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self._len):
            raise IndexError(f"sample ids out of range for a dataset of {self._len}")
        batch = {k: self._apply(k, v[idx]) for k, v in self.columns.items()}
        batch["sample_ids"] = idx.clone()
        return batch

    def subset(self, n: int) -> DictDataset:
        """The first ``n`` samples (all if fewer); sample ids are unchanged (they are the same indices)."""
        if n < 0:
            raise SpecError(f"subset size must be >= 0, got {n}")
        n = min(n, self._len)
        return DictDataset({k: v[:n] for k, v in self.columns.items()}, transforms=self.transforms,
                           info=self.info)

    def _apply(self, key: str, value: Tensor) -> Tensor:
        fn = self.transforms.get(key)
        return fn(value) if fn is not None else value

    def __repr__(self) -> str:
        cols = ", ".join(f"{k}{list(v.shape[1:])}:{str(v.dtype).removeprefix('torch.')}"
                         for k, v in self.columns.items())
        return f"DictDataset(n={self._len}, {cols})"


def _max(ds_len: int, max_samples: int | None) -> int:
    """How many of ``ds_len`` samples to keep: all, or the first ``max_samples``."""
    if max_samples is not None and max_samples < 0:
        raise SpecError(f"max_samples must be >= 0, got {max_samples}")
    return ds_len if max_samples is None else min(ds_len, max_samples)


@dataclass(frozen=True)
class TaskArgs:
    """What a task loader (:attr:`TaskSpec.loader <aqsgd.data.datasets.tasks.TaskSpec>`) receives: the
    arguments of :func:`~aqsgd.data.datasets.load_task`.

    Attributes:
        split: ``"train"`` or ``"eval"``.
        cache_dir: the sources' cache folder (None: the default).
        seq_len: tokens per sample of causal-LM data.
        max_length: padded/truncated length of text classification samples.
        max_samples: keep only the first N samples of the split (None: all).
        tokenizer: a tokenizer source name, folder or object the task should use (None: the task's own).
        seed: seed of seeded splits.
        eval_fraction: eval share of a split held out from the training data (None: the task's default).
    """

    split: str
    cache_dir: PathLike | None
    seq_len: int
    max_length: int
    max_samples: int | None
    tokenizer: Any
    seed: int
    eval_fraction: float | None


_Args = TaskArgs  # the name the built-in loaders use
