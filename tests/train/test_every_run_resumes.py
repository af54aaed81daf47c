"""Every run ``aqsgd train`` can make evaluates, resumes and exports: each model family, full fine-tuning and
LoRA, one stage and two, fixed codecs and links that choose their bits (``auto``). A run trains a step,
stops, resumes to its second step, then ``aqsgd eval`` gives its final evaluation and ``aqsgd export`` a
folder that ``from_pretrained`` loads; with ``-m exhaustive`` every case also checks that the resumed losses
equal an uninterrupted run's (the default suite checks that for the tied-embedding LoRA case below, and
``test_checkpoint_integrity``/``test_lora`` for the rest of the machinery).

The default suite runs each family in two of the four (fine-tuning, stages) combinations, alternating, so that
each combination meets seven families, and one ``auto`` case (it needs the distributed runtime: a process per
stage, started three times); ``-m exhaustive`` runs all of them."""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from aqsgd.train.config import TrainConfig
from aqsgd.train.evaluate import evaluate_run
from aqsgd.train.export import export_run
from aqsgd.train.trainer import Trainer

from test_own_data import _save_model, _sentences

# model_type (config.json) -> whether it is a causal LM (else a sequence classifier)
FAMILIES = {"llama": True, "mistral": True, "qwen2": True, "qwen3": True, "gemma2": True, "gemma3_text": True,
            "phi3": True, "olmo2": True, "gpt2": True, "gpt_neox": True, "bert": False, "roberta": False,
            "deberta-v2": False, "distilbert": False}
# the auto case of the default suite (a distributed run starts a process per stage, three times: about half a
# minute on two cores); every family's with -m exhaustive
AUTO_DEFAULT = {("llama", True, 2)}


# tiny models: one intra-op thread is faster than two, above all on a busy machine
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def family_data(tmp_path_factory, tokenizer_dir):
    """Per model type, a tiny random model folder with the tests' tokenizer, and its training file."""
    root = tmp_path_factory.mktemp("families")
    made: dict[str, tuple[Path, Path]] = {}

    def get(model_type: str) -> tuple[Path, Path]:
        if model_type not in made:
            causal = FAMILIES[model_type]
            torch.manual_seed(0)
            folder = _save_model(root / model_type, tokenizer_dir, model_type,
                                 "AutoModelForCausalLM" if causal else "AutoModelForSequenceClassification")
            if causal:
                data = root / f"{model_type}.txt"
                data.write_text("\n".join(_sentences(40, 1)) + "\n", encoding="utf-8")
            else:
                data = root / f"{model_type}.csv"
                with open(data, "w", newline="", encoding="utf-8") as f:
                    w = csv.writer(f)
                    w.writerow(["text", "label"])
                    for s in _sentences(40, 2):
                        w.writerow([s, "animal" if {"cat", "dog"} & set(s.split()) else "other"])
            made[model_type] = folder, data
        return made[model_type]

    return get


def _cfg(out: Path, folder: Path, data: Path, *, lora: bool, stages: int, auto: bool, **kw) -> TrainConfig:
    settings = dict(model=str(folder), train_file=str(data), max_length=12, stages=stages, micro_batches=2,
                    micro_batch_size=2, epochs=1, max_steps=2, warmup_epochs=0, lr=1e-2, lora=lora,
                    output_dir=str(out), cache_dir=str(out / "cache"), progress=False, tensorboard=False,
                    checkpoint_every=1, timeout=60.0)
    if auto:
        settings.update(runtime="distributed", forward="auto", backward="auto")
    else:
        settings.update(forward="delta:q4", backward="direct:q8")
    settings.update(kw)
    return TrainConfig.of(**settings)


def _losses(run: Path) -> list[float]:
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] == "train"]


def _run(cfg: TrainConfig, **kw) -> None:
    from aqsgd.train.driver import run_training

    if cfg.pipeline.runtime == "local":
        Trainer(cfg).run(**kw)
    else:
        assert not kw  # a distributed run stops at its --max-steps instead
        run_training(cfg)


def _check(tmp_path: Path, family_data, model_type: str, lora: bool, stages: int, auto: bool,
           exact: bool) -> None:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    folder, data = family_data(model_type)
    cfg = _cfg(tmp_path, folder, data, lora=lora, stages=stages, auto=auto)
    if auto:  # stopped by its --max-steps after step 1, then resumed for step 2
        _run(cfg.replace(run_name="part", max_steps=1))
    else:
        _run(cfg.replace(run_name="part"), stop_at=1)
    _run(cfg.replace(resume=str(tmp_path / "part")))
    assert len(_losses(tmp_path / "part")) == 2
    if exact:
        _run(cfg.replace(run_name="whole"))
        assert _losses(tmp_path / "part") == _losses(tmp_path / "whole")
    final = [json.loads(r) for r in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()][-1]
    evaluated = evaluate_run(tmp_path / "part")
    assert evaluated["step"] == 2
    for way in final["kind"] == "eval" and ("uncompressed", "compressed") or ():
        assert evaluated["eval"][way]["loss"] == pytest.approx(final[way]["loss"], rel=1e-5), way
    assert evaluated["auto_links"] == auto
    out = export_run(tmp_path / "part", tmp_path / "exported")
    auto_class = AutoModelForCausalLM if FAMILIES[model_type] else AutoModelForSequenceClassification
    model = auto_class.from_pretrained(str(out))
    assert model.config.model_type == model_type


def _cases(default: Callable[[int, bool, int], bool]) -> list[Any]:
    """Every (family, fine-tuning, stages), marked exhaustive unless ``default(family index, lora,
    stages)``."""
    return [pytest.param(t, lora, stages, id=f"{t}-{'lora' if lora else 'full'}-{stages}",
                         marks=() if default(i, lora, stages) else pytest.mark.exhaustive)
            for i, t in enumerate(FAMILIES) for lora in (False, True) for stages in (1, 2)]


def _slow_run(request) -> bool:
    return "exhaustive" in (request.config.getoption("-m") or "")


# even families: full on 1 stage, LoRA on 2; odd ones: full on 2, LoRA on 1
FIXED_CASES = _cases(lambda i, lora, stages: (stages == 2) == (lora == (i % 2 == 0)))
AUTO_CASES = _cases(lambda i, lora, stages: (list(FAMILIES)[i], lora, stages) in AUTO_DEFAULT)


@pytest.mark.parametrize("model_type,lora,stages", FIXED_CASES)
def test_a_fixed_run_resumes_evaluates_and_exports(tmp_path, family_data, model_type, lora, stages, request):
    _check(tmp_path, family_data, model_type, lora, stages, auto=False, exact=_slow_run(request))


@pytest.mark.parametrize("model_type,lora,stages", AUTO_CASES)
def test_an_auto_run_resumes_evaluates_and_exports(tmp_path, family_data, model_type, lora, stages, request):
    _check(tmp_path, family_data, model_type, lora, stages, auto=True, exact=_slow_run(request))


def test_a_one_stage_lora_run_of_tied_embeddings_resumes_exactly(tmp_path, family_data, tokenizer_dir):
    """SmolLM2's case: the LM head is the (frozen) embedding. A LoRA checkpoint holds neither name, and a
    resume must not miss the head."""
    torch.manual_seed(0)
    folder = _save_model(tmp_path / "tied", tokenizer_dir, "llama", "AutoModelForCausalLM",
                         tie_word_embeddings=True)
    _, data = family_data("llama")
    cfg = _cfg(tmp_path, folder, data, lora=True, stages=1, auto=False, max_steps=4, checkpoint_every=2)
    Trainer(cfg.replace(run_name="whole")).run()
    Trainer(cfg.replace(run_name="part")).run(stop_at=3)
    Trainer(cfg.replace(resume=str(tmp_path / "part"))).run()
    assert _losses(tmp_path / "part") == _losses(tmp_path / "whole")
    assert evaluate_run(tmp_path / "part")["step"] == 4
    export_run(tmp_path / "part", tmp_path / "exported")
