"""Materialize one pipeline stage without ever building the full model in memory.

In the distributed runtime every process owns one stage.  Loading the full model in every process
would cost ``num_stages`` times the memory of the model, so a stage process instead:

1. builds the model *skeleton* on the ``meta`` device from a :class:`ModelRecipe` (no storage at all);
2. partitions it with :func:`~aqsgd.pipeline.partition.partition_model` and keeps its own stage;
3. allocates only that stage's tensors on the target device and reads them, key by key, from a
   safetensors file (or a directory of shards) with :func:`safetensors.safe_open`;
4. recomputes the stage's non-persistent buffers (rotary ``inv_freq``, BERT ``position_ids`` ...),
   which are not stored in weights files, with the initializer registered for the owning module class
   (see :func:`register_buffer_initializer`; the model families register theirs).

Weights files are the full model's ``state_dict`` (as written by :func:`save_weights`,
:func:`init_weights_file` or transformers' ``save_pretrained``), so every stage process reads the same
file and only touches the bytes of its own tensors.  Tied parameters (GPT-2's embedding and LM head) are
stored once; the loader finds a tensor under any of its names in the full model, under the aliases
that :func:`safetensors.torch.save_model` records in the file metadata, and, for transformers models,
under the name without the base-model prefix (``h.0.attn...`` for ``transformer.h.0.attn...``).
"""

from __future__ import annotations

import functools
import importlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from aqsgd.errors import WeightsError
from aqsgd.models.family import BufferInitializer
from aqsgd.models.recipe import ModelRecipe
from aqsgd.models.registry import MODEL_KINDS, families
from aqsgd.models.stage import LossFn, PipelineStage
from aqsgd.pipeline.partition import partition_model

if TYPE_CHECKING:
    from typing import Self

__all__ = [
    "MODEL_KINDS",
    "SAFETENSORS_INDEX",
    "SAFETENSORS_SINGLE",
    "BufferInitializer",
    "ModelRecipe",
    "buffer_initializer",
    "init_weights_file",
    "load_weights",
    "materialize_model_stage",
    "materialize_stage",
    "register_buffer_initializer",
    "save_weights",
    "stage_nbytes",
]

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"

DeviceLike = str | torch.device


# --------------------------------------------------------------------------------------------------
# Weights files
# --------------------------------------------------------------------------------------------------


def save_weights(
    model: nn.Module, path: str | os.PathLike[str], metadata: Mapping[str, str] | None = None
) -> Path:
    """Write ``model.state_dict()`` to the safetensors file ``path``.

    Tensors that share storage (tied weights) are stored once; the dropped names are recorded in the
    file metadata as aliases of the kept name (:func:`safetensors.torch.save_model` semantics), and
    the loaders here also resolve them through the model's own tying.
    """
    from safetensors.torch import save_model

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_model(model, str(path), metadata={"format": "pt", **(metadata or {})}, force_contiguous=True)
    return path


def init_weights_file(recipe: ModelRecipe, path: str | os.PathLike[str], seed: int) -> Path:
    """Build the full model once on CPU with ``torch.manual_seed(seed)`` and save its weights.

    This is the one place where the whole model is materialized, so it is meant for tests, toy runs
    and launchers that create a random-init checkpoint once; real checkpoints come from
    ``save_pretrained``.  The file metadata records the recipe fingerprint and the seed.
    """
    torch.manual_seed(seed)
    model = recipe.build("cpu")
    return save_weights(model, path, {"aqsgd.fingerprint": recipe.fingerprint(), "aqsgd.seed": str(seed)})


class _WeightSource:
    """Lazy, key-by-key access to a safetensors file or a directory of shards (a context manager)."""

    def __init__(self, location: str | os.PathLike[str]) -> None:
        self.location = Path(location)
        self._files = self._resolve(self.location)
        self._stack = ExitStack()
        self._handles: dict[Path, Any] = {}
        self.aliases: dict[str, str] = {}

    @staticmethod
    def _resolve(location: Path) -> dict[str, Path]:
        """Map every tensor name to the file holding it."""
        from safetensors import SafetensorError, safe_open

        if location.is_file():
            files = [location]
        elif location.is_dir():
            index = location / SAFETENSORS_INDEX
            if index.is_file():
                try:
                    weight_map = json.loads(index.read_text())["weight_map"]
                except (ValueError, KeyError) as exc:
                    raise WeightsError(
                        f"{index} is not a safetensors index (no 'weight_map'): {exc}"
                    ) from None
                mapping = {key: location / name for key, name in weight_map.items()}
                absent = sorted({str(p) for p in mapping.values() if not p.is_file()})
                if absent:
                    raise WeightsError(f"{index} names shard files that do not exist: {absent}")
                return mapping
            single = location / SAFETENSORS_SINGLE
            files = [single] if single.is_file() else sorted(location.glob("*.safetensors"))
            if not files:
                raise WeightsError(f"no safetensors files in directory {location}")
        else:
            raise WeightsError(f"weights path {location} does not exist")
        mapping = {}
        for file in files:
            try:
                with safe_open(str(file), framework="pt") as handle:
                    keys = list(handle.keys())
            except (OSError, SafetensorError) as exc:
                raise WeightsError(f"cannot read safetensors file {file}: {exc}") from None
            for key in keys:
                if key in mapping:
                    raise WeightsError(f"tensor {key!r} is stored both in {mapping[key]} and {file}")
                mapping[key] = file
        return mapping

    def __enter__(self) -> Self:
        for file in sorted(set(self._files.values())):
            metadata = self._handle(file).metadata() or {}
            # safetensors.torch.save_model records each dropped shared tensor as {dropped: kept}.
            self.aliases.update({k: v for k, v in metadata.items() if v in self._files})
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stack.close()
        self._handles.clear()

    def _handle(self, file: Path) -> Any:
        from safetensors import safe_open

        handle = self._handles.get(file)
        if handle is None:
            handle = self._stack.enter_context(safe_open(str(file), framework="pt"))
            self._handles[file] = handle
        return handle

    def find(self, names: Sequence[str], prefixes: Sequence[str]) -> str | None:
        """The stored key for a tensor known under ``names``, or None."""
        candidates = list(names)
        for name in names:
            for prefix in prefixes:
                if name.startswith(prefix + "."):
                    candidates.append(name[len(prefix) + 1 :])
        for key in candidates:
            if key in self._files:
                return key
        for key in candidates:
            if key in self.aliases:
                return self.aliases[key]
        return None

    def shape(self, key: str) -> tuple[int, ...]:
        """Shape of a stored tensor, from the header only."""
        return tuple(self._handle(self._files[key]).get_slice(key).get_shape())

    def get(self, key: str) -> torch.Tensor:
        """Read one stored tensor (a fresh CPU tensor)."""
        return self._handle(self._files[key]).get_tensor(key)


# --------------------------------------------------------------------------------------------------
# Non-persistent buffers
# --------------------------------------------------------------------------------------------------

_BUFFER_INITIALIZERS: dict[type, BufferInitializer] = {}


def register_buffer_initializer(module_type: type[nn.Module], initializer: BufferInitializer) -> None:
    """Teach :func:`materialize_stage` how to recompute the non-persistent buffers of ``module_type``
    (and its subclasses without an initializer of their own)."""
    _ensure_builtin_initializers()
    _BUFFER_INITIALIZERS[module_type] = initializer


@functools.cache
def _ensure_builtin_initializers() -> None:
    """Register the initializers the model families declare for their modules (once, lazily, so that
    importing this module does not import transformers)."""
    for module_name, class_name, initializer in (i for f in families() for i in f.buffer_initializers):
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue
        _BUFFER_INITIALIZERS.setdefault(cls, initializer)


def buffer_initializer(module: nn.Module) -> BufferInitializer | None:
    """The initializer registered for ``type(module)`` or its nearest registered base class."""
    _ensure_builtin_initializers()
    for cls in type(module).__mro__:
        initializer = _BUFFER_INITIALIZERS.get(cls)
        if initializer is not None:
            return initializer
    return None


# --------------------------------------------------------------------------------------------------
# Materialization
# --------------------------------------------------------------------------------------------------


@dataclass
class _Slot:
    """Where one tensor lives in the module tree: ``owner._parameters[attr]`` or ``owner._buffers[attr]``."""

    owner: nn.Module
    attr: str
    is_param: bool


def _tensor_slots(root: nn.Module) -> dict[int, tuple[torch.Tensor, list[_Slot]]]:
    """Every parameter and buffer under ``root``, by ``id``, with all the slots that hold it."""
    found: dict[int, tuple[torch.Tensor, list[_Slot]]] = {}
    for module in root.modules():
        for attr, param in module._parameters.items():
            if param is not None:
                found.setdefault(id(param), (param, []))[1].append(_Slot(module, attr, True))
        for attr, buffer in module._buffers.items():
            if buffer is not None:
                found.setdefault(id(buffer), (buffer, []))[1].append(_Slot(module, attr, False))
    return found


def _is_persistent(slots: Sequence[_Slot]) -> bool:
    return any(s.is_param or s.attr not in s.owner._non_persistent_buffers_set for s in slots)


def _full_names(model: nn.Module) -> dict[int, list[str]]:
    """``id(tensor)`` -> every name of that parameter/buffer in ``model`` (several when tied), followed by
    the names its family's checkpoints may use instead (:attr:`ModelFamily.checkpoint_renames`)."""
    names: dict[int, list[str]] = {}
    for name, tensor in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(tensor), []).append(name)
    for name, tensor in model.named_buffers(remove_duplicate=False):
        names.setdefault(id(tensor), []).append(name)
    family = next((f for f in families() if f.checkpoint_renames and f.matches(model)), None)
    if family is not None:
        for known in names.values():
            known.extend(alias for name in list(known) for alias in family.checkpoint_aliases(name))
    return names


def _name_prefixes(model: nn.Module) -> list[str]:
    """Prefixes a checkpoint may omit (transformers' ``base_model_prefix``)."""
    prefix = getattr(model, "base_model_prefix", "")
    return [prefix] if isinstance(prefix, str) and prefix else []


def _set(slots: Sequence[_Slot], value: torch.Tensor, requires_grad: bool) -> None:
    """Put ``value`` into every slot (one Parameter object shared by all parameter slots: ties survive)."""
    param = nn.Parameter(value, requires_grad=requires_grad) if any(s.is_param for s in slots) else None
    for slot in slots:
        if slot.is_param:
            slot.owner._parameters[slot.attr] = param
        else:
            slot.owner._buffers[slot.attr] = value


def _check_no_meta_attributes(root: nn.Module) -> None:
    """Reject plain tensor attributes left on ``meta`` (state a module computed in ``__init__`` outside
    its parameters and buffers, which nothing here could restore)."""
    leftovers = [
        f"{name or '<root>'}.{attr} ({type(module).__name__})"
        for name, module in root.named_modules()
        for attr, value in vars(module).items()
        if isinstance(value, torch.Tensor) and value.is_meta
    ]
    if leftovers:
        raise WeightsError(
            f"tensor attributes that are neither parameters nor buffers stay on meta: {leftovers}"
        )


def _abbreviate(items: Sequence[str], limit: int = 12) -> str:
    """``items`` sorted, as a list literal, cut after ``limit`` entries."""
    ordered = sorted(items)
    if len(ordered) <= limit:
        return str(ordered)
    return f"{ordered[:limit]} and {len(ordered) - limit} more"


def _materialize(
    stage: nn.Module,
    full_names: Mapping[int, list[str]],
    prefixes: Sequence[str],
    source: _WeightSource,
    device: torch.device,
    dtype: torch.dtype | None,
) -> None:
    """Replace every meta tensor of ``stage`` by a real one on ``device`` (see :func:`materialize_stage`)."""
    slots = _tensor_slots(stage)
    persistent: dict[int, str] = {}
    missing: list[str] = []
    mismatched: list[str] = []
    for key_id, (tensor, where) in slots.items():
        if not _is_persistent(where):
            continue
        names = full_names.get(key_id)
        if names is None:
            owner = where[0]
            raise WeightsError(
                f"{type(owner.owner).__name__}.{owner.attr} of the stage is not part of the partitioned model"
            )
        key = source.find(names, prefixes)
        if key is None:
            missing.append(names[0])
            continue
        stored = source.shape(key)
        if stored != tuple(tensor.shape):
            mismatched.append(f"{key}: file {list(stored)} vs model {list(tensor.shape)}")
            continue
        persistent[key_id] = key
    if missing or mismatched:
        parts = []
        if missing:
            parts.append(f"missing keys ({len(missing)}) {_abbreviate(missing)}")
        if mismatched:
            parts.append(f"shape mismatches ({len(mismatched)}) {_abbreviate(mismatched)}")
        raise WeightsError(f"weights {source.location} do not fit the stage: {'; '.join(parts)}")

    # Non-persistent buffers, grouped by owning module, from the registered initializers.
    computed: dict[int, torch.Tensor] = {}
    for module in stage.modules():
        wanted = [a for a in module._non_persistent_buffers_set if module._buffers.get(a) is not None]
        if not wanted:
            continue
        initializer = buffer_initializer(module)
        if initializer is None:
            raise WeightsError(
                f"don't know how to recompute the non-persistent buffers {sorted(wanted)} of "
                f"{type(module).__module__}.{type(module).__qualname__}; register an initializer with "
                "aqsgd.pipeline.materialize.register_buffer_initializer"
            )
        values = initializer(module, device)
        unexpected = sorted(set(values) - set(wanted))
        absent = sorted(set(wanted) - set(values))
        if unexpected or absent:
            raise WeightsError(
                f"buffer initializer of {type(module).__name__} returned {sorted(values)}, "
                f"expected the non-persistent buffers {sorted(wanted)}"
            )
        for attr in wanted:
            meta = module._buffers[attr]
            assert meta is not None
            value = values[attr]
            if tuple(value.shape) != tuple(meta.shape):
                raise WeightsError(
                    f"buffer initializer of {type(module).__name__} made {attr} with shape "
                    f"{list(value.shape)}, the module expects {list(meta.shape)}"
                )
            computed[id(meta)] = value.to(device=device, dtype=meta.dtype)

    with torch.no_grad():
        for key_id, (tensor, where) in slots.items():
            if key_id in persistent:
                target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
                value = source.get(persistent[key_id]).to(device=device, dtype=target)
            else:
                value = computed[key_id]
            _set(where, value, tensor.requires_grad)
    _check_no_meta_attributes(stage)


def materialize_model_stage(
    model: nn.Module,
    weights: str | os.PathLike[str],
    num_stages: int,
    stage_index: int,
    *,
    layers: list[int] | None = None,
    balance: str = "layers",
    loss_fn: LossFn | None = None,
    device: DeviceLike = "cpu",
    dtype: torch.dtype | None = None,
) -> PipelineStage:
    """Like :func:`materialize_stage`, for a supported model already built on the ``meta`` device.

    Partitions ``model`` in place (the returned stage references its sub-modules, whose meta tensors
    are replaced by real ones) and reads only that stage's tensors from ``weights``.
    """
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index {stage_index} is out of range for {num_stages} stages")
    not_meta = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if not t.is_meta]
    if not_meta:
        raise ValueError(f"the model must be built on the meta device; already materialized: {not_meta[:5]}")
    full_names = _full_names(model)
    stage = partition_model(model, num_stages, layers=layers, balance=balance, loss_fn=loss_fn)[stage_index]
    with _WeightSource(weights) as source:
        _materialize(stage, full_names, _name_prefixes(model), source, torch.device(device), dtype)
    return stage


def materialize_stage(
    recipe: ModelRecipe,
    num_stages: int,
    stage_index: int,
    *,
    layers: list[int] | None = None,
    balance: str = "layers",
    loss_fn: LossFn | None = None,
    device: DeviceLike = "cpu",
    dtype: torch.dtype | None = None,
) -> PipelineStage:
    """Build stage ``stage_index`` of ``num_stages`` with only that stage's weights in memory.

    The model skeleton is built on ``meta`` and partitioned exactly as
    :func:`~aqsgd.pipeline.partition.partition_model` would partition the full model (same ``layers``
    / ``balance`` / ``loss_fn``).  Then every persistent parameter and buffer of the stage is read from
    ``recipe.weights`` (each must be stored there, with the model's shape), and every non-persistent
    buffer is recomputed by the initializer registered for its module class.

    Args:
        recipe: the model; ``recipe.weights`` is required (create a random-init file once with
            :func:`init_weights_file`).
        num_stages, stage_index: the pipeline size and this process's stage.
        layers, balance, loss_fn: as for :func:`~aqsgd.pipeline.partition.partition_model`.
        device: where the stage's tensors are allocated.
        dtype: cast floating-point parameters and persistent buffers to this dtype; ``None`` keeps the
            skeleton's dtype (float32, as ``recipe.build("cpu")`` followed by loading the file).
            Non-persistent buffers keep their natural dtype (rotary ``inv_freq`` stays float32).

    Returns:
        The stage, with tied parameters inside it still tied; :func:`stage_nbytes` tells its size.

    Raises:
        WeightsError: no weights in the recipe, unreadable weights, missing keys or wrong shapes (all
            named in the message), or a non-persistent buffer without a registered initializer.
    """
    if recipe.weights is None:
        raise WeightsError(
            "materialize_stage needs recipe.weights; create a weights file once with "
            "init_weights_file(recipe, path, seed) and use recipe.with_weights(path)"
        )
    return materialize_model_stage(
        recipe.build("meta"),
        recipe.weights,
        num_stages,
        stage_index,
        layers=layers,
        balance=balance,
        loss_fn=loss_fn,
        device=device,
        dtype=dtype,
    )


def load_weights(model: nn.Module, weights: str | os.PathLike[str]) -> nn.Module:
    """Copy every persistent parameter/buffer of an already materialized ``model`` from ``weights``.

    The reference path (full model in memory); names are resolved as in :func:`materialize_stage`.
    Returns ``model``.
    """
    full_names = _full_names(model)
    slots = _tensor_slots(model)
    with _WeightSource(weights) as source:
        keys: dict[int, str] = {}
        missing = []
        for key_id, (tensor, where) in slots.items():
            if not _is_persistent(where):
                continue
            if tensor.is_meta:
                raise ValueError("load_weights needs a materialized model; use materialize_stage for meta")
            key = source.find(full_names[key_id], _name_prefixes(model))
            if key is None:
                missing.append(full_names[key_id][0])
            else:
                keys[key_id] = key
        if missing:
            raise WeightsError(f"weights {source.location} lack keys ({len(missing)}) {_abbreviate(missing)}")
        with torch.no_grad():
            for key_id, key in keys.items():
                tensor = slots[key_id][0]
                stored = source.get(key)
                if stored.shape != tensor.shape:
                    raise WeightsError(
                        f"{key}: file shape {list(stored.shape)} vs model shape {list(tensor.shape)}"
                    )
                tensor.copy_(stored)
    return model


def _unique_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    seen: set[int] = set()
    for tensor in (*module.parameters(), *module.buffers()):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            yield tensor


def stage_nbytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers (each shared tensor once; works on meta too)."""
    return sum(t.numel() * t.element_size() for t in _unique_tensors(module))
