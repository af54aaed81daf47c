"""``aqsgd bench pipeline``: training throughput of stage processes over links emulated in the transport
(:mod:`aqsgd.bench.pipeline`)."""

from __future__ import annotations

import argparse

import torch

from aqsgd.cli.bench.options import (add_options, columns, floats, ints, option, settings_from, wide_console,
                                     words)
from aqsgd.cli.options import positive_int

DESCRIPTION = ("Samples/s of real stage processes (PyTorch's elastic launcher, gloo) over links emulated in "
               "the transport, for each setting and bandwidth; speed-up vs fp32 next to the ideal speed-up "
               "and the efficiency of the speed model (the step the schedule allows, pipeline bubble "
               "included, from the measured compute time and bytes per micro-batch; docs/design.md).")


def _options() -> list:
    from aqsgd.bench.pipeline import PipelineBenchConfig
    from aqsgd.bench.settings import SETTINGS

    settings = PipelineBenchConfig().settings
    return [
        option("--stages", "stage counts (default: {default})", field="stages", type=ints),
        option("--bandwidths", "link bandwidths in Mbit/s (default: {default})", field="bandwidths_mbps",
               type=floats),
        option("--settings", f"settings to compare, from the named settings (default: {', '.join(settings)})",
               field="settings", nargs="+", choices=list(SETTINGS), metavar="SETTING"),
        option("--latency-ms", "one-way link latency (default: {default})", field="latency_ms", type=float),
        option("--hidden", "model width (default: {default})", field="hidden", type=positive_int),
        option("--layers", "transformer blocks (default: {default})", field="layers", type=positive_int),
        option("--seq-len", "tokens per sample (default: {default})", field="seq_len", type=positive_int),
        option("--micro-batch-size", "(default: {default})", field="microbatch_size", type=positive_int),
        option("--micro-batches", "(default: {default})", field="num_microbatches", type=positive_int),
        option("--measure-steps", "timed steps after the warm-up epoch (default: {default})",
               field="measure_steps", type=positive_int),
        option("--data-parallel", "replica counts; D > 1 runs stages x D processes (default: {default})",
               field="data_parallel", type=ints),
        option("--grad-syncs", "gradient syncs compared when D > 1, e.g. allreduce,q8,q4,powersgd:rank4 "
               "(default: {default})", field="grad_syncs", type=words),
        option("--json", "also write the rows as JSON to PATH", metavar="PATH", default=None),
    ]


def register(bench: argparse._SubParsersAction) -> None:
    from aqsgd.bench.pipeline import PipelineBenchConfig

    p = bench.add_parser("pipeline", help="training throughput of stage processes over emulated links",
                         description=DESCRIPTION)
    add_options(p, _options(), PipelineBenchConfig())
    p.set_defaults(func=run_pipeline)


def run_pipeline(args: argparse.Namespace) -> int:
    from aqsgd.bench.codecs import machine_description
    from aqsgd.bench.pipeline import PipelineBenchConfig, bench_pipeline, write_json

    cfg = settings_from(PipelineBenchConfig, args, _options())
    console = wide_console()
    machine = machine_description(torch.device("cpu"))
    console.print(f"[bold]pipeline throughput[/] on {machine}: Llama-style model, {cfg.layers} blocks x "
                  f"{cfg.hidden}, {cfg.seq_len} tokens, {cfg.num_microbatches} micro-batches of "
                  f"{cfg.microbatch_size}; median of {cfg.measure_steps} steps after an uncompressed warm-up "
                  f"epoch")
    rows = bench_pipeline(cfg, progress=lambda m: console.print(m))
    table = columns(("stages", "D", "grad sync", "Mbit/s", "setting", "samples/s", "speed-up", "ideal",
                     "efficiency", "vs pipeline-only", "fp32 comm:compute", "bytes/micro-batch"),
                    left=("setting", "grad sync"))
    for r in rows:
        vs = r.get("speedup_vs_pipeline_only")
        table.add_row(str(r["stages"]), str(r.get("data_parallel", 1)),
                      r.get("grad_sync", "-") if r.get("data_parallel", 1) > 1 else "-",
                      f"{r['bandwidth_mbps']:g}", r["setting"], f"{r['samples_per_s']:.1f}",
                      f"{r['speedup_vs_fp32']:.2f}x", f"{r['ideal_speedup']:.2f}x", f"{r['efficiency']:.2f}",
                      "-" if vs is None else f"{vs:.2f}x", f"{r['comm_compute_ratio']:.2f}",
                      f"{int(r['bytes_per_mb']):,}")
    console.print(table)
    if args.json:
        write_json(rows, args.json, cfg=cfg, command=args.command_line, machine=machine)
        console.print(f"wrote {args.json}")
    return 0
