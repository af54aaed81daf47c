"""``aqsgd bench ...``: benchmarks that print what they measured and how, optionally as JSON."""

from __future__ import annotations

import argparse
import shlex
import sys

import torch
from rich.console import Console
from rich.table import Table

from aqsgd.cli.options import parse_shape, positive_int


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark")
    bsub = p.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    c = bsub.add_parser("codecs", help="codec encode/decode throughput against x.clone()",
                        description="Encode, decode and round-trip throughput of each codec on one "
                                    "activation-like fp32 tensor, next to x.clone() of the same tensor measured "
                                    "in the same run (interleaved repeats, medians, warm-up excluded).")
    c.add_argument("--codecs", nargs="+", default=None, metavar="SPEC",
                   help="codec specs (default: a representative set; see `aqsgd codecs`)")
    c.add_argument("--shape", type=parse_shape, default=(8, 512, 768), help="tensor shape (default: 8,512,768)")
    c.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu or cuda (default: cuda when available)")
    c.add_argument("--repeats", type=positive_int, default=15, help="timed repeats per codec (default: 15)")
    c.add_argument("--warmup", type=positive_int, default=3, help="untimed warm-up calls (default: 3)")
    c.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")
    c.add_argument("--json", metavar="PATH", default=None, help="also write the rows as JSON to PATH")
    c.set_defaults(func=run_codecs)


def run_codecs(args: argparse.Namespace) -> int:
    from aqsgd.bench.codecs import DEFAULT_CODECS, bench_codecs, machine_description, write_json

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("aqsgd: error: --device cuda but no CUDA device is available", file=sys.stderr)
        return 2
    console = Console(width=max(Console().width, 150))
    specs = args.codecs or DEFAULT_CODECS
    console.print(f"[bold]codec throughput[/]: fp32 tensor {tuple(args.shape)} on {machine_description(device)}; "
                  f"median of {args.repeats} interleaved repeats after {args.warmup} warm-up calls")
    rows = bench_codecs(specs, shape=args.shape, device=device, repeats=args.repeats, warmup=args.warmup)
    table = Table()
    for col in ("codec", "encode GB/s", "decode GB/s", "round-trip GB/s", "clone GB/s", "enc/clone",
                "dec/clone", "wire bytes", "ratio", "rel err"):
        table.add_column(col, justify="left" if col == "codec" else "right")
    for r in rows:
        table.add_row(r.codec, f"{r.encode_gbps:.2f}", f"{r.decode_gbps:.2f}", f"{r.roundtrip_gbps:.2f}",
                      f"{r.clone_gbps:.2f}", f"{r.encode_vs_clone:.2f}", f"{r.decode_vs_clone:.2f}",
                      f"{r.wire_bytes:,}", f"{r.ratio:.1f}x", f"{r.rel_err:.3g}")
    console.print(table)
    if args.json:
        write_json(rows, args.json, device=device, command="aqsgd " + shlex.join(sys.argv[1:]))
        console.print(f"wrote {args.json}")
    return 0
