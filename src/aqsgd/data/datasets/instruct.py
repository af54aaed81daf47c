"""Instruction and chat data: examples of their own lengths with the loss on the answers only, as
:class:`~aqsgd.data.datasets.ragged.RaggedDataset` s, and the offline ``instruct`` task.

Two kinds of rows (:func:`prompt_response_dataset`, :func:`chat_dataset`):

* **prompt/response**: the tokens of ``prompt + response`` (joined as they are, no separator, no template:
  TRL's "prompt-completion" convention; end the prompt with the space or newline you want) followed by the
  tokenizer's EOS token. With ``as_chat`` (what a ``--chat-template`` does for such rows) the pair is
  rendered instead as a two-turn conversation, ``[{"role": "user", "content": prompt}, {"role":
  "assistant", "content": response}]``, like a ``messages`` row.
* **messages**: a list of ``{"role", "content"}`` turns (string content; other keys are passed to the
  template), rendered with the tokenizer's chat template (``tokenizer.apply_chat_template``) or one given
  as Jinja text (:func:`read_chat_template`: ``--chat-template FILE``).

**Labels** (``-100`` where no loss): a token carries its own id as label when it overlaps the response (with
the EOS after it), or one of the assistant turns. An assistant turn's characters are found by rendering the
conversation up to it twice, without it (with the template's generation prompt, where that is a prefix, else
without) and with it: what the second adds is the turn (its content and the template's end of turn). This
needs a *prefix-consistent* template (earlier turns rendered the same whatever follows); one that is not
fails in one line. A conversation must open with a turn before the first assistant one.

**Truncation**: each example keeps its first ``max_length`` tokens. ``info["truncated"]`` counts the
examples cut; an example left with no token that carries a loss (counted after the one-place shift of the
causal-LM loss) is dropped, counted in ``info["dropped"]`` and logged; none left is an error.

Texts are tokenized in batches of at most :data:`~aqsgd.data.datasets.pieces.BATCH_CHARS` characters with
character offsets (a fast tokenizer), a text far longer than ``max_length`` tokens only as far as it is kept
(:func:`~aqsgd.data.datasets.pieces.leading`); the ids are stored as int32 where the vocabulary allows.
Bad rows raise a one-line error naming the row (:class:`~aqsgd.errors.DataFileError` with the option and file
for rows of a data file, :class:`~aqsgd.errors.SpecError` for rows given from Python).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from aqsgd.data.datasets.base import PathLike, _Args
from aqsgd.data.datasets.batching import _rng
from aqsgd.data.datasets.pieces import BATCH_CHARS, id_dtype, leading
from aqsgd.data.datasets.ragged import IGNORE_INDEX, RaggedDataset
from aqsgd.data.datasets.records import Records, _describe, _error, _first_line
from aqsgd.data.datasets.text import _vocab_size, bbc_articles, load_tokenizer
from aqsgd.errors import AqsgdError, DataFileError, SpecError
from aqsgd.logs import ProgressLog

__all__ = ["ChatTemplate", "chat_dataset", "instruct_pairs", "prompt_response_dataset", "read_chat_template"]

log = logging.getLogger(__name__)

ASSISTANT = "assistant"
"""The role whose turns carry the loss."""


# --------------------------------------------------------------------------------------------------
# templates and where rows come from
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template given instead of the tokenizer's own, and how messages name it."""

    text: str
    name: str = "the chat template"


def read_chat_template(path: PathLike, option: str = "--chat-template") -> ChatTemplate:
    """The chat template in the file ``path`` (Jinja, as ``tokenizer.chat_template`` holds it); a one-line
    :class:`~aqsgd.errors.DataFileError` naming ``option`` and the file for a missing, unreadable or empty
    one."""
    p = Path(path)
    if not p.exists():
        raise _error(option, str(path), "no such file")
    if not p.is_file():
        raise _error(option, str(path), "is not a file (give the Jinja template's file)")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise _error(option, str(path), "not UTF-8 text; save the template as UTF-8") from None
    except OSError as e:
        raise _error(option, str(path), f"cannot read it: {e.strerror or e}") from None
    if not text.strip():
        raise _error(option, str(path), "is empty (a Jinja chat template was expected)")
    return ChatTemplate(text, f"{option} {path}")


class _Source:
    """Where the examples come from, for one-line errors: a data file's rows, or lists given from Python;
    ``label`` names them in the log."""

    def __init__(self, records: Records | None, label: str | None = None) -> None:
        self.records = records
        self._label = label

    def where(self, i: int) -> str:
        return self.records.where(i) if self.records is not None else f"example {i + 1}"

    def error(self, problem: str) -> AqsgdError:
        return self.records.error(problem) if self.records is not None else SpecError(problem)

    @property
    def label(self) -> str:
        r = self.records
        if self._label is not None:
            return self._label
        return "the examples" if r is None else f"the examples of {r.option} {r.source}"


class _TemplateFailed(Exception):
    """The chat template raised while rendering (its own message, e.g. an unknown role)."""


@dataclasses.dataclass(frozen=True)
class _Example:
    """An example before tokenizing: its text, the character spans that carry the loss, and the id appended
    after its tokens (with a label), if any."""

    text: str
    spans: tuple[tuple[int, int], ...]
    eos: int | None = None


# --------------------------------------------------------------------------------------------------
# builders
# --------------------------------------------------------------------------------------------------


def prompt_response_dataset(
    prompts: Sequence[Any],
    responses: Sequence[Any],
    tokenizer: Any,
    max_length: int,
    *,
    as_chat: bool = False,
    chat_template: ChatTemplate | str | None = None,
    max_examples: int | None = None,
    records: Records | None = None,
    columns: tuple[str, str] = ("prompt", "response"),
    info: Mapping[str, Any] | None = None,
    label: str | None = None,
) -> RaggedDataset:
    """Prompt/response examples (see the module docstring): labels on the response and the EOS after it, or,
    with ``as_chat`` (implied by a ``chat_template``), on the assistant turn of the rendered two-turn
    conversation.

    Args:
        prompts, responses: one string per example; a prompt may be empty, a response may not.
        tokenizer: a Hugging Face fast tokenizer (character offsets are needed).
        max_length: tokens kept per example.
        chat_template: a :class:`ChatTemplate` (or Jinja text) used instead of the tokenizer's own.
        max_examples: stop once this many examples are kept (the first ones of the whole dataset).
        records: the data file the rows come from (errors then name it and the row); ``columns`` name the
            prompt and response columns in messages.
        info: extra metadata for the dataset's ``info``.
        label: what the log calls the examples (default: the examples, of the data file).
    """
    if len(prompts) != len(responses):
        raise SpecError(f"{len(prompts)} prompts and {len(responses)} responses")
    source = _Source(records, label)
    p_col, r_col = columns
    for i, (p, r) in enumerate(zip(prompts, responses)):
        _check_pair(source, i, p, r, p_col, r_col)
    template = _template(chat_template)
    as_chat = as_chat or template is not None
    if as_chat:
        _need_template(tokenizer, template, source)
        eos = None
    else:
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            raise source.error("the tokenizer has no EOS token to end each response with; set its eos_token")

    def render(i: int) -> _Example:
        if as_chat:
            turns = [{"role": "user", "content": prompts[i]}, {"role": ASSISTANT, "content": responses[i]}]
            return _render_chat(tokenizer, turns, template, source, i)
        return _Example(prompts[i] + responses[i], ((len(prompts[i]), len(prompts[i]) + len(responses[i])),),
                        int(eos))  # type: ignore[arg-type]

    meta = {"format": "prompt-response", "prompt_column": p_col, "response_column": r_col,
            "chat_template": _template_source(template, as_chat), **(info or {})}
    return _dataset(render, len(prompts), tokenizer, max_length, max_examples, source, meta)


def chat_dataset(
    conversations: Sequence[Any],
    tokenizer: Any,
    max_length: int,
    *,
    chat_template: ChatTemplate | str | None = None,
    max_examples: int | None = None,
    records: Records | None = None,
    column: str = "messages",
    info: Mapping[str, Any] | None = None,
    label: str | None = None,
) -> RaggedDataset:
    """Conversations (lists of ``{"role", "content"}`` turns, or such a list as a JSON string) rendered with
    the chat template, labels on the assistant turns only (see the module docstring). The arguments are
    :func:`prompt_response_dataset`'s; ``column`` names the messages column in messages."""
    source = _Source(records, label)
    turns = [_messages(source, i, v, column) for i, v in enumerate(conversations)]
    template = _template(chat_template)
    _need_template(tokenizer, template, source, column)

    def render(i: int) -> _Example:
        return _render_chat(tokenizer, turns[i], template, source, i)

    meta = {"format": "messages", "messages_column": column,
            "chat_template": _template_source(template, True), **(info or {})}
    return _dataset(render, len(turns), tokenizer, max_length, max_examples, source, meta)


def _template(chat_template: ChatTemplate | str | None) -> ChatTemplate | None:
    if chat_template is None or isinstance(chat_template, ChatTemplate):
        return chat_template
    if not isinstance(chat_template, str) or not chat_template.strip():
        raise SpecError("chat_template must be Jinja text (or a ChatTemplate), got an empty or non-text "
                        "value")
    return ChatTemplate(chat_template)


def _template_source(template: ChatTemplate | None, used: bool) -> str | None:
    """What ``info["chat_template"]`` says: None (no template), ``tokenizer`` or the given template's name."""
    if not used:
        return None
    return "tokenizer" if template is None else template.name


def _need_template(tokenizer: Any, template: ChatTemplate | None, source: _Source,
                   column: str | None = None) -> None:
    if template is None and not getattr(tokenizer, "chat_template", None):
        what = f"the {column!r} column" if column else "the conversations"
        raise source.error(f"the tokenizer has no chat template to render {what} with; give one with "
                           "--chat-template FILE")


def _check_pair(source: _Source, i: int, prompt: Any, response: Any, p_col: str, r_col: str) -> None:
    for col, value in ((p_col, prompt), (r_col, response)):
        if value is None:
            raise source.error(f"{source.where(i)} has no {col!r} value (null or missing)")
        if not isinstance(value, str):
            raise source.error(f"{source.where(i)}: the {col!r} value is {_describe(value)}, not a string")
    if not response.strip():
        raise source.error(f"{source.where(i)}: the {r_col!r} value is empty; every example needs a response")


def _messages(source: _Source, i: int, value: Any, column: str) -> list[dict[str, Any]]:
    """A conversation checked: a non-empty list of ``{role, content}`` objects with string content, an
    assistant turn with text, and a turn before the first assistant one. A string is read as JSON (how a
    ``.csv`` cell holds a list)."""
    where = source.where(i)
    if value is None:
        raise source.error(f"{where} has no {column!r} value (null or missing)")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise source.error(f"{where}: the {column!r} value is a string that is not JSON; give a list of "
                               "{role, content} messages") from None
    if not isinstance(value, (list, tuple)) or not value:
        shown = "an empty list" if isinstance(value, (list, tuple)) else _describe(value)
        raise source.error(f"{where}: the {column!r} value is {shown}, not a list of {{role, content}} "
                           "messages")
    for j, m in enumerate(value, 1):
        if not isinstance(m, Mapping):
            raise source.error(f"{where}: message {j} of {column!r} is {_describe(m)}, not a "
                               "{role, content} object")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role.strip():
            raise source.error(f"{where}: message {j} of {column!r} has no role (a non-empty string)")
        if not isinstance(content, str):
            raise source.error(f"{where}: message {j} of {column!r} ({role}) has content that is "
                               f"{_describe(content)}, not a string")
    roles = [m["role"] for m in value]
    if ASSISTANT not in roles:
        raise source.error(f"{where}: no {ASSISTANT!r} message in {column!r} (roles: {', '.join(roles)}); "
                           "every example needs a response")
    if roles[0] == ASSISTANT:
        raise source.error(f"{where}: message 1 of {column!r} is an {ASSISTANT!r} message; a conversation "
                           "opens with a turn before the first answer")
    for j, m in enumerate(value, 1):
        if m["role"] == ASSISTANT and not m["content"].strip():
            raise source.error(f"{where}: message {j} of {column!r} ({ASSISTANT}) is empty; every example "
                               "needs a response")
    return [dict(m) for m in value]


# --------------------------------------------------------------------------------------------------
# rendering conversations
# --------------------------------------------------------------------------------------------------


def _render_chat(tokenizer: Any, turns: list[dict[str, Any]], template: ChatTemplate | None, source: _Source,
                 i: int) -> _Example:
    """The conversation's text and the character spans of its assistant turns (module docstring)."""
    render = _renderer(tokenizer, template)
    try:
        whole = render(turns, False)
    except _TemplateFailed as e:
        raise _failure(render, turns, source, i, str(e)) from None
    spans = []
    for k, turn in enumerate(turns):
        if turn["role"] != ASSISTANT:
            continue
        upto = _render_or_fail(render, turns[:k + 1], False, source, i, k)
        start = _turn_start(render, turns, k, upto, source, i)
        if start is None or not whole.startswith(upto):
            raise source.error(f"{source.where(i)}: {_name(template)} is not prefix-consistent at message "
                               f"{k + 1} ({ASSISTANT}): the conversation rendered up to it is not the start "
                               "of the one rendered with it, or that of the whole one, so its tokens cannot "
                               "be found; use a template that renders earlier turns the same whatever "
                               "follows (--chat-template FILE)")
        if start == len(upto):
            raise source.error(f"{source.where(i)}: {_name(template)} renders message {k + 1} "
                               f"({ASSISTANT}) as nothing")
        spans.append((start, len(upto)))
    return _Example(whole, tuple(spans))


def _renderer(tokenizer: Any, template: ChatTemplate | None
                             ) -> Callable[[list[dict[str, Any]], bool], str]:
    """``render(turns, add_generation_prompt)``: the template's text for ``turns``; the template raising
    becomes :class:`_TemplateFailed`, a template that is not Jinja a one-line error naming it."""

    def render(turns: list[dict[str, Any]], generation: bool) -> str:
        kwargs = {} if template is None else {"chat_template": template.text}
        try:
            text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation,
                                                 **kwargs)
        except Exception as e:  # noqa: BLE001 - whatever the template raises is reported in one line
            if type(e).__name__ == "TemplateSyntaxError":
                line = getattr(e, "lineno", None)
                at = f" (line {line})" if line else ""
                raise DataFileError(f"{_name(template)}: not a valid Jinja template: {_first_line(e)}{at}"
                                    ) from None
            raise _TemplateFailed(_first_line(e)) from None
        if not isinstance(text, str):
            raise SpecError(f"{_name(template)}: apply_chat_template returned {type(text).__name__}, not "
                            "text")
        return text

    return render


def _name(template: ChatTemplate | None) -> str:
    return "the tokenizer's chat template" if template is None else template.name


def _render_or_fail(render: Callable[[list[dict[str, Any]], bool], str], turns: list[dict[str, Any]],
                    generation: bool, source: _Source, i: int, k: int) -> str:
    try:
        return render(turns, generation)
    except _TemplateFailed as e:
        raise source.error(f"{source.where(i)}: the chat template fails on the conversation up to message "
                           f"{k + 1} ({turns[-1]['role'] if turns else 'none'}): {e}") from None


def _turn_start(render: Callable[[list[dict[str, Any]], bool], str], turns: list[dict[str, Any]], k: int,
                upto: str, source: _Source, i: int) -> int | None:
    """Where assistant turn ``k`` starts in ``upto`` (the conversation rendered up to it): after the turns
    before it rendered with the generation prompt where that is a prefix of ``upto``, else without."""
    for generation in (True, False):
        before = _render_or_fail(render, turns[:k], generation, source, i, k - 1)
        if upto.startswith(before):
            return len(before)
    return None


def _failure(render: Callable[[list[dict[str, Any]], bool], str], turns: list[dict[str, Any]],
             source: _Source, i: int, why: str) -> AqsgdError:
    """The template failed (``why``) on the whole conversation: the one-line error names the first message
    (and its role) at which it fails on the conversation up to there."""
    for j in range(1, len(turns)):
        try:
            render(turns[:j], False)
        except _TemplateFailed as e:
            why, at = str(e), j
            break
    else:
        at = len(turns)
    return source.error(f"{source.where(i)}: the chat template fails at message {at} (role "
                        f"{turns[at - 1]['role']!r}): {why}")


# --------------------------------------------------------------------------------------------------
# tokenizing
# --------------------------------------------------------------------------------------------------


def _dataset(render: Callable[[int], _Example], n: int, tokenizer: Any, max_length: int,
             max_examples: int | None, source: _Source, meta: Mapping[str, Any]) -> RaggedDataset:
    """Render, tokenize, label and truncate the examples ``0..n-1`` (stopping once ``max_examples`` are
    kept), with the counts logged and in ``info``."""
    if not isinstance(max_length, (int, np.integer)) or max_length < 1:
        raise SpecError(f"max_length must be an integer >= 1, got {max_length!r}")
    if max_examples is not None and max_examples < 0:
        raise SpecError(f"max_examples must be >= 0, got {max_examples}")
    vocab = _vocab_size(tokenizer)
    dtype = id_dtype(vocab)
    want = n if max_examples is None else min(n, max_examples)
    progress = ProgressLog(log, f"tokenizing {source.label}", total=want, unit="examples")
    ids_parts: list[np.ndarray] = []
    label_parts: list[np.ndarray] = []
    lengths: list[int] = []
    counts = {"truncated": 0, "dropped": 0, "loss_tokens": 0}
    batch: list[tuple[_Example, bool]] = []
    chars = 0

    def flush() -> None:
        nonlocal chars
        if not batch:
            return
        texts = [ex.text for ex, _ in batch]
        for (ex, cut), (ids, offsets) in zip(batch, _encode(tokenizer, texts, source)):
            if len(lengths) >= want:
                break
            ids, labels = _labelled(ids, offsets, ex)
            cut = cut or len(ids) > max_length
            ids, labels = ids[:max_length], labels[:max_length]
            counts["truncated"] += cut
            loss = int((labels[1:] != IGNORE_INDEX).sum())
            if loss == 0:
                counts["dropped"] += 1
                continue
            counts["loss_tokens"] += loss
            ids_parts.append(ids.astype(dtype))
            label_parts.append(labels.astype(dtype))
            lengths.append(len(ids))
        batch.clear()
        chars = 0
        progress.update(len(lengths))

    for i in range(n):
        if len(lengths) + len(batch) >= want:
            flush()
            if len(lengths) >= want:
                break
        ex = render(i)
        text, more = leading(ex.text, tokenizer, max_length)  # a long text: only its kept beginning
        batch.append((dataclasses.replace(ex, text=text) if more is not None else ex, more is not None))
        chars += len(text)
        if chars >= BATCH_CHARS:
            flush()
    if batch:
        flush()
    return _finish(ids_parts, label_parts, lengths, counts, tokenizer, max_length, vocab, source, meta)


def _encode(tokenizer: Any, texts: list[str], source: _Source) -> Iterator[tuple[list[int], np.ndarray]]:
    """The ids (no special tokens added) and character offsets ``[L, 2]`` of each text, in one call."""
    try:
        enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    except NotImplementedError:
        raise source.error("the tokenizer gives no character offsets (a slow tokenizer); instruction data "
                           "need a fast one (a folder with tokenizer.json)") from None
    for ids, offsets in zip(enc["input_ids"], enc["offset_mapping"]):
        yield ids, np.asarray(offsets, dtype=np.int64).reshape(-1, 2)


def _labelled(ids: list[int], offsets: np.ndarray, ex: _Example) -> tuple[np.ndarray, np.ndarray]:
    """``ids`` (with the example's EOS appended) and their labels: a token's own id where it overlaps one of
    the example's spans (a token of no width: where it sits inside one), :data:`IGNORE_INDEX` elsewhere."""
    starts, ends = offsets[:, 0], offsets[:, 1]
    inside = np.zeros(len(ids), dtype=bool)
    for a, b in ex.spans:
        inside |= np.where(ends > starts, (ends > a) & (starts < b), (starts >= a) & (starts < b))
    tokens = np.asarray(ids, dtype=np.int64)
    labels = np.where(inside, tokens, IGNORE_INDEX)
    if ex.eos is not None:
        tokens = np.append(tokens, ex.eos)
        labels = np.append(labels, ex.eos)
    return tokens, labels


def _finish(ids_parts: list[np.ndarray], label_parts: list[np.ndarray], lengths: list[int],
            counts: dict[str, int], tokenizer: Any, max_length: int, vocab: int | None, source: _Source,
            meta: Mapping[str, Any]) -> RaggedDataset:
    """The dataset of the kept examples, and the counts logged; none kept is an error."""
    kept = len(lengths)
    seen = kept + counts["dropped"]
    if counts["truncated"]:
        log.info("%s: %d of %d examples cut to --max-length %d tokens", source.label, counts["truncated"],
                 seen, max_length)
    if counts["dropped"]:
        log.warning("%s: %d of %d examples dropped: --max-length %d cuts away every token of their response",
                    source.label, counts["dropped"], seen, max_length)
    if kept == 0 and seen:
        raise source.error(f"all {seen} examples dropped: --max-length {max_length} cuts away every token of "
                           "their responses; raise --max-length")
    offsets = torch.zeros(kept + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.as_tensor(lengths, dtype=torch.int64), 0)
    dtype = id_dtype(vocab)
    flat_ids = np.concatenate(ids_parts) if ids_parts else np.zeros(0, dtype=dtype)
    flat_labels = np.concatenate(label_parts) if label_parts else np.zeros(0, dtype=dtype)
    pad = getattr(tokenizer, "pad_token_id", None)
    eos = getattr(tokenizer, "eos_token_id", None)
    info = {"kind": "causal-lm", "max_length": max_length, "vocab_size": vocab,
            "pad_token_id": pad if pad is not None else eos, "eos_token_id": eos,
            "tokens": int(flat_ids.size), **counts, **meta}
    return RaggedDataset({"input_ids": torch.from_numpy(flat_ids), "labels": torch.from_numpy(flat_labels)},
                         offsets, info=info)


# --------------------------------------------------------------------------------------------------
# the offline ``instruct`` task
# --------------------------------------------------------------------------------------------------

_WIKI_PROMPTS = (
    ("entry", "Write a short encyclopedia entry about {title}."),
    ("subject", "Which subject is this encyclopedia entry about? Answer with its title.\n\n{extract}"),
    ("describe", "Describe {title} in a few words."),
)
_BBC_PROMPTS = (
    ("headline", "Write a headline for this news article.\n\n{body}"),
    ("section", "Which section of the newspaper is this article from: {sections}?\n\n{body}"),
    ("article", "Write the opening of a news article headlined \"{headline}\"."),
)
_BBC_BODY_CHARS = 1500  # the article's first paragraphs, up to about this many characters (~330 tokens)
_ORDER_KEY = 53  # the fixed shuffle of the task's examples (the same data set whatever the run's seed)


def instruct_pairs(cache_dir: PathLike | None = None) -> list[tuple[str, str, str]]:
    """The ``instruct`` task's examples, ``(kind, prompt, response)``, in the task's fixed order, built
    from the offline ``wiki`` and ``bbc`` sources (prepared on first use).

    Each Wikipedia lead section gives, in turn, an ``entry`` (title -> lead section: response-heavy), a
    ``subject`` (lead section -> title: prompt-heavy) or a ``describe`` (title -> its short description,
    where it has one; else an ``entry``); each BBC article a ``headline`` (opening paragraphs -> headline),
    a ``section`` (opening paragraphs -> its section, one of five) or an ``article`` (headline -> opening
    paragraphs). The examples are shuffled with a fixed key: the same list everywhere, whatever the run's
    seed."""
    from aqsgd.data.sources import require

    pairs: list[tuple[str, str, str]] = []
    for i, (title, extract, description) in enumerate(_wiki_articles(require("wiki", cache_dir))):
        kind, prompt = _WIKI_PROMPTS[i % len(_WIKI_PROMPTS)]
        if kind == "describe" and not description:
            kind, prompt = _WIKI_PROMPTS[0]
        response = {"entry": extract, "subject": title, "describe": description}[kind]
        pairs.append((kind, prompt.format(title=title, extract=extract), response))
    articles = _bbc_articles(require("bbc", cache_dir))
    sections = sorted({a[0] for a in articles})
    listed = ", ".join(sections[:-1]) + f" or {sections[-1]}"
    for i, (section, headline, body) in enumerate(articles):
        kind, prompt = _BBC_PROMPTS[i % len(_BBC_PROMPTS)]
        response = {"headline": headline, "section": section, "article": body}[kind]
        pairs.append((kind, prompt.format(body=body, headline=headline, sections=listed), response))
    order = _rng(_ORDER_KEY).permutation(len(pairs))
    return [pairs[k] for k in order]


def _wiki_articles(root: Path) -> list[tuple[str, str, str]]:
    """(title, lead section, short description) of each article of the ``wiki`` source with a lead."""
    data = json.loads((root / "summaries_en-us.json").read_text(encoding="utf-8"))
    rows = data.values() if isinstance(data, dict) else data
    out = []
    for r in rows:
        title, extract = " ".join(str(r.get("title", "")).split()), str(r.get("extract", "")).strip()
        if title and extract:
            out.append((title, extract, " ".join(str(r.get("description") or "").split())))
    return out


def _bbc_articles(root: Path) -> list[tuple[str, str, str]]:
    """(section, headline, opening paragraphs) of each article of the ``bbc`` source, in (section, file)
    order: the first line is the headline, the paragraphs after it are kept up to :data:`_BBC_BODY_CHARS`
    characters (at least one)."""
    out = []
    for _, section, text in bbc_articles(root):
        lines = [" ".join(line.split()) for line in text.splitlines()]
        paragraphs = [line for line in lines if line]
        if len(paragraphs) < 2:
            continue
        body: list[str] = []
        for p in paragraphs[1:]:
            if body and sum(map(len, body)) + len(p) > _BBC_BODY_CHARS:
                break
            body.append(p)
        out.append((section, paragraphs[0], "\n".join(body)))
    return out


def _load_instruct(a: _Args) -> RaggedDataset:
    """The ``instruct`` task: the last ``eval_fraction`` (default 0.1) of :func:`instruct_pairs` for
    evaluation, the rest for training; rendered with the tokenizer's chat template where it has one
    (SmolLM2's, the default), else as plain prompt + newline + response + EOS."""
    pairs = instruct_pairs(a.cache_dir)
    frac = 0.1 if a.eval_fraction is None else a.eval_fraction
    n_eval = math.ceil(len(pairs) * frac)
    part = pairs[: len(pairs) - n_eval] if a.split == "train" else pairs[len(pairs) - n_eval:]
    tok = load_tokenizer(a.tokenizer or "smollm2", a.cache_dir)
    as_chat = bool(getattr(tok, "chat_template", None))
    prompts = [p if as_chat else p + "\n" for _, p, _ in part]
    return prompt_response_dataset(prompts, [r for _, _, r in part], tok, a.max_length,
                                   as_chat=as_chat, max_examples=a.max_samples)

