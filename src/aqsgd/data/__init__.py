"""Offline data: named sources fetched from package registries, task datasets with stable sample ids,
and a deterministic micro-batch iterator. See :mod:`aqsgd.data.sources` and :mod:`aqsgd.data.datasets`.
"""

from aqsgd.data.datasets import (
    TASKS,
    DictDataset,
    TaskArgs,
    TaskSpec,
    collate,
    epoch_batches,
    epoch_order,
    image_classification,
    lm_chunks,
    load_task,
    load_tokenizer,
    num_batches,
    register_task,
    registered_tasks,
    stratified_split,
    task_names,
    text_classification,
)
from aqsgd.data.sources import SOURCES, Source, default_cache_dir, locate, prepare, require, source_names
from aqsgd.errors import DataSourceError

__all__ = [
    "SOURCES",
    "TASKS",
    "DataSourceError",
    "DictDataset",
    "Source",
    "TaskArgs",
    "TaskSpec",
    "collate",
    "default_cache_dir",
    "epoch_batches",
    "epoch_order",
    "image_classification",
    "lm_chunks",
    "load_task",
    "load_tokenizer",
    "locate",
    "num_batches",
    "prepare",
    "register_task",
    "registered_tasks",
    "require",
    "source_names",
    "stratified_split",
    "task_names",
    "text_classification",
]
