"""``aqsgd bench batching``: tokens per second and wire bytes per real token of instruction data laid out
three ways (``--batching max-length``, ``bucket``, ``pack``), in the local runtime and over an emulated link.

Each row is one training run of ``aqsgd train`` (a subprocess, one at a time) on the ``instruct`` task, whose
examples spread from a few to hundreds of tokens: the same examples, seed, model and compression for every
batching. The first epoch is the warm-up (uncompressed, AQ-SGD fills its cache), not timed; the figures are
over the ``epochs`` that follow, whole epochs, so that every batching processes the same examples:

* ``tokens_per_s``: the median over those epochs of (real tokens of the epoch / the epoch's step seconds);
* ``bytes_per_token``: boundary bytes (every boundary, both directions) / real tokens, over those epochs;
* ``pad_tokens_sent``: token positions sent across any boundary that were padding (the metrics count them);
* ``speedup``: ``tokens_per_s`` / that of ``max-length`` in the same runtime, measured in the same call.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["BatchingBenchConfig", "bench_batching", "summarize", "write_json"]


@dataclasses.dataclass
class BatchingBenchConfig:
    """What ``aqsgd bench batching`` runs (its options fill these fields)."""

    batchings: Sequence[str] = ("max-length", "bucket", "pack")
    runtimes: Sequence[str] = ("local", "distributed")
    task: str = "instruct"
    model: str = "smollm2"
    model_layers: int = 4  # throughput, not quality: a few of the model's blocks
    max_length: int = 512
    train_samples: int = 64
    stages: int = 2
    micro_batches: int = 4
    micro_batch_size: int = 4
    epochs: int = 3  # timed epochs after the warm-up epoch
    link: str = "100mbit,5ms"  # the distributed runs' emulated link
    forward: str | None = None  # None: aqsgd train's defaults
    backward: str | None = None
    seed: int = 0


def train_args(cfg: BatchingBenchConfig, batching: str, runtime: str, out: Path) -> list[str]:
    """The ``aqsgd train`` command line of one row."""
    args = ["--task", cfg.task, "--model", cfg.model, "--model-layers", str(cfg.model_layers),
            "--max-length", str(cfg.max_length), "--max-train-samples", str(cfg.train_samples),
            "--max-eval-samples", "8", "--stages", str(cfg.stages), "--micro-batches", str(cfg.micro_batches),
            "--micro-batch-size", str(cfg.micro_batch_size), "--epochs", str(1 + cfg.epochs),
            "--warmup-epochs", "1", "--batching", batching, "--runtime", runtime, "--eval-every", "0",
            "--checkpoint-every", "0", "--no-progress", "--no-tensorboard", "--seed", str(cfg.seed),
            "--output-dir", str(out), "--run-name", f"{batching}-{runtime}", "--overwrite"]
    if runtime == "distributed" and cfg.link:
        args += ["--link", cfg.link]
    for flag, value in (("--forward", cfg.forward), ("--backward", cfg.backward)):
        if value is not None:
            args += [flag, value]
    return args


def summarize(rows: list[dict[str, Any]], timed_epochs: int) -> dict[str, Any]:
    """The figures of one run from its metrics rows (``kind == "train"``): see the module docstring."""
    last = max(r["epoch"] for r in rows)
    timed = [r for r in rows if r["epoch"] > last - timed_epochs]
    per_epoch = []
    for epoch in sorted({r["epoch"] for r in timed}):
        these = [r for r in timed if r["epoch"] == epoch]
        per_epoch.append(sum(r["tokens"] for r in these) / sum(r["time"]["step"] for r in these))
    tokens = sum(r["tokens"] for r in timed)
    return {
        "tokens_per_s": statistics.median(per_epoch), "tokens_per_s_epochs": per_epoch,
        "bytes_per_token": sum(r["bytes_sent"] for r in timed) / tokens,
        "fp32_bytes_per_token": sum(r["raw_bytes"] for r in timed) / tokens,
        "pad_tokens_sent": sum(r["pad_tokens_sent"] for r in timed), "tokens": tokens,
        "steps": len(timed), "step_s_median": statistics.median(r["time"]["step"] for r in timed),
    }


def bench_batching(cfg: BatchingBenchConfig, *, progress: Callable[[str], None] = print,
                   out_dir: str | Path | None = None) -> list[dict[str, Any]]:
    """One row per (runtime, batching), each a training run; see the module docstring."""
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="aqsgd-bench-batching-") as tmp:
        out = Path(out_dir or tmp)
        for runtime in cfg.runtimes:
            for batching in cfg.batchings:
                progress(f"{runtime} {batching}: training {1 + cfg.epochs} epochs")
                cmd = [sys.executable, "-m", "aqsgd", "train", *train_args(cfg, batching, runtime, out)]
                done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
                if done.returncode != 0:
                    tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
                    raise RuntimeError(f"{runtime} {batching}: aqsgd train failed ({done.returncode}):"
                                       f"\n{tail}")
                metrics = out / f"{batching}-{runtime}" / "metrics.jsonl"
                lines = [json.loads(line) for line in metrics.read_text().splitlines()]
                row = {"runtime": runtime, "batching": batching,
                       **summarize([r for r in lines if r["kind"] == "train"], cfg.epochs)}
                rows.append(row)
                progress(f"  {row['tokens_per_s']:.0f} tokens/s, {row['bytes_per_token']:.0f} B/token, "
                         f"{row['pad_tokens_sent']:,} pad tokens sent")
    for r in rows:
        base = next((b for b in rows if b["runtime"] == r["runtime"] and b["batching"] == "max-length"), None)
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
    return rows


def write_json(rows: list[dict[str, Any]], path: str | Path, *, cfg: BatchingBenchConfig, command: str,
               machine: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"benchmark": "batching", "command": command, "machine": machine,
                                      "config": dataclasses.asdict(cfg), "rows": rows}, indent=1,
                                     default=list))
