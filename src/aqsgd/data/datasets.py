"""Map-style datasets with stable sample ids, task loaders, and a deterministic micro-batch iterator.

AQ-SGD keeps one cached activation per training example, so every item carries a ``sample_id``: its
index in the split, the same on every process. All datasets here hold their columns as tensors of one
shape per split (text is padded/truncated or chunked to a fixed length), so an activation cache row has
a single shape.

Item layouts (``dataset[i]``; :func:`epoch_batches` stacks them and adds ``sample_ids``):

* causal LM (:func:`lm_chunks`): ``input_ids``, ``attention_mask`` (ones), ``labels`` (= ``input_ids``),
  each ``[seq_len]`` int64;
* text classification (:func:`text_classification`): ``input_ids``, ``attention_mask`` and, where the
  tokenizer makes them, ``token_type_ids``, each ``[max_length]`` int64; ``labels`` scalar int64;
* images (:func:`image_classification`): ``pixel_values`` ``[C, H, W]`` float32, normalised;
  ``labels`` scalar int64.

Task loaders (:func:`load_task`): ``bbc``, ``wiki``, ``fashion-mnist`` and ``mnist`` come from the
offline sources in :mod:`aqsgd.data.sources`; ``wikitext-2``, ``glue-cola``, ``glue-qnli`` and
``cifar10`` need the ``datasets`` package and the Hugging Face hub, and otherwise raise a
:class:`~aqsgd.errors.DataSourceError` naming the offline task to use instead.
"""

from __future__ import annotations

import gzip
import json
import logging
import math
import os
import socket
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from aqsgd.data.sources import SOURCES, require
from aqsgd.errors import DataSourceError, SpecError

__all__ = [
    "SPLITS",
    "TASKS",
    "DictDataset",
    "TaskSpec",
    "collate",
    "epoch_batches",
    "epoch_order",
    "image_classification",
    "lm_chunks",
    "load_task",
    "load_tokenizer",
    "num_batches",
    "read_bbc",
    "read_idx",
    "read_wiki",
    "stratified_split",
    "task_names",
    "text_classification",
]

log = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]
Transform = Callable[[Tensor], Tensor]

SPLITS = ("train", "eval")
"""Split names; ``test`` and ``validation`` are accepted as aliases of ``eval``."""
_SPLIT_ALIASES = {"train": "train", "eval": "eval", "test": "eval", "validation": "eval", "valid": "eval"}

HUB_PROBE_TIMEOUT_S = 5.0
"""Seconds to wait for a TCP connection to the Hugging Face hub before declaring it unreachable."""


# --------------------------------------------------------------------------------------------------
# the dataset type
# --------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------
# builders from raw data
# --------------------------------------------------------------------------------------------------


def lm_chunks(
    texts: Iterable[str],
    tokenizer: Any,
    seq_len: int,
    *,
    eos_token_id: int | None = None,
    add_eos: bool = True,
    max_chunks: int | None = None,
    batch_texts: int = 256,
    info: Mapping[str, Any] | None = None,
) -> DictDataset:
    """Causal-LM samples: the tokenized texts concatenated and cut into non-overlapping chunks.

    Each text is tokenized without special tokens and followed by ``eos_token_id`` (default: the
    tokenizer's EOS) as a document separator, unless ``add_eos`` is false. Empty texts are skipped.
    The stream is cut into ``seq_len``-token chunks; the tokens after the last full chunk are dropped.
    ``max_chunks`` stops tokenizing once that many chunks exist; the result is then exactly the first
    ``max_chunks`` chunks of the full dataset.

    Items: ``input_ids``, ``attention_mask`` (ones), ``labels`` (= ``input_ids``), each ``[seq_len]``
    int64, and ``sample_id``.
    """
    if seq_len < 1:
        raise SpecError(f"seq_len must be >= 1, got {seq_len}")
    if max_chunks is not None and max_chunks < 0:
        raise SpecError(f"max_chunks must be >= 0, got {max_chunks}")
    if add_eos:
        if eos_token_id is None:
            eos_token_id = getattr(tokenizer, "eos_token_id", None)
        if eos_token_id is None:
            raise SpecError("the tokenizer has no EOS token: pass eos_token_id=... or add_eos=False")
    need = None if max_chunks is None else max_chunks * seq_len
    pieces: list[np.ndarray] = []
    total = 0

    def flush(batch: list[str]) -> None:
        nonlocal total
        encoded = tokenizer(batch, add_special_tokens=False, verbose=False)["input_ids"]
        for ids in encoded:
            if add_eos:
                ids = [*ids, eos_token_id]
            pieces.append(np.asarray(ids, dtype=np.int64))
            total += len(ids)

    batch: list[str] = []
    for text in texts:
        if need is not None and total >= need:
            break
        if not text or not text.strip():
            continue
        batch.append(text)
        if len(batch) >= batch_texts:
            flush(batch)
            batch = []
    if batch and (need is None or total < need):
        flush(batch)
    stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    n = len(stream) // seq_len
    if max_chunks is not None:
        n = min(n, max_chunks)
    if n == 0 and max_chunks != 0:
        raise SpecError(f"the texts give {len(stream)} tokens, fewer than one chunk of seq_len={seq_len}")
    ids = torch.from_numpy(stream[: n * seq_len].copy()).view(n, seq_len)
    meta = {"kind": "causal-lm", "seq_len": seq_len, "tokens": n * seq_len, "eos_token_id": eos_token_id,
            "vocab_size": _vocab_size(tokenizer)}
    meta.update(info or {})
    return DictDataset({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()},
                       info=meta)


def text_classification(
    texts: Sequence[str],
    labels: Sequence[int] | Tensor,
    tokenizer: Any,
    max_length: int,
    *,
    text_pairs: Sequence[str] | None = None,
    label_names: Sequence[str] | None = None,
    info: Mapping[str, Any] | None = None,
) -> DictDataset:
    """Text (or text-pair) classification samples, padded/truncated to exactly ``max_length`` tokens.

    Items: ``input_ids``, ``attention_mask`` and ``token_type_ids`` (if the tokenizer makes them), each
    ``[max_length]`` int64, ``labels`` (scalar int64) and ``sample_id``.
    """
    if max_length < 1:
        raise SpecError(f"max_length must be >= 1, got {max_length}")
    labels_t = torch.as_tensor(labels, dtype=torch.int64).reshape(-1)
    if len(texts) != labels_t.numel() or (text_pairs is not None and len(text_pairs) != len(texts)):
        raise SpecError(f"{len(texts)} texts, {labels_t.numel()} labels"
                        + ("" if text_pairs is None else f", {len(text_pairs)} pairs"))
    if getattr(tokenizer, "pad_token_id", None) is None:
        raise SpecError("the tokenizer has no pad token; set tokenizer.pad_token first")
    args: tuple[Any, ...] = (list(texts),) if text_pairs is None else (list(texts), list(text_pairs))
    enc = tokenizer(*args, padding="max_length", truncation=True, max_length=max_length,
                    return_tensors="pt", verbose=False)
    cols = {k: enc[k].to(torch.int64) for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc}
    cols["labels"] = labels_t
    if label_names is not None:
        num_labels = len(label_names)
    else:
        num_labels = int(labels_t.max()) + 1 if len(texts) else 0
    meta = {"kind": "sequence-classification", "max_length": max_length, "num_labels": num_labels,
            "label_names": list(label_names) if label_names is not None else None,
            "pad_token_id": tokenizer.pad_token_id, "vocab_size": _vocab_size(tokenizer)}
    meta.update(info or {})
    return DictDataset(cols, info=meta)


def image_classification(
    images: Tensor | np.ndarray,
    labels: Sequence[int] | Tensor | np.ndarray,
    *,
    mean: float | Sequence[float],
    std: float | Sequence[float],
    label_names: Sequence[str] | None = None,
    info: Mapping[str, Any] | None = None,
) -> DictDataset:
    """Image classification samples from uint8 images ``[N, H, W]`` or ``[N, C, H, W]``.

    Images are stored as uint8 and turned into ``pixel_values = (x / 255 - mean) / std`` (float32,
    ``[C, H, W]``, per-channel ``mean``/``std``) on access. Items: ``pixel_values``, ``labels`` (scalar
    int64), ``sample_id``.
    """
    if isinstance(images, np.ndarray) and not images.flags.writeable:
        images = images.copy()
    x = torch.as_tensor(images)
    if x.dtype != torch.uint8:
        raise SpecError(f"images must be uint8, got {x.dtype}")
    if x.dim() == 3:
        x = x.unsqueeze(1)
    if x.dim() != 4:
        raise SpecError(f"images must be [N, H, W] or [N, C, H, W], got {list(x.shape)}")
    c = x.shape[1]
    m = torch.as_tensor(mean, dtype=torch.float32).reshape(-1)
    s = torch.as_tensor(std, dtype=torch.float32).reshape(-1)
    if m.numel() not in (1, c) or s.numel() not in (1, c):
        raise SpecError(f"mean/std must have 1 or {c} values")
    m = m.expand(c).reshape(c, 1, 1).clone()
    s = s.expand(c).reshape(c, 1, 1).clone()

    def normalize(u8: Tensor) -> Tensor:
        return (u8.to(torch.float32) / 255.0 - m) / s

    y = torch.as_tensor(np.asarray(labels), dtype=torch.int64).reshape(-1)
    meta = {"kind": "image-classification", "image_shape": list(x.shape[1:]),
            "num_labels": len(label_names) if label_names is not None else int(y.max()) + 1,
            "label_names": list(label_names) if label_names is not None else None,
            "mean": m.flatten().tolist(), "std": s.flatten().tolist()}
    meta.update(info or {})
    return DictDataset({"pixel_values": x.contiguous(), "labels": y}, transforms={"pixel_values": normalize},
                       info=meta)


def _vocab_size(tokenizer: Any) -> int | None:
    try:
        return len(tokenizer)
    except TypeError:
        return getattr(tokenizer, "vocab_size", None)


# --------------------------------------------------------------------------------------------------
# splits and batches
# --------------------------------------------------------------------------------------------------


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
    :class:`DictDataset` is gathered column-wise; any other map-style dataset must return dicts with a
    ``sample_id`` and is collated with :func:`collate`.
    """
    n = len(dataset)  # type: ignore[arg-type]
    num_batches(n, batch_size)  # validates batch_size
    order = epoch_order(n, seed=seed, epoch=epoch, shuffle=shuffle)
    stop = (n // batch_size) * batch_size if drop_last else n
    for start in range(0, stop, batch_size):
        idx = order[start:min(start + batch_size, stop)]
        if isinstance(dataset, DictDataset):
            yield dataset.gather(idx)
        else:
            yield collate([dataset[int(i)] for i in idx])


# --------------------------------------------------------------------------------------------------
# tokenizers
# --------------------------------------------------------------------------------------------------


def load_tokenizer(spec: Any, cache_dir: PathLike | None = None) -> Any:
    """A Hugging Face tokenizer from a source name (``minilm``, ``smollm2``, ``gpt2-tokenizer``), a folder
    path, or a tokenizer object (returned unchanged). Source names are prepared on first use."""
    if not isinstance(spec, (str, os.PathLike)):
        return spec
    from transformers import AutoTokenizer

    path = require(spec, cache_dir) if isinstance(spec, str) and spec in SOURCES else Path(spec)
    if not Path(path).is_dir():
        raise DataSourceError(f"tokenizer folder {path} does not exist")
    return AutoTokenizer.from_pretrained(str(path))


# --------------------------------------------------------------------------------------------------
# offline task loaders
# --------------------------------------------------------------------------------------------------


def _split(split: str) -> str:
    try:
        return _SPLIT_ALIASES[split]
    except KeyError:
        raise SpecError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}") from None


def read_bbc(root: Path) -> tuple[list[str], list[int], list[str]]:
    """(texts, labels, class names) of the prepared BBC source, in (class, file name) order."""
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    texts: list[str] = []
    labels: list[int] = []
    for label, cls in enumerate(classes):
        for f in sorted((root / cls).glob("*.txt")):
            raw = f.read_bytes()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = raw.decode("latin-1")
            texts.append(" ".join(text.split()))
            labels.append(label)
    return texts, labels, classes


def read_wiki(root: Path) -> list[str]:
    """The lead sections of the prepared ``wiki`` source, in file order (empty ones skipped)."""
    data = json.loads((root / "summaries_en-us.json").read_text(encoding="utf-8"))
    rows = data.values() if isinstance(data, dict) else data
    return [str(r["extract"]).strip() for r in rows if str(r.get("extract", "")).strip()]


def read_idx(path: Path) -> np.ndarray:
    """An idx file (``.gz`` or raw) as a numpy array: the MNIST / Fashion-MNIST format."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:  # type: ignore[operator]
        data = f.read()
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise DataSourceError(f"{path}: not an unsigned-byte idx file")
    shape = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    arr = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if arr.size != math.prod(shape):
        raise DataSourceError(f"{path}: truncated ({arr.size} bytes for shape {shape})")
    return arr.reshape(shape).copy()  # frombuffer is read-only


FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
                         "Sneaker", "Bag", "Ankle boot")


def _max(ds_len: int, max_samples: int | None) -> int:
    if max_samples is not None and max_samples < 0:
        raise SpecError(f"max_samples must be >= 0, got {max_samples}")
    return ds_len if max_samples is None else min(ds_len, max_samples)


@dataclass(frozen=True)
class _Args:
    split: str
    cache_dir: PathLike | None
    seq_len: int
    max_length: int
    max_samples: int | None
    tokenizer: Any
    seed: int
    eval_fraction: float | None


def _load_bbc(a: _Args) -> DictDataset:
    texts, labels, classes = read_bbc(require("bbc", a.cache_dir))
    frac = 0.2 if a.eval_fraction is None else a.eval_fraction
    tr, ev = stratified_split(labels, frac, a.seed)
    idx = tr if a.split == "train" else ev
    idx = idx[: _max(len(idx), a.max_samples)]
    tok = load_tokenizer(a.tokenizer or "minilm", a.cache_dir)
    return text_classification([texts[i] for i in idx], [labels[i] for i in idx], tok, a.max_length,
                               label_names=classes)


def _load_wiki(a: _Args) -> DictDataset:
    articles = read_wiki(require("wiki", a.cache_dir))
    frac = 0.1 if a.eval_fraction is None else a.eval_fraction
    n_eval = math.ceil(len(articles) * frac)
    texts = articles[: len(articles) - n_eval] if a.split == "train" else articles[len(articles) - n_eval:]
    tok = load_tokenizer(a.tokenizer or "smollm2", a.cache_dir)
    return lm_chunks(texts, tok, a.seq_len, eos_token_id=_document_separator(tok), max_chunks=a.max_samples)


def _document_separator(tokenizer: Any) -> int | None:
    """``<|endoftext|>`` when the vocabulary has it (GPT-2, SmolLM2), else the EOS token."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return vocab.get("<|endoftext|>", getattr(tokenizer, "eos_token_id", None))


def _load_fashion_mnist(a: _Args) -> DictDataset:
    root = require("fashion-mnist", a.cache_dir)
    prefix = "train" if a.split == "train" else "t10k"
    x = read_idx(root / f"{prefix}-images-idx3-ubyte.gz")
    y = read_idx(root / f"{prefix}-labels-idx1-ubyte.gz")
    n = _max(len(y), a.max_samples)
    return image_classification(x[:n], y[:n].astype(np.int64), mean=0.2860, std=0.3530,
                                label_names=FASHION_MNIST_CLASSES)


def _load_mnist(a: _Args) -> DictDataset:
    root = require("mnist", a.cache_dir)
    key = "train" if a.split == "train" else "test"
    with np.load(root / "mnist.npz") as z:
        x, y = z[f"{key}_images"], z[f"{key}_labels"]
    n = _max(len(y), a.max_samples)
    return image_classification(x[:n], y[:n], mean=0.1307, std=0.3081,
                                label_names=[str(i) for i in range(10)])


# --------------------------------------------------------------------------------------------------
# hub-backed task loaders
# --------------------------------------------------------------------------------------------------

_TRUE = ("1", "true", "yes", "on")


def _hub_datasets(task: str, alternative: str) -> Any:
    """The ``datasets`` module if the hub can be used now; a DataSourceError otherwise (never hangs)."""
    hint = f"offline alternative: load_task({alternative!r}) (`--task {alternative}`)"
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in _TRUE:
            raise DataSourceError(f"task {task!r} loads from the Hugging Face hub, which {var} disables; "
                                  f"{hint}")
    try:
        import datasets
    except ImportError:
        raise DataSourceError(f"task {task!r} needs the `datasets` package and the Hugging Face hub: run "
                              f"`pip install datasets`; {hint}") from None
    endpoint = os.environ.get("HF_ENDPOINT")
    if not endpoint:
        try:
            from huggingface_hub import constants

            endpoint = constants.ENDPOINT
        except ImportError:  # pragma: no cover - datasets depends on huggingface_hub
            endpoint = None
    if endpoint:
        url = urlparse(endpoint)
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            with socket.create_connection((url.hostname or "", port), timeout=HUB_PROBE_TIMEOUT_S):
                pass
        except OSError as e:
            raise DataSourceError(f"task {task!r} needs the Hugging Face hub, which is unreachable "
                                  f"({url.hostname}:{port}: {e}); {hint}") from None
    return datasets


def _hub_split(split: str, eval_name: str) -> str:
    return "train" if split == "train" else eval_name


def _load_wikitext2(a: _Args) -> DictDataset:
    datasets = _hub_datasets("wikitext-2", "wiki")
    ds = datasets.load_dataset("Salesforce/wikitext", "wikitext-2-raw-v1",
                               split=_hub_split(a.split, "validation"))
    tok = load_tokenizer(a.tokenizer or "gpt2-tokenizer", a.cache_dir)
    # WikiText lines keep their newlines: concatenate them as they are (no separator), like run_clm.
    return lm_chunks(list(ds["text"]), tok, a.seq_len, add_eos=False, max_chunks=a.max_samples)


def _load_glue(a: _Args, config: str, fields: tuple[str, ...], label_names: list[str]) -> DictDataset:
    datasets = _hub_datasets(f"glue-{config}", "bbc")
    ds = datasets.load_dataset("nyu-mll/glue", config, split=_hub_split(a.split, "validation"))
    ds = ds.select(range(_max(len(ds), a.max_samples)))
    tok = load_tokenizer(a.tokenizer or "minilm", a.cache_dir)
    pairs = list(ds[fields[1]]) if len(fields) > 1 else None
    return text_classification(list(ds[fields[0]]), list(ds["label"]), tok, a.max_length, text_pairs=pairs,
                               label_names=label_names)


def _load_cifar10(a: _Args) -> DictDataset:
    datasets = _hub_datasets("cifar10", "fashion-mnist")
    ds = datasets.load_dataset("uoft-cs/cifar10", split=_hub_split(a.split, "test"))
    ds = ds.select(range(_max(len(ds), a.max_samples)))
    x = np.stack([np.asarray(im.convert("RGB"), dtype=np.uint8) for im in ds["img"]]).transpose(0, 3, 1, 2)
    return image_classification(x, np.asarray(ds["label"]), mean=(0.4914, 0.4822, 0.4465),
                                std=(0.2470, 0.2435, 0.2616), label_names=ds.features["label"].names)


# --------------------------------------------------------------------------------------------------
# task registry
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskSpec:
    """A named task: how to load it, whether it works offline and, if not, its offline stand-in."""

    name: str
    kind: str
    offline: bool
    description: str
    loader: Callable[[_Args], DictDataset]
    alternative: str | None = None


TASKS: dict[str, TaskSpec] = {t.name: t for t in (
    TaskSpec("bbc", "sequence-classification", True,
             "BBC News, 5 classes, MiniLM tokenizer; seeded stratified 80/20 split", _load_bbc),
    TaskSpec("wiki", "causal-lm", True,
             "Wikipedia lead sections, SmolLM2 tokenizer; last 10% of articles for eval", _load_wiki),
    TaskSpec("fashion-mnist", "image-classification", True, "Fashion-MNIST, 60k/10k", _load_fashion_mnist),
    TaskSpec("mnist", "image-classification", True, "MNIST, 60k/10k", _load_mnist),
    TaskSpec("wikitext-2", "causal-lm", False, "WikiText-2 (raw) from the hub, GPT-2 tokenizer",
             _load_wikitext2, "wiki"),
    TaskSpec("glue-cola", "sequence-classification", False, "GLUE CoLA from the hub, MiniLM tokenizer",
             lambda a: _load_glue(a, "cola", ("sentence",), ["unacceptable", "acceptable"]), "bbc"),
    TaskSpec("glue-qnli", "sequence-classification", False, "GLUE QNLI from the hub, MiniLM tokenizer",
             lambda a: _load_glue(a, "qnli", ("question", "sentence"), ["entailment", "not_entailment"]),
             "bbc"),
    TaskSpec("cifar10", "image-classification", False, "CIFAR-10 from the hub, 50k/10k", _load_cifar10,
             "fashion-mnist"),
)}
"""All tasks :func:`load_task` knows, by name."""


def task_names(*, offline_only: bool = False) -> list[str]:
    """Task names for :func:`load_task` (only those that need no hub if ``offline_only``)."""
    return [n for n, t in TASKS.items() if t.offline or not offline_only]


def load_task(
    name: str,
    split: str = "train",
    *,
    cache_dir: PathLike | None = None,
    seq_len: int = 128,
    max_length: int = 128,
    max_samples: int | None = None,
    tokenizer: Any = None,
    seed: int = 0,
    eval_fraction: float | None = None,
) -> DictDataset:
    """Load one split of a named task as a :class:`DictDataset`.

    Args:
        name: a task in :data:`TASKS` (``bbc``, ``wiki``, ``fashion-mnist``, ``mnist`` offline;
            ``wikitext-2``, ``glue-cola``, ``glue-qnli``, ``cifar10`` from the hub).
        split: ``train`` or ``eval`` (aliases ``test``, ``validation``).
        cache_dir: the sources' cache (default ``$AQSGD_CACHE`` or ``~/.cache/aqsgd``); missing sources
            are prepared on first use.
        seq_len: tokens per sample for causal-LM tasks.
        max_length: padded/truncated length for text classification.
        max_samples: keep only the first ``max_samples`` samples of the split (ids unchanged).
        tokenizer: a source name, tokenizer folder or tokenizer object; defaults per task (MiniLM for
            classification, SmolLM2 for ``wiki``, GPT-2 for ``wikitext-2``).
        seed: seed of seeded splits (``bbc``); splits of other tasks are fixed.
        eval_fraction: eval share of the split (``bbc`` 0.2, ``wiki`` 0.1 by default).

    The dataset's ``info`` holds ``task``, ``split`` and the kind's metadata (``num_labels``,
    ``label_names``, ``vocab_size``, ...).
    """
    try:
        spec = TASKS[name]
    except KeyError:
        raise SpecError(f"unknown task {name!r}; known: {', '.join(TASKS)}") from None
    split = _split(split)
    args = _Args(split=split, cache_dir=cache_dir, seq_len=seq_len, max_length=max_length,
                 max_samples=max_samples, tokenizer=tokenizer, seed=seed, eval_fraction=eval_fraction)
    ds = spec.loader(args)
    ds.info.update(task=name, split=split)
    log.info("task %s/%s: %s", name, split, ds)
    return ds
