"""Checkpoints: everything needed to continue a run exactly, written atomically, read without unpickling.

Layout of ``RUN_DIR/checkpoints/step-NNNNNNNN/``::

    trainer.json                 position (epoch, batch, step), totals, the config
    rank{r}.rng.json / .safetensors   RNG states of each process (python, torch)
    stage{i}/model.safetensors   the stage's parameters and buffers
    stage{i}/optimizer.pt        optimizer state (torch.save; loaded with weights_only=True)
    stage{i}/scheduler.json      LR scheduler state
    stage{i}/schemes/<key>/      each boundary scheme's state on this stage's sides (AQ-SGD caches, EF buffers)
    COMPLETE                     written last; a folder without it is ignored

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
    for i, module in engine.stages.items():
        d = tmp / f"stage{i}"
        d.mkdir(parents=True, exist_ok=True)
        save_model(module, str(d / "model.safetensors"))
        torch.save(engine.optimizers[i].state_dict(), d / "optimizer.pt")
        (d / "scheduler.json").write_text(json.dumps(engine.schedulers[i].state_dict(), default=_jsonable))
        runner = engine.runners[i]
        for key, scheme in runner.schemes.items():
            sd = d / "schemes" / _scheme_key(key)
            scheme.save(sd)
            (sd / "shape.json").write_text(json.dumps(runner.scheme_shapes[key]))
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
    for i, module in engine.stages.items():
        d = path / f"stage{i}"
        if not d.is_dir():
            raise CheckpointError(f"{path} has no stage{i}: was it written with another number of stages?")
        missing, unexpected = load_model(module, str(d / "model.safetensors"), strict=False)
        if missing or unexpected:
            raise CheckpointError(f"{d}: weights do not fit stage {i} (missing {missing[:5]}, unexpected {unexpected[:5]})")
        engine.optimizers[i].load_state_dict(torch.load(d / "optimizer.pt", weights_only=True))
        sched = json.loads((d / "scheduler.json").read_text())
        sched.pop("lr_lambdas", None)
        engine.schedulers[i].load_state_dict({**engine.schedulers[i].state_dict(), **sched})
        runner = engine.runners[i]
        sdir = d / "schemes"
        if sdir.is_dir():
            for sd in sorted(sdir.iterdir()):
                key = _parse_scheme_key(sd.name)
                shape = json.loads((sd / "shape.json").read_text())
                scheme = runner.scheme(key[1], key[2], tuple(shape["shape"]), getattr(torch, shape["dtype"]))
                scheme.load(sd)
    rng = json.loads((path / f"rank{rank}.rng.json").read_text())["python"]
    random.setstate((rng[0], tuple(rng[1]), rng[2]))
    torch.set_rng_state(load_file(str(path / f"rank{rank}.rng.safetensors"))["torch"])
    return json.loads((path / "trainer.json").read_text())
