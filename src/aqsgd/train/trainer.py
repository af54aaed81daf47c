"""The trainer: epochs of compressed pipeline training with evaluation, metrics and checkpoints.

One :class:`Trainer` runs in every process of a run: locally a single process owns every stage; distributed
(``torch.distributed`` initialized, one process per stage) each process owns its stage and the last one, which
holds the loss, writes the metrics. The loop:

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

import dataclasses
import json
import logging
import math
import re
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from aqsgd.data.datasets import epoch_batches, num_batches
from aqsgd.data.synthetic import microbatches
from aqsgd.errors import AqsgdError
from aqsgd.pipeline.compression import CompressionConfig
from aqsgd.pipeline.materialize import load_weights, materialize_stage
from aqsgd.pipeline.partition import partition_model, shared_parameters
from aqsgd.schemes import Phase
from aqsgd.train.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from aqsgd.train.config import TrainConfig
from aqsgd.train.engine import OptimConfig, PipelineEngine
from aqsgd.train.metrics import MetricsWriter, perplexity
from aqsgd.train.tasks import TaskSetup, setup_task

__all__ = ["Trainer", "default_run_name"]

log = logging.getLogger(__name__)
_STAT_KEYS = ("fw_bytes", "bw_bytes", "fw_raw", "bw_raw", "compute", "encode", "decode", "wait")


def default_run_name(cfg: TrainConfig) -> str:
    text = f"{cfg.task}-{cfg.forward}-{cfg.backward}"
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-")


def _mcc(preds: torch.Tensor, labels: torch.Tensor) -> float:
    tp = float(((preds == 1) & (labels == 1)).sum())
    tn = float(((preds == 0) & (labels == 0)).sum())
    fp = float(((preds == 1) & (labels == 0)).sum())
    fn = float(((preds == 0) & (labels == 1)).sum())
    den = math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return (tp * tn - fp * fn) / den if den else 0.0


class Trainer:
    def __init__(self, cfg: TrainConfig, *, run_dir: str | Path | None = None) -> None:
        self.cfg = cfg.validate()
        self.distributed = dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        if self.distributed and dist.get_world_size() != cfg.stages:
            raise AqsgdError(f"{dist.get_world_size()} processes for {cfg.stages} stages: start one process per stage")
        self.run_dir = Path(run_dir) if run_dir else Path(cfg.output_dir) / (cfg.run_name or default_run_name(cfg))
        self.task: TaskSetup = setup_task(cfg)
        n_train = len(self.task.train)
        self.steps_per_epoch = math.ceil(num_batches(n_train, cfg.batch_size) / cfg.grad_accum)
        total = self.steps_per_epoch * cfg.epochs
        self.total_steps = min(total, cfg.max_steps) if cfg.max_steps else total
        optim = OptimConfig(cfg.optimizer, cfg.lr, cfg.weight_decay, int(cfg.lr_warmup * self.total_steps),
                            self.total_steps, cfg.max_grad_norm)
        cache_dir = str(self.run_dir / "cache") if cfg.cache.startswith("disk") else None
        comp = CompressionConfig.simple(cfg.forward, cfg.backward, num_samples=n_train, cache=cfg.cache,
                                        cache_dir=cache_dir, ef_key=cfg.ef_key, seed=cfg.seed)
        autocast = torch.bfloat16 if cfg.dtype == "bf16" else None
        torch.manual_seed(cfg.seed)
        recipe = self.task.recipe
        self.transport = None
        if self.distributed:
            from aqsgd.comm import LinkSpec, Transport

            module = materialize_stage(recipe, cfg.stages, self.rank, layers=cfg.layers, balance=cfg.balance)
            ties = shared_parameters(partition_model(recipe.build("meta"), cfg.stages, layers=cfg.layers,
                                                     balance=cfg.balance))
            self.transport = Transport(timeout_s=cfg.timeout, links=LinkSpec.parse(cfg.link) if cfg.link else None,
                                       peer_labels={r: f"stage {r}" for r in range(cfg.stages)})
            self.engine = PipelineEngine({self.rank: module}, cfg.stages, comp, optim, schedule=cfg.schedule,
                                         transport=self.transport, ties=ties, autocast=autocast)
        else:
            model = load_weights(recipe.build("cpu"), recipe.weights)
            stages = partition_model(model, cfg.stages, layers=cfg.layers, balance=cfg.balance)
            self.engine = PipelineEngine(dict(enumerate(stages)), cfg.stages, comp, optim, schedule=cfg.schedule,
                                         autocast=autocast)
        self.holds_loss = (not self.distributed) or self.rank == cfg.stages - 1
        self.position = {"epoch": 0, "batch": 0, "step": 0}
        self.totals = {"bytes_sent": 0, "raw_bytes": 0, "samples": 0, "train_s": 0.0}
        self.history: list[dict[str, Any]] = []
        self.last_eval: dict[str, Any] | None = None

    # -- helpers -----------------------------------------------------------------------------------------
    def _gathered_stats(self) -> list[list[float]]:
        """Per stage: bytes and seconds of the last step (gathered from every process when distributed)."""
        rows = [[0.0] * len(_STAT_KEYS) for _ in range(self.cfg.stages)]
        for i, st in self.engine.stats().items():
            rows[i] = [st.bytes_sent["forward"], st.bytes_sent["backward"], st.raw_bytes["forward"],
                       st.raw_bytes["backward"], st.compute_s, st.encode_s, st.decode_s, st.wait_s]
        if self.distributed:
            t = torch.tensor(rows, dtype=torch.float64)
            dist.all_reduce(t)  # each row has one contributor
            rows = t.tolist()
        return rows

    def _phase(self, epoch: int) -> Phase:
        return Phase.WARMUP if epoch < self.cfg.warmup_epochs else Phase.TRAIN

    def _passes(self, batches: list[dict[str, torch.Tensor]]) -> list[list[dict[str, torch.Tensor]]]:
        return [microbatches(b, self.cfg.micro_batches) for b in batches]

    # -- evaluation --------------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        classify = self.task.kind != "causal-lm"
        for name, phase in (("compressed", Phase.EVAL), ("uncompressed", Phase.EVAL_RAW)):
            total, count, preds, labels = 0.0, 0, [], []
            for batch in epoch_batches(self.task.eval, self.cfg.batch_size, seed=self.cfg.seed, epoch=0,
                                       shuffle=False):
                mbs = microbatches(batch, self.cfg.micro_batches)
                loss, logits = self.engine.evaluate(mbs, phase, keep_logits=classify)
                if loss is None:
                    continue
                n = batch["sample_ids"].numel()
                total += loss * n
                count += n
                if classify and logits is not None:
                    preds.append(torch.cat(logits).argmax(-1))
                    labels.append(batch["labels"])
            if not self.holds_loss:
                continue
            metrics: dict[str, float] = {"loss": total / max(count, 1)}
            if classify:
                p, y = torch.cat(preds), torch.cat(labels)
                metrics["accuracy"] = float((p == y).float().mean())
                if self.task.main_metric == "mcc":
                    metrics["mcc"] = _mcc(p, y)
            else:
                metrics["perplexity"] = perplexity(metrics["loss"])
            out[name] = metrics
        return out

    # -- checkpoints -------------------------------------------------------------------------------------
    def _checkpoint(self) -> None:
        pos = {**self.position, "totals": self.totals, "config": self.cfg.to_dict()}
        path = save_checkpoint(self.run_dir, self.position["step"], self.engine, pos, keep=self.cfg.keep_checkpoints)
        log.info("checkpoint %s", path)

    def _resume(self) -> None:
        path = latest_checkpoint(self.cfg.resume)  # type: ignore[arg-type]
        if path is None:
            raise CheckpointError(f"--resume: no complete checkpoint under {self.cfg.resume}")
        state = load_checkpoint(path, self.engine)
        saved = state.get("config", {})
        for key in ("task", "stages", "forward", "backward", "micro_batches", "micro_batch_size", "seed"):
            if saved.get(key) != getattr(self.cfg, key):
                raise CheckpointError(f"--resume: checkpoint has {key}={saved.get(key)!r}, this run "
                                      f"{getattr(self.cfg, key)!r}")
        self.position = {k: state[k] for k in ("epoch", "batch", "step")}
        self.totals = state["totals"]
        log.info("resumed from %s at epoch %d, batch %d, step %d", path, *self.position.values())

    # -- the loop ----------------------------------------------------------------------------------------
    def run(self, *, stop_at: int | None = None) -> dict[str, Any]:
        """Train to the end (or, for tests of interruption, stop after optimizer step ``stop_at``)."""
        self._stop_at = stop_at
        cfg = self.cfg
        if cfg.resume:
            self._resume()
        writer = MetricsWriter(self.run_dir, enabled=self.holds_loss, tensorboard=cfg.tensorboard)
        if self.holds_loss:
            (self.run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeRemainingColumn(), disable=not (self.holds_loss and cfg.progress))
        start = time.perf_counter()
        try:
            with progress:
                bar = progress.add_task("training", total=self.total_steps, completed=self.position["step"])
                self._loop(writer, progress, bar)
        finally:
            if self.transport is not None:
                self.transport.close()
        summary = self._summary(time.perf_counter() - start)
        writer.summary(summary)
        writer.close()
        return summary

    def _loop(self, writer: MetricsWriter, progress: Any, bar: Any) -> None:
        cfg = self.cfg
        B = cfg.batch_size
        for epoch in range(self.position["epoch"], cfg.epochs):
            phase = self._phase(epoch)
            batches = list(epoch_batches(self.task.train, B, seed=cfg.seed, epoch=epoch))
            first = self.position["batch"] if epoch == self.position["epoch"] else 0
            for b in range(first, len(batches), cfg.grad_accum):
                if self.position["step"] >= self.total_steps or self.position["step"] == self._stop_at:
                    return
                group = batches[b : b + cfg.grad_accum]
                if cfg.trace and self.position["step"] == self.total_steps - 1:
                    for r in self.engine.runners.values():
                        r.trace = []
                t0 = time.perf_counter()
                loss = self.engine.train_step(self._passes(group), phase)
                dt = time.perf_counter() - t0
                self.position.update(epoch=epoch, batch=b + cfg.grad_accum, step=self.position["step"] + 1)
                self._log_step(writer, epoch, phase, loss, dt, sum(g["sample_ids"].numel() for g in group))
                progress.update(bar, advance=1, description=f"epoch {epoch} {phase.value} loss "
                                f"{loss if loss is not None else float('nan'):.4f}")
                step = self.position["step"]
                if cfg.eval_every and step % cfg.eval_every == 0:
                    self._eval(writer, epoch)
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                    self._checkpoint()
            self.position.update(epoch=epoch + 1, batch=0)
            if not cfg.eval_every:
                self._eval(writer, epoch)
            if not cfg.checkpoint_every:
                self._checkpoint()
        self._write_trace()

    def _write_trace(self) -> None:
        for i, r in self.engine.runners.items():
            if r.trace:
                path = self.run_dir / f"trace.stage{i}.json"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps({"traceEvents": r.trace}))

    def _eval(self, writer: MetricsWriter, epoch: int) -> None:
        result = self.evaluate()
        if self.holds_loss:
            self.last_eval = result
            writer.write({"kind": "eval", "step": self.position["step"], "epoch": epoch, **result})
            log.info("eval step %d: %s", self.position["step"], json.dumps(result))

    def _log_step(self, writer: MetricsWriter, epoch: int, phase: Phase, loss: float | None, dt: float,
                  samples: int) -> None:
        stats = self._gathered_stats()
        sent = int(sum(r[0] + r[1] for r in stats))
        raw = int(sum(r[2] + r[3] for r in stats))
        self.totals["bytes_sent"] += sent
        self.totals["raw_bytes"] += raw
        self.totals["samples"] += samples
        self.totals["train_s"] += dt
        if not self.holds_loss:
            return
        per_boundary = {}
        for b in range(self.cfg.stages - 1):
            per_boundary[f"b{b}.forward"] = int(stats[b][0])
            per_boundary[f"b{b}.backward"] = int(stats[b + 1][1])
        tokens = self.task.tokens_per_sample
        row = {
            "kind": "train", "step": self.position["step"], "epoch": epoch, "phase": phase.value, "loss": loss,
            "lr": self.engine.lr, "samples_per_s": samples / dt, "tokens_per_s": samples * tokens / dt if tokens else None,
            "bytes_sent": sent, "raw_bytes": raw, "ratio": raw / sent if sent else None, "bytes": per_boundary,
            "grad_norm": self.engine.last_grad_norm,
            "time": {"step": dt, "compute": sum(r[4] for r in stats), "codec": sum(r[5] + r[6] for r in stats),
                     "wait": sum(r[7] for r in stats)},
        }
        self.history.append(row)
        writer.write(row)

    def _summary(self, wall: float) -> dict[str, Any]:
        train_rows = [r for r in self.history if r["loss"] is not None]
        t = self.totals
        return {
            "task": self.cfg.task, "model": self.task.recipe.kind, "setting": f"{self.cfg.forward}/{self.cfg.backward}",
            "stages": self.cfg.stages, "runtime": self.cfg.runtime, "steps": self.position["step"],
            "final_train_loss": train_rows[-1]["loss"] if train_rows else None,
            "eval": self.last_eval, "main_metric": self.task.main_metric,
            "bytes_sent": t["bytes_sent"], "raw_bytes": t["raw_bytes"],
            "compression_ratio": t["raw_bytes"] / t["bytes_sent"] if t["bytes_sent"] else None,
            "traffic_saved": 1 - t["bytes_sent"] / t["raw_bytes"] if t["raw_bytes"] else None,
            "samples_per_s": t["samples"] / t["train_s"] if t["train_s"] else None,
            "wall_s": wall, "run_dir": str(self.run_dir),
        }
