"""``aqsgd eval``: evaluate a run's checkpoint, with compression on and off at the stage boundaries.

The run's own settings (from the checkpoint) rebuild its pipeline in this process (the local runtime: the
same numbers as the distributed one), the checkpoint's verified stage weights are loaded, and the evaluation
data (the run's, or ``--eval-file`` in the format of its training file) go through it twice: with the run's
codecs at every boundary and uncompressed. A run whose links chose their bits (``auto``, trained distributed)
is evaluated with each link at the level it had reached at the checkpoint. Nothing is written into the run
directory.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

from aqsgd.errors import SpecError
from aqsgd.pipeline.compression import BACKWARD_CHANNEL, FORWARD_CHANNEL, DirectionSpec
from aqsgd.train.adaptive import parse_link
from aqsgd.train.checkpoint import CheckpointError
from aqsgd.train.modelfiles import check_same_base

__all__ = ["evaluate_run"]

log = logging.getLogger(__name__)


def evaluate_run(run: str | Path, *, checkpoint: int | None = None, eval_file: str | None = None,
                 max_eval_samples: int | None = None, device: str | None = None) -> dict[str, Any]:
    """Evaluate the newest (or step ``checkpoint``'s) checkpoint of ``run``; returns ``{"checkpoint": path,
    "step": N, "samples": n, "eval": {"compressed": {...}, "uncompressed": {...}}}``."""
    from safetensors.torch import load_file

    from aqsgd.train.checkpoint.manifest import head
    from aqsgd.train.config import TrainConfig, flatten_config, options
    from aqsgd.train.export import _checkpoint
    from aqsgd.train.trainer import Trainer

    run = Path(run)
    path = _checkpoint(run, checkpoint, "evaluate")
    manifest, state = head(path)
    known = {o.flat for o in options()}
    settings = {k: v for k, v in flatten_config(state.get("config", {})).items() if k in known}
    levels = _fixed_levels(settings, state, path)  # --forward/--backward auto: the levels the run had reached
    if eval_file is not None:
        if settings.get("train_file") is None:
            raise SpecError(f"--eval-file: {run} was not trained on a file of its own (its data: "
                            f"{settings.get('task') or settings.get('dataset')}); its own evaluation data "
                            "are used without --eval-file")
        settings["eval_file"] = str(eval_file)
    if max_eval_samples is not None:
        settings["max_eval_samples"] = max_eval_samples
    with tempfile.TemporaryDirectory(prefix="aqsgd-eval-") as tmp:
        settings.update(runtime="local", data_parallel=1, link=None, p2p_backend="gloo", dp_backend="auto",
                        output_dir=tmp, run_name="eval", resume=None, overwrite=False, progress=False,
                        tensorboard=False, trace=False, activation_checkpointing=False, max_steps=None)
        if device is not None:
            settings["device"] = device
        trainer = Trainer(TrainConfig.from_flat(settings, source=f"{path}/trainer.json"))
        if settings.get("lora"):  # the checkpoint holds the adapters only: the base must be the one they fit
            check_same_base(state.get("base_sha256"), trainer.task.base_sha256, trainer.task.model_folder,
                            str(run))
        for name, spec in (levels or {}).items():
            b, direction, _ = parse_link(name)
            trainer.engine.set_link(b, FORWARD_CHANNEL if direction == "forward" else BACKWARD_CHANNEL,
                                    codec=DirectionSpec.parse(spec))
        stages = int(settings.get("stages", 1))
        files = [f"stage{i}/model.safetensors" for i in range(stages)]
        manifest.verify(files)
        try:
            trainer.engine.load_state_dict({i: {"model": load_file(str(path / f))}
                                            for i, f in enumerate(files)})
        except ValueError as e:
            raise CheckpointError(f"{path}: {e}") from None
        result = trainer.evaluate()
        samples = len(trainer.task.eval)
    log.info("evaluated %s on %d samples", path, samples)
    codecs = levels or {d: settings.get(d) for d in ("forward", "backward")}
    return {"checkpoint": str(path), "step": int(state["step"]), "samples": samples, "eval": result,
            "codecs": codecs, "auto_links": levels is not None}


def _fixed_levels(settings: dict[str, Any], state: dict[str, Any], path: Path) -> dict[str, str] | None:
    """For a run whose links chose their bits (``--forward``/``--backward auto``, which needs links: the
    distributed runtime), the spec each link had reached at the checkpoint (``{"b0.forward": spec}``), and
    ``settings`` changed to fixed specs that the local runtime here builds (each link's set afterwards);
    None for a run of fixed settings."""
    from aqsgd.train.adaptive import LinkPolicy, is_auto, parse_auto

    autos = {d: parse_auto(settings[d], d) if is_auto(str(settings.get(d, ""))) else None
             for d in ("forward", "backward")}
    if not any(autos.values()):
        return None
    policy = LinkPolicy(int(settings.get("stages", 1)) - 1, autos["forward"], autos["backward"])
    saved = state.get("link_levels")
    if not saved and policy.specs():  # (a run of one stage has no links, and records no levels)
        raise CheckpointError(f"{path}: a run of auto links whose checkpoint records no link levels "
                              "(written by an older aqsgd); it cannot be evaluated compressed")
    policy.restore(saved or {})
    for d, auto in autos.items():
        if auto is not None:
            settings[d] = auto.spec(0)
    return policy.specs()
