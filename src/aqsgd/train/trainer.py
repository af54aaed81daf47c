"""The trainer: epochs of compressed pipeline training with evaluation, metrics and checkpoints.

One :class:`Trainer` runs in every process of a run: locally a single process owns every stage; distributed
(``torch.distributed`` initialized, one process per stage) each process owns its stage and the last one, which
holds the loss, writes the metrics.

Data parallelism (distributed, ``data_parallel = D > 1``): ``stages x D`` processes in the grid of
:mod:`aqsgd.parallel.grid` (rank = replica * stages + stage), ``D`` replicas of the pipeline. Every pipeline
pass reads a global batch of ``micro_batches x micro_batch_size x D`` samples (steps per epoch follow from
it); replica ``r`` trains on the contiguous shard ``[r B, (r+1) B)`` of it (a partial last batch is split
into ``D`` nearly equal shards; a trailing batch with fewer than ``D`` samples is dropped), so the stages of
one replica agree on the sample ids and its AQ-SGD caches stay consistent. After backward each stage averages
its gradients over its replicas with ``grad_sync`` (:mod:`aqsgd.parallel.sync`; uncompressed during warm-up).
The logged loss is the mean over replicas, and stage ``S-1`` of replica 0 writes the metrics. Evaluation is
sharded the same way and its sums are reduced over the replicas of the last stage. The loop:

* epochs ``< warmup_epochs`` run in ``WARMUP`` (uncompressed; AQ-SGD fills its caches), the rest in ``TRAIN``;
* every optimizer step logs loss, learning rate, samples/s and tokens/s, bytes per boundary and direction,
  the compression ratio and the time split (compute / encode+decode / waiting) to ``metrics.jsonl`` and
  TensorBoard;
* evaluation (every epoch, or every ``eval_every`` steps) runs twice, with compression on (``EVAL``) and off
  (``EVAL_RAW``), and both are reported;
* checkpoints (every epoch, or every ``checkpoint_every`` steps) hold everything needed to continue exactly,
  including the AQ-SGD caches; ``resume`` continues a run so that its losses equal an uninterrupted run's.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from aqsgd.comm import Transport
from aqsgd.comm.link import LinkSchedule, boundary_links, parse_links
from aqsgd.comm.device import check_backends, gpu_sharing, group_backend, resolve_device, resolve_dp_backend
from aqsgd.comm.transport import StatsKey, naming_peer_failures
from aqsgd.data.datasets import epoch_batches
from aqsgd.data.synthetic import microbatches
from aqsgd.errors import ConfigMismatchError, DivergedError, Interrupted, NonFiniteError, SpecError
from aqsgd.interrupts import signals_held
from aqsgd.parallel import ProcessGrid, make_grad_sync
from aqsgd.parallel.grid import check_same_settings
from aqsgd.pipeline.checkpointing import checkpoint_blocks
from aqsgd.pipeline.compression import BACKWARD_CHANNEL, FORWARD_CHANNEL, CompressionConfig
from aqsgd.pipeline.materialize import load_weights, materialize_stage
from aqsgd.pipeline.partition import partition_model, shared_parameters
from aqsgd.schemes import Phase
from aqsgd.train.checkpoint import (CheckpointError, latest_checkpoint, load_checkpoint, read_trainer_state,
                                    save_checkpoint)
from aqsgd.train.adaptive import (BITS, LinkPolicy, is_auto, link_name, link_row, link_seconds, parse_auto,
                                   parse_link, probe_keys, probe_row)
from aqsgd.train.balance import emulate_slow_stages, measure_split
from aqsgd.train.config import TrainConfig, flatten_config
from aqsgd.train.engine import OptimConfig, PipelineEngine
from aqsgd.train.export import MODEL_FILE, model_description
from aqsgd.train.lora import add_adapters, is_trainable
from aqsgd.train.metrics import MetricsWriter, perplexity
from aqsgd.train.modelfiles import check_same_base
from aqsgd.train.rundir import (RunDirError, RunDirLock, check_run_dir, prepare_run_dir, resolve_run_dir,
                                run_dir_of_checkpoint, set_aside_later_checkpoints, truncate_metrics)
from aqsgd.train.tasks import TaskSetup, effective_settings, setup_task

__all__ = ["Trainer", "StepHook", "check_partition", "collective_timeout", "compute_dtype",
           "where_to_continue", "without_full_mask", "resume_settings", "RESUME_MUST_MATCH"]

log = logging.getLogger(__name__)
_STAT_KEYS = ("fw_bytes", "bw_bytes", "fw_raw", "bw_raw", "compute_s", "encode_s", "decode_s", "wait_s",
              "sync_bytes", "step_s", "fw_wire_bytes", "fw_busy_s", "bw_wire_bytes", "bw_busy_s",
              "in_fw_held_s", "in_bw_held_s", *probe_keys("forward"), *probe_keys("backward"))
_PROBE_KEYS = frozenset(probe_keys("forward") + probe_keys("backward"))  # not in the metrics' stage rows
# evaluation sums, reduced over the replicas: loss x samples, samples, correct predictions, binary confusion
# counts
_EVAL_KEYS = ("loss_sum", "count", "correct", "tp", "tn", "fp", "fn")


# Settings that change what a checkpoint's state means (the model and its cut into stages, the data and sample
# ids, the order of the data, the boundary schemes and their caches, the optimizer's state, the data-parallel
# grid and its error-feedback buffers): a resumed run must use the checkpoint's values. Every other setting
# may change on resume (lr, epochs, evaluation, ...), and the trainer warns about each one that did.
RESUME_MUST_MATCH = frozenset({
    "task", "model", "max_length", "max_train_samples", "model_layers", "hidden_size", "vocab_size", "stages",
    "layers", "balance", "micro_batches", "micro_batch_size", "data_parallel", "grad_sync", "grad_bucket_mb",
    "forward", "backward", "cache", "ef_key", "optimizer", "grad_accum", "seed", "lora", "lora_rank",
    "lora_alpha", "lora_targets",
    # which rows are training samples: a changed split or column would turn trained samples into evaluation
    # ones (and give the cache's sample ids other rows)
    "eval_split", "text_column", "text_pair_column", "label_column", "txt_unit"})
# where and how this invocation runs and reports: not part of the training, never compared
_RUN_ONLY = frozenset({"cache_dir", "output_dir", "run_name", "resume", "overwrite", "progress",
                       "tensorboard", "trace", "timeout", "checksum", "keep_checkpoints",
                       "checkpoint_minutes", "threads"})


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


def _mcc(tp: float, tn: float, fp: float, fn: float) -> float:
    """Matthews correlation coefficient from binary confusion counts (0 where undefined)."""
    den = math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return (tp * tn - fp * fn) / den if den else 0.0


def without_full_mask(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``batch`` without its ``attention_mask`` where that is all ones (no padding: every LM chunk), which is
    what a missing mask means to every model. Otherwise each stage's mask builder checks the mask for padding
    on the stages' device, a host wait per stage and micro-batch on a GPU; one look on the host decides
    here."""
    mask = batch.get("attention_mask")
    if mask is not None and mask.device.type == "cpu" and bool(mask.all()):
        return {k: v for k, v in batch.items() if k != "attention_mask"}
    return batch


# what ``aqsgd train --resume RUN`` does not take from the run: where this invocation writes, the resume
_NOT_RESUMED = frozenset({"output_dir", "run_name", "resume", "overwrite"})


def resume_settings(resume: str | Path) -> dict[str, Any]:
    """The settings the newest complete checkpoint under ``resume`` (a run directory or a checkpoint folder)
    was trained with, as ``{flat name: value}``, less where an invocation writes: ``aqsgd train --resume RUN``
    starts from them, and the options given beside it override them (those that must match the checkpoint
    are still refused when they differ). Raises :class:`CheckpointError` if there is no such checkpoint."""
    from aqsgd.train.config import options

    path = latest_checkpoint(resume)
    if path is None:
        raise CheckpointError(f"--resume: no complete checkpoint under {resume}")
    saved = flatten_config(read_trainer_state(path).get("config", {}))
    known = {o.flat for o in options()}
    return {k: v for k, v in saved.items() if k in known and k not in _NOT_RESUMED}


def where_to_continue(run_dir: str | Path) -> str:
    """Where a stopped run can continue from: its newest complete checkpoint and the command, for messages."""
    try:
        path = latest_checkpoint(run_dir)
    except CheckpointError as e:
        return f"its newest checkpoint is damaged ({e})"
    if path is None:
        return f"no checkpoint of {run_dir} was written yet"
    return f"the last complete checkpoint is {path} (continue with `aqsgd train --resume {run_dir}`)"


StepHook = Callable[["Trainer", int], None]


class Trainer:
    """Builds the stages this process owns, their engine and transport, and trains them (see the module
    docstring). ``on_step(trainer, step)`` hooks run before each optimizer step (``step`` counts from 1): a
    place for callbacks such as the tests' fault injection. A trainer is used once; a process (group) may run
    several in turn, each with its own run directory."""

    def __init__(self, cfg: TrainConfig, *, data: tuple[Dataset, Dataset] | None = None,
                 run_dir: str | Path | None = None, on_step: Sequence[StepHook] = ()) -> None:
        self.cfg = cfg.validate()
        p = cfg.pipeline
        self.on_step = list(on_step)
        self.distributed = dist.is_initialized()
        if p.runtime == "distributed" and not self.distributed:
            raise ConfigMismatchError(
                "runtime 'distributed' needs torch.distributed initialized in every stage process (start it "
                "with `aqsgd train --runtime distributed`, or torchrun and init_process_group); use runtime "
                "'local' to run all stages in this process")
        self.rank = dist.get_rank() if self.distributed else 0
        if self.distributed and dist.get_world_size() != cfg.world_size:
            raise ConfigMismatchError(
                f"{dist.get_world_size()} processes for {p.stages} stages x {p.data_parallel} data-parallel "
                f"replicas: start exactly stages x data_parallel = {cfg.world_size} processes (one per stage "
                f"and replica)")
        if self.distributed:
            settings = cfg.flat()
            if cfg.compression.cache.startswith("lowbit"):
                # each side re-encodes its cache rows: bit-identical sides need the same kind of device (an
                # eager CUDA encode may round a code differently from the CPU's; decoding agrees everywhere)
                settings["device kind (the low-bit cache encodes on both sides of a boundary)"] = (
                    resolve_device(p.device, distributed=True).type)
            check_same_settings(settings)
        self.grid = (ProcessGrid.build(p.stages, p.data_parallel, timeout_s=collective_timeout(p.timeout))
                     if self.distributed else None)
        self.replica = self.grid.replica if self.grid is not None else 0
        self.transport: Transport | None = None  # distributed: created with the engine
        self._link_schedules: dict[int, LinkSchedule] = {}  # this process's links that change during the run
        # the other stages of this pipeline: who a failed collective may have lost (see naming_peer_failures)
        self._suspects = [f"stage {s}" for s in range(p.stages) if self.grid is None or s != self.grid.stage]
        data_name = None if data is None else str((getattr(data[0], "info", {}) or {}).get("task") or "data")
        self.run_dir = Path(run_dir) if run_dir else resolve_run_dir(cfg, data_name)
        if not self.distributed:  # fail fast, before the data are prepared (distributed: rank 0, below)
            check_run_dir(cfg, self.run_dir)
        self.task: TaskSetup = setup_task(cfg, data=data)
        check_partition(cfg, self.task.recipe)
        # before anything (a disk cache, a checkpoint) writes into it
        self._lock = self._prepare_run_dir()
        self.steps_per_epoch = math.ceil(self._train_batches_per_epoch(len(self.task.train))
                                         / cfg.optim.grad_accum)
        total = self.steps_per_epoch * cfg.optim.epochs
        self.total_steps = min(total, cfg.optim.max_steps) if cfg.optim.max_steps else total
        self._warn_if_never_compressed()
        # --balance measured: the stages are profiled with the layers split, and the run trains with the split
        # chosen, recorded as its --layers (aqsgd.train.balance)
        self.balance: dict[str, Any] | None = None
        if p.balance == "measured" and p.layers is None:
            saved = resume_settings(cfg.run.resume).get("layers") if cfg.run.resume else None
            self.balance = (measure_split(self) if saved is None else
                            {"balance": "measured", "layers": list(saved), "from": str(cfg.run.resume)})
            self.cfg = self.cfg.replace(layers=self.balance["layers"])
        self.engine = self._build_engine()
        emulate_slow_stages(self.engine, self.cfg)
        if self.policy is not None:  # each auto link's sender measures every rung's error (every few steps),
            for name, ladder in self.policy.probes().items():  # and its level applies in the warm-up too
                b, direction, _ = parse_link(name)
                channel = FORWARD_CHANNEL if direction == "forward" else BACKWARD_CHANNEL
                for runner in self.engine.runners.values():
                    runner.set_probe(b, channel, ladder)
                    runner.compress_warmup(b, channel)
        # every replica's last stage has a loss; one of them (replica 0's) writes the metrics
        self.holds_loss = self.grid is None or self.grid.stage == p.stages - 1
        self.writes_metrics = self.holds_loss and self.replica == 0
        self.position = {"epoch": 0, "batch": 0, "step": 0}
        self.totals = {"bytes_sent": 0, "raw_bytes": 0, "grad_sync_bytes": 0, "samples": 0, "train_s": 0.0}
        self.history: list[dict[str, Any]] = []
        self.last_eval: dict[str, Any] | None = None
        self._done = {"eval": -1, "checkpoint": -1}  # the steps of the last evaluation and checkpoint
        self._checkpointed_at = time.monotonic()  # --checkpoint-minutes counts from here
        self._cache_stated = False  # the AQ-SGD caches' memory is stated once, when the first step made them
        self._skipped_in_a_row = 0  # steps in a row not applied for a non-finite loss or gradient norm
        self._links_seen: dict[Any, Any] = {}  # the transport's counters at the last step (see _link_deltas)

    def _warmup_codecs(self) -> dict[int, str]:
        """``--warmup-codec``: the channels whose warm-up and first visits it compresses (every direction with
        a fixed compressed setting; validated to be direct or delta) and the codec; auto links send their
        level instead (see the policy's compress_warmup below)."""
        c = self.cfg.compression
        if c.warmup_codec == "none":
            return {}
        return {FORWARD_CHANNEL if d == "forward" else BACKWARD_CHANNEL: c.warmup_codec
                for d in c.fixed_compressed()}

    def _warn_if_never_compressed(self) -> None:
        """Compression was asked for, but the uncompressed warm-up epochs cover every step of the run: say so
        (once per run), since the summary would otherwise just show no saving."""
        c = self.cfg.compression
        asked = [f"--{d} {getattr(c, d)}" for d in c.fixed_compressed()]  # auto: warm-up too
        warm = self.steps_per_epoch * c.warmup_epochs
        if (not asked or c.warmup_codec != "none" or self.total_steps > warm
                or (self.grid is not None and self.grid.rank != 0)):
            return
        log.warning("no step of this run will be compressed: its %d steps all fall in the %d uncompressed "
                    "warm-up epoch(s) (--warmup-epochs %d, %d steps each), so %s will not be used; lower "
                    "--warmup-epochs or train longer", self.total_steps, c.warmup_epochs, c.warmup_epochs,
                    self.steps_per_epoch, " and ".join(asked))

    def _build_engine(self, profiling: bool = False) -> PipelineEngine:
        """The stages this process owns (all of them locally, its own one distributed), their boundary
        schemes, optimizers and, distributed, the transport, tied-weight groups and data-parallel gradient
        sync. ``profiling`` (--balance measured): stages whose compute is timed, with uncompressed
        boundaries."""
        cfg, p, o = self.cfg, self.cfg.pipeline, self.cfg.optim
        # locally every stage computes on one device; distributed, each process on cuda:(LOCAL_RANK mod GPUs)
        device = self.device = resolve_device(p.device, distributed=self.distributed)
        check_backends(device, p.p2p_backend, p.dp_backend)
        optim = OptimConfig(o.optimizer, o.lr, o.weight_decay, int(o.lr_warmup * self.total_steps),
                            self.total_steps, o.max_grad_norm)
        cache_dir = None
        # one disk cache per replica: each holds its own samples' rows
        if cfg.compression.cache.startswith("disk"):
            cache_path = self.run_dir / "cache"
            cache_dir = str(cache_path / f"replica{self.replica}" if p.data_parallel > 1 else cache_path)
        c = cfg.compression
        autos = {d: parse_auto(spec, d) if is_auto(spec) else None
                 for d, spec in (("forward", c.forward), ("backward", c.backward))}
        # bits chosen per link (aqsgd.train.adaptive): every link starts at the top of its ladder
        self.policy = (LinkPolicy(p.stages - 1, autos["forward"], autos["backward"])
                       if any(autos.values()) else None)
        fw, bw = (a.spec(0) if a else spec for a, spec in ((autos["forward"], c.forward),
                                                            (autos["backward"], c.backward)))
        comp = CompressionConfig.simple(fw, bw, num_samples=len(self.task.train),
                                        cache=c.cache, cache_dir=cache_dir, ef_key=c.ef_key, seed=o.seed,
                                        warmup=self._warmup_codecs())
        if profiling:  # no codec and no cache: neither takes time nor writes files while stages are timed
            comp = CompressionConfig.simple("none", "none")
        autocast = torch.bfloat16 if compute_dtype(o.dtype, device) == "bf16" else None
        torch.manual_seed(o.seed)
        recipe = self.task.recipe
        # Weights are built and loaded on the CPU in both runtimes (the same numbers), then moved; Module.to
        # keeps the Parameter objects, so weights tied across local stages stay shared.
        if self.grid is None:
            model = load_weights(recipe.build("cpu"), recipe.weights)
            parts = partition_model(model, p.stages, layers=p.layers, balance=p.balance)
            if cfg.model.lora:
                add_adapters(parts, cfg.flat(), model=model)
            if p.activation_checkpointing:
                for part in parts:
                    checkpoint_blocks(part)
            stages = [s.to(device) for s in parts]
            return PipelineEngine(dict(enumerate(stages)), p.stages, comp, optim, schedule=p.schedule,
                                  device=device, autocast=autocast)
        # this process's links by the rank at their other end (its boundaries' settings); the replicas' sync
        # takes the one setting --link then has
        specs = self.link_schedules
        schedules = (boundary_links(specs, self.grid.stage, lambda s: self.grid.rank_of_stage[s])
                     if specs else {})
        links = {dst: schedule.initial for dst, schedule in schedules.items()} if specs else None
        sync_link = specs[0].initial if specs else None  # (a schedule that varies is refused with replicas)
        module = materialize_stage(recipe, p.stages, self.grid.stage, layers=p.layers, balance=p.balance)
        if cfg.model.lora:
            add_adapters(module, cfg.flat(), first_stage=self.grid.stage, model=recipe.build("meta"))
        if p.activation_checkpointing:
            checkpoint_blocks(module)
        module = module.to(device)
        ties = shared_parameters(partition_model(recipe.build("meta"), p.stages, layers=p.layers,
                                                 balance=p.balance))
        if cfg.model.lora:  # a frozen tied weight (an embedding and its LM head) gets no gradient to sum
            ties = [t for t in ties if all(is_trainable(name) for name in t.values())]
        grad_sync = None
        if p.data_parallel > 1:
            # NCCL replica groups of their own (collective, the same on every rank); gloo: the grid's groups,
            # with the buckets in host memory
            group, sync_device = self.grid.dp_group, torch.device("cpu")
            if resolve_dp_backend(p.dp_backend, device,
                                  shared_gpu=self._replicas_sharing_a_gpu(device)) == "nccl":
                group = self.grid.new_dp_group(group_backend("nccl"), timeout_s=collective_timeout(p.timeout))
                sync_device = device
            grad_sync = make_grad_sync(p.grad_sync, group, bucket_mb=p.grad_bucket_mb, link=sync_link,
                                       seed=o.seed, device=sync_device)
        self.transport = Transport(timeout_s=p.timeout, links=links, peer_labels=self.grid.peer_labels(),
                                   device=device, backend=p.p2p_backend, checksum=p.checksum)
        # links whose setting changes during the run (--link ...~SPEC@STEP): paced from the start, changed at
        # the step boundaries of their schedule (_follow_link_schedules)
        self._link_schedules = {dst: schedule for dst, schedule in schedules.items() if schedule.varies}
        for dst, schedule in self._link_schedules.items():
            self.transport.set_link(dst, schedule.initial)
        return PipelineEngine({self.grid.stage: module}, p.stages, comp, optim, schedule=p.schedule,
                              device=device, transport=self.transport, ties=ties, autocast=autocast,
                              grid=self.grid, grad_sync=grad_sync)

    def _replicas_sharing_a_gpu(self, device: torch.device) -> str | None:
        """Where replicas of a stage would share a GPU (on any machine of the run: every process learns it, so
        that all choose the same backend), in words; None where none would. With ``--dp-backend auto`` the
        sync then goes over gloo, which is said once."""
        if device.type != "cuda" or self.grid is None or self.cfg.pipeline.data_parallel < 2:
            return None
        layout = self.grid.layout
        here = gpu_sharing([layout.dp_ranks(s) for s in range(layout.num_stages)], layout.label,
                           world_size=self.cfg.world_size)
        anywhere = torch.tensor([0.0 if here is None else 1.0], dtype=torch.float64)
        dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)
        if not anywhere.item():
            return None
        shared = here or "replicas of a stage would share a GPU on another machine of the run"
        if self.rank == 0 and self.cfg.pipeline.dp_backend == "auto":
            log.warning("%s: the data-parallel gradient sync goes over gloo (NCCL cannot put two ranks of "
                        "one group on one GPU; --dp-backend auto)", shared)
        return shared

    def _prepare_run_dir(self) -> RunDirLock | None:
        """Check, create and lock the run directory: here without a process group, by rank 0 otherwise (the
        others learn its outcome, so that every process stops with the same one-line error)."""
        if not self.distributed:
            return prepare_run_dir(self.cfg, self.run_dir)
        lock, outcome = None, [None]
        if self.rank == 0:
            try:
                lock = prepare_run_dir(self.cfg, self.run_dir)
            except RunDirError as e:
                outcome = [str(e)]
        with naming_peer_failures(self.transport, "preparing the run directory", self._suspects):
            dist.broadcast_object_list(outcome, src=0)
        if outcome[0] is not None:
            raise RunDirError(outcome[0])
        return lock

    # -- data ----------------------------------------------------------------------------------------------
    def _train_batches_per_epoch(self, n: int) -> int:
        """Global batches of one epoch: a trailing partial batch counts if it has a sample for every
        replica."""
        full, rest = divmod(n, self.cfg.global_batch_size)
        return full + (1 if rest >= self.cfg.pipeline.data_parallel else 0)

    def _train_batches(self, epoch: int) -> list[dict[str, torch.Tensor]]:
        """The global batches of one epoch (the same on every process), in the order fixed by (seed,
        epoch)."""
        batches = epoch_batches(self.task.train, self.cfg.global_batch_size, seed=self.cfg.optim.seed,
                                epoch=epoch)
        return [b for b in batches if b["sample_ids"].numel() >= self.cfg.pipeline.data_parallel]

    def _shard(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This replica's contiguous shard of a global batch (the whole batch without data parallelism)."""
        if self.cfg.pipeline.data_parallel == 1:
            return batch
        return {k: torch.tensor_split(v, self.cfg.pipeline.data_parallel)[self.replica]
                for k, v in batch.items()}

    def _replica_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sum a float64 tensor over the replicas of this (last) stage; identity without data parallelism."""
        if self.grid is not None and self.cfg.pipeline.data_parallel > 1:
            dist.all_reduce(values, group=self.grid.dp_group)
        return values

    # -- helpers -----------------------------------------------------------------------------------------
    def _gathered_stats(self, dt: float) -> list[list[float]]:
        """Per stage: bytes and seconds of the last step (``dt``: the step as this process timed it), gathered
        from every process when distributed. With data parallelism each row is summed over the stage's
        replicas (boundary bytes of all D pipelines, their seconds, and the gradient-sync bytes each rank
        sent)."""
        rows = [[0.0] * len(_STAT_KEYS) for _ in range(self.cfg.pipeline.stages)]
        links = self._link_deltas()
        schemes = self.engine.schemes()

        def probe(b: int, channel: int, direction: str) -> list[float]:  # the sender's, if it probes
            scheme = schemes.get((b, channel, "sender"))
            return probe_row(scheme.take_probe() if scheme is not None else None, direction)

        for i, st in self.engine.stats().items():
            rows[i] = [st.bytes_sent["forward"], st.bytes_sent["backward"], st.raw_bytes["forward"],
                       st.raw_bytes["backward"], st.compute_s, st.encode_s, st.decode_s, st.wait_s,
                       self.engine.last_sync_bytes, dt, *links, *probe(i, FORWARD_CHANNEL, "forward"),
                       *probe(i - 1, BACKWARD_CHANNEL, "backward")]
        if self.distributed:
            t = torch.tensor(rows, dtype=torch.float64)
            dist.all_reduce(t)  # row i: one contributor per replica of stage i
            rows = t.tolist()
        return rows

    def _set_link_codecs(self, specs: Mapping[str, str]) -> None:
        """Apply ``{"b0.forward": spec}`` to this process's schemes of those links (before the next step)."""
        for name, spec in specs.items():
            b, direction, _ = parse_link(name)
            channel = FORWARD_CHANNEL if direction == "forward" else BACKWARD_CHANNEL
            for runner in self.engine.runners.values():
                runner.set_codec(b, channel, spec)

    def _link_deltas(self) -> tuple[float, ...]:
        """What this process's links carried since the last call (see
        :class:`~aqsgd.comm.transport.LinkStats`): to the next stage (forward) and the previous one
        (backward), wire bytes and busy seconds; from the previous stage (forward) and the next one
        (backward), the seconds their messages arrived held back by the link. Zeros in the local runtime,
        which has no links."""
        if self.transport is None or self.grid is None:
            return (0.0,) * 6
        now = self.transport.stats
        stage, ranks = self.grid.stage, self.grid.rank_of_stage

        def delta(peer: int, channel: int, direction: str, field: str) -> float:
            if not 0 <= peer < len(ranks):
                return 0.0
            key = StatsKey(ranks[peer], channel, direction)
            cur, before = now.get(key), self._links_seen.get(key)
            return float((getattr(cur, field) if cur else 0) - (getattr(before, field) if before else 0))

        out = (delta(stage + 1, FORWARD_CHANNEL, "send", "wire_bytes"),
               delta(stage + 1, FORWARD_CHANNEL, "send", "busy_s"),
               delta(stage - 1, BACKWARD_CHANNEL, "send", "wire_bytes"),
               delta(stage - 1, BACKWARD_CHANNEL, "send", "busy_s"),
               delta(stage - 1, FORWARD_CHANNEL, "recv", "backlog_s"),
               delta(stage + 1, BACKWARD_CHANNEL, "recv", "backlog_s"))
        self._links_seen = now
        return out

    def _phase(self, epoch: int) -> Phase:
        return Phase.WARMUP if epoch < self.cfg.compression.warmup_epochs else Phase.TRAIN

    def _passes(self, batches: list[dict[str, torch.Tensor]]) -> list[list[dict[str, torch.Tensor]]]:
        return [microbatches(self._on_device(b), self.cfg.pipeline.micro_batches) for b in batches]

    def _on_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The batch's tensors on the stages' device (non-blocking from pinned memory). Sample ids stay on the
        host: the boundary schemes and their caches index with them there. An attention mask of ones is left
        out (:func:`without_full_mask`)."""
        batch = without_full_mask(batch)
        if self.device.type == "cpu":
            return batch
        return {k: v if k == "sample_ids" or not isinstance(v, torch.Tensor)
                else v.to(self.device, non_blocking=v.is_pinned()) for k, v in batch.items()}

    # -- evaluation --------------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, Any]:
        """Evaluate with compression on and off. Every process must call it (collective when distributed);
        the metrics are returned where the loss is held (empty elsewhere). With data parallelism each replica
        evaluates its shard of every global batch and the sums are reduced over the last stage's replicas."""
        out: dict[str, Any] = {}
        classify = self.task.kind != "causal-lm"
        for name, phase in (("compressed", Phase.EVAL), ("uncompressed", Phase.EVAL_RAW)):
            sums = torch.zeros(len(_EVAL_KEYS), dtype=torch.float64)
            for batch in epoch_batches(self.task.eval, self.cfg.global_batch_size, seed=self.cfg.optim.seed,
                                       epoch=0, shuffle=False):
                shard = self._shard(batch)
                n = shard["sample_ids"].numel()
                # fewer samples than replicas in a last batch: every stage of this replica skips it
                if n == 0:
                    continue
                mbs = microbatches(self._on_device(shard), self.cfg.pipeline.micro_batches)
                loss, logits = self.engine.evaluate(mbs, phase, keep_logits=classify)
                if loss is None:
                    continue
                sums[0] += loss * n
                sums[1] += n
                if classify and logits is not None:
                    p, y = torch.cat(logits).argmax(-1).cpu(), shard["labels"]
                    sums[2:] += torch.tensor([float((p == y).sum()), float(((p == 1) & (y == 1)).sum()),
                                              float(((p == 0) & (y == 0)).sum()),
                                              float(((p == 1) & (y == 0)).sum()),
                                              float(((p == 0) & (y == 1)).sum())], dtype=torch.float64)
            if not self.holds_loss:
                continue
            tally = dict(zip(_EVAL_KEYS, self._replica_sum(sums).tolist()))
            count = max(tally["count"], 1.0)
            metrics: dict[str, float] = {"loss": tally["loss_sum"] / count}
            if classify:
                metrics["accuracy"] = tally["correct"] / count
                if self.task.main_metric == "mcc":
                    metrics["mcc"] = _mcc(tally["tp"], tally["tn"], tally["fp"], tally["fn"])
            else:
                metrics["perplexity"] = perplexity(metrics["loss"])
            out[name] = metrics
        return out

    def _resync(self) -> None:
        """After work between two steps (an evaluation, a checkpoint): every process waits for the others, so
        that the next step starts on all of them together, as a step does after the previous one's metrics
        all-reduce, and the links' statistics restart from here (the next step's alone, not the evaluation's
        fp32 traffic). Without it a stage that leaves such work
        first sends the next step's first messages while its receiver is still at it, and the wait reads as
        the link's time: in ``aqsgd bench adaptive`` every step after an evaluation measured the 1 Gbit/s
        link at 2.5-50 Mbit/s, and its activations went a rung or two down each time (fp16 to q8 at steps 16
        and 31, q4 to q2:l2 at step 91), then back up over the next steps."""
        if self.distributed:
            dist.barrier()
        if self.transport is not None:
            self._links_seen = self.transport.stats

    # -- checkpoints -------------------------------------------------------------------------------------
    def _checkpoint(self) -> None:
        # the model as built (what export rebuilds) with its base's digest, under the checkpoint's manifest
        pos = {**self.position, "totals": self.totals, "config": self.cfg.to_dict(),
               "data": self.task.data_info, "model": model_description(self.task),
               "base_sha256": self.task.base_sha256}
        if self.policy is not None:  # --forward/--backward auto: the links' levels continue on resume
            pos["link_levels"] = self.policy.specs()  # by spec: an index would change meaning with the ladder
            pos["link_policy"] = self.policy.state()  # and what it measured of them
        step = self.position["step"]
        # a signal while the checkpoint is written is raised once it is complete (aqsgd.interrupts)
        with signals_held():
            with naming_peer_failures(self.transport, f"the checkpoint of step {step}", self._suspects):
                path = save_checkpoint(self.run_dir, step, self.engine, pos,
                                       keep=self.cfg.run.keep_checkpoints)
                self._resync()
            self._done["checkpoint"] = self.position["step"]
            self._checkpointed_at = time.monotonic()
            log.info("checkpoint %s", path)

    def _state_cache_memory(self) -> None:
        """Say how much memory (or disk) this process's AQ-SGD caches take: one row per training sample and
        boundary side, allocated whole at the first visit, often the largest memory a fine-tuning run has."""
        self._cache_stated = True
        caches = [s.cache for s in self.engine.schemes().values() if getattr(s, "cache", None) is not None]
        caches = [c for c in caches if c.row_shape is not None]
        if not caches:
            return
        total = sum(c.nbytes for c in caches)
        c = caches[0]
        where = "on disk" if c.backend == "disk" else "in memory"
        hint = "; --cache disk keeps them on disk" if c.backend == "memory" else ""
        who = "" if self.grid is None else f" of stage {self.grid.stage}"
        log.info("AQ-SGD caches%s: %.1f MB %s (%d boundary sides x %d samples x %s values)%s", who,
                 total / 1e6, where, len(caches), c.capacity, " x ".join(map(str, c.row_shape)), hint)

    def _checkpoint_due(self) -> bool:
        """``--checkpoint-minutes``: whether that long has passed since the last checkpoint (or the start).
        Every process must call it after every step: distributed, the processes agree (one process's clock
        suffices), so that all of them write the checkpoint together."""
        minutes = self.cfg.run.checkpoint_minutes
        if not minutes or self.cfg.run.checkpoint_every == 0:
            return False
        due = time.monotonic() - self._checkpointed_at >= 60 * minutes
        if self.distributed:
            flag = torch.tensor([1.0 if due else 0.0])
            with naming_peer_failures(self.transport, "deciding on a timed checkpoint", self._suspects):
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            due = bool(flag.item())
        return due

    def _resume(self) -> int:
        """Load the newest checkpoint of ``cfg.run.resume``; returns its step. Settings that change what the
        saved state means must equal the checkpoint's (one error naming them); others may change, with a
        warning."""
        path = latest_checkpoint(self.cfg.run.resume)  # type: ignore[arg-type]
        if path is None:
            raise CheckpointError(f"--resume: no complete checkpoint under {self.cfg.run.resume}")
        # verified against the checkpoint's manifests; flat in checkpoints written before the config was
        # nested
        trainer_state = read_trainer_state(path)
        saved = effective_settings(flatten_config(trainer_state.get("config", {})))
        defaults = TrainConfig().flat()  # checkpoints written before a setting existed ran with its default
        mine = effective_settings(self.cfg.flat())
        differ = {k: (saved.get(k, defaults[k]), mine[k]) for k in mine
                  if k not in _RUN_ONLY and saved.get(k, defaults[k]) != mine[k]}
        fixed = {k: v for k, v in differ.items() if k in RESUME_MUST_MATCH}
        if fixed:
            what = ", ".join(f"{k}={a!r} (this run: {b!r})" for k, (a, b) in fixed.items())
            raise CheckpointError(f"--resume {path}: the checkpoint was trained with {what}; these settings "
                                  f"must match to continue it")
        was, now = trainer_state.get("data", {}).get("fingerprint"), self.task.data_info.get("fingerprint")
        if was is not None and was != now:
            info = self.task.data_info
            files = (", ".join(str(info[k]) for k in ("train_file", "eval_file", "dataset") if info.get(k))
                     or "the data")
            raise CheckpointError(f"--resume {path}: {files} changed since the checkpoint (sha256 "
                                  f"{str(was)[:12]}... then, {str(now)[:12]}... now); its sample ids and "
                                  f"cached activations would not match: restore the data or start a new run")
        if self.cfg.model.lora:  # the checkpoint holds the adapters only: the base must be the one they fit
            check_same_base(trainer_state.get("base_sha256"), self.task.base_sha256, self.task.model_folder,
                            f"--resume {path}")
        if differ:
            log.warning("resuming %s with changed settings: %s", path,
                        ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in differ.items()))
        if self.policy is not None and trainer_state.get("link_levels"):  # before the schemes are loaded
            self.policy.restore(trainer_state["link_levels"])
            if trainer_state.get("link_policy"):
                self.policy.load_state(trainer_state["link_policy"])
            self._set_link_codecs(self.policy.specs())
        with naming_peer_failures(self.transport, f"loading {path}", self._suspects):
            state = load_checkpoint(path, self.engine)
        self.position = {k: state[k] for k in ("epoch", "batch", "step")}
        self.totals = {**self.totals, **state["totals"]}
        if self.position["step"] >= self.total_steps:
            raise CheckpointError(f"--resume {path}: the checkpoint is at step {self.position['step']} of "
                                  f"{self.total_steps}, so there is nothing left to train; raise --epochs or "
                                  f"--max-steps to continue")
        self._done["checkpoint"] = self.position["step"]
        log.info("resumed from %s at epoch %d, batch %d, step %d", path, *self.position.values())
        if self.rank == 0 and run_dir_of_checkpoint(path).resolve() == self.run_dir.resolve():
            # the later checkpoints of this directory belong to the trajectory this resume abandons
            aside, moved = set_aside_later_checkpoints(self.run_dir, self.position["step"])
            if moved:
                log.warning("resumed from step %d of %s: its later checkpoints (%s) belong to the training "
                            "this resume abandons; moved to %s, where export, eval and --resume do not look",
                            self.position["step"], self.run_dir, ", ".join(moved), aside)
        return self.position["step"]

    # -- the loop ----------------------------------------------------------------------------------------
    def run(self, *, stop_at: int | None = None) -> dict[str, Any]:
        """Train to the end (or, for tests of interruption, stop after optimizer step ``stop_at``)."""
        self._stop_at = stop_at
        try:
            return self._run()
        except Interrupted as e:  # SIGINT/SIGTERM (aqsgd.interrupts): say where the run stands
            raise Interrupted(e.signum, f"{e} after step {self.position['step']} of {self.total_steps}; "
                                        f"{where_to_continue(self.run_dir)}") from None
        finally:
            if self._lock is not None:
                self._lock.release()

    def _run(self) -> dict[str, Any]:
        cfg = self.cfg
        resumed_at = self._resume() if cfg.run.resume else None
        if resumed_at is not None and self.writes_metrics:
            dropped = truncate_metrics(self.run_dir, resumed_at)
            if dropped:
                log.info("metrics.jsonl: dropped %d rows after step %d (they are trained again)", dropped,
                         resumed_at)
        writer = MetricsWriter(self.run_dir, enabled=self.writes_metrics, tensorboard=cfg.run.tensorboard,
                               purge_step=None if resumed_at is None else resumed_at + 1)
        if self.writes_metrics:
            (self.run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
            # the label set, files and their fingerprints: what the model was trained on
            if self.task.data_info:
                (self.run_dir / "data.json").write_text(json.dumps(self.task.data_info, indent=1))
            # the model's architecture and where its tokenizer lives: what `aqsgd export` rebuilds
            (self.run_dir / MODEL_FILE).write_text(json.dumps(model_description(self.task), indent=1))
            if self.balance is not None and resumed_at is None:  # the profile that chose the split
                writer.write({"kind": "balance", "step": 0, **self.balance})
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeRemainingColumn(), disable=not (self.writes_metrics and cfg.run.progress))
        start = time.perf_counter()
        try:
            with progress:
                bar = progress.add_task("training", total=self.total_steps, completed=self.position["step"])
                self._loop(writer, progress, bar)
        except BaseException:
            if self.transport is not None:
                self.transport.close(failed=True)
            raise
        if self.transport is not None:
            self.transport.close()
        summary = self._summary(time.perf_counter() - start)
        writer.summary(summary)
        writer.close()
        return summary

    def _loop(self, writer: MetricsWriter, progress: Any, bar: Any) -> None:
        cfg = self.cfg
        # None: at the end of every epoch; 0: never (not even at the end); N: every N optimizer steps
        eval_every, checkpoint_every = cfg.run.eval_every, cfg.run.checkpoint_every
        self._checkpointed_at = time.monotonic()
        for epoch in range(self.position["epoch"], cfg.optim.epochs):
            phase = self._phase(epoch)
            batches = self._train_batches(epoch)
            first = self.position["batch"] if epoch == self.position["epoch"] else 0
            for b in range(first, len(batches), cfg.optim.grad_accum):
                if self.position["step"] == self._stop_at:
                    return  # a simulated interruption: no final evaluation, checkpoint or trace
                if self.position["step"] >= self.total_steps:
                    break
                for hook in self.on_step:
                    hook(self, self.position["step"] + 1)
                group = batches[b : b + cfg.optim.grad_accum]
                traced = cfg.run.trace and self.position["step"] == self.total_steps - 1
                with self._profiled(traced):
                    t0 = time.perf_counter()
                    loss = self._train_step(group, phase)
                    dt = time.perf_counter() - t0
                self._check_finite(loss)
                if not self._cache_stated:  # allocated by the first step's first visits
                    self._state_cache_memory()
                self.position.update(epoch=epoch, batch=b + cfg.optim.grad_accum,
                                     step=self.position["step"] + 1)
                with naming_peer_failures(self.transport, "the metrics all-reduce", self._suspects):
                    self._log_step(writer, epoch, phase, loss, dt,
                                   sum(g["sample_ids"].numel() for g in group))
                progress.update(bar, advance=1, description=f"epoch {epoch} {phase.value} loss "
                                f"{loss if loss is not None else float('nan'):.4f}")
                step = self.position["step"]
                if eval_every and step % eval_every == 0:
                    self._eval(writer, epoch)
                if (checkpoint_every and step % checkpoint_every == 0) or self._checkpoint_due():
                    self._checkpoint()
            else:  # the epoch ran to its end
                self.position.update(epoch=epoch + 1, batch=0)
                if eval_every is None:
                    self._eval(writer, epoch)
                if checkpoint_every is None:  # (replaces a timed checkpoint of this step: the epoch is over)
                    self._checkpoint()
                continue
            break  # --max-steps ended training inside this epoch
        # the final state is evaluated and checkpointed (--max-steps may end between the regular points)
        if eval_every != 0 and self._done["eval"] != self.position["step"]:
            self._eval(writer, self.position["epoch"])
        if checkpoint_every != 0 and self._done["checkpoint"] != self.position["step"]:
            self._checkpoint()

    def _train_step(self, group: list[dict[str, torch.Tensor]], phase: Phase) -> float | None:
        """One optimizer step over ``group`` (``grad_accum`` global batches); the loss where it is held (the
        mean over the replicas with data parallelism)."""
        d = self.cfg.pipeline.data_parallel
        step = self.position["step"] + 1
        self._follow_link_schedules(step)
        if self.policy is not None:  # the error probes run every few steps (adaptive.PROBE_EVERY)
            for runner in self.engine.runners.values():
                runner.probe_now(self.policy.probes_at(step))
        with naming_peer_failures(self.transport, f"training step {step}", self._suspects):
            try:
                loss = self.engine.train_step(self._passes([self._shard(g) for g in group]), phase)
            except NonFiniteError as e:  # a codec refused a NaN/Inf activation or gradient at a boundary
                raise self._diverged(step, str(e)) from None
            if loss is not None and d > 1:
                loss = float(self._replica_sum(torch.tensor([loss], dtype=torch.float64))) / d
        return loss

    @functools.cached_property
    def link_schedules(self) -> list[LinkSchedule]:
        """``--link``, one schedule per boundary (none without it), parsed once."""
        p = self.cfg.pipeline
        return parse_links(p.link, p.stages - 1) if p.link else []

    def _follow_link_schedules(self, step: int) -> None:
        """Give this process's emulated links the setting their schedule has at ``step``, before its first
        packet (the two ends of a link read the same schedule, so they change at the same step boundary)."""
        if not self._link_schedules or self.transport is None:
            return
        for dst, schedule in self._link_schedules.items():
            self.transport.set_link(dst, schedule.at(step))
        if self.writes_metrics and step > 1:
            for b, schedule in enumerate(self.link_schedules):
                if schedule.at(step) != schedule.at(step - 1):
                    log.info("step %d: emulated link of boundary %d now %s", step, b, schedule.at(step))

    def _check_finite(self, loss: float | None) -> None:
        """After a step the engine did not apply (a NaN or infinite loss or gradient norm): stop with one
        line, or, with ``--skip-nonfinite N``, go on unless this is the (N+1)-th such step in a row."""
        if not self.engine.skipped:
            self._skipped_in_a_row = 0
            return
        step = self.position["step"] + 1
        what = ", ".join(([f"loss {loss}"] if loss is not None else [])
                         + [f"gradient norm {self.engine.last_grad_norm}"])
        self._skipped_in_a_row += 1
        allowed = self.cfg.optim.skip_nonfinite
        if self._skipped_in_a_row > allowed:
            if allowed:
                what += (f" ({self._skipped_in_a_row} such steps in a row; --skip-nonfinite {allowed} allows "
                         f"{allowed})")
            raise self._diverged(step, what)
        log.warning("step %d skipped: %s (%d of at most %d in a row, --skip-nonfinite)", step, what,
                    self._skipped_in_a_row, allowed)

    def _diverged(self, step: int, what: str) -> DivergedError:
        """The one-line error of a run that diverged at ``step``: what was not finite, what to change, and the
        checkpoint that continues the run."""
        o = self.cfg.optim
        fixes = [f"lower the learning rate (now --lr {o.lr:g})"]
        fixes.append("clip gradients (--max-grad-norm 1; now 0, off)" if o.max_grad_norm <= 0
                     else f"clip harder (--max-grad-norm below {o.max_grad_norm:g})")
        if not o.skip_nonfinite:
            fixes.append("or skip such steps (--skip-nonfinite N)")
        return DivergedError(f"training diverged at step {step}: {what}; the step was not applied. To go on: "
                             f"{', '.join(fixes)}; {where_to_continue(self.run_dir)}")

    @contextlib.contextmanager
    def _profiled(self, on: bool) -> Iterator[None]:
        """Profile the enclosed step with :mod:`torch.profiler` (the runner labels every schedule action) and
        write a chrome trace: ``trace.json`` locally, ``trace.stage<i>[.replica<r>].json`` per process."""
        if not on:
            yield
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            yield
        name = "trace"
        if self.grid is not None:
            name += f".stage{self.grid.stage}" + (f".replica{self.replica}"
                                                   if self.cfg.pipeline.data_parallel > 1 else "")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.run_dir / f"{name}.json"))

    def _eval(self, writer: MetricsWriter, epoch: int) -> None:
        with naming_peer_failures(self.transport, f"the evaluation at step {self.position['step']}",
                                  self._suspects):
            result = self.evaluate()
            self._resync()
        self._done["eval"] = self.position["step"]
        if self.writes_metrics:
            self.last_eval = result
            writer.write({"kind": "eval", "step": self.position["step"], "epoch": epoch, **result})
            log.info("eval step %d: %s", self.position["step"], json.dumps(result))

    def _log_step(self, writer: MetricsWriter, epoch: int, phase: Phase, loss: float | None, dt: float,
                  samples: int) -> None:
        # Boundary bytes are summed over the D replica pipelines (each has its own boundaries);
        # grad_sync_bytes is what every rank sent in its stage's data-parallel group, summed over all ranks (0
        # when D = 1).
        stats = [dict(zip(_STAT_KEYS, r)) for r in self._gathered_stats(dt)]
        codecs = None
        if self.policy is not None:  # the same statistics on every process: the same choice everywhere
            codecs = self.policy.specs()  # what this step sent with
            passes = self.cfg.pipeline.micro_batches * self.cfg.optim.grad_accum
            # (compressed: every step sent the links' codecs, the warm-up's too: see _build_engine)
            changes = self.policy.step(stats, passes, fills=self.cfg.optim.grad_accum)
            self._set_link_codecs(changes)
            if changes and self.writes_metrics:
                log.info("step %d: links now %s", self.position["step"],
                         ", ".join(f"{k} {v}" for k, v in changes.items()))
        sent = int(sum(s["fw_bytes"] + s["bw_bytes"] for s in stats))
        raw = int(sum(s["fw_raw"] + s["bw_raw"] for s in stats))
        sync = int(sum(s["sync_bytes"] for s in stats))
        self.totals["bytes_sent"] += sent
        self.totals["raw_bytes"] += raw
        self.totals["grad_sync_bytes"] += sync
        self.totals["samples"] += samples
        self.totals["train_s"] += dt
        if not self.writes_metrics:
            return
        per_boundary, links = {}, {}
        emulated = self.link_schedules
        for b in range(self.cfg.pipeline.stages - 1):
            for direction in ("forward", "backward"):
                name = link_name(b, direction)
                st, d, rx = link_row(stats, name)  # its sender's row, what its receiver saw held back
                per_boundary[name] = int(st[f"{d}_bytes"])
                if self.transport is None:
                    continue
                # what each link carried and how long it was busy doing it
                wire, busy = st[f"{d}_wire_bytes"], link_seconds(st[f"{d}_busy_s"], rx)
                links[name] = {"wire_bytes": int(wire), "busy_s": st[f"{d}_busy_s"], "held_back_s": rx,
                               "mbit_s": 8e-6 * wire / busy if busy > 0 else None,
                               **({"emulated": str(emulated[b].at(self.position["step"]))}
                                  if emulated else {})}
        tokens = self.task.tokens_per_sample
        skipped = self.engine.skipped
        row = {
            "kind": "train", "step": self.position["step"], "epoch": epoch, "phase": phase.value,
            "loss": None if skipped else loss,
            "lr": self.engine.lr, "samples_per_s": samples / dt,
            "tokens_per_s": samples * tokens / dt if tokens else None,
            "bytes_sent": sent, "raw_bytes": raw, "ratio": raw / sent if sent else None,
            "bytes": per_boundary, "grad_sync_bytes": sync,
            # distributed: each boundary's link as measured (bytes on the wire, busy seconds, Mbit/s achieved)
            **({"links": links} if links else {}),
            # --forward/--backward auto: the spec each link sent this step with
            **({"codecs": codecs} if codecs else {}),
            # ... and its bits per value, a number TensorBoard plots (train/link_bits/b0.forward)
            **({"link_bits": {k: BITS[v.split(":", 1)[1]] for k, v in codecs.items()}} if codecs else {}),
            "grad_norm": None if skipped else self.engine.last_grad_norm,
            "time": {"step": dt, "compute": sum(s["compute_s"] for s in stats),
                     "codec": sum(s["encode_s"] + s["decode_s"] for s in stats),
                     "wait": sum(s["wait_s"] for s in stats)},
            # ... and the relative error every rung of its ladder made on this step's probed message
            **({"link_errors": self._link_errors(stats)} if codecs else {}),
            # ... and what the rule saw after this step: budget, each link's throughput, floor, t(L) per rung
            **({"link_policy": self.policy.overview()} if self.policy is not None else {}),
            # per stage, the mean over its replicas: what one process of that stage sent and spent this step
            "stages": [{k: v / self.cfg.pipeline.data_parallel for k, v in s.items() if k not in _PROBE_KEYS}
                       for s in stats],
        }
        if skipped:  # not applied (--skip-nonfinite): no NaN in metrics.jsonl, but what it was
            row["skipped"] = f"loss {loss}, gradient norm {self.engine.last_grad_norm}"
        self.history.append(row)
        writer.write(row)

    def _link_errors(self, stats: list[dict[str, float]]) -> dict[str, dict[str, float]]:
        """Per auto link, each rung's relative error ``||x - x_hat|| / ||x||`` on the message its sender
        probed this step (the root mean square over its samples; links that probed nothing are left out)."""
        assert self.policy is not None
        out = {}
        for name, ladder in self.policy.probes().items():
            row, _, _ = link_row(stats, name)
            keys = probe_keys(parse_link(name)[1])
            if row[keys[-1]] > 0:
                out[name] = {rung: math.sqrt(row[k] / row[keys[-1]]) for rung, k in zip(ladder, keys)}
        return out

    def _summary(self, wall: float) -> dict[str, Any]:
        train_rows = [r for r in self.history if r["loss"] is not None]
        t = self.totals
        return {
            "task": self.task.name, "model": self.task.recipe.kind,
            "setting": f"{self.cfg.compression.forward}/{self.cfg.compression.backward}",
            "stages": self.cfg.pipeline.stages, "data_parallel": self.cfg.pipeline.data_parallel,
            "grad_sync": self.cfg.pipeline.grad_sync,
            **({"links": self.policy.describe()} if self.policy is not None else {}),
            **({"balance": self.balance} if self.balance is not None else {}),
            "runtime": self.cfg.pipeline.runtime, "steps": self.position["step"],
            "final_train_loss": train_rows[-1]["loss"] if train_rows else None,
            "eval": self.last_eval, "main_metric": self.task.main_metric,
            "bytes_sent": t["bytes_sent"], "raw_bytes": t["raw_bytes"],
            "compression_ratio": t["raw_bytes"] / t["bytes_sent"] if t["bytes_sent"] else None,
            "traffic_saved": 1 - t["bytes_sent"] / t["raw_bytes"] if t["raw_bytes"] else None,
            "grad_sync_bytes": t["grad_sync_bytes"],
            "samples_per_s": t["samples"] / t["train_s"] if t["train_s"] else None,
            "wall_s": wall, "run_dir": str(self.run_dir),
        }
