"""``aqsgd bench vs-torch``: the uncompressed pipeline next to PyTorch's ``torch.distributed.pipelining``.

The same stage modules run under both: a random tiny Llama (:func:`aqsgd.models.tiny_recipe`, the same seed on
every rank) split by :func:`aqsgd.pipeline.partition.partition_model`; each rank keeps its stage and makes one
copy of it per system, so every system starts from the same weights. aqsgd runs them with
:class:`~aqsgd.pipeline.runner.StageRunner` over :class:`~aqsgd.comm.transport.Transport` with no compression
(``direct:none`` both ways); PyTorch runs the same modules, wrapped to take ``(hidden, input_ids=, labels=)``,
as a :class:`torch.distributed.pipelining.PipelineStage` under ``ScheduleGPipe`` and ``Schedule1F1B`` on a
gloo group of its own. Both average the micro-batch losses, both update with AdamW after clipping each stage's
gradient norm to 1, fp32, one CPU thread per process, gloo on loopback.

Timing: every step starts after a barrier; a step's time is the slowest rank's (barrier to the end of its
optimizer step). The systems take turns (interleaved repeats, the order rotated each round) after one untimed
warm-up round; samples/s is the global batch over the median step time, and the ratio is aqsgd / torch for the
same schedule and stage count. The first step of every system starts from the same weights on the same data,
so its loss must be the same for all of them (:data:`LOSS_RTOL`); the rows carry it.

:func:`bench_latency` measures one message between two processes, aqsgd transport against plain
``dist.send``/``dist.recv`` on the same gloo group: *hand-over* (one way: the receive is posted, then the
sender sends; from the send call to the receiver's ``wait`` returning, wall clocks of one machine) and
*ping-pong* (a round trip, the reply sent as soon as the message is in). aqsgd is measured twice, with payload
CRCs (the default) and without them (``Transport(checksum=False)``, trusted links); the three take turns per
size and round, and each message is sent after 1 ms idle, as a pipeline stage sends after computing.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["LOSS_RTOL", "LatencyConfig", "VsTorchConfig", "bench_latency", "bench_vs_torch", "check_losses"]

LOSS_RTOL = 1e-5
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}
SYSTEMS = ("aqsgd", "aqsgd-nocrc", "torch")  # the latency test's: aqsgd with and without payload CRCs


@dataclasses.dataclass
class VsTorchConfig:
    stages: Sequence[int] = (2, 4)
    schedules: Sequence[str] = ("gpipe", "1f1b")
    hidden: int = 256
    layers: int = 4
    seq_len: int = 128
    vocab: int = 512
    microbatch_size: int = 4
    num_microbatches: int = 8
    steps: int = 3  # timed steps per system and round
    repeats: int = 4  # timed rounds (after one untimed warm-up round)
    seed: int = 0


@dataclasses.dataclass
class LatencyConfig:
    sizes: Sequence[int] = (4, 4 * 128 * 256 * 4)  # payload bytes: a tiny message and one fp32 activation
    repeats: int = 200
    rounds: int = 3  # interleaved rounds of aqsgd and torch


class _TorchStage(nn.Module):
    """An aqsgd stage as PyTorch's pipelining calls it: activations positional, the batch as keywords."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.stage(None if self.stage.is_first else hidden, {"input_ids": input_ids, "labels": labels})


def _loss_is_output(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return output  # the last stage already returns the micro-batch loss


def _setup(threads: int = 1) -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.set_num_threads(threads)


class _System:
    """One pipeline implementation with its own copy of this rank's stage and its optimizer."""

    def __init__(self, name: str, schedule: str, module: nn.Module) -> None:
        self.name, self.schedule, self.module = name, schedule, module
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=1e-3)

    def update(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class _Aqsgd(_System):
    def __init__(self, schedule: str, module: nn.Module, transport: Any, rank: int, world: int) -> None:
        from aqsgd.pipeline.compression import CompressionConfig
        from aqsgd.pipeline.runner import StageRunner

        super().__init__("aqsgd", schedule, module)
        self.runner = StageRunner(module, rank, world, CompressionConfig.simple(), transport,
                                  schedule=schedule)

    def step(self, ids: torch.Tensor, mbs: int) -> float | None:
        n = ids.shape[0] // mbs
        batches = [{"input_ids": ids[i * mbs:(i + 1) * mbs], "labels": ids[i * mbs:(i + 1) * mbs]}
                   for i in range(n)]
        loss = self.runner.step(batches)
        self.update()
        return None if loss is None else float(loss)


class _Torch(_System):
    def __init__(self, schedule: str, module: nn.Module, group: Any, rank: int, world: int,
                 n_mb: int) -> None:
        from torch.distributed import pipelining

        super().__init__("torch", schedule, module)
        self.rank, self.world = rank, world
        stage = pipelining.PipelineStage(_TorchStage(module), rank, world, torch.device("cpu"), group=group)
        cls = getattr(pipelining, SCHEDULES[schedule])
        self.sched = cls(stage, n_microbatches=n_mb, loss_fn=_loss_is_output)

    def step(self, ids: torch.Tensor, mbs: int) -> float | None:
        last = self.rank == self.world - 1
        losses: list[torch.Tensor] | None = [] if last else None
        args = (ids,) if self.rank == 0 else ()
        self.sched.step(*args, input_ids=ids, labels=ids, target=ids if last else None, losses=losses,
                        return_outputs=False)
        self.update()
        # the schedule's loss tensors can still require grad (they do at one stage): detach to read them
        return float(torch.stack(losses).detach().mean()) if losses else None


def _pipeline_entry(cfg_json: str) -> dict[str, Any]:
    """One stage process: build every system, one warm-up round, then interleaved timed rounds."""
    from aqsgd.comm.transport import Transport
    from aqsgd.models import tiny_recipe
    from aqsgd.pipeline.partition import partition_model

    cfg = VsTorchConfig(**json.loads(cfg_json))
    _setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    recipe = tiny_recipe("llama", layers=cfg.layers, hidden=cfg.hidden, vocab=cfg.vocab, seq_len=cfg.seq_len)
    torch.manual_seed(cfg.seed)
    mine = partition_model(recipe.build("cpu"), world)[rank]
    torch_group = dist.new_group(list(range(world)), backend="gloo")
    transport = Transport(timeout_s=300.0)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    batch = cfg.microbatch_size * cfg.num_microbatches
    ids = torch.randint(cfg.vocab, (batch, cfg.seq_len), generator=gen)
    systems: list[Any] = []
    for sched in cfg.schedules:
        systems.append(_Aqsgd(sched, copy.deepcopy(mine), transport, rank, world))
        systems.append(_Torch(sched, copy.deepcopy(mine), torch_group, rank, world, cfg.num_microbatches))
    times: dict[str, list[float]] = {f"{s.name} {s.schedule}": [] for s in systems}
    first_loss: dict[str, float | None] = {}
    try:
        for rnd in range(cfg.repeats + 1):
            shift = rnd % len(systems)
            for s in systems[shift:] + systems[:shift]:
                key = f"{s.name} {s.schedule}"
                for _ in range(cfg.steps):
                    dist.barrier()
                    t0 = time.perf_counter()
                    loss = s.step(ids, cfg.microbatch_size)
                    dt = time.perf_counter() - t0
                    if key not in first_loss:
                        first_loss[key] = loss
                    if rnd > 0:
                        times[key].append(dt)
        dist.barrier()
    finally:
        transport.close()
    return {"rank": rank, "times": times, "first_loss": first_loss}


def check_losses(rows: Sequence[dict[str, Any]], rtol: float = LOSS_RTOL) -> None:
    """Raise if the first-step losses of the rows of one stage count differ by more than ``rtol``."""
    for stages, group in itertools.groupby(sorted(rows, key=lambda r: r["stages"]),
                                           key=lambda r: r["stages"]):
        losses = [v for r in group for v in (r["aqsgd_first_loss"], r["torch_first_loss"])]
        ref = losses[0]
        if any(abs(v - ref) > rtol * abs(ref) for v in losses):
            raise AssertionError(f"{stages} stages: first-step losses differ: {losses}")


def pipelining_supported() -> str | None:
    """None where this torch's ``torch.distributed.pipelining`` runs the comparison; else why not. Its
    schedules take ``step(return_outputs=False)`` from torch 2.8 on; before, they concatenate the last stage's
    outputs (the micro-batches' scalar losses), which fails."""
    import inspect

    from torch.distributed.pipelining import ScheduleGPipe

    if "return_outputs" in inspect.signature(ScheduleGPipe.step).parameters:
        return None
    return (f"the comparison needs torch.distributed.pipelining's Schedule.step(return_outputs=...), from "
            f"torch 2.8 on; this is torch {torch.__version__}")


def bench_vs_torch(cfg: VsTorchConfig, progress=None) -> list[dict[str, Any]]:
    """One row per (stage count, schedule): samples/s of both, the ratio, the first-step losses."""
    from aqsgd.errors import SpecError

    why = pipelining_supported()
    if why is not None:
        raise SpecError(f"aqsgd bench vs-torch: {why}")
    from aqsgd.comm.launch import launch_local

    rows = []
    for stages in cfg.stages:
        if progress:
            progress(f"{stages} stages: {len(cfg.schedules)} schedules x (aqsgd, torch), {cfg.repeats} "
                     f"rounds of {cfg.steps} steps after a warm-up round")
        per_rank = launch_local(_pipeline_entry, stages, json.dumps(dataclasses.asdict(cfg), default=list),
                                run_id="aqsgd-vs-torch")
        last = per_rank[-1]
        batch = cfg.microbatch_size * cfg.num_microbatches
        for sched in cfg.schedules:
            row: dict[str, Any] = {"stages": stages, "schedule": sched, "torch_schedule": SCHEDULES[sched]}
            for name in ("aqsgd", "torch"):
                key = f"{name} {sched}"
                steps = [max(ts) for ts in zip(*(r["times"][key] for r in per_rank))]  # slowest rank per step
                med = statistics.median(steps)
                row[f"{name}_step_s"] = med
                row[f"{name}_samples_per_s"] = batch / med
                row[f"{name}_first_loss"] = last["first_loss"][key]
            row["ratio"] = row["aqsgd_samples_per_s"] / row["torch_samples_per_s"]
            rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------ latency
def _latency_entry(cfg_json: str) -> dict[str, Any]:
    from aqsgd.comm.transport import BACKWARD, FORWARD, Transport
    from aqsgd.compress import make_codec

    cfg = LatencyConfig(**json.loads(cfg_json))
    _setup()
    rank = dist.get_rank()
    peer = 1 - rank
    codec = make_codec("none")
    out: dict[str, list[float]] = {}
    # aqsgd with payload CRCs (the default) and without (trusted links), used in turn on the same group
    transports = {"aqsgd": Transport(timeout_s=60.0),
                  "aqsgd-nocrc": Transport(timeout_s=60.0, checksum=False)}
    try:
        for rnd in range(cfg.rounds + 1):  # round 0: warm-up
            for size in cfg.sizes:
                x = torch.randn(max(1, size // 4))
                packets = [codec.encode(x)]
                buf = torch.empty_like(x)
                for system in SYSTEMS:
                    transport = transports.get(system)
                    hand, ping = [], []
                    for _ in range(cfg.repeats):
                        # hand-over: receive posted first, then one message 0 -> 1
                        if transport is not None:
                            h = transport.irecv(peer, FORWARD) if rank == 1 else None
                            dist.barrier()
                            if rank == 0:
                                time.sleep(0.001)
                                t0 = time.time()
                                transport.isend(packets, 1, FORWARD).wait()
                                hand.append(t0)
                            else:
                                h.wait()
                                hand.append(time.time())
                        else:
                            w = dist.irecv(buf, 0) if rank == 1 else None
                            dist.barrier()
                            if rank == 0:
                                time.sleep(0.001)
                                t0 = time.time()
                                dist.send(x, 1)
                                hand.append(t0)
                            else:
                                w.wait()
                                hand.append(time.time())
                        # ping-pong: 0 -> 1 -> 0
                        dist.barrier()
                        if transport is not None:
                            if rank == 0:
                                r = transport.irecv(1, BACKWARD)
                                t0 = time.perf_counter()
                                transport.isend(packets, 1, FORWARD)
                                r.wait()
                                ping.append(time.perf_counter() - t0)
                            else:
                                got = transport.irecv(0, FORWARD).wait()
                                transport.isend(got, 0, BACKWARD).wait()
                        else:
                            if rank == 0:
                                t0 = time.perf_counter()
                                dist.send(x, 1)
                                dist.recv(buf, 1)
                                ping.append(time.perf_counter() - t0)
                            else:
                                dist.recv(buf, 0)
                                dist.send(buf, 0)
                    if rnd > 0:
                        out.setdefault(f"{system} {size} hand", []).extend(hand)
                        out.setdefault(f"{system} {size} ping", []).extend(ping)
        dist.barrier()
    finally:
        for transport in transports.values():
            transport.close()
    return out


def bench_latency(cfg: LatencyConfig) -> list[dict[str, Any]]:
    """Per payload size: median hand-over and ping-pong of aqsgd's transport and of plain send/recv (ms)."""
    from aqsgd.comm.launch import launch_local

    sender, receiver = launch_local(_latency_entry, 2, json.dumps(dataclasses.asdict(cfg), default=list),
                                    run_id="aqsgd-latency")
    rows = []
    for size in cfg.sizes:
        row: dict[str, Any] = {"payload_bytes": size}
        for system in SYSTEMS:
            key = f"{system} {size}"
            hand = [b - a for a, b in zip(sender[f"{key} hand"], receiver[f"{key} hand"])]
            name = system.replace("-", "_")
            row[f"{name}_handover_ms"] = 1e3 * statistics.median(hand)
            row[f"{name}_pingpong_ms"] = 1e3 * statistics.median(sender[f"{key} ping"])
        for name, ratio in (("aqsgd", ""), ("aqsgd_nocrc", "_nocrc")):
            row[f"handover_ratio{ratio}"] = row[f"{name}_handover_ms"] / row["torch_handover_ms"]
            row[f"pingpong_ratio{ratio}"] = row[f"{name}_pingpong_ms"] / row["torch_pingpong_ms"]
        rows.append(row)
    return rows


def write_json(payload: dict[str, Any], path: str | os.PathLike[str]) -> None:
    from pathlib import Path

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=1, default=list))
