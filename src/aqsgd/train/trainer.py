"""The trainer: epochs of compressed pipeline training with evaluation, metrics and checkpoints.

One :class:`Trainer` runs in every process of a run: locally a single process owns every stage; distributed
(``torch.distributed`` initialized, one process per stage) each process owns its stage and the last one, which
holds the loss, writes the metrics. It puts together the run's components and calls them in order:

* the data (:class:`~aqsgd.train.feed.DataFeed`: global batches, this replica's shard, micro-batches);
* the engine (:func:`~aqsgd.train.build.build_engine`: the stages this process owns, their schemes,
  optimizers, transport, tied weights and data-parallel sync; ``--balance measured`` chooses the split first,
  :mod:`aqsgd.train.balance`);
* the links (:class:`~aqsgd.train.linkcontrol.LinkController`: emulated link schedules, what the links
  carried, the codecs chosen per link, with their parts of the metrics, checkpoints and summary);
* evaluation (:func:`~aqsgd.train.evaluation.evaluate`), resume checks (:mod:`aqsgd.train.resume`), the
  divergence guard (:class:`~aqsgd.train.divergence.FiniteGuard`) and the step statistics
  (:mod:`aqsgd.train.stepstats`).

Data parallelism (distributed, ``data_parallel = D > 1``): ``stages x D`` processes in the grid of
:mod:`aqsgd.parallel.grid` (rank = replica * stages + stage), ``D`` replicas of the pipeline, each training
on its shard of every global batch (:mod:`aqsgd.train.feed`). After backward each stage averages its
gradients over its replicas with ``grad_sync`` (:mod:`aqsgd.parallel.sync`; uncompressed during warm-up).
The logged loss is the mean over replicas, and stage ``S-1`` of replica 0 writes the metrics. The loop:

* epochs ``< warmup_epochs`` run in ``WARMUP`` (uncompressed; AQ-SGD fills its caches), the rest in ``TRAIN``;
* every optimizer step logs loss, learning rate, samples/s and tokens/s, bytes per boundary and direction,
  the compression ratio and the time split (compute / encode+decode / waiting) to ``metrics.jsonl`` and
  TensorBoard;
* evaluation (every epoch, or every ``eval_every`` steps) runs twice, with compression on (``EVAL``) and off
  (``EVAL_RAW``), and both are reported;
* checkpoints (every epoch, or every ``checkpoint_every`` steps, and at least every ``checkpoint_minutes``)
  hold everything needed to continue exactly, including the AQ-SGD caches; ``resume`` continues a run so
  that its losses equal an uninterrupted run's.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from aqsgd.comm.device import resolve_device
from aqsgd.comm.transport import naming_peer_failures
from aqsgd.errors import Interrupted, NonFiniteError
from aqsgd.parallel import ProcessGrid
from aqsgd.schemes import Phase
from aqsgd.train.adaptive import LinkPolicy, RuleFactory
from aqsgd.train.balance import emulate_slow_stages, measure_split
from aqsgd.train.build import build_engine, check_partition, check_processes, collective_timeout
from aqsgd.train.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, read_trainer_state
from aqsgd.train.checkpointer import Checkpointer
from aqsgd.train.config import DEFAULT_BACKWARD, DEFAULT_FORWARD, LORA_BACKWARD, LORA_FORWARD, TrainConfig
from aqsgd.train.divergence import FiniteGuard
from aqsgd.train.evaluation import evaluate
from aqsgd.train.export import describe_run, model_description
from aqsgd.train.feed import DataFeed
from aqsgd.train.linkcontrol import LinkController
from aqsgd.train.metrics import MetricsWriter
from aqsgd.train.resume import check_resumable, resume_settings, where_to_continue
from aqsgd.train.rundir import (RunDirError, RunDirLock, check_run_dir, prepare_run_dir,
                                resolve_run_dir, run_dir_of_checkpoint, set_aside_later_checkpoints,
                                truncate_metrics)
from aqsgd.train.stepstats import StageStats, gather, step_sample
from aqsgd.train.tasks import TaskSetup, setup_task
from aqsgd.train.tracing import profiled, trace_name

__all__ = ["Trainer", "StepHook"]

log = logging.getLogger(__name__)


StepHook = Callable[["Trainer", int], None]


class _Behind(Exception):
    """This replica took the other replicas' state inside a step (:meth:`Trainer._check_behind`): the loop
    goes on from their place."""


class Trainer:
    """Builds the components of one process of a run and trains with them (see the module docstring).
    ``on_step(trainer, step)`` hooks run before each optimizer step (``step`` counts from 1): a place for
    callbacks such as the tests' fault injection. ``link_rule`` builds the rule that chooses the codecs of
    ``auto`` links (:class:`~aqsgd.train.adaptive.LinkRule`). A trainer is used once; a process (group) may
    run several in turn, each with its own run directory."""

    def __init__(self, cfg: TrainConfig, *, data: tuple[Dataset, Dataset] | None = None,
                 run_dir: str | Path | None = None, on_step: Sequence[StepHook] = (),
                 link_rule: RuleFactory = LinkPolicy) -> None:
        self.cfg = cfg.validate()
        p = cfg.pipeline
        self.on_step = list(on_step)
        self.distributed = dist.is_initialized()
        check_processes(self.cfg, self.distributed)
        self.rank = dist.get_rank() if self.distributed else 0
        self.grid = (ProcessGrid.build(p.stages, p.world_replicas, timeout_s=collective_timeout(p.timeout))
                     if self.distributed else None)
        # the replica's index among all (its shard of the data): a replica that comes and goes is a process
        # group of its own, replica 0 of its grid
        self.replica = (p.dp_replica if p.dp_replica is not None else
                        self.grid.replica if self.grid is not None else 0)
        self.transport = None  # distributed: created with the engine
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
        self.device = resolve_device(p.device, distributed=self.distributed)
        self.feed = DataFeed(cfg, self.task.train, self.task.eval, replica=self.replica, device=self.device)
        self.steps_per_epoch = math.ceil(self.feed.batches_per_epoch() / cfg.optim.grad_accum)
        total = self.steps_per_epoch * cfg.optim.epochs
        self.total_steps = min(total, cfg.optim.max_steps) if cfg.optim.max_steps else total
        self._warn_if_never_compressed()
        self._warn_lora_with_default_compression()
        # --balance measured: the stages are profiled with the layers split, and the run trains with the split
        # chosen, recorded as its --layers (aqsgd.train.balance)
        self.balance: dict[str, Any] | None = None
        if p.balance == "measured" and p.layers is None:
            saved = resume_settings(cfg.run.resume).get("layers") if cfg.run.resume else None
            self.balance = (measure_split(self.cfg, self.task, self.feed, grid=self.grid,
                                          run_dir=self.run_dir, total_steps=self.total_steps,
                                          suspects=self._suspects)
                            if saved is None else
                            {"balance": "measured", "layers": list(saved), "from": str(cfg.run.resume)})
            self.cfg = self.cfg.replace(layers=self.balance["layers"])
        self.links = LinkController(self.cfg, link_rule)
        built = build_engine(self.cfg, self.task, grid=self.grid, run_dir=self.run_dir,
                             total_steps=self.total_steps, links=self.links, cache_ids=self.feed.cache_ids())
        self.engine, self.transport = built.engine, built.transport
        emulate_slow_stages(self.engine, self.cfg)
        # every replica's last stage has a loss; one of them (replica 0's) writes the metrics
        self.holds_loss = self.grid is None or self.grid.stage == p.stages - 1
        self.writes_metrics = self.holds_loss and (self.grid is None or self.grid.replica == 0)
        self.links.attach(self.engine, self.transport, self.grid, writes_metrics=self.writes_metrics)
        self.guard = FiniteGuard(self.cfg.optim, lambda: where_to_continue(self.run_dir))
        self.position = {"epoch": 0, "batch": 0, "step": 0}
        self.totals = {"bytes_sent": 0, "raw_bytes": 0, "grad_sync_bytes": 0, "samples": 0, "train_s": 0.0,
                       "tokens": 0, "pad_tokens_sent": 0}
        self._step_tokens: int | None = None  # this replica's real tokens in the step (text)
        self.history: list[dict[str, Any]] = []
        self.last_eval: dict[str, Any] | None = None
        self.checkpoints = Checkpointer(self.run_dir, self.cfg.run, distributed=self.distributed,
                                        transport=self.transport, suspects=self._suspects)
        self._evaluated = -1  # the step of the last evaluation
        self._cache_stated = False  # the AQ-SGD caches' memory is stated once, when the first step made them

    def _warn_if_never_compressed(self) -> None:
        """Compression was asked for, but the uncompressed warm-up epochs cover every step of the run: say so
        (once per run), since the summary would otherwise just show no saving."""
        c = self.cfg.compression
        asked = [f"--{d} {getattr(c, d)}" for d in c.fixed_compressed()]  # auto: warm-up too
        warm = self.steps_per_epoch * c.warmup_epochs
        if (not asked or c.warmup != "none" or self.total_steps > warm
                or (self.grid is not None and self.grid.rank != 0)):
            return
        log.warning("no step of this run will be compressed: its %d steps all fall in the %d uncompressed "
                    "warm-up epoch(s) (--warmup-epochs %d, %d steps each), so %s will not be used; lower "
                    "--warmup-epochs or train longer", self.total_steps, c.warmup_epochs, c.warmup_epochs,
                    self.steps_per_epoch, " and ".join(asked))

    def _warn_lora_with_default_compression(self) -> None:
        """--lora with full fine-tuning's default compression, named (a --lora run that names no direction
        takes the LoRA setting): measured well outside 1 % of LoRA in fp32 on both study tasks; say so once,
        naming the LoRA setting."""
        c = self.cfg.compression
        if (not self.cfg.model.lora or c.forward != DEFAULT_FORWARD or c.backward != DEFAULT_BACKWARD
                or (self.grid is not None and self.grid.rank != 0)):
            return
        log.warning("--lora with full fine-tuning's default compression: measured 4-6 %% worse than LoRA in "
                    "fp32 on the study tasks (docs/convergence.md, The default setting); --lora alone takes "
                    "the LoRA setting, which sends more: --forward %s --backward %s", LORA_FORWARD,
                    LORA_BACKWARD)

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

    def _replica_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sum a float64 tensor over the replicas of this (last) stage; identity without data parallelism."""
        if self.grid is not None and self.cfg.pipeline.world_replicas > 1:
            dist.all_reduce(values, group=self.grid.dp_group)
        return values

    def evaluate(self) -> dict[str, Any]:
        """Evaluate with compression on and off (:func:`~aqsgd.train.evaluation.evaluate`). Every process must
        call it (collective when distributed); the metrics are returned where the loss is held."""
        return evaluate(self.engine, self.feed, classify=self.task.kind != "causal-lm",
                        main_metric=self.task.main_metric, holds_loss=self.holds_loss,
                        replica_sum=self._replica_sum)

    def _resync(self) -> None:
        """After work between two steps (an evaluation, a checkpoint): every process waits for the others, so
        that the next step starts on all of them together, as a step does after the previous one's metrics
        all-reduce, and the links' statistics restart from here (the next step's alone, not the evaluation's
        fp32 traffic). Without it a stage that leaves such work first sends the next step's first messages
        while its receiver is still at it, and the wait reads as the link's time: in ``aqsgd bench adaptive``
        every step after an evaluation measured the 1 Gbit/s link at 2.5-50 Mbit/s, and its activations went a
        rung or two down each time (fp16 to q8 at steps 16 and 31, q4 to q2:l2 at step 91), then back up over
        the next steps."""
        if self.distributed:
            dist.barrier()
        self.links.resync()

    # -- checkpoints -------------------------------------------------------------------------------------
    def _checkpoint(self) -> None:
        # the model as built (what export rebuilds) with its base's digest, under the checkpoint's manifest;
        # --forward/--backward auto: the links' levels and what the rule measured of them continue on resume
        pos = {**self.position, "totals": self.totals, "config": self.cfg.to_dict(),
               "data": self.task.data_info, "model": model_description(self.task),
               "base_sha256": self.task.base_sha256, **self.links.state()}
        self.checkpoints.save(self.position["step"], self.engine, pos, self._resync)

    def _resume(self) -> int:
        """Load the newest checkpoint of ``cfg.run.resume``; returns its step. Settings that change what the
        saved state means must equal the checkpoint's (one error naming them); others may change, with a
        warning (:func:`~aqsgd.train.resume.check_resumable`)."""
        path = latest_checkpoint(self.cfg.run.resume)  # type: ignore[arg-type]
        if path is None:
            raise CheckpointError(f"--resume: no complete checkpoint under {self.cfg.run.resume}")
        trainer_state = read_trainer_state(path)  # verified against the checkpoint's manifests
        check_resumable(self.cfg, trainer_state, self.task, path)
        self.links.load_state(trainer_state)  # before the schemes are loaded
        with naming_peer_failures(self.transport, f"loading {path}", self._suspects):
            state = load_checkpoint(path, self.engine)
        self.position = {k: state[k] for k in ("epoch", "batch", "step")}
        self.totals = {**self.totals, **state["totals"]}
        if self.position["step"] >= self.total_steps:
            raise CheckpointError(f"--resume {path}: the checkpoint is at step {self.position['step']} of "
                                  f"{self.total_steps}, so there is nothing left to train; raise --epochs or "
                                  f"--max-steps to continue")
        self.checkpoints.last = self.position["step"]
        log.info("resumed from %s at epoch %d, batch %d, step %d", path, *self.position.values())
        if self.rank == 0 and run_dir_of_checkpoint(path).resolve() == self.run_dir.resolve():
            # the later checkpoints of this directory belong to the trajectory this resume abandons
            aside, moved = set_aside_later_checkpoints(self.run_dir, self.position["step"])
            if moved:
                log.warning("resumed from step %d of %s: its later checkpoints (%s) belong to the training "
                            "this resume abandons; moved to %s, where export, eval and --resume do not look",
                            self.position["step"], self.run_dir, ", ".join(moved), aside)
        return self.position["step"]

    # -- replicas that come and go (aqsgd.parallel.elastic) ----------------------------------------------
    def _elastic(self) -> Any:
        """This stage's :class:`~aqsgd.parallel.elastic.ElasticGroup` (None unless --dp-elastic), its peers'
        state exchange bound to this trainer."""
        outer = self.engine.outer
        membership = outer.membership if outer is not None else None
        if membership is not None:
            membership.state_fn, membership.load_fn = self._shared_state, self._load_shared_state
        return membership

    def _shared_state(self) -> dict[str, Any]:
        """What a joining replica takes from this one, at an outer step (inside the step that ends a round):
        the stage's weights, optimizer and scheduler state, the outer state without this replica's error
        feedback, and the position after this step (before the first step, where a launch resumed meets: the
        position as it is). Copies: the step goes on while the joiner reads."""
        state = {}
        for i, entries in self.engine.state_dict().items():
            state[i] = {k: copy.deepcopy(entries[k]) for k in ("model", "optimizer", "optimizer_class",
                                                               "scheduler")}
            state[i]["scheduler"].pop("lr_lambdas", None)
            state[i]["outer"] = self.engine.outer.shared_state()
        if self._at is None:  # (asked before the first step: a launch resumed meets at its start)
            return {"engine": state, "position": dict(self.position)}
        epoch, b = self._at
        return {"engine": state, "position": {"epoch": epoch, "batch": b + self.cfg.optim.grad_accum,
                                              "step": self.position["step"] + 1}}

    def _load_shared_state(self, state: dict[str, Any]) -> None:
        self.engine.load_state_dict(state["engine"])
        self.position = dict(state["position"])

    def _check_behind(self) -> None:
        """A replica that comes and goes may find itself behind the others at an outer step: they took one
        that failed here (its averaging alone failed), or went on without it (its heartbeats had stopped: a
        frozen process). It then took their state inside the step (:meth:`~aqsgd.parallel.outer.OuterSync.
        step`), their place in the data too: the step ends here, unlogged, and the loop goes on from that
        place (:class:`_Behind`)."""
        outer = self.engine.outer
        if outer is not None and outer.healed_in_step:
            log.warning("replica %d: behind the others at step %d; goes on from their place, after step %d "
                        "(epoch %d, batch %d)", self.replica, self._at_step, self.position["step"],
                        self.position["epoch"], self.position["batch"])
            self._behind_at.append([self._at_step, self.position["step"]])
            raise _Behind

    def _join(self) -> int | None:
        """Before the first step: meet the other replicas (:meth:`~aqsgd.parallel.outer.OuterSync.join`); if
        they are training already, at their next outer step, with a peer's state. Returns the step it joined
        at (None: no replica was ahead; it starts from its initial weights)."""
        if self._elastic() is None:
            return None
        from aqsgd.train.elastic import start_together

        start_together(self.replica, self.grid.stage if self.grid is not None else 0)
        log.info("replica %d: meeting the others through the lighthouse (replicas already training: at their "
                 "next outer step)", self.replica)
        joined = self.engine.outer.join()  # (compressed or not as the others' outer step is)
        members = list(self.engine.outer.last_round.members)
        self.engine.outer.last_round = None  # (healed in joining, not inside a step)
        if not joined:
            log.info("replica %d: no replica is ahead; replicas %s start from the initial weights",
                     self.replica, members)
            return None
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
        self._elastic()  # (binds what a joining replica takes from this one)
        joins = cfg.pipeline.dp_replica is not None and cfg.pipeline.dp_join
        self._at: tuple[int, int] | None = None  # (the loop's place: set at each step)
        self._joined_at = self._join() if joins else None
        self._behind_at: list[list[int]] = []  # [step, the others' step it went on after], each time
        if resumed_at is not None and self.writes_metrics:
            dropped = truncate_metrics(self.run_dir, resumed_at)
            if dropped:
                log.info("metrics.jsonl: dropped %d rows after step %d (they are trained again)", dropped,
                         resumed_at)
        writer = MetricsWriter(self.run_dir, enabled=self.writes_metrics, tensorboard=cfg.run.tensorboard,
                               purge_step=None if resumed_at is None else resumed_at + 1)
        if self.writes_metrics:
            describe_run(self.run_dir, self.cfg, self.task)
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
        if self.engine.outer is not None:
            self.engine.outer.close()  # (streaming's worker thread; the run's last step left it idle)
        summary = self._summary(time.perf_counter() - start)
        writer.summary(summary)
        writer.close()
        return summary

    def _loop(self, writer: MetricsWriter, progress: Any, bar: Any) -> None:
        while True:
            try:
                return self._loop_from_position(writer, progress, bar)
            except _Behind:  # (the position is the other replicas' now)
                progress.update(bar, completed=self.position["step"])

    def _loop_from_position(self, writer: MetricsWriter, progress: Any, bar: Any) -> None:
        cfg = self.cfg
        # None: at the end of every epoch; 0: never (not even at the end); N: every N optimizer steps
        eval_every, checkpoint_every = cfg.run.eval_every, cfg.run.checkpoint_every
        self.checkpoints.restart_clock()
        for epoch in range(self.position["epoch"], cfg.optim.epochs):
            phase = Phase.WARMUP if epoch < cfg.compression.warmup_epochs else Phase.TRAIN
            batches = self.feed.train_batches(epoch)
            first = self.position["batch"] if epoch == self.position["epoch"] else 0
            for b in range(first, len(batches), cfg.optim.grad_accum):
                self._at = (epoch, b)  # where a joining replica continues from, if this step ends a round
                if self.position["step"] == self._stop_at:
                    return  # a simulated interruption: no final evaluation, checkpoint or trace
                if self.position["step"] >= self.total_steps:
                    break
                loss = self._step(writer, epoch, phase, batches[b : b + cfg.optim.grad_accum], b)
                progress.update(bar, advance=1, description=f"epoch {epoch} {phase.value} loss "
                                f"{loss if loss is not None else float('nan'):.4f}")
                step = self.position["step"]
                if eval_every and step % eval_every == 0:
                    self._eval(writer, epoch)
                if self.checkpoints.due(step):
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
        if eval_every != 0 and self._evaluated != self.position["step"]:
            self._eval(writer, self.position["epoch"])
        if checkpoint_every != 0 and self.checkpoints.last != self.position["step"]:
            self._checkpoint()

    def _step(self, writer: MetricsWriter, epoch: int, phase: Phase, group: list[dict[str, torch.Tensor]],
              b: int) -> float | None:
        """One optimizer step over ``group`` (starting at batch ``b`` of the epoch), checked and logged; its
        loss where it is held."""
        for hook in self.on_step:
            hook(self, self.position["step"] + 1)
        traced = self.cfg.run.trace and self.position["step"] == self.total_steps - 1
        trace = trace_name(None if self.grid is None else self.grid.stage,
                           self.replica if self.cfg.pipeline.data_parallel > 1 else None)
        self._at_step = self.position["step"] + 1
        with profiled(traced, self.device, self.run_dir / trace):
            t0 = time.perf_counter()
            loss = self._train_step(group, phase)
            dt = time.perf_counter() - t0
        self._check_behind()
        self.guard.check(self.engine.skipped, self.position["step"] + 1, loss, self.engine.last_grad_norm)
        if not self._cache_stated:  # allocated by the first step's first visits
            self._cache_stated = True
            keyed_by = "tokens" if self.feed.cache_ids() != len(self.feed.train) else "samples"
            if (caches := self.engine.describe_caches(keyed_by)) is not None:
                who = "" if self.grid is None else f" of stage {self.grid.stage}"
                log.info("AQ-SGD caches%s: %s", who, caches)
        self.position.update(epoch=epoch, batch=b + self.cfg.optim.grad_accum, step=self.position["step"] + 1)
        with naming_peer_failures(self.transport, "the metrics all-reduce", self._suspects):
            self._log_step(writer, epoch, phase, loss, dt, self._samples(group))
        return loss

    def _samples(self, group: list[dict[str, torch.Tensor]]) -> int:
        """The samples a step's metrics count: the global batches of the whole replica group, but only this
        replica's shards for a replica that comes and goes (its metrics are its own: the others may not be
        there)."""
        if self.cfg.pipeline.dp_replica is not None:
            group = [self.feed.shard(g) for g in group]
        return sum(g["sample_ids"].numel() for g in group)

    def _train_step(self, group: list[dict[str, torch.Tensor]], phase: Phase) -> float | None:
        """One optimizer step over ``group`` (``grad_accum`` global batches); the loss where it is held (the
        mean over the replicas with data parallelism)."""
        d = self.cfg.pipeline.world_replicas
        step = self.position["step"] + 1
        self.links.before_step(step)
        with naming_peer_failures(self.transport, f"training step {step}", self._suspects):
            try:
                passes = self.feed.passes(group)
                self._step_tokens = DataFeed.tokens(passes)
                loss = self.engine.train_step(passes, phase)
            except NonFiniteError as e:  # a codec refused a NaN/Inf activation or gradient at a boundary
                raise self.guard.diverged(step, str(e)) from None
            if loss is not None and d > 1:
                loss = float(self._replica_sum(torch.tensor([loss], dtype=torch.float64))) / d
        return loss

    def _eval(self, writer: MetricsWriter, epoch: int) -> None:
        with naming_peer_failures(self.transport, f"the evaluation at step {self.position['step']}",
                                  self._suspects):
            result = self.evaluate()
            self._resync()
        self._evaluated = self.position["step"]
        if self.writes_metrics:
            self.last_eval = result
            writer.write({"kind": "eval", "step": self.position["step"], "epoch": epoch, **result})
            log.info("eval step %d: %s", self.position["step"], json.dumps(result))

    # -- metrics -----------------------------------------------------------------------------------------
    def _gathered_stats(self, dt: float) -> list[StageStats]:
        """Per stage: bytes and seconds of the last step (``dt``: the step as this process timed it), gathered
        from every process when distributed. With data parallelism each stage's figures are summed over its
        replicas (boundary bytes of all D pipelines, their seconds, and the gradient-sync bytes each rank
        sent)."""
        mine = {i: StageStats(fw_bytes=st.bytes_sent["forward"], bw_bytes=st.bytes_sent["backward"],
                              fw_raw=st.raw_bytes["forward"], bw_raw=st.raw_bytes["backward"],
                              compute_s=st.compute_s, encode_s=st.encode_s, decode_s=st.decode_s,
                              wait_s=st.wait_s, sync_bytes=self.engine.last_sync_bytes, step_s=dt,
                              tokens=self._step_tokens or 0,
                              fw_tokens_sent=st.tokens_sent["forward"],
                              bw_tokens_sent=st.tokens_sent["backward"],
                              fw_pad_sent=st.pad_tokens_sent["forward"],
                              bw_pad_sent=st.pad_tokens_sent["backward"],
                              **self.links.measure(i))
                for i, st in self.engine.stats().items()}
        return gather(mine, self.cfg.pipeline.stages, self.distributed)

    def _log_step(self, writer: MetricsWriter, epoch: int, phase: Phase, loss: float | None, dt: float,
                  samples: int) -> None:
        # Boundary bytes are summed over the D replica pipelines (each has its own boundaries);
        # grad_sync_bytes is what every rank sent in its stage's data-parallel group, summed over all ranks (0
        # when D = 1). The links see the same statistics on every process: the same choices everywhere.
        stats = self._gathered_stats(dt)
        links, link_rule = self.links.after_step(stats, self.position["step"])
        sent = int(sum(s.fw_bytes + s.bw_bytes for s in stats))
        raw = int(sum(s.fw_raw + s.bw_raw for s in stats))
        sync = int(sum(s.sync_bytes for s in stats))
        # real tokens of the step over every replica (each stage counts its own replica's), and the token
        # positions sent across the boundaries that were padding
        tokens = int(stats[0].tokens) if self._step_tokens is not None else None
        pad = int(sum(s.fw_pad_sent + s.bw_pad_sent for s in stats))
        for key, value in (("bytes_sent", sent), ("raw_bytes", raw), ("grad_sync_bytes", sync),
                           ("samples", samples), ("train_s", dt), ("tokens", tokens or 0),
                           ("pad_tokens_sent", pad)):
            self.totals[key] += value
        if not self.writes_metrics:
            return
        skipped = self.engine.skipped
        row = {
            "kind": "train", "step": self.position["step"], "epoch": epoch, "phase": phase.value,
            "loss": None if skipped else loss,
            "lr": self.engine.lr, "samples_per_s": samples / dt,
            "tokens_per_s": tokens / dt if tokens else None,
            "tokens": tokens, "pad_tokens_sent": pad if tokens is not None else None,
            "bytes_sent": sent, "raw_bytes": raw, "ratio": raw / sent if sent else None,
            "bytes": {name: int(s.sent) for name, s in step_sample(stats).links.items()},
            "grad_sync_bytes": sync, **links,
            "grad_norm": None if skipped else self.engine.last_grad_norm,
            "time": {"step": dt, "compute": sum(s.compute_s for s in stats),
                     "codec": sum(s.encode_s + s.decode_s for s in stats),
                     "wait": sum(s.wait_s for s in stats)},
            **link_rule,
            # per stage, the mean over its replicas: what one process of that stage sent and spent this step
            "stages": [s.row(self.cfg.pipeline.world_replicas) for s in stats],
        }
        if skipped:  # not applied (--skip-nonfinite): no NaN in metrics.jsonl, but what it was
            row["skipped"] = f"loss {loss}, gradient norm {self.engine.last_grad_norm}"
        self.history.append(row)
        writer.write(row)

    def _summary(self, wall: float) -> dict[str, Any]:
        train_rows = [r for r in self.history if r["loss"] is not None]
        t = self.totals
        return {
            "task": self.task.name, "model": self.task.recipe.kind,
            "setting": f"{self.cfg.compression.forward}/{self.cfg.compression.backward}",
            "warmup_codec": self.cfg.compression.warmup,
            "stages": self.cfg.pipeline.stages, "data_parallel": self.cfg.pipeline.data_parallel,
            "grad_sync": self.cfg.pipeline.grad_sync, **self.links.summary(),
            **({"balance": self.balance} if self.balance is not None else {}),
            "runtime": self.cfg.pipeline.runtime, "steps": self.position["step"],
            "final_train_loss": train_rows[-1]["loss"] if train_rows else None,
            "eval": self.last_eval, "main_metric": self.task.main_metric,
            "bytes_sent": t["bytes_sent"], "raw_bytes": t["raw_bytes"],
            "compression_ratio": t["raw_bytes"] / t["bytes_sent"] if t["bytes_sent"] else None,
            "traffic_saved": 1 - t["bytes_sent"] / t["raw_bytes"] if t["raw_bytes"] else None,
            "grad_sync_bytes": t["grad_sync_bytes"],
            "samples_per_s": t["samples"] / t["train_s"] if t["train_s"] else None,
            **({"tokens_per_s": t["tokens"] / t["train_s"] if t["train_s"] else None,
                "pad_tokens_sent": t["pad_tokens_sent"], "batching": self.feed.batching}
               if t["tokens"] else {}),
            "wall_s": wall, "run_dir": str(self.run_dir),
            **({"elastic": self._elastic_summary()} if self.cfg.pipeline.dp_elastic else {}),
        }

    def _elastic_summary(self) -> dict[str, Any]:
        """Replicas that come and go: this replica, the step it joined at (None: from the start), where it
        found itself behind the others and took their state (``[[step, their step], ...]``: it did not train
        the steps between as its own) and the members of every outer step where they changed (``[[round,
        step, [replicas]], ...]``)."""
        membership = self._elastic()
        every = self.engine.outer.every
        return {"replica": self.replica, "joined_at": getattr(self, "_joined_at", None),
                "behind": getattr(self, "_behind_at", []),
                "members": [[r, m] for r, m in membership.history] if membership is not None else [],
                "outer_every": every}
