"""Reading a checkpoint: find the newest complete one, verify everything this process will read, then restore.

Restoring hands each file's contents to the engine's
:meth:`~aqsgd.train.engine.PipelineEngine.load_state_dict`, one entry at a time, so that every failure names
its file.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from aqsgd.train.checkpoint.layout import (
    COMPLETE,
    MANIFEST,
    STEP_DIR,
    TRAINER,
    CheckpointError,
    agreed,
    one_line,
    parse_scheme_dir,
    per_replica_dir,
    process_of,
    raise_agreed,
    relative,
    replica_of,
)
from aqsgd.train.checkpoint.manifest import Manifest, head, read_json

__all__ = ["latest_checkpoint", "load_checkpoint", "read_trainer_state"]


def latest_checkpoint(path: str | Path) -> Path | None:
    """The newest complete checkpoint under a run directory (or ``path`` itself if it is one); ``None`` if
    there is none. Unfinished ``step-N.tmp`` folders are never taken. Raises :class:`CheckpointError` if that
    checkpoint's manifests or ``trainer.json`` are damaged (an older one can be resumed by naming its
    folder)."""
    p = Path(path)
    if p.name.endswith(".tmp"):
        return None
    if (p / COMPLETE).exists():
        found: Path | None = p
    else:
        root = p / "checkpoints"
        if not root.is_dir():
            return None
        done = sorted(d for d in root.iterdir() if STEP_DIR.fullmatch(d.name) and (d / COMPLETE).is_file())
        found = done[-1] if done else None
    if found is not None:
        try:
            head(found)
        except CheckpointError as e:
            raise CheckpointError(_pointing_back(found, str(e))) from None
    return found


def _pointing_back(path: Path, message: str) -> str:
    """``message`` about a damaged checkpoint, followed by the newest older one of the same run whose
    manifests verify (the files it lists are verified when it is loaded), to continue from instead."""
    root = path.parent
    if not root.is_dir():
        return message
    older = sorted((d for d in root.iterdir() if STEP_DIR.fullmatch(d.name) and d.name < path.name
                    and (d / COMPLETE).is_file()), reverse=True)
    for d in older:
        try:
            head(d)
        except CheckpointError:
            continue
        return f"{message}; the previous complete checkpoint is {d}: continue from it with --resume {d}"
    return f"{message}; the run has no older complete checkpoint"


def read_trainer_state(path: str | Path) -> dict[str, Any]:
    """The verified ``trainer.json`` of a checkpoint (position, totals, config); :class:`CheckpointError` if
    the checkpoint is incomplete or damaged."""
    return head(Path(path))[1]


@contextlib.contextmanager
def _reading(file: Path, what: str) -> Iterator[None]:
    """Turn any failure to read or apply ``file`` into a one-line :class:`CheckpointError`."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{file}: {what}: {one_line(exc)}") from None


def _plan(manifest: Manifest, engine: Any, held: dict[int, dict[str, Any]], rank: int,
          ) -> tuple[list[str], list[str]]:
    """The files and scheme folders this process will read for the state it holds (``held``: the engine's
    state, for its stages and entries); checks the checkpoint's shape against the run."""
    path = manifest.path
    replica, data_parallel = replica_of(engine)
    num_stages = int(engine.num_stages)
    if manifest.stages != num_stages or manifest.data_parallel != data_parallel:
        raise CheckpointError(f"{path / MANIFEST}: written by a run of {manifest.stages} stages x "
                              f"{manifest.data_parallel} replicas, this run has {num_stages} x "
                              f"{data_parallel}")
    files = [TRAINER, f"rank{rank}.rng.json", f"rank{rank}.rng.safetensors"]
    trees = []
    for i, state in held.items():
        d = f"stage{i}"
        if not any(f.startswith(d + "/") for f in manifest.files):
            raise CheckpointError(f"{path} has no stage{i}: was it written with another number of stages?")
        own = d if data_parallel == 1 and "outer" not in state else f"{d}/replica{replica}"
        w = own if "outer" in state else d  # outer steps (diloco): each replica's weights of its own
        files += [f"{w}/model.safetensors", f"{w}/optimizer.pt", f"{w}/scheduler.json"]
        prefix = f"{own}/schemes/"
        trees += sorted({prefix + f[len(prefix):].split("/")[0] for f in manifest.files
                         if f.startswith(prefix)})
        if "grad_sync" in state:
            if not manifest.has(f"{own}/grad_sync.safetensors"):
                raise CheckpointError(f"{path / own} has no grad_sync.safetensors: was it written without "
                                      "data parallelism?")
            files.append(f"{own}/grad_sync.safetensors")
        if "outer" in state:
            if not manifest.has(f"{own}/outer.safetensors"):
                raise CheckpointError(f"{path / own} has no outer.safetensors: was it written without outer "
                                      "steps (--grad-sync diloco:H)?")
            files.append(f"{own}/outer.safetensors")
    for t in trees:
        if t not in manifest.trees:
            raise CheckpointError(f"{path / t}: not a scheme folder of the checkpoint's manifests (damaged "
                                  "manifest)")
    for f in files:
        if not manifest.has(f):
            raise CheckpointError(f"{path / f}: missing from the checkpoint's manifests (damaged, or written "
                                  "by another version)")
    return files, trees


def load_checkpoint(path: Path, engine: Any) -> dict[str, Any]:
    """Restore the stages this process owns, their optimizers, schedulers and schemes, and the RNG states;
    returns the trainer position. Everything this process reads is verified first (see the package docstring);
    every problem is a one-line :class:`CheckpointError` naming the file."""
    path = Path(path)
    distributed, rank, _ = process_of(engine)
    held = engine.state_dict()
    error = None
    try:
        if path.name.endswith(".tmp"):
            raise CheckpointError(f"{path} is an unfinished checkpoint (a .tmp folder); it is never loaded")
        if not (path / COMPLETE).exists():
            raise CheckpointError(f"{path} is not a complete checkpoint (no {COMPLETE} marker)")
        manifest, state = head(path)
        files, trees = _plan(manifest, engine, held, rank)
        manifest.check_mirrors()
        manifest.verify([f for f in files if f != TRAINER])
        for t in trees:
            manifest.verify_tree(t)
    except CheckpointError as exc:
        error = _pointing_back(path, str(exc))
    error, at = agreed(error, distributed)
    if error is not None:
        raise_agreed(error, at, own=at == rank)
    _restore(path, engine, held, rank, trees, manifest.optimizers)
    return state


def _scheme_shape(file: Path) -> dict[str, Any]:
    """A scheme folder's ``shape.json``: the shape (a list of ints) and dtype name the scheme was built
    for."""
    shape = read_json(file)
    dims = [int(n) for n in shape["shape"]]
    dtype = str(shape["dtype"])
    if not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return {"shape": dims, "dtype": dtype}


def _restore(path: Path, engine: Any, held: dict[int, dict[str, Any]], rank: int, trees: list[str],
             optimizers: dict[str, str]) -> None:
    replica, data_parallel = replica_of(engine)
    for i, state in held.items():
        d = path / f"stage{i}"
        own = per_replica_dir(d, replica, data_parallel, outer="outer" in state)
        w = own if "outer" in state else d
        file = w / "model.safetensors"
        with _reading(file, f"cannot load the weights of stage {i}"):
            missing, unexpected = engine.load_state_dict({i: {"model": load_file(str(file))}},
                                                         strict=False)[i]
        if missing or unexpected:
            raise CheckpointError(f"{file}: weights do not fit stage {i} (missing {sorted(missing)[:5]}, "
                                  f"unexpected {sorted(unexpected)[:5]})")
        file = w / "optimizer.pt"
        kind = optimizers.get(relative(file, path))
        if kind is not None and kind != state["optimizer_class"]:
            raise CheckpointError(f"{file}: holds the state of the {kind} optimizer, this run's stage {i} "
                                  f"uses {state['optimizer_class']}")
        with _reading(file, f"does not fit the optimizer of stage {i}"):
            # read onto the host wherever it was saved; the optimizer moves it to its parameters' device
            saved = torch.load(file, weights_only=True, map_location="cpu")
            engine.load_state_dict({i: {"optimizer": saved}})
        file = w / "scheduler.json"
        sched = read_json(file)
        with _reading(file, f"does not fit the LR scheduler of stage {i}"):
            if not isinstance(sched, dict):
                raise ValueError("not a JSON object")
            engine.load_state_dict({i: {"scheduler": sched}})
        prefix = relative(own / "schemes", path) + "/"
        for tree in (t for t in trees if t.startswith(prefix)):
            sd = path / tree
            key = parse_scheme_dir(sd.name)
            if key is None:
                raise CheckpointError(f"{sd}: not a boundary scheme folder "
                                      "(b<N>-forward|backward-sender|receiver)")
            with _reading(sd / "shape.json", f"does not describe the {sd.name} scheme of stage {i}"):
                built_for = _scheme_shape(sd / "shape.json")
            with _reading(sd, f"cannot restore the {sd.name} scheme of stage {i}"):
                engine.load_state_dict({i: {"schemes": {key: {**built_for, "scheme": sd}}}})
        if "grad_sync" in state:
            file = own / "grad_sync.safetensors"
            with _reading(file, "cannot restore the gradient synchronization state"):
                engine.load_state_dict({i: {"grad_sync": load_file(str(file))}})
        if "outer" in state:
            file = own / "outer.safetensors"
            with _reading(file, "cannot restore the outer steps' state"):
                engine.load_state_dict({i: {"outer": load_file(str(file))}})
    file = path / f"rank{rank}.rng.json"
    rng = read_json(file)
    with _reading(file, "not a Python RNG state"):
        py = rng["python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
    file = path / f"rank{rank}.rng.safetensors"
    with _reading(file, "not a torch RNG state"):
        states = load_file(str(file))
        torch.set_rng_state(states["torch"])
        if "cuda" in states and torch.cuda.is_available():  # a GPU run's (a CPU run has no use for it)
            torch.cuda.set_rng_state(states["cuda"])
