"""A model folder's files: checked before anything loads them, and named by what they hold.

The prepared-weights cache (``CACHE/weights``, see :mod:`aqsgd.train.tasks`) holds the complete starting model
of a run built from a folder (its weights, a seeded classification head, fewer blocks). Such a file is named
by the folder's **contents**, :func:`model_digest`, never by its name alone: a folder saved again with new
weights (fine-tune, save, fine-tune again from the same path), or another folder of the same name, gets a
cache entry of its own instead of the stale one.

Hashing a model's weights reads them once (about a second per GB). The digest of each file is remembered in
``CACHE/weights/digests.json`` together with the file's size, modification time, status-change time (ns) and
inode, and is computed again whenever any of them changed. The status-change time (``st_ctime``) is what makes
this a key on content: the kernel sets it on every write and no program can set it back, where a copy that
restores the modification time (``rsync --inplace -t``, ``touch -r``) leaves size, mtime and inode as they
were.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from aqsgd.data.datasets.records import data_fingerprint
from aqsgd.errors import WeightsError

__all__ = ["model_digest", "check_model_files", "check_same_base", "MODEL_FILE_SUFFIXES"]

MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")
"""Files of a model folder that hold weights (with the ``*.index.json`` of sharded ones and
``config.json``)."""
_MEMO = "digests.json"


def _model_files(folder: Path) -> list[Path]:
    return sorted(f for f in folder.iterdir() if f.is_file() and (
        f.suffix in MODEL_FILE_SUFFIXES or f.name.endswith(".index.json") or f.name == "config.json"))


def check_model_files(folder: Path, option: str) -> None:
    """Every ``.safetensors`` file of ``folder`` opens (a truncated or damaged one does not: its header names
    more bytes than the file has); a one-line :class:`~aqsgd.errors.WeightsError` naming ``option`` and the
    file otherwise. Reads the headers only."""
    from safetensors import SafetensorError, safe_open

    for f in _model_files(folder):
        if f.suffix != ".safetensors":
            continue
        try:
            with safe_open(str(f), framework="pt"):
                pass
        except (OSError, SafetensorError) as e:
            detail = " ".join(str(e).split()) or type(e).__name__
            raise WeightsError(f"{option}: {f} is not a readable safetensors file ({detail}); it may be "
                               f"truncated or damaged: save the model there again") from None


def model_digest(folder: Path, memo_dir: Path) -> str:
    """A hex SHA-256 over the folder's weight files and ``config.json`` (names and bytes, in name order).
    Per-file digests are remembered in ``memo_dir/digests.json`` keyed by the file's path, size, mtime, ctime
    and inode (module docstring)."""
    memo_path = memo_dir / _MEMO
    memo = _read_memo(memo_path)
    changed = False
    total = hashlib.sha256()
    for f in _model_files(folder):
        st = f.stat()
        key = str(f.resolve())
        stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        known = memo.get(key)
        if not (isinstance(known, dict) and known.get("stamp") == stamp
                and isinstance(known.get("sha256"), str)):
            known = {"stamp": stamp, "sha256": data_fingerprint(f)}
            memo[key] = known
            changed = True
        total.update(f"{f.name}\0{known['sha256']}\n".encode())
    if changed:
        _write_memo(memo_path, memo)
    return total.hexdigest()


def _read_memo(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # none yet, or damaged: every digest is computed again
    return data if isinstance(data, dict) else {}


def _write_memo(path: Path, memo: dict[str, Any]) -> None:
    """Write aside and rename: stage processes of one run may do this at the same time (either copy is
    right)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(memo, indent=0, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:  # a read-only cache still works, it only hashes again next time
        with contextlib.suppress(OSError):
            tmp.unlink()


def check_same_base(recorded: str | None, now: str | None, folder: Path | str | None, where: str) -> None:
    """A LoRA checkpoint holds only its adapters (and a classifier's head): they fit the base model they were
    trained on, whose digest (:func:`model_digest`) the run recorded. A one-line
    :class:`~aqsgd.errors.WeightsError` if the base folder now holds other weights (saved again, replaced)."""
    if recorded is None or now is None or recorded == now:
        return
    raise WeightsError(f"{where}: the base model {folder} changed since the run was trained (sha256 "
                       f"{recorded[:12]}... then, {now[:12]}... now); the run's LoRA adapters fit the base "
                       "they were trained on: restore that folder, or start a new run on the new base")
