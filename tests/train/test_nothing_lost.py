"""Nothing of the user's is deleted and no abandoned checkpoint is trusted: ``--overwrite`` (export and train)
replaces only what aqsgd wrote, an export is swapped in only once complete, a run resumed from an earlier
checkpoint sets the later ones aside, a LoRA run refuses a changed base, and every failure is one line naming
the path or option."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch

from aqsgd.cli import main
from aqsgd.errors import SpecError, WeightsError
from aqsgd.train.checkpoint import CheckpointError, latest_checkpoint
from aqsgd.train.config import TrainConfig
from aqsgd.train.export import export_run
from aqsgd.train.rundir import RunDirError
from aqsgd.train.trainer import Trainer

from test_own_data import _save_model, _sentences


def _cfg(out: Path, **kw) -> TrainConfig:
    base = dict(task="synthetic-lm", max_train_samples=24, max_eval_samples=8, max_length=12, stages=2,
                micro_batches=2, micro_batch_size=4, epochs=2, warmup_epochs=1, lr=3e-3, output_dir=str(out),
                progress=False, tensorboard=False, cache_dir=str(out / "cache"))
    base.update(kw)
    return TrainConfig.of(**base)


def _tree(path: Path) -> list[tuple[str, int]]:
    """Every file under ``path`` with its size: what must be left as it was."""
    return sorted((str(p.relative_to(path)), p.stat().st_size) for p in path.rglob("*") if p.is_file())


def _one_line(capsys, argv: list[str], code: int = 2) -> str:
    capsys.readouterr()
    assert main(argv) == code
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two finished runs (3 steps each, checkpoints at 2 and 3) and an export of the first."""
    out = tmp_path_factory.mktemp("lost")
    for name in ("a", "b"):
        Trainer(_cfg(out, run_name=name, max_steps=3, checkpoint_every=2)).run()
    assert main(["export", str(out / "a"), "--out", str(out / "exp")]) == 0
    return out


# -- export --overwrite --------------------------------------------------------------------------------------
def test_export_onto_another_run_or_its_own_is_refused(runs, capsys):
    before = {n: _tree(runs / n) for n in ("a", "b")}
    for out in (runs / "b", runs / "a", runs / "a" / "checkpoints", runs):
        line = _one_line(capsys, ["export", str(runs / "a"), "--out", str(out), "--overwrite"])
        assert line.startswith(f"aqsgd: error: --out {out}: "), line
    assert {n: _tree(runs / n) for n in ("a", "b")} == before


def test_export_onto_a_model_folder_is_refused(runs, tmp_path, capsys, tokenizer_dir):
    folder = _save_model(tmp_path / "my-model", tokenizer_dir, "qwen2", "AutoModelForCausalLM")
    before = _tree(folder)
    line = _one_line(capsys, ["export", str(runs / "a"), "--out", str(folder), "--overwrite"])
    assert "replaces only an earlier aqsgd export" in line
    assert _tree(folder) == before


def test_export_into_the_working_directory_is_refused(runs, tmp_path, capsys, monkeypatch):
    earlier = tmp_path / "earlier"
    assert main(["export", str(runs / "a"), "--out", str(earlier)]) == 0
    (earlier / "notes.txt").write_text("mine")
    before = _tree(earlier)
    monkeypatch.chdir(earlier)
    assert "working directory" in _one_line(capsys, ["export", str(runs / "a"), "--out", ".", "--overwrite"])
    monkeypatch.chdir(tmp_path)
    line = _one_line(capsys, ["export", str(runs / "a"), "--out", str(earlier), "--overwrite"])
    assert "holds notes.txt besides an earlier export" in line
    assert _tree(earlier) == before


def test_overwrite_keeps_the_earlier_export_until_the_new_one_is_complete(runs, tmp_path, capsys):
    out = tmp_path / "exp"
    assert main(["export", str(runs / "a"), "--out", str(out), "--checkpoint", "2"]) == 0
    before = _tree(out)
    damaged = runs / "b" / "checkpoints" / "step-00000003" / "stage1" / "model.safetensors"
    data = damaged.read_bytes()
    damaged.write_bytes(b"garbage")
    try:
        line = _one_line(capsys, ["export", str(runs / "b"), "--out", str(out), "--overwrite"])
    finally:
        damaged.write_bytes(data)
    assert "stage1/model.safetensors" in line
    assert _tree(out) == before and not (tmp_path / ".exp.tmp").exists()
    assert main(["export", str(runs / "a"), "--out", str(out), "--overwrite"]) == 0  # an export: replaced
    marker = json.loads((out / "aqsgd-export.json").read_text())
    assert marker["checkpoint"] == "step-00000003" and sorted(marker["files"]) == sorted(os.listdir(out))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]  # nothing left beside it


def test_export_that_cannot_write_is_one_line_and_leaves_nothing(runs, tmp_path, capsys, monkeypatch):
    import aqsgd.train.export as export

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    calls = []
    monkeypatch.setattr(export, "run_model", lambda *a, **k: calls.append(a) or 1 / 0)
    line = _one_line(capsys, ["export", str(runs / "a"), "--out", str(blocker / "out")])
    assert line.startswith(f"aqsgd: error: --out {blocker / 'out'}: cannot write there") and not calls
    monkeypatch.undo()

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("transformers.PreTrainedModel.save_pretrained", full)
    out = tmp_path / "exp"
    line = _one_line(capsys, ["export", str(runs / "a"), "--out", str(out)])
    assert line == (f"aqsgd: error: --out {out}: cannot write the export (No space left on device); nothing "
                    "was replaced")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_export_uses_the_checkpoints_model_description(runs, tmp_path):
    """``RUN/model.json`` edited after the run: the checkpoint's own copy (under its manifest) is used."""
    model_json = runs / "a" / "model.json"
    saved = model_json.read_text()
    edited = json.loads(saved)
    edited["recipe"]["config"]["vocab_size"] = 100  # another model than the one trained
    model_json.write_text(json.dumps(edited))
    try:
        export_run(runs / "a", tmp_path / "exp")
    finally:
        model_json.write_text(saved)
    assert (tmp_path / "exp" / "model.safetensors").is_file()


def test_lora_export_of_a_full_fine_tuning_is_refused(runs, tmp_path, capsys):
    line = _one_line(capsys, ["export", str(runs / "a"), "--out", str(tmp_path / "x"), "--lora-export",
                              "adapter"])
    assert "is a full fine-tuning, not a LoRA run" in line and not (tmp_path / "x").exists()


def test_eval_and_export_of_a_missing_run_say_so(tmp_path, capsys):
    for command in ("eval", "export"):
        argv = [command, str(tmp_path / "nope")] + (["--out", str(tmp_path / "x")] if command == "export"
                                                     else [])
        assert _one_line(capsys, argv).endswith(f"{tmp_path / 'nope'}: no such run directory")
    (tmp_path / "empty").mkdir()
    assert "no complete checkpoint to evaluate" in _one_line(capsys, ["eval", str(tmp_path / "empty")])


def test_a_checkpoint_removed_while_it_is_read_is_not_blamed_on_its_age(runs, tmp_path):
    from aqsgd.train.checkpoint.manifest import head

    (tmp_path / "step-00000009").mkdir()
    with pytest.raises(CheckpointError) as e:
        head(tmp_path / "step-00000009")
    assert "checksums" not in str(e.value) and "removed while it was read" in str(e.value)


# -- train --overwrite ---------------------------------------------------------------------------------------
def test_train_overwrite_refuses_a_model_folder_or_a_run_holding_the_users_files(runs, tmp_path,
                                                                                  tokenizer_dir):
    folder = _save_model(tmp_path / "my-model", tokenizer_dir, "qwen2", "AutoModelForCausalLM")
    before = _tree(folder)
    with pytest.raises(RunDirError, match="does not look like a run directory"):
        Trainer(_cfg(tmp_path, run_name="my-model", overwrite=True))
    assert _tree(folder) == before
    (runs / "b" / "notes.txt").write_text("mine")
    try:
        with pytest.raises(RunDirError, match="holds notes.txt, which no run writes"):
            Trainer(_cfg(runs, run_name="b", overwrite=True))
    finally:
        (runs / "b" / "notes.txt").unlink()


def test_train_overwrite_takes_the_runs_own_chat_template_copy(tmp_path):
    """A run trained with --chat-template holds a copy of it (chat_template.jinja): its own entry, which
    --overwrite replaces like the rest of the run."""
    Trainer(_cfg(tmp_path, run_name="r", max_steps=1, checkpoint_every=0)).run()
    (tmp_path / "r" / "chat_template.jinja").write_text("{{ messages }}")
    Trainer(_cfg(tmp_path, run_name="r", max_steps=1, checkpoint_every=0, overwrite=True)).run()
    assert not (tmp_path / "r" / "chat_template.jinja").exists()


def test_train_overwrite_refuses_the_working_directory(tmp_path, monkeypatch):
    Trainer(_cfg(tmp_path, run_name="r", max_steps=1)).run()
    monkeypatch.chdir(tmp_path / "r")
    with pytest.raises(RunDirError, match="is the working directory or holds it"):
        Trainer(_cfg(tmp_path, run_name="r", overwrite=True))
    assert (tmp_path / "r" / "metrics.jsonl").exists()


def test_already_exists_offers_resume_only_with_a_checkpoint(tmp_path):
    Trainer(_cfg(tmp_path, run_name="r", max_steps=1, checkpoint_every=0)).run()
    with pytest.raises(RunDirError) as e:
        Trainer(_cfg(tmp_path, run_name="r"))
    assert "it has no complete checkpoint to continue from" in str(e.value) and "--resume" not in str(e.value)


def test_a_full_disk_at_the_start_is_one_line(tmp_path, monkeypatch):
    import aqsgd.train.rundir as rundir

    def full(*a):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rundir.os, "pwrite", full)
    with pytest.raises(RunDirError) as e:
        Trainer(_cfg(tmp_path, run_name="r"))
    lock = tmp_path / "r" / ".lock"
    assert str(e.value) == f"run directory {tmp_path / 'r'}: cannot write {lock} (No space left on device)"


# -- resume --------------------------------------------------------------------------------------------------
def test_an_in_place_resume_sets_the_abandoned_checkpoints_aside(tmp_path):
    Trainer(_cfg(tmp_path, run_name="p", max_steps=6, checkpoint_every=2, keep_checkpoints=3)).run()
    ckpts = tmp_path / "p" / "checkpoints"
    Trainer(_cfg(tmp_path, resume=str(ckpts / "step-00000002"), max_steps=3, checkpoint_every=2,
                 keep_checkpoints=2)).run()
    assert sorted(p.name for p in ckpts.iterdir()) == ["abandoned-after-step-00000002", "step-00000002",
                                                       "step-00000003"]
    assert sorted(p.name for p in (ckpts / "abandoned-after-step-00000002").iterdir()) == [
        "step-00000004", "step-00000006"]
    assert latest_checkpoint(tmp_path / "p") == ckpts / "step-00000003"
    export_run(tmp_path / "p", tmp_path / "exp")
    assert json.loads((tmp_path / "exp" / "aqsgd-export.json").read_text())["checkpoint"] == "step-00000003"
    summary = Trainer(_cfg(tmp_path, resume=str(tmp_path / "p"), max_steps=4, checkpoint_every=2)).run()
    rows = [json.loads(r) for r in (tmp_path / "p" / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 4 and [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3, 4]


def test_pruning_never_deletes_the_checkpoint_just_written(tmp_path):
    from aqsgd.train.checkpoint.write import _prune

    for step in (3, 4, 6):
        (tmp_path / f"step-{step:08d}").mkdir()
        (tmp_path / f"step-{step:08d}" / "COMPLETE").write_text("{}")
    _prune(tmp_path, 2, tmp_path / "step-00000003")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003", "step-00000004", "step-00000006"]


@pytest.mark.parametrize("changed", [{"hidden_size": 32}, {"vocab_size": 64}])
def test_resume_with_another_model_shape_is_refused_before_loading(tmp_path, changed):
    Trainer(_cfg(tmp_path, run_name="r", max_steps=2, checkpoint_every=2)).run()
    with pytest.raises(CheckpointError, match=f"{next(iter(changed))}=.*must match"):
        Trainer(_cfg(tmp_path, resume=str(tmp_path / "r"), **changed)).run()


def test_resume_with_another_data_split_is_refused(tmp_path, tokenizer_dir):
    folder = _save_model(tmp_path / "qwen2", tokenizer_dir, "qwen2", "AutoModelForCausalLM")
    text = tmp_path / "notes.txt"
    text.write_text("\n".join(_sentences(80, 1)) + "\n", encoding="utf-8")
    common = dict(task=None, model=str(folder), train_file=str(text), max_length=16, max_train_samples=None,
                  max_eval_samples=None)
    Trainer(_cfg(tmp_path, run_name="r", max_steps=2, checkpoint_every=2, **common)).run()
    with pytest.raises(CheckpointError, match="eval_split=0.1 .this run: 0.3.*must match"):
        Trainer(_cfg(tmp_path, resume=str(tmp_path / "r"), eval_split=0.3, **common)).run()


# -- LoRA: the base it adapts, its settings ------------------------------------------------------------------
def test_a_lora_run_refuses_a_changed_base_on_resume_eval_and_export(tmp_path, tokenizer_dir, capsys):
    torch.manual_seed(0)
    folder = _save_model(tmp_path / "qwen2", tokenizer_dir, "qwen2", "AutoModelForCausalLM")
    text = tmp_path / "notes.txt"
    text.write_text("\n".join(_sentences(80, 1)) + "\n", encoding="utf-8")
    common = dict(task=None, model=str(folder), train_file=str(text), max_length=16, max_train_samples=None,
                  max_eval_samples=None, lora=True, warmup_epochs=0)
    Trainer(_cfg(tmp_path, run_name="r", max_steps=2, checkpoint_every=2, **common)).run()
    torch.manual_seed(1)
    _save_model(folder, tokenizer_dir, "qwen2", "AutoModelForCausalLM")  # the base saved again, new weights
    with pytest.raises(WeightsError, match=f"the base model {folder} changed since the run was trained"):
        Trainer(_cfg(tmp_path, resume=str(tmp_path / "r"), max_steps=4, **common)).run()
    for argv in (["eval", str(tmp_path / "r")],
                 ["export", str(tmp_path / "r"), "--out", str(tmp_path / "exp")]):
        assert f"the base model {folder} changed since the run was trained" in _one_line(capsys, argv)
    assert not (tmp_path / "exp").exists()


@pytest.mark.parametrize("option,value", [("lora_rank", 16), ("lora_targets", "q_proj"), ("lora_alpha", 8.0)])
def test_lora_settings_without_lora_are_refused(option, value):
    with pytest.raises(SpecError, match=f"--{option.replace('_', '-')}: .* add --lora"):
        TrainConfig.of(**{option: value}).validate()


def test_a_lora_rank_above_the_layers_is_refused(tmp_path):
    with pytest.raises(SpecError) as e:
        Trainer(_cfg(tmp_path, run_name="r", lora=True, lora_rank=200_000))
    assert "--lora-rank 200000: larger than the smallest layer it adapts" in str(e.value)
    assert "(model.layers.0.self_attn.k_proj: 32 x 64)" in str(e.value) and "use at most 32" in str(e.value)


# -- checkpoints by time; what a run states at its start -----------------------------------------------------
def test_checkpoints_come_by_time_as_well(tmp_path, monkeypatch):
    """``--checkpoint-minutes`` (default 10): a checkpoint after the first step that ends that long after the
    last one, so that an interruption loses minutes, not an epoch."""
    import aqsgd.train.trainer as trainer_mod

    assert TrainConfig().run.checkpoint_minutes == 10
    clock = [0.0]
    monkeypatch.setattr(trainer_mod.time, "monotonic", lambda: clock[0])
    trainer = Trainer(_cfg(tmp_path, run_name="t", epochs=2, checkpoint_minutes=5, eval_every=0,
                           keep_checkpoints=9))

    def tick(t, step):  # every step takes 3 minutes of the clock
        clock[0] += 180.0

    trainer.on_step.append(tick)
    trainer.run(stop_at=5)  # 3 steps an epoch
    done = sorted(p.name for p in (tmp_path / "t" / "checkpoints").iterdir())
    # 2: 6 minutes in; 3: the epoch's end (3 minutes later); 5: 6 minutes after that
    assert done == ["step-00000002", "step-00000003", "step-00000005"]
    with pytest.raises(SpecError, match="--checkpoint-minutes: must be >= 0"):
        _cfg(tmp_path, checkpoint_minutes=-1).validate()


def test_the_caches_memory_is_stated_when_the_first_step_makes_them(tmp_path, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="aqsgd.train.trainer"):
        Trainer(_cfg(tmp_path, run_name="m", max_steps=2, stages=3)).run()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("AQ-SGD caches")]
    # 2 boundaries x 2 sides x 24 samples x 12 tokens x 64 values x 2 bytes (fp16), and each side's mask
    assert said == ["AQ-SGD caches: 0.1 MB in memory (4 boundary sides x 24 samples x 12 x 64 values); "
                    "--cache disk keeps them on disk"]


def test_an_adapter_names_its_base_as_the_run_did(tmp_path, tokenizer_dir):
    folder = _save_model(tmp_path / "qwen2", tokenizer_dir, "qwen2", "AutoModelForCausalLM")
    text = tmp_path / "notes.txt"
    text.write_text("\n".join(_sentences(80, 1)) + "\n", encoding="utf-8")
    Trainer(_cfg(tmp_path, run_name="r", max_steps=2, task=None, model=str(folder), train_file=str(text),
                 max_length=16, max_train_samples=None, max_eval_samples=None, lora=True)).run()
    export_run(tmp_path / "r", tmp_path / "adapter", lora="adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(folder.resolve())
    marker = json.loads((tmp_path / "adapter" / "aqsgd-export.json").read_text())
    assert marker["base_model"] == str(folder.resolve()) and len(marker["base_sha256"]) == 64
