"""``aqsgd bench pipeline``: training throughput of real stage processes over emulated links.

For each stage count, one set of processes (started with PyTorch's elastic launcher) runs every
(setting, bandwidth) combination in turn, so process start-up is paid once. Each combination trains a small
Llama-style model on synthetic data: one warm-up epoch uncompressed (AQ-SGD fills its cache there; it is not
timed), then ``measure_steps`` timed steps; samples/s is the batch size over the median step time of the first
stage (its last backward ends a step).

Next to each measured speed-up against fp32 at the same bandwidth we print the *ideal* speed-up of a simple
steady-state model (DESIGN.md §4): a micro-batch costs a stage ``max(c, l)``, with ``c`` the measured compute
plus encode/decode time per micro-batch of the busiest stage, and ``l`` the link time of the larger of the
per-micro-batch forward/backward messages (links are full duplex). Ideal speed-up = ``max(c32, l32) /
max(cX, lX)``; efficiency = measured / ideal. ``comm_compute_ratio`` = ``l32 / c32``.

Data parallelism (``data_parallel`` lists replica counts D > 1): ``stages x D`` processes per stage count and
D, each replica pipeline on its own shard of a D-times larger global batch; every (setting, bandwidth) is
run with each gradient sync in ``grad_syncs`` (``allreduce`` = fp32, ``q8``, ``powersgd:rank4``, ...). The
stage-to-stage links are the transport's emulated links; the gradient collectives inside a data-parallel
group go through gloo directly and are paced by :class:`~aqsgd.parallel.sync.GradSync` (``sync`` does not
return before its bytes would have crossed one full-duplex link of the same bandwidth, plus one latency per
collective round). Rows then also carry ``sync_bytes`` (per rank and step) and two speed-ups:
``speedup_vs_fp32`` (against fp32 boundaries and fp32 all-reduce: nothing compressed) and
``speedup_vs_pipeline_only`` (against the same boundary setting with the fp32 all-reduce: only the pipeline
compressed). The ideal model adds the paced sync time to the pipeline's: ``T = M max(c, l) + sync_s``.
Samples/s = global batch / median step time of rank 0 (stage 0 of replica 0; its step ends after the
gradient sync). All processes share this machine's cores: with ``stages x D`` processes on fewer cores the
compute term is inflated by contention, which the figures include.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from aqsgd.comm.launch import leave_process_group
from aqsgd.train.job import JobConfig, JobResult, ensure_weights, run_stage, tiny_lm_recipe

__all__ = ["SETTINGS", "PipelineBenchConfig", "bench_pipeline", "summarize"]

SETTINGS = {
    "fp32": ("none", "none"),
    "fp16": ("fp16", "fp16"),
    "direct fw2/bw4": ("direct:q2", "direct:q4"),
    "aqsgd fw2/bw4": ("delta:q2", "direct:q4"),
}


@dataclasses.dataclass
class PipelineBenchConfig:
    stages: Sequence[int] = (2, 4)
    bandwidths_mbps: Sequence[float] = (1000, 300, 100, 30, 10)
    settings: Sequence[str] = tuple(SETTINGS)
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


def _jobs(cfg: PipelineBenchConfig, stages: int, weights_dir: str,
          data_parallel: int = 1) -> list[tuple[str, float, JobConfig]]:
    recipe = tiny_lm_recipe("llama", layers=cfg.layers, hidden=cfg.hidden, vocab=cfg.vocab, seq_len=cfg.seq_len)
    batch = cfg.microbatch_size * cfg.num_microbatches * data_parallel
    base = JobConfig(recipe=recipe.to_dict(), num_stages=stages, schedule=cfg.schedule,
                     num_microbatches=cfg.num_microbatches, microbatch_size=cfg.microbatch_size,
                     seq_len=cfg.seq_len, num_samples=batch, steps=1 + cfg.measure_steps, warmup_steps=1,
                     max_grad_norm=1.0, timeout_s=300, data_parallel=data_parallel)
    base = ensure_weights(base, weights_dir)
    syncs = cfg.grad_syncs if data_parallel > 1 else ("allreduce",)
    out = []
    for bw in cfg.bandwidths_mbps:
        for name in cfg.settings:
            for sync in syncs:
                fw, bwd = SETTINGS[name]
                link = f"{bw:g}mbit,{cfg.latency_ms:g}ms"
                out.append((name, bw, dataclasses.replace(base, forward=fw, backward=bwd, link=link,
                                                          grad_sync=sync)))
    return out


def _worker(jobs_json: str) -> list[dict[str, Any]]:
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    # Share the cores between the local processes: with every process on all cores, OpenMP threads spin
    # against each other and one row's compute time was seen inflated 20x (4 processes on 2 cores).
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local)))
    results = []
    for job_json in json.loads(jobs_json):
        job = JobConfig.from_json(job_json)
        results.append(dataclasses.asdict(run_stage(job)))
        dist.barrier()
    return results


def _launch(jobs: list[JobConfig], stages: int) -> list[list[JobResult]]:
    """Run the jobs in one set of processes (``stages`` of them: pass stages x D with data parallelism);
    returns results[job][rank]."""
    from aqsgd.comm.launch import launch_local

    per_rank = launch_local(_bench_entry, stages, json.dumps([j.to_json() for j in jobs]), run_id="aqsgd-bench")
    return [[JobResult(**per_rank[s][j]) for s in range(stages)] for j in range(len(jobs))]


def _bench_entry(jobs_json: str) -> list[dict[str, Any]]:
    results = _worker(jobs_json)
    leave_process_group(clean=True)
    return results


def _measure(job: JobConfig, per_stage: list[JobResult]) -> dict[str, Any]:
    timed = slice(job.warmup_steps, job.steps)
    step_s = statistics.median(per_stage[0].step_s[timed])
    sync_bytes = max(statistics.median(r.sync_bytes[timed]) for r in per_stage)
    m = job.num_microbatches
    # busiest stage's compute + codec time per micro-batch, and its largest per-micro-batch message
    c = max(statistics.median(r.compute_s[timed]) + statistics.median(r.encode_s[timed])
            + statistics.median(r.decode_s[timed]) for r in per_stage) / m
    msg = max(max(statistics.median(r.bytes_sent["forward"][timed]), statistics.median(r.bytes_sent["backward"][timed]))
              for r in per_stage) / m
    return {"step_s": step_s, "compute_per_mb_s": c, "bytes_per_mb": msg, "sync_bytes": sync_bytes,
            "num_microbatches": m, "samples_per_s": job.global_batch_size / step_s}


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add speed-ups, ideal speed-ups, efficiency and the fp32 comm:compute ratio (same stages, replicas and
    bandwidth); with data parallelism also the speed-up over the same boundary setting with the fp32 all-reduce."""
    key = lambda row: (row["stages"], row.get("data_parallel", 1), row["bandwidth_mbps"])  # noqa: E731
    fp32 = lambda row: row.get("grad_sync", "allreduce") == "allreduce"  # noqa: E731
    base = {key(r): r for r in rows if r["setting"] == "fp32" and fp32(r)}
    pipeline_only = {(key(r), r["setting"]): r for r in rows if fp32(r)}
    for r in rows:
        b = base[key(r)]
        bps = r["bandwidth_mbps"] * 1e6
        link = lambda row: row["bytes_per_mb"] * 8 / bps  # noqa: E731
        step = lambda row: (row.get("num_microbatches", 1) * max(row["compute_per_mb_s"], link(row))  # noqa: E731
                            + row.get("sync_bytes", 0) * max(row.get("sync_load", 1), 1) * 8 / bps)
        r["speedup_vs_fp32"] = r["samples_per_s"] / b["samples_per_s"]
        if r.get("data_parallel", 1) > 1:
            r["speedup_vs_pipeline_only"] = r["samples_per_s"] / pipeline_only[(key(r), r["setting"])]["samples_per_s"]
        r["ideal_speedup"] = step(b) / step(r)
        r["efficiency"] = r["speedup_vs_fp32"] / r["ideal_speedup"]
        r["comm_compute_ratio"] = link(b) / b["compute_per_mb_s"]
    return rows


def bench_pipeline(cfg: PipelineBenchConfig, weights_dir: str, progress=None) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for dp in cfg.data_parallel:
        for stages in cfg.stages:
            plan = _jobs(cfg, stages, weights_dir, dp)
            if progress:
                progress(f"{stages} stages x {dp} replicas: {len(plan)} runs ({len(cfg.settings)} settings x "
                         f"{len(cfg.bandwidths_mbps)} bandwidths"
                         + (f" x {len(cfg.grad_syncs)} gradient syncs" if dp > 1 else "")
                         + f"), {cfg.measure_steps} timed steps each")
            # A fresh set of processes pays one-off costs in its first job (allocator growth, thread pools,
            # first gloo connections; seen as a 2-5x slower first row): a copy of it runs first and is dropped.
            results = _launch([plan[0][2]] + [j for _, _, j in plan], stages * dp)[1:]
            for (name, bw, job), per_rank in zip(plan, results):
                rows.append({"setting": name, "stages": stages, "data_parallel": dp, "grad_sync": job.grad_sync,
                             "bandwidth_mbps": bw, "forward": job.forward, "backward": job.backward,
                             **_measure(job, per_rank)})
    return summarize(rows)


def write_json(rows: list[dict[str, Any]], path: str | Path, *, cfg: PipelineBenchConfig, command: str,
               machine: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"benchmark": "pipeline", "command": command, "machine": machine,
                                      "config": dataclasses.asdict(cfg), "rows": rows}, indent=1, default=list))
