"""``aqsgd bench vs-torch``: the uncompressed pipeline against ``torch.distributed.pipelining`` on the same
stages (:mod:`aqsgd.bench.vs_torch`)."""

from __future__ import annotations

import argparse
import dataclasses

import torch
from rich.console import Console
from rich.table import Table

from aqsgd.cli.bench.options import add_options, columns, ints, option, settings_from, wide_console, words
from aqsgd.cli.options import positive_int
from aqsgd.errors import SpecError

DESCRIPTION = ("Samples/s of aqsgd's uncompressed pipeline and of PyTorch's PipelineStage with ScheduleGPipe "
               "and Schedule1F1B on the same stage modules and weights (tiny Llama, fp32, gloo on loopback, "
               "one thread per process, AdamW with clipping; interleaved rounds, medians, first-step losses "
               "checked equal), then one message's hand-over and ping-pong latency, aqsgd transport vs "
               "dist.send/recv.")


def _options() -> list:
    from aqsgd.bench.vs_torch import LatencyConfig

    return [
        option("--stages", "stage counts (default: {default})", field="stages", type=ints),
        option("--schedules", "gpipe and/or 1f1b (default: {default})", field="schedules", type=words),
        option("--hidden", "model width (default: {default})", field="hidden", type=positive_int),
        option("--layers", "transformer blocks (default: {default})", field="layers", type=positive_int),
        option("--seq-len", "tokens per sample (default: {default})", field="seq_len", type=positive_int),
        option("--micro-batch-size", "(default: {default})", field="microbatch_size", type=positive_int),
        option("--micro-batches", "(default: {default})", field="num_microbatches", type=positive_int),
        option("--steps", "timed steps per round (default: {default})", field="steps", type=positive_int),
        option("--repeats", "timed rounds (default: {default})", field="repeats", type=positive_int),
        option("--latency-repeats", "messages per size and round in the latency test; 0 skips it (default: "
               "{default})", type=int, default=LatencyConfig().repeats),
        option("--json", "also write the rows as JSON to PATH", metavar="PATH", default=None),
    ]


def register(bench: argparse._SubParsersAction) -> None:
    from aqsgd.bench.vs_torch import VsTorchConfig

    p = bench.add_parser("vs-torch", description=DESCRIPTION,
                         help="uncompressed pipeline vs torch.distributed.pipelining, same stages")
    add_options(p, _options(), VsTorchConfig())
    p.set_defaults(func=run_vs_torch)


def run_vs_torch(args: argparse.Namespace) -> int:
    from aqsgd.bench.codecs import machine_description
    from aqsgd.bench.vs_torch import VsTorchConfig, bench_vs_torch, check_losses, write_json

    bad = [s for s in args.schedules if s not in ("gpipe", "1f1b")]
    if bad:
        raise SpecError(f"--schedules: unknown {', '.join(bad)} (gpipe, 1f1b)")
    cfg = settings_from(VsTorchConfig, args, _options())
    console = wide_console()
    machine = machine_description(torch.device("cpu"))
    console.print(f"[bold]aqsgd vs torch.distributed.pipelining[/] on {machine}: Llama-style model, "
                  f"{cfg.layers} blocks x {cfg.hidden}, {cfg.seq_len} tokens, {cfg.num_microbatches} "
                  f"micro-batches of {cfg.microbatch_size}, fp32; median of {cfg.repeats} x {cfg.steps} "
                  f"interleaved steps")
    rows = bench_vs_torch(cfg, progress=lambda m: console.print(m))
    table = columns(("stages", "schedule", "aqsgd samples/s", "torch samples/s", "aqsgd/torch",
                     "aqsgd step ms", "torch step ms", "first-step loss aqsgd", "first-step loss torch"),
                    left=("schedule",))
    for r in rows:
        table.add_row(str(r["stages"]), f"{r['schedule']} / {r['torch_schedule']}",
                      f"{r['aqsgd_samples_per_s']:.1f}", f"{r['torch_samples_per_s']:.1f}",
                      f"{r['ratio']:.2f}x", f"{1e3 * r['aqsgd_step_s']:.1f}",
                      f"{1e3 * r['torch_step_s']:.1f}", f"{r['aqsgd_first_loss']:.6f}",
                      f"{r['torch_first_loss']:.6f}")
    console.print(table)
    check_losses(rows)
    console.print("first-step losses equal")
    latency = _latency(args.latency_repeats, console)
    if args.json:
        write_json({"benchmark": "vs-torch", "command": args.command_line, "machine": machine,
                    "config": dataclasses.asdict(cfg), "rows": rows, "latency": latency}, args.json)
        console.print(f"wrote {args.json}")
    return 0


def _latency(repeats: int, console: Console) -> list:
    """One message's hand-over and ping-pong times, aqsgd's transport (with and without its checksum) vs
    torch's send/recv, as a table; none where ``repeats`` is 0."""
    from aqsgd.bench.vs_torch import LatencyConfig, bench_latency

    if repeats <= 0:
        return []
    latency = bench_latency(LatencyConfig(repeats=repeats))
    lt = Table(title="one message between two processes (median ms)")
    for col in ("payload bytes", "checksum", "aqsgd hand-over", "torch hand-over", "ratio",
                "aqsgd ping-pong", "torch ping-pong", "ratio "):
        lt.add_column(col, justify="right")
    for r in latency:
        for name, suffix, crc in (("aqsgd", "", "CRC-32"), ("aqsgd_nocrc", "_nocrc", "off")):
            lt.add_row(f"{r['payload_bytes']:,}", crc, f"{r[name + '_handover_ms']:.3f}",
                       f"{r['torch_handover_ms']:.3f}", f"{r['handover_ratio' + suffix]:.2f}x",
                       f"{r[name + '_pingpong_ms']:.3f}", f"{r['torch_pingpong_ms']:.3f}",
                       f"{r['pingpong_ratio' + suffix]:.2f}x")
    console.print(lt)
    return latency
