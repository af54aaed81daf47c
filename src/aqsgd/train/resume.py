"""Continuing a run from its checkpoint: which settings it takes from the run, which must match, and what
else must be the same (its data, a LoRA run's base model).

Settings that change what a checkpoint's state means (the model and its cut into stages, the data and sample
ids, the order of the data, the boundary schemes and their caches, the optimizer's state, the data-parallel
grid and its error-feedback buffers) must equal the checkpoint's (:data:`RESUME_MUST_MATCH`); every other
setting may change on resume (lr, epochs, evaluation, ...), with a warning naming each one that did.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aqsgd.train.checkpoint import CheckpointError, latest_checkpoint, read_trainer_state
from aqsgd.train.config import TrainConfig, flatten_config
from aqsgd.train.modelfiles import check_same_base
from aqsgd.train.tasks import effective_settings

if TYPE_CHECKING:
    from aqsgd.train.tasks import TaskSetup

__all__ = ["RESUME_MUST_MATCH", "check_resumable", "resume_settings", "where_to_continue"]

log = logging.getLogger(__name__)

RESUME_MUST_MATCH = frozenset({
    "task", "model", "max_length", "max_train_samples", "model_layers", "hidden_size", "vocab_size", "stages",
    "layers", "balance", "micro_batches", "micro_batch_size", "data_parallel", "grad_sync", "grad_bucket_mb",
    "forward", "backward", "cache", "ef_key", "optimizer", "grad_accum", "seed", "lora", "lora_rank",
    "lora_alpha", "lora_targets", "batching",
    # an elastic replica's run: whose shard it trains, and the layout of its checkpoints
    "dp_elastic", "dp_replica",
    # which rows are training samples: a changed split or column would turn trained samples into evaluation
    # ones (and give the cache's sample ids other rows)
    "eval_split", "text_column", "text_pair_column", "label_column", "txt_unit"})
# where and how this invocation runs and reports: not part of the training, never compared
_RUN_ONLY = frozenset({"cache_dir", "output_dir", "run_name", "resume", "overwrite", "progress",
                       "tensorboard", "trace", "timeout", "checksum", "keep_checkpoints",
                       "checkpoint_minutes", "threads"})
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


def check_resumable(cfg: TrainConfig, trainer_state: dict[str, Any], task: TaskSetup, path: Path) -> None:
    """Raise :class:`CheckpointError` (one line) unless the run of ``cfg`` on ``task`` may continue the
    checkpoint at ``path`` (whose ``trainer.json`` is ``trainer_state``): settings of
    :data:`RESUME_MUST_MATCH` equal, the same data, a LoRA run's base model unchanged. Warns about the other
    settings that changed."""
    # flat in checkpoints written before the config was nested
    saved = effective_settings(flatten_config(trainer_state.get("config", {})))
    defaults = TrainConfig().flat()  # checkpoints written before a setting existed ran with its default
    mine = effective_settings(cfg.flat())
    differ = {k: (saved.get(k, defaults[k]), mine[k]) for k in mine
              if k not in _RUN_ONLY and saved.get(k, defaults[k]) != mine[k]}
    fixed = {k: v for k, v in differ.items() if k in RESUME_MUST_MATCH}
    if fixed:
        what = ", ".join(f"{k}={a!r} (this run: {b!r})" for k, (a, b) in fixed.items())
        raise CheckpointError(f"--resume {path}: the checkpoint was trained with {what}; these settings must "
                              f"match to continue it")
    was, now = trainer_state.get("data", {}).get("fingerprint"), task.data_info.get("fingerprint")
    if was is not None and was != now:
        info = task.data_info
        files = (", ".join(str(info[k]) for k in ("train_file", "eval_file", "dataset") if info.get(k))
                 or "the data")
        raise CheckpointError(f"--resume {path}: {files} changed since the checkpoint (sha256 "
                              f"{str(was)[:12]}... then, {str(now)[:12]}... now); its sample ids and cached "
                              f"activations would not match: restore the data or start a new run")
    if cfg.model.lora:  # the checkpoint holds the adapters only: the base must be the one they fit
        check_same_base(trainer_state.get("base_sha256"), task.base_sha256, task.model_folder,
                        f"--resume {path}")
    if differ:
        log.warning("resuming %s with changed settings: %s", path,
                    ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in differ.items()))
