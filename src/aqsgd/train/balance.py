"""``--balance measured`` in the trainer: profile the stages as they run, then choose the split.

Before training, :func:`measure_split` builds the stages with the ``layers`` split (the same code path as the
run's own stages, with uncompressed boundaries and no optimizer step), runs ``--balance-passes`` pipeline
passes of the first training batches (after one more that warms up), and times every stage's forward and
backward per micro-batch, and each block's forward inside it (:class:`~aqsgd.pipeline.balance.ForwardTimer`).
Distributed, every process times its own stage, and an all-reduce (the maximum over a stage's replicas: the
slowest one sets the pace) gives every process the same figures, from which each computes the same split
(:mod:`aqsgd.pipeline.balance`); rank 0's is broadcast all the same. The profiling stages are then dropped
and the trainer builds the run's stages with the chosen split from the initial weights, with the seed reset,
so the run is the one ``--layers`` with that split would train.

The chosen split becomes the run's ``--layers`` (``config.json``, every checkpoint), so ``--resume``,
``aqsgd export`` and ``aqsgd eval`` rebuild the same stages; the profile is logged, written to
``metrics.jsonl`` as a ``"kind": "balance"`` row, and kept in the run summary.
"""

from __future__ import annotations

import gc
import logging
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from aqsgd.comm.transport import naming_peer_failures
from aqsgd.pipeline.balance import ForwardTimer, StageProfile, choose_split, fit_cost_model, parse_slow_stages
from aqsgd.pipeline.partition import count_parameters, even_counts, model_layout
from aqsgd.schemes import Phase
from aqsgd.train.build import build_engine
from aqsgd.train.linkcontrol import LinkController

if TYPE_CHECKING:
    from aqsgd.parallel import ProcessGrid
    from aqsgd.train.config import TrainConfig
    from aqsgd.train.engine import PipelineEngine
    from aqsgd.train.feed import DataFeed
    from aqsgd.train.tasks import TaskSetup

__all__ = ["measure_split", "emulate_slow_stages"]

log = logging.getLogger(__name__)


def emulate_slow_stages(engine: PipelineEngine, cfg: TrainConfig) -> None:
    """Slow the engine's stages down as ``--emulate-slow-stage`` says (none without it)."""
    spec = cfg.pipeline.emulate_slow_stage
    factors = parse_slow_stages(spec, cfg.pipeline.stages) if spec else {}
    for i, runner in engine.runners.items():
        runner.slowdown = factors.get(i, 1.0)


def measure_split(cfg: TrainConfig, task: TaskSetup, feed: DataFeed, *, grid: ProcessGrid | None,
                  run_dir: Path, total_steps: int, suspects: Sequence[str]) -> dict[str, Any]:
    """Profile the stages of the run of ``cfg`` with the ``layers`` split and choose the split to train with
    (see the module docstring); returns what was measured and chosen, ``layers`` the split. (A resumed run
    takes its checkpoint's split instead, unprofiled: the trainer does not call this then.) Called by every
    process of the run (``grid``: its place, None in the local runtime), before the trainer builds its engine;
    ``suspects``: the stages a failed collective may have lost, for the message."""
    p = cfg.pipeline
    params = [float(count_parameters([b])) for b in model_layout(task.recipe.build("meta")).blocks]
    profiled = even_counts(len(params), p.stages)
    if p.stages == 1:  # one split only: nothing to measure
        return {"balance": "measured", "layers": profiled}
    timed = cfg.replace(layers=profiled)
    built = build_engine(timed, task, grid=grid, run_dir=run_dir, total_steps=total_steps,
                         links=LinkController(timed), profiling=True)
    engine, device, transport = built.engine, built.device, built.transport
    del built
    failed = True
    try:
        emulate_slow_stages(engine, cfg)
        with naming_peer_failures(transport, "profiling the stages (--balance measured)", suspects):
            figures = _profile(engine, feed, device, p.balance_passes, grid is not None)
            del engine
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            figures = _gathered(figures, profiled, grid is not None)
        failed = False
    finally:
        if transport is not None:  # the run's own transport is built with its stages
            transport.close(failed=failed)
    profiles = _profiles(figures, profiled)
    model = fit_cost_model(profiles, profiled, params)
    chosen = choose_split(model, profiled)
    if grid is not None:
        shared = [chosen]
        dist.broadcast_object_list(shared, src=0)
        chosen = shared[0]
    result = {
        "balance": "measured", "layers": chosen, "profiled_layers": profiled, "passes": p.balance_passes,
        "stage_ms": [1e3 * s.compute_s for s in profiles],
        "predicted_ms": [1e3 * t for t in model.predict(chosen)],
        "speed": model.speed, "fixed_ms": [1e3 * f for f in model.fixed],
        "peak_mb": ([None if s.peak_bytes is None else s.peak_bytes / 2**20 for s in profiles]
                    if any(s.peak_bytes is not None for s in profiles) else None),
    }
    if p.emulate_slow_stage:
        result["emulated"] = p.emulate_slow_stage
    if grid is None or grid.rank == 0:
        log.info("--balance measured: stages with %s blocks computed %s ms per micro-batch; training with %s "
                 "blocks (predicted %s ms, slowest %.2f -> %.2f ms)", _csv(profiled), _ms(result["stage_ms"]),
                 _csv(chosen), _ms(result["predicted_ms"]), max(result["stage_ms"]),
                 max(result["predicted_ms"]))
    return result


def _csv(values: list[int]) -> str:
    return ",".join(map(str, values))


def _ms(values: list[float]) -> str:
    return "/".join(f"{v:.2f}" for v in values)


def _profile(engine: PipelineEngine, feed: DataFeed, device: torch.device, passes: int,
             distributed: bool) -> dict[int, dict[str, Any]]:
    """Per stage this process owns: the medians over ``passes`` pipeline passes (after one that warms up) of
    its compute and forward per micro-batch and of each block's forward, and its device's peak memory (with
    one stage per process on a GPU)."""
    cuda = device.type == "cuda"
    timer = ForwardTimer(engine.stages, sync=cuda)
    for runner in engine.runners.values():
        runner.synchronize = True
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    batches = feed.train_batches(0)
    samples: dict[int, list[tuple[float, float, list[float]]]] = {i: [] for i in engine.stages}
    with timer.attached():
        for k in range(passes + 1):
            mbs = feed.passes([batches[k % len(batches)]])[0]
            timer.reset()
            engine.forward_backward(mbs, Phase.TRAIN)
            for o in engine.optimizers.values():
                o.zero_grad(set_to_none=True)
            if k == 0:
                continue
            for i, stats in engine.stats().items():
                n = max(timer.calls[i], 1)
                samples[i].append((stats.compute_s / len(mbs), timer.forward_s[i] / n,
                                   [b / n for b in timer.block_s[i]]))
    peak = torch.cuda.max_memory_allocated(device) if cuda and distributed else None
    out = {}
    for i, rows in samples.items():
        out[i] = {"compute_s": statistics.median(r[0] for r in rows),
                  "forward_s": statistics.median(r[1] for r in rows),
                  "blocks": [statistics.median(r[2][k] for r in rows) for k in range(len(rows[0][2]))],
                  "peak_bytes": peak}
    return out


# per stage in the gathered vector: compute, forward, peak bytes + 1 (0: not measured), timed blocks (0 or 1)
_PER_STAGE = 4


def _gathered(figures: dict[int, dict[str, Any]], counts: list[int], distributed: bool) -> torch.Tensor:
    """Every stage's figures in one vector (per stage :data:`_PER_STAGE` entries, then each block's forward at
    its index in the model, the stages holding ``counts`` blocks), all-reduced over the processes of a
    distributed run by their maximum."""
    stages = len(counts)
    v = torch.zeros(stages * _PER_STAGE + sum(counts), dtype=torch.float64)
    for i, f in figures.items():
        v[i * _PER_STAGE:(i + 1) * _PER_STAGE] = torch.tensor(
            [f["compute_s"], f["forward_s"], 0.0 if f["peak_bytes"] is None else f["peak_bytes"] + 1.0,
             1.0 if f["blocks"] else 0.0], dtype=torch.float64)
        if f["blocks"]:
            start = stages * _PER_STAGE + sum(counts[:i])
            v[start:start + len(f["blocks"])] = torch.tensor(f["blocks"], dtype=torch.float64)
    if distributed:
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
    return v


def _profiles(v: torch.Tensor, counts: list[int]) -> list[StageProfile]:
    out, start = [], len(counts) * _PER_STAGE
    for i, n in enumerate(counts):
        compute, forward, peak, timed = v[i * _PER_STAGE:(i + 1) * _PER_STAGE].tolist()
        blocks = v[start:start + n].tolist() if timed else []
        out.append(StageProfile(compute, forward, blocks, int(peak - 1) if peak > 0 else None))
        start += n
    return out
