"""Instruction and chat data: loss masks checked by hand, truncation and drop counts, the one-line errors for
bad rows and templates, the user's files in every format, text classification without padding, the offline
``instruct`` task, and the task section's options."""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from aqsgd.data import DataFileError, load_task, load_text_files, locate
from aqsgd.data.datasets.instruct import (
    ChatTemplate,
    chat_dataset,
    instruct_pairs,
    prompt_response_dataset,
    read_chat_template,
)
from aqsgd.data.datasets.ragged import RaggedDataset
from aqsgd.data.datasets.text import text_classification
from aqsgd.errors import SpecError
from aqsgd.train.config import TrainConfig

from .conftest import WORDS

PAD, UNK, EOS, USER, ASSISTANT, END, SYSTEM = range(7)
SPECIALS = ["[PAD]", "[UNK]", "[EOS]", "<|user|>", "<|assistant|>", "<|end|>", "<|system|>"]
X = -100  # no loss

TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|> ' + m['content'] + ' <|end|> ' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}")
STRICT = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
          "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
          "{{ '<|' + m['role'] + '|> ' + m['content'] + ' <|end|> ' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}")
# a marker before the last turn: the turns before it are rendered otherwise once another follows
LAST_MARKED = ("{% for m in messages %}{% if loop.last %}{{ '<|end|> ' }}{% endif %}"
               "{{ '<|' + m['role'] + '|> ' + m['content'] + ' ' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}")


def w(text: str) -> list[int]:
    """The ids of letters separated by spaces."""
    return [WORDS.index(c) + len(SPECIALS) for c in text.split()]


def make_tokenizer(template: str | None = TEMPLATE):
    """A fast word-level tokenizer over single letters, with the turn markers as special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate([*SPECIALS, *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIALS[3:])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                  eos_token="[EOS]")
    out.chat_template = template
    return out


@pytest.fixture
def tok():
    return make_tokenizer()


def rows_of(ds: RaggedDataset) -> list[tuple[list[int], list[int]]]:
    return [(ds[i]["input_ids"].tolist(), ds[i]["labels"].tolist()) for i in range(len(ds))]


def message(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text and "\r" not in text, text
    return text


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def chat(*turns: tuple[str, str]) -> list[dict]:
    return [{"role": r, "content": c} for r, c in turns]


# --------------------------------------------------------------------------------------------------
# loss masks, by hand
# --------------------------------------------------------------------------------------------------


def test_prompt_response_labels_only_the_response_and_eos(tok):
    ds = prompt_response_dataset(["a b ", "c"], ["c d", " e f g"], tok, 32)
    assert rows_of(ds) == [
        (w("a b c d") + [EOS], [X, X, *w("c d"), EOS]),
        (w("c e f g") + [EOS], [X, *w("e f g"), EOS]),
    ]
    assert ds.info["kind"] == "causal-lm" and ds.info["format"] == "prompt-response"
    assert ds.info["pad_token_id"] == PAD and ds.info["chat_template"] is None
    assert ds.info["truncated"] == 0 and ds.info["dropped"] == 0 and ds.info["loss_tokens"] == 7
    assert ds.tokens["input_ids"].dtype == torch.int32 and ds.lengths.tolist() == [5, 5]


def test_pad_falls_back_to_eos(tok):
    tok.pad_token = None
    assert prompt_response_dataset(["a"], ["b"], tok, 8).info["pad_token_id"] == EOS


def test_prompt_response_as_chat_labels_the_assistant_turn(tok):
    ds = prompt_response_dataset(["a b"], ["c d"], tok, 32, as_chat=True)
    assert rows_of(ds) == [([USER, *w("a b"), END, ASSISTANT, *w("c d"), END],
                            [X, X, X, X, X, *w("c d"), END])]
    assert ds.info["chat_template"] == "tokenizer"


def test_multi_turn_labels_only_assistant_turns(tok):
    turns = chat(("system", "s"), ("user", "a b"), ("assistant", "c"), ("user", "d"), ("assistant", "e f"))
    ds = chat_dataset([turns], tok, 64)
    ids, labels = rows_of(ds)[0]
    assert ids == [SYSTEM, *w("s"), END, USER, *w("a b"), END, ASSISTANT, *w("c"), END, USER, *w("d"), END,
                   ASSISTANT, *w("e f"), END]
    assert labels == [X, X, X, X, X, X, X, X, *w("c"), END, X, X, X, X, *w("e f"), END]
    assert ds.info["format"] == "messages" and ds.info["loss_tokens"] == 5


def test_template_from_text_replaces_a_missing_one():
    bare = make_tokenizer(None)
    ds = chat_dataset([chat(("user", "a"), ("assistant", "b"))], bare, 16, chat_template=TEMPLATE)
    assert rows_of(ds) == [([USER, *w("a"), END, ASSISTANT, *w("b"), END], [X, X, X, X, *w("b"), END])]


def test_chat_template_turns_pairs_into_conversations(tmp_path):
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    template = read_chat_template(tmp_path / "t.jinja")
    ds = prompt_response_dataset(["a"], ["b"], make_tokenizer(None), 16, chat_template=template)
    assert rows_of(ds) == [([USER, *w("a"), END, ASSISTANT, *w("b"), END], [X, X, X, X, *w("b"), END])]
    assert ds.info["chat_template"] == f"--chat-template {tmp_path / 't.jinja'}"


def test_messages_as_json_text(tok):
    text = json.dumps(chat(("user", "a"), ("assistant", "b")))
    assert rows_of(chat_dataset([text], tok, 16)) == [([USER, *w("a"), END, ASSISTANT, *w("b"), END],
                                                       [X, X, X, X, *w("b"), END])]


def test_smollm2_template_masks_the_system_prompt_and_user_turn():
    if locate("smollm2") is None:
        pytest.skip("source 'smollm2' is not prepared; run `aqsgd data prepare smollm2`")
    from aqsgd.data import load_tokenizer

    t = load_tokenizer("smollm2")
    ds = chat_dataset([chat(("user", "What is two plus two?"), ("assistant", "Four."))], t, 128)
    labels = ds[0]["labels"]
    assert t.decode(labels[labels != X]) == "Four.<|im_end|>\n"
    assert t.decode(ds[0]["input_ids"]).startswith("<|im_start|>system\n")


# --------------------------------------------------------------------------------------------------
# truncation
# --------------------------------------------------------------------------------------------------


def test_truncation_counts_and_drops_examples_without_a_response_token(tok, caplog):
    prompts = ["a b ", "a b c d e f ", "a b c d e "]
    responses = ["c", "g h", "f"]
    with caplog.at_level(logging.INFO, logger="aqsgd.data.datasets.instruct"):
        ds = prompt_response_dataset(prompts, responses, tok, 6)
    # 1: a b c EOS (whole); 2: cut to "a b c d e f", no response token left: dropped; 3: "a b c d e f",
    # cut before its EOS, its response token kept
    assert rows_of(ds) == [(w("a b c") + [EOS], [X, X, *w("c"), EOS]),
                           (w("a b c d e f"), [X, X, X, X, X, *w("f")])]
    assert ds.info["truncated"] == 2 and ds.info["dropped"] == 1
    assert "2 of 3 examples cut to --max-length 6 tokens" in caplog.text
    assert "1 of 3 examples dropped" in caplog.text
    assert any(r.levelno == logging.WARNING and "dropped" in r.getMessage() for r in caplog.records)


def test_a_label_only_at_the_first_position_is_no_loss(tok):
    kept = prompt_response_dataset(["", "a b "], ["b c", "c"], tok, 2)
    assert rows_of(kept) == [(w("b c"), w("b c"))] and kept.info["dropped"] == 1  # "a b": nothing to learn
    with pytest.raises(SpecError, match="all 1 examples dropped"):
        prompt_response_dataset([""], ["b c"], tok, 1)  # "b" is labelled, but nothing before it predicts it


def test_all_examples_dropped_is_one_line(tok):
    with pytest.raises(SpecError) as e:
        prompt_response_dataset(["a b c d"], ["e"], tok, 3)
    assert message(e) == ("all 1 examples dropped: --max-length 3 cuts away every token of their responses; "
                          "raise --max-length")


def test_max_examples_keeps_the_first_kept_examples(tok):
    prompts, responses = ["a b c d ", "a ", "b ", "c "], ["e", "f", "g", "h"]
    ds = prompt_response_dataset(prompts, responses, tok, 4, max_examples=2)
    assert [ids for ids, _ in rows_of(ds)] == [w("a f") + [EOS], w("b g") + [EOS]]
    assert ds.info["dropped"] == 1


def test_long_text_is_tokenized_only_as_far_as_kept(tok):
    long_prompt = "a " * 40_000
    ds = prompt_response_dataset([long_prompt, "b "], ["c", "d"], tok, 8)
    assert len(ds) == 1 and ds.info["truncated"] == 1 and ds.info["dropped"] == 1


# --------------------------------------------------------------------------------------------------
# one-line errors
# --------------------------------------------------------------------------------------------------


EMPTY = "line 2: the 'response' value is empty; every example needs a response"


@pytest.mark.parametrize("row, expected", [
    ({"prompt": "a", "response": ""}, EMPTY),
    ({"prompt": "a", "response": "  "}, EMPTY),
    ({"prompt": "a"}, "line 2 has no 'response' value (null or missing)"),
    ({"prompt": "a", "response": 3}, "line 2: the 'response' value is a number (3), not a string"),
    ({"prompt": None, "response": "b"}, "line 2 has no 'prompt' value (null or missing)"),
])
def test_bad_pair_rows(tmp_path, tok, row, expected):
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "response": "b"}, row])
    with pytest.raises(DataFileError) as e:
        load_text_files(f, f, tokenizer=tok, max_length=16)
    assert message(e) == f"--train-file {f}: {expected}"


@pytest.mark.parametrize("value, expected", [
    ("hello", "the 'messages' value is a string that is not JSON; give a list of {role, content} messages"),
    ({"role": "user"}, "the 'messages' value is an object, not a list of {role, content} messages"),
    ([], "the 'messages' value is an empty list, not a list of {role, content} messages"),
    (["hi"], "message 1 of 'messages' is a string, not a {role, content} object"),
    ([{"content": "a"}], "message 1 of 'messages' has no role (a non-empty string)"),
    ([{"role": "user", "content": ["a"]}], "message 1 of 'messages' (user) has content that is a list, not a "
                                           "string"),
    (chat(("user", "a")), "no 'assistant' message in 'messages' (roles: user); every example needs a "
                          "response"),
    (chat(("user", "a"), ("assistant", " ")), "message 2 of 'messages' (assistant) is empty; every example "
                                               "needs a response"),
    (chat(("assistant", "a"), ("user", "b"), ("assistant", "c")),
     "message 1 of 'messages' is an 'assistant' message; a conversation opens with a turn before the first "
     "answer"),
])
def test_bad_messages(tmp_path, tok, value, expected):
    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": chat(("user", "a"), ("assistant", "b"))},
                                           {"messages": value}])
    with pytest.raises(DataFileError) as e:
        load_text_files(f, f, tokenizer=tok, max_length=16)
    assert message(e) == f"--train-file {f}: line 2: {expected}"


def test_unknown_role_names_the_role_and_row(tmp_path):
    robot = chat(("user", "a"), ("robot", "x"), ("assistant", "b"))
    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": chat(("user", "a"), ("assistant", "b"))},
                                           {"messages": robot}])
    with pytest.raises(DataFileError) as e:
        load_text_files(f, f, tokenizer=make_tokenizer(STRICT), max_length=16)
    assert message(e) == (f"--train-file {f}: line 2: the chat template fails at message 2 (role 'robot'): "
                          "unknown role robot")


def test_no_chat_template_names_the_option(tmp_path):
    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": chat(("user", "a"), ("assistant", "b"))}] * 2)
    with pytest.raises(DataFileError) as e:
        load_text_files(f, f, tokenizer=make_tokenizer(None), max_length=16)
    assert message(e) == (f"--train-file {f}: the tokenizer has no chat template to render the 'messages' "
                          "column with; give one with --chat-template FILE")


def test_chat_template_file_errors(tmp_path):
    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": chat(("user", "a"), ("assistant", "b"))}] * 2)
    missing = tmp_path / "none.jinja"
    with pytest.raises(DataFileError) as e:
        load_text_files(f, f, tokenizer=make_tokenizer(None), max_length=16, chat_template=missing)
    assert message(e) == f"--chat-template {missing}: no such file"
    empty = tmp_path / "empty.jinja"
    empty.write_text(" \n")
    with pytest.raises(DataFileError) as e:
        read_chat_template(empty)
    assert message(e) == f"--chat-template {empty}: is empty (a Jinja chat template was expected)"
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m['content'] }}")
    with pytest.raises(DataFileError) as e:
        load_text_files(f, f, tokenizer=make_tokenizer(None), max_length=16, chat_template=broken)
    assert message(e).startswith(f"--chat-template {broken}: not a valid Jinja template: ")


def test_template_that_is_not_prefix_consistent(tok):
    turns = chat(("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d"))
    with pytest.raises(SpecError) as e:
        chat_dataset([turns], tok, 32, chat_template=ChatTemplate(LAST_MARKED, "--chat-template last.jinja"))
    assert message(e) == ("example 1: --chat-template last.jinja is not prefix-consistent at message 2 "
                          "(assistant): the conversation rendered up to it is not the start of the one "
                          "rendered with it, or that of the whole one, so its tokens cannot be found; use a "
                          "template that renders earlier turns the same whatever follows (--chat-template "
                          "FILE)")


def test_tokenizer_without_eos_for_pairs(tok):
    tok.eos_token = None
    with pytest.raises(SpecError) as e:
        prompt_response_dataset(["a"], ["b"], tok, 8)
    assert message(e) == "the tokenizer has no EOS token to end each response with; set its eos_token"


# --------------------------------------------------------------------------------------------------
# the user's files
# --------------------------------------------------------------------------------------------------

CONVERSATIONS = [chat(("user", WORDS[i % 26]), ("assistant", WORDS[(i + 1) % 26])) for i in range(20)]


def expected_chat(i: int) -> list[int]:
    return [USER, *w(WORDS[i % 26]), END, ASSISTANT, *w(WORDS[(i + 1) % 26]), END]


@pytest.mark.parametrize("ext", [".jsonl", ".json", ".parquet", ".csv"])
def test_messages_survive_every_format(tmp_path, tok, ext):
    f = tmp_path / f"c{ext}"
    rows = [{"messages": c, "id": i} for i, c in enumerate(CONVERSATIONS)]
    if ext == ".jsonl":
        write_jsonl(f, rows)
    elif ext == ".json":
        f.write_text(json.dumps(rows))
    elif ext == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), f)
    else:  # a .csv cell holds the list as a JSON string
        with open(f, "w", newline="") as out:
            writer = csv.DictWriter(out, fieldnames=["messages", "id"])
            writer.writeheader()
            writer.writerows({"messages": json.dumps(r["messages"]), "id": r["id"]} for r in rows)
    train, evals = load_text_files(f, f, tokenizer=tok, max_length=16)
    assert [ids for ids, _ in rows_of(train)] == [expected_chat(i) for i in range(20)]
    assert len(evals) == 20 and train.info["format"] == "messages" and train.info["kind"] == "causal-lm"
    assert train.info["split"] == "train" and evals.info["split"] == "eval"


def test_custom_pair_columns_and_eval_file(tmp_path, tok):
    rows = [{"instruction": f"{WORDS[i]} ", "output": WORDS[i + 1]} for i in range(10)]
    f = write_jsonl(tmp_path / "a.jsonl", rows)
    e = write_jsonl(tmp_path / "b.jsonl", rows[:3])
    train, evals = load_text_files(f, e, tokenizer=tok, max_length=8, prompt_column="instruction",
                                   response_column="output")
    assert rows_of(train)[1] == (w("b c") + [EOS], [X, *w("c"), EOS])
    assert len(train) == 10 and len(evals) == 3
    assert train.info["prompt_column"] == "instruction" and train.info["response_column"] == "output"
    with pytest.raises(DataFileError) as err:
        load_text_files(f, tokenizer=tok, max_length=8, prompt_column="question", response_column="output")
    assert message(err) == f"--train-file {f}: no column 'question'; the columns are: instruction, output"


def test_hold_out_of_whole_examples_is_seeded(tmp_path, tok):
    rows = [{"prompt": f"{WORDS[i % 26]} ", "response": WORDS[(i + 3) % 26]} for i in range(40)]
    f = write_jsonl(tmp_path / "p.jsonl", rows)
    train, evals = load_text_files(f, tokenizer=tok, max_length=8, eval_split=0.25, seed=3)
    again, _ = load_text_files(f, tokenizer=tok, max_length=8, eval_split=0.25, seed=3)
    other, _ = load_text_files(f, tokenizer=tok, max_length=8, eval_split=0.25, seed=4)
    assert len(train) == 30 and len(evals) == 10
    assert torch.equal(train.tokens["input_ids"], again.tokens["input_ids"])
    assert not torch.equal(train.tokens["input_ids"], other.tokens["input_ids"])
    seen = sorted(ids[0] for ids, _ in rows_of(train) + rows_of(evals))
    assert seen == sorted(w(WORDS[i % 26])[0] for i in range(40))  # every example whole, in one split


def test_hold_out_errors_name_the_file_line(tmp_path, tok):
    rows = [{"prompt": "a ", "response": "b"} for _ in range(9)] + [{"prompt": "a ", "response": ""}]
    f = write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(DataFileError) as e:
        load_text_files(f, tokenizer=tok, max_length=8, eval_split=0.5, seed=0)
    assert message(e) == (f"--train-file {f}: line 10: the 'response' value is empty; every example needs a "
                          "response")


def test_which_data_are_instruction_data(tmp_path, tok):
    both = write_jsonl(tmp_path / "both.jsonl", [{"prompt": "a ", "response": "b", "label": "x"},
                                                 {"prompt": "c ", "response": "d", "label": "y"}] * 5)
    assert load_text_files(both, both, tokenizer=tok, max_length=8)[0].info["format"] == "prompt-response"
    classified = load_text_files(both, both, tokenizer=tok, max_length=8, text_column="prompt",
                                 label_column="label")[0]
    assert classified.info["kind"] == "sequence-classification"
    with pytest.raises(SpecError) as e:
        load_text_files(both, both, tokenizer=tok, max_length=8, label_column="label", prompt_column="prompt")
    assert "give one or the other" in message(e)
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": "a b c d"}] * 10)
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    with pytest.raises(DataFileError) as e:
        load_text_files(text, text, tokenizer=tok, max_length=2, chat_template=template)
    assert message(e) == (f"--train-file {text}: --chat-template {template} is for instruction data, and the "
                          "data have neither a 'messages' column nor 'prompt' and 'response' columns (the "
                          "columns are: text)")


def test_chat_template_joins_the_fingerprint(tmp_path):
    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CONVERSATIONS])
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    own = load_text_files(f, f, tokenizer=make_tokenizer(), max_length=16)[0].info["fingerprint"]
    given = load_text_files(f, f, tokenizer=make_tokenizer(None), max_length=16,
                            chat_template=template)[0].info["fingerprint"]
    assert own != given


# --------------------------------------------------------------------------------------------------
# text classification without padding
# --------------------------------------------------------------------------------------------------


def test_ragged_classification_is_the_padded_one_without_pads(word_tokenizer):
    texts = ["a b c", "d e f g h i j k l m n o p q r s t u v w x y z a b c", "a", "x y"]
    pairs = ["z", "y x", "a b c d e f g h i j k l m n o p q r s t", "w"]
    for p in (None, pairs):
        padded = text_classification(texts, [0, 1, 2, 1], word_tokenizer, 12, text_pairs=p)
        ragged = text_classification(texts, [0, 1, 2, 1], word_tokenizer, 12, text_pairs=p, ragged=True)
        reference = RaggedDataset.from_padded(padded.columns)
        assert isinstance(ragged, RaggedDataset) and sorted(ragged.tokens) == ["input_ids", "token_type_ids"]
        for name in ragged.tokens:
            assert ragged.tokens[name].tolist() == reference.tokens[name].tolist()
        assert torch.equal(ragged.offsets, reference.offsets)
        assert ragged.values["labels"].tolist() == [0, 1, 2, 1]
        assert ragged.info["truncated"] == (1 if p is None else 2) and ragged.info["dropped"] == 0
        assert ragged.info["kind"] == "sequence-classification" and ragged.info["num_labels"] == 3
        assert ragged.info["pad_token_id"] == 0


def test_ragged_classification_counts_exact_fits_as_whole(word_tokenizer):
    ds = text_classification(["a b c d e f", "a b c d e f g"], [0, 1], word_tokenizer, 8, ragged=True)
    assert ds.lengths.tolist() == [8, 8] and ds.info["truncated"] == 1


# --------------------------------------------------------------------------------------------------
# the offline task
# --------------------------------------------------------------------------------------------------


def need(*names: str) -> None:
    for name in names:
        if locate(name) is None:
            pytest.skip(f"source {name!r} is not prepared; run `aqsgd data prepare {name}`")


def test_instruct_pairs_are_fixed_and_mixed():
    need("wiki", "bbc")
    pairs = instruct_pairs()
    assert pairs == instruct_pairs() and len(pairs) > 12_000
    kinds = {k for k, _, _ in pairs[:200]}
    assert kinds == {"entry", "subject", "describe", "headline", "section", "article"}
    assert all(p.strip() and r.strip() for _, p, r in pairs)


def test_instruct_task_builds_deterministically_with_a_spread_of_lengths():
    need("wiki", "bbc", "smollm2")
    ds = load_task("instruct", "train", max_length=512, max_samples=400)
    again = load_task("instruct", "train", max_length=512, max_samples=400, seed=7)
    assert torch.equal(ds.tokens["input_ids"], again.tokens["input_ids"])
    assert torch.equal(ds.offsets, again.offsets)
    assert isinstance(ds, RaggedDataset) and len(ds) == 400 and ds.info["task"] == "instruct"
    assert ds.info["chat_template"] == "tokenizer" and ds.info["kind"] == "causal-lm"
    lengths = ds.lengths.numpy()
    assert lengths.min() < 64 and np.median(lengths) < 200 and lengths.max() > 400
    share = np.add.reduceat((ds.tokens["labels"] != X).numpy(), ds.offsets[:-1].numpy()) / lengths
    assert (share < 0.2).sum() > 50 and (share > 0.6).sum() > 50  # prompt-heavy and response-heavy
    evals = load_task("instruct", "eval", max_length=512, max_samples=50)
    assert len(evals) == 50 and not torch.equal(evals.tokens["input_ids"][:100], ds.tokens["input_ids"][:100])


def test_instruct_task_plain_without_a_template():
    need("wiki", "bbc", "gpt2-tokenizer")
    ds = load_task("instruct", "train", max_length=512, max_samples=200, tokenizer="gpt2-tokenizer")
    assert ds.info["chat_template"] is None and len(ds) == 200
    assert int(ds.lengths.min()) < 24
    ends = ds.offsets[1:] - 1
    assert (ds.tokens["input_ids"][ends] == 50256).all()  # every example ends with EOS


# --------------------------------------------------------------------------------------------------
# the task section
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flat, expected", [
    ({"train_file": "a.jsonl", "prompt_column": " "},
     "--prompt-column: must name a column, got an empty string"),
    ({"train_file": "a.jsonl", "messages_column": ""},
     "--messages-column: must name a column, got an empty string"),
    ({"task": "instruct", "chat_template": "t.jinja"},
     "--chat-template: is for your instruction data (--train-file or --dataset); a named task brings its own "
     "format"),
    ({"train_file": "a.jsonl", "messages_column": "m", "response_column": "r"},
     "--messages-column: names conversations, --prompt-column / --response-column prompt/response pairs: "
     "give one or the other"),
    ({"train_file": "a.jsonl", "label_column": "l", "prompt_column": "p"},
     "--label-column: makes the data classification, --prompt-column instruction data: give one or the "
     "other"),
    ({"train_file": "a.jsonl", "chat_template": " "},
     "--chat-template: must name a Jinja template file, got an empty string"),
])
def test_task_section_checks(flat, expected):
    with pytest.raises(SpecError) as e:
        TrainConfig.of(**flat).validate()
    assert message(e) == expected


def test_task_section_options_reach_the_loader(tmp_path):
    need("smollm2")
    from aqsgd.train.tasks import _own_data

    rows = [{"conv": chat(("user", "Name a colour."), ("assistant", f"Colour {i}."))} for i in range(10)]
    f = write_jsonl(tmp_path / "c.jsonl", rows)
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
                        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    cfg = TrainConfig.of(train_file=str(f), messages_column="conv", chat_template=str(template),
                         max_length=32).validate()
    train, evals, kind, folder = _own_data(cfg)
    assert kind == "causal-lm" and isinstance(train, RaggedDataset) and len(train) + len(evals) == 10
    assert train.info["messages_column"] == "conv"
    assert train.info["chat_template"] == f"--chat-template {template}"
