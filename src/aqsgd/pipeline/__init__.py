"""Pipeline parallelism: model partitioning into stages, schedules as data, and a local executor."""

from aqsgd.pipeline.local_exec import Boundary, run_pipeline_locally
from aqsgd.pipeline.partition import SUPPORTED_MODELS, partition_model, shared_parameters
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
from aqsgd.pipeline.stage import PipelineStage

__all__ = [
    "SUPPORTED_MODELS",
    "Action",
    "ActionKind",
    "Boundary",
    "PipelineStage",
    "ScheduleError",
    "build_plans",
    "execution_order",
    "get_schedule",
    "gpipe",
    "one_f_one_b",
    "partition_model",
    "run_pipeline_locally",
    "shared_parameters",
    "validate",
]
