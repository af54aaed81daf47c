"""Running a training configuration wherever it says: all stages in this process (``runtime = "local"``), or
one process per stage and replica (``"distributed"``), either started here on this machine through PyTorch's
elastic launcher or already started by ``torchrun`` (then this process trains its own rank).

:func:`run_training` is what ``aqsgd train`` calls; :func:`worker` is the body of every stage process.
"""

from __future__ import annotations

import json
import logging
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from torch.utils.data import Dataset

from aqsgd.comm.device import (check_backends, check_p2p_sharing, gpu_sharing, resolve_device,
                               resolve_dp_backend, world_backend)
from aqsgd.comm.launch import (LOOPBACK, address_towards, launch, leave_process_group, rank_thread_share,
                               started_as_rank)
from aqsgd.comm.launch.local import spawned_here
from aqsgd.comm.launch.placement import NODE_RANK_ENV, Seat, node_rank_given, take_seat
from aqsgd.comm.launch.threads import intra_op_threads
from aqsgd.data.datasets import TaskSpec, register_task, registered_tasks
from aqsgd.errors import Interrupted, SpecError
from aqsgd.interrupts import stop_on_signals
from aqsgd.logs import configure, prefixed
from aqsgd.parallel.grid import GridLayout
from aqsgd.train.config import TrainConfig
from aqsgd.train.rundir import check_run_dir, last_logged_step, resolve_run_dir
from aqsgd.train.tasks import setup_task
from aqsgd.train.build import check_partition, collective_timeout
from aqsgd.train.resume import where_to_continue
from aqsgd.train.trainer import Trainer

__all__ = ["run_training", "worker"]

log = logging.getLogger(__name__)


def worker(cfg_json: str, data: tuple[Dataset, Dataset] | None = None,
           tasks: Sequence[TaskSpec] = ()) -> dict[str, Any] | None:
    """One stage process: join the process group (from the environment, with the rank its machine's node rank
    places it at: :mod:`aqsgd.comm.launch.placement`), train that rank's stage, leave the group; every log
    line it writes names its stage and replica. The process that writes the metrics (last stage of replica
    0) returns the run's summary, the others None.

    ``data`` are datasets given from Python and ``tasks`` the tasks registered in the launching process (a
    spawned process starts with neither)."""
    with stop_on_signals(again="ignore"):  # the launcher (ours or torchrun) forwards a signal it gets itself
        return _stage(cfg_json, data, tasks)


def _stage(cfg_json: str, data: tuple[Dataset, Dataset] | None,
           tasks: Sequence[TaskSpec]) -> dict[str, Any] | None:
    configure(logging.INFO, "%(asctime)s %(levelname)s [pid %(process)d] %(message)s")
    for spec in tasks:
        register_task(spec, replace=True)
    cfg = TrainConfig.from_dict(json.loads(cfg_json))
    seat = _take_seat(cfg)
    rank = dist.get_rank() if seat is None else seat.rank
    with prefixed(_log_prefix(cfg, rank)):  # this process's stage and replica on each of its log lines
        if seat is not None:
            if (placed := seat.describe()) is not None:
                log.info("%s", placed)
            if started_as_rank() and not spawned_here() and seat.claim.local_rank == 0:  # torchrun's rank
                log.info("%s", rank_thread_share(cfg.pipeline.threads).describe())
            # the process's GPU is current before the group exists (NCCL binds to it); see aqsgd.comm.device
            device = resolve_device(cfg.pipeline.device, distributed=True)
            check_backends(device, cfg.pipeline.p2p_backend, cfg.pipeline.dp_backend)
            check_p2p_sharing(cfg.pipeline.p2p_backend, device, _layout(cfg).label, world_size=cfg.world_size)
            seat.init_process_group(world_backend(device, cfg.pipeline.p2p_backend),
                                    collective_timeout(cfg.pipeline.timeout))
        clean = False
        try:
            trainer = Trainer(cfg, data=data)
            summary = trainer.run()
            clean = True
        finally:
            leave_process_group(clean=clean, timeout_s=cfg.pipeline.timeout)
    return summary if trainer.writes_metrics else None


def _take_seat(cfg: TrainConfig) -> Seat | None:
    """This process's rank in the job, agreed with the others from the node rank each machine asks for
    (:mod:`aqsgd.comm.launch.placement`); None where ``torch.distributed`` was initialized already (a script
    that called ``init_process_group`` keeps its ranks, and a node rank set here is said to be ignored)."""
    if not dist.is_initialized():
        return take_seat(collective_timeout(cfg.pipeline.timeout))
    if node_rank_given() is not None:
        log.warning("%s is ignored: torch.distributed was initialized before the run (rank %d keeps its "
                    "stage); let aqsgd initialize it to place the stages by node rank", NODE_RANK_ENV,
                    dist.get_rank())
    return None


def run_training(cfg: TrainConfig, *, data: tuple[Dataset, Dataset] | None = None) -> dict[str, Any] | None:
    """Train as ``cfg`` says and return the summary (None in the stage processes of a torchrun job that do not
    write the metrics).

    ``data`` = (train, eval) datasets replace the config's task: map-style datasets whose items are dicts of
    tensors with a stable ``sample_id`` (a :class:`~aqsgd.data.DictDataset`, e.g. from
    :func:`~aqsgd.data.lm_chunks` or :func:`~aqsgd.data.text_classification`). The stage processes this starts
    receive a copy of them and of the tasks registered with :func:`~aqsgd.data.register_task`; under torchrun
    every process runs the calling script, so each builds its own (identical) datasets.

    How the processes of a distributed run start is :func:`aqsgd.comm.launch.launch`'s decision: this process
    is one of them under torchrun, else they are spawned here; so is how many threads each computes with
    (their share of their machine's cores, :mod:`aqsgd.comm.launch.threads`). A local run computes on the
    threads PyTorch chose (every core, or ``OMP_NUM_THREADS``), or on ``--threads`` for the run's duration.
    """
    cfg = cfg.validate()
    if cfg.pipeline.runtime == "local":
        with intra_op_threads(cfg.pipeline.threads):
            return Trainer(cfg, data=data).run()
    if cfg.pipeline.dp_elastic and cfg.pipeline.dp_replica is None:
        if started_as_rank():
            raise SpecError("--dp-elastic under torchrun: start one torchrun per replica pipeline (--stages "
                            "processes), each with --dp-replica R and --dp-lighthouse http://HOST:PORT")
        from aqsgd.train.elastic import run_replicas

        return run_replicas(cfg, run_training, data=data)
    tasks = registered_tasks()
    run_dirs: list[Path] = []

    def prepare() -> None:
        """Before the stage processes are spawned here: what would fail in every one of them alike, and the
        data sources and weights file, prepared once."""
        for what, obj in (("the datasets given as data", data),
                          *((f"registered task {t.name!r}", t) for t in tasks)):
            try:
                pickle.dumps(obj)
            except Exception as e:  # noqa: BLE001 - whatever pickling raises, the stage processes cannot get it
                raise SpecError(f"{what} must be picklable to reach the stage processes ({type(e).__name__}: "
                                f"{e}); use module-level functions and plain tensors") from None
        _check_gpu_sharing(cfg)
        setup = setup_task(cfg, data=data)
        run_dirs.append(resolve_run_dir(cfg, None if data is None else setup.name))
        check_run_dir(cfg, run_dirs[0])
        check_partition(cfg, setup.recipe)

    # a failing stage ends in StageFailedError: one line naming the stage at fault and the details file
    names = _layout(cfg).label
    try:
        results = launch(worker, cfg.world_size, cfg.to_json(), data, tasks, before_spawn=prepare,
                         rank_names=names, threads=cfg.pipeline.threads, host=_listen_on(cfg))
    except Interrupted as e:
        if not run_dirs:  # a rank of a torchrun job: its trainer said where it stood
            raise
        step = last_logged_step(run_dirs[0])  # spawned here: say where the run stands, as a local run says it
        at = "before step 1" if step is None else f"after step {step}"
        raise Interrupted(e.signum, f"{e} {at}; {where_to_continue(run_dirs[0])}") from None
    return next((r for r in results if r), None)


def _listen_on(cfg: TrainConfig) -> str:
    """The address the stage processes spawned here listen on: 127.0.0.1, or for a replica that meets its
    peers through a lighthouse (``--dp-lighthouse``) this machine's address on the route to it, so that
    replicas on other machines reach this one's store and gloo group (127.0.0.1 again for a lighthouse on
    loopback)."""
    lighthouse = cfg.pipeline.dp_lighthouse
    if not (cfg.pipeline.dp_elastic and lighthouse):
        return LOOPBACK
    try:
        return address_towards(lighthouse)
    except OSError as e:
        raise SpecError(f"--dp-lighthouse {e}") from None


def _log_prefix(cfg: TrainConfig, rank: int) -> str:
    """``[stage 1/4 replica 0]``; a replica that comes and goes is replica 0 of its own process group, and is
    named by its index among all (``--dp-replica``)."""
    if cfg.pipeline.dp_replica is None:
        return _layout(cfg).log_prefix(rank)
    return f"[stage {rank}/{cfg.pipeline.stages} replica {cfg.pipeline.dp_replica}]"


def _layout(cfg: TrainConfig) -> GridLayout:
    return GridLayout(cfg.pipeline.stages, cfg.pipeline.world_replicas)


def _check_gpu_sharing(cfg: TrainConfig, device_count: int | None = None) -> None:
    """Before the stage processes are spawned on this machine: an explicit NCCL backend where there is no GPU,
    or where it would put two ranks of one group on one GPU, is refused in one line (``auto`` takes gloo
    there, see the trainer)."""
    p = cfg.pipeline
    device = resolve_device(p.device)
    check_backends(device, p.p2p_backend, p.dp_backend)  # NCCL on a machine without a GPU
    if device.type != "cuda":
        return
    layout = _layout(cfg)
    check_p2p_sharing(p.p2p_backend, device, layout.label, world_size=cfg.world_size,
                      device_count=device_count)
    if p.data_parallel > 1 and p.dp_backend == "nccl":
        shared = gpu_sharing([layout.dp_ranks(s) for s in range(p.stages)], layout.label,
                             world_size=cfg.world_size, device_count=device_count)
        resolve_dp_backend(p.dp_backend, device, shared_gpu=shared)
