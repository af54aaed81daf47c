"""``aqsgd bench`` options come from each benchmark's settings dataclass: every option that fills a field
names a real one, takes its default from it, and the parsed options build the settings."""

from __future__ import annotations

import argparse
import dataclasses
import importlib

import pytest

from aqsgd.cli import build_parser
from aqsgd.cli.bench import adaptive, overhead, pipeline, vs_torch
from aqsgd.cli.bench.options import add_options, option, settings_from

BENCHMARKS = [("pipeline", pipeline, "aqsgd.bench.pipeline", "PipelineBenchConfig"),
              ("adaptive", adaptive, "aqsgd.bench.adaptive", "AdaptiveBenchConfig"),
              ("vs-torch", vs_torch, "aqsgd.bench.vs_torch", "VsTorchConfig"),
              ("overhead", overhead, "aqsgd.bench.overhead", "OverheadConfig")]


def _table(module):
    return module.OPTIONS if hasattr(module, "OPTIONS") else module._options()


def _settings_class(path, name):
    return getattr(importlib.import_module(path), name)


@pytest.mark.parametrize("name, module, path, cls", BENCHMARKS, ids=[b[0] for b in BENCHMARKS])
def test_every_field_option_names_a_field_and_takes_its_default(name, module, path, cls):
    settings = _settings_class(path, cls)
    fields = {f.name for f in dataclasses.fields(settings)}
    table = [o for o in _table(module) if o.field is not None]
    assert table and all(o.field in fields for o in table)
    args = build_parser().parse_args(["bench", name])
    defaults = settings()
    for o in table:
        value = getattr(defaults, o.field)
        assert getattr(args, o.dest) == (list(value) if isinstance(value, tuple) else value)


def test_parsed_options_build_the_settings():
    from aqsgd.bench.overhead import OverheadConfig

    args = build_parser().parse_args(["bench", "overhead", "--stages", "1,2", "--kv-heads", "1",
                                      "--micro-batch-size", "3", "--dtype", "fp32"])
    cfg = settings_from(OverheadConfig, args, overhead.OPTIONS)
    assert cfg == OverheadConfig(stages=[1, 2], kv_heads=1, microbatch_size=3, dtype="fp32")


def test_help_shows_the_settings_default():
    @dataclasses.dataclass
    class Settings:
        sizes: tuple = (2, 4)
        latency_ms: float = 0.0

    parser = argparse.ArgumentParser()
    table = [option("--sizes", "sizes (default: {default})", field="sizes"),
             option("--latency-ms", "latency (default: {default})", field="latency_ms", type=float)]
    add_options(parser, table, Settings())
    helps = {a.dest: a.help for a in parser._actions}
    assert helps["sizes"] == "sizes (default: 2,4)" and helps["latency_ms"] == "latency (default: 0)"
    assert parser.parse_args([]).sizes == [2, 4]
