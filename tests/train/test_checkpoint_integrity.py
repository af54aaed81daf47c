"""Checkpoints can be trusted: checksummed, written durably and atomically, verified before anything is read.

A real checkpoint of the synthetic task (3 stages, AQ-SGD forward, EF21 backward: both boundary kinds whose
two sides hold bit-identical state) is damaged in every way a disk, a copy or a person can damage it; each
resume must stop with one :class:`CheckpointError` line naming the file, and an undamaged one must continue
exactly.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from aqsgd.errors import SchemeError
from aqsgd.pipeline.compression import BACKWARD_CHANNEL, FORWARD_CHANNEL
from aqsgd.schemes.factory import make_scheme
from aqsgd.schemes.feedback import EF21Scheme
from aqsgd.train.checkpoint import (
    CheckpointError,
    file_digest,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from aqsgd.train.checkpoint import write as ckpt_write
from aqsgd.train.config import TrainConfig
from aqsgd.train.trainer import Trainer

STEP8 = "checkpoints/step-00000008"
STEP4 = "checkpoints/step-00000004"


def _cfg(out: Path, **kw) -> TrainConfig:
    base = dict(task="synthetic-lm", max_train_samples=48, max_eval_samples=16, max_length=12, stages=3,
                micro_batches=2, micro_batch_size=4, epochs=2, lr=3e-3, output_dir=str(out), progress=False,
                tensorboard=False, forward="delta:q2:stochastic", backward="ef21:q4",
                cache_dir=str(out / "cache"), checkpoint_every=4)
    base.update(kw)
    return TrainConfig.of(**base)


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}  # a resumed run's rows come last


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted run (12 steps) and one stopped after step 8 (checkpoints at steps 4 and 8)."""
    out = tmp_path_factory.mktemp("ckpt")
    Trainer(_cfg(out, run_name="full")).run()
    Trainer(_cfg(out, run_name="part")).run(stop_at=8)
    return out


@pytest.fixture
def run(runs, tmp_path):
    """A private copy of the interrupted run (its own caches folder)."""
    dst = tmp_path / "part"
    shutil.copytree(runs / "part", dst)
    return dst


def _resume(run: Path, **kw) -> dict:
    return Trainer(_cfg(run.parent, run_name=run.name, resume=str(run), **kw)).run()


def _one_line_error(excinfo, *names: str) -> str:
    msg = str(excinfo.value)
    assert type(excinfo.value) is CheckpointError
    assert "\n" not in msg and len(msg) < 1000, msg
    for name in names:
        assert name in msg, (name, msg)
    return msg


# -- damage helpers ------------------------------------------------------------------------------------------
def _flip(file: Path, at: float = 0.5) -> None:
    data = bytearray(file.read_bytes())
    data[min(len(data) - 1, int(len(data) * at))] ^= 0x01
    file.write_bytes(bytes(data))


def _truncate(file: Path, keep: float = 0.5) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])


def _edit_epoch(file: Path) -> None:  # a hand edit that keeps the size: epoch 1 -> 9
    text = file.read_text()
    assert '"epoch": 1,' in text
    file.write_text(text.replace('"epoch": 1,', '"epoch": 9,', 1))


def _swap_older_cache(file: Path) -> None:  # the same side's cache, from the step-4 checkpoint
    older = Path(str(file).replace("step-00000008", "step-00000004"))
    shutil.copyfile(older, file)


DAMAGE = {  # name: (file in the step-8 checkpoint, damage)
    "model-flip": ("stage1/model.safetensors", _flip),
    "model-truncated": ("stage0/model.safetensors", _truncate),
    "optimizer-flip": ("stage2/optimizer.pt", lambda f: _flip(f, 0.9)),
    "optimizer-deleted": ("stage0/optimizer.pt", Path.unlink),
    "scheduler-not-utf8": ("stage0/scheduler.json", lambda f: f.write_bytes(b"\xff\xfe{\x00\x9c")),
    "trainer-epoch-edited": ("trainer.json", _edit_epoch),
    "trainer-garbled": ("trainer.json", lambda f: f.write_text("{not json")),
    "trainer-deleted": ("trainer.json", Path.unlink),
    "rng-flip": ("rank0.rng.safetensors", _flip),
    "rng-json-truncated": ("rank0.rng.json", _truncate),
    "sender-cache-flip": ("stage0/schemes/b0-forward-sender/cache/cache.safetensors",
                          lambda f: _flip(f, 0.7)),
    "receiver-cache-flip": ("stage2/schemes/b1-forward-receiver/cache/cache.safetensors",
                            lambda f: _flip(f, 0.99)),
    "cache-meta-garbled": ("stage1/schemes/b1-forward-sender/cache/meta.json", lambda f: f.write_text("}")),
    "cache-deleted": ("stage1/schemes/b0-forward-receiver/cache/cache.safetensors", Path.unlink),
    "cache-from-older-checkpoint": ("stage0/schemes/b0-forward-sender/cache/cache.safetensors",
                                    _swap_older_cache),
    "ef21-estimate-flip": ("stage1/schemes/b1-backward-receiver/slots.safetensors", _flip),
    "scheme-shape-edited": ("stage2/schemes/b1-backward-sender/shape.json",
                            lambda f: f.write_text(f.read_text().replace("12", "13", 1))),
    "generator-flip": ("stage0/schemes/b0-forward-sender/state.safetensors", lambda f: _flip(f, 0.95)),
    "file-manifest-flip": ("rank0.manifest.json", lambda f: _flip(f, 0.3)),
    "file-manifest-deleted": ("rank0.manifest.json", Path.unlink),
    "manifest-flip": ("MANIFEST.json", _flip),
    "manifest-deleted": ("MANIFEST.json", Path.unlink),
    "complete-garbled": ("COMPLETE", lambda f: f.write_bytes(b"\x00\xff")),
    "unlisted-file-in-scheme": ("stage1/schemes/b0-forward-receiver/cache/extra.bin",
                                lambda f: f.write_bytes(b"x")),
}


@pytest.mark.parametrize("name", sorted(DAMAGE))
def test_damaged_checkpoint_is_refused_naming_the_file(run, name):
    rel, damage = DAMAGE[name]
    damage(run / STEP8 / rel)
    with pytest.raises(CheckpointError) as excinfo:
        _resume(run)
    _one_line_error(excinfo, f"{STEP8}/{rel}")


def test_verified_before_anything_is_loaded(run, tmp_path):
    """A damaged file of the last stage stops the load before the first stage's weights are touched."""
    _flip(run / STEP8 / "stage2/schemes/b1-forward-receiver/cache/cache.safetensors")
    trainer = Trainer(_cfg(tmp_path, run_name="fresh"))
    before = {i: {k: v.clone() for k, v in m.state_dict().items()} for i, m in trainer.engine.stages.items()}
    with pytest.raises(CheckpointError) as excinfo:
        load_checkpoint(run / STEP8, trainer.engine)
    _one_line_error(excinfo, "b1-forward-receiver/cache/cache.safetensors", "checksum mismatch")
    for i, m in trainer.engine.stages.items():
        assert all(torch.equal(v, before[i][k]) for k, v in m.state_dict().items())
    assert not any(r.schemes for r in trainer.engine.runners.values())


def test_undamaged_resume_continues_exactly(runs, run):
    _resume(run)
    expect, got = _losses(runs / "full"), _losses(run)
    assert sorted(got) == sorted(expect) == list(range(1, 13))
    for step in range(1, 13):
        assert got[step] == expect[step], step  # bit-identical on CPU


def test_manifests_cover_every_file(runs):
    ck = runs / "part" / STEP8
    complete = json.loads((ck / "COMPLETE").read_text())
    assert complete["step"] == 8 and complete["manifest"]["sha256"] == file_digest(ck / "MANIFEST.json")[1]
    top = json.loads((ck / "MANIFEST.json").read_text())
    assert (top["stages"], top["data_parallel"], top["world"], top["algorithm"]) == (3, 1, 1, "sha256")
    assert top["manifests"]["rank0.manifest.json"]["sha256"] == file_digest(ck / "rank0.manifest.json")[1]
    files = json.loads((ck / "rank0.manifest.json").read_text())["files"]
    on_disk = {p.relative_to(ck).as_posix() for p in ck.rglob("*") if p.is_file()}
    assert set(files) == on_disk - {"COMPLETE", "MANIFEST.json", "rank0.manifest.json"}
    for rel, entry in files.items():
        data = (ck / rel).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, rel
    mirrored = json.loads((ck / "rank0.manifest.json").read_text())["mirrored"]
    assert mirrored["stage0/schemes/b0-forward-sender"] == ["cache/cache.safetensors", "cache/meta.json"]
    assert mirrored["stage2/schemes/b1-backward-sender"] == ["slots.safetensors"]
    # the two sides' mirrored files are byte-identical
    for a, b in (("stage0/schemes/b0-forward-sender/cache/cache.safetensors",
                  "stage1/schemes/b0-forward-receiver/cache/cache.safetensors"),
                 ("stage2/schemes/b1-backward-sender/slots.safetensors",
                  "stage1/schemes/b1-backward-receiver/slots.safetensors")):
        assert files[a] == files[b]
    assert not list((runs / "part" / "checkpoints").glob("*.tmp"))


# -- contents that pass their checksums but are bad (a bug in the writer, a manifest rewritten by hand) ------
def _reseal(ck: Path) -> None:
    """Recompute every manifest of ``ck`` for its current files (as a buggy writer would have written
    them)."""
    top = json.loads((ck / "MANIFEST.json").read_text())
    for name in top["manifests"]:
        own = json.loads((ck / name).read_text())
        own["files"] = {rel: dict(zip(("size", "sha256"), file_digest(ck / rel))) for rel in own["files"]}
        (ck / name).write_text(json.dumps(own))
        top["manifests"][name] = dict(zip(("size", "sha256"), file_digest(ck / name)))
    (ck / "MANIFEST.json").write_text(json.dumps(top))
    (ck / "COMPLETE").write_text(json.dumps({"step": top["step"], "manifest": dict(
        zip(("size", "sha256"), file_digest(ck / "MANIFEST.json")))}))


SEALED = {  # name: (file, damage, words of the message)
    "trainer-garbled": ("trainer.json", lambda f: f.write_text("{not json"), "not valid JSON"),
    "trainer-no-step": ("trainer.json", lambda f: f.write_text('{"epoch": 1, "batch": 2}'), "'step'"),
    "scheduler-not-utf8": ("stage0/scheduler.json", lambda f: f.write_bytes(b"\xff\xfe{\x00"), "not UTF-8"),
    "scheduler-list": ("stage1/scheduler.json", lambda f: f.write_text("[1, 2]"), "LR scheduler"),
    "model-truncated": ("stage1/model.safetensors", _truncate, "cannot load the weights of stage 1"),
    "optimizer-garbage": ("stage2/optimizer.pt", lambda f: f.write_bytes(b"PK\x03\x04 garbage"),
                          "optimizer of stage 2"),
    "rng-json-wrong": ("rank0.rng.json", lambda f: f.write_text('{"python": 5}'), "Python RNG state"),
    "rng-not-safetensors": ("rank0.rng.safetensors", _truncate, "torch RNG state"),
    "shape-empty": ("stage1/schemes/b1-forward-sender/shape.json", lambda f: f.write_text("{}"), "'shape'"),
    "generator-truncated": ("stage1/schemes/b1-forward-sender/state.safetensors", _truncate,
                            "cannot restore the b1-forward-sender scheme"),
    # one side's cache no longer equals the other side's: found from the manifests before anything is read
    "cache-truncated": ("stage1/schemes/b1-forward-sender/cache/cache.safetensors", _truncate,
                        "boundary 1 forward: the sender's"),
    "scheme-json-garbled": ("stage0/schemes/b0-backward-receiver/scheme.json",
                            lambda f: f.write_bytes(b"\xff"),
                            "cannot restore the b0-backward-receiver scheme"),
}


@pytest.mark.parametrize("name", sorted(SEALED))
def test_bad_contents_with_valid_checksums_are_one_line_errors(run, tmp_path, name):
    rel, damage, words = SEALED[name]
    ck = run / STEP8
    damage(ck / rel)
    _reseal(ck)
    trainer = Trainer(_cfg(tmp_path, run_name="fresh"))
    with pytest.raises(CheckpointError) as excinfo:
        load_checkpoint(ck, trainer.engine)
    _one_line_error(excinfo, rel, words)


@pytest.mark.parametrize("kw,words", [
    (dict(stages=2), "written by a run of 3 stages x 1 replicas, this run has 2 x 1"),
    (dict(optimizer="sgd"), "optimizer.pt: holds the state of the AdamW optimizer"),
    (dict(layers=[1, 1, 2]),
     "model.safetensors: weights do not fit stage 0 (missing [], unexpected ['layers.1."),
    (dict(backward="direct:q4"), "b0-backward-receiver: cannot restore"),
    (dict(max_train_samples=40), "b0-forward-sender: cannot restore"),
])
def test_checkpoint_of_another_engine_is_a_one_line_error(runs, tmp_path, kw, words):
    """load_checkpoint itself refuses a checkpoint that does not fit (the trainer compares settings first)."""
    trainer = Trainer(_cfg(tmp_path, run_name="other", **kw))
    with pytest.raises(CheckpointError) as excinfo:
        load_checkpoint(runs / "part" / STEP8, trainer.engine)
    _one_line_error(excinfo, str(runs / "part" / STEP8), words)


# -- the two sides of a boundary -----------------------------------------------------------------------------
@pytest.mark.parametrize("side,words", [("delta", "boundary 0 forward"), ("ef21", "boundary 1 backward")])
def test_sides_that_diverged_before_the_save_are_refused(tmp_path, side, words):
    """Consistent manifests, but one side's state differs from the other's: named by its boundary."""
    trainer = Trainer(_cfg(tmp_path, run_name="diverged"))
    trainer.run(stop_at=2)
    engine = trainer.engine
    if side == "delta":
        cache = engine.runners[1].schemes[(0, FORWARD_CHANNEL, "receiver")].cache
        ids = cache.visited(torch.arange(cache.capacity)).nonzero()[:1, 0]
        cache.put(ids, cache.get(ids) + 1)
    else:
        state = engine.runners[1].schemes[(1, BACKWARD_CHANNEL, "receiver")].state
        state.buffers[0] += 1
    position = {"epoch": 0, "batch": 2, "step": 2, "totals": {}, "config": {}}
    ck = save_checkpoint(tmp_path / "diverged", 2, engine, position)
    with pytest.raises(CheckpointError) as excinfo:
        load_checkpoint(ck, Trainer(_cfg(tmp_path, run_name="fresh")).engine)
    _one_line_error(excinfo, words, "sender", "receiver", "bit-identical")


# -- writing -------------------------------------------------------------------------------------------------
def _enospc_at(path_part: str, real):
    def write(obj, path):
        if path_part in str(path):
            Path(path).write_bytes(b"partial")  # a partly written file
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(obj, path)
    return write


def test_disk_full_is_one_line_and_the_previous_checkpoint_resumes_exactly(runs, tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt_write, "_torch_save", _enospc_at("step-00000008.tmp/stage1/optimizer.pt",
                                                               ckpt_write._torch_save))
    with pytest.raises(CheckpointError) as excinfo:
        Trainer(_cfg(tmp_path, run_name="full-disk")).run()
    run = tmp_path / "full-disk"
    _one_line_error(excinfo, "writing checkpoint", "step-00000008", "No space left on device",
                    "stage1/optimizer.pt")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000004"]
    monkeypatch.undo()
    _resume(run)
    expect, got = _losses(runs / "full"), _losses(run)
    assert sorted(got) == list(range(1, 13))
    assert all(got[s] == expect[s] for s in got)


def test_safetensors_storage_error_is_one_line(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    import aqsgd.schemes.cache.memory as cache_mod  # the run's AQ-SGD caches are memory caches

    def full(*a, **kw):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                              '"No space left on device" })')

    trainer = Trainer(_cfg(tmp_path, run_name="st"))
    trainer.run(stop_at=1)
    monkeypatch.setattr(cache_mod, "save_file", full)
    with pytest.raises(CheckpointError) as excinfo:
        save_checkpoint(tmp_path / "st", 1, trainer.engine, {"epoch": 0, "batch": 1, "step": 1})
    _one_line_error(excinfo,
                    "step-00000001: No space left on device (writing stage0/schemes/b0-forward-sender)")
    assert not (tmp_path / "st" / "checkpoints" / "step-00000001.tmp").exists()


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    size_kb = 4096  # one checkpoint (~2.7 MB) fits, a second one does not
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(mnt)], check=True,
                       capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        pytest.skip("mounting a tmpfs is not permitted here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=10)


def test_really_full_tmpfs(tiny_tmpfs, tmp_path):
    cfg = _cfg(tiny_tmpfs, run_name="r", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(CheckpointError) as excinfo:
        Trainer(cfg).run()
    _one_line_error(excinfo, "writing checkpoint", "step-00000008", "No space left on device")
    ckpts = tiny_tmpfs / "r" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000004"]
    assert latest_checkpoint(tiny_tmpfs / "r") == ckpts / "step-00000004"
    load_checkpoint(ckpts / "step-00000004", Trainer(_cfg(tmp_path, run_name="fresh")).engine)


def test_files_and_folders_are_fsynced_before_the_rename(tmp_path, monkeypatch):
    trainer = Trainer(_cfg(tmp_path, run_name="sync"))
    trainer.run(stop_at=1)
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(a, b):
        events.append(("replace", str(b)))
        return real_replace(a, b)

    monkeypatch.setattr(ckpt_write.os, "fsync", fsync)
    monkeypatch.setattr(ckpt_write.os, "replace", replace)
    final = save_checkpoint(tmp_path / "sync", 1, trainer.engine, {"epoch": 0, "batch": 1, "step": 1})
    monkeypatch.undo()
    renamed = [i for i, e in enumerate(events) if e == ("replace", str(final))]
    assert len(renamed) == 1
    before = {path for kind, path in events[: renamed[0]]}
    tmp = str(final) + ".tmp"
    for p in [final, *final.rglob("*")]:
        assert tmp + str(p)[len(str(final)):] in before, p  # every file and folder, COMPLETE included
    assert ("fsync", str(final.parent)) in events[renamed[0]:]  # the rename itself


def test_stale_tmp_is_never_loaded_and_is_cleaned_by_the_next_save(run):
    stale = run / "checkpoints" / "step-00000012.tmp"
    shutil.copytree(run / STEP8, stale)  # a crashed save that even got its COMPLETE written
    (run / "checkpoints" / "step-00000010").mkdir()  # a folder without COMPLETE (an old crash)
    assert latest_checkpoint(run) == run / STEP8
    assert latest_checkpoint(stale) is None
    with pytest.raises(CheckpointError) as excinfo:
        load_checkpoint(stale, Trainer(_cfg(run.parent, run_name="fresh")).engine)
    _one_line_error(excinfo, "step-00000012.tmp", "unfinished")
    _resume(run)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000008", "step-00000012"]


def test_checkpoint_without_checksums_is_refused(run):
    ck = run / STEP8
    for name in ("MANIFEST.json", "rank0.manifest.json"):
        (ck / name).unlink()
    (ck / "COMPLETE").write_text("8")  # as written before checkpoints carried checksums
    with pytest.raises(CheckpointError) as excinfo:
        _resume(run)
    _one_line_error(excinfo, f"{STEP8}/COMPLETE", "checksums")


def test_file_digest_streams_large_files(tmp_path):
    data = os.urandom((8 << 20) + 12345)  # more than one chunk
    (tmp_path / "f").write_bytes(data)
    assert file_digest(tmp_path / "f", sync=True) == (len(data), hashlib.sha256(data).hexdigest())


# -- the schemes' side of it ---------------------------------------------------------------------------------
def test_mirrored_state_of_each_scheme():
    assert make_scheme("delta", "q4", "sender", num_samples=8).mirrored_state() == ("cache/",)
    assert make_scheme("ef21", "q4", "receiver").mirrored_state() == ("slots.safetensors",)
    assert make_scheme("ef21", "q4", "receiver", key="sample", num_samples=8).mirrored_state() == ("cache/",)
    assert make_scheme("ef", "q4", "sender").mirrored_state() == ()
    assert make_scheme("direct", "q4", "sender").mirrored_state() == ()


def test_ef21_sides_save_identical_estimates_and_old_folders_still_load(tmp_path):
    s, r = make_scheme("ef21", "q4:stochastic", "sender"), make_scheme("ef21", "q4:stochastic", "receiver")
    for phase in ("warmup", "train", "train"):
        x = torch.randn(3, 5)
        r.recv(s.send(x, phase=phase), phase=phase)
    s.save(tmp_path / "s")
    r.save(tmp_path / "r")
    assert (tmp_path / "s/slots.safetensors").read_bytes() == (tmp_path / "r/slots.safetensors").read_bytes()
    assert (tmp_path / "s/state.safetensors").read_bytes() != (tmp_path / "r/state.safetensors").read_bytes()
    r2 = make_scheme("ef21", "q4:stochastic", "receiver")
    r2.load(tmp_path / "r")
    assert torch.equal(r2.state.buffers[0], r.state.buffers[0])
    # a folder written before the estimates got their own file: everything in state.safetensors
    from safetensors.torch import save_file
    legacy = tmp_path / "legacy"
    shutil.copytree(tmp_path / "r", legacy)
    (legacy / "slots.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in EF21Scheme.state_dict(r).items()},
              str(legacy / "state.safetensors"))
    r3 = make_scheme("ef21", "q4:stochastic", "receiver")
    r3.load(legacy)
    assert torch.equal(r3.state.buffers[0], r.state.buffers[0])


def test_scheme_load_names_a_garbled_file(tmp_path):
    s = make_scheme("direct", "q4", "sender")
    s.save(tmp_path)
    (tmp_path / "scheme.json").write_bytes(b"\xff")
    with pytest.raises(SchemeError, match="scheme.json: unreadable"):
        make_scheme("direct", "q4", "sender").load(tmp_path)
    s.save(tmp_path)
    (tmp_path / "state.safetensors").write_bytes(b"12")
    with pytest.raises(SchemeError, match="state.safetensors: unreadable"):
        make_scheme("direct", "q4", "sender").load(tmp_path)


# -- distributed: 2 stages x 2 replicas, each rank writes and verifies its own files -------------------------
def _dp_worker(rank: int, world: int, out: str) -> dict:
    import torch.distributed as dist

    out_dir = Path(out)
    cfg = _cfg(out_dir, stages=2, runtime="distributed", data_parallel=2, grad_sync="q8",
               max_train_samples=30, micro_batch_size=2, epochs=2, warmup_epochs=1, checkpoint_every=3,
               timeout=60.0, run_name="dp")
    result: dict = {}
    Trainer(cfg).run(stop_at=4)  # checkpoint at step 3
    # one rank's disk is full at the next save: every rank gets the same error, the partial folder goes
    real = ckpt_write._torch_save if rank == 1 else None
    if rank == 1:
        ckpt_write._torch_save = _enospc_at("optimizer.pt", real)
    try:
        save_checkpoint(out_dir / "dp", 4, Trainer(cfg.replace(run_name="dp2")).engine,
                        {"epoch": 1, "batch": 0, "step": 4})
    except CheckpointError as e:
        result["save_error"] = str(e)
        # the rank whose disk was full raises its own error; the others name it (the launcher's forensics
        # follow that to the stage at fault)
        result["save_error_blames"] = getattr(e, "rank", "own")
    finally:
        if real is not None:
            ckpt_write._torch_save = real
    dist.barrier()
    result["after_failed_save"] = sorted(p.name for p in (out_dir / "dp" / "checkpoints").iterdir())
    # a byte of replica 1's stage-1 cache (only rank 3 reads it) flips: every rank refuses the resume
    if rank == 0:
        _flip(next((out_dir / "dp" / "checkpoints" / "step-00000003" / "stage1"
                    / "replica1").rglob("cache.safetensors")))
    dist.barrier()
    try:
        Trainer(cfg.replace(resume=str(out_dir / "dp"))).run()
    except CheckpointError as e:
        result["load_error"] = str(e)
        result["load_error_blames"] = getattr(e, "rank", "own")
    return result


@pytest.mark.slow
def test_distributed_ranks_agree_on_every_failure(tmp_path):
    from aqsgd.comm.testing import run_processes
    from aqsgd.train.tasks import setup_task

    setup_task(_cfg(tmp_path))  # the weights file, once, before the processes start
    ranks = run_processes(_dp_worker, 4, args=(str(tmp_path),), timeout_s=300, pg_timeout_s=90)
    for r in ranks:
        assert "No space left on device (writing stage1/optimizer.pt)" in r["save_error"], r
        assert "\n" not in r["save_error"]
        assert r["after_failed_save"] == ["step-00000003"]
        assert ("step-00000003/stage1/replica1/schemes/" in r["load_error"]
                and "checksum mismatch" in r["load_error"])
    assert len({r["save_error"] for r in ranks}) == len({r["load_error"] for r in ranks}) == 1
    assert [r["save_error_blames"] for r in ranks] == [1, "own", 1, 1]
    assert [r["load_error_blames"] for r in ranks] == [3, 3, 3, "own"]


def test_a_signal_during_the_write_is_raised_once_the_checkpoint_is_complete(tmp_path, monkeypatch):
    """Ctrl-C that lands inside ``torch.save`` must not cut the checkpoint in half (the interruption raised
    inside the zip writer surfaced as its own "unexpected pos" error): it is held back until the checkpoint
    is published, then stops the run naming that checkpoint."""
    import signal

    import torch

    from aqsgd.errors import Interrupted
    from aqsgd.interrupts import stop_on_signals

    real_save, sent = torch.save, []

    def save(obj, f, *a, **kw):
        if not sent:
            sent.append(1)
            os.kill(os.getpid(), signal.SIGINT)  # delivered at once, within the write
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(ckpt_write.torch, "save", save)
    with stop_on_signals(), pytest.raises(Interrupted) as excinfo:
        Trainer(_cfg(tmp_path, run_name="sig")).run(stop_at=4)
    assert sent and excinfo.value.signum == signal.SIGINT
    ckpts = tmp_path / "sig" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000004"]
    assert f"the last complete checkpoint is {ckpts / 'step-00000004'}" in str(excinfo.value)
    load_checkpoint(ckpts / "step-00000004", Trainer(_cfg(tmp_path, run_name="fresh")).engine)
