"""Pipeline parallelism: model partitioning into stages, schedules as data, and the stage runner."""

from typing import Any

from aqsgd.pipeline.materialize import (
    ModelRecipe,
    init_weights_file,
    load_weights,
    materialize_stage,
    register_buffer_initializer,
    save_weights,
    stage_nbytes,
)
from aqsgd.pipeline.partition import partition_model, shared_parameters
from aqsgd.pipeline.schedule import (
    Action,
    ActionKind,
    ScheduleError,
    build_plans,
    execution_order,
    get_schedule,
    gpipe,
    one_f_one_b,
    validate,
)
from aqsgd.models.stage import PipelineStage

__all__ = [
    "SUPPORTED_MODELS",
    "Action",
    "ActionKind",
    "ModelRecipe",
    "PipelineStage",
    "ScheduleError",
    "build_plans",
    "execution_order",
    "get_schedule",
    "gpipe",
    "init_weights_file",
    "load_weights",
    "materialize_stage",
    "one_f_one_b",
    "partition_model",
    "register_buffer_initializer",
    "save_weights",
    "shared_parameters",
    "stage_nbytes",
    "validate",
]


def __getattr__(name: str) -> Any:
    # Built from the model family registry on first use (see aqsgd.pipeline.partition).
    if name == "SUPPORTED_MODELS":
        from aqsgd.models.registry import supported_models

        return supported_models()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
