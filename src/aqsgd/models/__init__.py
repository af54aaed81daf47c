"""Model families: one module per family, and the registry that maps a recipe kind to its family.

Every family module defines ``FAMILY``, a :class:`~aqsgd.models.family.ModelFamily` holding all the
library knows about that model; the registry is :mod:`aqsgd.models.registry`.  The families:

* causal LMs: :mod:`~aqsgd.models.gpt2` and, on the generic decoder stage of :mod:`~aqsgd.models.decoder`,
  :mod:`~aqsgd.models.llama`, :mod:`~aqsgd.models.mistral`, :mod:`~aqsgd.models.qwen2`,
  :mod:`~aqsgd.models.qwen3`, :mod:`~aqsgd.models.gemma2`, :mod:`~aqsgd.models.gemma3`,
  :mod:`~aqsgd.models.phi3`, :mod:`~aqsgd.models.olmo2`, :mod:`~aqsgd.models.gpt_neox`;
* sequence classifiers: :mod:`~aqsgd.models.bert` (BERT, RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA),
  :mod:`~aqsgd.models.deberta_v2`, :mod:`~aqsgd.models.distilbert`;
* others: :mod:`~aqsgd.models.resnet`, :mod:`~aqsgd.models.mlp`.

:func:`family_for` maps a transformers ``model_type`` to its recipe kind and
:func:`supported_model_types` lists the model types a task kind accepts.

Importing this package imports neither transformers nor :mod:`aqsgd.pipeline`: family modules are loaded
on first use.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING, Any

from aqsgd.models.family import BufferInitializer, ModelFamily, ModelLayout
from aqsgd.models.registry import (
    MODEL_KINDS,
    families,
    family_for,
    family_of_model,
    get_family,
    supported_model_types,
    supported_models,
    truncate_config,
)

if TYPE_CHECKING:
    from aqsgd.models.recipe import ModelRecipe

__all__ = [
    "MODEL_KINDS",
    "BasicBlock",
    "BufferInitializer",
    "ModelFamily",
    "ModelLayout",
    "ResNet",
    "ResNetHead",
    "families",
    "family_for",
    "family_of_model",
    "get_family",
    "supported_model_types",
    "supported_models",
    "tiny_recipe",
    "truncate_config",
    "with_dropout",
]


def with_dropout(recipe: ModelRecipe, p: float | None) -> ModelRecipe:
    """``recipe`` with every dropout probability of its config set to ``p`` (``None``: ``recipe`` itself).

    The weights stay the same file: dropout is not a parameter.

    Raises:
        SpecError: the family has no dropout setting.
    """
    if p is None:
        return recipe
    return dataclasses.replace(recipe, config=get_family(recipe.kind).with_dropout(recipe.config, p))


def tiny_recipe(
    kind: str = "llama", *, layers: int = 4, hidden: int = 64, vocab: int = 128, seq_len: int = 32
) -> ModelRecipe:
    """A small randomly initialized model of family ``kind`` (a recipe without weights file)."""
    from aqsgd.models.recipe import ModelRecipe

    config = get_family(kind).tiny_config(layers=layers, hidden=hidden, vocab=vocab, seq_len=seq_len)
    return ModelRecipe(kind, config)


_RESNET_NAMES = ("BasicBlock", "ResNet", "ResNetHead")


def __getattr__(name: str) -> Any:
    # The bundled ResNet stays importable from here without loading its family module eagerly.
    if name in _RESNET_NAMES:
        return getattr(importlib.import_module("aqsgd.models.resnet"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
