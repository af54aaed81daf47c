"""Building a run's engine: the stages one process owns, their boundary schemes, optimizers and, distributed,
the transport, tied-weight groups and the replicas' gradient sync.

:func:`build_engine` is the one place that does it, for the trainer and for ``--balance measured``'s
profiling (:mod:`aqsgd.train.balance`), which builds the stages with another split and uncompressed
boundaries and times them. Locally every stage is built in this process; distributed, each process
materializes its own stage only (:func:`~aqsgd.pipeline.materialize.materialize_stage`).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from aqsgd.comm import Transport
from aqsgd.errors import ConfigMismatchError, SpecError
from aqsgd.parallel.grid import check_same_settings
from aqsgd.comm.device import check_backends, gpu_sharing, group_backend, resolve_device, resolve_dp_backend
from aqsgd.parallel import make_grad_sync, make_outer_sync, parse_grad_sync
from aqsgd.pipeline.checkpointing import checkpoint_blocks
from aqsgd.pipeline.compression import BACKWARD_CHANNEL, FORWARD_CHANNEL, BoundarySpec, CompressionConfig
from aqsgd.pipeline.materialize import load_weights, materialize_stage
from aqsgd.pipeline.partition import StageCut, shared_parameters
from aqsgd.train.engine import OptimConfig, PipelineEngine
from aqsgd.train.lora import LoraSettings, add_adapters, is_trainable

if TYPE_CHECKING:
    from aqsgd.parallel import ProcessGrid
    from aqsgd.train.config import TrainConfig
    from aqsgd.train.linkcontrol import LinkController
    from aqsgd.train.tasks import TaskSetup

__all__ = ["Built", "build_engine", "check_partition", "check_processes", "collective_timeout",
           "compute_dtype", "warmup_codecs"]

log = logging.getLogger(__name__)


def check_partition(cfg: TrainConfig, recipe: Any) -> None:
    """The model can be cut as ``--stages`` / ``--layers`` ask (one line naming the option if not)."""
    from aqsgd.pipeline.partition import model_layout, stage_layer_counts

    balance = cfg.pipeline.balance
    try:  # measured: profiled with the layers split, then chosen while the run starts
        stage_layer_counts(model_layout(recipe.build("meta")), cfg.pipeline.stages, cfg.pipeline.layers,
                           "layers" if balance == "measured" else balance)
    except ValueError as e:
        option = (f"--layers {','.join(map(str, cfg.pipeline.layers))}" if cfg.pipeline.layers is not None
                  else f"--stages {cfg.pipeline.stages}")
        raise SpecError(f"{option}: {e}") from None


def check_processes(cfg: TrainConfig, distributed: bool) -> None:
    """The runtime and the process group agree: distributed needs a group of exactly stages x replicas
    processes, all with the same settings."""
    p = cfg.pipeline
    if p.runtime == "distributed" and not distributed:
        raise ConfigMismatchError(
            "runtime 'distributed' needs torch.distributed initialized in every stage process (start it "
            "with `aqsgd train --runtime distributed`, or torchrun and init_process_group); use runtime "
            "'local' to run all stages in this process")
    if not distributed:
        return
    if dist.get_world_size() != cfg.world_size:
        start = (f"stages = {cfg.world_size} processes (a replica of --dp-elastic is a process group of its "
                 "own)" if p.dp_replica is not None else
                 f"stages x data_parallel = {cfg.world_size} processes (one per stage and replica)")
        raise ConfigMismatchError(f"{dist.get_world_size()} processes for {p.stages} stages x "
                                  f"{p.world_replicas} data-parallel replicas: start exactly {start}")
    settings = cfg.flat()
    if cfg.compression.cache.startswith("lowbit"):
        # each side re-encodes its cache rows: bit-identical sides need the same kind of device (an eager
        # CUDA encode may round a code differently from the CPU's; decoding agrees everywhere)
        settings["device kind (the low-bit cache encodes on both sides of a boundary)"] = (
            resolve_device(p.device, distributed=True).type)
    check_same_settings(settings)


def collective_timeout(timeout: float) -> float:
    """Seconds a collective of the run's groups (the gradient norm, the replicas' sync, metrics) waits for
    every member: ``--timeout``, but at least 10 s. A collective waits for the slowest stage to end its step
    (the pipeline's drain, a kernel compiled at its first call), where a link's ``--timeout`` bounds one
    message."""
    return max(float(timeout), 10.0)


def compute_dtype(spec: str, device: torch.device) -> str:
    """``fp32`` or ``bf16`` for ``--dtype spec`` on ``device``: ``auto`` is bf16 on a GPU that supports it."""
    if spec != "auto":
        return spec
    return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"


def warmup_codecs(cfg: TrainConfig) -> dict[int, str]:
    """``--warmup-codec``: the channels whose warm-up and first visits it compresses (every direction with a
    fixed compressed setting; validated to be direct or delta) and the codec; auto links send their level
    instead (:meth:`~aqsgd.train.linkcontrol.LinkController.attach`)."""
    c = cfg.compression
    if c.warmup == "none":
        return {}
    return {FORWARD_CHANNEL if d == "forward" else BACKWARD_CHANNEL: c.warmup for d in c.fixed_compressed()}


@dataclasses.dataclass
class Built:
    """What :func:`build_engine` made: the engine, the device its stages compute on and (distributed) the
    transport, which the caller closes."""

    engine: PipelineEngine
    device: torch.device
    transport: Transport | None = None


def build_engine(cfg: TrainConfig, task: TaskSetup, *, grid: ProcessGrid | None, run_dir: Path,
                 total_steps: int, links: LinkController, profiling: bool = False,
                 cache_ids: int | None = None) -> Built:
    """The stages this process owns (all of them without ``grid``, its own one with it) and their engine.
    ``profiling`` (``--balance measured``): stages whose compute is timed, with uncompressed boundaries.
    ``cache_ids``: how many ids per-sample state is keyed by (:meth:`~aqsgd.train.feed.DataFeed.cache_ids`:
    the training set's real tokens where only those cross; default its samples)."""
    p, o = cfg.pipeline, cfg.optim
    # locally every stage computes on one device; distributed, each process on cuda:(LOCAL_RANK mod GPUs)
    device = resolve_device(p.device, distributed=grid is not None)
    check_backends(device, p.p2p_backend, p.dp_backend)
    optim = OptimConfig(o.optimizer, o.lr, o.weight_decay, int(o.lr_warmup * total_steps), total_steps,
                        o.max_grad_norm)
    comp = _compression(cfg, len(task.train) if cache_ids is None else cache_ids, run_dir, grid, links)
    if profiling:  # no codec and no cache: neither takes time nor writes files while stages are timed
        comp = CompressionConfig.simple("none", "none")
    autocast = torch.bfloat16 if compute_dtype(o.dtype, device) == "bf16" else None
    torch.manual_seed(o.seed)
    recipe = task.recipe
    # Weights are built and loaded on the CPU in both runtimes (the same numbers), then moved; Module.to keeps
    # the Parameter objects, so weights tied across local stages stay shared.
    if grid is None:
        model = load_weights(recipe.build("cpu"), recipe.weights)
        parts = StageCut.of(p).cut(model)
        if cfg.model.lora:
            add_adapters(parts, LoraSettings.of(cfg.model), model=model, seed=o.seed)
        if p.activation_checkpointing:
            for part in parts:
                checkpoint_blocks(part)
        stages = [s.to(device) for s in parts]
        engine = PipelineEngine(dict(enumerate(stages)), p.stages, comp, optim, schedule=p.schedule,
                                device=device, autocast=autocast)
        return Built(engine, device)
    initial, sync_link = links.process_links(grid)
    module = materialize_stage(recipe, p.stages, grid.stage, layers=p.layers, balance=p.balance)
    if cfg.model.lora:
        add_adapters(module, LoraSettings.of(cfg.model), model=recipe.build("meta"), seed=o.seed,
                     first_stage=grid.stage)
    if p.activation_checkpointing:
        checkpoint_blocks(module)
    module = module.to(device)
    ties = shared_parameters(StageCut.of(p).cut(recipe.build("meta")))
    if cfg.model.lora:  # a frozen tied weight (an embedding and its LM head) gets no gradient to sum
        ties = [t for t in ties if all(is_trainable(name) for name in t.values())]
    grad_sync = outer = None
    if p.dp_elastic:
        # replicas that come and go: this process group is one replica pipeline; its stages meet their
        # replicas at the outer steps through the lighthouse, in groups torchft forms for each
        outer = make_outer_sync(p.grad_sync, list(module.parameters()), None, bucket_mb=p.grad_bucket_mb,
                                link=sync_link, membership=elastic_group(cfg, grid))
    elif p.world_replicas > 1:
        # NCCL replica groups of their own (collective, the same on every rank); gloo: the grid's groups, with
        # the buckets in host memory. Streaming with a delay averages on a worker thread, over gloo groups of
        # its own (the engine's collectives in between must not queue behind it), from host memory.
        group, sync_device = grid.dp_group, torch.device("cpu")
        spec = parse_grad_sync(p.grad_sync)
        if spec.kind == "diloco" and spec.delay:
            group = grid.new_dp_group("gloo", timeout_s=collective_timeout(p.timeout))
        elif resolve_dp_backend(p.dp_backend, device,
                                shared_gpu=replicas_sharing_a_gpu(cfg, grid, device)) == "nccl":
            group = grid.new_dp_group(group_backend("nccl"), timeout_s=collective_timeout(p.timeout))
            sync_device = device
        if spec.kind == "diloco":  # the stage's trainable parameters (LoRA: adapters)
            outer = make_outer_sync(p.grad_sync, list(module.parameters()), group, bucket_mb=p.grad_bucket_mb,
                                    link=sync_link, device=sync_device)
        else:
            grad_sync = make_grad_sync(p.grad_sync, group, bucket_mb=p.grad_bucket_mb, link=sync_link,
                                       seed=o.seed, device=sync_device)
    transport = Transport(timeout_s=p.timeout, links=initial, peer_labels=grid.peer_labels(), device=device,
                          backend=p.p2p_backend, checksum=p.checksum)
    links.pace(transport)
    engine = PipelineEngine({grid.stage: module}, p.stages, comp, optim, schedule=p.schedule, device=device,
                            transport=transport, ties=ties, autocast=autocast, grid=grid, grad_sync=grad_sync,
                            outer=outer)
    return Built(engine, device, transport)


def elastic_group(cfg: TrainConfig, grid: ProcessGrid) -> Any:
    """This stage's :class:`~aqsgd.parallel.elastic.ElasticGroup`: replica ``--dp-replica``, its manager
    found through this process group's own store (``MASTER_ADDR:MASTER_PORT``, which the launcher or torchrun
    set), the lighthouse ``--dp-lighthouse``."""
    import os

    from aqsgd.parallel.elastic import ElasticGroup

    p = cfg.pipeline
    return ElasticGroup(replica=p.dp_replica, stage=grid.stage, num_stages=p.stages,
                        lighthouse=p.dp_lighthouse, store=(os.environ["MASTER_ADDR"],
                                                           int(os.environ["MASTER_PORT"])),
                        timeout_s=collective_timeout(p.timeout))


def _compression(cfg: TrainConfig, samples: int, run_dir: Path, grid: ProcessGrid | None,
                 links: LinkController) -> CompressionConfig:
    """The boundaries' settings: auto links at the top of their ladders, the caches (one disk cache per
    replica: each holds its own samples' rows) and the warm-up codec."""
    c, p = cfg.compression, cfg.pipeline
    cache_dir = None
    if c.cache.startswith("disk"):
        cache_path = run_dir / "cache"
        replica = grid.replica if grid is not None else 0
        cache_dir = str(cache_path / f"replica{replica}" if p.data_parallel > 1 else cache_path)
    return CompressionConfig(BoundarySpec(*links.initial_specs()), num_samples=samples, cache=c.cache,
                             cache_dir=cache_dir, ef_key=c.ef_key, seed=cfg.optim.seed,
                             warmup=warmup_codecs(cfg))


def replicas_sharing_a_gpu(cfg: TrainConfig, grid: ProcessGrid, device: torch.device) -> str | None:
    """Where replicas of a stage would share a GPU (on any machine of the run: every process learns it, so
    that all choose the same backend), in words; None where none would. With ``--dp-backend auto`` the sync
    then goes over gloo, which is said once."""
    if device.type != "cuda" or cfg.pipeline.world_replicas < 2:
        return None
    layout = grid.layout
    here = gpu_sharing([layout.dp_ranks(s) for s in range(layout.num_stages)], layout.label,
                       world_size=cfg.world_size)
    anywhere = torch.tensor([0.0 if here is None else 1.0], dtype=torch.float64)
    dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)
    if not anywhere.item():
        return None
    shared = here or "replicas of a stage would share a GPU on another machine of the run"
    if grid.rank == 0 and cfg.pipeline.dp_backend == "auto":
        log.warning("%s: the data-parallel gradient sync goes over gloo (NCCL cannot put two ranks of one "
                    "group on one GPU; --dp-backend auto)", shared)
    return shared
