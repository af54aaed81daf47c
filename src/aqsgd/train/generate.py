"""``aqsgd generate``: a run's or an export's model answering prompts, through plain ``transformers``.

The source is a run directory (its newest complete checkpoint, or step ``checkpoint``'s: the full model
rebuilt as ``aqsgd export`` rebuilds it, a LoRA run's adapters merged into the weights) or a folder in the
``save_pretrained`` layout: an export (merged, or a PEFT adapter folder, which is merged onto its base) or any
causal LM folder with its tokenizer. Each prompt is answered by ``model.generate`` on its own (no padding
beside other prompts, so an answer does not depend on them), with the settings given here on top of the
model's own generation config: a setting not given is not touched, and transformers' defaults apply where the
model sets none.

A chat template is applied (``add_generation_prompt=True``) where there is one: the ``chat_template`` given
here, else the template a run was trained with, else the tokenizer's own. Without one a prompt goes to the
model as raw text (tokenized as ``tokenizer(prompt)`` does), and a conversation (``messages``) is refused in
one line naming ``--chat-template``.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from aqsgd.errors import SpecError
from aqsgd.train.checkpoint.layout import one_line

__all__ = ["Generator", "Prompt", "Sampling", "generate", "load", "read_prompts"]

log = logging.getLogger(__name__)

Prompt = str | list[dict[str, str]]
"""A prompt: text, or a conversation (``messages``: a list of ``{"role": ..., "content": ...}``)."""

_CAUSAL_LM_CLASSES = ("ForCausalLM", "LMHeadModel")  # how transformers names its causal LM classes


@dataclass(frozen=True)
class Sampling:
    """The generation settings given by the user; None: not given (the model's generation config, or
    transformers' default, applies)."""

    max_new_tokens: int | None = None
    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        """A value out of range is one line naming its option (before any model is loaded)."""
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise SpecError(f"--max-new-tokens {self.max_new_tokens}: must be at least 1")
        if self.temperature is not None and not self.temperature > 0:
            raise SpecError(f"--temperature {self.temperature}: must be above 0 (greedy: --no-do-sample)")
        if self.top_k is not None and self.top_k < 1:
            raise SpecError(f"--top-k {self.top_k}: must be at least 1")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise SpecError(f"--top-p {self.top_p}: must be in (0, 1]")

    def given(self) -> dict[str, Any]:
        """The settings given, as ``model.generate`` keywords."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    def check_used(self, samples_by_default: bool) -> None:
        """One line naming the option for a sampling setting that would not be used: neither
        ``--do-sample`` nor the model's generation config (``samples_by_default``) samples."""
        sampling = self.do_sample if self.do_sample is not None else samples_by_default
        unused = [n for n in ("temperature", "top_k", "top_p") if getattr(self, n) is not None]
        if unused and not sampling:
            name = unused[0].replace("_", "-")
            why = ("--no-do-sample is greedy" if self.do_sample is False
                   else "the model's generation settings are greedy")
            raise SpecError(f"--{name}: applies to sampling only, and {why}; add --do-sample")


@dataclass
class Generator:
    """A model ready to answer prompts: the model (in evaluation mode on ``device``), its tokenizer, the chat
    template in use, said as where it comes from (``template_from``; None: there is none, prompts are raw
    text) with its text where it is not the tokenizer's own (``template``), and the source as said in the
    output (``source``)."""

    model: Any
    tokenizer: Any
    template: str | None
    template_from: str | None
    source: str
    device: torch.device

    def answer(self, prompts: Sequence[Prompt], *, sampling: Sampling | None = None, seed: int | None = None,
               use_template: bool = True) -> list[str]:
        """Each prompt's answer: the generated tokens after the prompt, decoded without special tokens.
        ``seed``: each prompt's sampling starts from ``torch.manual_seed(seed)`` (an answer then does not
        depend on the prompts before it). ``use_template`` False: text prompts go in raw, even where there is
        a template."""
        sampling = sampling or Sampling()
        sampling.check_used(bool(getattr(self.model.generation_config, "do_sample", False)))
        encoded = [self.encode(p, i, use_template) for i, p in enumerate(prompts, 1)]
        answers, said = [], set()
        for ids in encoded:
            if seed is not None:
                torch.manual_seed(seed)
            with warnings.catch_warnings(record=True) as caught:  # transformers' notes: one log line each
                warnings.simplefilter("always")
                out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                          **sampling.given())
            for w in caught:
                text = " ".join(str(w.message).split())
                if text not in said:
                    said.add(text)
                    log.warning("transformers: %s", text)
            answers.append(self.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
        return answers

    def encode(self, prompt: Prompt, number: int, use_template: bool = True) -> torch.Tensor:
        """The token ids ``[1, n]`` on the model's device that the ``number``-th prompt gives the model."""
        conversation = not isinstance(prompt, str)
        if conversation and not use_template:
            raise SpecError(f"prompt {number} is a conversation (messages), and --no-chat-template gives "
                            "prompts as raw text; leave --no-chat-template out")
        if conversation and self.template_from is None:
            raise SpecError(f"prompt {number} is a conversation (messages), and the tokenizer of "
                            f"{self.source} has no chat template; give one with --chat-template FILE")
        if use_template and self.template_from is not None:
            messages = prompt if conversation else [{"role": "user", "content": prompt}]
            try:
                text = self.tokenizer.apply_chat_template(messages, chat_template=self.template,
                                                          tokenize=False, add_generation_prompt=True)
            except Exception as e:  # noqa: BLE001 - a template's own error (an unknown role): one line
                raise SpecError(f"prompt {number}: {self.template_from} refused it ({type(e).__name__}: "
                                f"{one_line(e)})") from None
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]  # (the template writes them)
        else:
            ids = self.tokenizer(prompt)["input_ids"]
        if not ids:
            raise SpecError(f"prompt {number} gives no tokens; nothing to continue")
        return torch.tensor([ids], dtype=torch.long, device=self.device)


def load(source: str | Path, *, checkpoint: int | None = None, chat_template: str | Path | None = None,
         device: str = "auto") -> Generator:
    """The model and tokenizer of ``source`` (a run directory, or a folder in the ``save_pretrained``
    layout) on ``device`` (``auto``, ``cpu``, ``cuda``), with the chat template to apply: the file
    ``chat_template``, else a run's own, else the tokenizer's (see the module docstring)."""
    from aqsgd.comm.device import resolve_device

    where = resolve_device(device)
    source = Path(source)
    template = _template_file(chat_template) if chat_template is not None else None
    kind = _source_kind(source)
    if kind != "run" and checkpoint is not None:
        raise SpecError(f"--checkpoint {checkpoint}: {source} is a model folder, not a run directory; a "
                        "checkpoint step names one of a run's checkpoints")
    if kind == "run":
        model, tokenizer, own, said = _from_run(source, checkpoint)
    else:
        model, tokenizer = _from_adapter(source) if kind == "adapter" else _from_folder(source)
        own, said = None, str(source)
    if template is not None:
        text, template_from = template, f"--chat-template {chat_template}"
    elif own is not None:
        text, template_from = own, "the chat template the run was trained with"
    elif getattr(tokenizer, "chat_template", None):  # (passed as None: the tokenizer picks among several)
        text, template_from = None, "the tokenizer's chat template"
    else:
        text, template_from = None, None
    return Generator(model.to(where).eval(), tokenizer, text, template_from, said, where)


def generate(source: str | Path, prompts: Sequence[Prompt], *, checkpoint: int | None = None,
             chat_template: str | Path | None = None, use_chat_template: bool = True,
             sampling: Sampling | None = None, seed: int | None = None, device: str = "auto") -> list[str]:
    """The answers of ``source``'s model to ``prompts`` (see :func:`load` and :meth:`Generator.answer`)."""
    if chat_template is not None and not use_chat_template:
        raise SpecError("--chat-template and --no-chat-template: give one or the other")
    if not prompts:
        raise SpecError("no prompts to answer; give --prompt TEXT or --prompts FILE")
    generator = load(source, checkpoint=checkpoint, chat_template=chat_template, device=device)
    return generator.answer(prompts, sampling=sampling, seed=seed, use_template=use_chat_template)


def read_prompts(path: str | Path) -> list[Prompt]:
    """The prompts of ``--prompts FILE``: a ``.jsonl`` file holds one JSON object a line, with a
    ``prompt`` (text) or a ``messages`` field (a conversation); any other file one prompt a line. Blank lines
    are skipped; a file with no prompt, a line that is no JSON object or lacks both fields, and a
    conversation of the wrong shape are refused in one line naming the file and the line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(f"--prompts {path}: cannot read it ({one_line(e)})") from None
    jsonl = path.suffix.lower() == ".jsonl"
    prompts: list[Prompt] = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            prompts.append(_json_prompt(line, f"--prompts {path} line {number}") if jsonl else line)
    if not prompts:
        how = "one JSON object a line" if jsonl else "one a line"
        raise SpecError(f"--prompts {path}: holds no prompts ({how})")
    return prompts


def _json_prompt(line: str, where: str) -> Prompt:
    try:
        row = json.loads(line)
    except ValueError as e:
        raise SpecError(f"{where}: not JSON ({one_line(e)})") from None
    if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
        raise SpecError(f'{where}: needs a JSON object with either a "prompt" field (text) or a "messages" '
                        'field (a list of {"role": ..., "content": ...})')
    if "prompt" in row:
        if not isinstance(row["prompt"], str) or not row["prompt"].strip():
            raise SpecError(f'{where}: "prompt" must be a non-empty string')
        return row["prompt"]
    messages = row["messages"]
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise SpecError(f'{where}: "messages" must be a non-empty list of {{"role": text, "content": text}}')
    return messages


def _template_file(path: str | Path) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(f"--chat-template {path}: cannot read it ({one_line(e)})") from None
    if not text.strip():
        raise SpecError(f"--chat-template {path}: is empty")
    return text


def _source_kind(source: Path) -> str:
    """``run`` (a run directory), ``adapter`` (a PEFT adapter folder) or ``folder`` (a model folder in the
    ``save_pretrained`` layout); anything else is one line."""
    from aqsgd.train.export import MODEL_FILE

    if not source.exists():
        raise SpecError(f"{source}: no such run directory or model folder")
    if not source.is_dir():
        raise SpecError(f"{source}: is a file; give a run directory or a model folder (save_pretrained "
                        "layout)")
    if (source / "checkpoints").is_dir() or (source / MODEL_FILE).is_file():
        return "run"
    if (source / "adapter_config.json").is_file():
        return "adapter"
    try:
        config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = None
    if isinstance(config, dict) and "model_type" in config:
        return "folder"
    raise SpecError(f"{source}: neither a run directory (it has no checkpoints/ and no {MODEL_FILE}) nor a "
                    "model folder in the save_pretrained layout (it has no config.json of a transformers "
                    "model)")


def _from_run(run: Path, checkpoint: int | None) -> tuple[Any, Any, str | None, str]:
    """A run's model (merged, with its model folder's generation settings), its tokenizer, the chat template
    it was trained with (None: none named) and the source as said in the output."""
    from transformers import AutoTokenizer

    from aqsgd.train.checkpoint.manifest import head
    from aqsgd.train.export import _checkpoint, _description, generation_ready, run_chat_template, run_model

    path = _checkpoint(run, checkpoint, "generate from")
    _, state = head(path)
    described = state.get("model") or _description(run)
    if described.get("kind", "causal-lm") != "causal-lm":
        raise SpecError(f"{run}: a {described['kind']} run; generate needs a causal language model")
    if described.get("model_folder") is None:
        raise SpecError(f"{run}: its model ({described['recipe'].get('kind')}) is a bundled random model "
                        "with no tokenizer; generate needs a model folder's tokenizer")
    model, described, path = run_model(run, checkpoint=checkpoint)
    template = run_chat_template(run, described["settings"])
    try:
        tokenizer = AutoTokenizer.from_pretrained(described["model_folder"])
    except Exception as e:  # noqa: BLE001 - a moved or deleted model folder: one line
        raise SpecError(f"{run}: the tokenizer of its model ({described['model_folder']}) cannot be loaded "
                        f"({one_line(e)})") from None
    return generation_ready(model, described), tokenizer, template, f"{run} ({path.name})"


def _causal_lm(source: Path, config: dict[str, Any], what: str) -> None:
    """One line where the transformers ``config`` of ``source`` names no causal LM class (a classifier)."""
    classes = config.get("architectures") or []
    if classes and not any(c.endswith(_CAUSAL_LM_CLASSES) for c in classes):
        raise SpecError(f"{source}: {what} is a {classes[0]}, not a causal language model; generate needs "
                        "one")


def _from_folder(folder: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM

    _causal_lm(folder, json.loads((folder / "config.json").read_text(encoding="utf-8")), "its model")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001 - missing or damaged weights, an unknown model type: one line
        raise SpecError(f"{folder}: cannot load its model ({type(e).__name__}: {one_line(e)})") from None
    return model, _tokenizer(folder)


def _from_adapter(folder: Path) -> tuple[Any, Any]:
    """A PEFT adapter folder's adapters merged onto its base model (``base_model_name_or_path``)."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    from aqsgd.train.lora import HEAD_NAMES

    try:
        adapter = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
        base = adapter["base_model_name_or_path"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SpecError(f"{folder}/adapter_config.json: not an adapter config naming its base model "
                        f"({one_line(e)})") from None
    if set(adapter.get("modules_to_save") or ()) & set(HEAD_NAMES):
        heads = ", ".join(adapter["modules_to_save"])
        raise SpecError(f"{folder}: the adapter of a classifier (it trains {heads}); generate needs a causal "
                        "language model")
    try:
        _causal_lm(folder, AutoConfig.from_pretrained(base).to_dict(), f"its base model {base}")
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(folder))
    except SpecError:
        raise
    except Exception as e:  # noqa: BLE001 - a base that is not here (a hub name offline, a moved folder)
        raise SpecError(f"{folder}: its base model {base} cannot be loaded ({type(e).__name__}: "
                        f"{one_line(e)}); generate from the run, or export it with --lora-export "
                        "merged") from None
    return model.merge_and_unload(), _tokenizer(folder)


def _tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001 - a folder with the weights only: one line
        raise SpecError(f"{folder}: holds no tokenizer that loads ({type(e).__name__}: {one_line(e)}); "
                        "generate needs the model's tokenizer beside it") from None
