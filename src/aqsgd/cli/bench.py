"""``aqsgd bench ...``: benchmarks that print what they measured and how, optionally as JSON."""

from __future__ import annotations

import argparse
import dataclasses

import torch
from rich.console import Console
from rich.table import Table

from aqsgd.cli.options import parse_shape, positive_int
from aqsgd.errors import SpecError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark")
    bsub = p.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    c = bsub.add_parser("codecs", help="codec encode/decode throughput against x.clone(), or --quality",
                        description="Encode, decode and round-trip throughput of each codec on one "
                                    "activation-like fp32 tensor, next to x.clone() of the same tensor measured "
                                    "in the same run (interleaved repeats, medians, warm-up excluded). "
                                    "With --quality: the quantizer's rate-distortion table instead "
                                    "(relative squared error at 1..8 bits for every scale/grid/granularity "
                                    "option on N(0, 1) data, next to the best uniform quantizer and the "
                                    "Shannon bound).")
    c.add_argument("--codecs", nargs="+", default=None, metavar="SPEC",
                   help="codec specs (default: a representative set; see `aqsgd codecs`)")
    c.add_argument("--shape", type=parse_shape, default=(8, 512, 768), help="tensor shape (default: 8,512,768)")
    c.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where the codecs run: auto (CUDA when available), cpu or cuda (default: auto)")
    c.add_argument("--repeats", type=positive_int, default=15, help="timed repeats per codec (default: 15)")
    c.add_argument("--warmup", type=positive_int, default=3, help="untimed warm-up calls (default: 3)")
    c.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")
    c.add_argument("--json", metavar="PATH", default=None, help="also write the rows as JSON to PATH")
    c.add_argument("--quality", action="store_true",
                   help="rate-distortion table of q1..q8 on Gaussian data instead of throughput")
    c.add_argument("--seed", type=int, default=0, help="seed of the --quality data (default: 0)")
    c.add_argument("--png", metavar="PATH", default=None, help="with --quality: also plot it to PATH")
    c.set_defaults(func=run_codecs)

    from aqsgd.bench.pipeline import PipelineBenchConfig
    from aqsgd.bench.settings import SETTINGS

    d = PipelineBenchConfig()
    pp = bsub.add_parser("pipeline", help="training throughput of stage processes over emulated links",
                         description="Samples/s of real stage processes (PyTorch's elastic launcher, gloo) over "
                                     "links emulated in the transport, for each setting and bandwidth; speed-up vs "
                                     "fp32 next to the ideal speed-up and the efficiency of the speed model (the step "
                                     "the schedule allows, pipeline bubble included, from the measured compute "
                                     "time and bytes per micro-batch; docs/design.md).")
    pp.add_argument("--stages", type=_ints, default=list(d.stages), help="stage counts (default: 2,4)")
    pp.add_argument("--bandwidths", type=_floats, default=list(d.bandwidths_mbps),
                    help="link bandwidths in Mbit/s (default: 1000,300,100,30,10)")
    pp.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(d.settings), metavar="SETTING",
                    help=f"settings to compare, from the named settings (default: {', '.join(d.settings)})")
    pp.add_argument("--latency-ms", type=float, default=d.latency_ms, help="one-way link latency (default: 0)")
    pp.add_argument("--hidden", type=positive_int, default=d.hidden, help="model width (default: 256)")
    pp.add_argument("--layers", type=positive_int, default=d.layers, help="transformer blocks (default: 4)")
    pp.add_argument("--seq-len", type=positive_int, default=d.seq_len, help="tokens per sample (default: 128)")
    pp.add_argument("--micro-batch-size", type=positive_int, default=d.microbatch_size, help="(default: 4)")
    pp.add_argument("--micro-batches", type=positive_int, default=d.num_microbatches, help="(default: 8)")
    pp.add_argument("--measure-steps", type=positive_int, default=d.measure_steps,
                    help="timed steps after the warm-up epoch (default: 6)")
    pp.add_argument("--data-parallel", type=_ints, default=list(d.data_parallel),
                    help="replica counts; D > 1 runs stages x D processes (default: 1)")
    pp.add_argument("--grad-syncs", type=lambda t: t.split(","), default=list(d.grad_syncs),
                    help="gradient syncs compared when D > 1, e.g. allreduce,q8,q4,powersgd:rank4 (default: allreduce,q8)")
    pp.add_argument("--json", metavar="PATH", default=None, help="also write the rows as JSON to PATH")
    pp.set_defaults(func=run_pipeline)

    from aqsgd.bench.vs_torch import LatencyConfig, VsTorchConfig

    dv, dl = VsTorchConfig(), LatencyConfig()
    vt = bsub.add_parser("vs-torch", help="uncompressed pipeline vs torch.distributed.pipelining, same stages",
                         description="Samples/s of aqsgd's uncompressed pipeline and of PyTorch's PipelineStage "
                                     "with ScheduleGPipe and Schedule1F1B on the same stage modules and weights "
                                     "(tiny Llama, fp32, gloo on loopback, one thread per process, AdamW with "
                                     "clipping; interleaved rounds, medians, first-step losses checked equal), "
                                     "then one message's hand-over and ping-pong latency, aqsgd transport vs "
                                     "dist.send/recv.")
    vt.add_argument("--stages", type=_ints, default=list(dv.stages), help="stage counts (default: 2,4)")
    vt.add_argument("--schedules", type=lambda t: t.split(","), default=list(dv.schedules),
                    help="gpipe and/or 1f1b (default: gpipe,1f1b)")
    vt.add_argument("--hidden", type=positive_int, default=dv.hidden, help="model width (default: 256)")
    vt.add_argument("--layers", type=positive_int, default=dv.layers, help="transformer blocks (default: 4)")
    vt.add_argument("--seq-len", type=positive_int, default=dv.seq_len, help="tokens per sample (default: 128)")
    vt.add_argument("--micro-batch-size", type=positive_int, default=dv.microbatch_size, help="(default: 4)")
    vt.add_argument("--micro-batches", type=positive_int, default=dv.num_microbatches, help="(default: 8)")
    vt.add_argument("--steps", type=positive_int, default=dv.steps, help="timed steps per round (default: 3)")
    vt.add_argument("--repeats", type=positive_int, default=dv.repeats, help="timed rounds (default: 4)")
    vt.add_argument("--latency-repeats", type=int, default=dl.repeats,
                    help="messages per size and round in the latency test; 0 skips it (default: 200)")
    vt.add_argument("--json", metavar="PATH", default=None, help="also write the rows as JSON to PATH")
    vt.set_defaults(func=run_vs_torch)

    from aqsgd.bench.convergence import DEFAULT_TASKS as CONV_DEFAULT_TASKS
    from aqsgd.bench.convergence import SETTINGS as CONV_SETTINGS
    from aqsgd.bench.convergence import TASKS as CONV_TASKS

    cv = bsub.add_parser("convergence", help="fp32 vs direct quantization vs AQ-SGD vs TopK/EF, same seed and data",
                         description="Train every setting with the same seed, data order and steps on reduced "
                                     "tasks; write curves and final metrics (compression on and off at eval) as "
                                     "JSON, a PNG per task and a table.")
    cv.add_argument("tasks", nargs="*", choices=list(CONV_TASKS), default=list(CONV_DEFAULT_TASKS), metavar="TASK",
                    help=f"tasks, of {', '.join(CONV_TASKS)} (default: {' '.join(CONV_DEFAULT_TASKS)})")
    cv.add_argument("--settings", nargs="+", choices=list(CONV_SETTINGS), default=None, metavar="SETTING",
                    help="settings (default: all)")
    cv.add_argument("--runs-dir", default="runs/convergence", help="run directories (default: runs/convergence); "
                    "an interrupted study continues where it stopped")
    cv.add_argument("--results-dir", default="benchmarks/results", help="JSON and PNG output (default: benchmarks/results)")
    cv.add_argument("--epochs", type=positive_int, default=None, help="override the task's epochs")
    cv.add_argument("--max-train-samples", type=positive_int, default=None, help="override the task's training samples")
    cv.add_argument("--max-eval-samples", type=positive_int, default=None, help="override the task's evaluation samples")
    cv.add_argument("--dropout", type=float, default=None, help="override the model's dropout probabilities "
                    "(e.g. 0)")
    cv.add_argument("--seeds", type=_ints, default=[0], metavar="N[,N...]",
                    help="run every setting once per seed (data order, head initialization, rounding); the table "
                         "gives means and the spread of the paired differences to fp32 (default: 0)")
    cv.add_argument("--tag", default=None, help="suffix of the result files: convergence-TASK-TAG.json/.png "
                    "(use it with another --runs-dir when overriding the task's settings)")
    cv.add_argument("--keep-checkpoints", action="store_true",
                    help="keep every finished run's checkpoints (default: delete them once the run is recorded; "
                         "an LLM run's take gigabytes)")
    cv.set_defaults(func=run_convergence)

    from aqsgd.cli.netem import register as register_netem

    register_netem(bsub)


def run_convergence(args: argparse.Namespace) -> int:
    from pathlib import Path

    from aqsgd.bench.codecs import machine_description
    from aqsgd.bench.convergence import format_relative, run_study, study_table, write_results

    console = Console(width=max(Console().width, 150))
    overrides = {k: v for k, v in (("epochs", args.epochs), ("max_train_samples", args.max_train_samples),
                                   ("max_eval_samples", args.max_eval_samples)) if v}
    if args.dropout is not None:
        overrides["dropout"] = args.dropout
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    command = args.command_line
    for task in args.tasks:
        results = run_study(task, args.runs_dir, settings=args.settings, overrides=overrides, seeds=args.seeds,
                            progress=lambda m: console.print(m), command=command,
                            keep_checkpoints=args.keep_checkpoints)
        path, png = write_results(task, results, args.runs_dir, out, command=command,
                                  machine=machine_description(torch.device("cpu")), tag=args.tag)
        rows = study_table(results)
        table = Table(title=f"convergence: {task}" + (f" (means over seeds {args.seeds})" if len(args.seeds) > 1 else ""))
        for col in ("setting", "forward", "backward", "train loss", "metric", "eval (comp. on)", "eval (comp. off)",
                    "on vs fp32", "off vs fp32", "best off", "best vs fp32", "traffic ratio"):
            table.add_column(col, justify="left" if col in ("setting", "forward", "backward", "metric") else "right")
        for r in rows:
            fmt = lambda v, p=4: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
            table.add_row(r["setting"], r["forward"], r["backward"], fmt(r["final_train_loss"]), r["metric"],
                          fmt(r["eval_on"]), fmt(r["eval_off"]), format_relative(r["rel_vs_fp32"], r["rel_vs_fp32_std"]),
                          format_relative(r["rel_off_vs_fp32"], r["rel_off_vs_fp32_std"]), fmt(r["best_off"]),
                          format_relative(r["rel_best_off_vs_fp32"], r["rel_best_off_vs_fp32_std"]),
                          fmt(r["compression_ratio"], 2))
        console.print(table)
        console.print(f"wrote {path} and {png}")
    return 0


def _ints(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _floats(text: str) -> list[float]:
    try:
        return [float(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def run_pipeline(args: argparse.Namespace) -> int:
    from aqsgd.bench.codecs import machine_description
    from aqsgd.bench.pipeline import PipelineBenchConfig, bench_pipeline, write_json

    cfg = PipelineBenchConfig(stages=args.stages, bandwidths_mbps=args.bandwidths, settings=args.settings,
                              hidden=args.hidden, layers=args.layers, seq_len=args.seq_len,
                              microbatch_size=args.micro_batch_size, num_microbatches=args.micro_batches,
                              measure_steps=args.measure_steps, latency_ms=args.latency_ms,
                              data_parallel=args.data_parallel, grad_syncs=args.grad_syncs)
    console = Console(width=max(Console().width, 150))
    machine = machine_description(torch.device("cpu"))
    console.print(f"[bold]pipeline throughput[/] on {machine}: Llama-style model, {cfg.layers} blocks x {cfg.hidden}, "
                  f"{cfg.seq_len} tokens, {cfg.num_microbatches} micro-batches of {cfg.microbatch_size}; median of "
                  f"{cfg.measure_steps} steps after an uncompressed warm-up epoch")
    rows = bench_pipeline(cfg, progress=lambda m: console.print(m))
    table = Table()
    for col in ("stages", "D", "grad sync", "Mbit/s", "setting", "samples/s", "speed-up", "ideal", "efficiency",
                "vs pipeline-only", "fp32 comm:compute", "bytes/micro-batch"):
        table.add_column(col, justify="left" if col in ("setting", "grad sync") else "right")
    for r in rows:
        vs = r.get("speedup_vs_pipeline_only")
        table.add_row(str(r["stages"]), str(r.get("data_parallel", 1)),
                      r.get("grad_sync", "-") if r.get("data_parallel", 1) > 1 else "-", f"{r['bandwidth_mbps']:g}",
                      r["setting"], f"{r['samples_per_s']:.1f}", f"{r['speedup_vs_fp32']:.2f}x",
                      f"{r['ideal_speedup']:.2f}x", f"{r['efficiency']:.2f}", "-" if vs is None else f"{vs:.2f}x",
                      f"{r['comm_compute_ratio']:.2f}", f"{int(r['bytes_per_mb']):,}")
    console.print(table)
    if args.json:
        write_json(rows, args.json, cfg=cfg, command=args.command_line, machine=machine)
        console.print(f"wrote {args.json}")
    return 0


def run_vs_torch(args: argparse.Namespace) -> int:
    from aqsgd.bench.codecs import machine_description
    from aqsgd.bench.vs_torch import (
        LatencyConfig,
        VsTorchConfig,
        bench_latency,
        bench_vs_torch,
        check_losses,
        write_json,
    )

    bad = [s for s in args.schedules if s not in ("gpipe", "1f1b")]
    if bad:
        raise SpecError(f"--schedules: unknown {', '.join(bad)} (gpipe, 1f1b)")
    cfg = VsTorchConfig(stages=args.stages, schedules=args.schedules, hidden=args.hidden, layers=args.layers,
                        seq_len=args.seq_len, microbatch_size=args.micro_batch_size,
                        num_microbatches=args.micro_batches, steps=args.steps, repeats=args.repeats)
    console = Console(width=max(Console().width, 150))
    machine = machine_description(torch.device("cpu"))
    console.print(f"[bold]aqsgd vs torch.distributed.pipelining[/] on {machine}: Llama-style model, {cfg.layers} "
                  f"blocks x {cfg.hidden}, {cfg.seq_len} tokens, {cfg.num_microbatches} micro-batches of "
                  f"{cfg.microbatch_size}, fp32; median of {cfg.repeats} x {cfg.steps} interleaved steps")
    rows = bench_vs_torch(cfg, progress=lambda m: console.print(m))
    table = Table()
    for col in ("stages", "schedule", "aqsgd samples/s", "torch samples/s", "aqsgd/torch", "aqsgd step ms",
                "torch step ms", "first-step loss aqsgd", "first-step loss torch"):
        table.add_column(col, justify="left" if col == "schedule" else "right")
    for r in rows:
        table.add_row(str(r["stages"]), f"{r['schedule']} / {r['torch_schedule']}", f"{r['aqsgd_samples_per_s']:.1f}",
                      f"{r['torch_samples_per_s']:.1f}", f"{r['ratio']:.2f}x", f"{1e3 * r['aqsgd_step_s']:.1f}",
                      f"{1e3 * r['torch_step_s']:.1f}", f"{r['aqsgd_first_loss']:.6f}", f"{r['torch_first_loss']:.6f}")
    console.print(table)
    check_losses(rows)
    console.print("first-step losses equal")
    latency: list = []
    if args.latency_repeats > 0:
        lcfg = LatencyConfig(repeats=args.latency_repeats)
        latency = bench_latency(lcfg)
        lt = Table(title="one message between two processes (median ms)")
        for col in ("payload bytes", "aqsgd hand-over", "torch hand-over", "ratio", "aqsgd ping-pong",
                    "torch ping-pong", "ratio "):
            lt.add_column(col, justify="right")
        for r in latency:
            lt.add_row(f"{r['payload_bytes']:,}", f"{r['aqsgd_handover_ms']:.3f}", f"{r['torch_handover_ms']:.3f}",
                       f"{r['handover_ratio']:.2f}x", f"{r['aqsgd_pingpong_ms']:.3f}", f"{r['torch_pingpong_ms']:.3f}",
                       f"{r['pingpong_ratio']:.2f}x")
        console.print(lt)
    if args.json:
        write_json({"benchmark": "vs-torch", "command": args.command_line, "machine": machine,
                    "config": dataclasses.asdict(cfg), "rows": rows, "latency": latency}, args.json)
        console.print(f"wrote {args.json}")
    return 0


def run_codecs(args: argparse.Namespace) -> int:
    from aqsgd.bench.codecs import DEFAULT_CODECS, bench_codecs, machine_description, write_json
    from aqsgd.comm.device import resolve_device

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)  # --device cuda without a GPU: a SpecError, one line from main()
    console = Console(width=max(Console().width, 150))
    if args.quality:
        return run_codec_quality(args, device, console)
    if args.png:
        raise SpecError("--png: plots the --quality table; add --quality")
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
        write_json(rows, args.json, device=device, command=args.command_line)
        console.print(f"wrote {args.json}")
    return 0


def run_codec_quality(args: argparse.Namespace, device: torch.device, console: Console) -> int:
    from aqsgd.bench.codecs import machine_description
    from aqsgd.bench.quality import BITS, bench_quality, write_quality_json, write_quality_png

    if args.codecs:
        raise SpecError("--codecs: --quality measures its own set of quantizer variants; leave --codecs out")
    shape = tuple(args.shape)
    machine = machine_description(device)
    console.print(f"[bold]quantizer rate-distortion[/]: relative squared error ||x - C(x)||^2 / ||x||^2 "
                  f"on one N(0, 1) fp32 tensor {shape} (seed {args.seed}) on {machine}; 1 = sending zeros")
    rows = bench_quality(shape=shape, seed=args.seed, device=device)
    table = Table()
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
    console.print("default: channel scales (max over the other dims), max-abs scale (mean |x| for 1 bit), "
                  "nearest rounding, mid-tread grid, fp16 scales")
    if args.json:
        write_quality_json(rows, args.json, shape=shape, seed=args.seed, command=args.command_line,
                           machine=machine)
        console.print(f"wrote {args.json}")
    if args.png:
        write_quality_png(rows, args.png, title=f"quantizer rate-distortion, N(0, 1) tensor {shape}")
        console.print(f"wrote {args.png}")
    return 0
