"""The task registry: :data:`TASKS` by name, and :func:`load_task`, which loads one split of a task."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aqsgd.data.datasets.base import DictDataset, PathLike, TaskArgs
from aqsgd.data.datasets.images import _load_cifar10, _load_fashion_mnist, _load_mnist
from aqsgd.data.datasets.instruct import _load_instruct
from aqsgd.data.datasets.text import _load_bbc, _load_glue, _load_wiki, _load_wikitext2
from aqsgd.errors import SpecError

__all__ = ["SPLITS", "TASKS", "TASK_KIND_NAMES", "TaskArgs", "TaskSpec", "load_task", "register_task",
           "registered_tasks", "task_names"]

log = logging.getLogger(__name__)

SPLITS = ("train", "eval")
"""Split names; ``test`` and ``validation`` are accepted as aliases of ``eval``."""
_SPLIT_ALIASES = {"train": "train", "eval": "eval", "test": "eval", "validation": "eval", "valid": "eval"}


def _split(split: str) -> str:
    try:
        return _SPLIT_ALIASES[split]
    except KeyError:
        raise SpecError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}") from None


@dataclass(frozen=True)
class TaskSpec:
    """A named task: how to load it, whether it works offline and, if not, its offline stand-in.

    ``loader(args: TaskArgs) -> DictDataset`` (or a :class:`~aqsgd.data.datasets.ragged.RaggedDataset`)
    returns one split (``args.split``) with stable sample ids: the same arguments must give the same samples
    in the same order in every process. ``kind`` is one of
    :data:`TASK_KIND_NAMES`; the loader's dataset ``info`` should hold ``num_labels`` for classification.
    """

    name: str
    kind: str
    offline: bool
    description: str
    loader: Callable[[TaskArgs], DictDataset]
    alternative: str | None = None


TASKS: dict[str, TaskSpec] = {t.name: t for t in (
    TaskSpec("bbc", "sequence-classification", True,
             "BBC News, 5 classes, MiniLM tokenizer; seeded stratified 80/20 split", _load_bbc),
    TaskSpec("wiki", "causal-lm", True,
             "Wikipedia lead sections, SmolLM2 tokenizer; last 10% of articles for eval", _load_wiki),
    TaskSpec("instruct", "causal-lm", True,
             "instructions made from the wiki and bbc sources (prompt/response, loss on the response), "
             "SmolLM2 tokenizer and chat template; last 10% for eval", _load_instruct),
    TaskSpec("fashion-mnist", "image-classification", True, "Fashion-MNIST, 60k/10k", _load_fashion_mnist),
    TaskSpec("mnist", "image-classification", True, "MNIST, 60k/10k", _load_mnist),
    TaskSpec("wikitext-2", "causal-lm", False, "WikiText-2 (raw) from the hub, GPT-2 tokenizer",
             _load_wikitext2, "wiki"),
    TaskSpec("glue-cola", "sequence-classification", False, "GLUE CoLA from the hub, MiniLM tokenizer",
             lambda a: _load_glue(a, "cola", ("sentence",), ["unacceptable", "acceptable"]), "bbc"),
    TaskSpec("glue-qnli", "sequence-classification", False, "GLUE QNLI from the hub, MiniLM tokenizer",
             lambda a: _load_glue(a, "qnli", ("question", "sentence"), ["entailment", "not_entailment"]),
             "bbc"),
    TaskSpec("cifar10", "image-classification", False, "CIFAR-10 from the hub, 50k/10k", _load_cifar10,
             "fashion-mnist"),
)}
"""All tasks :func:`load_task` knows, by name: the built-in ones and those added with
:func:`register_task`."""

TASK_KIND_NAMES = ("causal-lm", "sequence-classification", "image-classification")
"""The kinds of task the trainer knows how to train."""
_BUILTIN = frozenset(TASKS) | {"synthetic-lm"}


def register_task(spec: TaskSpec, *, replace: bool = False) -> TaskSpec:
    """Make ``spec`` a task that :func:`load_task` and the trainer (``TrainConfig.of(task=spec.name)``) know.

    A distributed run started with :func:`aqsgd.train.run_training` sends the tasks registered in the calling
    process to every stage process, so ``spec.loader`` must be picklable (a module-level function, or a
    :func:`functools.partial` of one). Under ``torchrun`` every process runs the script, so register the task
    at the top of it.

    Raises:
        SpecError: a built-in task's name, a name already registered (unless ``replace``), or an unknown kind.
    """
    if spec.name in _BUILTIN:
        raise SpecError(f"register_task: {spec.name!r} is a built-in task; choose another name")
    if spec.name in TASKS and not replace:
        raise SpecError(f"register_task: task {spec.name!r} is already registered (pass replace=True)")
    if spec.kind not in TASK_KIND_NAMES:
        raise SpecError(f"register_task: kind {spec.kind!r} is not one of {', '.join(TASK_KIND_NAMES)}")
    TASKS[spec.name] = spec
    return spec


def registered_tasks() -> list[TaskSpec]:
    """The tasks added with :func:`register_task`, in registration order."""
    return [t for n, t in TASKS.items() if n not in _BUILTIN]


def task_names(*, offline_only: bool = False) -> list[str]:
    """Task names for :func:`load_task` (only those that need no hub if ``offline_only``)."""
    return [n for n, t in TASKS.items() if t.offline or not offline_only]


def load_task(
    name: str,
    split: str = "train",
    *,
    cache_dir: PathLike | None = None,
    seq_len: int = 128,
    max_length: int = 128,
    max_samples: int | None = None,
    tokenizer: Any = None,
    seed: int = 0,
    eval_fraction: float | None = None,
) -> DictDataset:
    """Load one split of a named task as a :class:`DictDataset` (``instruct``: a
    :class:`~aqsgd.data.datasets.ragged.RaggedDataset` of examples of their own lengths).

    Args:
        name: a task in :data:`TASKS` (``bbc``, ``wiki``, ``instruct``, ``fashion-mnist``, ``mnist`` offline;
            ``wikitext-2``, ``glue-cola``, ``glue-qnli``, ``cifar10`` from the hub).
        split: ``train`` or ``eval`` (aliases ``test``, ``validation``).
        cache_dir: the sources' cache (default ``$AQSGD_CACHE`` or ``~/.cache/aqsgd``); missing sources
            are prepared on first use.
        seq_len: tokens per sample for causal-LM tasks.
        max_length: padded/truncated length for text classification; tokens kept per example of ``instruct``.
        max_samples: keep only the first ``max_samples`` samples of the split (ids unchanged).
        tokenizer: a source name, tokenizer folder or tokenizer object; defaults per task (MiniLM for
            classification, SmolLM2 for ``wiki`` and ``instruct``, GPT-2 for ``wikitext-2``).
        seed: seed of seeded splits (``bbc``); splits of other tasks are fixed.
        eval_fraction: eval share of the split (``bbc`` 0.2, ``wiki`` and ``instruct`` 0.1 by default).

    The dataset's ``info`` holds ``task``, ``split`` and the kind's metadata (``num_labels``,
    ``label_names``, ``vocab_size``, ...).
    """
    try:
        spec = TASKS[name]
    except KeyError:
        raise SpecError(f"unknown task {name!r}; known: {', '.join(TASKS)}") from None
    split = _split(split)
    args = TaskArgs(split=split, cache_dir=cache_dir, seq_len=seq_len, max_length=max_length,
                 max_samples=max_samples, tokenizer=tokenizer, seed=seed, eval_fraction=eval_fraction)
    ds = spec.loader(args)
    ds.info.update(task=name, split=split)
    log.info("task %s/%s: %s", name, split, ds)
    return ds
