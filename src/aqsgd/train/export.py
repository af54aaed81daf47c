"""``aqsgd export``: a trained run's checkpoint as a Hugging Face folder.

A checkpoint holds one ``stage{i}/model.safetensors`` per pipeline stage, named as the stage module names its
tensors (stage-local). The stages of a pipeline reference the sub-modules of the full model (see
:func:`~aqsgd.pipeline.partition.partition_model`), so the way back is the way there: build the full model
from the run's recipe, cut it into the same stages, load each stage's tensors into its stage (strictly: every
tensor of the stage, nothing else), and the full model holds the trained weights; ``save_pretrained`` then
writes the standard layout, with the tokenizer the data were tokenized with and, for a classifier, its label
names (``id2label``). ``AutoModelFor...from_pretrained(DIR)`` loads it as any other folder.

What the run was trained on is recorded when it starts, in ``RUN/model.json`` (:func:`model_description`):
the recipe (family and config, with the run's classification head and dropout) and the folder of the
model's tokenizer. A LoRA run is merged into the base weights (``--lora-export merged``, the default) or
written as a PEFT adapter folder beside the base model's name (``adapter``).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from aqsgd.errors import SpecError
from aqsgd.train.checkpoint import CheckpointError, latest_checkpoint
from aqsgd.train.checkpoint.manifest import head

__all__ = ["MODEL_FILE", "export_run", "model_description", "run_model", "load_stage_weights"]

log = logging.getLogger(__name__)

MODEL_FILE = "model.json"


def model_description(task: Any) -> dict[str, Any]:
    """What ``RUN/model.json`` records of a run's model (``task``: its :class:`~aqsgd.train.tasks.TaskSetup`):
    the recipe (its weights: the prepared initial weights, which a LoRA export needs as the frozen base), the
    task kind and the folder whose tokenizer tokenized the data (None for the bundled models)."""
    recipe = task.recipe.to_dict()  # its weights: the prepared initial weights (a LoRA run's frozen base)
    return {"format": "aqsgd-model", "version": 1, "kind": task.kind, "task": task.name, "recipe": recipe,
            "model_folder": None if task.model_folder is None else str(task.model_folder)}


def _checkpoint(run: Path, step: int | None) -> Path:
    if step is None:
        found = latest_checkpoint(run)
        if found is None:
            raise CheckpointError(f"{run}: no complete checkpoint to export (is it a run directory?)")
        return found
    path = run / "checkpoints" / f"step-{step:08d}"
    if not (path / "COMPLETE").is_file():
        done = sorted(p.name for p in (run / "checkpoints").glob("step-*[0-9]") if (p / "COMPLETE").is_file())
        raise CheckpointError(f"--checkpoint {step}: {run} has no complete checkpoint of that step (it has "
                              f"{', '.join(done) or 'none'})")
    return path


def _description(run: Path) -> dict[str, Any]:
    file = run / MODEL_FILE
    if not file.is_file():
        raise SpecError(f"{run}: no {MODEL_FILE} (the model a run trains is recorded there when it starts; "
                        "this run is older, or not a run directory)")
    try:
        data = json.loads(file.read_text())
        assert isinstance(data, dict) and data.get("format") == "aqsgd-model"
    except (ValueError, AssertionError):
        raise SpecError(f"{file}: not a model description written by aqsgd train") from None
    return data


def load_stage_weights(model: torch.nn.Module, checkpoint: Path, settings: dict[str, Any]) -> None:
    """Load a checkpoint's stage files into the full ``model``: cut it into the run's stages (``settings``:
    the run's flat config) and load each stage's verified tensors into its stage. A LoRA run's checkpoint
    holds only the adapters (and the trained head), which ``model`` must already carry."""
    from safetensors.torch import load_file

    from aqsgd.pipeline.partition import partition_model

    manifest, _ = head(checkpoint)
    stages = int(settings.get("stages", 1))
    parts = partition_model(model, stages, layers=settings.get("layers"),
                            balance=settings.get("balance", "layers"))
    files = [f"stage{i}/model.safetensors" for i in range(stages)]
    manifest.verify(files)
    lora = bool(settings.get("lora"))
    for i, (part, rel) in enumerate(zip(parts, files)):
        tensors = load_file(str(checkpoint / rel))
        result = part.load_state_dict(tensors, strict=False)
        own = dict(part.named_parameters())
        # tied tensors are saved once per stage; a LoRA checkpoint holds only what was trained
        missing = [n for n in result.missing_keys
                   if not lora and n in own and not any(own[n] is own[t] for t in tensors if t in own)]
        if missing or result.unexpected_keys:
            what = "; ".join(x for x in (
                f"missing {sorted(missing)[:6]}" if missing else "",
                f"unexpected {sorted(result.unexpected_keys)[:6]}" if result.unexpected_keys else "") if x)
            raise CheckpointError(f"{checkpoint / rel}: does not fit stage {i} of the run's model ({what})")


def run_model(run: str | Path, *, checkpoint: int | None = None) -> tuple[torch.nn.Module, dict[str, Any],
                                                                            Path]:
    """The full model of a run with the weights of its newest (or ``checkpoint``-th step's) checkpoint, in
    evaluation mode on the CPU; with the model description and the checkpoint folder."""
    from aqsgd.models.registry import get_family
    from aqsgd.pipeline.materialize import ModelRecipe
    from aqsgd.train.config import flatten_config

    run = Path(run)
    path = _checkpoint(run, checkpoint)
    described = _description(run)
    recipe = ModelRecipe.from_dict(described["recipe"])
    if not get_family(recipe.kind).model_types:
        raise SpecError(f"{run}: its model ({recipe.kind}) is not a transformers model; its trained weights "
                        f"are the stage files {path}/stage*/model.safetensors")
    _, state = head(path)
    settings = flatten_config(state.get("config", {}))
    torch.manual_seed(0)  # the weights are all replaced; a fixed seed keeps stray buffers reproducible
    model = recipe.build("cpu")
    if settings.get("lora"):  # the checkpoint holds the adapters and the head: the base comes from its file
        from aqsgd.pipeline.materialize import load_weights
        from aqsgd.train.lora import add_adapters

        if recipe.weights is None or not Path(recipe.weights).exists():
            raise SpecError(f"{run}: the frozen base weights of this LoRA run ({recipe.weights}) are gone (a "
                            "cleared cache?); run `aqsgd train` with the run's model again to prepare them")
        load_weights(model, recipe.weights)
        described = {**described, "targets": add_adapters(model, settings)}
    load_stage_weights(model, path, settings)
    return model.eval(), {**described, "settings": settings}, path


def export_run(run: str | Path, out: str | Path, *, checkpoint: int | None = None, dtype: str = "fp32",
               lora: str = "merged", overwrite: bool = False) -> Path:
    """Write the run's trained model (newest checkpoint, or that of step ``checkpoint``) to the folder ``out``
    in the ``save_pretrained`` layout, with its tokenizer; returns ``out``. ``dtype``: ``fp32`` (as trained)
    or ``bf16``/``fp16``. ``lora`` (LoRA runs): ``merged`` into the weights, or ``adapter`` (a PEFT adapter
    folder, to load onto the base model with ``PeftModel.from_pretrained``). An existing non-empty ``out``
    is replaced only with ``overwrite``."""
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if dtype not in dtypes:
        raise SpecError(f"--dtype: {dtype!r} is not one of {', '.join(dtypes)}")
    if lora not in ("merged", "adapter"):
        raise SpecError(f"--lora-export: {lora!r} is not one of merged, adapter")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not overwrite:
            raise SpecError(f"--out {out}: exists and is not empty; choose another folder or pass "
                            "--overwrite")
        if not (out / "config.json").is_file():
            raise SpecError(f"--out {out}: --overwrite replaces only an exported model folder (one with "
                            "config.json); this one is something else")
        shutil.rmtree(out)
    model, described, path = run_model(run, checkpoint=checkpoint)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    is_lora = bool(described["settings"].get("lora"))
    if is_lora:
        from aqsgd.pipeline.materialize import ModelRecipe
        from aqsgd.train import lora as lora_

        recipe = ModelRecipe.from_dict(described["recipe"])
        if lora == "adapter":  # a PEFT folder over the model the run started from
            from aqsgd.pipeline.materialize import load_weights

            base = load_weights(recipe.build("cpu"), recipe.weights)  # type: ignore[arg-type]
            wrapped = lora_.peft_model(model, base, described["settings"], described["targets"])
            wrapped.peft_config["default"].base_model_name_or_path = described.get("model_folder")
            wrapped.to(dtypes[dtype]).save_pretrained(str(tmp))
        else:
            lora_.merged(model, recipe.build("cpu")).to(dtypes[dtype]).save_pretrained(str(tmp))
    else:
        model.to(dtypes[dtype]).save_pretrained(str(tmp))
    _save_tokenizer(described, tmp)
    (tmp / "aqsgd-export.json").write_text(json.dumps(
        {"run": str(Path(run).resolve()), "checkpoint": path.name, "dtype": dtype,
         "lora": lora if is_lora else None, "task": described.get("task")},
        indent=1))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.replace(out)
    log.info("exported %s to %s", path, out)
    return out


def _save_tokenizer(described: dict[str, Any], out: Path) -> None:
    folder = described.get("model_folder")
    if folder is None:
        log.warning("the run's model has no tokenizer folder (a bundled random model): none is exported")
        return
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(folder).save_pretrained(str(out))
    except Exception as e:  # noqa: BLE001 - a moved or deleted folder: the weights are still worth having
        log.warning("the tokenizer of %s could not be copied (%s: %s); the export holds the weights only",
                    folder, type(e).__name__, " ".join(str(e).split())[:200])
