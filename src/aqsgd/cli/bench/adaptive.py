"""``aqsgd bench adaptive``: the bits ``auto`` chooses per link against every fixed rung, over uneven links
(:mod:`aqsgd.bench.adaptive`)."""

from __future__ import annotations

import argparse
import dataclasses

import torch

from aqsgd.cli.bench.options import add_options, option, settings_from, wide_console, words
from aqsgd.cli.options import positive_int

DESCRIPTION = ("Stage processes over uneven emulated links (one setting per boundary; 'drop': the middle "
               "link falls from 200 to 20 Mbit/s halfway) train the same model with fp32, with "
               "--forward/--backward auto and with every fixed rung of auto's ladders: time to a target "
               "training loss (fp32's at 75 %% of its steps), final perplexity against fp32, and the bits "
               "auto gave each link over time (a plot).")


def _setting(text: str) -> str:
    from aqsgd.bench.adaptive import setting_specs

    try:
        setting_specs(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _options() -> list:
    from aqsgd.bench.adaptive import SCENARIOS, all_settings

    return [
        option("--scenarios", f"of {', '.join(f'{k} ({v})' for k, v in SCENARIOS.items())} (default: all)",
               field="scenarios", type=words),
        option("--settings", f"of {', '.join(all_settings())}, auto:err=E (auto with the error budget E, to "
               "compare budgets) and 'fixed RUNG warmup CODEC' (a fixed setting with --warmup-codec CODEC) "
               "(default: all of the first list; fp32 is needed)", field="settings", nargs="+", type=_setting,
               metavar="SETTING"),
        option("--stages", "2 to 4 (default: {default})", field="stages", type=positive_int),
        option("--steps", "training steps (default: {default})", field="steps", type=positive_int),
        option("--train-samples", "synthetic training samples (default: {default}, 4 steps per epoch; the "
               "first epoch is the warm-up, uncompressed but for auto's links)", field="train_samples",
               type=positive_int),
        option("--evals", "evaluations per run, evenly spaced; quality is the mean perplexity of those in "
               "the last quarter of the steps (default: {default})", field="evals", type=positive_int),
        option("--hidden", "model width (default: {default})", field="hidden", type=positive_int),
        option("--seq-len", "tokens per sample (default: {default})", field="seq_len", type=positive_int),
        option("--micro-batches", "(default: {default})", field="num_microbatches", type=positive_int),
        option("--repeats", "runs of every setting but fp32 (whose losses, the same in every run, set the "
               "target), the settings in turn; times are medians over them (default: {default})",
               field="repeats", type=positive_int),
        option("--latency-ms", "one-way latency of every link (default: {default})", field="latency_ms",
               type=float),
        option("--json", "write the results as JSON to PATH", metavar="PATH", default=None),
        option("--png", "plot loss against time and auto's bits per link over time to PATH", metavar="PATH",
               default=None),
    ]


def register(bench: argparse._SubParsersAction) -> None:
    from aqsgd.bench.adaptive import AdaptiveBenchConfig

    p = bench.add_parser("adaptive", help="bits chosen per link (auto) vs every fixed rung, uneven links",
                         description=DESCRIPTION)
    add_options(p, _options(), AdaptiveBenchConfig())
    p.set_defaults(func=run_adaptive)


def run_adaptive(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from aqsgd.bench.adaptive import AdaptiveBenchConfig, bench_adaptive, plot
    from aqsgd.bench.codecs import machine_description

    cfg = settings_from(AdaptiveBenchConfig, args, _options())
    console = wide_console()
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
