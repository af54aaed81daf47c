"""Manifests: the size and SHA-256 of every file of a checkpoint, verified before anything is read.

``COMPLETE`` holds the step and the checksum of ``MANIFEST.json``; ``MANIFEST.json`` the run's shape and the
checksum of every ``rank{r}.manifest.json``; each of those the files one process wrote (size and checksum),
its scheme folders, which files of each scheme folder the other side of the boundary saves identically, and
the class of each optimizer state. :class:`Manifest` reads and checks that chain; :func:`head` adds
``trainer.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aqsgd.train.checkpoint.layout import (
    ALGORITHM,
    COMPLETE,
    FORMAT,
    MANIFEST,
    STEP_DIR,
    TRAINER,
    VERSION,
    CheckpointError,
    channel_name,
    one_line,
    parse_scheme_dir,
    rank_manifest,
    relative,
)

__all__ = ["Manifest", "digests", "file_digest", "head", "read_json"]

_CHUNK = 8 << 20


def file_digest(path: str | os.PathLike[str], *, sync: bool = False) -> tuple[int, str]:
    """``(size, SHA-256 hex digest)`` of a file, read in 8 MiB chunks (bounded memory whatever its size);
    with ``sync`` the file is also fsynced."""
    h = hashlib.new(ALGORITHM)
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


def digests(paths: list[Path], *, sync: bool = False) -> list[tuple[int, str]]:
    """:func:`file_digest` of several files, a few at a time (hashlib and reads release the GIL)."""
    workers = min(4, os.cpu_count() or 1, len(paths))
    if workers <= 1:
        return [file_digest(p, sync=sync) for p in paths]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="aqsgd-ckpt-hash") as pool:
        return list(pool.map(lambda p: file_digest(p, sync=sync), paths))


def read_json(file: Path, what: str = "") -> Any:
    try:
        return json.loads(file.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing{what}") from None
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{file}: not UTF-8 text ({one_line(exc)}){what}") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{file}: not valid JSON ({one_line(exc)}){what}") from None
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot read it ({one_line(exc)})") from None


def digest_entry(obj: Any, file: Path, where: str) -> tuple[int, str]:
    """A ``{"size": int, "sha256": hex}`` entry of a manifest, checked."""
    if (not isinstance(obj, dict) or not isinstance(obj.get("size"), int)
            or not isinstance(obj.get(ALGORITHM), str) or not re.fullmatch(r"[0-9a-f]{64}", obj[ALGORITHM])):
        raise CheckpointError(f"{file}: malformed entry for {where} (damaged manifest)")
    return obj["size"], obj[ALGORITHM]


def check_size(file: Path, size: int, listed_in: str) -> None:
    if not file.is_file():
        raise CheckpointError(f"{file}: missing (listed in {listed_in})")
    got_size = file.stat().st_size
    if got_size != size:
        raise CheckpointError(f"{file}: {got_size} bytes, {listed_in} says {size}: the file was truncated, "
                              "extended or replaced after the checkpoint was written")


def check_file(file: Path, expected: tuple[int, str], listed_in: str,
               actual: tuple[int, str] | None = None) -> None:
    """``file`` exists with the size and checksum of its manifest entry (``actual``: its digest if known)."""
    size, digest = expected
    check_size(file, size, listed_in)
    got = actual if actual is not None else file_digest(file)
    if got[1] != digest:
        raise CheckpointError(f"{file}: {ALGORITHM} checksum mismatch ({got[1][:16]}..., {listed_in} says "
                              f"{digest[:16]}...): the file was changed or damaged after the checkpoint was "
                              "written")


class Manifest:
    """The verified manifests of a checkpoint: ``COMPLETE`` -> ``MANIFEST.json`` ->
    ``rank{r}.manifest.json``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        complete = path / COMPLETE
        if not complete.exists():  # listed as complete a moment ago (a run still training prunes its oldest)
            raise CheckpointError(f"{complete}: missing; the checkpoint was removed while it was read (a run "
                                  "still training prunes its older checkpoints), or is not complete")
        marker = read_json(complete, " (is this a checkpoint written before checkpoints carried checksums?)")
        if (not isinstance(marker, dict) or not isinstance(marker.get("step"), int)
                or "manifest" not in marker):
            raise CheckpointError(f"{complete}: no step and {MANIFEST} checksum (a checkpoint written before "
                                  f"checkpoints carried checksums, or a damaged marker)")
        self.step = marker["step"]
        m = STEP_DIR.fullmatch(path.name)
        if m and int(path.name[5:]) != self.step:
            raise CheckpointError(f"{complete}: says step {self.step}, the folder is {path.name}")
        top = path / MANIFEST
        check_file(top, digest_entry(marker["manifest"], complete, MANIFEST), COMPLETE)
        root = read_json(top)
        if not isinstance(root, dict) or root.get("format") != FORMAT:
            raise CheckpointError(f"{top}: not an aqsgd checkpoint manifest")
        if root.get("version") != VERSION or root.get("algorithm") != ALGORITHM:
            raise CheckpointError(f"{top}: format version {root.get('version')} ({root.get('algorithm')}), "
                                  f"this aqsgd reads version {VERSION} ({ALGORITHM})")
        if root.get("step") != self.step:
            raise CheckpointError(f"{top}: says step {root.get('step')}, {COMPLETE} says {self.step}")
        for key in ("stages", "data_parallel", "world"):
            if not isinstance(root.get(key), int) or root[key] < 1:
                raise CheckpointError(f"{top}: no valid {key!r} (damaged manifest)")
        self.stages, self.data_parallel, self.world = root["stages"], root["data_parallel"], root["world"]
        manifests = root.get("manifests")
        if (not isinstance(manifests, dict)
                or sorted(manifests) != sorted(rank_manifest(r) for r in range(self.world))):
            raise CheckpointError(f"{top}: does not list one file manifest per process (damaged manifest)")
        self.files: dict[str, tuple[int, str]] = {}
        self.owner: dict[str, str] = {}
        self.trees: dict[str, str] = {}
        self.mirrored: dict[str, list[str]] = {}
        self.optimizers: dict[str, str] = {}
        for name in sorted(manifests, key=lambda n: int(n[4:].split(".")[0])):
            file = path / name
            check_file(file, digest_entry(manifests[name], top, name), MANIFEST)
            own = read_json(file)
            if (not isinstance(own, dict) or own.get("format") != f"{FORMAT}-files"
                    or own.get("step") != self.step or not isinstance(own.get("files"), dict)
                    or not isinstance(own.get("trees"), list) or not isinstance(own.get("mirrored"), dict)):
                raise CheckpointError(f"{file}: not a file manifest of step {self.step} (damaged manifest)")
            for rel, entry in own["files"].items():
                if (rel in self.files or not isinstance(rel, str) or rel.startswith("/")
                        or ".." in rel.split("/")):
                    raise CheckpointError(f"{file}: bad or duplicate entry {rel!r} (damaged manifest)")
                self.files[rel] = digest_entry(entry, file, rel)
                self.owner[rel] = name
            for tree in own["trees"]:
                self.trees[str(tree)] = name
            for d, rels in own["mirrored"].items():
                if (not isinstance(rels, list)
                        or not all(isinstance(r, str) and f"{d}/{r}" in own["files"] for r in rels)):
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
                                      f"{MANIFEST}'s rank manifests; written by another version, or damaged)")
            check_size(file, self.files[rel][0], self.owner[rel])  # cheap checks of every file first
        sums = digests([self.path / r for r in rels])
        for rel, got in zip(rels, sums):
            check_file(self.path / rel, self.files[rel], self.owner[rel], actual=got)

    def verify_tree(self, tree: str) -> list[str]:
        """Every file listed under ``tree`` verified, and no unlisted file there; returns the listed ones."""
        listed = self.tree_files(tree)
        d = self.path / tree
        if d.is_dir():
            for f in sorted(d.rglob("*")):
                if f.is_file() and relative(f, self.path) not in self.files:
                    raise CheckpointError(f"{f}: not listed in the checkpoint's manifests (a file added "
                                          "after the checkpoint was written)")
        self.verify(listed)
        return listed

    def check_mirrors(self) -> None:
        """The two sides of each boundary with bit-identical state saved identical bytes (by their
        digests)."""
        pairs: dict[tuple[str, int, str], dict[str, str]] = {}
        for d in self.mirrored:
            parts = d.split("/")
            key = parse_scheme_dir(parts[-1])
            if key is None or len(parts) < 3 or parts[-2] != "schemes":
                continue
            replica = parts[1] if len(parts) == 4 else ""
            pairs.setdefault((replica, key[0], channel_name(key[1])), {})[key[2]] = d
        for (replica, b, direction), sides in sorted(pairs.items()):
            if len(sides) != 2:
                continue
            s, r = sides["sender"], sides["receiver"]
            ms, mr = self.mirrored[s], self.mirrored[r]
            if not ms and not mr:
                continue
            where = f"boundary {b} {direction}" + (f" ({replica})" if replica else "")
            if ms != mr:
                raise CheckpointError(f"{self.path}: {where}: the sender saved {ms} in {s}, the receiver "
                                      f"{mr} in {r}; the two sides' state must be identical")
            for f in ms:
                if self.files[f"{s}/{f}"][1] != self.files[f"{r}/{f}"][1]:
                    raise CheckpointError(
                        f"{self.path}: {where}: the sender's {s}/{f} and the receiver's {r}/{f} differ; the "
                        "two sides of the boundary must hold bit-identical state, so this checkpoint would "
                        "not continue training correctly")


def head(path: Path) -> tuple[Manifest, dict[str, Any]]:
    """The verified manifests and ``trainer.json`` of a checkpoint."""
    manifest = Manifest(path)
    manifest.verify([TRAINER])
    state = read_json(path / TRAINER)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path / TRAINER}: not a JSON object")
    for key in ("epoch", "batch", "step"):
        if not isinstance(state.get(key), int) or isinstance(state.get(key), bool) or state[key] < 0:
            raise CheckpointError(f"{path / TRAINER}: no valid {key!r}")
    if state["step"] != manifest.step:
        raise CheckpointError(f"{path / TRAINER}: says step {state['step']}, the checkpoint is step "
                              f"{manifest.step}")
    if not isinstance(state.get("totals", {}), dict) or not isinstance(state.get("config", {}), dict):
        raise CheckpointError(f"{path / TRAINER}: 'totals' and 'config' must be JSON objects")
    state.setdefault("totals", {})
    return manifest, state
