"""What the library asks of a model family: :class:`ModelFamily`, and the :class:`ModelLayout` it reports.

A family is one :class:`~aqsgd.models.recipe.ModelRecipe` kind.  Its module under
:mod:`aqsgd.models` defines a ``FAMILY`` object that says how to build the model from a recipe, how to
recognise a built model, how to cut it into pipeline stages, how to shorten its config to fewer blocks,
how to set its dropout, which non-persistent buffers it must recompute after loading weights, which layers
LoRA adapts by default, and a tiny random config for tests and benchmarks.  The generic code
(partitioning, materialization, tasks, LoRA) asks the family and knows nothing of any one model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from aqsgd.errors import SpecError

if TYPE_CHECKING:
    from aqsgd.models.stage import LossFn, PipelineStage

StageFactory = Callable[[int, int, int, int], "PipelineStage"]
"""``make_stage(index, num_stages, start, end)``: the stage holding blocks ``[start, end)``."""

BufferInitializer = Callable[[nn.Module, torch.device], dict[str, torch.Tensor]]
"""``fn(module, device) -> {buffer_name: value}`` for the module's own (non-recursive) non-persistent
buffers; values may be computed on any device, they are moved to ``device`` and cast to the skeleton
buffer's dtype by the caller."""


@dataclass(frozen=True)
class ModelLayout:
    """How a model splits: its repeated ``blocks``, the ``pre`` modules of the first stage and the
    ``post`` modules of the last stage, and a factory ``make_stage(index, num_stages, start, end)``.

    ``family`` is the recipe kind of the model's family.
    """

    family: str
    blocks: Sequence[nn.Module]
    pre: Sequence[nn.Module]
    post: Sequence[nn.Module]
    make_stage: StageFactory


@dataclass(frozen=True)
class ModelFamily:
    """Everything the library knows about one model family.

    Attributes:
        kind: the :class:`~aqsgd.models.recipe.ModelRecipe` kind.
        description: the models of this family that :func:`~aqsgd.pipeline.partition.partition_model`
            accepts, as listed in error messages.
        stage: the :class:`~aqsgd.models.stage.PipelineStage` subclass of the family.
        build: ``build(config, attn_implementation) -> model``, the full model from a recipe's config dict,
            created on the current default device (:meth:`ModelRecipe.build` sets it); bad configs raise
            :class:`SpecError`.  ``attn_implementation`` is the attention kernel of transformers models.
        matches: ``matches(model) -> bool``, whether a built model belongs to the family.
        layout: ``layout(model, loss_fn) -> ModelLayout``, how the model cuts into stages; ``loss_fn`` is
            the loss of families that take one (``takes_loss_fn``), the others compute their own.
        tiny_config: ``tiny_config(layers=, hidden=, vocab=, seq_len=) -> dict``, the recipe config of a
            small random model.
        takes_loss_fn: whether the last stage applies a caller-given loss to ``batch["labels"]``.
        task_kind: the task kind the family serves (``"causal-lm"``, ``"sequence-classification"``,
            ``"image-classification"``), or None.
        model_types: the transformers ``model_type`` values that map to this family; None for any
            ``model_type`` (the config's own ``model_type`` selects the config class); ``()`` for models
            that are not transformers models.
        blocks_key: the config key holding the number of blocks, or None when the config has no such key.
        dropout: ``dropout(config, p) -> config`` with every dropout probability set to ``p``, or None when
            the family has no dropout setting.
        buffer_initializers: ``(module path, class name, initializer)`` for the non-persistent buffers of
            the family's modules (registered lazily by :mod:`aqsgd.pipeline.materialize`).
        auto_class: the transformers auto class that loads a pretrained folder of the family
            (``"AutoModelForCausalLM"``, ``"AutoModelForSequenceClassification"``), or None for models that
            are not transformers models.
        checkpoint_renames: ``(model prefix, checkpoint prefix)`` pairs: a tensor whose name in the model
            starts with ``model prefix`` may be stored under ``checkpoint prefix`` instead (GPT-NeoX's
            ``lm_head.`` is saved as ``embed_out.`` by ``save_pretrained``).
        lora_targets: the linear layers (the last component of their module names) that LoRA adapts when
            ``--lora-targets`` names none: the family's attention projections, the choice of the LoRA paper
            (Hu et al., 2021); ``()`` for a family without attention, whose layers the user names.
    """

    kind: str
    description: str
    stage: type[PipelineStage]
    build: Callable[[Mapping[str, Any], str], nn.Module]
    matches: Callable[[nn.Module], bool]
    layout: Callable[[nn.Module, LossFn], ModelLayout]
    tiny_config: Callable[..., dict[str, Any]]
    takes_loss_fn: bool = False
    task_kind: str | None = None
    model_types: tuple[str, ...] | None = ()
    blocks_key: str | None = None
    dropout: Callable[[Mapping[str, Any], float], dict[str, Any]] | None = None
    buffer_initializers: tuple[tuple[str, str, BufferInitializer], ...] = ()
    auto_class: str | None = None
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    lora_targets: tuple[str, ...] = ()

    def checkpoint_aliases(self, name: str) -> list[str]:
        """The other names under which a checkpoint may store the model's tensor ``name``."""
        return [old + name[len(new) :] for new, old in self.checkpoint_renames if name.startswith(new)]

    def truncate_config(self, config: dict[str, Any], n: int | None) -> dict[str, Any]:
        """``config`` keeping only the first ``n`` blocks (``None``: ``config`` itself).

        A per-block ``layer_types`` list (the attention type of every layer, e.g. sliding-window or full) is
        cut to its first ``n`` entries as well: transformers requires one entry per layer.

        Raises:
            SpecError: the family has no block count, the config lacks it, or ``n`` exceeds it.
        """
        if n is None:
            return config
        if self.blocks_key is None:
            raise SpecError(f"{self.kind} models have no block count to truncate")
        if self.blocks_key not in config:
            raise SpecError(f"the {self.kind} config has no {self.blocks_key!r} to truncate")
        if n > config[self.blocks_key]:
            raise SpecError(f"the model has only {config[self.blocks_key]} blocks, asked for {n}")
        truncated = {**config, self.blocks_key: n}
        layer_types = config.get("layer_types")
        if isinstance(layer_types, list) and len(layer_types) > n:
            truncated["layer_types"] = layer_types[:n]
        return truncated

    def with_dropout(self, config: Mapping[str, Any], p: float) -> dict[str, Any]:
        """``config`` with every dropout probability set to ``p``.

        Raises:
            SpecError: the family has no dropout setting.
        """
        if self.dropout is None:
            raise SpecError(f"{self.kind} models have no dropout setting")
        return self.dropout(config, p)
