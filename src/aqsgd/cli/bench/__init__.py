"""``aqsgd bench ...``: benchmarks that print what they measured and how, optionally as JSON. Each benchmark
registers its own subcommand from its module here: its options are a table (:mod:`aqsgd.cli.bench.options`)
whose defaults come from the benchmark's settings dataclass, which the same table fills from the parsed
options."""

from __future__ import annotations

import argparse

from aqsgd.cli.bench import adaptive, batching, codecs, convergence, overhead, pipeline, vs_torch
from aqsgd.cli.bench.adaptive import run_adaptive
from aqsgd.cli.bench.batching import run_batching
from aqsgd.cli.bench.cachepath import run_cache_path
from aqsgd.cli.bench.codecs import run_codecs
from aqsgd.cli.bench.convergence import run_convergence
from aqsgd.cli.bench.overhead import run_overhead
from aqsgd.cli.bench.pipeline import run_pipeline
from aqsgd.cli.bench.quality import QUALITY_DATA, run_codec_quality, run_spec_quality
from aqsgd.cli.bench.vs_torch import run_vs_torch

__all__ = ["register", "QUALITY_DATA", "run_adaptive", "run_batching", "run_cache_path", "run_codec_quality",
           "run_codecs", "run_convergence", "run_overhead", "run_pipeline", "run_spec_quality",
           "run_vs_torch"]


def register(sub: argparse._SubParsersAction) -> None:
    """``aqsgd bench`` and one subcommand per benchmark, in the order ``--help`` lists them."""
    from aqsgd.cli.netem import register as register_netem

    p = sub.add_parser("bench", help="run a benchmark")
    bench = p.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for module in (codecs, pipeline, adaptive, vs_torch, overhead, convergence, batching):
        module.register(bench)
    register_netem(bench)
