"""Map-style datasets with stable sample ids, task loaders, and a deterministic micro-batch iterator.

AQ-SGD keeps one cached activation per training example, so every item carries a ``sample_id``: its
index in the split, the same on every process. A :class:`DictDataset` holds its columns as tensors of one
shape per split (text is padded/truncated or chunked to a fixed length); a :class:`RaggedDataset` holds
examples of their own lengths (instruction and chat data: :func:`prompt_response_dataset`,
:func:`chat_dataset`), whose micro-batches carry only real tokens across the stages
(:mod:`aqsgd.data.datasets.ragged`).

Item layouts (``dataset[i]``; :func:`epoch_batches` stacks them and adds ``sample_ids``):

* causal LM (:func:`lm_chunks`): ``input_ids``, ``attention_mask`` (ones), ``labels`` (= ``input_ids``),
  each ``[seq_len]`` int64;
* text classification (:func:`text_classification`): ``input_ids``, ``attention_mask`` and, where the
  tokenizer makes them, ``token_type_ids``, each ``[max_length]`` int64; ``labels`` scalar int64;
* images (:func:`image_classification`): ``pixel_values`` ``[C, H, W]`` float32, normalised;
  ``labels`` scalar int64.

Task loaders (:func:`load_task`): ``bbc``, ``wiki``, ``instruct``, ``fashion-mnist`` and ``mnist`` come from
the offline sources in :mod:`aqsgd.data.sources`; ``wikitext-2``, ``glue-cola``, ``glue-qnli`` and
``cifar10`` need the ``datasets`` package and the Hugging Face hub, and otherwise raise a
:class:`~aqsgd.errors.DataSourceError` naming the offline task to use instead.
"""

from aqsgd.data.datasets.base import DictDataset, TaskArgs
from aqsgd.data.datasets.base import PathLike as PathLike
from aqsgd.data.datasets.base import Transform as Transform
from aqsgd.data.datasets.batching import _rng as _rng
from aqsgd.data.datasets.batching import (
    collate,
    epoch_batches,
    epoch_order,
    num_batches,
    stratified_split,
)
from aqsgd.data.datasets.files import (
    SUPPORTED_EXTENSIONS,
    Records,
    data_fingerprint,
    load_hub_dataset,
    load_text_files,
    read_records,
)
from aqsgd.data.datasets.hub import HUB_PROBE_TIMEOUT_S as HUB_PROBE_TIMEOUT_S
from aqsgd.data.datasets.instruct import (
    ChatTemplate,
    chat_dataset,
    instruct_pairs,
    prompt_response_dataset,
    read_chat_template,
)
from aqsgd.data.datasets.images import FASHION_MNIST_CLASSES as FASHION_MNIST_CLASSES
from aqsgd.data.datasets.images import image_classification, read_idx
from aqsgd.data.datasets.ragged import RaggedDataset
from aqsgd.data.datasets.tasks import (
    SPLITS,
    TASKS,
    TaskSpec,
    load_task,
    register_task,
    registered_tasks,
    task_names,
)
from aqsgd.data.datasets.text import (document_separator, lm_chunks, load_tokenizer, read_bbc, read_wiki,
                                      text_classification)

__all__ = [
    "SPLITS",
    "SUPPORTED_EXTENSIONS",
    "TASKS",
    "ChatTemplate",
    "DictDataset",
    "RaggedDataset",
    "Records",
    "TaskArgs",
    "TaskSpec",
    "chat_dataset",
    "collate",
    "data_fingerprint",
    "epoch_batches",
    "epoch_order",
    "image_classification",
    "instruct_pairs",
    "document_separator",
    "lm_chunks",
    "load_hub_dataset",
    "load_task",
    "load_text_files",
    "load_tokenizer",
    "num_batches",
    "prompt_response_dataset",
    "read_bbc",
    "read_chat_template",
    "read_idx",
    "read_records",
    "read_wiki",
    "register_task",
    "registered_tasks",
    "stratified_split",
    "task_names",
    "text_classification",
]
