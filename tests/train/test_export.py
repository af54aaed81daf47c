"""``aqsgd export``: a trained run becomes a Hugging Face folder that ``from_pretrained`` loads and whose
outputs are the pipeline's."""

from __future__ import annotations

import json

import pytest
import torch
from test_own_data import _save_model, _sentences

from aqsgd.cli import main


def _eval_loss(run) -> float:
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "eval"][-1]["uncompressed"]["loss"]


def _common(tmp_path, folder, text, *extra):
    return ["train", "--model", str(folder), "--train-file", str(text), "--stages", "2", "--micro-batches",
            "2", "--micro-batch-size", "4", "--max-length", "16", "--cache-dir", str(tmp_path / "cache"),
            "--output-dir", str(tmp_path / "runs"), "--warmup-epochs", "0", "--epochs", "2", "--lr", "1e-2",
            "--no-progress", "--no-tensorboard", *extra]


@pytest.mark.parametrize("runtime", ["local", "distributed"])
@pytest.mark.slow
def test_export_of_a_causal_lm_loads_and_gives_the_runs_evaluation_loss(tmp_path, tokenizer_dir, runtime):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from aqsgd.data import lm_chunks

    folder = _save_model(tmp_path / "qwen2", tokenizer_dir, "qwen2", "AutoModelForCausalLM")
    text, held = tmp_path / "notes.txt", tmp_path / "held.txt"
    text.write_text("\n".join(_sentences(80, 1)) + "\n", encoding="utf-8")
    held.write_text("\n".join(_sentences(30, 2)) + "\n", encoding="utf-8")
    assert main(_common(tmp_path, folder, text, "--eval-file", str(held), "--runtime", runtime,
                        "--run-name", "r")) == 0
    run, out = tmp_path / "runs" / "r", tmp_path / "exported"
    assert main(["export", str(run), "--out", str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(str(out))
    before = AutoModelForCausalLM.from_pretrained(str(folder))
    assert not torch.equal(model.model.embed_tokens.weight, before.model.embed_tokens.weight)  # trained
    # the evaluation data as the run built them (its own tokenizer, 16-token chunks): every chunk has as many
    # predicted tokens, so the mean over chunks is the run's loss
    chunks = lm_chunks([s for s in held.read_text().splitlines() if s.strip()], tok, 16)
    with torch.no_grad():
        losses = [float(model(input_ids=chunks[i]["input_ids"][None], labels=chunks[i]["labels"][None]).loss)
                  for i in range(len(chunks))]
    # fp32 both ways; the pipeline and the full model sum in another order (stated tolerance: 1e-5 relative)
    assert sum(losses) / len(losses) == pytest.approx(_eval_loss(run), rel=1e-5)


def test_export_of_a_classifier_keeps_the_label_names(tmp_path, tokenizer_dir):
    from transformers import AutoModelForSequenceClassification

    folder = _save_model(tmp_path / "bert", tokenizer_dir, "bert", "AutoModelForSequenceClassification")
    rows = tmp_path / "reviews.csv"
    sentences = _sentences(60, 3)
    rows.write_text("text,label\n" + "\n".join(f"{s},{'good' if 'cat' in s else 'bad'}" for s in sentences),
                    encoding="utf-8")
    assert main(_common(tmp_path, folder, rows, "--run-name", "c")) == 0
    out = tmp_path / "cls"
    assert main(["export", str(tmp_path / "runs" / "c"), "--out", str(out), "--dtype", "bf16"]) == 0
    model = AutoModelForSequenceClassification.from_pretrained(str(out))
    assert model.config.id2label == {0: "bad", 1: "good"}
    assert model.classifier.weight.dtype == torch.bfloat16


def test_export_errors_are_one_line(tmp_path, tokenizer_dir, capsys):
    folder = _save_model(tmp_path / "qwen2", tokenizer_dir, "qwen2", "AutoModelForCausalLM")
    text = tmp_path / "notes.txt"
    text.write_text("\n".join(_sentences(80, 1)) + "\n", encoding="utf-8")
    assert main(_common(tmp_path, folder, text, "--run-name", "r", "--max-steps", "2")) == 0
    run, out = tmp_path / "runs" / "r", tmp_path / "out"
    (out / "mine").mkdir(parents=True)
    capsys.readouterr()

    def error(*argv) -> str:
        assert main(["export", *argv]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        return lines[0]

    assert "exists and is not empty" in error(str(run), "--out", str(out))
    assert "replaces only an earlier aqsgd export" in error(str(run), "--out", str(out), "--overwrite")
    assert "has no complete checkpoint of that step (it has step-00000002)" in error(
        str(run), "--out", str(tmp_path / "x"), "--checkpoint", "7")
    assert "no complete checkpoint to export" in error(str(tmp_path), "--out", str(tmp_path / "x"))
    (run / "checkpoints" / "step-00000002" / "stage1" / "model.safetensors").write_bytes(b"garbage")
    assert "stage1/model.safetensors" in error(str(run), "--out", str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()


def test_eval_of_a_checkpoint_gives_the_runs_numbers_and_takes_another_file(tmp_path, tokenizer_dir, capsys):
    """``aqsgd eval RUN`` rebuilds the run's pipeline in this process and gives its final evaluation (both
    ways, the same numbers, whichever runtime trained it); ``--eval-file`` evaluates other text; the run
    directory is left as it was."""
    folder = _save_model(tmp_path / "qwen2", tokenizer_dir, "qwen2", "AutoModelForCausalLM")
    text, held, other = (tmp_path / f"{n}.txt" for n in ("notes", "held", "other"))
    text.write_text("\n".join(_sentences(80, 1)) + "\n", encoding="utf-8")
    held.write_text("\n".join(_sentences(30, 2)) + "\n", encoding="utf-8")
    other.write_text("\n".join(_sentences(30, 5)) + "\n", encoding="utf-8")
    assert main(_common(tmp_path, folder, text, "--eval-file", str(held), "--runtime", "distributed",
                        "--forward", "delta:q2:l2", "--run-name", "r")) == 0
    run = tmp_path / "runs" / "r"
    before = sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*"))
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in rows if r["kind"] == "eval"][-1]
    assert main(["eval", str(run), "--out", str(tmp_path / "e.json")]) == 0
    got = json.loads((tmp_path / "e.json").read_text())
    for way in ("compressed", "uncompressed"):
        assert got["eval"][way]["loss"] == pytest.approx(final[way]["loss"], rel=1e-6), way
    assert got["eval"]["compressed"]["loss"] != got["eval"]["uncompressed"]["loss"]
    assert main(["eval", str(run), "--eval-file", str(other), "--out", str(tmp_path / "o.json")]) == 0
    assert json.loads((tmp_path / "o.json").read_text())["eval"]["uncompressed"]["loss"] != pytest.approx(
        final["uncompressed"]["loss"], rel=1e-3)
    assert sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*")) == before


def test_a_run_keeps_a_copy_of_its_chat_template(tmp_path):
    """The --chat-template file a run names is copied into the run directory when it starts (what export and
    generate then apply, wherever the file goes); a resumed run whose file is gone keeps its copy; a run
    with no copy and no file is one line naming the option."""
    from types import SimpleNamespace

    from aqsgd.errors import SpecError
    from aqsgd.train.export import CHAT_TEMPLATE_FILE, describe_run, run_chat_template

    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}", encoding="utf-8")
    recipe = SimpleNamespace(to_dict=lambda: {"kind": "qwen2"})
    task = SimpleNamespace(data_info=None, recipe=recipe, kind="causal-lm", name="chat", model_folder=None,
                           model_name="m", base_sha256=None)
    cfg = SimpleNamespace(to_dict=lambda: {"task": {"chat_template": str(template)}})
    run = tmp_path / "run"
    run.mkdir()
    describe_run(run, cfg, task)
    assert (run / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8") == template.read_text(encoding="utf-8")
    settings = {"chat_template": str(template)}
    text = template.read_text(encoding="utf-8")
    template.unlink()
    describe_run(run, cfg, task)  # (resumed)
    assert run_chat_template(run, settings) == text
    (run / CHAT_TEMPLATE_FILE).unlink()
    with pytest.raises(SpecError, match=f"--chat-template {template}, cannot be read") as e:
        run_chat_template(run, settings)
    assert "\n" not in str(e.value)
    with pytest.raises(SpecError, match=f"--chat-template {template}: cannot read it"):
        describe_run(run, cfg, task)
    assert run_chat_template(run, {}) is None  # none named: the tokenizer's own applies
