"""``aqsgd bench pipeline`` as a client of the trainer: a tiny sweep in one set of stage processes."""

from __future__ import annotations

import pytest

from aqsgd.bench.pipeline import PipelineBenchConfig, bench_pipeline, measure, train_config

ROW_FIELDS = {"setting", "stages", "data_parallel", "grad_sync", "bandwidth_mbps", "forward", "backward",
              "step_s", "compute_per_mb_s", "bytes_per_mb", "sync_bytes", "num_microbatches", "samples_per_s",
              "speedup_vs_fp32", "ideal_speedup", "efficiency", "comm_compute_ratio", "ideal_step_s",
              "stage_compute_per_mb_s", "fw_bytes_per_mb", "bw_bytes_per_mb", "schedule", "latency_ms"}


def test_a_run_is_a_training_config(tmp_path):
    cfg = PipelineBenchConfig(hidden=32, layers=2, seq_len=16, vocab=64, microbatch_size=2,
                              num_microbatches=3, measure_steps=2)
    c = train_config(cfg, stages=2, data_parallel=1, setting="aqsgd fw2/bw4", bandwidth_mbps=100,
                     grad_sync="allreduce", output_dir=str(tmp_path), run_name="r").validate()
    assert ((c.task.name, c.model.name, c.model.layers, c.model.hidden_size)
            == ("synthetic-lm", "tiny-llama", 2, 32))
    assert ((c.compression.forward, c.compression.backward, c.pipeline.link)
            == ("delta:q2", "direct:q4", "100mbit,0ms"))
    assert c.task.max_train_samples == c.global_batch_size == 6  # one global batch per epoch
    assert ((c.optim.epochs, c.compression.warmup_epochs, c.run.eval_every, c.run.checkpoint_every)
            == (3, 1, 0, 0))


def test_measure_takes_the_medians_of_the_timed_steps():
    def row(phase, step_s, compute, fw):
        stage = {"step_s": step_s, "compute_s": compute, "encode_s": 0.0, "decode_s": 0.0, "fw_bytes": fw,
                 "bw_bytes": 0, "sync_bytes": 0}
        return {"phase": phase, "stages": [stage, {**stage, "compute_s": compute / 2, "fw_bytes": 0}]}

    rows = [row("warmup", 9.0, 9.0, 999), row("train", 1.0, 0.4, 80), row("train", 3.0, 0.8, 80),
            row("train", 2.0, 0.6, 80)]
    m = measure(rows, num_microbatches=4, global_batch=8)
    assert m["step_s"] == 2.0 and m["samples_per_s"] == 4.0
    assert m["compute_per_mb_s"] == pytest.approx(0.6 / 4) and m["bytes_per_mb"] == 20
    assert m["stage_compute_per_mb_s"] == pytest.approx([0.6 / 4, 0.3 / 4])
    # boundary 0: stage 0 out, stage 1 back
    assert m["fw_bytes_per_mb"] == [20] and m["bw_bytes_per_mb"] == [0]


@pytest.mark.slow
def test_sweep_produces_its_rows(tmp_path):
    cfg = PipelineBenchConfig(stages=(2,), bandwidths_mbps=(1000,), settings=("fp32", "aqsgd fw2/bw4"),
                              hidden=32, layers=2, seq_len=16, vocab=64, microbatch_size=2,
                              num_microbatches=2, measure_steps=2)
    rows = bench_pipeline(cfg, str(tmp_path))
    assert [r["setting"] for r in rows] == ["fp32", "aqsgd fw2/bw4"]
    for r in rows:
        assert ROW_FIELDS <= set(r), ROW_FIELDS - set(r)
        assert r["step_s"] > 0 and r["samples_per_s"] > 0
    fp32, aq = rows
    assert fp32["speedup_vs_fp32"] == 1.0 and fp32["schedule"] == "1f1b"
    assert fp32["efficiency"] == pytest.approx(fp32["ideal_step_s"] / fp32["step_s"])
    assert aq["bytes_per_mb"] < fp32["bytes_per_mb"] / 4  # 2-bit codes plus per-channel scales against fp32
