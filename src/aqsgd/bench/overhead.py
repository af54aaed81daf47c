"""``aqsgd bench overhead``: what the local pipeline costs per step next to a plain transformers training
loop.

Three systems train the same Qwen2-style model (a random one of the configured size, built once with a fixed
seed and copied, so every system starts from the same weights) on the same micro-batches:

* ``plain``: the model as transformers builds it; per step ``zero_grad``, forward and backward of every
  micro-batch (loss scaled by 1/M) under the same autocast, ``clip_grad_norm_(1.0)``, AdamW (PyTorch's
  default implementation for the device), and the mean loss read once;
* ``aqsgd`` at each stage count S: the model cut into S stages by
  :func:`~aqsgd.pipeline.partition.partition_model`, run by the local runtime's
  :class:`~aqsgd.train.engine.PipelineEngine` exactly as ``aqsgd train --runtime local --forward none
  --backward none`` runs it (1F1B schedule, global-norm clipping across stages, AdamW per stage, the loss read
  once per step, an attention mask of ones left out on the host as the trainer does); the plain loop gets
  the micro-batches as a data collator makes them, the mask included.

Timing: one untimed warm-up round, then ``rounds`` rounds in which every system runs ``steps`` steps in turn
(the order rotated every round, so that drifting load hits all alike), each timed between device
synchronisations; the reported step time is the median over the rounds of the mean step of a round. ``ratio``
is plain step time over aqsgd step time (1.0: no overhead; above 1: faster than the plain loop). The first
step's loss of every system is recorded (the same weights and data: equal up to the order of floating-point
sums).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aqsgd.bench.timing import sync

__all__ = ["OverheadConfig", "bench_overhead", "write_json"]


@dataclasses.dataclass
class OverheadConfig:
    stages: Sequence[int] = (1, 4)
    hidden: int = 256
    layers: int = 8
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 688
    vocab: int = 4096
    seq_len: int = 128
    microbatch_size: int = 4
    num_microbatches: int = 4
    steps: int = 2  # timed steps per system and round
    rounds: int = 5  # timed rounds (after one untimed warm-up round)
    device: str = "auto"
    dtype: str = "auto"  # auto: bf16 autocast on a GPU with bf16, else fp32
    seed: int = 0

    def model_config(self) -> dict[str, Any]:
        return {"model_type": "qwen2", "num_hidden_layers": self.layers, "hidden_size": self.hidden,
                "intermediate_size": self.intermediate, "num_attention_heads": self.heads,
                "num_key_value_heads": self.kv_heads, "vocab_size": self.vocab,
                "max_position_embeddings": max(self.seq_len, 64), "tie_word_embeddings": True,
                "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


class _Plain:
    """The model trained as a plain transformers loop would train it."""

    name = "plain"

    def __init__(self, model: nn.Module, device: torch.device, autocast: torch.dtype | None) -> None:
        self.model, self.device, self.autocast = model.to(device), device, autocast
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=1e-4, weight_decay=0.01)

    def batches(self, host: Sequence[dict[str, torch.Tensor]],
                device: torch.device) -> list[dict[str, torch.Tensor]]:
        """The micro-batches as a plain loop passes them: every column, moved to the device."""
        return [{k: v.to(device) for k, v in mb.items()} for mb in host]

    def step(self, microbatches: Sequence[dict[str, torch.Tensor]]) -> float:
        self.opt.zero_grad(set_to_none=True)
        losses = []
        for mb in microbatches:
            with torch.autocast(self.device.type, dtype=self.autocast or torch.bfloat16,
                                enabled=self.autocast is not None):
                loss = self.model(**mb).loss / len(microbatches)
            loss.backward()
            losses.append(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        return float(torch.stack(losses).sum())


class _Pipeline:
    """The same model cut into stages and trained by aqsgd's local runtime."""

    def __init__(self, model: nn.Module, stages: int, device: torch.device,
                 autocast: torch.dtype | None) -> None:
        from aqsgd.pipeline.compression import CompressionConfig
        from aqsgd.pipeline.partition import partition_model
        from aqsgd.train.engine import OptimConfig, PipelineEngine

        self.name = f"aqsgd {stages}"
        parts = [s.to(device) for s in partition_model(model.to(device), stages)]
        self.engine = PipelineEngine(dict(enumerate(parts)), stages, CompressionConfig.simple(),
                                     OptimConfig("adamw", 1e-4, 0.01, 0, 0, 1.0), device=device,
                                     autocast=autocast)

    def step(self, microbatches: Sequence[dict[str, torch.Tensor]]) -> float:
        loss = self.engine.train_step(list(microbatches))
        assert loss is not None
        return loss

    def batches(self, host: Sequence[dict[str, torch.Tensor]],
                device: torch.device) -> list[dict[str, torch.Tensor]]:
        """The micro-batches as the trainer hands them to the engine (a mask of ones left out on the host)."""
        from aqsgd.train.feed import without_full_mask

        return [{k: v.to(device) for k, v in without_full_mask(mb).items()} for mb in host]


def _timed_rounds(systems: Sequence[Any], host: Sequence[dict[str, torch.Tensor]], cfg: OverheadConfig,
                  device: torch.device, progress: Callable[[str], None] | None
                  ) -> tuple[dict[str, float], dict[str, float]]:
    first: dict[str, float] = {}
    times: dict[str, list[float]] = {s.name: [] for s in systems}
    batches = {s.name: s.batches(host, device) for s in systems}
    for rnd in range(cfg.rounds + 1):
        shift = rnd % len(systems)
        for s in [*systems[shift:], *systems[:shift]]:
            sync(device)
            t0 = time.perf_counter()
            for _ in range(cfg.steps):
                loss = s.step(batches[s.name])
                first.setdefault(s.name, loss)
            sync(device)
            if rnd > 0:  # round 0 warms up (allocator, kernels, autotuning)
                times[s.name].append((time.perf_counter() - t0) / cfg.steps)
        if progress is not None and rnd > 0:
            progress(f"round {rnd}/{cfg.rounds}: "
                     + ", ".join(f"{k} {1e3 * v[-1]:.1f} ms" for k, v in times.items()))
    return {k: statistics.median(v) for k, v in times.items()}, first


def bench_overhead(cfg: OverheadConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Step times of the plain loop and of the local pipeline at every stage count, and the ratios (module
    docstring)."""
    from aqsgd.comm.device import resolve_device
    from aqsgd.pipeline.materialize import ModelRecipe
    from aqsgd.train.build import compute_dtype

    device = resolve_device(cfg.device)
    autocast = torch.bfloat16 if compute_dtype(cfg.dtype, device) == "bf16" else None
    torch.manual_seed(cfg.seed)
    model = ModelRecipe("qwen2", cfg.model_config()).build("cpu")
    params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    ids = torch.randint(3, cfg.vocab, (cfg.num_microbatches, cfg.microbatch_size, cfg.seq_len), generator=gen)
    host = [{"input_ids": x, "labels": x, "attention_mask": torch.ones_like(x)} for x in ids]  # LM chunks
    systems: list[Any] = [_Plain(copy.deepcopy(model), device, autocast)]
    systems += [_Pipeline(copy.deepcopy(model), s, device, autocast) for s in cfg.stages]
    del model
    medians, first = _timed_rounds(systems, host, cfg, device, progress)
    samples = cfg.num_microbatches * cfg.microbatch_size
    rows = [{"system": "plain", "stages": None, "step_s": medians["plain"],
             "samples_per_s": samples / medians["plain"], "first_loss": first["plain"], "ratio": 1.0}]
    for s in cfg.stages:
        t = medians[f"aqsgd {s}"]
        rows.append({"system": "aqsgd", "stages": s, "step_s": t, "samples_per_s": samples / t,
                     "first_loss": first[f"aqsgd {s}"], "ratio": medians["plain"] / t})
    return {"device": str(device), "dtype": "bf16" if autocast is not None else "fp32", "parameters": params,
            "rows": rows, "ratio": {str(r["stages"]): r["ratio"] for r in rows[1:]}}


def write_json(result: dict[str, Any], path: str | Path, *, cfg: OverheadConfig, command: str,
               machine: str) -> None:
    import transformers

    out = {"benchmark": "overhead", "command": command, "machine": machine,
           "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
           "config": dataclasses.asdict(cfg), **result}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1, default=list))
