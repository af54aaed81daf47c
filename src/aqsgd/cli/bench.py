"""``aqsgd bench ...``: benchmarks that print what they measured and how, optionally as JSON."""

from __future__ import annotations

import argparse
import dataclasses

import torch
from rich.console import Console
from rich.table import Table

from aqsgd.cli.options import parse_shape, positive_int
from aqsgd.errors import SpecError

QUALITY_DATA = ("gaussian", "minilm", "smollm2", "all")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark")
    bsub = p.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    c = bsub.add_parser("codecs", help="codec encode/decode throughput against x.clone(), or --quality",
                        description="Encode, decode and round-trip throughput of each codec on one "
                                    "activation-like fp32 tensor, next to x.clone() of the same tensor "
                                    "measured in the same run (interleaved repeats, medians, warm-up "
                                    "excluded). With --quality: the quantizer's rate-distortion table "
                                    "instead (relative squared error at 1..8 bits for every "
                                    "scale/grid/granularity option on N(0, 1) data, next to the best uniform "
                                    "quantizer and the Shannon bound; with --data also on MiniLM's and "
                                    "SmolLM2's boundary tensors).")
    c.add_argument("--codecs", nargs="+", default=None, metavar="SPEC",
                   help="codec specs (default: a representative set; see `aqsgd codecs`)")
    c.add_argument("--shape", type=parse_shape, default=(8, 512, 768),
                   help="tensor shape (default: 8,512,768)")
    c.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where the codecs run: auto (CUDA when available), cpu or cuda (default: auto)")
    c.add_argument("--repeats", type=positive_int, default=15, help="timed repeats per codec (default: 15)")
    c.add_argument("--warmup", type=positive_int, default=3, help="untimed warm-up calls (default: 3)")
    c.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")
    c.add_argument("--json", metavar="PATH", default=None, help="also write the rows as JSON to PATH")
    c.add_argument("--quality", action="store_true",
                   help="rate-distortion table of q1..q8 on Gaussian data (or --data) instead of throughput")
    c.add_argument("--data", nargs="+", choices=QUALITY_DATA, default=None, metavar="SOURCE",
                   help="with --quality: what to measure on: gaussian (one N(0, 1) tensor of --shape), "
                        "minilm, smollm2 (the offline model's activations, AQ-SGD deltas and activation "
                        "gradients at the boundaries of a 4-stage split, on BBC News text: about 20 s and "
                        "1.5 min on 2 CPU cores), or all (default: gaussian)")
    c.add_argument("--seed", type=int, default=0, help="seed of the --quality data (default: 0)")
    c.add_argument("--png", metavar="PATH", default=None, help="with --quality: also plot it to PATH")
    c.add_argument("--cache-path", nargs="*", default=None, metavar="CACHE",
                   help="instead of the codec table: the AQ-SGD cache path per micro-batch (the delta "
                        "scheme's sender: get, a - m, encode, decode, m + d, put; its receiver: get, decode, "
                        "add, put) for each cache spec (default: memory lowbit4 disk) with --codecs (q2 "
                        "unless given), against x.clone(); with a disk cache also its reads from disk with "
                        "and without prefetch")
    c.add_argument("--cache-dir", metavar="DIR", default=None,
                   help="with --cache-path: where the disk caches go (default: a temporary folder, removed)")
    c.set_defaults(func=run_codecs)

    from aqsgd.bench.pipeline import PipelineBenchConfig
    from aqsgd.bench.settings import SETTINGS

    d = PipelineBenchConfig()
    pp = bsub.add_parser("pipeline", help="training throughput of stage processes over emulated links",
                         description="Samples/s of real stage processes (PyTorch's elastic launcher, gloo) "
                                     "over links emulated in the transport, for each setting and bandwidth; "
                                     "speed-up vs fp32 next to the ideal speed-up and the efficiency of the "
                                     "speed model (the step the schedule allows, pipeline bubble included, "
                                     "from the measured compute time and bytes per micro-batch; "
                                     "docs/design.md).")
    pp.add_argument("--stages", type=_ints, default=list(d.stages), help="stage counts (default: 2,4)")
    pp.add_argument("--bandwidths", type=_floats, default=list(d.bandwidths_mbps),
                    help="link bandwidths in Mbit/s (default: 1000,300,100,30,10)")
    pp.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(d.settings),
                    metavar="SETTING",
                    help=f"settings to compare, from the named settings (default: {', '.join(d.settings)})")
    pp.add_argument("--latency-ms", type=float, default=d.latency_ms,
                    help="one-way link latency (default: 0)")
    pp.add_argument("--hidden", type=positive_int, default=d.hidden, help="model width (default: 256)")
    pp.add_argument("--layers", type=positive_int, default=d.layers, help="transformer blocks (default: 4)")
    pp.add_argument("--seq-len", type=positive_int, default=d.seq_len,
                    help="tokens per sample (default: 128)")
    pp.add_argument("--micro-batch-size", type=positive_int, default=d.microbatch_size, help="(default: 4)")
    pp.add_argument("--micro-batches", type=positive_int, default=d.num_microbatches, help="(default: 8)")
    pp.add_argument("--measure-steps", type=positive_int, default=d.measure_steps,
                    help="timed steps after the warm-up epoch (default: 6)")
    pp.add_argument("--data-parallel", type=_ints, default=list(d.data_parallel),
                    help="replica counts; D > 1 runs stages x D processes (default: 1)")
    pp.add_argument("--grad-syncs", type=lambda t: t.split(","), default=list(d.grad_syncs),
                    help="gradient syncs compared when D > 1, e.g. allreduce,q8,q4,powersgd:rank4 (default: "
                         "allreduce,q8)")
    pp.add_argument("--json", metavar="PATH", default=None, help="also write the rows as JSON to PATH")
    pp.set_defaults(func=run_pipeline)

    from aqsgd.bench.adaptive import SCENARIOS, AdaptiveBenchConfig, all_settings

    da = AdaptiveBenchConfig()
    ad = bsub.add_parser("adaptive", help="bits chosen per link (auto) vs every fixed rung, uneven links",
                         description="Stage processes over uneven emulated links (one setting per boundary; "
                                     "'drop': the middle link falls from 200 to 20 Mbit/s halfway) train the "
                                     "same model with fp32, with --forward/--backward auto and with every "
                                     "fixed rung of auto's ladders: time to a target training loss (fp32's "
                                     "at 75 %% of its steps), final perplexity against fp32, and the bits "
                                     "auto gave each link over time (a plot).")
    ad.add_argument("--scenarios", type=lambda t: t.split(","), default=list(da.scenarios),
                    help=f"of {', '.join(f'{k} ({v})' for k, v in SCENARIOS.items())} (default: all)")
    ad.add_argument("--settings", nargs="+", type=_adaptive_setting, default=list(da.settings),
                    metavar="SETTING", help=f"of {', '.join(all_settings())}, auto:err=E (auto with the "
                    "error budget E, to compare budgets) and 'fixed RUNG warmup CODEC' (a fixed setting with "
                    "--warmup-codec CODEC) (default: all of the first list; fp32 is needed)")
    ad.add_argument("--stages", type=positive_int, default=da.stages, help="2 to 4 (default: 4)")
    ad.add_argument("--steps", type=positive_int, default=da.steps, help="training steps (default: 40)")
    ad.add_argument("--train-samples", type=positive_int, default=da.train_samples,
                    help="synthetic training samples (default: 64, 4 steps per epoch; the first epoch "
                         "is the warm-up, uncompressed but for auto's links)")
    ad.add_argument("--evals", type=positive_int, default=da.evals,
                    help="evaluations per run, evenly spaced; quality is the mean perplexity of those in the "
                         "last quarter of the steps (default: 8)")
    ad.add_argument("--hidden", type=positive_int, default=da.hidden, help="model width (default: 256)")
    ad.add_argument("--seq-len", type=positive_int, default=da.seq_len,
                    help="tokens per sample (default: 128)")
    ad.add_argument("--micro-batches", type=positive_int, default=da.num_microbatches, help="(default: 4)")
    ad.add_argument("--repeats", type=positive_int, default=da.repeats,
                    help="runs of every setting but fp32 (whose losses, the same in every run, set the "
                         "target), the settings in turn; times are medians over them (default: 1)")
    ad.add_argument("--latency-ms", type=float, default=da.latency_ms, help="one-way latency of every link "
                    "(default: 0)")
    ad.add_argument("--json", metavar="PATH", default=None, help="write the results as JSON to PATH")
    ad.add_argument("--png", metavar="PATH", default=None, help="plot loss against time and auto's bits per "
                    "link over time to PATH")
    ad.set_defaults(func=run_adaptive)

    from aqsgd.bench.vs_torch import LatencyConfig, VsTorchConfig

    dv, dl = VsTorchConfig(), LatencyConfig()
    vt = bsub.add_parser("vs-torch",
                         help="uncompressed pipeline vs torch.distributed.pipelining, same stages",
                         description="Samples/s of aqsgd's uncompressed pipeline and of PyTorch's "
                                     "PipelineStage with ScheduleGPipe and Schedule1F1B on the same stage "
                                     "modules and weights (tiny Llama, fp32, gloo on loopback, one thread "
                                     "per process, AdamW with clipping; interleaved rounds, medians, "
                                     "first-step losses checked equal), then one message's hand-over and "
                                     "ping-pong latency, aqsgd transport vs dist.send/recv.")
    vt.add_argument("--stages", type=_ints, default=list(dv.stages), help="stage counts (default: 2,4)")
    vt.add_argument("--schedules", type=lambda t: t.split(","), default=list(dv.schedules),
                    help="gpipe and/or 1f1b (default: gpipe,1f1b)")
    vt.add_argument("--hidden", type=positive_int, default=dv.hidden, help="model width (default: 256)")
    vt.add_argument("--layers", type=positive_int, default=dv.layers, help="transformer blocks (default: 4)")
    vt.add_argument("--seq-len", type=positive_int, default=dv.seq_len,
                    help="tokens per sample (default: 128)")
    vt.add_argument("--micro-batch-size", type=positive_int, default=dv.microbatch_size, help="(default: 4)")
    vt.add_argument("--micro-batches", type=positive_int, default=dv.num_microbatches, help="(default: 8)")
    vt.add_argument("--steps", type=positive_int, default=dv.steps, help="timed steps per round (default: 3)")
    vt.add_argument("--repeats", type=positive_int, default=dv.repeats, help="timed rounds (default: 4)")
    vt.add_argument("--latency-repeats", type=int, default=dl.repeats,
                    help="messages per size and round in the latency test; 0 skips it (default: 200)")
    vt.add_argument("--json", metavar="PATH", default=None, help="also write the rows as JSON to PATH")
    vt.set_defaults(func=run_vs_torch)

    from aqsgd.bench.overhead import OverheadConfig

    do = OverheadConfig()
    ov = bsub.add_parser("overhead", help="the local pipeline's step time next to a plain transformers loop",
                         description="Step time of a plain transformers training loop and of aqsgd's local "
                                     "pipeline (uncompressed) at each stage count, on the same Qwen2-style "
                                     "model (random, from one seed), the same micro-batches, AdamW and "
                                     "clipping, the same autocast; interleaved rounds, medians, warm-up "
                                     "excluded. The ratio is the plain loop's step time over the pipeline's "
                                     "(1.0: no overhead). Runs on the CPU or a GPU.")
    ov.add_argument("--stages", type=_ints, default=list(do.stages), help="stage counts (default: 1,4)")
    for name, default, what in (("hidden", do.hidden, "model width"),
                                ("layers", do.layers, "transformer blocks"),
                                ("heads", do.heads, "attention heads"),
                                ("kv-heads", do.kv_heads, "key/value heads"),
                                ("intermediate", do.intermediate, "MLP width"),
                                ("vocab", do.vocab, "vocabulary"),
                                ("seq-len", do.seq_len, "tokens per sample"),
                                ("micro-batch-size", do.microbatch_size, "samples per micro-batch"),
                                ("micro-batches", do.num_microbatches, "micro-batches per step"),
                                ("steps", do.steps, "timed steps per system and round"),
                                ("rounds", do.rounds, "timed rounds")):
        ov.add_argument(f"--{name}", type=positive_int, default=default, help=f"{what} (default: {default})")
    ov.add_argument("--device", default=do.device, choices=("auto", "cpu", "cuda"),
                    help="auto (CUDA when available), cpu or cuda (default: auto)")
    ov.add_argument("--dtype", default=do.dtype, choices=("auto", "fp32", "bf16"),
                    help="auto: bf16 autocast on a GPU that has it, else fp32 (default: auto)")
    ov.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")
    ov.add_argument("--json", metavar="PATH", default=None, help="also write the result as JSON to PATH")
    ov.set_defaults(func=run_overhead)

    from aqsgd.bench.convergence import DEFAULT_TASKS as CONV_DEFAULT_TASKS
    from aqsgd.bench.convergence import SETTINGS as CONV_SETTINGS
    from aqsgd.bench.convergence import STUDIES as CONV_STUDIES
    from aqsgd.bench.convergence import TASKS as CONV_TASKS

    cv = bsub.add_parser("convergence",
                         help="fp32 vs direct quantization vs AQ-SGD vs TopK/EF, same seed and data",
                         description="Train every setting with the same seed, data order and steps on "
                                     "reduced tasks; write curves and final metrics (compression on and off "
                                     "at eval) as JSON, a PNG per task and a table.")
    cv.add_argument("tasks", nargs="*", choices=list(CONV_TASKS), default=list(CONV_DEFAULT_TASKS),
                    metavar="TASK",
                    help=f"tasks, of {', '.join(CONV_TASKS)} (default: {' '.join(CONV_DEFAULT_TASKS)})")
    cv.add_argument("--study", choices=list(CONV_STUDIES), default="convergence",
                    help="which study: its default settings and the name of its result files, "
                         "<study>-TASK.json (default: convergence; fewer-bits: rotated tiles, outlier rows, "
                         "zstd, 1-bit AQ-SGD, TAH-Quant; lora: LoRA in fp32 and with AQ-SGD against full "
                         "fine-tuning)")
    cv.add_argument("--settings", nargs="+", choices=list(CONV_SETTINGS), default=None, metavar="SETTING",
                    help="settings (default: the study's)")
    cv.add_argument("--runs-dir", default="runs/convergence", help="run directories (default: "
                    "runs/convergence); an interrupted study continues where it stopped")
    cv.add_argument("--results-dir", default="benchmarks/results",
                    help="JSON and PNG output (default: benchmarks/results)")
    cv.add_argument("--epochs", type=positive_int, default=None, help="override the task's epochs")
    cv.add_argument("--max-train-samples", type=positive_int, default=None,
                    help="override the task's training samples")
    cv.add_argument("--max-eval-samples", type=positive_int, default=None,
                    help="override the task's evaluation samples")
    cv.add_argument("--dropout", type=float, default=None, help="override the model's dropout probabilities "
                    "(e.g. 0)")
    cv.add_argument("--seeds", type=_ints, default=[0], metavar="N[,N...]",
                    help="run every setting once per seed (data order, head initialization, rounding); the "
                         "table gives means and the spread of the paired differences to fp32 (default: 0)")
    cv.add_argument("--tag", default=None, help="suffix of the result files: convergence-TASK-TAG.json/.png "
                    "(use it with another --runs-dir when overriding the task's settings)")
    cv.add_argument("--keep-checkpoints", action="store_true",
                    help="keep every finished run's checkpoints (default: delete them once the run is "
                         "recorded; an LLM run's take gigabytes)")
    cv.set_defaults(func=run_convergence)

    from aqsgd.cli.netem import register as register_netem

    register_netem(bsub)


def run_convergence(args: argparse.Namespace) -> int:
    from pathlib import Path

    from aqsgd.bench.codecs import machine_description
    from aqsgd.bench.convergence import STUDIES, format_relative, run_study, study_table, write_results

    console = Console(width=max(Console().width, 150))
    overrides = {k: v for k, v in (("epochs", args.epochs), ("max_train_samples", args.max_train_samples),
                                   ("max_eval_samples", args.max_eval_samples)) if v}
    if args.dropout is not None:
        overrides["dropout"] = args.dropout
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    command = args.command_line
    for task in args.tasks:
        results = run_study(task, args.runs_dir, settings=args.settings, overrides=overrides,
                            seeds=args.seeds, progress=lambda m: console.print(m), command=command,
                            keep_checkpoints=args.keep_checkpoints, study=args.study)
        path, png = write_results(task, results, args.runs_dir, out, command=command,
                                  machine=machine_description(torch.device("cpu")), tag=args.tag,
                                  study=args.study, settings=args.settings)
        rows = [r for r in study_table(results) if args.study == "convergence"
                or r["setting"] in STUDIES[args.study][task] or r["setting"] in (args.settings or [])]
        table = Table(title=f"{args.study}: {task}"
                      + (f" (means over seeds {args.seeds})" if len(args.seeds) > 1 else ""))
        for col in ("setting", "forward", "backward", "train loss", "metric", "eval (comp. on)",
                    "eval (comp. off)", "on vs fp32", "off vs fp32", "best off", "best vs fp32", "loss gap",
                    "fw bits/value", "traffic ratio"):
            table.add_column(col, justify="left" if col in ("setting", "forward", "backward", "metric")
                             else "right")
        for r in rows:
            fmt = lambda v, p=4: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
            table.add_row(r["setting"], r["forward"], r["backward"], fmt(r["final_train_loss"]), r["metric"],
                          fmt(r["eval_on"]), fmt(r["eval_off"]),
                          format_relative(r["rel_vs_fp32"], r["rel_vs_fp32_std"]),
                          format_relative(r["rel_off_vs_fp32"], r["rel_off_vs_fp32_std"]), fmt(r["best_off"]),
                          format_relative(r["rel_best_off_vs_fp32"], r["rel_best_off_vs_fp32_std"]),
                          fmt(r["train_loss_gap"], 3), fmt(r["wire_bits_per_value"], 2),
                          fmt(r["compression_ratio"], 2))
        console.print(table)
        console.print(f"wrote {path}"
                      + (f" and {png}" if png else " (the plot needs every seed-0 run directory)"))
    return 0


def _ints(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _adaptive_setting(text: str) -> str:
    from aqsgd.bench.adaptive import setting_specs

    try:
        setting_specs(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


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
    console.print(f"[bold]pipeline throughput[/] on {machine}: Llama-style model, {cfg.layers} blocks x "
                  f"{cfg.hidden}, {cfg.seq_len} tokens, {cfg.num_microbatches} micro-batches of "
                  f"{cfg.microbatch_size}; median of {cfg.measure_steps} steps after an uncompressed warm-up "
                  f"epoch")
    rows = bench_pipeline(cfg, progress=lambda m: console.print(m))
    table = Table()
    for col in ("stages", "D", "grad sync", "Mbit/s", "setting", "samples/s", "speed-up", "ideal",
                "efficiency", "vs pipeline-only", "fp32 comm:compute", "bytes/micro-batch"):
        table.add_column(col, justify="left" if col in ("setting", "grad sync") else "right")
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


def run_adaptive(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from aqsgd.bench.adaptive import AdaptiveBenchConfig, bench_adaptive, plot
    from aqsgd.bench.codecs import machine_description

    cfg = AdaptiveBenchConfig(stages=args.stages, scenarios=args.scenarios, settings=args.settings,
                              steps=args.steps, train_samples=args.train_samples, evals=args.evals,
                              hidden=args.hidden, seq_len=args.seq_len, num_microbatches=args.micro_batches,
                              latency_ms=args.latency_ms, repeats=args.repeats)
    console = Console(width=max(Console().width, 150))
    machine = machine_description(torch.device("cpu"))
    console.print(f"[bold]bits chosen per link[/] on {machine}: {cfg.stages} stages, Llama-style model "
                  f"{cfg.layers} blocks x {cfg.hidden}, {cfg.seq_len} tokens, {cfg.num_microbatches} "
                  f"micro-batches of {cfg.microbatch_size}, {cfg.steps} steps")
    try:
        results = bench_adaptive(cfg, progress=lambda m: console.print(m, highlight=False, markup=False))
    except ValueError as e:
        console.print(f"aqsgd bench adaptive: {e}")
        return 2
    if args.json:  # (each scenario's figures were printed as it ended); compact: a 120-step run's per-step
        # link rows take ~1 MB indented
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"benchmark": "adaptive", "command": args.command_line,
                                               "machine": machine, "config": dataclasses.asdict(cfg),
                                               "scenarios": results}, separators=(",", ":"), default=list))
        console.print(f"wrote {args.json}")
    if args.png:
        plot(results, args.png, title=f"{args.command_line} ({machine})")
        console.print(f"wrote {args.png}")
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
    console.print(f"[bold]aqsgd vs torch.distributed.pipelining[/] on {machine}: Llama-style model, "
                  f"{cfg.layers} blocks x {cfg.hidden}, {cfg.seq_len} tokens, {cfg.num_microbatches} "
                  f"micro-batches of {cfg.microbatch_size}, fp32; median of {cfg.repeats} x {cfg.steps} "
                  f"interleaved steps")
    rows = bench_vs_torch(cfg, progress=lambda m: console.print(m))
    table = Table()
    for col in ("stages", "schedule", "aqsgd samples/s", "torch samples/s", "aqsgd/torch", "aqsgd step ms",
                "torch step ms", "first-step loss aqsgd", "first-step loss torch"):
        table.add_column(col, justify="left" if col == "schedule" else "right")
    for r in rows:
        table.add_row(str(r["stages"]), f"{r['schedule']} / {r['torch_schedule']}",
                      f"{r['aqsgd_samples_per_s']:.1f}", f"{r['torch_samples_per_s']:.1f}",
                      f"{r['ratio']:.2f}x", f"{1e3 * r['aqsgd_step_s']:.1f}",
                      f"{1e3 * r['torch_step_s']:.1f}", f"{r['aqsgd_first_loss']:.6f}",
                      f"{r['torch_first_loss']:.6f}")
    console.print(table)
    check_losses(rows)
    console.print("first-step losses equal")
    latency: list = []
    if args.latency_repeats > 0:
        lcfg = LatencyConfig(repeats=args.latency_repeats)
        latency = bench_latency(lcfg)
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
    if args.json:
        write_json({"benchmark": "vs-torch", "command": args.command_line, "machine": machine,
                    "config": dataclasses.asdict(cfg), "rows": rows, "latency": latency}, args.json)
        console.print(f"wrote {args.json}")
    return 0


def run_overhead(args: argparse.Namespace) -> int:
    from aqsgd.bench.codecs import machine_description
    from aqsgd.bench.overhead import OverheadConfig, bench_overhead, write_json
    from aqsgd.comm.device import resolve_device

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = OverheadConfig(stages=args.stages, hidden=args.hidden, layers=args.layers, heads=args.heads,
                         kv_heads=args.kv_heads, intermediate=args.intermediate, vocab=args.vocab,
                         seq_len=args.seq_len, microbatch_size=args.micro_batch_size,
                         num_microbatches=args.micro_batches, steps=args.steps, rounds=args.rounds,
                         device=args.device, dtype=args.dtype)
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
    table = Table(title=f"{result['parameters'] / 1e6:.1f} M parameters, {result['dtype']}, "
                        f"{result['device']}")
    for col in ("system", "stages", "step ms", "samples/s", "ratio (plain / this)", "first-step loss"):
        table.add_column(col, justify="left" if col == "system" else "right")
    for r in result["rows"]:
        table.add_row(r["system"], "" if r["stages"] is None else str(r["stages"]),
                      f"{1e3 * r['step_s']:.1f}", f"{r['samples_per_s']:.1f}", f"{r['ratio']:.3f}",
                      f"{r['first_loss']:.6f}")
    console.print(table)
    if args.json:
        write_json(result, args.json, cfg=cfg, command=args.command_line, machine=machine)
        console.print(f"wrote {args.json}")
    return 0


def run_codecs(args: argparse.Namespace) -> int:
    from aqsgd.bench.codecs import DEFAULT_CODECS, bench_codecs, launch_costs, machine_description, write_json
    from aqsgd.bench.timing import warm_allocator
    from aqsgd.comm.device import resolve_device

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)  # --device cuda without a GPU: a SpecError, one line from main()
    console = Console(width=max(Console().width, 150))
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
    launch = launch_costs(device) if device.type == "cuda" else None
    if launch:
        console.print("launch costs, µs per call (alone between two synchronisations / 20 queued): "
                      + ", ".join(f"{k} {v:.1f}" for k, v in launch.items()))
    if args.json:
        write_json(rows, args.json, device=device, command=args.command_line, launch_us=launch,
                   warm_allocator=warm)
        console.print(f"wrote {args.json}")
    return 0


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
        console.print(f"[bold]disk cache reads[/]: steps of {MICROBATCHES} micro-batches through the sender, "
                      f"in the stage runner's order (prefetch of micro-batch k+1 when k arrives, a stand-in "
                      f"forward of one {shape[-1]}x{shape[-1]} linear layer, send); median of {args.repeats} "
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
    if args.json:
        config = {"codecs": list(codecs), "caches": list(caches), "shape": list(shape),
                  "microbatches": MICROBATCHES, "repeats": args.repeats, "warmup": args.warmup,
                  "cache_dir": args.cache_dir}
        write_cache_path_json(rows, prefetch, args.json, device=device, command=args.command_line,
                              config=config)
        console.print(f"wrote {args.json}")
    return 0
