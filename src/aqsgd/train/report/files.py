"""Writing a command's result files (``aqsgd report --out/--json``, ``aqsgd eval --out``) so that a bad
path or a full disk ends the command with one line naming the path and the cause.

:func:`check_writable` refuses, before any long work, a path that cannot be written (a folder, a path under
a file, a folder without write permission or on a read-only filesystem); :func:`write_replacing` writes into
a temporary file beside the target and renames it over the target, so that a write that fails halfway (a full
disk) leaves neither a truncated file nor the temporary one.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import IO

from aqsgd.errors import AqsgdError, SpecError

__all__ = ["check_writable", "write_replacing"]


def _nearest_existing(path: Path) -> Path:
    """``path``'s nearest ancestor that exists (the folders after it are created when the file is written)."""
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def check_writable(path: str | Path, option: str, error: type[AqsgdError] = SpecError) -> None:
    """Raise ``error`` (one line: ``option``, the path and why) when ``path`` cannot be written: it is a
    folder, a part of it is a file, or the folder it goes into (or its nearest existing ancestor, where
    folders are missing: they are created) is not writable by this process, e.g. read-only. Writes
    nothing."""
    path = Path(path)
    try:
        if path.is_dir():
            raise error(f"{option} {path}: is a directory; give a file name")
        folder = _nearest_existing(path)
        if not folder.is_dir():
            raise error(f"{option} {path}: {folder} is a file, not a folder")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise error(f"{option} {path}: folder {folder} is not writable (permission denied or read-only)")
    except OSError as e:  # a folder on the way that cannot even be looked into
        raise error(f"{option} {path}: cannot be written ({e.strerror or e})") from None


def write_replacing(path: str | Path, write: Callable[[IO[bytes]], None], option: str,
                    error: type[AqsgdError] = SpecError) -> Path:
    """Write ``path`` with ``write(binary file)``: into a temporary file in the same folder (missing folders
    are created first), then renamed over ``path``. An :class:`OSError` on the way (a full disk, a read-only
    folder) removes the temporary file, leaves an existing ``path`` as it was and raises ``error`` in one
    line naming ``option``, the path and the cause. Returns ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "xb") as f:  # (created with the umask's permissions, as the file itself would be)
            write(f)
            f.flush()
            os.fsync(f.fileno())  # a full disk may only say so here
        os.replace(tmp, path)
    except OSError as e:
        _remove(tmp)
        raise error(f"{option} {path}: could not write it ({e.strerror or e})") from None
    except BaseException:
        _remove(tmp)
        raise
    return path


def _remove(tmp: Path) -> None:
    """Remove a temporary file if it is there (where it cannot be, there is nothing more to say)."""
    with contextlib.suppress(OSError):
        tmp.unlink(missing_ok=True)
