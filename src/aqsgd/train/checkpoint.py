"""Checkpoints: everything needed to continue a run exactly, written atomically and durably, verified before
anything is read, read without unpickling.

Layout of ``RUN_DIR/checkpoints/step-NNNNNNNN/``::

    trainer.json                 position (epoch, batch, step), totals, the config
    rank{r}.rng.json / .safetensors   RNG states of each process (python, torch)
    stage{i}/model.safetensors   the stage's parameters and buffers
    stage{i}/optimizer.pt        optimizer state (torch.save; loaded with weights_only=True)
    stage{i}/scheduler.json      LR scheduler state
    stage{i}/schemes/<key>/      each boundary scheme's state on this stage's sides (AQ-SGD caches, EF buffers)
    rank{r}.manifest.json        the files rank r wrote: size and SHA-256 of each
    MANIFEST.json                the run's shape (stages, replicas, processes) and the size and SHA-256 of every
                                 rank{r}.manifest.json
    COMPLETE                     the step and the SHA-256 of MANIFEST.json; a folder without it is ignored

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

Writing
-------
A checkpoint is written into ``step-N.tmp``. Every process writes its own files there, reads each back once to
hash it (SHA-256, streamed in 8 MiB chunks, several files at a time) and fsyncs it, then writes and fsyncs its
``rank{r}.manifest.json`` and fsyncs the folders it created. After all processes agree that they succeeded,
rank 0 writes ``MANIFEST.json`` and ``COMPLETE``, fsyncs them and the folder, renames ``step-N.tmp`` to
``step-N`` and fsyncs ``checkpoints/``: a crash at any moment leaves the earlier checkpoints and either no
``step-N`` or a complete one. (In a distributed run the run directory must be shared by the stage
processes, as it is on one machine or a shared filesystem.) Any failure (a full disk, say) on any process is
one :class:`CheckpointError` on every process naming the step, the file and the cause; the partial
``step-N.tmp`` is removed and the earlier checkpoints are kept. Left-over ``step-*.tmp`` folders of a crashed
run are never loaded and are removed by the next save.

Reading
-------
:func:`latest_checkpoint` checks the chain ``COMPLETE`` -> ``MANIFEST.json`` -> ``rank{r}.manifest.json`` and
``trainer.json``; :func:`load_checkpoint` then checks every file this process is about to read against its
manifest (present, same size, same SHA-256; no unlisted file in a scheme's folder) and, from the manifests,
that the two sides of every boundary whose state must be bit-identical (AQ-SGD caches, EF21 estimates; see
:meth:`~aqsgd.schemes.base.BoundaryScheme.mirrored_state`) saved identical bytes. Only then is anything
loaded. Every problem, damage or a checkpoint that does not fit this run, is a :class:`CheckpointError` with
a one-line message naming the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, load_model, save_file, save_model

from aqsgd.errors import AqsgdError

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "read_trainer_state", "file_digest",
           "CheckpointError"]


class CheckpointError(AqsgdError, ValueError):
    """A checkpoint that is missing, incomplete, damaged or does not fit this run, or one that cannot be written."""


_FORMAT = "aqsgd-checkpoint"
_VERSION = 1
_ALGORITHM = "sha256"
_CHUNK = 8 << 20
_MANIFEST = "MANIFEST.json"
_COMPLETE = "COMPLETE"
_TRAINER = "trainer.json"
_STEP_DIR = re.compile(r"step-\d{8,}")


def _rank_manifest(rank: int) -> str:
    return f"rank{rank}.manifest.json"


def _scheme_key(key: tuple[int, int, str]) -> str:
    b, channel, side = key
    return f"b{b}-{'forward' if channel == 0 else 'backward'}-{side}"


_SCHEME_DIR = re.compile(r"b(\d+)-(forward|backward)-(sender|receiver)")


def _parse_scheme_key(name: str) -> tuple[int, int, str] | None:
    m = _SCHEME_DIR.fullmatch(name)
    return (int(m[1]), 0 if m[2] == "forward" else 1, m[3]) if m else None


def _replica(engine: Any) -> tuple[int, int]:
    """``(replica, data_parallel)`` of this process's engine (``(0, 1)`` without a process grid)."""
    grid = getattr(engine, "grid", None)
    return (grid.replica, grid.data_parallel) if grid is not None else (0, 1)


def _per_replica_dir(stage_dir: Path, replica: int, data_parallel: int) -> Path:
    """Where this replica's own state of a stage lives (the stage folder itself without data parallelism)."""
    return stage_dir if data_parallel == 1 else stage_dir / f"replica{replica}"


def _process(engine: Any) -> tuple[bool, int, int]:
    """``(distributed, rank, world size)`` of this process for checkpointing."""
    distributed = dist.is_initialized() and bool(getattr(engine, "distributed", False))
    return (True, dist.get_rank(), dist.get_world_size()) if distributed else (False, 0, 1)


# -- messages ----------------------------------------------------------------------------------------------
_RUST_IO = re.compile(r'message: "([^"]+)"')


def _one_line(exc: BaseException) -> str:
    """A one-line description of ``exc`` (library errors may span lines; safetensors wraps OS errors)."""
    if isinstance(exc, OSError) and exc.strerror:
        text = exc.strerror
    elif isinstance(exc, KeyError):
        text = f"no entry {exc.args[0]!r}" if exc.args else "missing entry"
    else:
        text = str(exc)
        m = _RUST_IO.search(text)
        if m:  # SafetensorError: 'Error while serializing: IoError(Os { code: 28, ..., message: "No space ..." })'
            text = m[1]
    text = " ".join(text.split())
    if not text:
        text = type(exc).__name__
    return text if len(text) <= 400 else text[:397] + "..."


def _rel(path: Path, base: Path) -> str:
    try:
        return path.relative_to(base).as_posix()
    except ValueError:
        return str(path)


# -- hashing and durability --------------------------------------------------------------------------------
def file_digest(path: str | os.PathLike[str], *, sync: bool = False) -> tuple[int, str]:
    """``(size, SHA-256 hex digest)`` of a file, read in 8 MiB chunks (bounded memory whatever its size);
    with ``sync`` the file is also fsynced."""
    h = hashlib.new(_ALGORITHM)
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    size = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
        if sync:
            os.fsync(f.fileno())
    return size, h.hexdigest()


def _digests(paths: list[Path], *, sync: bool = False) -> list[tuple[int, str]]:
    """:func:`file_digest` of several files, a few at a time (hashlib and reads release the GIL)."""
    workers = min(4, os.cpu_count() or 1, len(paths))
    if workers <= 1:
        return [file_digest(p, sync=sync) for p in paths]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="aqsgd-ckpt-hash") as pool:
        return list(pool.map(lambda p: file_digest(p, sync=sync), paths))


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


def _agree(error: str | None, distributed: bool) -> str | None:
    """In a distributed run, the first error of any process (every process gets the same answer)."""
    if not distributed:
        return error
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e is not None), None)


# -- writing -----------------------------------------------------------------------------------------------
class _WriteFailure(Exception):
    def __init__(self, where: str, exc: BaseException) -> None:
        super().__init__(f"{_one_line(exc)} (writing {where})")


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
            raise _WriteFailure(where if isinstance(where, str) else _rel(where, self.tmp), exc) from exc

    def file(self, path: Path, write: Callable[[Path], Any]) -> None:
        self.mkdir(path.parent)
        with self.writing(path):
            write(path)
        self.files.append(_rel(path, self.tmp))

    def tree(self, d: Path, write: Callable[[Path], Any]) -> None:
        self.mkdir(d)
        with self.writing(d):
            write(d)
        for sub in sorted(p for p in d.rglob("*")):
            if sub.is_dir():
                self.dirs.add(sub)
            else:
                self.files.append(_rel(sub, self.tmp))
        self.trees.append(_rel(d, self.tmp))


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


def _mirrored_files(scheme: Any, d: Path, tmp: Path) -> list[str]:
    """The files (relative to the scheme folder ``d``) that the other side of the boundary saves identically."""
    declared = getattr(scheme, "mirrored_state", None)
    patterns = tuple(declared()) if callable(declared) else ()
    out = []
    for f in sorted(p for p in d.rglob("*") if p.is_file()):
        rel = _rel(f, d)
        if any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in patterns):
            out.append(rel)
    return out


def _write_own(writer: _Writer, step: int, engine: Any, position: dict[str, Any], rank: int) -> dict[str, Any]:
    """Write this process's files; returns what its manifest records besides them: the mirrored files of each
    scheme folder it wrote, the optimizer class of each optimizer state."""
    tmp = writer.tmp
    replica, data_parallel = _replica(engine)
    mirrored: dict[str, list[str]] = {}
    optimizers: dict[str, str] = {}
    for i, module in engine.stages.items():
        d = tmp / f"stage{i}"
        own = _per_replica_dir(d, replica, data_parallel)
        writer.mkdir(own)
        if replica == 0:  # replicas hold identical weights and optimizer states: written once per stage
            writer.file(d / "model.safetensors", lambda p, m=module: save_model(m, str(p)))
            writer.file(d / "optimizer.pt", lambda p, o=engine.optimizers[i]: _torch_save(o.state_dict(), p))
            optimizers[f"stage{i}/optimizer.pt"] = type(engine.optimizers[i]).__name__
            writer.file(d / "scheduler.json", lambda p, s=engine.schedulers[i]: p.write_text(
                json.dumps(s.state_dict(), default=_jsonable)))
        runner = engine.runners[i]
        for key, scheme in runner.schemes.items():
            sd = own / "schemes" / _scheme_key(key)

            def write_scheme(p: Path, scheme: Any = scheme, key: Any = key) -> None:
                scheme.save(p)
                (p / "shape.json").write_text(json.dumps(runner.scheme_shapes[key]))

            writer.tree(sd, write_scheme)
            mirrored[_rel(sd, tmp)] = _mirrored_files(scheme, sd, tmp)
        if engine.grad_sync is not None:
            state = {k: v.detach().contiguous() for k, v in engine.grad_sync.state_dict().items()}
            writer.file(own / "grad_sync.safetensors", lambda p: save_file(state, str(p)))
    py_state = random.getstate()
    writer.file(tmp / f"rank{rank}.rng.json", lambda p: p.write_text(
        json.dumps({"python": [py_state[0], list(py_state[1]), py_state[2]]})))
    writer.file(tmp / f"rank{rank}.rng.safetensors", lambda p: save_file({"torch": torch.get_rng_state()}, str(p)))
    if rank == 0:
        writer.file(tmp / _TRAINER, lambda p: p.write_text(json.dumps(position, indent=1)))
    return {"mirrored": mirrored, "optimizers": optimizers}


def _seal_own(writer: _Writer, step: int, rank: int, extra: dict[str, Any]) -> None:
    """Hash and fsync this process's files, write and fsync its manifest, fsync the folders it created."""
    tmp = writer.tmp
    with writer.writing("hashing and fsyncing the files"):
        sums = _digests([tmp / f for f in writer.files], sync=True)
    files = {f: {"size": size, _ALGORITHM: digest} for f, (size, digest) in zip(writer.files, sums)}
    manifest = {"format": f"{_FORMAT}-files", "version": _VERSION, "step": step, "rank": rank,
                "algorithm": _ALGORITHM, "files": files, "trees": writer.trees, **extra}
    path = tmp / _rank_manifest(rank)
    with writer.writing(path):
        _write_json_durably(path, manifest)
    for d in sorted(writer.dirs, key=lambda p: len(p.parts), reverse=True):
        with writer.writing(d):
            _fsync_dir(d)


def _publish(root: Path, tmp: Path, final: Path, step: int, world: int, engine: Any) -> None:
    """Rank 0, once every process has sealed its files: ``MANIFEST.json``, ``COMPLETE``, the rename."""
    manifests = {}
    for r in range(world):
        name = _rank_manifest(r)
        size, digest = file_digest(tmp / name)
        manifests[name] = {"size": size, _ALGORITHM: digest}
    _, data_parallel = _replica(engine)
    manifest = {"format": _FORMAT, "version": _VERSION, "step": step, "algorithm": _ALGORITHM,
                "stages": int(engine.num_stages), "data_parallel": data_parallel, "world": world,
                "manifests": manifests}
    writing = _Writer(tmp).writing
    with writing(_MANIFEST):
        _write_json_durably(tmp / _MANIFEST, manifest)
        size, digest = file_digest(tmp / _MANIFEST)
    with writing(_COMPLETE):
        _write_json_durably(tmp / _COMPLETE, {"step": step, "manifest": {"size": size, _ALGORITHM: digest}})
        _fsync_dir(tmp)
    with writing(f"renaming {tmp.name} to {final.name}"):
        if final.exists():  # the same step written again (a run resumed from an earlier checkpoint)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)


def _remove_stale(root: Path) -> None:
    """Remove left-overs of crashed saves: ``step-*.tmp`` folders and ``step-N`` folders without ``COMPLETE``."""
    for d in root.iterdir():
        if d.name.startswith("step-") and d.is_dir() and (d.name.endswith(".tmp") or not (d / _COMPLETE).exists()):
            shutil.rmtree(d, ignore_errors=True)


def _prune(root: Path, keep: int) -> None:
    done = sorted(d for d in root.iterdir() if _STEP_DIR.fullmatch(d.name) and (d / _COMPLETE).exists())
    for d in done[:-keep] if keep > 0 else []:
        shutil.rmtree(d, ignore_errors=True)


def save_checkpoint(run_dir: Path, step: int, engine: Any, position: dict[str, Any], *, keep: int = 2) -> Path:
    """Write checkpoint ``step`` of this run (every process of a distributed run calls it) and keep the
    ``keep`` newest; returns its folder. Raises :class:`CheckpointError` (on every process) if any process
    cannot write its part: the partial folder is then removed and the earlier checkpoints stay."""
    root = Path(run_dir) / "checkpoints"
    name = f"step-{step:08d}"
    final, tmp = root / name, root / f"{name}.tmp"
    distributed, rank, world = _process(engine)

    def fail(error: str) -> CheckpointError:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        return CheckpointError(f"writing checkpoint {final}: {error}; the partial {tmp.name} was removed, earlier "
                               f"checkpoints are kept")

    error = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            _remove_stale(root)
            tmp.mkdir()
        except Exception as exc:
            error = f"{_one_line(exc)} (creating {tmp})"
    if (error := _agree(error, distributed)) is not None:
        raise fail(error)
    writer = _Writer(tmp)
    try:
        _seal_own(writer, step, rank, _write_own(writer, step, engine, position, rank))
    except _WriteFailure as exc:
        error = str(exc)
    except Exception as exc:  # pragma: no cover - the writer names the file of every expected failure
        error = _one_line(exc)
    if (error := _agree(error, distributed)) is not None:
        raise fail(error)
    if rank == 0:
        try:
            _publish(root, tmp, final, step, world, engine)
        except _WriteFailure as exc:
            error = str(exc)
        except Exception as exc:  # pragma: no cover - reading back the rank manifests
            error = f"{_one_line(exc)} (reading the processes' manifests)"
    if (error := _agree(error, distributed)) is not None:
        raise fail(error)
    if rank == 0:
        _prune(root, keep)
    if distributed:
        dist.barrier()
    return final


def _jsonable(o: Any) -> Any:
    if isinstance(o, torch.Tensor):
        return o.tolist()
    return None  # lr_lambdas (functions) are rebuilt from the config


# -- reading -----------------------------------------------------------------------------------------------
def _read_json(file: Path, what: str = "") -> Any:
    try:
        return json.loads(file.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing{what}") from None
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{file}: not UTF-8 text ({_one_line(exc)}){what}") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{file}: not valid JSON ({_one_line(exc)}){what}") from None
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot read it ({_one_line(exc)})") from None


def _entry(obj: Any, file: Path, where: str) -> tuple[int, str]:
    """A ``{"size": int, "sha256": hex}`` entry of a manifest, checked."""
    if (not isinstance(obj, dict) or not isinstance(obj.get("size"), int) or not isinstance(obj.get(_ALGORITHM), str)
            or not re.fullmatch(r"[0-9a-f]{64}", obj[_ALGORITHM])):
        raise CheckpointError(f"{file}: malformed entry for {where} (damaged manifest)")
    return obj["size"], obj[_ALGORITHM]


def _check_size(file: Path, size: int, listed_in: str) -> None:
    if not file.is_file():
        raise CheckpointError(f"{file}: missing (listed in {listed_in})")
    got_size = file.stat().st_size
    if got_size != size:
        raise CheckpointError(f"{file}: {got_size} bytes, {listed_in} says {size}: the file was truncated, extended "
                              f"or replaced after the checkpoint was written")


def _check(file: Path, expected: tuple[int, str], listed_in: str, actual: tuple[int, str] | None = None) -> None:
    """``file`` exists with the size and checksum of its manifest entry (``actual``: its digest if known)."""
    size, digest = expected
    _check_size(file, size, listed_in)
    got = actual if actual is not None else file_digest(file)
    if got[1] != digest:
        raise CheckpointError(f"{file}: {_ALGORITHM} checksum mismatch ({got[1][:16]}..., {listed_in} says "
                              f"{digest[:16]}...): the file was changed or damaged after the checkpoint was written")


class _Manifest:
    """The verified manifests of a checkpoint: ``COMPLETE`` -> ``MANIFEST.json`` -> ``rank{r}.manifest.json``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        complete = path / _COMPLETE
        marker = _read_json(complete, " (is this a checkpoint written before checkpoints carried checksums?)")
        if not isinstance(marker, dict) or not isinstance(marker.get("step"), int) or "manifest" not in marker:
            raise CheckpointError(f"{complete}: no step and {_MANIFEST} checksum (a checkpoint written before "
                                  f"checkpoints carried checksums, or a damaged marker)")
        self.step = marker["step"]
        m = _STEP_DIR.fullmatch(path.name)
        if m and int(path.name[5:]) != self.step:
            raise CheckpointError(f"{complete}: says step {self.step}, the folder is {path.name}")
        top = path / _MANIFEST
        _check(top, _entry(marker["manifest"], complete, _MANIFEST), _COMPLETE)
        root = _read_json(top)
        if not isinstance(root, dict) or root.get("format") != _FORMAT:
            raise CheckpointError(f"{top}: not an aqsgd checkpoint manifest")
        if root.get("version") != _VERSION or root.get("algorithm") != _ALGORITHM:
            raise CheckpointError(f"{top}: format version {root.get('version')} ({root.get('algorithm')}), this "
                                  f"aqsgd reads version {_VERSION} ({_ALGORITHM})")
        if root.get("step") != self.step:
            raise CheckpointError(f"{top}: says step {root.get('step')}, {_COMPLETE} says {self.step}")
        for key in ("stages", "data_parallel", "world"):
            if not isinstance(root.get(key), int) or root[key] < 1:
                raise CheckpointError(f"{top}: no valid {key!r} (damaged manifest)")
        self.stages, self.data_parallel, self.world = root["stages"], root["data_parallel"], root["world"]
        manifests = root.get("manifests")
        if not isinstance(manifests, dict) or sorted(manifests) != sorted(_rank_manifest(r) for r in range(self.world)):
            raise CheckpointError(f"{top}: does not list one file manifest per process (damaged manifest)")
        self.files: dict[str, tuple[int, str]] = {}
        self.owner: dict[str, str] = {}
        self.trees: dict[str, str] = {}
        self.mirrored: dict[str, list[str]] = {}
        self.optimizers: dict[str, str] = {}
        for name in sorted(manifests, key=lambda n: int(n[4:].split(".")[0])):
            file = path / name
            _check(file, _entry(manifests[name], top, name), _MANIFEST)
            own = _read_json(file)
            if (not isinstance(own, dict) or own.get("format") != f"{_FORMAT}-files" or own.get("step") != self.step
                    or not isinstance(own.get("files"), dict)
                    or not isinstance(own.get("trees"), list) or not isinstance(own.get("mirrored"), dict)):
                raise CheckpointError(f"{file}: not a file manifest of step {self.step} (damaged manifest)")
            for rel, entry in own["files"].items():
                if rel in self.files or not isinstance(rel, str) or rel.startswith("/") or ".." in rel.split("/"):
                    raise CheckpointError(f"{file}: bad or duplicate entry {rel!r} (damaged manifest)")
                self.files[rel] = _entry(entry, file, rel)
                self.owner[rel] = name
            for tree in own["trees"]:
                self.trees[str(tree)] = name
            for d, rels in own["mirrored"].items():
                if not isinstance(rels, list) or not all(isinstance(r, str) and f"{d}/{r}" in own["files"] for r in rels):
                    raise CheckpointError(f"{file}: bad mirrored entry for {d!r} (damaged manifest)")
                self.mirrored[d] = rels
            kinds = own.get("optimizers", {})
            if not isinstance(kinds, dict) or not all(isinstance(v, str) for v in kinds.values()):
                raise CheckpointError(f"{file}: bad optimizers entry (damaged manifest)")
            self.optimizers.update(kinds)

    def has(self, rel: str) -> bool:
        return rel in self.files

    def tree_files(self, tree: str) -> list[str]:
        return sorted(f for f in self.files if f.startswith(tree + "/"))

    def verify(self, rels: list[str]) -> None:
        """Check that each file is listed, present, of its size and checksum (hashing a few at a time)."""
        for rel in rels:
            file = self.path / rel
            if rel not in self.files:
                raise CheckpointError(f"{file}: not listed in the checkpoint's manifests (missing from "
                                      f"{_MANIFEST}'s rank manifests; written by another version, or damaged)")
            _check_size(file, self.files[rel][0], self.owner[rel])  # cheap checks of every file first
        sums = _digests([self.path / r for r in rels])
        for rel, got in zip(rels, sums):
            _check(self.path / rel, self.files[rel], self.owner[rel], actual=got)

    def verify_tree(self, tree: str) -> list[str]:
        """Every file listed under ``tree`` verified, and no unlisted file there; returns the listed ones."""
        listed = self.tree_files(tree)
        d = self.path / tree
        if d.is_dir():
            for f in sorted(d.rglob("*")):
                if f.is_file() and _rel(f, self.path) not in self.files:
                    raise CheckpointError(f"{f}: not listed in the checkpoint's manifests (a file added after "
                                          f"the checkpoint was written)")
        self.verify(listed)
        return listed

    def check_mirrors(self) -> None:
        """The two sides of each boundary with bit-identical state saved identical bytes (by their digests)."""
        pairs: dict[tuple[str, int, str], dict[str, str]] = {}
        for d in self.mirrored:
            parts = d.split("/")
            key = _parse_scheme_key(parts[-1])
            if key is None or len(parts) < 3 or parts[-2] != "schemes":
                continue
            replica = parts[1] if len(parts) == 4 else ""
            pairs.setdefault((replica, key[0], "forward" if key[1] == 0 else "backward"), {})[key[2]] = d
        for (replica, b, direction), sides in sorted(pairs.items()):
            if len(sides) != 2:
                continue
            s, r = sides["sender"], sides["receiver"]
            ms, mr = self.mirrored[s], self.mirrored[r]
            if not ms and not mr:
                continue
            where = f"boundary {b} {direction}" + (f" ({replica})" if replica else "")
            if ms != mr:
                raise CheckpointError(f"{self.path}: {where}: the sender saved {ms} in {s}, the receiver {mr} in {r}; "
                                      f"the two sides' state must be identical")
            for f in ms:
                if self.files[f"{s}/{f}"][1] != self.files[f"{r}/{f}"][1]:
                    raise CheckpointError(
                        f"{self.path}: {where}: the sender's {s}/{f} and the receiver's {r}/{f} differ; the two "
                        f"sides of the boundary must hold bit-identical state, so this checkpoint would not "
                        f"continue training correctly")


def _head(path: Path) -> tuple[_Manifest, dict[str, Any]]:
    """The verified manifests and ``trainer.json`` of a checkpoint."""
    manifest = _Manifest(path)
    manifest.verify([_TRAINER])
    state = _read_json(path / _TRAINER)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path / _TRAINER}: not a JSON object")
    for key in ("epoch", "batch", "step"):
        if not isinstance(state.get(key), int) or isinstance(state.get(key), bool) or state[key] < 0:
            raise CheckpointError(f"{path / _TRAINER}: no valid {key!r}")
    if state["step"] != manifest.step:
        raise CheckpointError(f"{path / _TRAINER}: says step {state['step']}, the checkpoint is step {manifest.step}")
    if not isinstance(state.get("totals", {}), dict) or not isinstance(state.get("config", {}), dict):
        raise CheckpointError(f"{path / _TRAINER}: 'totals' and 'config' must be JSON objects")
    state.setdefault("totals", {})
    return manifest, state


def latest_checkpoint(path: str | Path) -> Path | None:
    """The newest complete checkpoint under a run directory (or ``path`` itself if it is one); ``None`` if
    there is none. Unfinished ``step-N.tmp`` folders are never taken. Raises :class:`CheckpointError` if that
    checkpoint's manifests or ``trainer.json`` are damaged (an older one can be resumed by naming its folder)."""
    p = Path(path)
    if p.name.endswith(".tmp"):
        return None
    if (p / _COMPLETE).exists():
        found: Path | None = p
    else:
        root = p / "checkpoints"
        if not root.is_dir():
            return None
        done = sorted(d for d in root.iterdir() if _STEP_DIR.fullmatch(d.name) and (d / _COMPLETE).is_file())
        found = done[-1] if done else None
    if found is not None:
        _head(found)
    return found


def read_trainer_state(path: str | Path) -> dict[str, Any]:
    """The verified ``trainer.json`` of a checkpoint (position, totals, config); :class:`CheckpointError` if the
    checkpoint is incomplete or damaged."""
    return _head(Path(path))[1]


@contextlib.contextmanager
def _reading(file: Path, what: str) -> Iterator[None]:
    """Turn any failure to read or apply ``file`` into a one-line :class:`CheckpointError`."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{file}: {what}: {_one_line(exc)}") from None


def _plan(manifest: _Manifest, engine: Any, rank: int) -> tuple[list[str], list[str]]:
    """The files and scheme folders this process will read; checks the checkpoint's shape against the run."""
    path = manifest.path
    replica, data_parallel = _replica(engine)
    num_stages = int(getattr(engine, "num_stages", len(engine.stages)))
    if manifest.stages != num_stages or manifest.data_parallel != data_parallel:
        raise CheckpointError(f"{path / _MANIFEST}: written by a run of {manifest.stages} stages x "
                              f"{manifest.data_parallel} replicas, this run has {num_stages} x {data_parallel}")
    files = [_TRAINER, f"rank{rank}.rng.json", f"rank{rank}.rng.safetensors"]
    trees = []
    for i in engine.stages:
        d = f"stage{i}"
        if not any(f.startswith(d + "/") for f in manifest.files):
            raise CheckpointError(f"{path} has no stage{i}: was it written with another number of stages?")
        files += [f"{d}/model.safetensors", f"{d}/optimizer.pt", f"{d}/scheduler.json"]
        own = d if data_parallel == 1 else f"{d}/replica{replica}"
        prefix = f"{own}/schemes/"
        trees += sorted({prefix + f[len(prefix):].split("/")[0] for f in manifest.files if f.startswith(prefix)})
        if engine.grad_sync is not None:
            if not manifest.has(f"{own}/grad_sync.safetensors"):
                raise CheckpointError(f"{path / own} has no grad_sync.safetensors: was it written without data "
                                      f"parallelism?")
            files.append(f"{own}/grad_sync.safetensors")
    for t in trees:
        if t not in manifest.trees:
            raise CheckpointError(f"{path / t}: not a scheme folder of the checkpoint's manifests (damaged manifest)")
    for f in files:
        if not manifest.has(f):
            raise CheckpointError(f"{path / f}: missing from the checkpoint's manifests (damaged, or written by "
                                  f"another version)")
    return files, trees


def load_checkpoint(path: Path, engine: Any) -> dict[str, Any]:
    """Restore the stages this process owns, their optimizers, schedulers and schemes, and the RNG states;
    returns the trainer position. Everything this process reads is verified first (see the module docstring);
    every problem is a one-line :class:`CheckpointError` naming the file."""
    path = Path(path)
    distributed, rank, _ = _process(engine)
    error = None
    try:
        if path.name.endswith(".tmp"):
            raise CheckpointError(f"{path} is an unfinished checkpoint (a .tmp folder); it is never loaded")
        if not (path / _COMPLETE).exists():
            raise CheckpointError(f"{path} is not a complete checkpoint (no {_COMPLETE} marker)")
        manifest, state = _head(path)
        files, trees = _plan(manifest, engine, rank)
        manifest.check_mirrors()
        manifest.verify([f for f in files if f != _TRAINER])
        for t in trees:
            manifest.verify_tree(t)
    except CheckpointError as exc:
        error = str(exc)
    if (error := _agree(error, distributed)) is not None:
        raise CheckpointError(error)
    _restore(path, engine, rank, trees, manifest.optimizers)
    return state


def _restore(path: Path, engine: Any, rank: int, trees: list[str], optimizers: dict[str, str]) -> None:
    replica, data_parallel = _replica(engine)
    for i, module in engine.stages.items():
        d = path / f"stage{i}"
        own = _per_replica_dir(d, replica, data_parallel)
        file = d / "model.safetensors"
        with _reading(file, f"cannot load the weights of stage {i}"):
            missing, unexpected = load_model(module, str(file), strict=False)
        if missing or unexpected:
            raise CheckpointError(f"{file}: weights do not fit stage {i} (missing {sorted(missing)[:5]}, "
                                  f"unexpected {sorted(unexpected)[:5]})")
        file = d / "optimizer.pt"
        optimizer = engine.optimizers[i]
        kind = optimizers.get(_rel(file, path))
        if kind is not None and kind != type(optimizer).__name__:
            raise CheckpointError(f"{file}: holds the state of the {kind} optimizer, this run's stage {i} uses "
                                  f"{type(optimizer).__name__}")
        with _reading(file, f"does not fit the optimizer of stage {i}"):
            optimizer.load_state_dict(torch.load(file, weights_only=True))
        file = d / "scheduler.json"
        sched = _read_json(file)
        with _reading(file, f"does not fit the LR scheduler of stage {i}"):
            if not isinstance(sched, dict):
                raise ValueError("not a JSON object")
            sched.pop("lr_lambdas", None)
            engine.schedulers[i].load_state_dict({**engine.schedulers[i].state_dict(), **sched})
        runner = engine.runners[i]
        prefix = _rel(own / "schemes", path) + "/"
        for tree in (t for t in trees if t.startswith(prefix)):
            sd = path / tree
            key = _parse_scheme_key(sd.name)
            if key is None:
                raise CheckpointError(f"{sd}: not a boundary scheme folder (b<N>-forward|backward-sender|receiver)")
            shape = _read_json(sd / "shape.json")
            with _reading(sd / "shape.json", f"does not describe the {sd.name} scheme of stage {i}"):
                scheme = runner.scheme(key[1], key[2], tuple(int(n) for n in shape["shape"]),
                                       getattr(torch, str(shape["dtype"])))
            with _reading(sd, f"cannot restore the {sd.name} scheme of stage {i}"):
                scheme.load(sd)
        if engine.grad_sync is not None:
            file = own / "grad_sync.safetensors"
            with _reading(file, "cannot restore the gradient synchronization state"):
                engine.grad_sync.load_state_dict(load_file(str(file)))
    file = path / f"rank{rank}.rng.json"
    rng = _read_json(file)
    with _reading(file, "not a Python RNG state"):
        state = rng["python"]
        random.setstate((state[0], tuple(state[1]), state[2]))
    file = path / f"rank{rank}.rng.safetensors"
    with _reading(file, "not a torch RNG state"):
        torch.set_rng_state(load_file(str(file))["torch"])
