"""``aqsgd bench codecs --cache-path``: the AQ-SGD cache path (memory, low-bit and disk caches) and the disk
cache's prefetch, measured on the library's own schemes and caches."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from aqsgd.bench.cachepath import (
    CachePair,
    CachePathRow,
    PrefetchRow,
    bench_cache_path,
    bench_prefetch,
    drop_file_pages,
    markdown_table,
    resident_fraction,
)
from aqsgd.cli import main
from aqsgd.compress import kernels, make_codec
from aqsgd.schemes import DiskCache, make_cache

SHAPE = (2, 16, 64)  # 2 samples of 16 x 64 per micro-batch


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return bench_cache_path(["q2", "q4"], ["memory", "lowbit4", "disk"], shape=SHAPE, repeats=2, warmup=1,
                            cache_dir=tmp_path_factory.mktemp("cp"))


def test_one_row_per_codec_and_cache(rows):
    assert [(r.codec, r.cache) for r in rows] == [
        (make_codec(c).spec, k) for c in ("q2", "q4") for k in ("memory", "lowbit4", "disk")]
    for r in rows:
        assert r.shape == list(SHAPE) and r.device == "cpu" and r.microbatches == 4
        for f in ("sender_gbps", "receiver_gbps", "clone_gbps", "sender_vs_clone", "receiver_vs_clone",
                  "get_ms", "sub_ms", "encode_ms", "decode_ms", "add_ms", "put_ms"):
            assert getattr(r, f) > 0 and math.isfinite(getattr(r, f)), f
        nbytes = math.prod(SHAPE) * 4
        assert r.sender_gbps == pytest.approx(nbytes / r.sender_ms / 1e6)
        assert r.sender_vs_clone == pytest.approx(r.sender_gbps / r.clone_gbps)
        assert r.receiver_vs_clone == pytest.approx(r.receiver_gbps / r.clone_gbps)
        assert r.copy_gbps > 0 and r.sender_vs_copy == pytest.approx(r.sender_gbps / r.copy_gbps)
        assert r.receiver_vs_copy == pytest.approx(r.receiver_gbps / r.copy_gbps)
        assert r.caches_identical  # both sides' caches bit-identical after every timed call
        # the in-memory cache runs the fused AQ-SGD step; the same paths also timed with the kernels off
        compiled = kernels.for_device("cpu").name != "eager"
        assert r.fused == (r.cache == "memory" and compiled)
        if compiled:
            assert r.eager_sender_ms > 0 and r.eager_receiver_ms > 0
        else:
            assert r.eager_sender_ms is None and r.eager_receiver_ms is None


def test_wire_and_cache_bytes(rows):
    x = torch.randn(SHAPE)
    row = math.prod(SHAPE[1:])
    for r in rows:
        assert r.wire_bytes == make_codec(r.codec).encode(x).nbytes  # one DELTA packet: every sample was seen
        expected = {"memory": row * 2, "disk": row * 2,  # fp16 storage, the default
                    "lowbit4": -(-row // 64) * (64 * 4 // 8 + 2)}[r.cache]
        assert r.cache_bytes_per_sample == expected


@pytest.mark.parametrize("cache", ["memory", "lowbit4", "disk", "memory:fp32"])
@pytest.mark.slow
def test_sender_path_stores_m_plus_decoded_delta(cache, tmp_path):
    """What the benchmark times is the real scheme: after one TRAIN micro-batch the sender's cache holds
    round(m + decode(packet)) (round = the cache's storage), the receiver returns and stores the same."""
    pair = CachePair(cache, "q2", SHAPE, microbatches=3, cache_dir=tmp_path)
    try:
        for k in (1, 0, 1):  # a second visit too: the caches now hold earlier m'
            ids = pair.ids[k]
            m = pair.sender.cache.get(ids).clone()
            x = pair.activation(k)
            packets = pair.send(k)
            assert len(packets) == 1 and packets[0].kind == 3  # Kind.DELTA
            assert packets[0].nbytes == make_codec("q2").encode(x - m).nbytes
            expected = m + pair.sender.codec.decode(packets[0])
            reference = make_cache(cache, pair.capacity, row_shape=SHAPE[1:], path=tmp_path / "ref.bin")
            stored = reference.put(ids, expected)
            if isinstance(reference, DiskCache):
                reference.close()
            assert torch.equal(pair.sender.cache.get(ids), stored)
            out = pair.recv(k, packets)
            assert torch.equal(out, stored)
            assert torch.equal(pair.receiver.cache.get(ids), stored)
            assert not torch.equal(stored, m)  # the delta moved the cache
        assert pair.identical()
        assert pair.visits == [2, 3, 1]  # the warm-up epoch was visit 0; versions alternate per visit
    finally:
        pair.close()


def test_drop_file_pages(tmp_path):
    with DiskCache(tmp_path / "rows.bin", 8, (256, 64)) as cache:
        rows = cache.put(torch.arange(8), torch.randn(8, 256, 64))
        cache.flush()
        before = resident_fraction(cache.path)
        if before is None:
            pytest.skip("mincore unavailable here")
        assert before > 0.9
        if not drop_file_pages(cache):
            pytest.skip("the page cache cannot be dropped on this file system")
        assert resident_fraction(cache.path) == 0.0
        assert torch.equal(cache.get(torch.tensor([3])), rows[3:4])  # read back from the disk, unchanged
        assert resident_fraction(cache.path) > 0  # (with the kernel's read-ahead)


def test_prefetch_modes(tmp_path):
    rows = bench_prefetch("q2", "disk", shape=SHAPE, repeats=2, cache_dir=tmp_path)
    assert [(r.pages, r.prefetch) for r in rows] == [("cold", False), ("cold", True), ("warm", False),
                                                     ("warm", True)]
    for r in rows:
        # every get used its prefetch, or none
        assert (r.hits, r.misses) == ((4, 0) if r.prefetch else (0, 4))
        assert r.step_read_wait_ms >= r.max_get_wait_ms > 0 and r.step_ms > r.step_read_wait_ms
        assert r.forward_ms > 0
        assert (r.hidden is None) != r.prefetch
        if r.pages == "warm":
            assert r.resident_before == 1.0 and not r.pages_dropped
        elif r.pages_dropped:
            assert r.resident_before == 0.0
    assert not list(tmp_path.iterdir())  # the temporary folder is gone


def test_prefetch_needs_a_disk_cache(tmp_path):
    with pytest.raises(ValueError, match="disk cache"):
        bench_prefetch("q2", "memory", shape=SHAPE, repeats=1, cache_dir=tmp_path)


def test_cli_tables_and_json(tmp_path, capsys):
    out = tmp_path / "cp.json"
    assert main(["bench", "codecs", "--cache-path", "memory", "disk:fp32", "--codecs", "q4", "--shape",
                 "2,8,32", "--repeats", "2", "--warmup", "1", "--device", "cpu", "--cache-dir",
                 str(tmp_path / "c"), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "AQ-SGD cache path" in text and "disk cache reads" in text and "cold" in text and "warm" in text
    data = json.loads(out.read_text())
    assert data["benchmark"] == "codecs-cache-path"
    assert data["command"].startswith("aqsgd bench codecs --cache-path memory disk:fp32")
    assert data["config"]["caches"] == ["memory", "disk:fp32"] and data["config"]["shape"] == [2, 8, 32]
    assert [r["cache"] for r in data["rows"]] == ["memory", "disk:fp32"]
    assert all(r["codec"] == "q4" for r in data["rows"])
    assert set(data["rows"][0]) == {f.name for f in dataclasses.fields(CachePathRow)}
    assert [(r["pages"], r["prefetch"]) for r in data["prefetch"]] == [
        ("cold", False), ("cold", True), ("warm", False), ("warm", True)]
    assert set(data["prefetch"][0]) == {f.name for f in dataclasses.fields(PrefetchRow)}
    assert data["rows"][1]["cache_bytes_per_sample"] == 8 * 32 * 4
    assert not list((tmp_path / "c").iterdir())  # temporary folders inside --cache-dir are removed
    md = markdown_table(data)
    assert len(md) == 2 + 2 + 3 + 4 and md[2].startswith("| `memory` | `q4` |") and "| cold | yes |" in md[-3]


def test_cli_defaults_without_disk_print_no_prefetch_table(tmp_path, capsys):
    out = tmp_path / "cp.json"
    assert main(["bench", "codecs", "--cache-path", "memory", "--shape", "2,8,32", "--repeats", "1",
                 "--warmup", "1", "--device", "cpu", "--json", str(out)]) == 0
    assert "disk cache reads" not in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["config"]["codecs"] == ["q2"] and data["prefetch"] == []


def test_cli_misuse_is_one_line(capsys):
    assert main(["bench", "codecs", "--device", "cpu", "--cache-path", "--quality"]) == 2
    assert "separate tables" in capsys.readouterr().err
    assert main(["bench", "codecs", "--device", "cpu", "--cache-dir", "/tmp"]) == 2
    assert "add --cache-path" in capsys.readouterr().err
    assert main(["bench", "codecs", "--device", "cpu", "--cache-path", "memory:fp8"]) == 2
    assert "invalid cache spec" in capsys.readouterr().err
    assert main(["bench", "codecs", "--device", "cpu", "--cache-path", "--codecs", "q9"]) == 2
    assert main(["bench", "codecs", "--device", "cpu", "--cache-path", "--shape", "64"]) == 2
    assert "row shape" in capsys.readouterr().err
