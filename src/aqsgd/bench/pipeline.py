"""``aqsgd bench pipeline``: training throughput of real stage processes over emulated links.

For each stage count, one set of processes (started with PyTorch's elastic launcher) runs every
(setting, bandwidth) combination in turn, so process start-up is paid once. Each combination trains a small
Llama-style model on synthetic data: one warm-up epoch uncompressed (AQ-SGD fills its cache there; it is not
timed), then ``measure_steps`` timed steps; samples/s is the batch size over the median step time of the first
stage (its last backward ends a step).

Each row is read against the *speed model* (:mod:`aqsgd.bench.speedmodel`, docs/design.md, "Speed model"):
the shortest step the run's schedule allows with the measured compute + codec time per micro-batch of every
stage and the measured bytes of every boundary's forward and backward messages over links of the row's
bandwidth (one serial line per boundary and direction), pipeline fill and drain included.
``ideal_step_s`` is that step, ``efficiency`` = ``ideal_step_s / step_s`` (1: the run is as fast as its
schedule can be; below 1: time lost to what the model leaves out), ``ideal_speedup`` = ideal step of fp32 /
ideal step of the row, ``comm_compute_ratio`` = fp32 link time of the larger message per micro-batch / the
busiest stage's compute per micro-batch.

Data parallelism (``data_parallel`` lists replica counts D > 1): ``stages x D`` processes per stage count and
D, each replica pipeline on its own shard of a D-times larger global batch; every (setting, bandwidth) is
run with each gradient sync in ``grad_syncs`` (``allreduce`` = fp32, ``q8``, ``powersgd:rank4``, ...). The
stage-to-stage links are the transport's emulated links; the gradient collectives inside a data-parallel
group go through gloo directly and are paced by :class:`~aqsgd.parallel.sync.GradSync` (``sync`` does not
return before its bytes would have crossed one full-duplex link of the same bandwidth, plus one latency per
collective round). Rows then also carry ``sync_bytes`` (per rank and step) and two speed-ups:
``speedup_vs_fp32`` (against fp32 boundaries and fp32 all-reduce: nothing compressed) and
``speedup_vs_pipeline_only`` (against the same boundary setting with the fp32 all-reduce: only the pipeline
compressed). The speed model adds the paced sync time after the pipeline's step.
Samples/s = global batch / median step time of rank 0 (stage 0 of replica 0; its step ends after the
gradient sync). All processes share this machine's cores: with ``stages x D`` processes on fewer cores the
compute term is inflated by contention, which the figures include.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any, Sequence

import torch.distributed as dist

from aqsgd.bench import speedmodel
from aqsgd.bench.settings import SETTINGS
from aqsgd.comm.launch import launch_local, leave_process_group
from aqsgd.train.config import TrainConfig
from aqsgd.train.trainer import Trainer

__all__ = ["DEFAULT_SETTINGS", "PipelineBenchConfig", "bench_pipeline", "measure", "run_options", "summarize",
           "train_config"]

DEFAULT_SETTINGS = ("fp32", "fp16", "direct fw2/bw4", "aqsgd fw2/bw4")


@dataclasses.dataclass
class PipelineBenchConfig:
    stages: Sequence[int] = (2, 4)
    bandwidths_mbps: Sequence[float] = (1000, 300, 100, 30, 10)
    settings: Sequence[str] = DEFAULT_SETTINGS
    hidden: int = 256
    layers: int = 4
    seq_len: int = 128
    vocab: int = 512
    microbatch_size: int = 4
    num_microbatches: int = 8
    measure_steps: int = 6
    latency_ms: float = 0.0
    schedule: str = "1f1b"
    data_parallel: Sequence[int] = (1,)  # replica counts; D > 1 runs stages x D processes
    grad_syncs: Sequence[str] = ("allreduce", "q8")  # gradient syncs compared when D > 1


def run_options(cfg: Any, setting: str, *, stages: int, replicas: int = 1, grad_sync: str = "allreduce",
                link: str | None = None, timeout_s: float, output_dir: str | Path, run_name: str,
                cache_dir: str | Path | None = None) -> dict[str, Any]:
    """One run of a throughput benchmark as training options by their flat names: a random tiny Llama of
    ``cfg``'s sizes (``hidden``, ``layers``, ``seq_len``, ``vocab``, ``microbatch_size``,
    ``num_microbatches``, ``measure_steps``: the fields :class:`PipelineBenchConfig` and the netem sweep's
    config share) on a synthetic set of exactly one global batch, so every epoch is one optimizer step: epoch
    0 uncompressed (AQ-SGD fills its cache there; it is not timed), then ``measure_steps`` timed epochs with
    the setting's codecs and overrides; no evaluation, no checkpoints. ``cache_dir`` holds the initial weights
    file."""
    s = SETTINGS[setting]
    opts: dict[str, Any] = {
        "task": "synthetic-lm", "model": "tiny-llama", "model_layers": cfg.layers, "hidden_size": cfg.hidden,
        "vocab_size": cfg.vocab, "max_length": cfg.seq_len,
        "max_train_samples": cfg.microbatch_size * cfg.num_microbatches * replicas,
        "stages": stages, "micro_batches": cfg.num_microbatches, "micro_batch_size": cfg.microbatch_size,
        "data_parallel": replicas, "grad_sync": grad_sync, "forward": s.forward, "backward": s.backward,
        "warmup_epochs": 1, "epochs": 1 + cfg.measure_steps, "lr": 1e-3, "lr_warmup": 0.0,
        "eval_every": 0, "checkpoint_every": 0, "progress": False, "tensorboard": False,
        "runtime": "distributed", "timeout": float(timeout_s), "output_dir": str(output_dir),
        "run_name": run_name, "overwrite": True, "schedule": getattr(cfg, "schedule", "1f1b"),
    }
    if link is not None:
        opts["link"] = link
    if cache_dir is not None:
        opts["cache_dir"] = str(cache_dir)
    return {**opts, **s.overrides}


def train_config(cfg: PipelineBenchConfig, *, stages: int, data_parallel: int, setting: str,
                 bandwidth_mbps: float, grad_sync: str, output_dir: str, run_name: str) -> TrainConfig:
    """One run of this benchmark (:func:`run_options`) over links emulated in the transport."""
    return TrainConfig.of(**run_options(cfg, setting, stages=stages, replicas=data_parallel,
                                        grad_sync=grad_sync,
                                        link=f"{bandwidth_mbps:g}mbit,{cfg.latency_ms:g}ms", timeout_s=300.0,
                                        output_dir=output_dir, run_name=run_name))


def _plan(cfg: PipelineBenchConfig, stages: int, data_parallel: int,
          output_dir: str) -> list[tuple[str, float, TrainConfig]]:
    syncs = cfg.grad_syncs if data_parallel > 1 else ("allreduce",)
    out = []
    for bw in cfg.bandwidths_mbps:
        for name in cfg.settings:
            for sync in syncs:
                run_name = f"run{len(out)}"
                out.append((name, bw, train_config(cfg, stages=stages, data_parallel=data_parallel,
                                                   setting=name, bandwidth_mbps=bw, grad_sync=sync,
                                                   output_dir=output_dir, run_name=run_name)))
    return out


def _bench_entry(configs_json: str) -> list[list[dict[str, Any]] | None]:
    """One stage process: train every configuration in turn (process start-up is paid once); the process that
    writes the metrics returns each run's train rows."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    # (the launcher shares the cores between the local processes: aqsgd.comm.launch.threads)
    results = []
    for cfg_json in json.loads(configs_json):
        trainer = Trainer(TrainConfig.from_dict(json.loads(cfg_json)))
        trainer.run()
        results.append(trainer.history if trainer.writes_metrics else None)
        dist.barrier()
    leave_process_group(clean=True)
    return results


def measure(rows: list[dict[str, Any]], *, num_microbatches: int, global_batch: int) -> dict[str, Any]:
    """The figures of one run from its train rows (``metrics.jsonl``), warm-up excluded, per micro-batch and
    as medians over the timed steps: the step time of stage 0 (its last backward ends a step), every stage's
    compute + codec time (``stage_compute_per_mb_s``) and the busiest one's (``compute_per_mb_s``), the bytes
    of every boundary's forward message (sent by the stage before it, ``fw_bytes_per_mb``) and backward
    message (sent by the stage after it, ``bw_bytes_per_mb``), the largest of them (``bytes_per_mb``), and the
    gradient-sync bytes per rank."""
    timed = [r for r in rows if r["phase"] != "warmup"]
    stages = list(zip(*(r["stages"] for r in timed)))  # per stage: its dict of every timed step

    def med(stage: Sequence[dict[str, float]], key: str) -> float:
        return statistics.median(d[key] for d in stage)

    m = num_microbatches
    step_s = med(stages[0], "step_s")
    per_stage = [(med(s, "compute_s") + med(s, "encode_s") + med(s, "decode_s")) / m for s in stages]
    fw = [med(s, "fw_bytes") / m for s in stages[:-1]]
    bw = [med(s, "bw_bytes") / m for s in stages[1:]]
    msg = max(max(med(s, "fw_bytes"), med(s, "bw_bytes")) for s in stages) / m
    sync_bytes = max(med(s, "sync_bytes") for s in stages)
    return {"step_s": step_s, "compute_per_mb_s": max(per_stage), "stage_compute_per_mb_s": per_stage,
            "bytes_per_mb": msg, "fw_bytes_per_mb": fw, "bw_bytes_per_mb": bw, "sync_bytes": sync_bytes,
            "num_microbatches": m, "samples_per_s": global_batch / step_s}


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add the speed model's step (``ideal_step_s``, :func:`aqsgd.bench.speedmodel.row_step_time`), efficiency
    (``ideal_step_s / step_s``), speed-ups and ideal speed-ups against fp32 and the fp32 comm:compute ratio
    (same stages, replicas and bandwidth); with data parallelism also the speed-up over the same boundary
    setting with the fp32 all-reduce."""
    key = lambda row: (row["stages"], row.get("data_parallel", 1), row["bandwidth_mbps"])  # noqa: E731
    fp32 = lambda row: row.get("grad_sync", "allreduce") == "allreduce"  # noqa: E731
    base = {key(r): r for r in rows if r["setting"] == "fp32" and fp32(r)}
    pipeline_only = {(key(r), r["setting"]): r for r in rows if fp32(r)}
    for r in rows:
        r["ideal_step_s"] = speedmodel.row_step_time(r)
    for r in rows:
        b = base[key(r)]
        r["speedup_vs_fp32"] = r["samples_per_s"] / b["samples_per_s"]
        if r.get("data_parallel", 1) > 1:
            r["speedup_vs_pipeline_only"] = (r["samples_per_s"]
                                             / pipeline_only[(key(r), r["setting"])]["samples_per_s"])
        r["ideal_speedup"] = b["ideal_step_s"] / r["ideal_step_s"]
        r["efficiency"] = r["ideal_step_s"] / r["step_s"]
        link = speedmodel.transfer_time(b["bytes_per_mb"], r["bandwidth_mbps"] * 1e6)
        r["comm_compute_ratio"] = link / b["compute_per_mb_s"]
    return rows


def bench_pipeline(cfg: PipelineBenchConfig, work_dir: str | None = None,
                   progress=None) -> list[dict[str, Any]]:
    """Every (stage count, replicas, setting, bandwidth, gradient sync) of ``cfg``; run directories go under
    ``work_dir`` (default: a temporary folder, removed afterwards)."""
    with tempfile.TemporaryDirectory(prefix="aqsgd-bench-") as tmp:
        out = work_dir or tmp
        rows: list[dict[str, Any]] = []
        for dp in cfg.data_parallel:
            for stages in cfg.stages:
                plan = _plan(cfg, stages, dp, str(Path(out) / f"s{stages}-d{dp}"))
                if progress:
                    progress(f"{stages} stages x {dp} replicas: {len(plan)} runs ({len(cfg.settings)} "
                             f"settings x {len(cfg.bandwidths_mbps)} bandwidths"
                             + (f" x {len(cfg.grad_syncs)} gradient syncs" if dp > 1 else "")
                             + f"), {cfg.measure_steps} timed steps each")
                # A fresh set of processes pays one-off costs in its first run (allocator growth, thread
                # pools, first gloo connections; seen as a 2-5x slower first row): a copy of it runs first and
                # is dropped.
                first = plan[0][2].replace(run_name="warm-up")
                runs = [first.to_json()] + [c.to_json() for _, _, c in plan]
                per_rank = launch_local(_bench_entry, stages * dp, json.dumps(runs), run_id="aqsgd-bench")
                histories = [next(r[j] for r in per_rank if r[j] is not None) for j in range(1, len(runs))]
                for (name, bw, c), history in zip(plan, histories):
                    rows.append({"setting": name, "stages": stages, "data_parallel": dp,
                                 "grad_sync": c.pipeline.grad_sync, "bandwidth_mbps": bw,
                                 "latency_ms": cfg.latency_ms, "schedule": c.pipeline.schedule,
                                 "forward": c.compression.forward, "backward": c.compression.backward,
                                 **measure(history, num_microbatches=cfg.num_microbatches,
                                           global_batch=c.global_batch_size)})
    return summarize(rows)


def write_json(rows: list[dict[str, Any]], path: str | Path, *, cfg: PipelineBenchConfig, command: str,
               machine: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"benchmark": "pipeline", "command": command, "machine": machine,
                                      "config": dataclasses.asdict(cfg), "rows": rows}, indent=1,
                                     default=list))
