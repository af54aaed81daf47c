"""The prepared-weights cache is keyed by what a model folder holds: a folder saved again in place (or another
folder of the same name) is never served the old weights; damaged weights are one line naming the file."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from aqsgd.cli import main
from aqsgd.errors import WeightsError
from aqsgd.train.config import TrainConfig
from aqsgd.train.modelfiles import model_digest
from aqsgd.train.tasks import setup_task

from test_own_data import _save_model, _sentences


def _data(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("text,label\n" + "".join(f"{s},{i % 2}\n" for i, s in enumerate(_sentences(40, 1))))
    return path


def _save(folder, tokenizer_dir, seed):
    torch.manual_seed(seed)
    return _save_model(folder, tokenizer_dir, "bert", "AutoModelForSequenceClassification")


def _cfg(tmp_path, folder, data, cache):
    return TrainConfig.of(model=str(folder), train_file=str(data), max_length=16, stages=2, micro_batches=2,
                          micro_batch_size=4, epochs=1, max_steps=1, cache_dir=str(cache),
                          output_dir=str(tmp_path / "runs"), progress=False, tensorboard=False)


def _first_loss(tmp_path, folder, data, cache, name):
    argv = ["train", "--model", str(folder), "--train-file", str(data), "--max-length", "16", "--stages", "2",
            "--micro-batches", "2", "--micro-batch-size", "4", "--epochs", "1", "--max-steps", "1",
            "--cache-dir", str(cache), "--output-dir", str(tmp_path / "runs"), "--run-name", name,
            "--no-progress", "--no-tensorboard"]
    assert main(argv) == 0
    rows = (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()
    return json.loads(rows[0])["loss"]


def test_a_folder_saved_again_in_place_trains_on_its_new_weights(tmp_path, tokenizer_dir):  # noqa: F811
    folder, data, cache = tmp_path / "my-bert", _data(tmp_path), tmp_path / "cache"
    _save(folder, tokenizer_dir, 0)
    first = _first_loss(tmp_path, folder, data, cache, "a")
    _save(folder, tokenizer_dir, 1)  # fine-tuned, say, and saved to the same path
    again = _first_loss(tmp_path, folder, data, cache, "b")
    fresh = _first_loss(tmp_path, folder, data, tmp_path / "fresh-cache", "c")
    assert again == fresh != first
    # and the cached file holds the new folder's weights (the encoder's; the head is seeded anew)
    recipe = setup_task(_cfg(tmp_path, folder, data, cache)).recipe
    saved = load_file(str(folder / "model.safetensors"))
    prepared = load_file(recipe.weights)
    key = next(k for k in saved if k.endswith("word_embeddings.weight"))
    assert prepared[key].equal(saved[key])


def test_another_folder_of_the_same_name_gets_its_own_entry(tmp_path, tokenizer_dir):  # noqa: F811
    data, cache = _data(tmp_path), tmp_path / "cache"
    one, two = (_save(tmp_path / "a" / "model", tokenizer_dir, 0),
                _save(tmp_path / "b" / "model", tokenizer_dir, 1))
    w1 = setup_task(_cfg(tmp_path, one, data, cache)).recipe.weights
    w2 = setup_task(_cfg(tmp_path, two, data, cache)).recipe.weights
    assert (w1 != w2 and os.path.basename(w1).startswith("model-")
            and os.path.basename(w2).startswith("model-"))
    assert setup_task(_cfg(tmp_path, one, data, cache)).recipe.weights == w1  # unchanged: the same entry


def test_digests_are_remembered_until_a_file_changes(tmp_path, tokenizer_dir, monkeypatch):  # noqa: F811
    folder = _save(tmp_path / "m", tokenizer_dir, 0)
    memo = tmp_path / "cache"
    first = model_digest(folder, memo)
    calls = []
    import aqsgd.train.modelfiles as modelfiles

    real = modelfiles.data_fingerprint
    monkeypatch.setattr(modelfiles, "data_fingerprint", lambda p: calls.append(p) or real(p))
    assert model_digest(folder, memo) == first and calls == []  # remembered: nothing read again
    weights = folder / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # touched, same bytes
    assert model_digest(folder, memo) == first and calls == [weights]
    _save(folder, tokenizer_dir, 1)
    assert model_digest(folder, memo) != first


def test_a_truncated_safetensors_file_is_one_line(tmp_path, tokenizer_dir):  # noqa: F811
    folder = _save(tmp_path / "m", tokenizer_dir, 0)
    weights = folder / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    with pytest.raises(WeightsError) as e:
        setup_task(_cfg(tmp_path, folder, _data(tmp_path), tmp_path / "cache"))
    text = str(e.value)
    assert "\n" not in text
    assert text.startswith(f"--model {folder}: {weights} is not a readable safetensors file (")
    assert text.endswith("it may be truncated or damaged: save the model there again")
    assert (not (tmp_path / "cache" / "weights").exists()
            or not list((tmp_path / "cache" / "weights").glob("*.safetensors")))


def test_a_rewrite_in_place_that_restores_the_modification_time_is_seen(tmp_path, tokenizer_dir):  # noqa: F811
    """``rsync --inplace -t``: new bytes in the same file (same size and inode), its modification time set
    back to the old one. Only the status-change time, which no program can set back, says it changed."""
    folder = _save(tmp_path / "m", tokenizer_dir, 0)
    memo = tmp_path / "cache"
    first = model_digest(folder, memo)
    weights = folder / "model.safetensors"
    before = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # the last byte of the last tensor: same size, other content
    with open(weights, "r+b") as f:  # in place: the same inode
        f.write(data)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = weights.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns,
                                                                before.st_ino)
    assert model_digest(folder, memo) != first
