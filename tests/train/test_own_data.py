"""Fine-tuning a model chosen by folder on the user's own files, through ``aqsgd train``: tiny random models
of several families saved with ``save_pretrained`` next to a small tokenizer trained offline."""

from __future__ import annotations

import csv
import json
import random

import pytest

from aqsgd.cli import main

_WORDS = ("the cat dog sat ran on a mat big small red blue fast slow house tree river stone bird fish sun "
          "moon light dark old new green").split()


def _sentences(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 14))) for _ in range(n)]


def _save_model(folder, tokenizer_dir, model_type: str, auto: str, **config):
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    from aqsgd.models import family_for, get_family

    task = "causal-lm" if auto == "AutoModelForCausalLM" else "sequence-classification"
    tiny = get_family(family_for(model_type, task)).tiny_config(layers=4, hidden=32, vocab=128, seq_len=32)
    tiny.update(config)
    tiny.pop("model_type", None)
    model = getattr(transformers, auto).from_config(AutoConfig.for_model(model_type, **tiny))
    model.save_pretrained(str(folder))
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(folder))
    return folder


def _train(tmp_path, *args: str) -> dict:
    argv = ["train", *args, "--stages", "2", "--micro-batches", "2", "--micro-batch-size", "4", "--epochs",
            "2", "--max-length", "16", "--lr", "1e-3", "--output-dir", str(tmp_path / "runs"), "--run-name",
            "run", "--cache-dir", str(tmp_path / "cache"), "--no-progress", "--no-tensorboard"]
    assert main(argv) == 0
    return json.loads((tmp_path / "runs" / "run" / "summary.json").read_text())


@pytest.mark.parametrize("model_type", ["qwen2", "mistral"])
def test_causal_lm_folder_on_a_txt_file(tmp_path, tokenizer_dir, model_type):
    folder = _save_model(tmp_path / model_type, tokenizer_dir, model_type, "AutoModelForCausalLM")
    text = tmp_path / "notes.txt"
    text.write_text("\n".join(_sentences(120, 1)) + "\n", encoding="utf-8")
    summary = _train(tmp_path, "--model", str(folder), "--train-file", str(text))
    ppl = summary["eval"]["uncompressed"]["perplexity"]
    assert summary["main_metric"] == "perplexity" and 1 < ppl < 200, summary["eval"]
    assert summary["task"] == "notes" and summary["steps"] > 0


def test_deberta_classifier_on_csv_files(tmp_path, tokenizer_dir):
    folder = _save_model(tmp_path / "deberta", tokenizer_dir, "deberta-v2",
                         "AutoModelForSequenceClassification")
    for name, n, seed in (("train.csv", 96, 2), ("dev.csv", 24, 3)):
        with open(tmp_path / name, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["sentence", "topic"])
            for s in _sentences(n, seed):
                w.writerow([s, "animals" if ("cat" in s.split() or "dog" in s.split()) else "other"])
    summary = _train(tmp_path, "--model", str(folder), "--train-file", str(tmp_path / "train.csv"),
                     "--eval-file", str(tmp_path / "dev.csv"), "--text-column", "sentence",
                     "--label-column", "topic")
    assert summary["main_metric"] == "accuracy" and 0 <= summary["eval"]["uncompressed"]["accuracy"] <= 1
    data = json.loads((tmp_path / "runs" / "run" / "data.json").read_text())
    assert data["label_names"] == ["animals", "other"]


def test_resume_refuses_a_changed_training_file(tmp_path, tokenizer_dir, capsys):
    folder = _save_model(tmp_path / "qwen2", tokenizer_dir, "qwen2", "AutoModelForCausalLM")
    text = tmp_path / "notes.txt"
    text.write_text("\n".join(_sentences(80, 1)) + "\n", encoding="utf-8")
    _train(tmp_path, "--model", str(folder), "--train-file", str(text), "--checkpoint-every", "2",
           "--max-steps", "2")
    text.write_text("\n".join(_sentences(80, 9)) + "\n", encoding="utf-8")
    argv = ["train", "--model", str(folder), "--train-file", str(text), "--stages", "2", "--micro-batches",
            "2", "--micro-batch-size", "4", "--max-length", "16", "--cache-dir", str(tmp_path / "cache"),
            "--resume", str(tmp_path / "runs" / "run"), "--no-progress", "--no-tensorboard"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "notes.txt changed since the checkpoint" in err


def test_unsupported_family_and_folder_errors(tmp_path, tokenizer_dir, capsys):
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"model_type": "t5"}))
    text = tmp_path / "a.txt"
    text.write_text("\n".join(_sentences(40, 1)), encoding="utf-8")
    argv = ["train", "--model", str(odd), "--train-file", str(text), "--cache-dir", str(tmp_path / "cache")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "t5" in err and "qwen2" in err and "llama" in err
    assert main(["train", "--model", str(tmp_path / "missing" / "x"), "--train-file", str(text)]) == 2
    assert "no such folder" in capsys.readouterr().err
    empty = tmp_path / "no-tokenizer"
    _save_model(empty, tokenizer_dir, "qwen2", "AutoModelForCausalLM")
    for f in empty.glob("*token*"):
        f.unlink()
    assert main(["train", "--model", str(empty), "--train-file", str(text), "--cache-dir",
                 str(tmp_path / "c")]) == 2
    assert "no tokenizer" in capsys.readouterr().err


def test_models_command_lists_the_families(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for model_type in ("llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3", "olmo2", "gpt2", "gpt_neox",
                       "bert", "roberta", "deberta-v2", "distilbert"):
        assert model_type in out, model_type


@pytest.mark.slow
def test_deberta_distributed_equals_local(tmp_path, tokenizer_dir):
    """DeBERTa's relative-position table is held by every stage (a tie across all three): the distributed run
    sums its gradient over the stages exactly as the local one does."""
    folder = _save_model(tmp_path / "deberta", tokenizer_dir, "deberta-v2",
                         "AutoModelForSequenceClassification")
    data = tmp_path / "train.jsonl"
    rows = [{"text": s, "label": int("cat" in s.split())} for s in _sentences(64, 5)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    common = ["--model", str(folder), "--train-file", str(data), "--stages", "3", "--micro-batches", "2",
              "--micro-batch-size", "4", "--epochs", "2", "--max-length", "16", "--dropout", "0",
              "--output-dir", str(tmp_path / "runs"), "--cache-dir", str(tmp_path / "cache"), "--no-progress",
              "--no-tensorboard", "--checkpoint-every", "0", "--device", "cpu"]  # fp32: equal up to rounding
    assert main(["train", *common, "--run-name", "local"]) == 0
    assert main(["train", *common, "--run-name", "dist", "--runtime", "distributed", "--timeout", "120"]) == 0

    def losses(name):
        rows = [json.loads(x) for x in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in rows if r["kind"] == "train"]

    assert len(losses("dist")) == len(losses("local")) == 16  # 58 training rows of 64, 8 per pass, 2 epochs
    assert losses("dist") == pytest.approx(losses("local"), rel=1e-4)


def _exported_loss_matches(run, auto_class: str) -> None:
    """``aqsgd export`` of the run loads with ``from_pretrained`` and its loss on the run's evaluation data
    (as the run built them) equals the run's final uncompressed evaluation loss."""
    import torch
    import transformers

    from aqsgd.train.config import TrainConfig, flatten_config
    from aqsgd.train.tasks import setup_task

    out = run.parent / f"{run.name}-exported"
    assert main(["export", str(run), "--out", str(out)]) == 0
    model = getattr(transformers, auto_class).from_pretrained(str(out), attn_implementation="eager").eval()
    from aqsgd.comm.device import resolve_device
    from aqsgd.train.build import compute_dtype

    settings = flatten_config(json.loads((run / "config.json").read_text()))
    cfg = TrainConfig.from_flat(settings)
    evals = setup_task(cfg).eval
    # evaluated as the run evaluated: on its device, under bf16 autocast where it used that (a GPU's default)
    device = resolve_device(cfg.pipeline.device)
    bf16 = compute_dtype(cfg.optim.dtype, device) == "bf16"
    batch = {k: torch.stack([evals[i][k] for i in range(len(evals))]).to(device) for k in evals[0]
             if k != "sample_id"}
    with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=bf16):
        loss = float(model.to(device)(**batch).loss)
    expected = json.loads((run / "summary.json").read_text())["eval"]["uncompressed"]["loss"]
    # fp32: the same sums in another order. bf16: a loss rounded to bf16's 8 bits (2**-8 relative at most)
    assert loss == pytest.approx(expected, rel=4e-3 if bf16 else 1e-5, abs=1e-6)


def _all_types(task_kind: str) -> list[str]:
    from aqsgd.models import supported_model_types

    return supported_model_types(task_kind)


@pytest.mark.parametrize("model_type", _all_types("causal-lm"))
def test_every_causal_lm_family_trains_from_a_folder(tmp_path, tokenizer_dir, model_type):
    """A short `aqsgd train` over a tiny random model of each family, saved as a folder, on a .jsonl file; its
    export is the model the run evaluated."""
    folder = _save_model(tmp_path / "m", tokenizer_dir, model_type, "AutoModelForCausalLM")
    data = tmp_path / "docs.jsonl"
    data.write_text("\n".join(json.dumps({"text": s}) for s in _sentences(60, 4)) + "\n", encoding="utf-8")
    summary = _train(tmp_path, "--model", str(folder), "--train-file", str(data), "--max-steps", "3")
    assert summary["steps"] == 3 and summary["main_metric"] == "perplexity"
    assert 1 < summary["eval"]["compressed"]["perplexity"] < 1e4
    _exported_loss_matches(tmp_path / "runs" / "run", "AutoModelForCausalLM")


@pytest.mark.parametrize("model_type", _all_types("sequence-classification"))
def test_every_classifier_family_trains_from_a_folder(tmp_path, tokenizer_dir, model_type):
    """The same for each encoder family, on sentence pairs with integer labels in a .tsv file."""
    folder = _save_model(tmp_path / "m", tokenizer_dir, model_type, "AutoModelForSequenceClassification")
    data = tmp_path / "pairs.tsv"
    lines = ["first\tsecond\tlabel"] + [f"{a}\t{b}\t{int(len(a) > len(b))}"
                                        for a, b in zip(_sentences(60, 6), _sentences(60, 7))]
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    summary = _train(tmp_path, "--model", str(folder), "--train-file", str(data), "--text-column", "first",
                     "--text-pair-column", "second", "--max-steps", "3")
    assert summary["steps"] == 3 and summary["main_metric"] == "accuracy"
    assert 0 <= summary["eval"]["compressed"]["accuracy"] <= 1
    _exported_loss_matches(tmp_path / "runs" / "run", "AutoModelForSequenceClassification")


def test_data_option_errors_are_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cases = [
        (["--dataset", "stanfordnlp/imdb"], "--dataset stanfordnlp/imdb loads from the Hugging Face hub, "
                                            "which HF_HUB_OFFLINE disables"),
        (["--train-file", str(tmp_path / "none.csv")], f"--train-file {tmp_path / 'none.csv'}: no such file"),
        (["--train-file", "a.csv", "--task", "wiki"], "--task: 'wiki' and --train-file both name the data"),
        (["--train-file", "a.csv", "--dataset", "x"], "--dataset: give either --train-file or --dataset"),
        (["--eval-file", "a.csv"], "--eval-file: needs --train-file"),
        (["--model", "Qwen/Qwen2.5-0.5B", "--task", "wiki"], "--model Qwen/Qwen2.5-0.5B: the Hugging Face "
                                                             "hub is offline (HF_HUB_OFFLINE=1)"),
        (["--train-file", "a.csv", "--eval-split", "0"], "--eval-split: must be in (0, 1)"),
    ]
    for args, message in cases:
        assert main(["train", *args, "--cache-dir", str(tmp_path / "cache")]) == 2, args
        err = capsys.readouterr().err.strip()
        assert err.startswith("aqsgd: error: ") and "\n" not in err, err
        assert message in err, (args, err)


def test_builtin_text_task_uses_the_models_own_tokenizer(tmp_path, tokenizer_dir):
    """bbc with a classifier folder is tokenized with that folder's tokenizer (not MiniLM's), and keeps the
    built-in task's sample caps."""
    from transformers import AutoTokenizer

    from aqsgd.data import locate
    from aqsgd.train.config import TrainConfig
    from aqsgd.train.tasks import setup_task

    if locate("bbc") is None:
        pytest.skip("source 'bbc' is not prepared; run `aqsgd data prepare bbc`")
    folder = _save_model(tmp_path / "roberta", tokenizer_dir, "roberta", "AutoModelForSequenceClassification")
    # the prepared source, linked (preparing it again in a new cache would need the package index)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "bbc").symlink_to(locate("bbc"), target_is_directory=True)
    setup = setup_task(TrainConfig.of(model=str(folder), cache_dir=str(tmp_path / "cache"), max_length=16))
    assert setup.train.info["vocab_size"] == len(AutoTokenizer.from_pretrained(str(folder)))
    assert len(setup.train) == 600 and len(setup.eval) == 200
    assert setup.recipe.kind == "bert-cls" and setup.recipe.config["num_labels"] == 5


def test_resume_from_the_run_alone_continues_exactly(tmp_path, tokenizer_dir, capsys):
    """``aqsgd train --resume RUN`` with nothing else takes the run's own settings (its model folder, its
    file, its pipeline and compression), and continues with the losses of an uninterrupted run; an option
    given beside it that may change (``--epochs``) is taken, one that may not is refused naming it."""
    from aqsgd.cli import build_parser
    from aqsgd.cli.train import build_config
    from aqsgd.train.trainer import Trainer
    folder = _save_model(tmp_path / "qwen2", tokenizer_dir, "qwen2", "AutoModelForCausalLM")
    text = tmp_path / "notes.txt"
    text.write_text("\n".join(_sentences(80, 1)) + "\n", encoding="utf-8")
    common = ["--model", str(folder), "--train-file", str(text), "--stages", "2", "--micro-batches", "2",
              "--micro-batch-size", "4", "--max-length", "16", "--cache-dir", str(tmp_path / "cache"),
              "--forward", "delta:q2", "--backward", "q4", "--warmup-epochs", "0", "--epochs", "2",
              "--checkpoint-every", "3", "--lr", "3e-3", "--no-progress", "--no-tensorboard",
              "--output-dir", str(tmp_path / "runs")]
    assert main(["train", *common, "--run-name", "whole"]) == 0
    # the same command, stopped after step 3 (as by a crash: the run's checkpoint of step 3 is its last)
    Trainer(build_config(build_parser().parse_args(["train", *common, "--run-name", "part"]))).run(stop_at=3)
    part = tmp_path / "runs" / "part"
    assert main(["train", "--resume", str(part)]) == 0

    def losses(run):
        rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}

    whole, resumed = losses(tmp_path / "runs" / "whole"), losses(part)
    assert len(whole) > 4 and resumed == whole
    assert main(["train", "--resume", str(part), "--forward", "delta:q4"]) == 2  # must match the checkpoint
    assert "forward='delta:q2' (this run: 'delta:q4')" in capsys.readouterr().err
    # a setting that may change is taken, with a warning: two more epochs
    assert main(["train", "--resume", str(part), "--epochs", "3"]) == 0
    assert max(losses(part)) > max(whole)


def test_resume_of_a_folder_without_checkpoints_is_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["train", "--resume", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"aqsgd: error: --resume: no complete checkpoint under {tmp_path / 'empty'}"


def test_token_ids_beyond_the_embedding_name_the_fix(tmp_path, tokenizer_dir, capsys):
    """The model's own tokenizer with tokens added but no rows for them: ids the data use beyond the embedding
    are refused naming the id, the sizes and the fix; an added token the data never use trains."""
    from transformers import AutoTokenizer

    text = tmp_path / "notes.txt"
    text.write_text("\n".join(_sentences(80, 1)) + "\n", encoding="utf-8")
    vocab = len(AutoTokenizer.from_pretrained(str(tokenizer_dir)))
    folder = _save_model(tmp_path / "small", tokenizer_dir, "qwen2", "AutoModelForCausalLM", vocab_size=vocab)
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.add_tokens(["zebra"])  # one more token than the embedding has rows
    tok.save_pretrained(str(folder))
    argv = ["train", "--model", str(folder), "--train-file", str(text), "--stages", "2", "--max-length", "16",
            "--max-steps", "1", "--cache-dir", str(tmp_path / "cache"), "--output-dir",
            str(tmp_path / "runs"),
            "--no-progress", "--no-tensorboard"]
    assert main([*argv, "--run-name", "fits"]) == 0  # the data never use "zebra"
    text.write_text("\n".join(s + " zebra" for s in _sentences(80, 1)) + "\n", encoding="utf-8")
    assert main([*argv, "--run-name", "beyond"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"the data hold token id {vocab}, but its embedding has only {vocab} rows" in err
    assert f"(its tokenizer has {vocab + 1})" in err and "resize_token_embeddings" in err


def test_txt_unit_is_recorded_and_a_resume_must_read_the_file_the_same_way(tmp_path, tokenizer_dir, capsys):
    folder = _save_model(tmp_path / "qwen2", tokenizer_dir, "qwen2", "AutoModelForCausalLM")
    text = tmp_path / "book.txt"
    paragraphs = ["\n".join(_sentences(3, seed)) for seed in range(40)]  # hard-wrapped: 3 lines each
    text.write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    _train(tmp_path, "--model", str(folder), "--train-file", str(text), "--txt-unit", "paragraph",
           "--checkpoint-every", "2", "--max-steps", "2")
    assert json.loads((tmp_path / "runs" / "run" / "data.json").read_text())["txt_unit"] == "paragraph"
    argv = ["train", "--resume", str(tmp_path / "runs" / "run"), "--txt-unit", "line", "--max-steps", "3"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "txt_unit='paragraph' (this run: 'line')" in err
