"""Training: optimizers and schedules, the pipeline engine, the trainer loop, checkpoints and metrics.

The entry points for Python users are re-exported here (imported on first use):

* :class:`~aqsgd.train.config.TrainConfig`, the whole configuration
  (``TrainConfig.of(task="wiki", stages=2)``);
* :func:`~aqsgd.train.driver.run_training`, which trains as the config says, locally, in processes it starts,
  or as one rank of a torchrun job (``run_training(cfg, data=(train, eval))`` for datasets built in Python);
* :class:`~aqsgd.train.trainer.Trainer`, the loop one process runs.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["TrainConfig", "Trainer", "run_training"]

_EXPORTS = {"TrainConfig": "aqsgd.train.config", "Trainer": "aqsgd.train.trainer",
            "run_training": "aqsgd.train.driver"}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
