"""``aqsgd bench codecs``: codec encode/decode throughput against ``x.clone()``; with ``--quality`` the
rate-distortion table instead (:mod:`aqsgd.cli.bench.quality`), with ``--cache-path`` the AQ-SGD cache path
(:mod:`aqsgd.cli.bench.cachepath`)."""

from __future__ import annotations

import argparse

import torch
from rich.table import Table

from aqsgd.cli.bench.cachepath import run_cache_path
from aqsgd.cli.bench.options import add_options, option, wide_console
from aqsgd.cli.bench.quality import QUALITY_DATA, run_codec_quality
from aqsgd.cli.options import parse_shape, positive_int
from aqsgd.errors import SpecError

DESCRIPTION = ("Encode, decode and round-trip throughput of each codec on one activation-like fp32 tensor, "
               "next to x.clone() of the same tensor measured in the same run (interleaved repeats, medians, "
               "warm-up excluded). With --quality: the quantizer's rate-distortion table instead (relative "
               "squared error at 1..8 bits for every scale/grid/granularity option on N(0, 1) data, next to "
               "the best uniform quantizer and the Shannon bound; with --data also on MiniLM's and SmolLM2's "
               "boundary tensors).")

OPTIONS = [
    option("--codecs", "codec specs (default: a representative set; see `aqsgd codecs`)", nargs="+",
           default=None, metavar="SPEC"),
    option("--shape", "tensor shape (default: 8,512,768)", type=parse_shape, default=(8, 512, 768)),
    option("--device", "where the codecs run: auto (CUDA when available), cpu or cuda (default: auto)",
           default="auto", choices=("auto", "cpu", "cuda")),
    option("--repeats", "timed repeats per codec (default: 15)", type=positive_int, default=15),
    option("--warmup", "untimed warm-up calls (default: 3)", type=positive_int, default=3),
    option("--threads", "torch CPU threads (default: torch's)", type=positive_int, default=None),
    option("--json", "also write the rows as JSON to PATH", metavar="PATH", default=None),
    option("--quality", "rate-distortion table of q1..q8 on Gaussian data (or --data) instead of throughput",
           action="store_true"),
    option("--data", "with --quality: what to measure on: gaussian (one N(0, 1) tensor of --shape), minilm, "
           "smollm2 (the offline model's activations, AQ-SGD deltas and activation gradients at the "
           "boundaries of a 4-stage split, on BBC News text: about 20 s and 1.5 min on 2 CPU cores), or all "
           "(default: gaussian)", nargs="+", choices=QUALITY_DATA, default=None, metavar="SOURCE"),
    option("--seed", "seed of the --quality data (default: 0)", type=int, default=0),
    option("--png", "with --quality: also plot it to PATH", metavar="PATH", default=None),
    option("--cache-path", "instead of the codec table: the AQ-SGD cache path per micro-batch (the delta "
           "scheme's sender: get, a - m, encode, decode, m + d, put; its receiver: get, decode, add, put) "
           "for each cache spec (default: memory lowbit4 disk) with --codecs (q2 unless given), against "
           "x.clone(); with a disk cache also its reads from disk with and without prefetch", nargs="*",
           default=None, metavar="CACHE"),
    option("--cache-dir", "with --cache-path: where the disk caches go (default: a temporary folder, "
           "removed)", metavar="DIR", default=None),
]


def register(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("codecs", help="codec encode/decode throughput against x.clone(), or --quality",
                         description=DESCRIPTION)
    add_options(p, OPTIONS)
    p.set_defaults(func=run_codecs)


def run_codecs(args: argparse.Namespace) -> int:
    from aqsgd.bench.codecs import DEFAULT_CODECS, bench_codecs, launch_costs, machine_description, write_json
    from aqsgd.bench.timing import warm_allocator
    from aqsgd.comm.device import resolve_device

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)  # --device cuda without a GPU: a SpecError, one line from main()
    console = wide_console()
    if args.cache_path is not None or args.cache_dir:
        return run_cache_path(args, device, console)
    if args.quality:
        return run_codec_quality(args, device, console)
    if args.png:
        raise SpecError("--png: plots the --quality table; add --quality")
    if args.data:
        raise SpecError("--data: chooses the --quality data; add --quality")
    specs = args.codecs or DEFAULT_CODECS
    console.print(f"[bold]codec throughput[/]: fp32 tensor {tuple(args.shape)} on "
                  f"{machine_description(device)}; median of {args.repeats} interleaved repeats after "
                  f"{args.warmup} warm-up calls")
    with warm_allocator() as warm:  # the timed calls' results on pages already mapped (not page faults)
        rows = bench_codecs(specs, shape=args.shape, device=device, repeats=args.repeats, warmup=args.warmup)
    eager = any(r.eager_encode_gbps is not None for r in rows)
    table = Table(caption="eager: the same codec with the fused kernels off, timed in the same rounds"
                  if eager else None)
    for col in ("codec", "encode GB/s", "decode GB/s", "round-trip GB/s", "clone GB/s", "enc/clone",
                "dec/clone", *(("eager enc GB/s", "eager dec GB/s") if eager else ()), "wire bytes", "ratio",
                "rel err"):
        table.add_column(col, justify="left" if col == "codec" else "right")
    for r in rows:
        extra = (f"{r.eager_encode_gbps:.2f}", f"{r.eager_decode_gbps:.2f}") if eager else ()
        table.add_row(r.codec, f"{r.encode_gbps:.2f}", f"{r.decode_gbps:.2f}", f"{r.roundtrip_gbps:.2f}",
                      f"{r.clone_gbps:.2f}", f"{r.encode_vs_clone:.2f}", f"{r.decode_vs_clone:.2f}", *extra,
                      f"{r.wire_bytes:,}", f"{r.ratio:.1f}x", f"{r.rel_err:.3g}")
    console.print(table)
    for r in rows:
        if r.learning_encode_gbps is not None:
            console.print(f"{r.codec}: encode as training's sender runs it (adding the rows to the basis's "
                          f"estimate, refreshes amortized) {r.learning_encode_gbps:.2f} GB/s, "
                          f"{r.learning_encode_gbps / r.clone_gbps:.2f} of the clone")
    launch = launch_costs(device) if device.type == "cuda" else None
    if launch:
        console.print("launch costs, µs per call (alone between two synchronisations / 20 queued): "
                      + ", ".join(f"{k} {v:.1f}" for k, v in launch.items()))
    if args.json:
        write_json(rows, args.json, device=device, command=args.command_line, launch_us=launch,
                   warm_allocator=warm)
        console.print(f"wrote {args.json}")
    return 0


