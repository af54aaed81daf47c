"""``aqsgd bench codecs --cache-path``: the AQ-SGD cache path per micro-batch, and the disk cache's reads with
and without prefetch (:mod:`aqsgd.bench.cachepath`)."""

from __future__ import annotations

import argparse

import torch
from rich.console import Console
from rich.table import Table

from aqsgd.errors import SpecError


def run_cache_path(args: argparse.Namespace, device: torch.device, console: Console) -> int:
    """``--cache-path``: the AQ-SGD cache path per micro-batch (and the disk cache's prefetch) instead of the
    codec table."""
    from aqsgd.bench.cachepath import (
        DEFAULT_CACHES,
        DEFAULT_CODEC,
        MICROBATCHES,
        bench_cache_path,
        bench_prefetch,
        check_specs,
        write_cache_path_json,
    )
    from aqsgd.bench.codecs import machine_description

    if args.cache_path is None:
        raise SpecError("--cache-dir: where --cache-path puts its disk caches; add --cache-path")
    if args.quality or args.png or getattr(args, "data", None):
        raise SpecError("--cache-path and --quality are separate tables; give one of them")
    caches = args.cache_path or list(DEFAULT_CACHES)
    codecs = args.codecs or [DEFAULT_CODEC]
    check_specs(codecs, caches)
    shape = tuple(args.shape)
    if len(shape) < 2:
        raise SpecError(f"--shape {args.shape}: the cache path needs rows (samples) and a row shape, e.g. "
                        f"8,512,768")
    machine = machine_description(device)
    where = args.cache_dir or "a temporary folder"
    console.print(f"[bold]AQ-SGD cache path[/]: delta scheme (sender and receiver of one boundary, TRAIN "
                  f"phase), fp32 micro-batches {shape} cycling over {MICROBATCHES} micro-batches of distinct "
                  f"sample ids, on {machine}; "
                  f"median of {args.repeats} interleaved repeats after {args.warmup} warm-up calls; disk "
                  f"caches in {where}, read from the page cache here")
    rows = bench_cache_path(codecs, caches, shape=shape, device=device, repeats=args.repeats,
                            warmup=args.warmup, cache_dir=args.cache_dir)
    table = Table()
    for col in ("cache", "codec", "fused", "send GB/s", "recv GB/s", "clone GB/s", "send/clone", "recv/clone",
                "send ms", "recv ms", "unfused send ms", "unfused recv ms", "get", "a-m", "encode", "decode",
                "m+d", "put", "B/sample"):
        table.add_column(col, justify="left" if col in ("cache", "codec", "fused") else "right")
    for r in rows:
        table.add_row(r.cache, r.codec, "yes" if r.fused else "no", f"{r.sender_gbps:.2f}",
                      f"{r.receiver_gbps:.2f}", f"{r.clone_gbps:.2f}", f"{r.sender_vs_clone:.3f}",
                      f"{r.receiver_vs_clone:.3f}", f"{r.sender_ms:.2f}", f"{r.receiver_ms:.2f}",
                      *("-" if v is None else f"{v:.2f}" for v in (r.eager_sender_ms, r.eager_receiver_ms)),
                      *(f"{v:.2f}" for v in (r.get_ms, r.sub_ms, r.encode_ms, r.decode_ms, r.add_ms,
                                             r.put_ms)),
                      f"{r.cache_bytes_per_sample:,}")
    console.print(table)
    console.print("send: the sender's path, recv: the receiver's; fused: the sender's step ran as one pass "
                  "over the cache rows (memory cache, q<b> codec); unfused: the same paths with the fused "
                  "kernels off, timed in the same rounds; GB/s: fp32 activation bytes per second; get .. "
                  "put: each step alone (ms per micro-batch, on a third cache of the same spec); B/sample: "
                  "the cache's bytes per sample")
    broken = [r.cache for r in rows if not r.caches_identical]
    if broken:
        console.print(f"[red]sender and receiver caches differ after the run: {', '.join(broken)}[/]")
    prefetch = []
    for spec in (c for c in caches if c.split(":")[0] == "disk"):
        prefetch += bench_prefetch(codecs[0], spec, shape=shape, device=device, repeats=args.repeats,
                                   cache_dir=args.cache_dir)
    if prefetch:
        _prefetch_table(prefetch, shape, args.repeats, console)
    if args.json:
        config = {"codecs": list(codecs), "caches": list(caches), "shape": list(shape),
                  "microbatches": MICROBATCHES, "repeats": args.repeats, "warmup": args.warmup,
                  "cache_dir": args.cache_dir}
        write_cache_path_json(rows, prefetch, args.json, device=device, command=args.command_line,
                              config=config)
        console.print(f"wrote {args.json}")
    return 0


def _prefetch_table(prefetch: list, shape: tuple[int, ...], repeats: int, console: Console) -> None:
    """The disk cache's reads per step, with and without prefetch, cold and warm."""
    from aqsgd.bench.cachepath import MICROBATCHES

    console.print(f"[bold]disk cache reads[/]: steps of {MICROBATCHES} micro-batches through the sender, "
                  f"in the stage runner's order (prefetch of micro-batch k+1 when k arrives, a stand-in "
                  f"forward of one {shape[-1]}x{shape[-1]} linear layer, send); median of {repeats} "
                  f"steps per mode, interleaved. cold: the file's pages dropped before every step "
                  f"(fsync, madvise/posix_fadvise DONTNEED), resident = its share in the page cache then "
                  f"(mincore)")
    ptable = Table()
    for col in ("cache", "pages", "prefetch", "resident", "read wait ms/step", "slowest get ms", "hidden",
                "step ms", "forward ms/mb", "hits/misses"):
        ptable.add_column(col, justify="left" if col in ("cache", "pages", "prefetch") else "right")
    for r in prefetch:
        ptable.add_row(r.cache, r.pages, "yes" if r.prefetch else "no",
                       "-" if r.resident_before is None else f"{r.resident_before:.0%}",
                       f"{r.step_read_wait_ms:.2f}", f"{r.max_get_wait_ms:.2f}",
                       "-" if r.hidden is None else f"{r.hidden:.0%}",
                       f"{r.step_ms:.1f}", f"{r.forward_ms:.1f}", f"{r.hits}/{r.misses}")
    console.print(ptable)
    if any(r.pages == "cold" and not r.pages_dropped for r in prefetch):
        console.print("[yellow]the file's pages could not be dropped (tmpfs, or not Linux?): the cold "
                      "rows may have been read from the page cache[/]")
