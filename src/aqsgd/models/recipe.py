"""A model described as data: :class:`ModelRecipe` (family, config, weights), from which every stage process
builds the same skeleton (on the ``meta`` device, for the pipeline to materialize stage by stage)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from aqsgd.errors import SpecError
from aqsgd.models.registry import get_family

__all__ = ["ModelRecipe"]

DeviceLike = str | torch.device
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelRecipe:
    """A JSON-serializable description of how to build a model skeleton.

    Attributes:
        kind: the model family, one of :data:`aqsgd.models.MODEL_KINDS`.
        config: the family's config dict, described in the family's module under :mod:`aqsgd.models`
            (a transformers config dict for the transformers families: ``gpt2``, ``llama``, ``bert-cls``
            ...; the keyword arguments of :class:`aqsgd.models.resnet.ResNet` for ``resnet``, layer sizes
            for ``sequential-mlp``).
            The dict is normalised through JSON (tuples become lists, dict keys strings).
        weights: a safetensors file, or a directory holding ``model.safetensors``, sharded weights with
            ``model.safetensors.index.json``, or any ``*.safetensors`` files; ``None`` for a recipe that
            only describes the architecture.
        attn_implementation: attention kernel of transformers models (``"eager"`` or ``"sdpa"``).
    """

    kind: str
    config: dict[str, Any] = field(default_factory=dict)
    weights: str | None = None
    attn_implementation: str = "eager"

    def __post_init__(self) -> None:
        get_family(self.kind)  # an unknown kind is a SpecError listing the kinds
        if not isinstance(self.config, Mapping):
            raise SpecError(f"recipe config must be a dict, got {type(self.config).__name__}")
        try:
            normalised = json.loads(json.dumps(dict(self.config), sort_keys=True))
        except (TypeError, ValueError) as exc:
            raise SpecError(f"recipe config is not JSON-serializable: {exc}") from None
        object.__setattr__(self, "config", normalised)
        if self.weights is not None:
            object.__setattr__(self, "weights", os.fspath(self.weights))

    def __hash__(self) -> int:
        return hash((self.fingerprint(), self.weights))

    # -- serialization ------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The recipe as a plain dict (inverse of :meth:`from_dict`)."""
        return {
            "kind": self.kind,
            "config": json.loads(json.dumps(self.config)),
            "weights": self.weights,
            "attn_implementation": self.attn_implementation,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelRecipe:
        """Rebuild a recipe from :meth:`to_dict` output; unknown keys are an error."""
        known = {"kind", "config", "weights", "attn_implementation"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpecError(f"unknown recipe keys {unknown}; expected {sorted(known)}")
        if "kind" not in data:
            raise SpecError("recipe needs a 'kind'")
        return cls(
            kind=data["kind"],
            config=dict(data.get("config") or {}),
            weights=data.get("weights"),
            attn_implementation=data.get("attn_implementation", "eager"),
        )

    def to_json(self) -> str:
        """Canonical JSON text of the recipe."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelRecipe:
        """Inverse of :meth:`to_json`."""
        return cls.from_dict(json.loads(text))

    def with_weights(self, weights: str | os.PathLike[str] | None) -> ModelRecipe:
        """A copy of this recipe that reads its weights from ``weights``."""
        return replace(self, weights=None if weights is None else os.fspath(weights))

    def fingerprint(self) -> str:
        """A short stable hash (16 hex digits) of ``kind``, ``config`` and ``attn_implementation``.

        The weights path is left out: it may legitimately differ between machines.  Stage processes
        compare fingerprints to check that they all build the same architecture.
        """
        canonical = json.dumps(
            {"kind": self.kind, "config": self.config, "attn_implementation": self.attn_implementation},
            sort_keys=True,
            separators=(",", ":"),
        )
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    # -- building -----------------------------------------------------------------------------------

    def build(self, device: DeviceLike = "meta") -> nn.Module:
        """Build the full model on ``device``.

        On ``"meta"`` no storage is allocated (every parameter and buffer ``is_meta``): this is the
        skeleton that :func:`materialize_stage` partitions.  On a real device the model gets the
        library's random initialisation (seed it with :func:`torch.manual_seed`).
        """
        family = get_family(self.kind)
        if family.model_types:  # a transformers model: its module imported outside the device context
            from aqsgd.models.hf import import_modeling

            import_modeling(self.config.get("model_type") or family.model_types[0])
        with torch.device(device):
            return family.build(self.config, self.attn_implementation)
