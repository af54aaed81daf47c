"""``aqsgd bench batching``: instruction data padded to --max-length, bucketed and packed, side by side
(:mod:`aqsgd.bench.batching`)."""

from __future__ import annotations

import argparse

import torch

from aqsgd.cli.bench.options import add_options, columns, option, settings_from, wide_console, words
from aqsgd.cli.options import positive_int

DESCRIPTION = ("Tokens per second and wire bytes per real token of the instruct task (examples of a few to "
               "hundreds of tokens) with each --batching: every example padded to --max-length, length "
               "buckets (each micro-batch padded to its own longest; only real tokens cross a boundary), "
               "packed rows. One aqsgd train run per row, one at a time; whole epochs after the warm-up "
               "epoch, median over epochs; speed-up against max-length in the same runtime and call.")


def _options() -> list:
    return [
        option("--batchings", "batchings compared (default: {default})", field="batchings", type=words),
        option("--runtimes", "local and/or distributed (default: {default})", field="runtimes", type=words),
        option("--task", "(default: {default})", field="task"),
        option("--model", "(default: {default})", field="model"),
        option("--model-layers", "blocks of the model kept (default: {default})", field="model_layers",
               type=positive_int),
        option("--max-length", "tokens an example is cut to (default: {default})", field="max_length",
               type=positive_int),
        option("--train-samples", "training examples (default: {default})", field="train_samples",
               type=positive_int),
        option("--stages", "(default: {default})", field="stages", type=positive_int),
        option("--micro-batches", "(default: {default})", field="micro_batches", type=positive_int),
        option("--micro-batch-size", "(default: {default})", field="micro_batch_size", type=positive_int),
        option("--epochs", "timed epochs after the warm-up epoch (default: {default})", field="epochs",
               type=positive_int),
        option("--link", "the distributed runs' emulated link, as aqsgd train --link (default: {default})",
               field="link"),
        option("--forward", "forward setting (default: aqsgd train's)", field="forward"),
        option("--backward", "backward setting (default: aqsgd train's)", field="backward"),
        option("--json", "also write the rows as JSON to PATH", metavar="PATH", default=None),
    ]


def register(bench: argparse._SubParsersAction) -> None:
    from aqsgd.bench.batching import BatchingBenchConfig

    p = bench.add_parser("batching", description=DESCRIPTION,
                         help="instruction data padded, bucketed and packed: tokens/s, bytes per token")
    add_options(p, _options(), BatchingBenchConfig())
    p.set_defaults(func=run_batching)


def run_batching(args: argparse.Namespace) -> int:
    from aqsgd.bench.batching import BatchingBenchConfig, bench_batching, write_json
    from aqsgd.bench.codecs import machine_description

    cfg = settings_from(BatchingBenchConfig, args, _options())
    console = wide_console()
    machine = machine_description(torch.device("cpu"))
    console.print(f"[bold]batching[/] on {machine}: {cfg.task}, {cfg.model} ({cfg.model_layers} blocks), "
                  f"{cfg.train_samples} examples up to {cfg.max_length} tokens, {cfg.stages} stages, "
                  f"{cfg.micro_batches} micro-batches of {cfg.micro_batch_size}; {cfg.epochs} timed epochs "
                  f"after the warm-up")
    rows = bench_batching(cfg, progress=lambda m: console.print(m))
    table = columns(("runtime", "batching", "tokens/s", "speed-up", "bytes/token", "fp32 bytes/token",
                     "pad tokens sent", "step s (median)"), left=("runtime", "batching"))
    for r in rows:
        table.add_row(r["runtime"], r["batching"], f"{r['tokens_per_s']:.0f}", f"{r['speedup']:.2f}x",
                      f"{r['bytes_per_token']:,.0f}", f"{r['fp32_bytes_per_token']:,.0f}",
                      f"{r['pad_tokens_sent']:,}", f"{r['step_s_median']:.2f}")
    console.print(table)
    if args.json:
        write_json(rows, args.json, cfg=cfg, command=args.command_line, machine=machine)
        console.print(f"wrote {args.json}")
    return 0
