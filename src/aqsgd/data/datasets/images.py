"""Image datasets: uint8 images normalised on access, and the image tasks (``fashion-mnist`` and ``mnist``
offline, ``cifar10`` from the hub).
"""

from __future__ import annotations

import gzip
import math
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from aqsgd.data.datasets.base import DictDataset, _Args, _max
from aqsgd.data.datasets.hub import _hub_datasets, _hub_split
from aqsgd.data.sources import require
from aqsgd.errors import DataSourceError, SpecError

__all__ = ["FASHION_MNIST_CLASSES", "image_classification", "read_idx"]


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


def _load_cifar10(a: _Args) -> DictDataset:
    datasets = _hub_datasets("cifar10", "fashion-mnist")
    ds = datasets.load_dataset("uoft-cs/cifar10", split=_hub_split(a.split, "test"))
    ds = ds.select(range(_max(len(ds), a.max_samples)))
    x = np.stack([np.asarray(im.convert("RGB"), dtype=np.uint8) for im in ds["img"]]).transpose(0, 3, 1, 2)
    return image_classification(x, np.asarray(ds["label"]), mean=(0.4914, 0.4822, 0.4465),
                                std=(0.2470, 0.2435, 0.2616), label_names=ds.features["label"].names)
