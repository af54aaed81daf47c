"""The ``sequential-mlp`` family: ``torch.nn.Sequential`` models, built from a recipe as an MLP.

Recipe config: ``sizes`` (layer widths, input first), ``activation`` (one name, or one per hidden layer,
from ``relu``, ``gelu``, ``tanh``, ``sigmoid``, ``silu``, ``identity``; default ``relu``) and ``bias``
(default true).  Any ``nn.Sequential`` cuts between its children; the first stage reads
``batch["input"]``, the last applies the loss to ``batch["labels"]``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from aqsgd.errors import SpecError
from aqsgd.models.family import ModelFamily, ModelLayout
from aqsgd.models.stage import Batch, LossFn, PipelineStage

KIND = "sequential-mlp"

ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "tanh": nn.Tanh,
    "sigmoid": nn.Sigmoid,
    "silu": nn.SiLU,
    "identity": nn.Identity,
}


class SequentialStage(PipelineStage):
    """A slice of an ``nn.Sequential``.

    The first stage reads ``batch["input"]``; the last applies ``loss_fn`` to ``batch["labels"]``.
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        stage_index: int,
        num_stages: int,
        start: int,
        end: int,
        loss_fn: LossFn,
    ) -> None:
        super().__init__(stage_index, num_stages, (start, end))
        self.layers = nn.Sequential(*modules)
        self.loss_fn = loss_fn

    def forward(self, hidden: torch.Tensor | None, batch: Batch) -> torch.Tensor:
        """Run this slice of the Sequential (see :class:`PipelineStage`)."""
        if self.is_first:
            hidden = self.require(batch, "input")
        out = self.layers(self._check_hidden(hidden))
        if not self.is_last:
            return out
        return self.loss_fn(self._kept(out), self.require(batch, "labels"))


def build_mlp(config: Mapping[str, Any]) -> nn.Sequential:
    """``Linear -> act -> ... -> Linear`` from a ``sequential-mlp`` recipe config."""
    unknown = sorted(set(config) - {"sizes", "activation", "bias"})
    if unknown:
        raise SpecError(f"unknown sequential-mlp config keys {unknown}; expected sizes, activation, bias")
    sizes = list(config.get("sizes", []))
    if len(sizes) < 2 or not all(isinstance(s, int) and s > 0 for s in sizes):
        raise SpecError(f"sequential-mlp needs 'sizes' with at least two positive ints, got {sizes}")
    activation = config.get("activation", "relu")
    hidden = len(sizes) - 2
    names = [activation] * hidden if isinstance(activation, str) else list(activation)
    if len(names) != hidden:
        raise SpecError(f"sequential-mlp has {hidden} hidden layers but {len(names)} activations")
    for name in names:
        if name not in ACTIVATIONS:
            raise SpecError(f"unknown activation {name!r}; expected one of {', '.join(ACTIVATIONS)}")
    bias = bool(config.get("bias", True))
    modules: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
        modules.append(nn.Linear(fan_in, fan_out, bias=bias))
        if i < hidden:
            modules.append(ACTIVATIONS[names[i]]())
    return nn.Sequential(*modules)


def _layout(model: nn.Module, loss_fn: LossFn) -> ModelLayout:
    children = list(model)
    return ModelLayout(
        KIND,
        children,
        [],
        [],
        lambda i, s, a, b: SequentialStage(children[a:b], i, s, a, b, loss_fn),
    )


def _tiny_config(*, layers: int, hidden: int, vocab: int, seq_len: int) -> dict[str, Any]:
    """``layers`` linear layers ``hidden`` wide (ReLU between them) mapping to 10 classes (``vocab`` and
    ``seq_len`` do not apply)."""
    return {"sizes": [hidden] * layers + [10], "activation": "relu"}


FAMILY = ModelFamily(
    kind=KIND,
    description="torch.nn.Sequential",
    stage=SequentialStage,
    build=lambda config, attn_implementation: build_mlp(config),
    matches=lambda model: isinstance(model, nn.Sequential),
    layout=_layout,
    tiny_config=_tiny_config,
    takes_loss_fn=True,
    auto_class=None,  # not a transformers model
)
