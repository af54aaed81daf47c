"""``aqsgd bench codecs --quality``: the quantizer's rate-distortion table, or the named codecs' error and
bits per value, on Gaussian data or on offline models' boundary tensors (:mod:`aqsgd.bench.quality`)."""

from __future__ import annotations

import argparse

import torch
from rich.console import Console
from rich.table import Table

from aqsgd.errors import SpecError

QUALITY_DATA = ("gaussian", "minilm", "smollm2", "all")


def run_codec_quality(args: argparse.Namespace, device: torch.device, console: Console) -> int:
    from aqsgd.bench.boundary import PRESETS, require_sources, source_boundary_tensors
    from aqsgd.bench.codecs import machine_description
    from aqsgd.bench.quality import (
        BITS,
        bench_quality,
        boundary_quality,
        kurtosis,
        panel_title,
        write_quality_json,
        write_quality_png,
    )

    chosen = args.data or ["gaussian"]
    if args.codecs:
        return run_spec_quality(args, device, console, chosen)
    sources = [s for s in QUALITY_DATA[:-1] if s in chosen or "all" in chosen]
    models = [s for s in sources if s != "gaussian"]
    for s in models:
        require_sources(s)  # before measuring anything: one line naming `aqsgd data prepare NAME`
    shape = tuple(args.shape)
    machine = machine_description(device)
    console.print(f"[bold]quantizer rate-distortion[/] on {machine}: relative squared error "
                  f"||x - C(x)||^2 / ||x||^2; 1 = sending zeros")
    rows, data = [], {}
    if "gaussian" in sources:
        rows += bench_quality(shape=shape, seed=args.seed, device=device)
        data["gaussian"] = {"distribution": "normal(0, 1)", "shape": list(shape), "seed": args.seed,
                            "dtype": "float32"}
        _quality_table(console, rows, f"one N(0, 1) fp32 tensor {shape} (seed {args.seed})")
    for source in models:
        bt = source_boundary_tensors(source, seed=args.seed, device=device)
        info = bt.info | {"kurtosis": {k: [kurtosis(x) for x in xs] for k, xs in bt.tensors.items()}}
        data[source] = info
        new = boundary_quality(bt, source, seed=args.seed, device=device)
        rows += new
        for kind in bt.tensors:
            k = info["kurtosis"][kind]
            _quality_table(console, [r for r in new if r.tensor == kind],
                           f"{panel_title(source, kind)}: {PRESETS[source].description}, "
                           f"{info['micro_batch']} x {info['seq_len']} tokens, after blocks {bt.boundaries} "
                           f"(delta: {info['steps']} AdamW steps of {info['batch']} at lr {info['lr']:g}); "
                           f"mean over the {len(bt.boundaries)} boundaries; kurtosis "
                           f"{min(k):.3g}-{max(k):.3g} (Gaussian: 3); N(0,1) rows are Gaussian references")
    console.print("default: channel scales (max over the other dims), max-abs scale (mean |x| for 1 bit), "
                  "nearest rounding, mid-tread grid, fp16 scales")
    if args.json:
        write_quality_json(rows, args.json, data=data, bits=BITS, command=args.command_line, machine=machine)
        console.print(f"wrote {args.json}")
    if args.png:
        title = (f"quantizer rate-distortion, N(0, 1) tensor {shape}" if sources == ["gaussian"] else
                 "quantizer rate-distortion (mean over boundaries); black and grey: N(0, 1) references")
        write_quality_png(rows, args.png, title=title)
        console.print(f"wrote {args.png}")
    return 0


def run_spec_quality(args: argparse.Namespace, device: torch.device, console: Console,
                     chosen: list[str]) -> int:
    """``--quality --codecs SPEC...``: the named codecs (any spec) on the chosen data, with the bits per value
    that cross the wire measured from the packets."""
    import json
    from pathlib import Path

    from aqsgd.bench.boundary import require_sources, source_boundary_tensors
    from aqsgd.bench.codecs import machine_description
    from aqsgd.bench.quality import kurtosis, spec_quality
    from aqsgd.compress import make_codec

    if args.png:
        raise SpecError("--png: plots the per-bit-width --quality table; leave --codecs out for it")
    specs = [make_codec(s).spec for s in args.codecs]  # every spec checked before anything is measured
    sources = [s for s in QUALITY_DATA[:-1] if s in chosen or "all" in chosen]
    for s in sources:
        if s != "gaussian":
            require_sources(s)
    machine = machine_description(device)
    console.print(f"[bold]codec quality[/] on {machine}: relative squared error ||x - C(x)||^2 / ||x||^2 "
                  "and bits per value on the wire (packet bytes, header and scales included)")
    rows, data = [], {}
    for source in sources:
        if source == "gaussian":
            g = torch.Generator(device=device).manual_seed(args.seed)
            tensors = {"normal": [torch.randn(tuple(args.shape), generator=g, device=device)]}
            data[source] = {"distribution": "normal(0, 1)", "shape": list(args.shape), "seed": args.seed}
        else:
            bt = source_boundary_tensors(source, seed=args.seed, device=device)
            tensors = bt.tensors
            data[source] = bt.info | {"kurtosis": {k: [kurtosis(x) for x in xs] for k, xs in tensors.items()}}
        new = spec_quality(tensors, specs, source, seed=args.seed, device=device)
        rows += new
        table = Table(title=f"{source}: mean over {len(next(iter(tensors.values())))} tensor(s) per kind",
                      title_justify="left")
        table.add_column("codec", justify="left")
        for kind in tensors:
            table.add_column(f"{kind} bits/value", justify="right")
            table.add_column(f"{kind} rel. error", justify="right")
        for spec in specs:
            cells = []
            for kind in tensors:
                r = next(r for r in new if r["spec"] == spec and r["tensor"] == kind)
                cells += [f"{r['bits_per_value']:.3f}", f"{r['rel_mse']:.4g}"]
            table.add_row(spec, *cells)
        console.print(table)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"benchmark": "codecs-quality-specs",
                                               "command": args.command_line, "machine": machine, "data": data,
                                               "rows": rows}, indent=1))
        console.print(f"wrote {args.json}")
    return 0


def _quality_table(console: Console, rows: list, title: str) -> None:
    from aqsgd.bench.quality import BITS

    table = Table(title=title, title_justify="left")
    table.add_column("q<b> options", justify="left")
    table.add_column("scale bits/value", justify="right")
    for b in BITS:
        table.add_column(f"b={b}", justify="right")
    for i, r in enumerate(rows):
        if r.kind == "reference" and i and rows[i - 1].kind == "codec":
            table.add_section()
        cells = ["-" if e is None else f"{e:.3g}" for e in r.rel_mse]
        table.add_row(r.label, "-" if r.scale_bits is None else f"{r.scale_bits:.3g}", *cells)
    console.print(table)


