"""What crosses the stage boundaries of a pretrained model: the tensors the codecs are measured on.

At the boundaries of an even split of a transformer's blocks into ``stages`` stages (after the last block of
every stage but the last), :func:`collect_boundary_tensors` records for one probe micro-batch

- ``activation``: the block's output ``a`` (what direct quantization sends forward),
- ``delta``: its change ``a1 - a0`` after AdamW steps on other batches (what AQ-SGD sends for a sample on its
  next visit),
- ``gradient``: the loss gradient with respect to ``a`` (what the backward direction sends).

Used by ``python -m benchmarks.boundary_errors`` and ``aqsgd bench codecs --quality --data minilm|smollm2``;
:func:`source_boundary_tensors` loads the offline SmolLM2 or MiniLM model with BBC News text for the latter.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from aqsgd.errors import SpecError

__all__ = ["KINDS", "PRESETS", "BoundaryPreset", "BoundaryTensors", "collect_boundary_tensors",
           "require_sources", "source_boundary_tensors", "transformer_blocks"]

KINDS = ("activation", "delta", "gradient")


@dataclass
class BoundaryTensors:
    """``tensors[kind]``: one ``(batch, seq, hidden)`` tensor per boundary, in the order of ``boundaries``
    (the index of the last block before each boundary)."""

    boundaries: list[int]
    tensors: dict[str, list[torch.Tensor]]
    info: dict = field(default_factory=dict)  # how they were made (model, data, steps, ...)


def transformer_blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's stack of ``config.num_hidden_layers`` blocks (Llama ``model.layers``, BERT
    ``bert.encoder.layer``, ...): its first ``ModuleList`` of that length."""
    n = model.config.num_hidden_layers
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) == n:
            return m
    raise SpecError(f"{type(model).__name__}: no list of {n} blocks to split at")


def collect_boundary_tensors(model: torch.nn.Module, probe: Mapping[str, torch.Tensor],
                             batches: Iterable[Mapping[str, torch.Tensor]], *, stages: int = 4,
                             lr: float = 5e-5, progress: bool = True) -> BoundaryTensors:
    """Activation, delta and gradient at the boundaries of an even ``stages``-way split of ``model``.

    ``probe`` and every batch are model inputs with ``labels`` (the model returns ``.loss``). The probe's
    activations and gradients are taken in eval mode (no dropout: the change measured is the weights'); then
    one AdamW step (lr ``lr``, weight decay 0.01, gradients clipped to norm 1) per batch in train mode, and
    the probe's activations again. Changes ``model``'s weights.
    """
    from aqsgd.pipeline.partition import even_counts

    blocks = transformer_blocks(model)
    counts = even_counts(len(blocks), stages)
    boundaries = [sum(counts[: i + 1]) - 1 for i in range(stages - 1)]
    captured: dict[int, torch.Tensor] = {}
    grads: dict[int, torch.Tensor] = {}

    def hook(i: int):
        def f(_module, _inputs, out):
            h = out[0] if isinstance(out, tuple) else out
            captured[i] = h.detach().clone()
            if h.requires_grad:
                h.register_hook(lambda g: grads.__setitem__(i, g.detach().clone()))
        return f

    handles = [blocks[i].register_forward_hook(hook(i)) for i in boundaries]
    try:
        model.eval()
        model(**probe).loss.backward()
        a0, g0 = dict(captured), dict(grads)
        model.zero_grad()
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        batches = list(batches)
        for step, batch in enumerate(batches):
            model(**batch).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            if progress:
                print(f"\rAdamW step {step + 1}/{len(batches)}", end="", file=sys.stderr, flush=True)
        if progress and batches:
            print(file=sys.stderr)
        model.eval()
        with torch.no_grad():
            model(**probe)
    finally:
        for h in handles:
            h.remove()
    return BoundaryTensors(boundaries, {"activation": [a0[i] for i in boundaries],
                                        "delta": [captured[i] - a0[i] for i in boundaries],
                                        "gradient": [g0[i] for i in boundaries]})


@dataclass(frozen=True)
class BoundaryPreset:
    """How :func:`source_boundary_tensors` probes one offline model: the reduced convergence study's sizes,
    and one epoch of it (``steps`` x ``batch`` samples at the study's learning rate) between the two
    activations."""

    description: str
    seq_len: int
    micro_batch: int
    steps: int
    batch: int
    lr: float
    stages: int = 4


PRESETS = {
    "minilm": BoundaryPreset("all-MiniLM-L6-v2 + seeded 5-class head, BBC News classification", seq_len=64,
                             micro_batch=8, steps=12, batch=32, lr=2e-4),
    "smollm2": BoundaryPreset("SmolLM2-135M causal LM on BBC News text", seq_len=32, micro_batch=4, steps=32,
                              batch=8, lr=5e-5),
}


def require_sources(source: str) -> tuple[Path, Path]:
    """The cached folders of model ``source`` and of the BBC News data; no download from here.

    Raises:
        SpecError: not a model of :data:`PRESETS`.
        DataSourceError: one of them is not prepared (one line naming ``aqsgd data prepare NAME``).
    """
    from aqsgd.data import require

    if source not in PRESETS:
        raise SpecError(f"unknown boundary-tensor source {source!r}; known: {', '.join(PRESETS)}")
    return require(source, auto_prepare=False), require("bbc", auto_prepare=False)


def _load(source: str, preset: BoundaryPreset, seed: int):
    """``(model, samples)`` for ``source`` from the offline cache: ``micro_batch + steps * batch`` samples."""
    import transformers

    from aqsgd.data.datasets import lm_chunks, load_task, load_tokenizer, read_bbc

    folder, bbc = require_sources(source)
    n = preset.micro_batch + preset.steps * preset.batch
    if source == "minilm":
        ds = load_task("bbc", "train", max_length=preset.seq_len, max_samples=n, seed=seed)
        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()  # not the seeded head's "newly initialized" notice
        try:
            model = transformers.AutoModelForSequenceClassification.from_pretrained(
                folder, num_labels=ds.info["num_labels"], dtype=torch.float32)
        finally:
            transformers.logging.set_verbosity(verbosity)
    else:  # the texts in a seeded order, so that the chunks are not all from one class
        texts = read_bbc(bbc)[0]
        order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(seed)).tolist()
        tok = load_tokenizer(str(folder))
        ds = lm_chunks([texts[i] for i in order], tok, preset.seq_len, max_chunks=n)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model, [ds[i] for i in range(len(ds))]


def source_boundary_tensors(source: str, *, seed: int = 0, device: str | torch.device = "cpu",
                            progress: bool = True) -> BoundaryTensors:
    """Boundary tensors of the offline model ``source`` (``minilm`` or ``smollm2``, see :data:`PRESETS`).

    Raises:
        DataSourceError: the model or the BBC data are not in the cache (the message names the command).
    """
    from aqsgd.data.datasets import collate

    require_sources(source)
    p = PRESETS[source]
    torch.manual_seed(seed)  # the classification head, dropout
    model, samples = _load(source, p, seed)
    device = torch.device(device)
    model.to(device)
    keys = ("input_ids", "attention_mask", "token_type_ids", "labels")

    def batch(items: list[dict]) -> dict[str, torch.Tensor]:
        b = collate(items)
        return {k: b[k].to(device) for k in keys if k in b}

    probe = batch(samples[: p.micro_batch])
    rest = samples[p.micro_batch:]
    steps = [batch(rest[i * p.batch: (i + 1) * p.batch]) for i in range(min(p.steps, len(rest) // p.batch))]
    out = collect_boundary_tensors(model, probe, steps, stages=p.stages, lr=p.lr, progress=progress)
    out.info = {"source": source, "model": p.description, "text": "BBC News", "stages": p.stages,
                "seq_len": p.seq_len, "micro_batch": p.micro_batch, "steps": len(steps), "batch": p.batch,
                "lr": p.lr, "seed": seed, "boundaries": out.boundaries,
                "shape": list(out.tensors["activation"][0].shape)}
    return out
