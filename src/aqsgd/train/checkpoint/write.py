"""Writing a checkpoint: every process writes, hashes and fsyncs its files into ``step-N.tmp``; rank 0
publishes it.

What a process writes is the engine's :meth:`~aqsgd.train.engine.PipelineEngine.state_dict`, placed as the
package docstring lays out, plus the process's RNG states and (rank 0) ``trainer.json``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from aqsgd.train.checkpoint.layout import (
    ALGORITHM,
    COMPLETE,
    FORMAT,
    MANIFEST,
    STEP_DIR,
    TRAINER,
    VERSION,
    agreed,
    one_line,
    per_replica_dir,
    process_of,
    raise_agreed,
    rank_manifest,
    relative,
    replica_of,
    scheme_dir,
)
from aqsgd.train.checkpoint.manifest import digests, file_digest

__all__ = ["save_checkpoint"]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json_durably(path: Path, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(obj, indent=1, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


class _WriteFailure(Exception):
    def __init__(self, where: str, exc: BaseException) -> None:
        super().__init__(f"{one_line(exc)} (writing {where})")


class _Writer:
    """Writes one process's files into ``tmp``, remembering each and every folder it creates."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.files: list[str] = []
        self.trees: list[str] = []  # folders whose every file is this process's (scheme folders)
        self.dirs: set[Path] = set()

    def mkdir(self, d: Path) -> None:
        d.mkdir(parents=True, exist_ok=True)
        while d != self.tmp and self.tmp in d.parents:
            self.dirs.add(d)
            d = d.parent

    @contextlib.contextmanager
    def writing(self, where: Path | str) -> Iterator[None]:
        try:
            yield
        except _WriteFailure:
            raise
        except Exception as exc:
            raise _WriteFailure(where if isinstance(where, str) else relative(where, self.tmp), exc) from exc

    def file(self, path: Path, write: Callable[[Path], Any]) -> None:
        self.mkdir(path.parent)
        with self.writing(path):
            write(path)
        self.files.append(relative(path, self.tmp))

    def tree(self, d: Path, write: Callable[[Path], Any]) -> None:
        self.mkdir(d)
        with self.writing(d):
            write(d)
        for sub in sorted(p for p in d.rglob("*")):
            if sub.is_dir():
                self.dirs.add(sub)
            else:
                self.files.append(relative(sub, self.tmp))
        self.trees.append(relative(d, self.tmp))


class _Writes:
    """A file for ``torch.save`` that writes everything it is given or records the OSError (a full disk) that
    stopped it: torch itself only reports a short write ("unexpected pos ...")."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        done = 0
        try:
            while done < len(view):
                done += self.f.write(view[done:])
        except OSError as exc:
            self.error = exc
            raise
        return done

    def flush(self) -> None:
        self.f.flush()


def _torch_save(obj: Any, path: Path) -> None:
    with open(path, "wb", buffering=0) as f:
        out = _Writes(f)
        try:
            torch.save(obj, out)
        except Exception as exc:
            if out.error is not None:
                raise out.error from exc
            raise


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(path))


def _rng_states() -> dict[str, torch.Tensor]:
    """The torch RNG states of this process: the CPU generator's, and, once CUDA is in use, the current GPU's
    (the device this process trains on; dropout on the GPU draws from it)."""
    states = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _jsonable(o: Any) -> Any:
    if isinstance(o, torch.Tensor):
        return o.tolist()
    return None  # lr_lambdas (functions) are rebuilt from the config


def _mirrored_files(scheme: Any, d: Path) -> list[str]:
    """The files (relative to the scheme folder ``d``) that the other side of the boundary saves
    identically."""
    declared = getattr(scheme, "mirrored_state", None)
    patterns = tuple(declared()) if callable(declared) else ()
    out = []
    for f in sorted(p for p in d.rglob("*") if p.is_file()):
        name = relative(f, d)
        if any(name == p or (p.endswith("/") and name.startswith(p)) for p in patterns):
            out.append(name)
    return out


def _write_own(writer: _Writer, engine: Any, position: dict[str, Any], rank: int) -> dict[str, Any]:
    """Write this process's files; returns what its manifest records besides them: the mirrored files of each
    scheme folder it wrote, the optimizer class of each optimizer state."""
    tmp = writer.tmp
    replica, data_parallel = replica_of(engine)
    mirrored: dict[str, list[str]] = {}
    optimizers: dict[str, str] = {}
    for i, state in engine.state_dict().items():
        d = tmp / f"stage{i}"
        own = per_replica_dir(d, replica, data_parallel, outer="outer" in state)
        writer.mkdir(own)
        # replicas that average every step hold identical weights and optimizer states: written once per
        # stage, by replica 0; those that take outer steps (diloco) differ inside a round: each writes its
        # own, and replica 0 the weights they last agreed on as the stage's
        w = own if "outer" in state else d
        if replica == 0 or "outer" in state:
            writer.file(w / "model.safetensors", lambda p, t=state["model"]: _save_tensors(t, p))
            writer.file(w / "optimizer.pt", lambda p, o=state["optimizer"]: _torch_save(o, p))
            optimizers[relative(w / "optimizer.pt", tmp)] = state["optimizer_class"]
            writer.file(w / "scheduler.json", lambda p, s=state["scheduler"]: p.write_text(
                json.dumps(s, default=_jsonable)))
        if replica == 0 and "outer" in state:  # the stage's model for export and evaluation: the agreed one
            writer.file(d / "model.safetensors", lambda p, t=state["agreed_model"]: _save_tensors(t, p))
        for key, entry in state["schemes"].items():
            sd = own / "schemes" / scheme_dir(key)

            def write_scheme(p: Path, entry: Any = entry) -> None:
                entry["scheme"].save(p)
                (p / "shape.json").write_text(json.dumps({"shape": entry["shape"], "dtype": entry["dtype"]}))

            writer.tree(sd, write_scheme)
            mirrored[relative(sd, tmp)] = _mirrored_files(entry["scheme"], sd)
        if "grad_sync" in state:
            writer.file(own / "grad_sync.safetensors", lambda p, t=state["grad_sync"]: _save_tensors(t, p))
        if "outer" in state:
            writer.file(own / "outer.safetensors", lambda p, t=state["outer"]: _save_tensors(t, p))
    py_state = random.getstate()
    writer.file(tmp / f"rank{rank}.rng.json", lambda p: p.write_text(
        json.dumps({"python": [py_state[0], list(py_state[1]), py_state[2]]})))
    writer.file(tmp / f"rank{rank}.rng.safetensors", lambda p: save_file(_rng_states(), str(p)))
    if rank == 0:
        writer.file(tmp / TRAINER, lambda p: p.write_text(json.dumps(position, indent=1)))
    return {"mirrored": mirrored, "optimizers": optimizers}


def _seal_own(writer: _Writer, step: int, rank: int, extra: dict[str, Any]) -> None:
    """Hash and fsync this process's files, write and fsync its manifest, fsync the folders it created."""
    tmp = writer.tmp
    with writer.writing("hashing and fsyncing the files"):
        sums = digests([tmp / f for f in writer.files], sync=True)
    files = {f: {"size": size, ALGORITHM: digest} for f, (size, digest) in zip(writer.files, sums)}
    manifest = {"format": f"{FORMAT}-files", "version": VERSION, "step": step, "rank": rank,
                "algorithm": ALGORITHM, "files": files, "trees": writer.trees, **extra}
    path = tmp / rank_manifest(rank)
    with writer.writing(path):
        _write_json_durably(path, manifest)
    for d in sorted(writer.dirs, key=lambda p: len(p.parts), reverse=True):
        with writer.writing(d):
            _fsync_dir(d)


def _publish(root: Path, tmp: Path, final: Path, step: int, world: int, engine: Any) -> None:
    """Rank 0, once every process has sealed its files: ``MANIFEST.json``, ``COMPLETE``, the rename."""
    manifests = {}
    for r in range(world):
        name = rank_manifest(r)
        size, digest = file_digest(tmp / name)
        manifests[name] = {"size": size, ALGORITHM: digest}
    _, data_parallel = replica_of(engine)
    manifest = {"format": FORMAT, "version": VERSION, "step": step, "algorithm": ALGORITHM,
                "stages": int(engine.num_stages), "data_parallel": data_parallel, "world": world,
                "manifests": manifests}
    writing = _Writer(tmp).writing
    with writing(MANIFEST):
        _write_json_durably(tmp / MANIFEST, manifest)
        size, digest = file_digest(tmp / MANIFEST)
    with writing(COMPLETE):
        _write_json_durably(tmp / COMPLETE, {"step": step, "manifest": {"size": size, ALGORITHM: digest}})
        _fsync_dir(tmp)
    with writing(f"renaming {tmp.name} to {final.name}"):
        if final.exists():  # the same step written again (a run resumed from an earlier checkpoint)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)


def _remove_stale(root: Path) -> None:
    """Remove left-overs of crashed saves: ``step-*.tmp`` folders and ``step-N`` folders without
    ``COMPLETE``."""
    for d in root.iterdir():
        if (d.name.startswith("step-") and d.is_dir()
                and (d.name.endswith(".tmp") or not (d / COMPLETE).exists())):
            shutil.rmtree(d, ignore_errors=True)


def _prune(root: Path, keep: int, written: Path) -> None:
    """Keep the ``keep`` newest complete checkpoints, and always ``written``, the one just written (a run
    resumed from an earlier checkpoint sets the later ones aside first, see
    :func:`~aqsgd.train.rundir.set_aside_later_checkpoints`; were any left, they would not push it out)."""
    done = sorted(d for d in root.iterdir() if STEP_DIR.fullmatch(d.name) and (d / COMPLETE).exists())
    for d in done[:-keep] if keep > 0 else []:
        if d != written:
            shutil.rmtree(d, ignore_errors=True)


def save_checkpoint(run_dir: Path, step: int, engine: Any, position: dict[str, Any], *,
                    keep: int = 2) -> Path:
    """Write checkpoint ``step`` of this run (every process of a distributed run calls it) and keep the
    ``keep`` newest; returns its folder. Raises :class:`CheckpointError` (on every process) if any process
    cannot write its part: the partial folder is then removed and the earlier checkpoints stay."""
    root = Path(run_dir) / "checkpoints"
    name = f"step-{step:08d}"
    final, tmp = root / name, root / f"{name}.tmp"
    distributed, rank, world = process_of(engine)

    def fail(error: str, at: int | None) -> None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise_agreed(f"writing checkpoint {final}: {error}; the partial {tmp.name} was removed, earlier "
                     "checkpoints are kept", at, own=at == rank)

    error = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            _remove_stale(root)
            tmp.mkdir()
        except Exception as exc:
            error = f"{one_line(exc)} (creating {tmp})"
    if (agreement := agreed(error, distributed))[0] is not None:
        fail(*agreement)
    writer = _Writer(tmp)
    try:
        _seal_own(writer, step, rank, _write_own(writer, engine, position, rank))
    except _WriteFailure as exc:
        error = str(exc)
    except Exception as exc:  # pragma: no cover - the writer names the file of every expected failure
        error = one_line(exc)
    if (agreement := agreed(error, distributed))[0] is not None:
        fail(*agreement)
    if rank == 0:
        try:
            _publish(root, tmp, final, step, world, engine)
        except _WriteFailure as exc:
            error = str(exc)
        except Exception as exc:  # pragma: no cover - reading back the rank manifests
            error = f"{one_line(exc)} (reading the processes' manifests)"
    if (agreement := agreed(error, distributed))[0] is not None:
        fail(*agreement)
    if rank == 0:
        _prune(root, keep, final)
    if distributed:
        dist.barrier()
    return final
