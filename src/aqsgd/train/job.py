"""A pipeline training job on synthetic data: the unit the distributed runtime, its tests and
``aqsgd bench pipeline`` run.

``run_local(job)`` runs every stage in this process; ``run_worker(job)`` runs one stage per process (rank =
stage) over torch.distributed; ``launch(job)`` starts ``job.num_stages`` local processes through PyTorch's own
elastic launcher (the API behind ``torchrun``) and returns every rank's result.

Data parallelism (``data_parallel = D > 1``): ``num_stages * D`` processes in the grid of
:mod:`aqsgd.parallel.grid` (rank = replica * num_stages + stage). Each step's global batch is
``D * num_microbatches * microbatch_size`` samples; replica ``r`` trains on the contiguous shard
``[r * batch_size, (r + 1) * batch_size)`` of it (the same sample ids on every stage of its pipeline, so AQ-SGD
caches stay consistent), and every stage averages its gradients over its replicas with ``grad_sync`` (see
:mod:`aqsgd.parallel.sync`). Replica ``r``'s micro-batch ``m`` is micro-batch ``r * num_microbatches + m`` of a
single pipeline run with ``D * num_microbatches`` micro-batches, which is what the tests compare against. All three load the same
weights file and draw the same micro-batches, so their losses can be compared directly.

Start-up checks: every rank publishes its settings (the whole job, as JSON) and compares them with rank 0's
before anything else happens, so stages started with different codecs, stage counts or shapes stop with a
:class:`~aqsgd.errors.ConfigMismatchError` naming the differing setting.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from aqsgd.comm import LinkSpec, Transport
from aqsgd.comm.launch import leave_process_group
from aqsgd.comm.transport import naming_peer_failures
from aqsgd.data.datasets import collate, epoch_order
from aqsgd.data.synthetic import SyntheticLM, microbatches
from aqsgd.errors import ConfigMismatchError
from aqsgd.parallel import ProcessGrid, make_grad_sync, parse_grad_sync
from aqsgd.pipeline.compression import CompressionConfig
from aqsgd.pipeline.materialize import ModelRecipe, init_weights_file, load_weights, materialize_stage
from aqsgd.pipeline.partition import partition_model, shared_parameters
from aqsgd.schemes import Phase
from aqsgd.train.engine import OptimConfig, PipelineEngine

__all__ = ["JobConfig", "JobResult", "run_local", "run_worker", "launch", "check_same_settings", "tiny_lm_recipe"]

log = logging.getLogger(__name__)


def tiny_lm_recipe(kind: str = "llama", *, layers: int = 4, hidden: int = 64, vocab: int = 128,
                   seq_len: int = 32) -> ModelRecipe:
    """A small randomly initialized causal LM (no weights file yet)."""
    if kind == "gpt2":
        config = {"model_type": "gpt2", "n_layer": layers, "n_embd": hidden, "n_head": 4, "vocab_size": vocab,
                  "n_positions": max(64, seq_len), "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                  "bos_token_id": 0, "eos_token_id": 0}
    elif kind == "llama":
        config = {"model_type": "llama", "num_hidden_layers": layers, "hidden_size": hidden,
                  "intermediate_size": 2 * hidden, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "vocab_size": vocab, "max_position_embeddings": max(64, seq_len), "pad_token_id": 0,
                  "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}
    else:
        raise ValueError(f"tiny_lm_recipe kind must be gpt2 or llama, got {kind!r}")
    return ModelRecipe(kind, config)


@dataclasses.dataclass
class JobConfig:
    """Everything a stage process needs; identical on every rank (checked at start-up)."""

    recipe: dict[str, Any]
    num_stages: int = 2
    layers: list[int] | None = None
    balance: str = "layers"
    schedule: str = "1f1b"
    num_microbatches: int = 4
    microbatch_size: int = 4
    seq_len: int = 32
    num_samples: int = 64
    data_seed: int = 0
    forward: str = "delta:q2"
    backward: str = "direct:q4"
    cache: str = "memory"
    ef_key: str = "slot"
    steps: int = 8
    warmup_steps: int = 0  # leading steps sent uncompressed (AQ-SGD fills its cache there)
    optimizer: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    seed: int = 0
    link: str | None = None  # emulated link, e.g. "100mbit,5ms"
    timeout_s: float = 60.0
    trace: str | None = None  # chrome-trace JSON path (one file per stage: PATH.stageN.json)
    data_parallel: int = 1  # replicas of the pipeline (world size = num_stages * data_parallel)
    grad_sync: str = "allreduce"  # gradient sync between replicas: allreduce | q<b>[:block<N>] | powersgd[:rank<R>]
    grad_bucket_mb: float = 25.0  # gradient bucket size for grad_sync

    def __post_init__(self) -> None:
        if not isinstance(self.data_parallel, int) or self.data_parallel < 1:
            raise ValueError(f"data_parallel must be a positive integer, got {self.data_parallel!r}")
        parse_grad_sync(self.grad_sync)  # SpecError naming the valid forms

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> JobConfig:
        return cls(**json.loads(text))

    @property
    def batch_size(self) -> int:
        return self.num_microbatches * self.microbatch_size

    @property
    def global_batch_size(self) -> int:
        """Samples per step over all replicas."""
        return self.batch_size * self.data_parallel

    def compression(self) -> CompressionConfig:
        return CompressionConfig.simple(self.forward, self.backward, num_samples=self.num_samples, cache=self.cache,
                                        ef_key=self.ef_key, seed=self.seed)

    def optim(self) -> OptimConfig:
        return OptimConfig(self.optimizer, self.lr, self.weight_decay, 0, 0, self.max_grad_norm)

    def dataset(self) -> SyntheticLM:
        vocab = ModelRecipe.from_dict(self.recipe).config.get("vocab_size", 128)
        return SyntheticLM(self.num_samples, self.seq_len, vocab, seed=self.data_seed)

    def step_batches(self, step: int, dataset: SyntheticLM, replica: int = 0) -> list[dict[str, torch.Tensor]]:
        """Replica ``replica``'s micro-batches of step ``step`` (its contiguous shard of the global batch)."""
        per_epoch = math.ceil(self.num_samples / self.global_batch_size)
        epoch, i = divmod(step, per_epoch)
        start = i * self.global_batch_size + replica * self.batch_size
        ids = epoch_order(self.num_samples, seed=self.data_seed, epoch=epoch)[start : start + self.batch_size]
        return microbatches(collate([dataset[int(j)] for j in ids]), self.num_microbatches)

    def phase(self, step: int) -> Phase:
        return Phase.WARMUP if step < self.warmup_steps else Phase.TRAIN


@dataclasses.dataclass
class JobResult:
    stage: int | None  # None: all stages (local)
    losses: list[float | None]
    step_s: list[float]
    bytes_sent: dict[str, list[int]]  # per direction, per step
    raw_bytes: dict[str, list[int]]
    compute_s: list[float]
    encode_s: list[float]
    decode_s: list[float]
    wait_s: list[float]
    replica: int = 0
    sync_bytes: list[int] = dataclasses.field(default_factory=list)  # data-parallel gradient sync, per step


def _record(result: JobResult, engine: PipelineEngine, stages: list[int]) -> None:
    stats = engine.stats()
    for d in ("forward", "backward"):
        result.bytes_sent[d].append(sum(stats[s].bytes_sent[d] for s in stages))
        result.raw_bytes[d].append(sum(stats[s].raw_bytes[d] for s in stages))
    result.compute_s.append(sum(stats[s].compute_s for s in stages))
    result.encode_s.append(sum(stats[s].encode_s for s in stages))
    result.decode_s.append(sum(stats[s].decode_s for s in stages))
    result.wait_s.append(sum(stats[s].wait_s for s in stages))
    result.sync_bytes.append(engine.last_sync_bytes)


def _new_result(stage: int | None) -> JobResult:
    return JobResult(stage, [], [], {"forward": [], "backward": []}, {"forward": [], "backward": []}, [], [], [], [])


def _train(job: JobConfig, engine: PipelineEngine, stages: list[int], result: JobResult,
           replica: int = 0) -> JobResult:
    data = job.dataset()
    fault = os.environ.get("AQSGD_FAULT")  # fault injection for tests: "STAGE:STEP:exit" or "STAGE:STEP:hang:SECONDS"
    for step in range(job.steps):
        if fault:
            f_stage, f_step, kind, *secs = fault.split(":")
            if int(f_stage) in stages and int(f_step) == step:
                log.warning("AQSGD_FAULT: stage %s %s at step %d", f_stage, kind, step)
                if kind == "exit":
                    os._exit(3)
                time.sleep(float(secs[0]) if secs else 3600.0)
        batches = job.step_batches(step, data, replica)
        t0 = time.perf_counter()
        others = [f"stage {s}" for s in range(job.num_stages) if s not in stages]
        with naming_peer_failures(getattr(engine, "transport", None), f"training step {step}", others):
            loss = engine.train_step(batches, job.phase(step))
        result.step_s.append(time.perf_counter() - t0)
        result.losses.append(loss)
        _record(result, engine, stages)
    return result


def _write_trace(path: str | None, events: list[dict], suffix: str) -> None:
    if path and events:
        Path(f"{path}{suffix}.json").write_text(json.dumps({"traceEvents": events}))


def run_local(job: JobConfig) -> JobResult:
    """All stages in this process (same numerics as :func:`run_worker`). One pipeline only: for the
    equivalent of ``data_parallel = D`` run ``num_microbatches * D`` micro-batches with ``data_parallel = 1``."""
    if job.data_parallel != 1:
        raise ConfigMismatchError(
            f"run_local runs one pipeline, got data_parallel={job.data_parallel}; use run_worker/launch with "
            f"{job.num_stages * job.data_parallel} processes, or data_parallel=1 with "
            f"num_microbatches={job.num_microbatches * job.data_parallel} for the same global batch")
    recipe = ModelRecipe.from_dict(job.recipe)
    torch.manual_seed(job.seed)
    model = load_weights(recipe.build("cpu"), recipe.weights)
    stages = partition_model(model, job.num_stages, layers=job.layers, balance=job.balance)
    trace: list[dict] | None = [] if job.trace else None
    engine = PipelineEngine(dict(enumerate(stages)), job.num_stages, job.compression(), job.optim(),
                            schedule=job.schedule, trace=trace)
    result = _train(job, engine, list(range(job.num_stages)), _new_result(None))
    _write_trace(job.trace, trace or [], ".local")
    return result


def check_same_settings(settings: dict[str, Any], group: Any = None) -> None:
    """All-gather every rank's settings (JSON bytes, no pickle) and raise ConfigMismatchError on any
    difference from rank 0's, naming the setting and the ranks."""
    text = json.dumps(settings, sort_keys=True).encode()
    world = dist.get_world_size(group)
    size = torch.tensor([len(text)], dtype=torch.long)
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    buf = torch.zeros(longest, dtype=torch.uint8)
    buf[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    bufs = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(bufs, buf, group=group)
    every = [json.loads(bytes(b[: int(s.item())].tolist())) for b, s in zip(bufs, sizes)]
    problems = []
    for rank, other in enumerate(every[1:], start=1):
        for key in sorted(set(every[0]) | set(other)):
            if every[0].get(key) != other.get(key):
                problems.append(f"{key}: rank 0 has {every[0].get(key)!r}, rank {rank} has {other.get(key)!r}")
    if problems:
        raise ConfigMismatchError("stage processes were started with different settings: " + "; ".join(problems[:8]))


def run_worker(job: JobConfig) -> JobResult:
    """One stage per process; ``torch.distributed`` is initialized from the environment if needed."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=max(job.timeout_s, 10)))
    check_same_settings(dataclasses.asdict(job))
    return run_stage(job)


def run_stage(job: JobConfig) -> JobResult:
    """Train this process's stage of an already checked job (rank = stage, or with data parallelism the
    grid of :mod:`aqsgd.parallel.grid`)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if job.data_parallel == 1 and world != job.num_stages:
        raise ConfigMismatchError(f"{world} processes for {job.num_stages} stages; start one process per stage")
    grid = ProcessGrid.build(job.num_stages, job.data_parallel) if job.data_parallel > 1 else None
    stage, replica = (grid.stage, grid.replica) if grid is not None else (rank, 0)
    recipe = ModelRecipe.from_dict(job.recipe)
    torch.manual_seed(job.seed)
    module = materialize_stage(recipe, job.num_stages, stage, layers=job.layers, balance=job.balance)
    ties = shared_parameters(partition_model(recipe.build("meta"), job.num_stages, layers=job.layers,
                                             balance=job.balance))
    links = LinkSpec.parse(job.link) if job.link else None
    labels = grid.peer_labels() if grid is not None else {r: f"stage {r}" for r in range(world)}
    grad_sync = (make_grad_sync(job.grad_sync, grid.dp_group, bucket_mb=job.grad_bucket_mb, link=links,
                                seed=job.seed) if grid is not None else None)
    transport = Transport(timeout_s=job.timeout_s, links=links, peer_labels=labels)
    trace: list[dict] | None = [] if job.trace else None
    suffix = f".stage{stage}" if grid is None else f".stage{stage}.replica{replica}"
    try:
        engine = PipelineEngine({stage: module}, job.num_stages, job.compression(), job.optim(),
                                schedule=job.schedule, transport=transport, ties=ties, trace=trace, grid=grid,
                                grad_sync=grad_sync)
        result = _new_result(stage)
        result.replica = replica
        return _train(job, engine, [stage], result, replica)
    finally:
        transport.close()
        _write_trace(job.trace, trace or [], suffix)


def _elastic_entry(job_json: str) -> dict[str, Any]:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [rank %(process)d] %(message)s")
    job = JobConfig.from_json(job_json)
    result = run_worker(job)
    leave_process_group(clean=True, timeout_s=job.timeout_s)
    return dataclasses.asdict(result)


def launch(job: JobConfig, *, log_dir: str | None = None) -> list[JobResult]:
    """Start one local process per stage with PyTorch's elastic launcher (what ``torchrun`` uses) on
    loopback (``num_stages * data_parallel`` with data parallelism) and return their results in rank order. A
    failing stage stops the others (non-zero exit)."""
    from aqsgd.comm.launch import launch_local

    return [JobResult(**r) for r in launch_local(_elastic_entry, job.num_stages * job.data_parallel, job.to_json())]


def ensure_weights(job: JobConfig, directory: str | None = None) -> JobConfig:
    """Give the job a weights file (seeded random init) if its recipe has none."""
    recipe = ModelRecipe.from_dict(job.recipe)
    if recipe.weights:
        return job
    directory = directory or tempfile.mkdtemp(prefix="aqsgd-weights-")
    path = Path(directory) / f"{recipe.fingerprint()}-seed{job.seed}.safetensors"
    if not path.exists():
        init_weights_file(recipe, path, job.seed)
    return dataclasses.replace(job, recipe=recipe.with_weights(path).to_dict())


def main(argv: list[str] | None = None) -> int:
    """``python -m aqsgd.train.job JOB.json [--result PATH]``: run this process's stage of a job, with the
    rank, world size and rendezvous taken from the environment (``torchrun`` or any launcher that sets
    RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT). Writes this stage's :class:`JobResult` as JSON."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m aqsgd.train.job", description=main.__doc__)
    parser.add_argument("job", help="job JSON file (JobConfig fields)")
    parser.add_argument("--result", default=None, help="write this stage's result JSON here ({rank} is replaced)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    job = JobConfig.from_json(Path(args.job).read_text())
    result = run_worker(job)
    if args.result:
        Path(args.result.format(rank=dist.get_rank())).write_text(json.dumps(dataclasses.asdict(result)))
    leave_process_group(clean=True, timeout_s=job.timeout_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
