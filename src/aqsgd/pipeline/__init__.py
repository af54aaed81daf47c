"""Pipeline parallelism: model partitioning into stages, schedules as data, and a local executor."""

from aqsgd.pipeline.local_exec import Boundary, run_pipeline_locally
from aqsgd.pipeline.materialize import (
    ModelRecipe,
    init_weights_file,
    load_weights,
    materialize_stage,
    register_buffer_initializer,
    save_weights,
    stage_nbytes,
)
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
    "run_pipeline_locally",
    "save_weights",
    "shared_parameters",
    "stage_nbytes",
    "validate",
]
