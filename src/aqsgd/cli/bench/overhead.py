"""``aqsgd bench overhead``: the local pipeline's step time next to a plain transformers loop
(:mod:`aqsgd.bench.overhead`)."""

from __future__ import annotations

import argparse

import torch
from rich.console import Console

from aqsgd.cli.bench.options import add_options, columns, ints, option, settings_from
from aqsgd.cli.options import positive_int
from aqsgd.errors import SpecError

DESCRIPTION = ("Step time of a plain transformers training loop and of aqsgd's local pipeline (uncompressed) "
               "at each stage count, on the same Qwen2-style model (random, from one seed), the same "
               "micro-batches, AdamW and clipping, the same autocast; interleaved rounds, medians, warm-up "
               "excluded. The ratio is the plain loop's step time over the pipeline's (1.0: no overhead). "
               "Runs on the CPU or a GPU.")

_SIZES = (("hidden", "hidden", "model width"), ("layers", "layers", "transformer blocks"),
          ("heads", "heads", "attention heads"), ("kv-heads", "kv_heads", "key/value heads"),
          ("intermediate", "intermediate", "MLP width"), ("vocab", "vocab", "vocabulary"),
          ("seq-len", "seq_len", "tokens per sample"),
          ("micro-batch-size", "microbatch_size", "samples per micro-batch"),
          ("micro-batches", "num_microbatches", "micro-batches per step"),
          ("steps", "steps", "timed steps per system and round"), ("rounds", "rounds", "timed rounds"))
"""The model's and the measurement's sizes: (option, settings field, what it is)."""

OPTIONS = [
    option("--stages", "stage counts (default: {default})", field="stages", type=ints),
    *(option(f"--{flag}", f"{what} (default: {{default}})", field=name, type=positive_int)
      for flag, name, what in _SIZES),
    option("--device", "auto (CUDA when available), cpu or cuda (default: {default})", field="device",
           choices=("auto", "cpu", "cuda")),
    option("--dtype", "auto: bf16 autocast on a GPU that has it, else fp32 (default: {default})",
           field="dtype", choices=("auto", "fp32", "bf16")),
    option("--threads", "torch CPU threads (default: torch's)", type=positive_int, default=None),
    option("--json", "also write the result as JSON to PATH", metavar="PATH", default=None),
]


def register(bench: argparse._SubParsersAction) -> None:
    from aqsgd.bench.overhead import OverheadConfig

    p = bench.add_parser("overhead", help="the local pipeline's step time next to a plain transformers loop",
                         description=DESCRIPTION)
    add_options(p, OPTIONS, OverheadConfig())
    p.set_defaults(func=run_overhead)


def run_overhead(args: argparse.Namespace) -> int:
    from aqsgd.bench.codecs import machine_description
    from aqsgd.bench.overhead import OverheadConfig, bench_overhead, write_json
    from aqsgd.comm.device import resolve_device

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = settings_from(OverheadConfig, args, OPTIONS)
    if min(cfg.stages) < 1 or max(cfg.stages) > cfg.layers:
        raise SpecError(f"--stages {','.join(map(str, cfg.stages))}: each must be in 1..--layers "
                        f"({cfg.layers})")
    machine = machine_description(resolve_device(cfg.device))
    console = Console()
    console.print(f"[bold]local pipeline vs a plain transformers loop[/] on {machine}: Qwen2-style, "
                  f"{cfg.layers} blocks x {cfg.hidden}, {cfg.num_microbatches} micro-batches of "
                  f"{cfg.microbatch_size} x {cfg.seq_len} tokens; median of {cfg.rounds} interleaved rounds "
                  f"of {cfg.steps} steps")
    result = bench_overhead(cfg, progress=lambda m: console.print(m))
    table = columns(("system", "stages", "step ms", "samples/s", "ratio (plain / this)", "first-step loss"),
                    left=("system",), title=f"{result['parameters'] / 1e6:.1f} M parameters, "
                    f"{result['dtype']}, {result['device']}")
    for r in result["rows"]:
        table.add_row(r["system"], "" if r["stages"] is None else str(r["stages"]),
                      f"{1e3 * r['step_s']:.1f}", f"{r['samples_per_s']:.1f}", f"{r['ratio']:.3f}",
                      f"{r['first_loss']:.6f}")
    console.print(table)
    if args.json:
        write_json(result, args.json, cfg=cfg, command=args.command_line, machine=machine)
        console.print(f"wrote {args.json}")
    return 0
