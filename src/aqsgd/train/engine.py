"""The pipeline engine: the stages one process runs, their optimizers, clipping and tied weights.

Locally (one process) the engine owns every stage and drives them through a
:class:`~aqsgd.pipeline.local.LocalPipeline`. Distributed, it owns one stage and its
:class:`~aqsgd.pipeline.runner.StageRunner` talks to the neighbours through a transport. Everything around the
step (optimizer, learning-rate schedule, clipping by the global norm, tied weights across stages) is written
once against "the stages this process owns", so both runtimes do the same arithmetic in the same order.

State
-----
:meth:`PipelineEngine.state_dict` returns, per stage this process owns, its part of what continues training
exactly (the process's RNG states are the caller's): the module's tensors, the optimizer's and LR
scheduler's ``state_dict()``, the runner's boundary schemes
(:meth:`~aqsgd.pipeline.runner.StageRunner.state_dict`) and, with data parallelism, the gradient
synchronization's tensors. Values are tensors, plain data, or objects that write their state into a folder
(``save(folder)``; the boundary schemes, whose caches may be large). :meth:`PipelineEngine.load_state_dict`
takes the same structure, with the folder that ``save`` wrote in place of each such object, and restores
the entries it is given: a caller may restore one entry at a time (:mod:`aqsgd.train.checkpoint` does, to
name the file at fault). Where and how the state is stored is the checkpoint's business.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from aqsgd.parallel.grid import new_group
from aqsgd.pipeline.compression import CompressionConfig, DirectionSpec
from aqsgd.pipeline.partition import shared_parameters
from aqsgd.pipeline.local import LocalPipeline
from aqsgd.pipeline.runner import StageRunner, StepStats, Transport
from aqsgd.models.stage import Batch
from aqsgd.schemes import BoundaryScheme, Phase
from aqsgd.train.optim import clip_coefficient, make_optimizer, squared_grad_norm, warmup_linear_decay

if TYPE_CHECKING:
    from aqsgd.parallel import GradSync, OuterSync, ProcessGrid

__all__ = ["PipelineEngine", "OptimConfig"]


@dataclasses.dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 1e-4
    weight_decay: float = 0.01
    warmup_steps: int = 0
    total_steps: int = 0  # 0: constant after warm-up
    max_grad_norm: float = 1.0  # <= 0: no clipping


class PipelineEngine:
    """See the module docstring. ``stages`` maps stage index -> module for the stages this process owns."""

    def __init__(
        self,
        stages: dict[int, nn.Module],
        num_stages: int,
        compression: CompressionConfig,
        optim: OptimConfig,
        *,
        schedule: str = "1f1b",
        device: torch.device | str = "cpu",
        transport: Transport | None = None,
        rank_of_stage: Sequence[int] | None = None,
        ties: Sequence[dict[int, str]] = (),
        autocast: torch.dtype | None = None,
        grid: ProcessGrid | None = None,
        grad_sync: GradSync | None = None,
        outer: OuterSync | None = None,
    ) -> None:
        """``grid`` (distributed, data parallel): this process's place in the stages x replicas grid; it gives
        the pipeline ranks (unless ``rank_of_stage`` is given), the group for the global gradient norm and the
        replicas for tied-weight groups. ``grad_sync`` averages this stage's gradients over its replicas after
        backward and tied-weight sync, before clipping (compressed except in the warm-up phase). ``outer``
        (DiLoCo, instead of ``grad_sync``) leaves the replicas alone for its interval and takes its outer step
        after the optimizers' (:mod:`aqsgd.parallel.outer`)."""
        self.num_stages = num_stages
        self.stages = dict(stages)
        self.distributed = transport is not None
        self.transport = transport
        self.grid = grid
        self.grad_sync = grad_sync
        self.outer = outer
        if outer is not None:
            outer.end = optim.total_steps  # the replicas end the run agreed
        self.last_sync_bytes = 0
        if rank_of_stage is None and grid is not None:
            rank_of_stage = grid.rank_of_stage
        self.ranks = list(rank_of_stage) if rank_of_stage is not None else list(range(num_stages))
        if (grad_sync is not None or outer is not None) and not self.distributed:
            raise ValueError("grad_sync needs a distributed engine (one stage per process in a process grid)")
        if grad_sync is not None and outer is not None:
            raise ValueError("a stage's replicas sync gradients every step or take outer steps, not both")
        if self.distributed:
            if len(self.stages) != 1:
                raise ValueError("a distributed engine runs exactly one stage per process")
            (index, module), = self.stages.items()
            self.runners = {index: StageRunner(module, index, num_stages, compression, transport,
                                               schedule=schedule, device=device, rank_of_stage=self.ranks,
                                               autocast=autocast,
                                               replica=grid.replica if grid is not None else 0)}
            self.local = None
        else:
            if sorted(self.stages) != list(range(num_stages)):
                raise ValueError(f"a local engine needs all {num_stages} stages, got {sorted(self.stages)}")
            self.local = LocalPipeline([self.stages[i] for i in range(num_stages)], compression,
                                       schedule=schedule, device=device, autocast=autocast)
            self.runners = dict(enumerate(self.local.runners))
        self.optim_config = optim
        # A parameter shared by several local stages (tied embeddings) is updated once, by the lowest stage.
        self.optimizers = {}
        claimed: set[int] = set()
        for i in sorted(self.stages):
            self.optimizers[i] = make_optimizer(self.stages[i], optim.name, optim.lr, optim.weight_decay,
                                                exclude=set(claimed))
            claimed.update(id(p) for p in self.stages[i].parameters())
        factor = warmup_linear_decay(optim.warmup_steps, optim.total_steps)
        self.schedulers = {i: torch.optim.lr_scheduler.LambdaLR(o, factor)
                           for i, o in self.optimizers.items()}
        if not self.distributed and not ties:
            ties = shared_parameters([self.stages[i] for i in range(num_stages)])
        self._not_counted: dict[int, set[str]] = {}
        for tie in ties:
            for s, name in tie.items():
                if s != min(tie):
                    self._not_counted.setdefault(s, set()).add(name)
        self._tie_groups = self._build_ties(ties)
        self.last_grad_norm = 0.0
        # whether the last train_step was not applied (a non-finite loss or gradient norm)
        self.skipped = False

    # -- ties ----------------------------------------------------------------------------------------
    def _build_ties(self, ties: Sequence[dict[int, str]]) -> list[tuple[object, torch.nn.Parameter]]:
        """Distributed only: one process group per tied parameter spanning its stages (every rank takes part
        in creating every group, in the same order, as torch.distributed requires)."""
        groups = []
        if not self.distributed:
            return groups  # local stages share the Parameter object itself
        # With data parallelism every replica pipeline has its own group per tie; all ranks create them all.
        pipelines = ([self.grid.layout.rank_of_stage(r) for r in range(self.grid.data_parallel)]
                     if self.grid is not None else [self.ranks])
        for tie in ties:
            for pipeline in pipelines:
                group = new_group(sorted(pipeline[s] for s in tie),
                                  getattr(self.transport, "timeout_s", None))
                if pipeline != self.ranks:
                    continue
                for s, name in tie.items():
                    if s in self.stages:
                        groups.append((group, self.stages[s].get_parameter(name)))
        return groups

    def _sync_tied_grads(self) -> None:
        for group, param in self._tie_groups:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=group)

    # -- steps ---------------------------------------------------------------------------------------
    def forward_backward(self, microbatches: Sequence[Batch], phase: Phase | str = Phase.TRAIN, *,
                         loss_scale: float = 1.0, keep_logits: bool = False) -> float | None:
        """One pipelined pass. Training phases accumulate gradients (of ``loss_scale`` times the mean
        micro-batch loss); returns the mean loss where the last stage runs (None elsewhere). With
        ``keep_logits`` the last stage's runner keeps each micro-batch's logits."""
        if self.local is not None:
            return float(self.local.step(microbatches, phase, loss_scale=loss_scale, keep_logits=keep_logits))
        (runner,) = self.runners.values()
        loss = runner.step(microbatches, phase, loss_scale=loss_scale, keep_logits=keep_logits)
        return None if loss is None else float(loss)

    def train_step(self, passes: Sequence[Sequence[Batch]] | Sequence[Batch],
                   phase: Phase | str = Phase.TRAIN) -> float | None:
        """One optimizer update from one pipelined pass (a list of micro-batches) or several accumulated
        passes (a list of lists); returns the mean loss over passes where the last stage runs.

        A step whose loss or global gradient norm is NaN or infinite (on any stage or replica: every process
        learns it from the norm's all-reduce) is not applied: the optimizers do not step, the LR schedule
        does.
        :attr:`skipped` says so afterwards, on every process alike, and :attr:`last_grad_norm` holds the norm
        (``inf`` where a replica's gradients were already non-finite before the data-parallel sync)."""
        if passes and isinstance(passes[0], dict):
            passes = [passes]  # type: ignore[list-item]
        for o in self.optimizers.values():
            o.zero_grad(set_to_none=True)
        losses = [self.forward_backward(p, phase, loss_scale=1.0 / len(passes)) for p in passes]  # type: ignore[arg-type]
        loss = None if losses[0] is None else sum(losses) / len(losses)  # type: ignore[arg-type]
        self.skipped = False
        with record_function("sync tied gradients"):
            self._sync_tied_grads()
        if self.grad_sync is not None and not self._replicas_finite(loss):
            self.skipped, self.last_grad_norm = True, math.inf  # a compressed sync could not encode them
        else:
            with record_function("sync replicas"):
                self._sync_replicas(phase)
            with record_function("clip gradients"):
                self.skipped = not self.clip(loss)
        with record_function("optimizer step"):
            for i in sorted(self.optimizers):
                if not self.skipped:
                    self.optimizers[i].step()
                self.schedulers[i].step()
        if self.outer is not None:
            with record_function("outer step" if self.outer.due else "count outer step"):
                self.last_sync_bytes = self.outer.step(compress=Phase(phase) != Phase.WARMUP)
        return loss

    def _replicas_finite(self, loss: float | None) -> bool:
        """Whether every replica's gradients (and loss, where it is held) are finite, before they are synced:
        one all-reduce over every process of the run."""
        sq = sum(float(squared_grad_norm(m.parameters())) for m in self.stages.values())
        bad = torch.tensor([0.0 if math.isfinite(sq) and (loss is None or math.isfinite(loss)) else 1.0],
                           dtype=torch.float64)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return not bad.item()

    def _sync_replicas(self, phase: Phase | str) -> None:
        """Average gradients over this stage's data-parallel replicas; uncompressed in the warm-up phase."""
        if self.grad_sync is None:
            return
        params = [p for i in sorted(self.stages) for p in self.stages[i].parameters()]
        self.last_sync_bytes = self.grad_sync.sync(params, compress=Phase(phase) != Phase.WARMUP)

    def evaluate(self, microbatches: Sequence[Batch], phase: Phase | str = Phase.EVAL, *,
                 keep_logits: bool = False) -> tuple[float | None, list[torch.Tensor] | None]:
        """Forward-only pass in eval mode; returns the loss (the micro-batch losses weighted by their sizes:
        the mean over the samples, also where the micro-batches are uneven; over the loss tokens where a
        micro-batch counts them, ``loss_tokens``) and (if asked) the last stage's
        logits per micro-batch, where the last stage runs."""
        for m in self.stages.values():
            m.eval()
        try:
            with torch.no_grad():
                loss = self.forward_backward(microbatches, phase, keep_logits=keep_logits)
        finally:
            for m in self.stages.values():
                m.train()
        logits = None
        last = self.runners.get(self.num_stages - 1)
        if last is not None and last.losses:
            sizes = [_size(m) for m in microbatches]
            losses = torch.stack([last.losses[mb].double().cpu() for mb in sorted(last.losses)])
            loss = float((losses * torch.tensor(sizes, dtype=torch.float64)).sum() / sum(sizes))
        if keep_logits and last is not None:
            logits = [last.kept_logits[mb] for mb in sorted(last.kept_logits)]
        return loss, logits

    def stage_sq_norms(self, loss: float | None = None) -> list[float]:
        """Every stage's squared gradient norm, in stage order (gathered across processes when distributed),
        then one entry that is 1.0 if ``loss`` (where this process holds it) is NaN or infinite, else 0.0. A
        parameter tied across stages counts once, on the lowest stage that holds it."""
        values = [0.0] * (self.num_stages + 1)
        owned = sorted(self.stages)
        norms = [squared_grad_norm(p for n, p in self.stages[i].named_parameters()
                                   if n not in self._not_counted.get(i, ())) for i in owned]
        for i, v in zip(owned, torch.stack([n.to(norms[0].device) for n in norms]).tolist()):  # one host read
            values[i] = v
        values[-1] = 0.0 if loss is None or math.isfinite(loss) else 1.0
        if self.distributed:
            t = torch.tensor(values, dtype=torch.float64)
            # each entry has exactly one non-zero contributor in the pipeline: the sum is exact
            dist.all_reduce(t, group=self.grid.pipeline_group if self.grid is not None else None)
            values = t.tolist()
        return values

    def clip(self, loss: float | None = None) -> bool:
        """Clip the gradients to the global norm ``max_grad_norm`` (unless it is 0); whether the step may be
        applied: the norm is finite and so is ``loss`` (on every stage of the pipeline). Records the norm in
        :attr:`last_grad_norm`."""
        cfg = self.optim_config
        *norms, loss_bad = self.stage_sq_norms(loss)
        norm, factor = clip_coefficient(norms, cfg.max_grad_norm)
        self.last_grad_norm = norm
        if loss_bad or not math.isfinite(norm):
            return False
        if factor < 1.0:
            grads: dict[int, torch.Tensor] = {}  # a parameter shared by local stages once
            for m in self.stages.values():
                for p in m.parameters():
                    if p.grad is not None:
                        grads.setdefault(id(p), p.grad)
            torch._foreach_mul_(list(grads.values()), factor)
        return True

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[int, dict[str, Any]]:
        """Per stage this process owns (see the module docstring):

        * ``model``: the module's ``state_dict()``, a tensor held under several names (tied weights) once,
          under the first of them in sorted order;
        * ``optimizer``: the optimizer's ``state_dict()``; ``optimizer_class``: the optimizer's class name;
        * ``scheduler``: the LR scheduler's ``state_dict()``;
        * ``schemes``: the runner's boundary schemes (:meth:`StageRunner.state_dict`);
        * ``grad_sync`` (with gradient synchronization): its ``state_dict()``, tensors;
        * ``outer`` (with outer steps): the round's anchors, the outer momentum and the steps taken, tensors;
          ``agreed_model``: ``model`` with the anchors in place of the trainable parameters.

        The values refer to the live state; nothing is copied."""
        out: dict[int, dict[str, Any]] = {}
        for i in sorted(self.stages):
            model = self.stages[i].state_dict()
            for names in _shared_names(model):
                for name in names[1:]:
                    del model[name]
            for name in _frozen(self.stages[i]):  # frozen weights (LoRA's base) come from the model's files
                model.pop(name, None)
            optimizer = self.optimizers[i]
            out[i] = {"model": model, "optimizer": optimizer.state_dict(),
                      "optimizer_class": type(optimizer).__name__,
                      "scheduler": self.schedulers[i].state_dict(), "schemes": self.runners[i].state_dict()}
            if self.grad_sync is not None:
                out[i]["grad_sync"] = self.grad_sync.state_dict()
            if self.outer is not None:
                out[i]["outer"] = self.outer.state_dict()
                # the weights the replicas last agreed on (the stage's model for export and evaluation)
                agreed = {name: self.outer.agreed(p)
                          for name, p in self.stages[i].named_parameters(remove_duplicate=False)}
                out[i]["agreed_model"] = {k: v if agreed.get(k) is None else agreed[k]
                                          for k, v in model.items()}
        return out

    def load_state_dict(self, state: Mapping[int, Mapping[str, Any]], *, strict: bool = True,
                        ) -> dict[int, tuple[list[str], list[str]]]:
        """Restore the entries ``state`` gives, in the form of :meth:`state_dict` (for ``schemes``, each
        scheme's folder in place of the scheme, see :meth:`StageRunner.load_state_dict`); entries left out are
        left as they are. Returns ``(missing, unexpected)`` tensor names per stage whose ``model`` was given
        (a tied tensor is present if one of its names is); with ``strict`` either being non-empty is a
        ValueError. The saved ``lr_lambdas`` of a scheduler are ignored: they are functions, rebuilt from the
        settings."""
        unknown = sorted(set(state) - set(self.stages))
        if unknown:
            raise ValueError(f"this process does not own stage(s) {unknown}; it owns {sorted(self.stages)}")
        fits: dict[int, tuple[list[str], list[str]]] = {}
        for i, entries in state.items():
            extra = sorted(set(entries) - _STAGE_STATE)
            if extra:
                raise ValueError(f"stage {i}: unknown state entries {extra}; known: {sorted(_STAGE_STATE)}")
            if "model" in entries:
                fits[i] = self._load_model(i, entries["model"])
                if strict and (fits[i][0] or fits[i][1]):
                    missing, unexpected = fits[i]
                    raise ValueError(f"weights do not fit stage {i} (missing {missing[:5]}, unexpected "
                                     f"{unexpected[:5]})")
            optimizer = self.optimizers[i]
            kind = entries.get("optimizer_class")
            if kind is not None and kind != type(optimizer).__name__:
                raise ValueError(f"the state of the {kind} optimizer does not fit stage {i}'s "
                                 f"{type(optimizer).__name__}")
            if "optimizer" in entries:
                optimizer.load_state_dict(entries["optimizer"])
            if "scheduler" in entries:
                saved = entries["scheduler"]
                if not isinstance(saved, Mapping):
                    raise ValueError(f"a scheduler state is a mapping, got {type(saved).__name__}")
                saved = {k: v for k, v in saved.items() if k != "lr_lambdas"}
                self.schedulers[i].load_state_dict({**self.schedulers[i].state_dict(), **saved})
            if "schemes" in entries:
                self.runners[i].load_state_dict(entries["schemes"])
            if "grad_sync" in entries:
                if self.grad_sync is None:
                    raise ValueError("this engine has no gradient synchronization to restore")
                self.grad_sync.load_state_dict(entries["grad_sync"])
            if "outer" in entries:
                if self.outer is None:
                    raise ValueError("this engine takes no outer steps (diloco) to restore")
                self.outer.load_state_dict(entries["outer"])
        return fits

    def _load_model(self, i: int, tensors: Mapping[str, torch.Tensor]) -> tuple[list[str], list[str]]:
        module = self.stages[i]
        result = module.load_state_dict(tensors, strict=False)
        tied = {name: names for names in _shared_names(module.state_dict()) for name in names}
        frozen = _frozen(module)
        missing = [n for n in result.missing_keys
                   if n not in frozen and not any(t in tensors for t in tied.get(n, ()))]
        return sorted(missing), sorted(result.unexpected_keys)

    # -- links -----------------------------------------------------------------------------------------
    def set_link(self, b: int, channel: int, *, codec: DirectionSpec | None = None,
                 probe: Sequence[str] | None = None, compress_warmup: bool = False) -> None:
        """:meth:`~aqsgd.pipeline.runner.StageRunner.set_link` on every stage this process owns (those that
        have no side of boundary ``b`` keep it for nothing)."""
        for runner in self.runners.values():
            runner.set_link(b, channel, codec=codec, probe=probe, compress_warmup=compress_warmup)

    def probe_now(self, on: bool) -> None:
        """Whether the probing senders (:meth:`set_link`) probe this step's message."""
        for runner in self.runners.values():
            runner.probe_now(on)

    # -- introspection -------------------------------------------------------------------------------
    def describe_caches(self, keyed_by: str = "samples") -> str | None:
        """How much memory (or disk) this process's AQ-SGD caches take, in words (None: none): one row per
        id (``keyed_by``: training samples, or real tokens for examples of their own lengths) and boundary
        side, allocated whole at the first visit, often the largest memory a fine-tuning run has."""
        caches = [s.cache for s in self.schemes().values() if getattr(s, "cache", None) is not None]
        caches = [c for c in caches if c.row_shape is not None]
        if not caches:
            return None
        total = sum(c.nbytes for c in caches)
        c = caches[0]
        where = "on disk" if c.backend == "disk" else "in memory"
        hint = "; --cache disk keeps them on disk" if c.backend == "memory" else ""
        return (f"{total / 1e6:.1f} MB {where} ({len(caches)} boundary sides x {c.capacity} {keyed_by} x "
                f"{' x '.join(map(str, c.row_shape))} values){hint}")

    def stats(self) -> dict[int, StepStats]:
        return {i: r.stats for i, r in self.runners.items()}

    def schemes(self) -> dict[tuple[int, int, str], BoundaryScheme]:
        out = {}
        for r in self.runners.values():
            out.update(r.schemes)
        return out

    @property
    def lr(self) -> float:
        return next(iter(self.schedulers.values())).get_last_lr()[0]


def _frozen(module: torch.nn.Module) -> set[str]:
    """Names of ``module``'s parameters that are not trained (none, unless the run trains LoRA adapters),
    under every name they have: a frozen embedding tied to the LM head is frozen as ``lm_head.weight`` too, so
    that neither name is saved nor missed on loading."""
    return {n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}


_STAGE_STATE = frozenset({"model", "optimizer", "optimizer_class", "scheduler", "schemes", "grad_sync",
                          "outer", "agreed_model"})


def _shared_names(state: Mapping[str, Any]) -> list[list[str]]:
    """The groups of names (sorted, two or more) under which ``state`` holds one tensor: the same memory with
    the same view, as tied weights are."""
    groups: dict[tuple[Any, ...], list[str]] = {}
    for name in sorted(state):
        t = state[name]
        if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.untyped_storage().data_ptr() != 0:
            view = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape),
                    t.stride())
            groups.setdefault(view, []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _size(microbatch: Batch) -> int:
    """What a micro-batch's mean loss is a mean over: its loss tokens where it counts them (examples of their
    own lengths), else its samples."""
    if "loss_tokens" in microbatch:
        return int(microbatch["loss_tokens"])
    if "sample_ids" in microbatch:
        return int(microbatch["sample_ids"].numel())
    return next(iter(microbatch.values())).shape[0]
