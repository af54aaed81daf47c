"""Helpers shared by the families built on transformers models (gpt2, the decoders, the classifiers).

transformers is imported inside the functions only, so that importing a family module does not import it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from aqsgd.errors import SpecError

if TYPE_CHECKING:
    from aqsgd.models.stage import Batch

_DROPOUT_KEY = re.compile(r"dropout|pdrop")


def no_cache(mask_builder: Callable[..., Any]) -> dict[str, None]:
    """The keyword argument that passes "no KV cache" to one of transformers' mask builders
    (``transformers.masking_utils.create_causal_mask`` and its siblings), under the name the installed version
    gives it: ``cache`` from transformers 5.24 on, ``past_key_values`` before (5.24 still takes the old name,
    with a FutureWarning at every call site). A pipeline stage keeps no cache."""
    return {_cache_parameter(mask_builder): None}


@functools.cache
def _cache_parameter(mask_builder: Callable[..., Any]) -> str:
    return "cache" if "cache" in inspect.signature(mask_builder).parameters else "past_key_values"


def is_transformers_instance(model: nn.Module, class_name: str) -> bool:
    """isinstance check against a transformers class, without importing transformers needlessly."""
    if not any(c.__module__.startswith("transformers.") for c in type(model).__mro__):
        return False
    import transformers

    cls = getattr(transformers, class_name, None)
    return cls is not None and isinstance(model, cls)


def build_transformers_model(
    config: Mapping[str, Any],
    attn_implementation: str,
    auto_class: str,
    *,
    kind: str,
    model_type: str | None = None,
    default_model_type: str | None = None,
) -> nn.Module:
    """``transformers.<auto_class>.from_config`` on a ``kind`` recipe's config dict.

    The config's ``model_type`` selects the config class; ``model_type`` requires that value (and is the
    default), ``default_model_type`` is the default when no value is required.
    """
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_dict = dict(config)
    name = config_dict.pop("model_type", model_type or default_model_type)
    if model_type is not None and name != model_type:
        raise SpecError(f"recipe kind {kind!r} needs model_type {model_type!r}, got {name!r}")
    if name not in CONFIG_MAPPING:
        raise SpecError(f"unknown transformers model_type {name!r}")
    model_config = CONFIG_MAPPING[name].from_dict(config_dict)
    auto = getattr(transformers, auto_class)
    return auto.from_config(model_config, attn_implementation=attn_implementation)


def import_modeling(model_type: str) -> None:
    """Import the transformers modeling module of ``model_type`` now.

    transformers imports it lazily, at the first model built; a recipe builds inside a ``torch.device``
    context (``build("meta")``), and under such a context the import itself fails with torch 2.6 (the
    generation utilities it pulls in import ``torch._dynamo``, whose module-level code then runs through the
    context's function mode: a circular import, or "item() cannot be called on meta tensors"). Call this
    outside the context first. An unknown ``model_type`` is left to the build to report."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        return
    module = CONFIG_MAPPING[model_type].__module__.replace(".configuration_", ".modeling_")
    with contextlib.suppress(ImportError):
        importlib.import_module(module)


def set_dropout(config: Mapping[str, Any], p: float) -> dict[str, Any]:
    """``config`` with every numeric (or unset) ``*dropout*`` / ``*pdrop*`` entry set to ``p``."""
    return {
        k: (p if _DROPOUT_KEY.search(k) and (v is None or isinstance(v, (int, float))) else v)
        for k, v in config.items()
    }


def position_ids(batch: Batch, seq_len: int, device: torch.device) -> torch.Tensor:
    """``batch["position_ids"]`` if given, else ``arange(T)[None]`` as the transformers models default to."""
    given = batch.get("position_ids")
    if given is not None:
        return given
    return torch.arange(seq_len, device=device).unsqueeze(0)
