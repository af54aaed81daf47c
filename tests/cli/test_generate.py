"""``aqsgd generate``: a run's model, and its export's, answer prompts as plain transformers does with the
exported folder; a chat template is applied where there is one (a file, the run's, the tokenizer's) and
lands in the export; bad input is one line.

The runs are tiny qwen2 models trained for a few steps on word salad: such a model's likeliest next token is
soon the document separator, so the model folder's generation settings suppress the special tokens (and
stop after 6 tokens): the answers are words, and these settings being the model folder's is itself what
the run and its export must keep."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from aqsgd.cli import main

_WORDS = ("the cat dog sat ran on a mat big small red blue fast slow house tree river stone bird fish sun "
          "moon light dark old new green").split()
_SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[EOS]"]
PROMPTS = ["the cat sat on", "green fish"]
# renders every turn as "role content " and the generation prompt as "bird "; refuses a role it does not know
TEMPLATE = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant', 'system'] %}"
            "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
            "{{ m['role'] }} {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}bird {% endif %}")
CONVERSATION = [{"role": "user", "content": "green fish"}, {"role": "assistant", "content": "sun"},
                {"role": "user", "content": "the dog"}]


def _sentences(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 14))) for _ in range(n)]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    """A tiny qwen2 causal LM with a ~100-token BPE tokenizer (no chat template) trained here, and
    generation settings of its own (``generation_config.json``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

    from aqsgd.models import family_for, get_family

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(_sentences(200, 0), trainers.BpeTrainer(vocab_size=100, special_tokens=_SPECIAL))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   eos_token="[EOS]")
    folder = tmp_path_factory.mktemp("qwen2")
    family = get_family(family_for("qwen2", "causal-lm"))
    tiny = family.tiny_config(layers=4, hidden=32, vocab=128, seq_len=32)
    tiny.pop("model_type", None)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **tiny))
    special = [fast.convert_tokens_to_ids(t) for t in _SPECIAL]
    model.generation_config = GenerationConfig(**{**model.generation_config.to_diff_dict(),
                                                  "max_new_tokens": 6, "suppress_tokens": special})
    model.save_pretrained(str(folder))
    fast.save_pretrained(str(folder))
    return folder


def _train(model: Path, out: Path, *extra: str) -> Path:
    text = out / "notes.txt"
    text.write_text("\n".join(_sentences(80, 1)) + "\n", encoding="utf-8")
    assert main(["train", "--model", str(model), "--train-file", str(text), "--stages", "2",
                 "--micro-batches", "2", "--micro-batch-size", "4", "--max-length", "16", "--cache-dir",
                 str(out / "cache"),
                 "--output-dir", str(out / "runs"), "--warmup-epochs", "0", "--epochs", "1", "--lr", "1e-2",
                 "--no-progress", "--no-tensorboard", "--run-name", "r", *extra]) == 0
    return out / "runs" / "r"


def _export(run: Path, out: Path, *extra: str) -> Path:
    assert main(["export", str(run), "--out", str(out), *extra]) == 0
    return out


@pytest.fixture(scope="module")
def full_run(model_folder, tmp_path_factory) -> Path:
    return _train(model_folder, tmp_path_factory.mktemp("full"))


@pytest.fixture(scope="module")
def full_export(full_run, tmp_path_factory) -> Path:
    return _export(full_run, tmp_path_factory.mktemp("export") / "out")


def _plain(folder: Path, text: str | None = None, *, messages=None, template=None, seed=None,
           **settings) -> str:
    """The answer plain transformers gives with the model folder ``folder``: ``text`` tokenized as
    ``tokenizer(text)``, or ``messages`` rendered with the chat template (``template``, else the tokenizer's)
    with the generation prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = AutoModelForCausalLM.from_pretrained(str(folder)), AutoTokenizer.from_pretrained(str(folder))
    if messages is None:
        ids = tok(text, return_tensors="pt").input_ids
    else:
        rendered = tok.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                           tokenize=False)
        ids = tok(rendered, add_special_tokens=False, return_tensors="pt").input_ids
    if seed is not None:
        torch.manual_seed(seed)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), **settings)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def _json(capsys, *argv: str) -> dict:
    capsys.readouterr()
    assert main(["generate", *argv, "--json", "--device", "cpu"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_run_and_its_export_answer_as_plain_transformers_does_with_the_export(full_run, full_export):
    from transformers import GenerationConfig

    from aqsgd.train.generate import generate

    # the model folder's generation settings travel with the export
    settings = GenerationConfig.from_pretrained(str(full_export))
    assert settings.max_new_tokens == 6 and len(settings.suppress_tokens) == len(_SPECIAL)
    plain = [_plain(full_export, p) for p in PROMPTS]
    assert all(plain), plain  # words (the special tokens are suppressed)
    assert generate(full_export, PROMPTS, device="cpu") == plain
    assert generate(full_run, PROMPTS, device="cpu") == plain  # (the settings from the run's model folder)


def test_the_model_answers_on_the_device(full_export, device):
    from aqsgd.train.generate import load

    generator = load(full_export, device=device.type)
    assert next(generator.model.parameters()).device == device
    assert generator.answer(PROMPTS) == [_plain(full_export, p) for p in PROMPTS]


def test_the_command_prints_each_prompt_and_its_answer(full_run, full_export, capsys):
    capsys.readouterr()
    assert main(["generate", str(full_run), "--prompt", PROMPTS[0], "--prompt", PROMPTS[1],
                 "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    answers = [_plain(full_export, p, max_new_tokens=3) for p in PROMPTS]
    head, *blocks = out.split("\n\n")
    assert head == (f"{full_run} (step-00000007): prompts given as raw text (the tokenizer has no chat "
                    "template; --chat-template FILE gives one)")
    assert blocks == [f"=== prompt {i}\n{p}\n=== answer {i}\n{a}" + ("\n" if i == 2 else "")
                      for i, (p, a) in enumerate(zip(PROMPTS, answers), 1)]
    assert answers != [_plain(full_export, p) for p in PROMPTS]  # (3 tokens, not the folder's 6)


def test_sampling_settings_and_seed_are_transformers_own(full_export, capsys):
    argv = [str(full_export), "--prompt", PROMPTS[0], "--do-sample", "--seed", "3", "--top-k", "20",
            "--temperature", "1.5", "--max-new-tokens", "8"]
    got = _json(capsys, *argv)
    assert got["settings"] == {"max_new_tokens": 8, "do_sample": True, "temperature": 1.5, "top_k": 20,
                               "seed": 3}
    assert got["chat_template"] is None and got["source"] == str(full_export)
    expected = _plain(full_export, PROMPTS[0], seed=3, do_sample=True, top_k=20, temperature=1.5,
                      max_new_tokens=8)
    assert got["results"] == [{"prompt": PROMPTS[0], "answer": expected}]
    assert _json(capsys, *argv) == got  # seeded: the same answer again


@pytest.mark.slow
def test_a_lora_run_answers_as_its_merged_and_its_adapter_exports(model_folder, tmp_path_factory):
    from aqsgd.train.generate import generate

    out = tmp_path_factory.mktemp("lora")
    run = _train(model_folder, out, "--lora", "--lora-rank", "4")
    merged, adapter = _export(run, out / "merged"), _export(run, out / "adapter", "--lora-export", "adapter")
    plain = [_plain(merged, p) for p in PROMPTS]
    assert all(plain), plain
    for source in (run, merged, adapter):
        assert generate(source, PROMPTS, device="cpu") == plain, source


def test_a_chat_template_file_renders_text_prompts_and_conversations(full_export, tmp_path, capsys):
    template, prompts = tmp_path / "chat.jinja", tmp_path / "prompts.jsonl"
    template.write_text(TEMPLATE, encoding="utf-8")
    prompts.write_text(json.dumps({"prompt": PROMPTS[0]}) + "\n\n" + json.dumps({"messages": CONVERSATION})
                       + "\n", encoding="utf-8")
    got = _json(capsys, str(full_export), "--prompts", str(prompts), "--chat-template", str(template))
    assert got["chat_template"] == f"--chat-template {template}"
    expected = [_plain(full_export, messages=[{"role": "user", "content": PROMPTS[0]}], template=TEMPLATE),
                _plain(full_export, messages=CONVERSATION, template=TEMPLATE)]
    assert [r["answer"] for r in got["results"]] == expected
    assert [r["prompt"] for r in got["results"]] == [PROMPTS[0], CONVERSATION]
    # what the model saw: the text prompt as the user's turn, and the generation prompt
    from transformers import AutoTokenizer

    from aqsgd.train.generate import load

    tok = AutoTokenizer.from_pretrained(str(full_export))
    seen = load(full_export, chat_template=template, device="cpu").encode(PROMPTS[0], 1)
    assert seen.tolist() == [tok(f"user {PROMPTS[0]} bird ", add_special_tokens=False).input_ids]
    # --no-chat-template: the text as it is
    raw = _json(capsys, str(full_export), "--prompt", PROMPTS[0], "--no-chat-template")
    assert raw["chat_template"] is None and raw["results"][0]["answer"] == _plain(full_export, PROMPTS[0])


def test_the_runs_chat_template_is_applied_and_lands_in_its_export(full_run, tmp_path, capsys):
    """A run's chat template (its copy in the run directory, written when it starts) is what generating
    from the run applies, and what its export's tokenizer holds: plain transformers applies it."""
    from transformers import AutoTokenizer

    from aqsgd.train.export import CHAT_TEMPLATE_FILE

    run = tmp_path / "run"
    shutil.copytree(full_run, run)
    (run / CHAT_TEMPLATE_FILE).write_text(TEMPLATE, encoding="utf-8")
    out = _export(run, tmp_path / "out")
    assert AutoTokenizer.from_pretrained(str(out)).chat_template == TEMPLATE
    expected = _plain(out, messages=CONVERSATION)  # (the export's own template)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": CONVERSATION}) + "\n", encoding="utf-8")
    for source in (run, out):
        got = _json(capsys, str(source), "--prompts", str(prompts))
        assert got["results"][0]["answer"] == expected, source
    assert got["chat_template"] == "the tokenizer's chat template"  # (the export's)
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", PROMPTS[0]]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        f"{run} (step-00000007): prompts given through the chat template the run was trained with, with the "
        "generation prompt added")


def _error(capsys, *argv: str) -> str:
    capsys.readouterr()
    try:
        status = main(list(argv))
    except SystemExit as e:  # (a usage error, from argparse)
        status = e.code
    assert status == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_bad_input_is_one_line(full_run, full_export, tmp_path, capsys):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("text")
    empty, blank, bad, shapeless, chat = (tmp_path / n for n in ("empty.txt", "blank.jsonl", "bad.jsonl",
                                                                   "shapeless.jsonl", "chat.jsonl"))
    empty.write_text("")
    blank.write_text("\n  \n")
    bad.write_text('{"prompt": "the cat"}\n{"prompt": \n')
    shapeless.write_text('{"text": "the cat"}\n')
    chat.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    classifier = tmp_path / "classifier"
    classifier.mkdir()
    (classifier / "config.json").write_text(json.dumps({"model_type": "bert",
                                                        "architectures": ["BertForSequenceClassification"]}))
    run, out = str(full_run), str(full_export)
    cases = [
        ((str(tmp_path / "notes"), "--prompt", "x"), "neither a run directory"),
        ((str(tmp_path / "gone"), "--prompt", "x"), "gone: no such run directory or model folder"),
        ((str(tmp_path / "notes" / "a.txt"), "--prompt", "x"), "is a file"),
        ((out, "--prompts", str(empty)), f"--prompts {empty}: holds no prompts"),
        ((out, "--prompts", str(blank)), f"--prompts {blank}: holds no prompts (one JSON object a line)"),
        ((out, "--prompts", str(bad)), f"--prompts {bad} line 2: not JSON"),
        ((out, "--prompts", str(shapeless)), 'needs a JSON object with either a "prompt"'),
        ((out,), "give --prompt TEXT or --prompts FILE"),
        ((run, "--prompts", str(chat)), "prompt 1 is a conversation (messages), and the tokenizer of "
                                        f"{run} (step-00000007) has no chat template; give one with "
                                        "--chat-template FILE"),
        ((run, "--prompts", str(chat), "--no-chat-template"), "leave --no-chat-template out"),
        ((run, "--prompt", "x", "--chat-template", str(template), "--no-chat-template"), "not allowed with"),
        ((run, "--prompt", "x", "--chat-template", str(tmp_path / "no.jinja")), "no.jinja: cannot read it"),
        ((run, "--prompt", "x", "--checkpoint", "99"), "has no complete checkpoint of that step"),
        ((out, "--prompt", "x", "--checkpoint", "7"), "is a model folder, not a run directory"),
        ((run, "--prompt", "x", "--temperature", "0.7"), "--temperature: applies to sampling only"),
        ((run, "--prompt", "x", "--top-p", "1.5"), "--top-p 1.5: must be in (0, 1]"),
        ((run, "--prompt", "x", "--max-new-tokens", "0"), "--max-new-tokens 0: must be at least 1"),
        ((str(classifier), "--prompt", "x"), "BertForSequenceClassification, not a causal language model"),
    ]
    for argv, needle in cases:
        assert needle in _error(capsys, "generate", *argv), argv
    tool = json.dumps({"messages": [{"role": "tool", "content": "x"}]})
    chat.write_text(tool + "\n")
    line = _error(capsys, "generate", run, "--prompts", str(chat), "--chat-template", str(template))
    assert f"prompt 1: --chat-template {template} refused it" in line and "unknown role tool" in line


def test_a_runs_chat_template_gone_without_a_copy_is_one_line(full_run, tmp_path, capsys, monkeypatch):
    """A run whose config names a --chat-template file that is gone, and that holds no copy of it: generate
    and export both refuse in one line naming the file (they would otherwise apply another template)."""
    import aqsgd.train.export as export

    real = export.run_model
    gone = tmp_path / "moved.jinja"

    def run_model(run, **kw):
        model, described, path = real(run, **kw)
        return model, {**described, "settings": {**described["settings"], "chat_template": str(gone)}}, path

    monkeypatch.setattr(export, "run_model", run_model)
    for argv in (["generate", str(full_run), "--prompt", "x"], ["export", str(full_run), "--out",
                                                                str(tmp_path / "out")]):
        line = _error(capsys, *argv)
        assert f"--chat-template {gone}, cannot be read" in line and "holds no copy" in line, argv
    assert not (tmp_path / "out").exists()
