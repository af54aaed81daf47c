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

The export is what the run's model is used as, so it carries what using it needs: the tokenizer's chat
template (the run's own, :func:`run_chat_template`, set on the tokenizer before it is saved: what the run was
trained with where it named one) and the model folder's generation settings (``generation_config.json``)
where the model the run started from has them.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from aqsgd.errors import AqsgdError, SpecError
from aqsgd.train.checkpoint import CheckpointError, latest_checkpoint
from aqsgd.train.checkpoint.layout import one_line
from aqsgd.train.checkpoint.manifest import head

if TYPE_CHECKING:
    from aqsgd.pipeline.partition import StageCut

__all__ = ["CHAT_TEMPLATE_FILE", "MODEL_FILE", "describe_run", "export_run", "generation_ready",
           "load_stage_weights", "model_description", "run_chat_template", "run_model"]

log = logging.getLogger(__name__)

MODEL_FILE = "model.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
"""A run's copy of the chat template it was trained with (``--chat-template FILE``), written when it starts:
what export and generate use, whatever became of the file since."""
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def model_description(task: Any) -> dict[str, Any]:
    """What ``RUN/model.json`` records of a run's model (``task``: its :class:`~aqsgd.train.tasks.TaskSetup`):
    the recipe (its weights: the prepared initial weights, which a LoRA export needs as the frozen base), the
    task kind and the folder whose tokenizer tokenized the data (None for the bundled models)."""
    recipe = task.recipe.to_dict()  # its weights: the prepared initial weights (a LoRA run's frozen base)
    return {"format": "aqsgd-model", "version": 1, "kind": task.kind, "task": task.name, "recipe": recipe,
            "model_folder": None if task.model_folder is None else str(task.model_folder),
            "model": task.model_name, "base_sha256": task.base_sha256}


def _checkpoint(run: Path, step: int | None, purpose: str) -> Path:
    """The newest complete checkpoint of ``run`` (or step ``step``'s), for ``purpose`` (export, evaluate)."""
    if not run.is_dir():
        raise CheckpointError(f"{run}: no such run directory")
    if step is None:
        found = latest_checkpoint(run)
        if found is None:
            raise CheckpointError(f"{run}: no complete checkpoint to {purpose} (is it a run directory? a run "
                                  "writes its first checkpoint at the end of its first epoch, or every "
                                  "--checkpoint-every steps)")
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


def load_stage_weights(model: torch.nn.Module, checkpoint: Path, cut: StageCut, *, lora: bool) -> None:
    """Load a checkpoint's stage files into the full ``model``: cut it into the run's stages (``cut``) and
    load each stage's verified tensors into its stage. A LoRA run's checkpoint (``lora``) holds only the
    adapters (and the trained head), which ``model`` must already carry."""
    from safetensors.torch import load_file

    manifest, _ = head(checkpoint)
    parts = cut.cut(model)
    files = [f"stage{i}/model.safetensors" for i in range(cut.stages)]
    manifest.verify(files)
    for i, (part, rel) in enumerate(zip(parts, files)):
        tensors = load_file(str(checkpoint / rel))
        result = part.load_state_dict(tensors, strict=False)
        own = dict(part.named_parameters(remove_duplicate=False))  # a tied tensor under each of its names
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
    from aqsgd.pipeline.partition import StageCut
    from aqsgd.train.config import PipelineSection, flatten_config

    run = Path(run)
    path = _checkpoint(run, checkpoint, "export")
    _, state = head(path)
    # the checkpoint's own copy (verified by its manifest); runs whose checkpoints lack it: RUN/model.json
    described = state.get("model") or _description(run)
    try:
        recipe = ModelRecipe.from_dict(described["recipe"])
    except Exception as e:  # noqa: BLE001 - an edited or damaged description: one line naming it
        raise SpecError(f"{run / MODEL_FILE}: not a model description aqsgd can read "
                        f"({one_line(e)})") from None
    if not get_family(recipe.kind).model_types:
        raise SpecError(f"{run}: its model ({recipe.kind}) is not a transformers model; its trained weights "
                        f"are the stage files {path}/stage*/model.safetensors")
    settings = flatten_config(state.get("config", {}))
    cut = StageCut.from_flat(settings, PipelineSection())
    torch.manual_seed(0)  # the weights are all replaced; a fixed seed keeps stray buffers reproducible
    model = recipe.build("cpu")
    if settings.get("lora"):  # the checkpoint holds the adapters and the head: the base comes from its file
        from aqsgd.pipeline.materialize import load_weights
        from aqsgd.train.config import OptimSection
        from aqsgd.train.lora import LoraSettings, add_adapters
        from aqsgd.train.modelfiles import check_same_base, model_digest

        if recipe.weights is None or not Path(recipe.weights).exists():
            raise SpecError(f"{run}: the frozen base weights of this LoRA run ({recipe.weights}) are gone (a "
                            "cleared cache?); run `aqsgd train` with the run's model again to prepare them")
        if Path(recipe.weights).is_dir():  # read from the model's own folder (a prepared file is named by it)
            from aqsgd.data.sources import default_cache_dir

            memo = Path(settings.get("cache_dir") or default_cache_dir()) / "weights"
            check_same_base(state.get("base_sha256") or described.get("base_sha256"),
                            model_digest(Path(recipe.weights), memo), recipe.weights, str(run))
        load_weights(model, recipe.weights)
        seed = int(settings.get("seed", OptimSection().seed))
        targets = add_adapters(cut.cut(model), LoraSettings.from_flat(settings), model=model, seed=seed)
        described = {**described, "targets": targets}
    load_stage_weights(model, path, cut, lora=bool(settings.get("lora")))
    return model.eval(), {**described, "settings": settings}, path


EXPORT_MARKER = "aqsgd-export.json"
"""The file every export holds: what it was exported from and every entry it wrote (what ``--overwrite`` may
replace)."""
# the entries of an export written before the marker listed them: save_pretrained's and the tokenizers' files
_EXPORT_NAMES = re.compile(
    r"(config|generation_config|adapter_config|tokenizer_config|tokenizer|special_tokens_map|added_tokens|"
    r"vocab|merges|chat_template|preprocessor_config)\.[a-z]+|model(-\d+-of-\d+)?\.safetensors|"
    r"model\.safetensors\.index\.json|adapter_model\.safetensors|README\.md|[a-z_.]*\.model|"
    + re.escape(EXPORT_MARKER))


def _export_entries(out: Path) -> set[str] | None:
    """The entries an earlier export in ``out`` wrote (from its marker), or None: ``out`` is no export."""
    try:
        marker = json.loads((out / EXPORT_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or "run" not in marker or "checkpoint" not in marker:
        return None
    files = marker.get("files")
    if isinstance(files, list):
        return {str(f) for f in files} | {EXPORT_MARKER}
    return {p.name for p in out.iterdir() if _EXPORT_NAMES.fullmatch(p.name)}


def check_out(run: Path, out: Path, overwrite: bool) -> None:
    """``out`` may receive an export of ``run``: not the run, a folder inside it or above it, not the working
    directory or a folder above it, and either new, empty, or (with ``overwrite``) an earlier export holding
    nothing else. One line naming ``--out`` otherwise. Read-only: nothing is deleted here."""
    from aqsgd.train.rundir import holds_working_dir

    here, target = run.resolve(), out.resolve()
    if target == here or here in target.parents or target in here.parents:
        raise SpecError(f"--out {out}: is the run {run} itself, inside it or a folder that holds it; "
                        "choose a folder of its own")
    if holds_working_dir(out):
        raise SpecError(f"--out {out}: is the working directory or holds it; choose a folder of its own")
    if out.exists() and not out.is_dir():
        raise SpecError(f"--out {out}: exists and is not a folder")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise SpecError(f"--out {out}: exists and is not empty; choose another folder or pass --overwrite "
                        "(which replaces an earlier export only)")
    ours = _export_entries(out)
    if ours is None:
        raise SpecError(f"--out {out}: --overwrite replaces only an earlier aqsgd export (a folder with "
                        f"{EXPORT_MARKER}); this one is something else")
    foreign = sorted(p.name for p in out.iterdir() if p.name not in ours)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise SpecError(f"--out {out}: holds {shown} besides an earlier export; --overwrite replaces an "
                        "export only: move those away first")


def _swap_in(tmp: Path, out: Path) -> None:
    """Put the complete export ``tmp`` in place of ``out`` (an earlier export, or nothing): the earlier one
    is moved aside first and deleted only once the new one is in place, and put back if that fails."""
    old = out.with_name(f".{out.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        os.replace(out, old)
    try:
        os.replace(tmp, out)
    except OSError:
        if old.exists():
            os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def export_run(run: str | Path, out: str | Path, *, checkpoint: int | None = None, dtype: str = "fp32",
               lora: str | None = None, overwrite: bool = False) -> Path:
    """Write the run's trained model (newest checkpoint, or that of step ``checkpoint``) to the folder ``out``
    in the ``save_pretrained`` layout, with its tokenizer; returns ``out``. ``dtype``: ``fp32`` (as trained)
    or ``bf16``/``fp16``. ``lora`` (LoRA runs only): ``merged`` into the weights (the default), or
    ``adapter`` (a PEFT adapter folder, to load onto the base model with ``PeftModel.from_pretrained``).

    An existing non-empty ``out`` is replaced only with ``overwrite``, and only if it is an earlier export
    holding nothing else (:func:`check_out`). The export is written beside ``out`` and swapped in once
    complete: a failure (a damaged checkpoint, a full disk) leaves any earlier export as it was."""
    if dtype not in _DTYPES:
        raise SpecError(f"--dtype: {dtype!r} is not one of {', '.join(_DTYPES)}")
    if lora not in (None, "merged", "adapter"):
        raise SpecError(f"--lora-export: {lora!r} is not one of merged, adapter")
    run, out = Path(run), Path(out)
    _checkpoint(run, checkpoint, "export")  # (a run with something to export, before where it goes)
    check_out(run, out, overwrite)
    out = out.resolve()
    tmp = out.with_name(f".{out.name}.tmp")
    try:  # before the work: a read-only or missing parent fails here, in one line
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    except OSError as e:
        raise SpecError(f"--out {out}: cannot write there ({e.strerror or e})") from None
    try:
        path = _write_export(run, tmp, checkpoint=checkpoint, dtype=dtype, lora=lora)
        _swap_in(tmp, out)
    except AqsgdError:
        raise
    except Exception as e:  # a full disk (safetensors wraps its OSError), a folder made read-only meanwhile
        raise SpecError(f"--out {out}: cannot write the export ({one_line(e)}); nothing was "
                        "replaced") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("exported %s to %s", path, out)
    return out


def _write_export(run: Path, tmp: Path, *, checkpoint: int | None, dtype: str, lora: str | None) -> Path:
    """Write the export of ``run`` into the empty folder ``tmp``; returns the checkpoint folder used."""
    model, described, path = run_model(run, checkpoint=checkpoint)
    to = _DTYPES[dtype]
    is_lora = bool(described["settings"].get("lora"))
    if lora is not None and not is_lora:
        raise SpecError(f"--lora-export {lora}: {run} is a full fine-tuning, not a LoRA run; it has no "
                        "adapters to export (leave --lora-export out)")
    lora = lora or "merged"
    template = run_chat_template(run, described["settings"])  # (a template gone: refused before the writing)
    if is_lora and lora == "adapter":  # a PEFT folder over the model the run started from
        from aqsgd.pipeline.materialize import ModelRecipe, load_weights
        from aqsgd.train import lora as lora_

        recipe = ModelRecipe.from_dict(described["recipe"])
        base = load_weights(recipe.build("cpu"), recipe.weights)  # type: ignore[arg-type]
        adapters = lora_.LoraSettings.from_flat(described["settings"])
        wrapped = lora_.peft_model(model, base, adapters, described["targets"])
        wrapped.peft_config["default"].base_model_name_or_path = base_model_name(described)
        wrapped.to(to).save_pretrained(str(tmp))
    else:
        generation_ready(model, described).to(to).save_pretrained(str(tmp))
    _save_tokenizer(described, tmp, template)
    files = sorted(p.name for p in tmp.iterdir()) + [EXPORT_MARKER]
    (tmp / EXPORT_MARKER).write_text(json.dumps(
        {"run": str(run.resolve()), "checkpoint": path.name, "dtype": dtype,
         "lora": lora if is_lora else None, "task": described.get("task"),
         "base_model": described.get("model"), "base_sha256": described.get("base_sha256"), "files": files},
        indent=1))
    return path


def base_model_name(described: dict[str, Any]) -> str | None:
    """The base model as the run named it (``--model``: a hub name, the user's folder, or an offline source
    such as ``smollm2``), for an adapter's ``base_model_name_or_path``; not the folder aqsgd prepared it in,
    which means nothing on another machine. Runs recorded before the name was: the folder."""
    return described.get("model") or described.get("model_folder")


def generation_ready(model: torch.nn.Module, described: dict[str, Any]) -> torch.nn.Module:
    """The run's model (from :func:`run_model`, with its ``described``) as one plain transformers model: a
    LoRA run's adapters merged into a fresh copy of the architecture, and a causal LM given the generation
    settings of the model folder it started from (its ``generation_config.json``: an instruct model's end
    tokens, its sampling defaults), where that folder has them. What ``save_pretrained`` writes as the
    export, and what ``aqsgd generate`` runs."""
    if described["settings"].get("lora"):
        from aqsgd.pipeline.materialize import ModelRecipe
        from aqsgd.train import lora as lora_

        model = lora_.merged(model, ModelRecipe.from_dict(described["recipe"]).build("cpu")).eval()
    folder = described.get("model_folder")
    can_generate = getattr(model, "can_generate", None)
    if folder is None or not callable(can_generate) or not can_generate():
        return model
    file = Path(folder) / "generation_config.json"
    if file.is_file():
        from transformers import GenerationConfig

        try:
            model.generation_config = GenerationConfig.from_pretrained(folder)
        except Exception as e:  # noqa: BLE001 - the weights do not depend on it: said, and the model's own kept
            log.warning("%s could not be read (%s); the model's generation settings are those of its config",
                        file, one_line(e))
    return model


def run_chat_template(run: Path, settings: dict[str, Any]) -> str | None:
    """The chat template ``run`` was trained with (``settings``: its flat settings): its copy in the run
    directory (:data:`CHAT_TEMPLATE_FILE`), else the file its ``--chat-template`` names; None where it named
    none (the tokenizer's own then applies). A named file that is gone, with no copy: one line."""
    copy = run / CHAT_TEMPLATE_FILE
    if copy.is_file():
        return copy.read_text(encoding="utf-8")
    named = settings.get("chat_template")
    if not named:
        return None
    try:
        return Path(named).read_text(encoding="utf-8")
    except OSError as e:
        raise SpecError(f"{run}: the chat template it was trained with, --chat-template {named}, cannot be "
                        f"read ({one_line(e)}) and the run holds no copy ({CHAT_TEMPLATE_FILE}); put the "
                        f"file back there or copy it to {copy}") from None


def _save_tokenizer(described: dict[str, Any], out: Path, template: str | None = None) -> None:
    """The run's tokenizer into ``out``, with ``template`` (the run's chat template) as its chat template
    where there is one, so that a plain ``AutoTokenizer.from_pretrained(out)`` applies it."""
    folder = described.get("model_folder")
    if folder is None:
        log.warning("the run's model has no tokenizer folder (a bundled random model): none is exported")
        return
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        if template is not None:
            tokenizer.chat_template = template
        tokenizer.save_pretrained(str(out))
    except Exception as e:  # noqa: BLE001 - a moved or deleted folder: the weights are still worth having
        log.warning("the tokenizer of %s could not be copied (%s: %s); the export holds the weights only%s",
                    folder, type(e).__name__, " ".join(str(e).split())[:200],
                    " (and not the run's chat template)" if template is not None else "")


def describe_run(run_dir: Path, cfg: Any, task: Any) -> None:
    """Write what a run is into its directory: its config, its data (the label set, files and their
    fingerprints: what the model was trained on), its model (the architecture and where its tokenizer
    lives: what ``aqsgd export`` rebuilds) and a copy of its chat template (:data:`CHAT_TEMPLATE_FILE`)
    where it names one."""
    config = cfg.to_dict()
    (run_dir / "config.json").write_text(json.dumps(config, indent=1))
    if task.data_info:
        (run_dir / "data.json").write_text(json.dumps(task.data_info, indent=1))
    (run_dir / MODEL_FILE).write_text(json.dumps(model_description(task), indent=1))
    _copy_chat_template(run_dir, config)


def _copy_chat_template(run_dir: Path, config: dict[str, Any]) -> None:
    """Copy the run's ``--chat-template`` file (``config``: its nested config) into ``run_dir``, so that
    export and generate apply the template it was trained with even once the file has moved or changed. A
    resumed run whose file is gone keeps the copy it made when it started."""
    from aqsgd.train.config import flatten_config

    named = flatten_config(config).get("chat_template")
    if not named:
        return
    try:
        text = Path(named).read_text(encoding="utf-8")
    except OSError as e:
        if (run_dir / CHAT_TEMPLATE_FILE).is_file():
            return
        raise SpecError(f"--chat-template {named}: cannot read it ({one_line(e)})") from None
    (run_dir / CHAT_TEMPLATE_FILE).write_text(text, encoding="utf-8")
