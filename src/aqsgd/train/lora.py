"""LoRA through the compressed pipeline: adapters injected with ``peft`` into each stage.

Every stage holds only its own layers, so every stage gets only its own layers' adapters:
:func:`add_adapters` injects LoRA layers (``peft.inject_adapter_in_model``) into each stage module it is given
and freezes everything but the adapters and a classifier's head. The adapters of stage ``s`` are drawn from a
generator seeded by ``(seed, s)`` alone, so the local runtime (all stages in one process) and the distributed
one (a stage per process) start from the same adapters, and so does ``aqsgd export``, which cuts the full
model into the same stages (the run's :class:`~aqsgd.pipeline.partition.StageCut`) before injecting them.
The run's adapter settings travel as one :class:`LoraSettings`.

Nothing else in the pipeline needs to know: the optimizer, the gradient norm, the data-parallel sync and the
tied-parameter sync take trainable parameters only, and a checkpoint holds only the trainable tensors (the
frozen base comes from the model's own weights on resume). The activations and gradients that cross a stage
boundary are the same kind of tensors as in full fine-tuning, so AQ-SGD and every scheme work unchanged.

Targets: ``--lora-targets`` names them; by default the attention projections the model's family declares
(:attr:`~aqsgd.models.family.ModelFamily.lora_targets`: ``q_proj``/``k_proj``/``v_proj``/``o_proj`` of
the decoders, ``c_attn``/``c_proj`` of GPT-2, ``query_key_value``/``dense`` of GPT-NeoX,
``query``/``key``/``value`` of BERT and RoBERTa and so on): the choice of the LoRA paper (Hu et al., 2021),
which adapted the attention weights. A model of no known family is searched for linear layers named like
any family's projections.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from aqsgd.errors import SpecError

if TYPE_CHECKING:
    from aqsgd.train.config import ModelSection

__all__ = ["HEAD_NAMES", "LoraSettings", "add_adapters", "adapter_targets", "is_trainable", "lora_config",
           "merged", "peft_model"]

log = logging.getLogger(__name__)

# For a model of no known family: the attention projections of the families' naming schemes (decoders, phi3,
# gpt2, gpt-neox, bert/roberta, deberta-v2, distilbert); a known family declares its own (ModelFamily).
ATTENTION_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "c_attn", "query_key_value", "query",
                   "key", "value", "query_proj", "key_proj", "value_proj", "q_lin", "k_lin", "v_lin")
# GPT-2's c_proj and GPT-NeoX's dense are the attention outputs only inside the attention module
_ATTENTION_OUTPUTS = {"c_proj": "attn", "dense": "attention"}
# a sequence classifier's new head: trained whole (peft's modules_to_save for sequence classification)
HEAD_NAMES = ("classifier", "score")


def _names(targets: str | None) -> tuple[str, ...] | None:
    """``--lora-targets`` (comma-separated) as names; None: the family's default."""
    return None if targets is None else tuple(t.strip() for t in targets.split(",") if t.strip())


@dataclass(frozen=True)
class LoraSettings:
    """A run's adapter settings: rank, alpha (the update is scaled by ``alpha / rank``), dropout on the
    adapters' input and the layers adapted (``targets``: None for the family's attention projections)."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...] | None = None

    @classmethod
    def of(cls, model: ModelSection) -> LoraSettings:
        """The settings of a run's model section."""
        return cls(rank=model.lora_rank, alpha=model.lora_alpha, dropout=model.lora_dropout,
                   targets=_names(model.lora_targets))

    @classmethod
    def from_flat(cls, settings: Mapping[str, Any]) -> LoraSettings:
        """The settings of a saved run from its flat config (a checkpoint's); an option the config lacks
        (written before the option existed) takes the model section's default."""
        from aqsgd.train.config import ModelSection

        default = ModelSection()
        return cls(rank=int(settings.get("lora_rank", default.lora_rank)),
                   alpha=float(settings.get("lora_alpha", default.lora_alpha)),
                   dropout=float(settings.get("lora_dropout", default.lora_dropout)),
                   targets=_names(settings.get("lora_targets", default.lora_targets)))


def _linear_like(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"  # GPT-2's transposed linear


def _family_targets(model: nn.Module) -> tuple[str, ...] | None:
    """The layers ``model``'s family adapts by default, or None for a model of no known family."""
    from aqsgd.models.registry import family_of_model

    try:
        return family_of_model(model).lora_targets
    except ValueError:  # no family recognises it
        return None


def _searched_targets(model: nn.Module, names: Iterable[str]) -> list[str]:
    """The attention projections of a model of no known family, found by their names (``names``: the last
    components of its linear layers' names)."""
    found = [n for n in ATTENTION_NAMES if n in names]
    for name, parent in _ATTENTION_OUTPUTS.items():
        if any(full.endswith(f"{parent}.{name}") for full, m in model.named_modules() if _linear_like(m)):
            found.append(name)
    return found


def adapter_targets(model: nn.Module, targets: Sequence[str] | None) -> list[str]:
    """The module names (last components) that get adapters: ``targets`` (each must name a linear layer of
    ``model``) or the attention projections of ``model``'s family that it holds (a model of no known family:
    its layers named like any family's projections)."""
    names: dict[str, str] = {}  # last component -> a full name, for messages
    for full, module in model.named_modules():
        if _linear_like(module) and full:
            names.setdefault(full.rsplit(".", 1)[-1], full)
    if targets is not None:
        wanted = list(targets)
        unknown = [t for t in wanted if t not in names]
        if unknown:
            raise SpecError(f"--lora-targets: no linear layer called {', '.join(unknown)} in the model; its "
                            f"linear layers are {', '.join(sorted(names))}")
        return wanted
    declared = _family_targets(model)
    found = _searched_targets(model, names) if declared is None else [n for n in declared if n in names]
    if not found:
        raise SpecError(f"--lora: no attention projections found in {type(model).__name__}; name the layers "
                        f"to adapt with --lora-targets (its linear layers: {', '.join(sorted(names))})")
    return found


def _check_rank(model: nn.Module, targets: list[str], rank: int) -> None:
    """A rank above a targeted layer's smaller dimension adds parameters without adding rank (the update of
    an ``n x m`` layer has rank at most ``min(n, m)``) and costs memory and time for nothing: refused, naming
    the largest rank that fits. Shapes only (works on a model on the meta device)."""
    smallest: tuple[int, str] | None = None
    for name, module in model.named_modules():
        if not (_linear_like(module) and name and name.rsplit(".", 1)[-1] in targets):
            continue
        weight = getattr(module, "weight", None)
        if weight is None:
            continue
        dims = min(weight.shape[0], weight.shape[1])
        if smallest is None or dims < smallest[0]:
            smallest = (dims, f"{name}: {weight.shape[0]} x {weight.shape[1]}")
    if smallest is not None and rank > smallest[0]:
        raise SpecError(f"--lora-rank {rank}: larger than the smallest layer it adapts ({smallest[1]}); a "
                        f"rank above {smallest[0]} adds no rank, only memory: use at most {smallest[0]}")


def lora_config(lora: LoraSettings, targets: list[str]) -> Any:
    """The ``peft.LoraConfig`` of a run's adapters on the layers ``targets``."""
    from peft import LoraConfig

    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                      bias="none")


def is_trainable(name: str) -> bool:
    """Whether a parameter of a LoRA run is trained: an adapter's, or one of a classifier head's."""
    parts = name.split(".")
    return any(p.startswith("lora_") for p in parts) or any(p in HEAD_NAMES for p in parts)


def _inject(module: nn.Module, lora: LoraSettings, targets: list[str], seed: int) -> None:
    """Adapters into ``module`` (those of ``targets`` it holds), drawn from a generator seeded by ``seed``."""
    from peft import inject_adapter_in_model

    present = {n.rsplit(".", 1)[-1] for n, m in module.named_modules() if _linear_like(m) and n}
    mine = [t for t in targets if t in present]
    if mine:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            # one stage's modules only: peft names no model type it would look the defaults up by
            inject_adapter_in_model(lora_config(lora, mine), module)
    for name, p in module.named_parameters():
        p.requires_grad_(is_trainable(name))


def add_adapters(stages: nn.Module | Sequence[nn.Module], lora: LoraSettings, *, model: nn.Module, seed: int,
                 first_stage: int = 0) -> list[str]:
    """Inject a run's adapters into each stage of ``stages`` (one stage module, or consecutive stages: stage
    ``first_stage + i``; the run's :class:`~aqsgd.pipeline.partition.StageCut` of ``model``) and freeze the
    rest; returns the target names. ``model``: the full model (its family, and its layers, choose the
    targets; the meta device will do); ``seed``: the run's seed, which with the stage index seeds each
    stage's adapters."""
    parts = [stages] if isinstance(stages, nn.Module) else list(stages)
    targets = adapter_targets(model, lora.targets)
    _check_rank(model, targets, lora.rank)
    for i, part in enumerate(parts):
        stage = first_stage + i
        _inject(part, lora, targets, (seed * 1_000_003 + 7919 * (stage + 1)) % 2**63)
        if not any(p.requires_grad for p in part.parameters()):
            raise SpecError(f"--lora-targets: stage {stage} holds none of {', '.join(targets)}, so it would "
                            "train nothing; name layers every stage holds")
    return targets


def _base_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state dict with every LoRA layer merged into its base layer, named as without adapters."""
    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if isinstance(module, LoraLayer):
            module.merge()
    out = {}
    for key, value in model.state_dict().items():
        if ".lora_" in key:
            continue
        out[key.replace(".base_layer.", ".")] = value
    return out


def merged(model: nn.Module, fresh: nn.Module) -> nn.Module:
    """``fresh`` (the same architecture, without adapters) holding ``model``'s weights with the adapters
    merged in."""
    fresh.load_state_dict(_base_state(model), strict=True)
    return fresh


def peft_model(model: nn.Module, base: nn.Module, lora: LoraSettings, targets: Iterable[str]) -> Any:
    """A ``peft.PeftModel`` over ``base`` (the untrained base model) carrying ``model``'s trained adapters and
    head (``lora``: the run's settings, ``targets``: the layers they adapt): what
    ``PeftModel.save_pretrained`` writes as an adapter folder."""
    from peft import get_peft_model

    config = lora_config(lora, list(targets))
    heads = sorted({n.split(".")[-1] for n, _ in base.named_modules() if n.split(".")[-1] in HEAD_NAMES})
    if heads:
        config.modules_to_save = heads
    wrapped = get_peft_model(base, config)
    trained = dict(model.named_parameters())
    copied = 0
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if not p.requires_grad:
                continue
            key = name.removeprefix("base_model.model.").replace(".modules_to_save.default.", ".")
            if key not in trained:
                raise SpecError(f"the adapter's {name} has no trained counterpart ({key})")
            p.copy_(trained[key])
            copied += 1
    log.debug("adapter: %d trained tensors", copied)
    return wrapped
