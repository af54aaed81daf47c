"""The parts of bench/netem that need neither root nor namespaces."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

import pytest

from aqsgd.bench.netem import (
    DEFAULT_SETTINGS,
    LinkShape,
    NetemBenchConfig,
    NetemCluster,
    NetemRun,
    bandwidth_grid,
    markdown_table,
    plot_speedups,
    snake_nodes,
    sync_link_load,
    train_argv,
    train_options,
    train_rows,
    variant_label,
)
from aqsgd.bench.netem.cluster import _last_exception
from aqsgd.bench.netem_wire import Impairment
from aqsgd.bench.pipeline import summarize
from aqsgd.bench.settings import SETTINGS
from aqsgd.bench.speedmodel import step_time
from aqsgd.cli import build_parser
from aqsgd.cli.netem import config_from_args, register
from aqsgd.cli.train import build_config
from aqsgd.errors import SpecError
from aqsgd.train.config import TrainConfig


def test_tbf_sizes_scale_with_rate():
    (cmd,) = LinkShape(rate_mbit=1000).tc_commands("ns", "east")
    assert cmd[cmd.index("rate") + 1] == "1000000kbit"
    assert int(cmd[cmd.index("burst") + 1]) == 125_000  # 1 ms at line rate
    assert int(cmd[cmd.index("limit") + 1]) == 12_500_000  # 100 ms
    (cmd,) = LinkShape(rate_mbit=1).tc_commands("ns", "east")
    assert int(cmd[cmd.index("burst") + 1]) == 4096 and int(cmd[cmd.index("limit") + 1]) == 256 * 1024
    assert LinkShape(delay_ms=5).tc_commands("ns", "east") == []


def test_link_shape_validation_and_impairment():
    assert not LinkShape(rate_mbit=10).impaired and LinkShape(loss_pct=1).impaired
    with pytest.raises(ValueError):
        LinkShape(delay_ms=5, jitter_ms=10)
    with pytest.raises(ValueError):
        LinkShape(loss_pct=101)
    shape = LinkShape(delay_ms=50, jitter_ms=10, loss_pct=1)
    assert Impairment.from_json(shape.impairment_json()) == Impairment(50, 10, 1)
    assert shape.describe() == "unlimited, 50±10 ms, 1% loss"


def test_bandwidth_grid():
    assert bandwidth_grid(1000, 3.45, step=10) == [1000, 100, 10, 3.45]
    assert bandwidth_grid(1000, 9, step=10) == [1000, 100, 9]  # no extra point a hair above the last
    assert bandwidth_grid(100, 200) == [100]


def test_last_exception_line():
    log = "Traceback...\n  File x\naqsgd.errors.PeerTimeout: stage 1 did not send forward within 4 s\n"
    assert _last_exception(log) == "aqsgd.errors.PeerTimeout: stage 1 did not send forward within 4 s"
    assert (_last_exception("[rank0]: aqsgd.errors.PeerFailure: lost stage 1\n")
            == "aqsgd.errors.PeerFailure: lost stage 1")
    assert _last_exception("all good\n") is None
    # the CLI's line
    assert _last_exception("x\naqsgd: error: lost stage 1 (rank 1)\n") == "lost stage 1 (rank 1)"


def test_snake_placement_gives_every_boundary_its_own_link():
    assert (snake_nodes(2) == [0, 1] and snake_nodes(2, 2) == [0, 1, 3, 2]
            and snake_nodes(3, 2) == [0, 1, 2, 5, 4, 3])
    for stages, replicas in ((2, 2), (4, 2), (2, 3), (3, 3)):
        nodes = snake_nodes(stages, replicas)
        assert sorted(nodes) == list(range(stages * replicas))
        for r in range(replicas):  # consecutive stages of a replica are chain neighbours
            assert all(abs(nodes[r * stages + s + 1] - nodes[r * stages + s]) == 1 for s in range(stages - 1))
    # 2x2: stage 1's replicas are neighbours (link 1), stage 0's span the chain (links 0-2): link 1
    # carries both
    assert sync_link_load(2, 2) == 2 and sync_link_load(4, 2) == 4 and sync_link_load(3, 1) == 0


def test_ideal_model_stretches_the_sync_by_the_link_load():
    row = dict(setting="fp32", stages=2, data_parallel=2, grad_sync="allreduce", bandwidth_mbps=8.0,
               step_s=2.0, samples_per_s=1.0, compute_per_mb_s=0.1, bytes_per_mb=1e5, num_microbatches=4,
               sync_bytes=1e6)
    q8 = {**row, "grad_sync": "q8", "sync_bytes": 2.5e5, "samples_per_s": 1.5}
    one, two = (summarize([dict(row, sync_load=1), dict(q8, sync_load=1)]),
                summarize([dict(row, sync_load=2), dict(q8, sync_load=2)]))
    # the pipeline's step (1F1B, 2 stages, 4 micro-batches of 0.1 s, 0.1 s messages) plus
    # load x sync_bytes x 8 / 8e6
    pipe = step_time("1f1b", 2, 4, 0.1, 0.1, 0.1)
    assert (one[1]["ideal_step_s"] == pytest.approx(pipe + 0.25)
            and two[1]["ideal_step_s"] == pytest.approx(pipe + 0.5))
    assert one[1]["ideal_speedup"] == pytest.approx((pipe + 1.0) / (pipe + 0.25))
    assert two[1]["ideal_speedup"] == pytest.approx((pipe + 2.0) / (pipe + 0.5))
    assert two[0]["efficiency"] == pytest.approx((pipe + 2.0) / 2.0)
    assert variant_label(two[1]) == "fp32, D=2 q8" and variant_label({"setting": "fp16"}) == "fp16"


def test_cli_options_and_reports(tmp_path):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="b"))
    args = parser.parse_args(["netem", "--quick", "--settings", "fp32", "aqsgd fw2/bw4", "--stages", "4",
                              "--data-parallel", "2", "--grad-syncs", "allreduce", "powersgd:rank4"])
    cfg = config_from_args(args)
    assert isinstance(cfg, NetemBenchConfig) and cfg.stages == 4 and cfg.measure_steps == 3
    assert cfg.data_parallel == 2 and cfg.grad_syncs == ("allreduce", "powersgd:rank4")
    assert cfg.dp_settings == ("fp32", "aqsgd fw2/bw4")
    assert cfg.settings == ("fp32", "aqsgd fw2/bw4") and set(cfg.settings) <= set(SETTINGS)
    assert config_from_args(parser.parse_args(["netem"])).settings == DEFAULT_SETTINGS
    rows = [{"setting": s, "bandwidth_mbps": bw, "link_mbps": bw * 0.95, "samples_per_s": 10.0 * k,
             "speedup_vs_fp32": float(k), "ideal_speedup": float(k), "efficiency": 1.0,
             "comm_compute_ratio": 1.0}
            for bw in (100, 10) for k, s in enumerate(("fp32", "aqsgd fw2/bw4"), start=1)]
    table = markdown_table(rows)
    assert table.count("\n") == 1 + len(rows) and "| 10 | 9.5 | aqsgd fw2/bw4 | 20.0 |" in table
    plot_speedups(rows, tmp_path / "s.png")
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
    json.dumps(rows)


def test_run_train_checks_the_options_before_starting_anything(tmp_path):
    cluster = NetemCluster(2)  # not entered: no namespaces exist, nothing may be started
    with pytest.raises(ValueError, match="--run-name"):
        cluster.run_train({"task": "synthetic-lm", "stages": 2}, tmp_path)
    with pytest.raises(SpecError, match="stages"):
        cluster.run_train({"task": "synthetic-lm", "stages": 0, "run_name": "x"}, tmp_path)
    with pytest.raises(SpecError, match="no_such_option"):
        cluster.run_train({"no_such_option": 1, "run_name": "x"}, tmp_path)
    assert not cluster._procs


def test_train_argv_is_the_command_line_of_the_options():
    opts = {"task": "synthetic-lm", "model_layers": 2, "layers": [1, 1], "lr": 1e-3, "progress": False,
            "overwrite": True, "max_steps": None}
    argv = train_argv(opts)
    assert argv == ["--task", "synthetic-lm", "--model-layers", "2", "--layers", "1,1", "--lr", "0.001",
                    "--no-progress", "--overwrite", "--max-steps", "none"]
    with pytest.raises(ValueError, match="nope"):
        train_argv({"nope": 1})


def test_sweep_runs_are_trainer_options(tmp_path):
    """One run of the sweep: a tiny synthetic run as trainer options; it parses back to the same settings."""
    cfg = NetemBenchConfig(hidden=64, layers=2, seq_len=32, vocab=128, measure_steps=3, timeout_s=30)
    opts = train_options(cfg, "aqsgd fw2/bw4", replicas=2, grad_sync="q8", output_dir=tmp_path, run_name="r")
    parsed = build_config(build_parser().parse_args(["train", *train_argv(opts)]))
    assert parsed == TrainConfig.from_flat(opts).validate()
    assert (parsed.task.name, parsed.model.name, parsed.model.layers, parsed.model.hidden_size) == \
        ("synthetic-lm", "tiny-llama", 2, 64)
    # one global batch per epoch
    assert parsed.task.max_train_samples == parsed.global_batch_size == 2 * 4 * 4
    assert (parsed.compression.forward, parsed.compression.backward) == ("delta:q2", "direct:q4")
    assert (parsed.compression.warmup_epochs, parsed.optim.epochs) == (1, 4)
    assert (parsed.run.eval_every, parsed.run.checkpoint_every) == (0, 0)
    assert (parsed.pipeline.data_parallel, parsed.pipeline.grad_sync, parsed.pipeline.runtime) == \
        (2, "q8", "distributed")


def test_metrics_steps_for_fault_injection(tmp_path):
    """``NetemRun.wait_for_step`` follows the trainer's metrics as they are written (a line being written does
    not count) and returns early once the processes are gone; ``train_rows`` keeps the train rows only."""
    metrics = tmp_path / "metrics.jsonl"
    proc = subprocess.Popen(["sleep", "30"])
    try:
        run = NetemRun([proc], 0.0, tmp_path)
        assert run.steps_done() == 0
        rows = [{"kind": "train", "step": 1, "loss": 2.0}, {"kind": "eval", "step": 1},
                {"kind": "train", "step": 2, "loss": 1.5}]

        def write() -> None:
            with open(metrics, "w") as f:
                for row in rows:
                    time.sleep(0.1)
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                f.write('{"kind": "train", "st')  # a row being written
                f.flush()

        writer = threading.Thread(target=write)
        writer.start()
        assert run.wait_for_step(2, timeout_s=30) == 2
        writer.join()
        assert run.steps_done() == 2
        with pytest.raises(TimeoutError):
            run.wait_for_step(3, timeout_s=0.2)
        proc.kill()
        proc.wait()
        assert run.wait_for_step(3, timeout_s=30) == 2  # nothing runs any more: no waiting
    finally:
        proc.kill()
        proc.wait()
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r["step"] for r in train_rows(tmp_path)] == [1, 2]


def test_importing_the_package_does_not_import_the_command_line():
    code = ("import sys, aqsgd.bench.netem; "
            "print(sorted(m for m in sys.modules if m == 'aqsgd.cli' or m.startswith('aqsgd.cli.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
