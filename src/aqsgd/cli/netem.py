"""``aqsgd bench netem``: pipeline throughput over real shaped links (:mod:`aqsgd.bench.netem`; needs
root)."""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import tempfile
from typing import Any

from aqsgd.bench.netem import (
    DEFAULT_SETTINGS,
    NetemBenchConfig,
    bench_netem,
    bench_netem_links,
    markdown_table,
    plot_speedups,
    variant_label,
    write_json,
)
from aqsgd.bench.settings import SETTINGS

__all__ = ["config_from_args", "register", "run"]


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def register(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``netem`` to the ``aqsgd bench`` sub-commands; returns its parser."""
    p = bench_subparsers.add_parser(
        "netem", help="pipeline throughput over real shaped links (network namespaces, tc; needs root)",
        description="Runs stage processes in Linux network namespaces joined by veth links shaped with tc "
                    "(tbf; delay and loss by a user-space wire), over gloo/TCP, for fp32, fp16, direct and "
                    "AQ-SGD compression (with --data-parallel also gradient syncs between replicas), from "
                    "--max-mbps down to where the fp32 link time is --target-ratio x the compute time. "
                    "Reports samples/s, speed-up vs fp32, the ideal speed-up and the efficiency (the step "
                    "the schedule can reach, bubble included, over the measured step; see docs/design.md, "
                    "Speed model) and the fp32 comm:compute ratio. Needs root and iproute2.")
    p.add_argument("--stages", type=int, choices=(2, 4), default=2, help="pipeline stages (default: 2)")
    p.add_argument("--bandwidths", type=_positive_float, nargs="+", default=None, metavar="MBPS",
                   help="explicit bandwidths in Mbit/s, highest first (default: derived from a calibration "
                        "run)")
    p.add_argument("--max-mbps", type=_positive_float, default=1000.0,
                   help="top of the sweep (default: 1000)")
    p.add_argument("--target-ratio", type=_positive_float, default=10.0,
                   help="sweep down to where fp32 link time = this x compute time (default: 10)")
    p.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(DEFAULT_SETTINGS),
                   metavar="SETTING", help=f"settings to run, from the named settings (default: "
                                           f"{', '.join(DEFAULT_SETTINGS)})")
    p.add_argument("--link", default=None, metavar="LINKS",
                   help="instead of the bandwidth sweep: every setting once over one tc setting per "
                        "boundary, as aqsgd train --link reads it (1gbit/50mbit,20ms/200mbit with --stages "
                        "4; 200mbit~20mbit@4 changes a link from step 4 on, re-shaped with tc as the run "
                        "gets there); the setting auto chooses the bits of each link")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay per link (default: 0)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default: 6; 3 with --quick)")
    p.add_argument("--runs", type=int, default=1, help="runs per (bandwidth, setting); median (default: 1)")
    p.add_argument("--hidden", type=int, default=256, help="model width (default: 256)")
    p.add_argument("--seq-len", type=int, default=128, help="sequence length (default: 128)")
    p.add_argument("--data-parallel", type=int, default=1, metavar="D",
                   help="also run --dp-settings on D replicas of the pipeline (S x D processes) with each "
                        "--grad-syncs (default: 1, off)")
    p.add_argument("--dp-settings", nargs="+", choices=list(SETTINGS), default=["fp32", "aqsgd fw2/bw4"],
                   metavar="SETTING",
                   help="settings run with data parallelism (default: fp32, aqsgd fw2/bw4)")
    p.add_argument("--grad-syncs", nargs="+", default=["allreduce", "q8"], metavar="SYNC",
                   help="gradient syncs between replicas: allreduce | q<b>[:block<N>] | powersgd[:rank<R>] "
                        "(default: allreduce q8)")
    p.add_argument("--quick", action="store_true", help="fewer timed steps (about 5 minutes on 2 cores)")
    p.add_argument("--workdir", default=None,
                   help="where run directories and logs go (default: a temporary folder)")
    p.add_argument("--json", metavar="PATH", default=None, help="write the report as JSON to PATH")
    p.add_argument("--png", metavar="PATH", default=None, help="plot speed-up vs bandwidth to PATH")
    p.set_defaults(func=run)
    return p


def config_from_args(args: argparse.Namespace) -> NetemBenchConfig:
    """The sweep the parsed options ask for."""
    kw: dict[str, Any] = {"stages": args.stages, "bandwidths_mbps": args.bandwidths,
                          "max_mbps": args.max_mbps, "target_ratio": args.target_ratio,
                          "settings": tuple(args.settings), "delay_ms": args.delay_ms, "runs": args.runs,
                          "hidden": args.hidden, "seq_len": args.seq_len, "data_parallel": args.data_parallel,
                          "dp_settings": tuple(args.dp_settings), "grad_syncs": tuple(args.grad_syncs)}
    if args.steps:
        kw["measure_steps"] = args.steps
    return NetemBenchConfig.quick(**kw) if args.quick else NetemBenchConfig(**kw)


def run(args: argparse.Namespace) -> int:
    """Run the sweep, print the table, write JSON/PNG when asked."""
    cfg = config_from_args(args)
    if args.link:
        return _run_links(args, cfg)
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="aqsgd-netem-"))
        report = bench_netem(cfg, workdir, progress=print)
    rows = report["rows"]
    print(markdown_table(rows))
    at = rows[-1]["bandwidth_mbps"]
    aq = next((r for r in rows if r["bandwidth_mbps"] == at and variant_label(r) == "aqsgd fw2/bw4"), None)
    if aq is not None:
        print(f"at {at:g} Mbit/s (fp32 comm:compute {aq['comm_compute_ratio']:.1f}): AQ-SGD fw2/bw4 is "
              f"{aq['speedup_vs_fp32']:.2f}x fp32; lowest efficiency "
              f"{min(r['efficiency'] for r in rows):.2f}")
    machine = f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, Linux {platform.release()}"
    if args.json:
        write_json(report, args.json, cfg=cfg, command=args.command_line, machine=machine)
        print(f"wrote {args.json}")
    if args.png:
        plot_speedups(rows, args.png, title=f"{cfg.stages} stages over shaped veth links (dotted: ideal)")
        print(f"wrote {args.png}")
    return 0


def _run_links(args: argparse.Namespace, cfg: NetemBenchConfig) -> int:
    """``--link``: every setting over one tc setting per boundary."""
    import json
    from pathlib import Path

    with contextlib.ExitStack() as stack:
        workdir = args.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="aqsgd-netem-"))
        report = bench_netem_links(cfg, args.link, workdir, progress=print)
    print("| setting | samples/s | vs fp32 | step (ms) | ideal (ms) | last codecs |")
    print("|---|---|---|---|---|---|")
    for r in report["rows"]:
        ideal = r.get("ideal_step_s")
        last = r["codecs"][-1] if r["codecs"] and r["codecs"][-1] else {}
        print(f"| {r['setting']} | {r['samples_per_s']:.1f} | {r['speedup_vs_fp32']:.2f}x | "
              f"{r['step_s'] * 1e3:.0f} | {'-' if ideal is None else f'{ideal * 1e3:.0f}'} | "
              f"{', '.join(f'{k} {v}' for k, v in last.items()) or '-'} |")
    if args.json:
        machine = (f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, Linux "
                   f"{platform.release()}")
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"benchmark": "netem-links", "command": args.command_line,
                                               "machine": machine, **report}, indent=1))
        print(f"wrote {args.json}")
    return 0
