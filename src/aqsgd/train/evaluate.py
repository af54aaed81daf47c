"""``aqsgd eval``: evaluate a run's checkpoint, with compression on and off at the stage boundaries.

The run's own settings (from the checkpoint) rebuild its pipeline in this process (the local runtime: the
same numbers as the distributed one), the checkpoint's verified stage weights are loaded, and the evaluation
data (the run's, or ``--eval-file`` in the format of its training file) go through it twice: with the run's
codecs at every boundary and uncompressed. Nothing is written into the run directory.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

from aqsgd.errors import SpecError
from aqsgd.train.checkpoint import CheckpointError

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
    path = _checkpoint(run, checkpoint)
    manifest, state = head(path)
    known = {o.flat for o in options()}
    settings = {k: v for k, v in flatten_config(state.get("config", {})).items() if k in known}
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
    return {"checkpoint": str(path), "step": int(state["step"]), "samples": samples, "eval": result}
