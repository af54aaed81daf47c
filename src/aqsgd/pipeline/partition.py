"""Split a model into pipeline stages.

:func:`partition_model` cuts a supported model between its repeated blocks (transformer layers,
residual blocks, ``nn.Sequential`` children); a :class:`StageCut` holds a run's choice of cut (stages,
blocks per stage, balance) so that everything that cuts a run's model (the trainer, LoRA, export) cuts it
the same way.  The first stage also holds the embeddings / stem, the
last stage the final norm, the head and the loss.  Stages reference the original sub-modules (no
copies, no data access), so partitioning works on a model built on the ``meta`` device and the
stages' gradients can be compared directly with the unsplit model's.

Where the blocks, embeddings and head of a model are is its family's business
(:meth:`aqsgd.models.family.ModelFamily.layout`); this module only cuts and balances.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn import functional as F

from aqsgd.models.family import ModelLayout
from aqsgd.models.registry import families, family_of_model, supported_models
from aqsgd.models.stage import LossFn, PipelineStage

BALANCE_MODES = ("layers", "params", "measured")
"""``measured`` splits by the stages' compute time profiled while training (:mod:`aqsgd.pipeline.balance`,
chosen by the trainer); here it needs that split as explicit ``layers``."""


def __getattr__(name: str) -> str:
    # SUPPORTED_MODELS is built from the family registry on first use: the family modules import
    # aqsgd.pipeline, so none of them is loaded while this package initializes.
    if name == "SUPPORTED_MODELS":
        return supported_models()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _default_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against ``batch["labels"]`` (the default ``loss_fn``)."""
    return F.cross_entropy(logits, labels)


def model_layout(model: nn.Module, loss_fn: LossFn | None = None) -> ModelLayout:
    """Describe how ``model`` splits into stages (the layout its family reports).

    Raises:
        ValueError: the model type is not supported (the message lists the supported ones), or
            ``loss_fn`` was given for a model that computes its own loss.
    """
    family = family_of_model(model)
    if loss_fn is not None and not family.takes_loss_fn:
        takers = " and ".join(f.description for f in families() if f.takes_loss_fn)
        raise ValueError(
            f"loss_fn is only used for {takers}; {type(model).__name__} computes its own loss"
        )
    return family.layout(model, loss_fn or _default_loss)


def count_parameters(modules: Sequence[nn.Module]) -> int:
    """Number of parameter elements in ``modules``, counting a shared parameter once (meta-safe)."""
    seen: dict[int, int] = {}
    for module in modules:
        for p in module.parameters():
            seen[id(p)] = p.numel()
    return sum(seen.values())


def even_counts(num_layers: int, num_stages: int) -> list[int]:
    """Blocks per stage as even as possible; the first ``num_layers % num_stages`` stages get one more."""
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if i < extra else 0) for i in range(num_stages)]


def balanced_counts(
    costs: Sequence[float], num_stages: int, first_extra: float = 0.0, last_extra: float = 0.0
) -> list[int]:
    """Contiguous split of blocks with ``costs`` into ``num_stages`` non-empty groups minimising the
    largest stage cost, where the first stage also pays ``first_extra`` and the last ``last_extra``.

    Ties are broken towards putting blocks in earlier stages.
    """
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def stage_cost(stage: int, start: int, end: int) -> float:
        extra = (first_extra if stage == 0 else 0.0) + (last_extra if stage == num_stages - 1 else 0.0)
        return prefix[end] - prefix[start] + extra

    return min_max_split(len(costs), num_stages, stage_cost)


def min_max_split(
    num_layers: int, num_stages: int, stage_cost: Callable[[int, int, int], float]
) -> list[int]:
    """Blocks per stage of the contiguous split of ``num_layers`` blocks into ``num_stages`` non-empty
    stages whose largest ``stage_cost(stage, start, end)`` (stage ``stage`` holding blocks
    ``[start, end)``) is smallest: exact dynamic programming, O(stages x blocks^2) calls of ``stage_cost``.
    Stages may differ (a stage's cost is its own function of its blocks). Ties are broken towards putting
    blocks in earlier stages.
    """
    n = num_layers
    _check_stage_count(n, num_stages)
    inf = float("inf")
    # best[s][e]: minimal max cost of splitting blocks [0, e) into stages 0..s; cut[s][e]: start of stage s.
    best = [[inf] * (n + 1) for _ in range(num_stages)]
    cut = [[0] * (n + 1) for _ in range(num_stages)]
    for e in range(1, n + 1):
        best[0][e] = stage_cost(0, 0, e)
    for s in range(1, num_stages):
        for e in range(s + 1, n + 1):
            for start in range(e - 1, s - 1, -1):
                value = max(best[s - 1][start], stage_cost(s, start, e))
                if value < best[s][e]:
                    best[s][e] = value
                    cut[s][e] = start
    counts: list[int] = []
    end = n
    for s in range(num_stages - 1, 0, -1):
        start = cut[s][end]
        counts.append(end - start)
        end = start
    counts.append(end)
    return counts[::-1]


def _check_stage_count(num_layers: int, num_stages: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_stages > num_layers:
        raise ValueError(
            f"cannot split a model with {num_layers} layers into {num_stages} stages: "
            "every stage needs at least one layer"
        )


def stage_layer_counts(
    layout: ModelLayout, num_stages: int, layers: Sequence[int] | None = None, balance: str = "layers"
) -> list[int]:
    """Number of blocks per stage for ``layout`` (explicit ``layers`` or a ``balance`` strategy)."""
    num_layers = len(layout.blocks)
    _check_stage_count(num_layers, num_stages)
    if layers is not None:
        layers = list(layers)
        if len(layers) != num_stages:
            raise ValueError(f"layers={layers} has {len(layers)} entries but num_stages={num_stages}")
        for i, count in enumerate(layers):
            if count < 1:
                raise ValueError(
                    f"layers={layers}: stage {i} has {count} layers; every stage needs at least one"
                )
        if sum(layers) != num_layers:
            raise ValueError(
                f"layers={layers} adds up to {sum(layers)} but the model has {num_layers} layers"
            )
        return layers
    if balance == "layers":
        return even_counts(num_layers, num_stages)
    if balance == "params":
        return balanced_counts(
            [count_parameters([b]) for b in layout.blocks],
            num_stages,
            first_extra=count_parameters(layout.pre),
            last_extra=count_parameters(layout.post),
        )
    if balance == "measured":
        raise ValueError("balance 'measured' is the split chosen by profiling the running stages (aqsgd "
                         "train --balance measured); pass that split as layers")
    raise ValueError(f"unknown balance {balance!r}; expected one of {', '.join(BALANCE_MODES)}")


def shared_parameters(stages: Sequence[nn.Module]) -> list[dict[int, str]]:
    """Parameters held by more than one stage (e.g. GPT-2's embedding tied to its LM head).

    Returns one dict per shared parameter, mapping stage index -> the parameter's name in that stage.
    A distributed runtime must sum the gradients of these parameters across the listed stages.
    """
    holders: dict[int, dict[int, str]] = {}
    for index, stage in enumerate(stages):
        for name, param in stage.named_parameters():
            holders.setdefault(id(param), {}).setdefault(index, name)
    return [names for names in holders.values() if len(names) > 1]


def partition_model(
    model: nn.Module,
    num_stages: int,
    *,
    layers: list[int] | None = None,
    balance: str = "layers",
    loss_fn: LossFn | None = None,
) -> list[PipelineStage]:
    """Split ``model`` into ``num_stages`` pipeline stages.

    Args:
        model: a supported model (see :func:`~aqsgd.models.supported_models`); it may live on the
            ``meta`` device.
        num_stages: number of stages, between 1 and the number of blocks.
        layers: explicit number of blocks per stage (overrides ``balance``).
        balance: ``"layers"`` (even number of blocks per stage) or ``"params"`` (minimise the largest
            per-stage parameter count; embeddings / stem count toward the first stage, final norm and
            head toward the last; a tied embedding/head counts for both, since both stages hold it);
            ``"measured"`` takes the split a profile chose, given as ``layers``.
        loss_fn: loss ``(output, labels) -> scalar`` for the families that take one (``nn.Sequential``,
            ResNet; default: cross-entropy against ``batch["labels"]``); transformers models use their
            own loss.

    Returns:
        The stages in pipeline order; they share the model's parameter objects.

    Raises:
        ValueError: unsupported model, more stages than blocks, or bad ``layers`` / ``balance``.
    """
    layout = model_layout(model, loss_fn)
    counts = stage_layer_counts(layout, num_stages, layers, balance)
    stages: list[PipelineStage] = []
    start = 0
    for index, count in enumerate(counts):
        stages.append(layout.make_stage(index, num_stages, start, start + count))
        start += count
    return stages


class CutSettings(Protocol):
    """What a cut is made of: a config section holding the stage count, the blocks per stage and the
    balance (``aqsgd.train.config.PipelineSection``, or a :class:`StageCut`)."""

    @property
    def stages(self) -> int: ...

    @property
    def layers(self) -> Sequence[int] | None: ...

    @property
    def balance(self) -> str: ...


@dataclass(frozen=True)
class StageCut:
    """How a run cuts its model into stages: ``stages`` stages of ``layers`` blocks each (None: as
    ``balance`` says), as :func:`partition_model` takes them.

    One value per run, so that the trainer, the LoRA adapters and the export cut the same model into the
    same stages (a checkpoint's stage files only load into the stages they were saved from).
    """

    stages: int
    layers: tuple[int, ...] | None = None
    balance: str = "layers"

    @classmethod
    def of(cls, section: CutSettings) -> StageCut:
        """The cut a config section (the pipeline section) describes."""
        layers = None if section.layers is None else tuple(section.layers)
        return cls(stages=section.stages, layers=layers, balance=section.balance)

    @classmethod
    def from_flat(cls, settings: Mapping[str, Any], defaults: CutSettings) -> StageCut:
        """The cut of a saved run from its flat config ``settings`` (``stages``, ``layers``, ``balance``); an
        option the config lacks (written before the option existed) takes ``defaults``' value (the pipeline
        section's own defaults)."""
        layers = settings.get("layers", defaults.layers)
        return cls(stages=int(settings.get("stages", defaults.stages)),
                   layers=None if layers is None else tuple(layers),
                   balance=str(settings.get("balance", defaults.balance)))

    def cut(self, model: nn.Module, *, loss_fn: LossFn | None = None) -> list[PipelineStage]:
        """``model`` cut into this cut's stages (see :func:`partition_model`)."""
        layers = None if self.layers is None else list(self.layers)
        return partition_model(model, self.stages, layers=layers, balance=self.balance, loss_fn=loss_fn)
