"""The ``resnet`` family: a compact ResNet for small images (1x28x28 MNIST-like or 3x32x32 CIFAR-like).

The network is deliberately laid out as ``stem`` + ``blocks`` (a flat ``nn.ModuleList`` of residual
blocks) + ``head`` so that :func:`aqsgd.pipeline.partition.partition_model` can cut it between any two
residual blocks.  torchvision is not required.

Recipe config: the keyword arguments of :class:`ResNet`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

from aqsgd.errors import SpecError
from aqsgd.models.family import ModelFamily, ModelLayout
from aqsgd.models.stage import Batch, LossFn, PipelineStage

KIND = "resnet"

NormKind = Literal["batch", "group", "none"]


def _norm(kind: NormKind, channels: int) -> nn.Module:
    """Build the normalisation layer used after every convolution."""
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "group":
        return nn.GroupNorm(min(8, channels), channels)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"unknown norm {kind!r}; expected 'batch', 'group' or 'none'")


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (projection shortcut when the shape changes)."""

    def __init__(
        self, in_channels: int, out_channels: int, stride: int = 1, norm: NormKind = "batch"
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.norm1 = _norm(norm, out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, stride=1, padding=1, bias=False)
        self.norm2 = _norm(norm, out_channels)
        self.shortcut: nn.Module
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), _norm(norm, out_channels)
            )
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to a ``[B, C, H, W]`` feature map."""
        out = torch.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNetHead(nn.Module):
    """Global average pooling followed by a linear classifier."""

    def __init__(self, channels: int, num_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map a ``[B, C, H, W]`` feature map to ``[B, num_classes]`` logits."""
        return self.fc(x.mean(dim=(2, 3)))


class ResNet(nn.Module):
    """Small ResNet: ``stem`` -> ``blocks`` (residual blocks) -> ``head``.

    Args:
        in_channels: image channels (1 for MNIST-like, 3 for CIFAR-like inputs).
        num_classes: number of output classes.
        widths: channel width of each resolution group; every group after the first halves the
            spatial resolution in its first block.
        blocks_per_group: number of residual blocks in each group.
        norm: ``"batch"`` (BatchNorm, the classic choice), ``"group"`` (GroupNorm, independent of the
            micro-batch size, so pipelined training is exactly equivalent to full-batch training) or
            ``"none"``.
    """

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 10,
        widths: Sequence[int] = (16, 32, 64),
        blocks_per_group: Sequence[int] | int = 2,
        norm: NormKind = "batch",
    ) -> None:
        super().__init__()
        if isinstance(blocks_per_group, int):
            blocks_per_group = [blocks_per_group] * len(widths)
        if len(blocks_per_group) != len(widths) or not widths:
            raise ValueError(
                f"widths ({len(widths)} groups) and blocks_per_group ({len(blocks_per_group)} groups) "
                "must be non-empty and of equal length"
            )
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False), _norm(norm, widths[0]), nn.ReLU()
        )
        blocks: list[nn.Module] = []
        channels = widths[0]
        for group, (width, count) in enumerate(zip(widths, blocks_per_group, strict=True)):
            for i in range(count):
                stride = 2 if group > 0 and i == 0 else 1
                blocks.append(BasicBlock(channels, width, stride=stride, norm=norm))
                channels = width
        self.blocks = nn.ModuleList(blocks)
        self.head = ResNetHead(channels, num_classes)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Return ``[B, num_classes]`` logits for ``[B, C, H, W]`` images."""
        x = self.stem(pixel_values)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class ResNetStage(PipelineStage):
    """A slice of :class:`ResNet`: [stem] -> residual blocks -> [head + loss].

    The first stage reads ``batch["pixel_values"]``; the last applies ``loss_fn`` to ``batch["labels"]``.
    """

    def __init__(
        self, model: nn.Module, stage_index: int, num_stages: int, start: int, end: int, loss_fn: LossFn
    ) -> None:
        super().__init__(stage_index, num_stages, (start, end))
        self.blocks = nn.ModuleList(model.blocks[start:end])
        if self.is_first:
            self.stem = model.stem
        if self.is_last:
            self.head = model.head
        self.loss_fn = loss_fn

    def forward(self, hidden: torch.Tensor | None, batch: Batch) -> torch.Tensor:
        """Run this slice of the ResNet (see :class:`PipelineStage`)."""
        if self.is_first:
            hidden = self.stem(self.require(batch, "pixel_values"))
        hidden = self._check_hidden(hidden)
        for block in self.blocks:
            hidden = block(hidden)
        if not self.is_last:
            return hidden
        return self.loss_fn(self._kept(self.head(hidden)), self.require(batch, "labels"))


def _build(config: Mapping[str, Any], attn_implementation: str) -> ResNet:
    try:
        return ResNet(**config)
    except TypeError as exc:
        raise SpecError(f"bad resnet recipe config {config}: {exc}") from None


def _layout(model: nn.Module, loss_fn: LossFn) -> ModelLayout:
    return ModelLayout(
        KIND,
        list(model.blocks),
        [model.stem],
        [model.head],
        lambda i, s, a, b: ResNetStage(model, i, s, a, b, loss_fn),
    )


def _tiny_config(*, layers: int, hidden: int, vocab: int, seq_len: int) -> dict[str, Any]:
    """One resolution group of ``layers`` blocks, ``hidden // 4`` channels wide, on 1-channel images with
    10 classes (``vocab`` and ``seq_len`` do not apply)."""
    return {"in_channels": 1, "num_classes": 10, "widths": [hidden // 4], "blocks_per_group": layers,
            "norm": "group"}


FAMILY = ModelFamily(
    kind=KIND,
    description="aqsgd.models.resnet.ResNet",
    stage=ResNetStage,
    build=_build,
    matches=lambda model: isinstance(model, ResNet),
    layout=_layout,
    tiny_config=_tiny_config,
    takes_loss_fn=True,
    task_kind="image-classification",
    auto_class=None,  # not a transformers model
)
