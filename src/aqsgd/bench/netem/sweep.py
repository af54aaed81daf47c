"""The netem benchmark (:func:`bench_netem`, ``aqsgd bench netem``): pipeline throughput over real shaped
links.

``aqsgd bench pipeline`` emulates links inside the transport (a pacer per directed link); this benchmark runs
the same training over *real* TCP links instead, one process per rank in the namespaces of a
:class:`~aqsgd.bench.netem.cluster.NetemCluster`. Every run is ``aqsgd train`` (:func:`train_options`): a
random tiny Llama on synthetic tokens, one global batch per epoch, the first epoch uncompressed (AQ-SGD fills
its cache there; it is not timed), then ``measure_steps`` timed epochs, no evaluation, no checkpoints. The
figures come from the run's ``metrics.jsonl`` (:func:`aqsgd.bench.pipeline.measure`).

First a calibration run of fp32 at the top bandwidth measures the compute time per micro-batch ``c`` and the
fp32 message size; the sweep then goes down from the top bandwidth in steps of ``sqrt(10)`` to the bandwidth
where the fp32 link time per micro-batch is ``target_ratio`` (10) times ``c``. At each bandwidth every setting
runs ``runs`` times (fresh processes each time); samples/s is the median over the runs of each run's
median-step throughput. The step the schedule can reach (:func:`aqsgd.bench.speedmodel.row_step_time`, the
speed model ``aqsgd bench pipeline`` uses too), efficiency = that step / the measured one, speed-ups, ideal
speed-ups and the fp32 comm:compute ratio follow (:func:`aqsgd.bench.pipeline.summarize`). The model uses the
*measured* TCP goodput of the link (``link_mbps``), not the nominal rate, so that efficiency measures how well
the pipeline overlaps communication and compute rather than TCP/IP header overhead; the nominal rate is
reported next to it. Delay stays 0 unless ``delay_ms`` asks for it (it then goes through the user-space wire,
too slow for bulk Gbit/s links).

Data parallelism (``data_parallel = D > 1``): the ``dp_settings`` also run on ``D`` replicas of the pipeline
with each gradient sync of ``grad_syncs`` (fp32 ``allreduce`` the baseline, ``q8``, ``powersgd:rank4``, ...).
The ``S x D`` processes lie along the one chain (:func:`~aqsgd.bench.netem.runs.snake_nodes`: replica 0
forwards, replica 1 backwards, ...), so every pipeline boundary keeps a dedicated link, the last stages of
replicas 0 and 1 are neighbours, and the other stages' replicas reach each other through the chain, as on a
real line of hosts. Their syncs then share links: with 2 stages x 2 replicas the middle link carries both
stages' syncs, and the speed model multiplies the sync time by that load
(:func:`~aqsgd.bench.netem.runs.sync_link_load`). Speed-ups of data-parallel rows are against the fp32
pipeline with the fp32 all-reduce at the same ``D``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from aqsgd.bench.netem.cluster import NetemCluster
from aqsgd.bench.netem.host import NetemError, check_netem
from aqsgd.bench.netem.runs import NetemRun, sync_link_load, train_rows
from aqsgd.bench.netem.shape import LinkShape
from aqsgd.bench import speedmodel
from aqsgd.bench.pipeline import measure, run_options, summarize
from aqsgd.bench.settings import SETTINGS
from aqsgd.comm.link import LinkSchedule, LinkSpec, parse_links
from aqsgd.parallel import parse_grad_sync

__all__ = [
    "DEFAULT_SETTINGS",
    "NetemBenchConfig",
    "bandwidth_grid",
    "bench_netem",
    "bench_netem_links",
    "train_options",
    "variant_label",
]

log = logging.getLogger(__name__)

DEFAULT_SETTINGS = ("fp32", "fp16", "direct fw2/bw4", "aqsgd fw2/bw4", "aqsgd fw4/bw8")
"""The settings the sweep runs unless told otherwise (names of :data:`aqsgd.bench.settings.SETTINGS`)."""


@dataclasses.dataclass
class NetemBenchConfig:
    """What :func:`bench_netem` sweeps. ``bandwidths_mbps`` None: from ``max_mbps`` down in steps of
    sqrt(10) to where fp32's link time is ``target_ratio`` x compute (from a calibration run). Settings are
    names of :data:`aqsgd.bench.settings.SETTINGS`."""

    stages: int = 2
    bandwidths_mbps: Sequence[float] | None = None
    max_mbps: float = 1000.0
    target_ratio: float = 10.0
    settings: Sequence[str] = DEFAULT_SETTINGS
    delay_ms: float = 0.0
    hidden: int = 256
    layers: int = 4
    seq_len: int = 128
    vocab: int = 512
    microbatch_size: int = 4
    num_microbatches: int = 4
    measure_steps: int = 6
    runs: int = 1
    timeout_s: float = 120.0  # the trainer's --timeout: how long a stage waits for a neighbour
    threads: int = 1  # torch threads per process
    grid_step: float = math.sqrt(10)  # ratio between consecutive bandwidths of the derived grid
    # data parallelism: with data_parallel D > 1, dp_settings also run on D replicas of the pipeline (S x D
    # processes along the chain, see snake_nodes) with each gradient sync of grad_syncs
    data_parallel: int = 1
    dp_settings: Sequence[str] = ("fp32", "aqsgd fw2/bw4")
    grad_syncs: Sequence[str] = ("allreduce", "q8")
    schedule: str = "1f1b"  # the pipeline schedule of every run (gpipe or 1f1b)

    @classmethod
    def quick(cls, **kw: Any) -> NetemBenchConfig:
        """A smaller sweep (about 5 minutes on 2 cores): 3 timed steps, bandwidths a factor 10 apart."""
        return cls(**{"measure_steps": 3, "grid_step": 10.0, **kw})


def train_options(cfg: NetemBenchConfig, setting: str, *, replicas: int = 1, grad_sync: str = "allreduce",
                  output_dir: str | Path, run_name: str,
                  cache_dir: str | Path | None = None) -> dict[str, Any]:
    """One run of the sweep as ``aqsgd train`` options (:func:`aqsgd.bench.pipeline.run_options`) over the
    cluster's shaped links; ``cache_dir`` holds the initial weights file, which every run of the same model
    shares."""
    return run_options(cfg, setting, stages=cfg.stages, replicas=replicas, grad_sync=grad_sync,
                       timeout_s=cfg.timeout_s, output_dir=output_dir, run_name=run_name, cache_dir=cache_dir)


def _variants(cfg: NetemBenchConfig) -> list[tuple[str, int, str]]:
    """(setting, replicas, gradient sync) of one bandwidth: every setting on one pipeline, then the
    data-parallel ones."""
    out = [(name, 1, "allreduce") for name in cfg.settings]
    if cfg.data_parallel > 1:
        out += [(name, cfg.data_parallel, sync) for name in cfg.dp_settings for sync in cfg.grad_syncs]
    return out


def variant_label(row: Mapping[str, Any]) -> str:
    """A row's setting with its data parallelism, e.g. ``aqsgd fw2/bw4, D=2 q8``."""
    dp = row.get("data_parallel", 1)
    return row["setting"] if dp == 1 else f"{row['setting']}, D={dp} {row.get('grad_sync', 'allreduce')}"


def bandwidth_grid(max_mbps: float, min_mbps: float, *, step: float = math.sqrt(10)) -> list[float]:
    """``max_mbps``, ``max_mbps/step``, ... while above ``min_mbps``, then ``min_mbps`` itself (3
    significant digits), descending."""
    if min_mbps >= max_mbps:
        return [float(f"{max_mbps:.3g}")]
    grid, bw = [], max_mbps
    while bw > min_mbps * 1.3:  # no point a hair above the last one
        grid.append(float(f"{bw:.3g}"))
        bw /= step
    grid.append(float(f"{min_mbps:.3g}"))
    return grid


def _run_name(bw: float, name: str, replicas: int, sync: str, rep: int | None) -> str:
    """A run directory name (letters, digits and ``_.+=-``) for one run of the sweep."""
    tag = f"{bw:g}-{name}-D{replicas}-{sync}-" + ("calibration" if rep is None else str(rep))
    return re.sub(r"[^A-Za-z0-9_.+=-]", "", tag.replace(" ", "_"))


def _measure(cfg: NetemBenchConfig, replicas: int, rows: list[dict[str, Any]]) -> dict[str, Any]:
    batch = cfg.microbatch_size * cfg.num_microbatches * replicas
    return measure(rows, num_microbatches=cfg.num_microbatches, global_batch=batch)


def _row(cfg: NetemBenchConfig, name: str, replicas: int, sync: str, bw: float, link_mbps: float,
         runs: list[list[dict[str, Any]]]) -> dict[str, Any]:
    measured = [_measure(cfg, replicas, rows) for rows in runs]
    s = SETTINGS[name]
    codecs = {"forward": s.forward, "backward": s.backward, **s.overrides}
    return {"setting": name, "stages": cfg.stages, "data_parallel": replicas, "grad_sync": sync,
            "sync_load": sync_link_load(cfg.stages, replicas), "bandwidth_mbps": bw, "link_mbps": link_mbps,
            "forward": codecs["forward"], "backward": codecs["backward"], "runs": len(runs),
            "samples_per_s": statistics.median(m["samples_per_s"] for m in measured),
            "samples_per_s_runs": [m["samples_per_s"] for m in measured],
            "step_s": statistics.median(m["step_s"] for m in measured),
            "compute_per_mb_s": statistics.median(m["compute_per_mb_s"] for m in measured),
            "bytes_per_mb": statistics.median(m["bytes_per_mb"] for m in measured),
            **{k: [statistics.median(v) for v in zip(*(m[k] for m in measured))]
               for k in ("stage_compute_per_mb_s", "fw_bytes_per_mb", "bw_bytes_per_mb")},
            "sync_bytes": statistics.median(m["sync_bytes"] for m in measured),
            "num_microbatches": cfg.num_microbatches, "schedule": cfg.schedule, "latency_ms": cfg.delay_ms}


def _summarize_with_link_rate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`aqsgd.bench.pipeline.summarize` over the measured goodput instead of the nominal rate."""
    for r in rows:
        r["nominal_mbps"], r["bandwidth_mbps"] = r["bandwidth_mbps"], r["link_mbps"]
    # rows of one nominal bandwidth share one goodput measurement, so the grouping is unchanged
    summarize(rows)
    for r in rows:
        r["bandwidth_mbps"] = r.pop("nominal_mbps")
    return rows


def _check(cfg: NetemBenchConfig) -> None:
    """ValueError for settings, data-parallel settings or gradient syncs the sweep cannot run."""
    unknown = [s for s in cfg.settings if s not in SETTINGS]
    if unknown or "fp32" not in cfg.settings:
        raise ValueError(f"settings must include fp32 and come from {list(SETTINGS)}; got "
                         f"{list(cfg.settings)}")
    unknown = [s for s in cfg.dp_settings if s not in SETTINGS] if cfg.data_parallel > 1 else []
    if unknown or (cfg.data_parallel > 1 and "fp32" not in cfg.dp_settings):
        raise ValueError(f"dp_settings must include fp32 and come from {list(SETTINGS)}; got "
                         f"{list(cfg.dp_settings)}")
    for sync in cfg.grad_syncs:
        parse_grad_sync(sync)
    if cfg.data_parallel > 1 and "allreduce" not in cfg.grad_syncs:
        raise ValueError(f"grad_syncs must include allreduce (the baseline); got {list(cfg.grad_syncs)}")


def bench_netem(cfg: NetemBenchConfig, workdir: str | Path,
                progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the sweep over real shaped links; returns ``{"calibration": ..., "links": ..., "rows": ...}``
    with one summarized row per (bandwidth, setting) (see the module docs). Run directories go to
    ``workdir/runs``, the processes' logs to ``workdir/logs``, the initial weights to ``workdir/cache``."""
    check_netem()
    _check(cfg)
    say = progress or (lambda msg: log.info("%s", msg))
    workdir = Path(workdir)
    results: dict[tuple[float, str, int, str], list[list[dict[str, Any]]]] = {}
    links: dict[float, dict[str, float]] = {}

    def run(cluster: NetemCluster, name: str, bw: float, replicas: int = 1, sync: str = "allreduce",
            rep: int | None = None) -> list[dict[str, Any]]:
        run_name = _run_name(bw, name, replicas, sync, rep)
        opts = train_options(cfg, name, replicas=replicas, grad_sync=sync, output_dir=workdir / "runs",
                             run_name=run_name, cache_dir=workdir / "cache")
        label = variant_label({"setting": name, "data_parallel": replicas, "grad_sync": sync})
        t0 = time.monotonic()
        outcomes = cluster.run_train(opts, workdir / "logs" / run_name, deadline_s=900, threads=cfg.threads)
        bad = [o for o in outcomes if not o.ok]
        if bad:
            raise NetemError(f"{label} at {bw:g} Mbit/s: rank {bad[0].stage} failed "
                             f"({bad[0].error or bad[0].returncode}):\n{bad[0].log_tail}")
        rows = train_rows(workdir / "runs" / run_name)
        m = _measure(cfg, replicas, rows)
        say(f"  {label:<30} {bw:>7g} Mbit/s: {m['samples_per_s']:8.1f} samples/s "
            f"(step {m['step_s'] * 1e3:.0f} ms, run {time.monotonic() - t0:.1f} s)")
        return rows

    def measure_links(cluster: NetemCluster, bw: float) -> dict[str, float]:
        fw = cluster.measure_goodput(0, 1)
        bwd = cluster.measure_goodput(1, 0)
        say(f"link {bw:g} Mbit/s (delay {cfg.delay_ms:g} ms): TCP goodput 0->1 {fw:.1f}, 1->0 {bwd:.1f} "
            f"Mbit/s ({min(fw, bwd) / bw:.1%} of nominal)")
        return {"forward_mbps": fw, "backward_mbps": bwd}

    with NetemCluster(cfg.stages * max(cfg.data_parallel, 1)) as cluster:
        top = cfg.bandwidths_mbps[0] if cfg.bandwidths_mbps else cfg.max_mbps
        cluster.shape_all(LinkShape(rate_mbit=top, delay_ms=cfg.delay_ms))
        links[top] = measure_links(cluster, top)
        say(f"calibration: fp32 at {top:g} Mbit/s, {cfg.stages} stages")
        calib = run(cluster, "fp32", top)
        m = _measure(cfg, 1, calib)
        c, nbytes = m["compute_per_mb_s"], m["bytes_per_mb"]
        target_mbps = nbytes * 8 / (cfg.target_ratio * c) / 1e6
        grid = list(cfg.bandwidths_mbps) if cfg.bandwidths_mbps else bandwidth_grid(cfg.max_mbps, target_mbps,
                                                                                       step=cfg.grid_step)
        calibration = {"compute_per_mb_s": c, "fp32_bytes_per_mb": nbytes, "bandwidth_mbps": top,
                       "target_ratio": cfg.target_ratio, "target_mbps": target_mbps, "grid_mbps": grid}
        say(f"compute {c * 1e3:.1f} ms per micro-batch, fp32 message {nbytes / 1024:.0f} KiB: link time = "
            f"{cfg.target_ratio:g}x compute at {target_mbps:.1f} Mbit/s; sweep {grid} Mbit/s, "
            f"{len(_variants(cfg))} settings x {cfg.runs} run(s)")
        for bw in grid:
            if bw not in links:
                cluster.shape_all(LinkShape(rate_mbit=bw, delay_ms=cfg.delay_ms))
                links[bw] = measure_links(cluster, bw)
            for name, replicas, sync in _variants(cfg):
                for rep in range(cfg.runs):
                    key = (bw, name, replicas, sync)
                    if bw == top and name == "fp32" and replicas == 1 and rep == 0:
                        results.setdefault(key, []).append(calib)
                        continue
                    results.setdefault(key, []).append(run(cluster, name, bw, replicas, sync, rep))
    rows = []
    for bw in grid:
        link = links[bw]
        # the speed model's line: the slower direction's measured goodput
        link_mbps = min(link["forward_mbps"], link["backward_mbps"], bw)
        for name, replicas, sync in _variants(cfg):
            rows.append(_row(cfg, name, replicas, sync, bw, link_mbps, results[(bw, name, replicas, sync)]))
    return {"calibration": calibration, "links": {f"{bw:g}": v for bw, v in links.items()},
            "rows": _summarize_with_link_rate(rows)}


def _shape_of(spec: LinkSpec) -> LinkShape:
    return LinkShape(rate_mbit=None if spec.bandwidth_bps is None else spec.bandwidth_bps / 1e6,
                     delay_ms=spec.latency_s * 1e3)


def _shape_boundaries(cluster: NetemCluster, schedules: Sequence[LinkSchedule], step: int) -> None:
    """Give every boundary's link (both directions) its setting at ``step``."""
    for b, schedule in enumerate(schedules):
        cluster.shape_link(b, b + 1, _shape_of(schedule.at(step)))


def bench_netem_links(cfg: NetemBenchConfig, links: str, workdir: str | Path,
                      progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every setting of ``cfg`` once per run over one tc setting per boundary (``links`` as ``--link`` reads
    it: ``"1gbit/50mbit/200mbit"``, and ``~SPEC@STEP`` for a link that changes during the run: the harness
    re-shapes it with tc as soon as the run's metrics show step ``STEP - 1`` done, so the change lands at the
    step boundary or within the step that follows). Returns ``{"links": ..., "goodput": ..., "rows": ...}``:
    per boundary the measured TCP goodput of its initial setting, and per setting the median step of the
    timed steps, samples/s, the speed-up against fp32, the codecs every link sent with at every step (those
    ``auto`` chose) and, for links that do not change, the step the speed model allows over the measured
    goodputs (``ideal_step_s``) and the efficiency."""
    check_netem()
    _check(cfg)
    if cfg.data_parallel > 1:
        raise ValueError("one tc setting per boundary is for a single pipeline: no --data-parallel with "
                         "--link")
    schedules = parse_links(links, cfg.stages - 1)
    say = progress or (lambda msg: log.info("%s", msg))
    workdir = Path(workdir)
    varies = any(s.varies for s in schedules)
    rows = []
    with NetemCluster(cfg.stages) as cluster:
        _shape_boundaries(cluster, schedules, 1)
        goodput = [min(cluster.measure_goodput(b, b + 1), cluster.measure_goodput(b + 1, b))
                   for b in range(cfg.stages - 1)]
        say(f"links {links}: TCP goodput per boundary {', '.join(f'{g:.1f}' for g in goodput)} Mbit/s")

        def follow(run: NetemRun) -> None:  # the schedule's changes, from outside, as the run reaches them
            for step in sorted({step for s in schedules for step, _ in s.changes}):
                if run.wait_for_step(step - 1, timeout_s=900) < step - 1:
                    return  # the run ended first
                _shape_boundaries(cluster, schedules, step)

        for name in cfg.settings:
            _shape_boundaries(cluster, schedules, 1)
            run_name = _run_name(0, name, 1, "links", 0)
            opts = train_options(cfg, name, output_dir=workdir / "runs", run_name=run_name,
                                 cache_dir=workdir / "cache")
            t0 = time.monotonic()
            outcomes = cluster.run_train(opts, workdir / "logs" / run_name, deadline_s=900,
                                         threads=cfg.threads, during=follow if varies else None)
            bad = [o for o in outcomes if not o.ok]
            if bad:
                raise NetemError(f"{name} over {links}: rank {bad[0].stage} failed "
                                 f"({bad[0].error or bad[0].returncode}):\n{bad[0].log_tail}")
            train = train_rows(workdir / "runs" / run_name)
            m = _measure(cfg, 1, train)
            row = {"setting": name, "links": links, "stages": cfg.stages, **m,
                   "codecs": [r.get("codecs") for r in train], "schedule": cfg.schedule}
            if not varies:
                bps = [g * 1e6 for g in goodput]
                row["ideal_step_s"] = speedmodel.step_time(
                    cfg.schedule, cfg.stages, cfg.num_microbatches, m["stage_compute_per_mb_s"],
                    [speedmodel.transfer_time(n, b) for n, b in zip(m["fw_bytes_per_mb"], bps)],
                    [speedmodel.transfer_time(n, b) for n, b in zip(m["bw_bytes_per_mb"], bps)],
                    latency_s=max(s.initial.latency_s for s in schedules))
                row["efficiency"] = row["ideal_step_s"] / row["step_s"]
            rows.append(row)
            say(f"  {name:<20} {m['samples_per_s']:8.1f} samples/s (step {m['step_s'] * 1e3:.0f} ms, run "
                f"{time.monotonic() - t0:.1f} s)")
    fp32 = next(r for r in rows if r["setting"] == "fp32")
    for r in rows:
        r["speedup_vs_fp32"] = r["samples_per_s"] / fp32["samples_per_s"]
    return {"links": links, "goodput_mbps": goodput, "rows": rows}
