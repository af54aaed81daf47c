"""Checkpoints: everything needed to continue a run exactly, written atomically, read without unpickling.

Layout of ``RUN_DIR/checkpoints/step-NNNNNNNN/``::

    trainer.json                 position (epoch, batch, step), totals, the config
    rank{r}.rng.json / .safetensors   RNG states of each process (python, torch)
    stage{i}/model.safetensors   the stage's parameters and buffers
    stage{i}/optimizer.pt        optimizer state (torch.save; loaded with weights_only=True)
    stage{i}/scheduler.json      LR scheduler state
    stage{i}/schemes/<key>/      each boundary scheme's state on this stage's sides (AQ-SGD caches, EF buffers)
    COMPLETE                     written last; a folder without it is ignored

With data parallelism (``D > 1`` replicas of the pipeline, see :mod:`aqsgd.parallel.grid`) the replicas of a
stage hold bit-identical parameters and optimizer states (every replica applies the same averaged gradient),
so ``model.safetensors``, ``optimizer.pt`` and ``scheduler.json`` are written once per stage, by replica 0,
and every replica loads them. What differs between replicas is kept per replica (``rank{r}`` files are per
global rank as always)::

    stage{i}/replica{r}/schemes/<key>/        replica r's boundary schemes (its samples' AQ-SGD cache rows,
                                              its EF buffers)
    stage{i}/replica{r}/grad_sync.safetensors the gradient synchronization's error-feedback state (quantized
                                              sync, PowerSGD), one per rank

With ``D = 1`` the layout is the one above (no ``replica{r}`` level), as before data parallelism.

A checkpoint is written into ``step-N.tmp`` and renamed when complete (in a distributed run every process
writes its stages there, then rank 0 renames after a barrier: the run directory must be shared by the stage
processes, as it is on one machine or a shared filesystem).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, load_model, save_file, save_model

from aqsgd.errors import AqsgdError

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "CheckpointError"]


class CheckpointError(AqsgdError, ValueError):
    """A checkpoint that is missing, incomplete or does not fit this run."""


def _scheme_key(key: tuple[int, int, str]) -> str:
    b, channel, side = key
    return f"b{b}-{'forward' if channel == 0 else 'backward'}-{side}"


def _parse_scheme_key(name: str) -> tuple[int, int, str]:
    b, direction, side = name.split("-")
    return int(b[1:]), 0 if direction == "forward" else 1, side


def _replica(engine: Any) -> tuple[int, int]:
    """``(replica, data_parallel)`` of this process's engine (``(0, 1)`` without a process grid)."""
    grid = getattr(engine, "grid", None)
    return (grid.replica, grid.data_parallel) if grid is not None else (0, 1)


def _per_replica_dir(stage_dir: Path, replica: int, data_parallel: int) -> Path:
    """Where this replica's own state of a stage lives (the stage folder itself without data parallelism)."""
    return stage_dir if data_parallel == 1 else stage_dir / f"replica{replica}"


def latest_checkpoint(path: str | Path) -> Path | None:
    """The newest complete checkpoint under a run directory (or ``path`` itself if it is one)."""
    p = Path(path)
    if (p / "COMPLETE").exists():
        return p
    root = p / "checkpoints"
    if not root.is_dir():
        return None
    done = sorted(d for d in root.iterdir() if d.name.startswith("step-") and (d / "COMPLETE").exists())
    return done[-1] if done else None


def save_checkpoint(run_dir: Path, step: int, engine: Any, position: dict[str, Any], *, keep: int = 2) -> Path:
    root = run_dir / "checkpoints"
    final = root / f"step-{step:08d}"
    tmp = root / f"step-{step:08d}.tmp"
    distributed = dist.is_initialized() and engine.distributed
    rank = dist.get_rank() if distributed else 0
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if distributed:
        dist.barrier()
    replica, data_parallel = _replica(engine)
    for i, module in engine.stages.items():
        d = tmp / f"stage{i}"
        own = _per_replica_dir(d, replica, data_parallel)
        own.mkdir(parents=True, exist_ok=True)
        if replica == 0:  # replicas hold identical weights and optimizer states: written once per stage
            save_model(module, str(d / "model.safetensors"))
            torch.save(engine.optimizers[i].state_dict(), d / "optimizer.pt")
            (d / "scheduler.json").write_text(json.dumps(engine.schedulers[i].state_dict(), default=_jsonable))
        runner = engine.runners[i]
        for key, scheme in runner.schemes.items():
            sd = own / "schemes" / _scheme_key(key)
            scheme.save(sd)
            (sd / "shape.json").write_text(json.dumps(runner.scheme_shapes[key]))
        if engine.grad_sync is not None:
            state = {k: v.detach().contiguous() for k, v in engine.grad_sync.state_dict().items()}
            save_file(state, str(own / "grad_sync.safetensors"))
    py_state = random.getstate()
    (tmp / f"rank{rank}.rng.json").write_text(json.dumps({"python": [py_state[0], list(py_state[1]), py_state[2]]}))
    save_file({"torch": torch.get_rng_state()}, str(tmp / f"rank{rank}.rng.safetensors"))
    if rank == 0:
        (tmp / "trainer.json").write_text(json.dumps(position, indent=1))
    if distributed:
        dist.barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        (final / "COMPLETE").write_text(str(step))
        old = sorted(d for d in root.iterdir() if d.name.startswith("step-") and not d.name.endswith(".tmp"))
        for d in old[:-keep]:
            shutil.rmtree(d, ignore_errors=True)
    if distributed:
        dist.barrier()
    return final


def _jsonable(o: Any) -> Any:
    if isinstance(o, torch.Tensor):
        return o.tolist()
    return None  # lr_lambdas (functions) are rebuilt from the config


def load_checkpoint(path: Path, engine: Any) -> dict[str, Any]:
    """Restore the stages this process owns, their optimizers, schedulers and schemes, and the RNG states;
    returns the trainer position."""
    if not (path / "COMPLETE").exists():
        raise CheckpointError(f"{path} is not a complete checkpoint (no COMPLETE marker)")
    rank = dist.get_rank() if (dist.is_initialized() and engine.distributed) else 0
    replica, data_parallel = _replica(engine)
    for i, module in engine.stages.items():
        d = path / f"stage{i}"
        if not d.is_dir():
            raise CheckpointError(f"{path} has no stage{i}: was it written with another number of stages?")
        own = _per_replica_dir(d, replica, data_parallel)
        if not own.is_dir():
            raise CheckpointError(f"{path} has no stage{i}/replica{replica}: was it written with another number "
                                  f"of data-parallel replicas?")
        missing, unexpected = load_model(module, str(d / "model.safetensors"), strict=False)
        if missing or unexpected:
            raise CheckpointError(f"{d}: weights do not fit stage {i} (missing {missing[:5]}, unexpected {unexpected[:5]})")
        engine.optimizers[i].load_state_dict(torch.load(d / "optimizer.pt", weights_only=True))
        sched = json.loads((d / "scheduler.json").read_text())
        sched.pop("lr_lambdas", None)
        engine.schedulers[i].load_state_dict({**engine.schedulers[i].state_dict(), **sched})
        runner = engine.runners[i]
        sdir = own / "schemes"
        if sdir.is_dir():
            for sd in sorted(sdir.iterdir()):
                key = _parse_scheme_key(sd.name)
                shape = json.loads((sd / "shape.json").read_text())
                scheme = runner.scheme(key[1], key[2], tuple(shape["shape"]), getattr(torch, shape["dtype"]))
                scheme.load(sd)
        if engine.grad_sync is not None:
            sync_file = own / "grad_sync.safetensors"
            if not sync_file.exists():
                raise CheckpointError(f"{own} has no grad_sync.safetensors: was it written without data parallelism?")
            engine.grad_sync.load_state_dict(load_file(str(sync_file)))
    rng = json.loads((path / f"rank{rank}.rng.json").read_text())["python"]
    random.setstate((rng[0], tuple(rng[1]), rng[2]))
    torch.set_rng_state(load_file(str(path / f"rank{rank}.rng.safetensors"))["torch"])
    return json.loads((path / "trainer.json").read_text())
