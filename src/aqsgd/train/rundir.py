"""Run directories: where a run writes, and the rules that keep two runs from mixing their outputs.

* A run directory is ``--output-dir / --run-name`` (a plain name, never a path that leads elsewhere). With
  ``--resume`` and no ``--run-name`` the run continues in the directory of the run it resumes.
* An existing run is never appended to or overwritten silently: a run directory that already holds files needs
  ``--resume`` (continue it) or ``--overwrite`` (delete it first). ``--overwrite`` deletes only a folder that
  aqsgd itself wrote as a run (its lock file, or a run's ``config.json``) and that holds nothing but what a
  run writes (:data:`RUN_ENTRIES`), never the working directory or a folder above it: a model folder, a
  folder of notes that happens to hold a ``config.json``, or a run with the user's own files added is
  refused, naming what would have been lost.
* While a run is in progress its directory is locked (``fcntl.flock`` on ``RUN_DIR/.lock``, released when the
  process ends, however it ends): a second run into the same directory stops at once, naming the holder.
* A run resumed in its own directory first cuts ``metrics.jsonl`` back to the checkpoint's step, so the steps
  between that checkpoint and the interruption, which are trained again, are not recorded twice, and moves any
  later checkpoint (resuming from an earlier one) into ``checkpoints/abandoned-after-step-N/``: what export,
  eval and ``--resume RUN`` see is the trajectory being trained, never the one it abandoned.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aqsgd.errors import AqsgdError

if TYPE_CHECKING:
    from aqsgd.train.config import TrainConfig

__all__ = ["RUN_ENTRIES", "RunDirError", "RunDirLock", "default_run_name", "resolve_run_dir", "check_run_dir",
           "prepare_run_dir", "set_aside_later_checkpoints", "truncate_metrics", "run_dir_of_checkpoint",
           "last_logged_step", "holds_working_dir"]

_LOCK = ".lock"
RUN_ENTRIES = ("config.json", "data.json", "model.json", "metrics.jsonl", "metrics.jsonl.tmp", "summary.json",
               "checkpoints", "tensorboard", "cache", "chat_template.jinja", _LOCK,
               "lighthouse.txt", "replicas.json", ".start")
"""What a run directory holds (with its ``trace*.json`` profiles, and the ``replica<r>`` runs of replicas that
come and go): all that ``--overwrite`` may delete."""
_TRACE = re.compile(r"trace(\.stage\d+(\.replica\d+)?)?\.json|replica\d+(\.pid)?")


class RunDirError(AqsgdError, ValueError):
    """A run directory that cannot be used: it exists (without --resume/--overwrite), is in use by another
    run, or is not a directory."""


def run_dir_of_checkpoint(checkpoint: Path) -> Path:
    """The run directory a checkpoint folder belongs to (``RUN/checkpoints/step-N`` -> ``RUN``)."""
    return checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint.parent


def default_run_name(cfg: TrainConfig, task: str | None = None) -> str:
    """``task-forward-backward`` with everything but letters, digits and ``_.-`` replaced by ``-`` (``task``:
    the data's name, default :attr:`TrainConfig.task_name`)."""
    text = f"{task or cfg.task_name}-{cfg.compression.forward}-{cfg.compression.backward}"
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-")


def resolve_run_dir(cfg: TrainConfig, task: str | None = None) -> Path:
    """Where ``cfg`` writes: ``output_dir / run_name``; when resuming without a ``run_name``, the resumed
    run's own directory; otherwise ``output_dir /`` :func:`default_run_name`."""
    source = _resumed_run_dir(cfg)
    if cfg.run.run_name is None and source is not None:
        return source
    return Path(cfg.run.output_dir) / (cfg.run.run_name or default_run_name(cfg, task))


def _resumed_run_dir(cfg: TrainConfig) -> Path | None:
    """The run directory that ``--resume`` names (a run directory, or one of its checkpoint folders)."""
    if not cfg.run.resume:
        return None
    resume = Path(cfg.run.resume)
    return run_dir_of_checkpoint(resume) if (resume / "COMPLETE").exists() else resume


def _resumes_here(cfg: TrainConfig, run_dir: Path) -> bool:
    source = _resumed_run_dir(cfg)
    return source is not None and source.resolve() == run_dir.resolve()


def _written_by_a_run(path: Path) -> bool:
    """Whether aqsgd wrote ``path`` as a run: it holds the lock file every run creates first, or (a run copied
    without its hidden files) a ``config.json`` of a run's settings, not a model's."""
    if (path / _LOCK).is_file():
        return True
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and {"pipeline", "compression", "optim"} <= set(config)


def _not_run_entries(path: Path) -> list[str]:
    """The entries of ``path`` that no run writes (what ``--overwrite`` would delete of the user's)."""
    return sorted(p.name for p in path.iterdir()
                  if p.name not in RUN_ENTRIES and not _TRACE.fullmatch(p.name))


def holds_working_dir(path: Path) -> bool:
    """Whether ``path`` is the working directory or a folder above it (never to be deleted or replaced)."""
    here, target = Path.cwd().resolve(), path.resolve()
    return here == target or target in here.parents


def check_run_dir(cfg: TrainConfig, run_dir: Path) -> None:
    """Read-only checks (safe before any process starts): the parent is a directory, and an existing run is
    only used with ``--resume`` (into itself) or ``--overwrite``."""
    out = Path(cfg.run.output_dir)
    if out.exists() and not out.is_dir():
        raise RunDirError(f"--output-dir {out} is not a directory")
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"run directory {run_dir} exists and is not a directory")
    here = _resumes_here(cfg, run_dir)
    if cfg.run.overwrite and here:
        raise RunDirError(f"--overwrite would delete {run_dir}, the run that --resume continues; drop one of "
                          "them")
    occupied = run_dir.is_dir() and any(p.name != _LOCK for p in run_dir.iterdir())
    if not occupied or here:
        return
    if not cfg.run.overwrite:
        raise RunDirError(f"run directory {run_dir} already exists: {_how_to_go_on(run_dir)}, replace it "
                          "with --overwrite, or choose another --run-name")
    if holds_working_dir(run_dir):
        raise RunDirError(f"--overwrite: {run_dir} is the working directory or holds it; refusing to delete "
                          "it")
    if not _written_by_a_run(run_dir):
        raise RunDirError(f"--overwrite: {run_dir} does not look like a run directory (no {_LOCK} and no run "
                          "config.json); refusing to delete it")
    foreign = _not_run_entries(run_dir)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise RunDirError(f"--overwrite: {run_dir} holds {shown}, which no run writes; refusing to delete it "
                          "(move those away first, or choose another --run-name)")


def _how_to_go_on(run_dir: Path) -> str:
    """The advice for an existing run directory: ``--resume`` only where there is a checkpoint to resume."""
    from aqsgd.train.checkpoint import CheckpointError, latest_checkpoint

    try:
        found = latest_checkpoint(run_dir)
    except CheckpointError:
        found = run_dir  # a damaged newest checkpoint: --resume names the older one to continue from
    if found is None:
        return "it has no complete checkpoint to continue from"
    return f"continue it with --resume {run_dir}"


class RunDirLock:
    """An exclusive lock on a run directory for the lifetime of this object (or of the process)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / _LOCK
        self._fd: int | None = None
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 256, 0).decode(errors="replace").strip() or "another process"
            self.release()
            raise RunDirError(f"run directory {run_dir} is in use by another run ({holder}); wait for it to "
                              f"finish or choose another --run-name") from None
        except OSError as e:
            self.release()
            raise RunDirError(f"run directory {run_dir}: cannot create its lock file {self.path} "
                              f"({e.strerror or e})") from None
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        except OSError as e:  # a full disk: the lock is held all the same, but the run could not write
            self.release()
            raise RunDirError(f"run directory {run_dir}: cannot write {self.path} "
                              f"({e.strerror or e})") from None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None

    def __del__(self) -> None:
        self.release()


def prepare_run_dir(cfg: TrainConfig, run_dir: Path) -> RunDirLock:
    """Check, clear (``--overwrite``), create and lock a run directory; the caller keeps the lock while it
    runs. In a distributed run exactly one process calls this, before any process writes into the
    directory."""
    check_run_dir(cfg, run_dir)
    try:
        if cfg.run.overwrite and run_dir.is_dir() and not _resumes_here(cfg, run_dir):
            lock = RunDirLock(run_dir)  # never delete a directory that a live run holds
            for p in run_dir.iterdir():
                if p.name != _LOCK:
                    shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
            return lock
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(f"run directory {run_dir}: {e.strerror or e}") from None
    return RunDirLock(run_dir)


def set_aside_later_checkpoints(run_dir: Path, step: int) -> tuple[Path | None, list[str]]:
    """A run resumed in its own directory from checkpoint ``step`` abandons the trajectory after it: move the
    later complete checkpoints into ``checkpoints/abandoned-after-step-N/`` (``-2``, ``-3``... if
    that exists), where neither ``--resume RUN``, ``aqsgd export`` nor ``aqsgd eval`` looks and no pruning
    deletes them. Returns the folder and the names moved (``(None, [])`` if there were none)."""
    from aqsgd.train.checkpoint.layout import STEP_DIR

    root = run_dir / "checkpoints"
    if not root.is_dir():
        return None, []
    later = sorted(d for d in root.iterdir() if STEP_DIR.fullmatch(d.name) and (d / "COMPLETE").is_file()
                   and int(d.name[5:]) > step)  # (left-overs of crashed saves: the next save removes them)
    if not later:
        return None, []
    aside = root / f"abandoned-after-step-{step:08d}"
    n = 1
    while aside.exists():
        n += 1
        aside = root / f"abandoned-after-step-{step:08d}-{n}"
    try:
        aside.mkdir()
        for d in later:
            os.replace(d, aside / d.name)
    except OSError as e:
        raise RunDirError(f"--resume: cannot move the abandoned checkpoints after step {step} aside into "
                          f"{aside} ({e.strerror or e}); move or delete them by hand") from None
    return aside, [d.name for d in later]


def truncate_metrics(run_dir: Path, step: int) -> int:
    """Keep the rows of ``metrics.jsonl`` up to optimizer step ``step`` (the checkpoint a run resumes from);
    returns how many rows were dropped. A torn last line (a run killed mid-write) is dropped too."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    kept: list[str] = []
    dropped = 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row: Any = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] > step:
            dropped += 1
            continue
        kept.append(line)
    if dropped:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(k + "\n" for k in kept), encoding="utf-8")
        os.replace(tmp, path)
    return dropped


def last_logged_step(run_dir: Path) -> int | None:
    """The last optimizer step ``metrics.jsonl`` records (None without one): where an interrupted run stood,
    for the process that did not train it (the launcher of a distributed run)."""
    path = Path(run_dir) / "metrics.jsonl"
    step = None
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            row: Any = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and row.get("kind") == "train" and isinstance(row.get("step"), int):
            step = row["step"]
    return step

