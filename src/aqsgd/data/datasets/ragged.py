"""Examples of their own lengths, and the micro-batches made of them, with no padding sent between stages.

Instruction and chat data (and text classification without padding) are :class:`RaggedDataset` s: every
per-token column is one flat tensor of all tokens, the examples one after another, cut by ``offsets``. Token
``j`` of example ``i`` has the *token id* ``offsets[i] + j``: its key in the AQ-SGD cache, which then holds
each example's own rows at its own length (memory and disk by real tokens, not by ``--max-length``).

How a micro-batch is made from examples (``--batching``, :data:`BATCHINGS`):

* ``max-length``: every example padded to ``max_length`` (what fixed-length data do); the stages send every
  position, pads included, and the cache keeps a ``[max_length, hidden]`` row per example. The baseline.
* ``bucket``: examples of similar length in one batch (a length-grouped order, :func:`bucketed_order`), each
  micro-batch padded to its own longest example.
* ``pack``: the micro-batch's examples packed into as few rows of ``max_length`` tokens as first-fit-
  decreasing finds, each example with its own positions (``position_ids`` restart at 0) and no
  ``attention_mask``, from which the decoder families' masks keep every example to itself (transformers
  builds a block-diagonal causal mask from restarting positions); the first label of each example is
  masked, so that no example learns to predict the next one's first token. Decoders only.

With ``bucket`` and ``pack`` a micro-batch carries ``token_positions`` (the flat indices, in its ``[rows x
length]`` grid, of its real tokens) and ``token_ids`` (their cache keys, on the host like ``sample_ids``):
the pipeline runner sends only those rows across every boundary (``[real tokens, hidden]``) and scatters
them back into the grid on the other side (:mod:`aqsgd.pipeline.runner`); pad positions never cross.
``real_tokens`` (an int) counts them, so that what crossed can be split into real and pad tokens.

All of it is deterministic: the same examples, seed and epoch give the same micro-batches on every process.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from aqsgd.errors import SpecError

__all__ = ["BATCHINGS", "IGNORE_INDEX", "RaggedDataset", "bucketed_order", "collate_ragged", "loss_tokens",
           "micro_batches", "pack_rows"]

BATCHINGS = ("max-length", "bucket", "pack")
IGNORE_INDEX = -100  # a label that carries no loss (transformers' ignore_index)
BUCKET_SPAN = 50  # batches whose examples are sorted by length together (as transformers' group_by_length)


class RaggedDataset(Dataset):  # type: ignore[type-arg]
    """Examples of their own lengths: per-token columns stored flat (``tokens``, one tensor each, the examples
    one after another, cut by ``offsets``: int64 ``[n + 1]`` from 0), per-example columns as ``[n, ...]``
    tensors (``values``, e.g. a class label). ``dataset[i]`` is ``{column: tensor, ..., "sample_id": i}``
    with the token columns ``[L_i]``. ``info`` as :class:`~aqsgd.data.datasets.base.DictDataset`'s, with
    ``pad_token_id`` for padding."""

    def __init__(self, tokens: Mapping[str, Tensor], offsets: Tensor, *,
                 values: Mapping[str, Tensor] | None = None, info: Mapping[str, Any] | None = None) -> None:
        if "input_ids" not in tokens:
            raise SpecError(f"a RaggedDataset needs an input_ids token column; got {sorted(tokens)}")
        offsets = torch.as_tensor(offsets, dtype=torch.int64).reshape(-1)
        if offsets.numel() < 1 or int(offsets[0]) != 0:
            raise SpecError("offsets must start at 0")
        lengths = offsets[1:] - offsets[:-1]
        if lengths.numel() and int(lengths.min()) < 1:
            raise SpecError(f"every example needs >= 1 token; example {int(torch.argmin(lengths))} has none")
        total = int(offsets[-1])
        for name, col in tokens.items():
            if col.dim() != 1 or col.numel() != total:
                raise SpecError(f"token column {name!r} must be 1-D with {total} tokens, got "
                                f"{tuple(col.shape)}")
        values = dict(values or {})
        for name, col in values.items():
            if col.shape[0] != lengths.numel():
                raise SpecError(f"value column {name!r} has {col.shape[0]} rows for {lengths.numel()} "
                                "examples")
        both = set(tokens) & set(values)
        if both or {"sample_id", "sample_ids"} & (set(tokens) | set(values)):
            raise SpecError(f"column names used twice or reserved: {sorted(both) or ['sample_id(s)']}")
        self.tokens: dict[str, Tensor] = dict(tokens)
        self.values: dict[str, Tensor] = values
        self.offsets = offsets
        self.lengths = lengths
        self.num_tokens = total
        self.info: dict[str, Any] = dict(info or {})

    def __len__(self) -> int:
        return self.lengths.numel()

    def __getitem__(self, index: int) -> dict[str, Any]:
        i = int(index)
        if not 0 <= i < len(self):
            raise IndexError(f"example {index} out of range for a dataset of {len(self)}")
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        item: dict[str, Any] = {k: v[a:b].to(torch.int64) for k, v in self.tokens.items()}
        item.update({k: v[i] for k, v in self.values.items()})
        item["sample_id"] = i
        return item

    def gather(self, indices: Tensor | Sequence[int]) -> dict[str, Tensor]:
        """A global batch: only its ``sample_ids`` (the examples are laid out per micro-batch later, by
        :func:`collate_ragged`, each micro-batch to its own length)."""
        idx = torch.as_tensor(indices, dtype=torch.int64).reshape(-1)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= len(self)):
            raise IndexError(f"example ids out of range for a dataset of {len(self)}")
        return {"sample_ids": idx.clone()}

    def subset(self, n: int) -> RaggedDataset:
        """The first ``n`` examples (all if fewer); ids unchanged."""
        if n < 0:
            raise SpecError(f"subset size must be >= 0, got {n}")
        n = min(n, len(self))
        end = int(self.offsets[n])
        return RaggedDataset({k: v[:end] for k, v in self.tokens.items()}, self.offsets[: n + 1],
                             values={k: v[:n] for k, v in self.values.items()}, info=self.info)

    @classmethod
    def from_padded(cls, columns: Mapping[str, Tensor], *,
                    info: Mapping[str, Any] | None = None) -> RaggedDataset:
        """The examples of padded ``[n, T]`` columns (a :class:`~aqsgd.data.datasets.base.DictDataset`'s)
        with their padding taken out: the positions ``attention_mask`` marks are kept, in order (either
        padding side); columns of another shape (a class label) become value columns. The same tokens, the
        same ids."""
        mask = columns.get("attention_mask")
        ids = columns["input_ids"]
        if mask is None:
            mask = torch.ones_like(ids)
        keep = mask.bool()
        lengths = keep.sum(dim=1)
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        tokens = {k: v[keep] for k, v in columns.items()
                  if k != "attention_mask" and v.dim() == 2 and v.shape == ids.shape}
        values = {k: v for k, v in columns.items() if k != "attention_mask" and k not in tokens}
        return cls(tokens, offsets, values=values, info=info)

    @property
    def pad_token_id(self) -> int:
        pad = self.info.get("pad_token_id")
        return 0 if pad is None else int(pad)

    def __repr__(self) -> str:
        lens = self.lengths
        spread = f"{int(lens.min())}..{int(lens.max())}" if lens.numel() else "-"
        return (f"RaggedDataset(n={len(self)}, tokens={self.num_tokens}, lengths {spread}, "
                f"columns {sorted(self.tokens)} + {sorted(self.values)})")


def bucketed_order(lengths: Tensor, batch_size: int, order: Tensor, *, seed: int, epoch: int) -> Tensor:
    """``order`` (an epoch's shuffled order) regrouped so that each batch of ``batch_size`` holds examples of
    similar length: spans of :data:`BUCKET_SPAN` batches are sorted by length (longest first), cut into
    batches, and the batches shuffled (seeded by ``seed`` and ``epoch``); a partial batch stays last, where
    the unbucketed order has it."""
    n = order.numel()
    span = BUCKET_SPAN * batch_size
    parts = []
    for start in range(0, n, span):
        chunk = order[start:start + span]
        keys = lengths[chunk]
        parts.append(chunk[torch.sort(keys, descending=True, stable=True).indices])
    grouped = torch.cat(parts) if parts else order
    full = n // batch_size
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, 1])))
    batches = grouped[: full * batch_size].view(full, batch_size)[torch.from_numpy(rng.permutation(full))]
    return torch.cat([batches.reshape(-1), grouped[full * batch_size:]])


def pack_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: the positions (into ``lengths``) of the examples in each row of at most
    ``capacity`` tokens (an example longer than ``capacity`` gets a row of its own). Rows in the order they
    were opened; examples in a row longest first, ties by position: the same on every process."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        for r, room in enumerate(free):
            if lengths[i] <= room:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(max(capacity - lengths[i], 0))
    return rows


def collate_ragged(dataset: RaggedDataset, ids: Tensor, batching: str, max_length: int) -> dict[str, Any]:
    """The micro-batch of examples ``ids`` laid out as ``batching`` says (see the module docstring).

    Keys: the token columns as ``[rows, length]`` int64 (``input_ids`` padded with the pad id, ``labels`` with
    :data:`IGNORE_INDEX`, others with 0), the value columns ``[len(ids), ...]``, ``sample_ids``, and
    ``real_tokens`` (an int). ``max-length``: ``attention_mask`` where anything is padded. ``bucket``:
    ``attention_mask`` where anything is padded, ``token_positions`` and ``token_ids``. ``pack``:
    ``position_ids``, ``token_positions`` and ``token_ids``."""
    if batching not in BATCHINGS:
        raise SpecError(f"batching must be one of {', '.join(BATCHINGS)}, got {batching!r}")
    ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
    lens = [int(dataset.lengths[i]) for i in ids]
    starts = [int(dataset.offsets[i]) for i in ids]
    if batching == "pack":
        rows = pack_rows(lens, max_length)
    else:
        rows = [[k] for k in range(len(ids))]
    width = max_length if batching == "max-length" else max(sum(lens[k] for k in row) for row in rows)
    if batching == "max-length" and max(lens) > max_length:
        raise SpecError(f"an example of {max(lens)} tokens is longer than --max-length {max_length}")
    n_rows = len(rows)
    pad = {"input_ids": dataset.pad_token_id, "labels": IGNORE_INDEX}
    out: dict[str, Any] = {name: torch.full((n_rows, width), pad.get(name, 0), dtype=torch.int64)
                           for name in dataset.tokens}
    positions = torch.zeros(n_rows, width, dtype=torch.int64)
    real = torch.zeros(n_rows, width, dtype=torch.bool)
    token_ids = torch.full((n_rows, width), -1, dtype=torch.int64)
    for r, row in enumerate(rows):
        at = 0
        for k in row:
            a, length = starts[k], lens[k]
            for name, col in dataset.tokens.items():
                out[name][r, at:at + length] = col[a:a + length]
            if batching == "pack" and "labels" in out:
                out["labels"][r, at] = IGNORE_INDEX  # predicted from the previous example: never
            positions[r, at:at + length] = torch.arange(length)
            token_ids[r, at:at + length] = torch.arange(a, a + length)
            real[r, at:at + length] = True
            at += length
        positions[r, at:] = torch.arange(width - at)  # the pad tail: a segment of its own
    out.update({name: col[ids] for name, col in dataset.values.items()})
    out["sample_ids"] = ids.clone()
    n_real = int(real.sum())
    out["real_tokens"] = n_real
    if batching == "pack":
        out["position_ids"] = positions
    elif n_real < real.numel():
        out["attention_mask"] = real.to(torch.int64)
    if batching != "max-length":
        flat = real.reshape(-1)
        out["token_positions"] = torch.nonzero(flat).reshape(-1)
        out["token_ids"] = token_ids.reshape(-1)[flat]
    return out


def loss_tokens(batch: Mapping[str, Any]) -> int:
    """The tokens of a causal-LM micro-batch that carry a loss: labels other than :data:`IGNORE_INDEX` after
    the one-place shift the loss makes (the first position of a row predicts nothing)."""
    labels = batch["labels"]
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def micro_batches(dataset: RaggedDataset, ids: Tensor, batching: str, parts: int,
                  max_length: int) -> list[dict[str, Any]]:
    """The examples ``ids`` (one pipeline pass) as at most ``parts`` micro-batches laid out as ``batching``
    says (:func:`collate_ragged`): with ``bucket`` sorted longest first before they are cut, so that each
    micro-batch is padded to its own longest example. Where the examples have per-token labels (causal LM),
    each micro-batch counts its ``loss_tokens`` and carries ``loss_weight``, its share of the pass's loss
    tokens times the number of micro-batches: the weighted mean of the micro-batches' mean losses is the
    pass's mean over its loss tokens, as one unsplit batch's loss would be."""
    ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
    if batching == "bucket":
        ids = ids[torch.sort(dataset.lengths[ids], descending=True, stable=True).indices]
    micro = [collate_ragged(dataset, part, batching, max_length)
             for part in torch.tensor_split(ids, min(parts, ids.numel()))]
    if "labels" in dataset.tokens:
        counts = [loss_tokens(mb) for mb in micro]
        total = sum(counts)
        for mb, n in zip(micro, counts):
            mb["loss_tokens"] = n
            mb["loss_weight"] = len(micro) * n / total if total else 1.0
    return micro
