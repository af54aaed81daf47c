"""The registry of model families: recipe kind -> family module.

Every family module defines ``FAMILY``, a :class:`~aqsgd.models.family.ModelFamily`.  Adding a family is
one new module plus its line in :data:`_FAMILY_MODULES`.  Family modules are imported on first use, so
importing the registry imports neither transformers nor :mod:`aqsgd.pipeline`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from aqsgd.errors import SpecError
from aqsgd.models.family import ModelFamily

if TYPE_CHECKING:
    from torch import nn

_FAMILY_MODULES: dict[str, str] = {
    "gpt2": "aqsgd.models.gpt2",
    "llama": "aqsgd.models.llama",
    "bert-cls": "aqsgd.models.bert",
    "resnet": "aqsgd.models.resnet",
    "sequential-mlp": "aqsgd.models.mlp",
    # Decoder-only causal LMs on the generic stage of aqsgd.models.decoder, one kind per model_type.
    "mistral": "aqsgd.models.mistral",
    "qwen2": "aqsgd.models.qwen2",
    "qwen3": "aqsgd.models.qwen3",
    "gemma2": "aqsgd.models.gemma2",
    "gemma3": "aqsgd.models.gemma3",
    "phi3": "aqsgd.models.phi3",
    "olmo2": "aqsgd.models.olmo2",
    "gpt-neox": "aqsgd.models.gpt_neox",
    # Encoder classifiers with their own stages.
    "deberta-v2-cls": "aqsgd.models.deberta_v2",
    "distilbert-cls": "aqsgd.models.distilbert",
}

MODEL_KINDS: tuple[str, ...] = tuple(_FAMILY_MODULES)
"""The recipe kinds, one per family (the original five first, so that their order is unchanged)."""


def get_family(kind: str) -> ModelFamily:
    """The family of recipe kind ``kind``.

    Raises:
        SpecError: unknown kind (one line listing the kinds).
    """
    if kind not in MODEL_KINDS:
        raise SpecError(f"unknown model kind {kind!r}; expected one of {', '.join(MODEL_KINDS)}")
    return importlib.import_module(_FAMILY_MODULES[kind]).FAMILY


def families() -> list[ModelFamily]:
    """Every family, in :data:`MODEL_KINDS` order."""
    return [get_family(kind) for kind in MODEL_KINDS]


def supported_models() -> str:
    """The models :func:`~aqsgd.pipeline.partition.partition_model` accepts, as one line."""
    return ", ".join(f.description for f in families())


def family_of_model(model: nn.Module) -> ModelFamily:
    """The family a built model belongs to.

    Raises:
        ValueError: no family recognises the model (one line listing the supported models).
    """
    for family in families():
        if family.matches(model):
            return family
    raise ValueError(f"unsupported model type {type(model).__name__}; supported: {supported_models()}")


def supported_model_types(task_kind: str) -> list[str]:
    """The transformers ``model_type`` values that a task of kind ``task_kind`` accepts, sorted (empty for
    a task kind that no transformers family serves)."""
    return sorted(
        {t for f in families() if f.task_kind == task_kind for t in f.model_types or ()}
    )


def family_for(model_type: str | None, task_kind: str) -> str:
    """The recipe kind for a transformers config's ``model_type`` in a task of kind ``task_kind``
    (``"causal-lm"``: ``gpt2``, ``llama``, ``mistral`` ...; ``"sequence-classification"``: ``bert-cls``,
    ``deberta-v2-cls``, ``distilbert-cls``); see :func:`supported_model_types`.

    Raises:
        SpecError: no family serves that model type for that task kind (one line listing the ones that do).
    """
    serving = [f for f in families() if f.task_kind == task_kind and f.model_types != ()]
    for family in serving:
        if family.model_types is None or model_type in family.model_types:
            return family.kind
    if not serving:
        kinds = sorted({f.task_kind for f in families() if f.task_kind is not None and f.model_types != ()})
        raise SpecError(
            f"no transformers model family serves task kind {task_kind!r}; task kinds: {', '.join(kinds)}"
        )
    types = supported_model_types(task_kind)
    raise SpecError(f"{task_kind} pipelines support model_type {', '.join(types)}, not {model_type!r}")


def truncate_config(kind: str, config: dict[str, Any], n: int | None) -> dict[str, Any]:
    """``config`` of a ``kind`` recipe keeping only the first ``n`` blocks (see
    :meth:`ModelFamily.truncate_config`)."""
    return get_family(kind).truncate_config(config, n)
