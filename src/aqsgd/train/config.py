"""The training configuration: one :class:`TrainConfig` nested by concern.

========== ==================== ===========================================================================
table      section class        what it holds
========== ==================== ===========================================================================
task       :class:`TaskSection`     the task (data) and how much of it
model      :class:`ModelSection`    the model, and what to change in it (blocks kept, dropout, random sizes)
pipeline   :class:`PipelineSection` stages, schedule, micro-batches, runtime, links, data parallelism
compression :class:`CompressionSection` the boundary schemes and codecs, caches, the uncompressed warm-up
optim      :class:`OptimSection`    epochs, optimizer, learning rate, clipping, dtype, seed
run        :class:`RunSection`      evaluation, checkpoints, run directory, logging, traces
========== ==================== ===========================================================================

Every field is keyword-only and documented by the docstring under it, which is also its ``--help``. Every
field is a command-line option too, named by its *flat name*: the field's name, except where a section's
``name`` or a name two sections share needs the section's word (``--task``, ``--model``, ``--model-layers``).
Flat names are unique, so a plain ``{flat name: value}`` mapping (the command line, a benchmark's overrides,
the flat configs that checkpoints before the nesting saved) converts both ways: :meth:`TrainConfig.of` and
:meth:`TrainConfig.flat`. TOML presets and ``config.json`` use the nesting (:meth:`TrainConfig.to_dict`):
one table per section; an unknown table, an unknown key or a key in the wrong table is an error naming it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from pathlib import Path
from typing import Any, Self

from aqsgd.errors import SpecError
from aqsgd.train.fields import (
    Check,
    Option,
    above,
    at_least,
    bad,
    check_fields,
    check_finite,
    check_ranges,
    field,
    flatten_tables,
    fraction,
    one_of,
    parsed,
    read_toml,
    section_options,
    typed,
)

# The default setting: the most compressed one measured within 1 % of fp32 on both study tasks (3 seeds,
# evaluation uncompressed; docs/convergence.md, "The default setting"). Forward, AQ-SGD's deltas in a basis
# of a quarter of each row's dimensions that the boundary learns, the coefficients on the entropy-coded 4-bit
# grid; backward, the gradients the same way with error feedback; the warm-up and AQ-SGD's first visits on
# that grid without the basis (which the warm-up estimates).
DEFAULT_FORWARD = "delta:q4:rot128:step1:rc:pca/4"
DEFAULT_BACKWARD = "ef:q4:rot128:step1:rc:pca/4"
DEFAULT_WARMUP_CODEC = "q4:rot128:step1:rc"
# With --lora, each direction not given takes the best setting measured with adapters (docs/convergence.md,
# "LoRA"): AQ-SGD's 2-bit deltas and 4-bit gradients on rotated tiles of 64 values, zstd on both, the warm-up
# in full. The subspace default lost 4-6 % against LoRA in fp32 on both study tasks; this one is within 1 % on
# the mean of 3 seeds (-0.97 % accuracy on MiniLM-BBC, +0.97 % perplexity on SmolLM2-wiki).
LORA_FORWARD = "delta:q2:rot64:l2:midrise:zstd"
LORA_BACKWARD = "direct:q4:rot64:l2:zstd"

__all__ = ["TrainConfig", "TaskSection", "ModelSection", "PipelineSection", "CompressionSection",
           "OptimSection", "RunSection", "Option", "options", "load_toml", "flatten_config", "check_run_name",
           "DEFAULT_FORWARD", "DEFAULT_BACKWARD", "DEFAULT_WARMUP_CODEC", "LORA_FORWARD", "LORA_BACKWARD"]


MAX_SEED = 2**32 - 1
"""The largest --seed: every seeded generator (numpy's SeedSequence, torch's manual_seed, the synthetic data's
per-sample seeds) takes it without overflow."""


_SEED_RANGE: Check = ((lambda x: 0 <= x <= MAX_SEED), f"must be in 0..{MAX_SEED} (2**32 - 1), got {{}}")


class _Section:
    """What every section does: check its fields (finite floats, then each field's own range or choices)."""

    def validate(self) -> Self:
        """Check the section's values; raise SpecError naming the option (as the command line spells it)."""
        check_fields(self)
        return self


@dataclasses.dataclass(kw_only=True)
class TaskSection(_Section):
    """Which task (data) a run trains on, and how much of it."""

    name: str | None = field(None, flat="task")
    """task: bbc (the default), wiki, instruct, fashion-mnist, mnist, synthetic-lm (offline); wikitext-2,
    glue-cola, glue-qnli, cifar10 (hub); a task registered from Python; leave it unset to train on
    --train-file or --dataset"""
    train_file: str | None = None
    """your training data: .jsonl, .json, .csv, .tsv, .txt (one document per line; see --txt-unit) or
    .parquet; a messages column, or a prompt and a response column, makes it instruction fine-tuning, a label
    column text classification, neither causal-LM fine-tuning"""
    eval_file: str | None = None
    """your evaluation data, in the training file's format (default: --eval-split of the training data)"""
    txt_unit: str = "line"
    """how a .txt --train-file / --eval-file is cut into documents: line (one document per line), paragraph
    (the lines up to a blank line) or file (the whole file as one document); a resumed run must read them the
    same way"""
    dataset: str | None = None
    """a Hugging Face hub dataset NAME[:CONFIG], loaded with datasets.load_dataset (needs the hub)"""
    text_column: str = "text"
    """column holding the text (--train-file, --dataset)"""
    text_pair_column: str | None = None
    """column holding the second text of sentence-pair classification (--train-file, --dataset)"""
    label_column: str | None = None
    """column holding the class label, strings or integers (default: label, where the data have it; without a
    label column the data are causal-LM text)"""
    prompt_column: str | None = None
    """column holding the prompts of instruction data (default: prompt, where the data have prompt and
    response columns); the loss is on the response only"""
    response_column: str | None = None
    """column holding the responses of instruction data (default: response, where the data have prompt and
    response columns)"""
    messages_column: str | None = None
    """column holding conversations, lists of {role, content} turns rendered with the chat template, the loss
    on the assistant turns only (default: messages, where the data have it; in a .csv, a JSON string)"""
    chat_template: str | None = None
    """a Jinja chat template file for instruction data, used instead of the tokenizer's own (needed where it
    has none); prompt/response pairs are then rendered as a user and an assistant turn"""
    eval_split: float = field(0.1, check=fraction(zero=False))
    """fraction of the training data held out for evaluation (seeded) when there is no evaluation file or
    split"""
    max_length: int = field(64, check=at_least(1))
    """tokens per sample (text tasks): padded/truncated length or LM chunk length"""
    max_train_samples: int | None = field(None, check=at_least(0, " (0: all)"))
    """use only the first N training samples (default: 600 for the built-in tasks, all of your own data; 0:
    all)"""
    max_eval_samples: int | None = field(None, check=at_least(0, " (0: all)"))
    """use only the first N evaluation samples (default: 200 for the built-in tasks, all of your own data; 0:
    all)"""
    cache_dir: str | None = None
    """data and weights cache (default $AQSGD_CACHE or ~/.cache/aqsgd)"""

    def validate(self) -> Self:
        """The fields' checks, then: one source of data (a task, a file or a dataset), an evaluation file only
        beside a training file, named columns, and a --txt-unit other than line only for .txt files."""
        from aqsgd.data.datasets.records import TXT_UNITS

        check_fields(self)
        own = [n for n in ("train_file", "dataset") if getattr(self, n) is not None]
        if len(own) > 1:
            raise bad("dataset", "give either --train-file or --dataset, not both")
        if own and self.name is not None:
            raise bad("task", f"{self.name!r} and --{own[0].replace('_', '-')} both name the data; give one")
        if self.eval_file is not None and self.train_file is None:
            raise bad("eval_file", "needs --train-file (the training data in the same format)")
        for name in ("text_column", "text_pair_column", "label_column", "prompt_column", "response_column",
                     "messages_column"):
            if getattr(self, name) is not None and not getattr(self, name).strip():
                raise bad(name, "must name a column, got an empty string")
        self._check_instruct(own)
        if self.txt_unit not in TXT_UNITS:
            raise bad("txt_unit", f"{self.txt_unit!r} is not one of {', '.join(TXT_UNITS)}")
        files = [f for f in (self.train_file, self.eval_file) if f is not None]
        if self.txt_unit != "line" and not any(str(f).lower().endswith(".txt") for f in files):
            raise bad("txt_unit", f"{self.txt_unit} cuts .txt files into documents, and neither --train-file "
                      "nor --eval-file is one")
        return self

    def _check_instruct(self, own: list[str]) -> None:
        """The instruction-data options: for your own data only (a named task has its own format), one
        format (conversations or pairs), not beside --label-column, and a template file that is named."""
        given = [n for n in ("messages_column", "prompt_column", "response_column", "chat_template")
                 if getattr(self, n) is not None]
        if given and not own:
            raise bad(given[0], "is for your instruction data (--train-file or --dataset); a named task "
                      "brings its own format")
        if self.messages_column is not None and (self.prompt_column or self.response_column) is not None:
            raise bad("messages_column", "names conversations, --prompt-column / --response-column "
                      "prompt/response pairs: give one or the other")
        columns = [n for n in given if n != "chat_template"]
        if columns and self.label_column is not None:
            raise bad("label_column", f"makes the data classification, --{columns[0].replace('_', '-')} "
                      "instruction data: give one or the other")
        if self.chat_template is not None and not self.chat_template.strip():
            raise bad("chat_template", "must name a Jinja template file, got an empty string")



@dataclasses.dataclass(kw_only=True)
class ModelSection(_Section):
    """The model and what to change in it."""

    name: str | None = field(None, flat="model")
    """model: a Hugging Face hub name (e.g. Qwen/Qwen2.5-0.5B) or a local folder of any supported family (see
    `aqsgd models`), or minilm, smollm2, resnet, tiny-llama, tiny-gpt2 (default: the task's model)"""
    layers: int | None = field(None, flat="model_layers", check=at_least(1))
    """keep only the first N transformer blocks of the model (a reduced model)"""
    dropout: float | None = field(None, check=fraction())
    """set every dropout probability of a transformers model to P (e.g. 0: with dropout a sample's activations
    differ between epochs, which AQ-SGD's deltas carry; default: the model's own)"""
    hidden_size: int = field(64, check=at_least(1))
    """hidden size of the random tiny-llama / tiny-gpt2 models"""
    vocab_size: int = field(128, check=at_least(1))
    """vocabulary of the random tiny models and of the synthetic-lm task's tokens"""
    lora: bool = False
    """fine-tune LoRA adapters (with peft) instead of every weight: the base weights are frozen, and neither
    optimised, checkpointed nor synchronised between replicas; a classifier's new head is trained whole. A
    direction not given then takes the LoRA setting (see --forward, --backward)"""
    lora_rank: int = field(8, check=at_least(1))
    """rank of the LoRA adapters"""
    lora_alpha: float = field(16.0, check=above(0))
    """LoRA scaling numerator (the update is scaled by alpha / rank)"""
    lora_dropout: float = field(0.0, check=fraction())
    """dropout on the LoRA adapters' input (default 0, as peft's: with dropout a sample's activations differ
    between epochs, which AQ-SGD's deltas carry)"""
    lora_targets: str | None = None
    """modules that get adapters, comma-separated names (e.g. q_proj,v_proj; default: the family's attention
    projections)"""

    def validate(self) -> Self:
        """The fields' checks; an adapter setting without --lora first, as it would be ignored: say so
        instead."""
        check_finite(self)
        lora = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets")
        given = [n for n in lora if getattr(self, n) != getattr(ModelSection, n)]
        if given and not self.lora:
            raise bad(given[0], f"{getattr(self, given[0])} sets the LoRA adapters, but this run has none: "
                      f"add --lora (or leave --{given[0].replace('_', '-')} out)")
        check_ranges(self)
        if self.lora_targets is not None and not [t for t in self.lora_targets.split(",") if t.strip()]:
            raise bad("lora_targets", "must name at least one module")
        return self



@dataclasses.dataclass(kw_only=True)
class PipelineSection(_Section):
    """How the model is cut into stages and how the stages run."""

    stages: int = field(4, check=at_least(1))
    """number of pipeline stages"""
    layers: list[int] | None = None
    """blocks per stage, comma-separated (default: split as --balance says)"""
    balance: str = field("layers", check=one_of("layers", "params", "measured"))
    """how blocks are split without --layers: layers (as many per stage), params (the fewest parameters on
    the largest stage) or measured (for stages of unequal speed: time every stage's forward and backward for
    --balance-passes pipeline passes with the layers split, then train with the split whose slowest stage is
    predicted fastest; the split is recorded as the run's --layers, which --resume, export and eval reuse)"""
    balance_passes: int = field(4, check=at_least(1))
    """pipeline passes --balance measured times (after one that warms up) before it chooses the split"""
    emulate_slow_stage: str | None = None
    """an emulation for benchmarks and tests (as --link): STAGE:FACTOR[,STAGE:FACTOR...] makes a stage FACTOR
    times slower, sleeping FACTOR-1 times each forward's and backward's duration after it (1:2: stage 1
    twice as slow, as if it shared its cores)"""
    schedule: str = "1f1b"
    """pipeline schedule: gpipe or 1f1b"""
    batching: str = field("auto", check=one_of("auto", "max-length", "bucket", "pack"))
    """how examples of text become micro-batches: max-length (every example padded to --max-length, pads sent
    between stages), bucket (examples of similar length together, each micro-batch padded to its own longest,
    only real tokens sent), pack (examples packed into rows of --max-length tokens, each attending to itself;
    decoders only) or auto (bucket for instruction and chat data, max-length for the rest)"""
    micro_batches: int = field(4, check=at_least(1))
    """micro-batches per pipeline pass"""
    micro_batch_size: int = field(8, check=at_least(1))
    """samples per micro-batch"""
    activation_checkpointing: bool = False
    """recompute each block's activations in the backward pass instead of keeping them (less memory per stage,
    about one more forward of compute; the same numbers)"""
    runtime: str = field("local", check=one_of("local", "distributed"))
    """local: all stages in this process; distributed: one process per stage (started here with PyTorch's
    launcher, or by torchrun)"""
    device: str = field("auto", check=one_of("auto", "cpu", "cuda"))
    """where the stages compute: auto (CUDA when available), cpu or cuda; a distributed process takes
    cuda:(LOCAL_RANK mod device count)"""
    threads: int | None = field(None, check=at_least(1))
    """CPU threads each process computes with (PyTorch's operations, the codec kernels); default:
    OMP_NUM_THREADS where it is set (torchrun sets 1 for several processes per machine), else every core in
    the local runtime, and in a distributed run the machine's cores shared by its processes (cores //
    processes, at least 1)"""
    p2p_backend: str = field("gloo", check=one_of("gloo", "nccl"))
    """how packets cross stage boundaries (distributed): gloo (TCP; robust on slow links, GPU tensors are
    staged through pinned host memory) or nccl (GPU to GPU; for fast links)"""
    dp_backend: str = field("auto", check=one_of("auto", "gloo", "nccl"))
    """backend of the data-parallel gradient sync: auto (nccl on GPU, else gloo), gloo or nccl"""
    timeout: float = field(60.0, check=above(0, " seconds"))
    """seconds a stage waits for a neighbour before failing (distributed)"""
    checksum: bool = True
    """send a CRC-32 of every packet payload between stages and check it on receipt (distributed, gloo: NCCL
    carries none); --no-checksum skips it on trusted links (TCP still checks its segments); the same on every
    stage, free to change on --resume"""
    link: str | None = None
    """emulated links between stages (distributed): one setting for every boundary (100mbit,5ms) or one per
    boundary separated by / (1gbit/50mbit,20ms/200mbit: stages 0-1, 1-2, 2-3); a setting may change during
    the run: 200mbit~20mbit@50 is 20mbit from step 50 on"""
    data_parallel: int = field(1, check=at_least(1))
    """replicas of the pipeline (distributed runtime); world size = stages x data_parallel"""
    grad_sync: str = "allreduce"
    """data-parallel synchronization: every step the gradients, allreduce, q<bits>[:block<N>],
    powersgd[:rank<R>] or topk<P>%[:q<bits>] (e.g. q8, q4:block256, powersgd:rank4, topk3%:q2); or outer
    steps, diloco:<H>[:lr<F>][:momentum<F>][:fragments<N>][:delay<T>][:mix<F>][:allreduce|:q<bits>|
    :topk<P>%[:q<bits>]]: each replica alone for H steps, then the averaged pseudo-gradients through SGD with
    Nesterov momentum (lr 0.7, momentum 0.9), e.g. diloco:50:q8; streaming: the stage in N fragments synced in
    turn, each sync overlapped with T steps of compute and its result mixed with the weights trained meanwhile
    (mix: the local weights' share, default 0.5), e.g. diloco:50:fragments2:delay5:q8"""
    dp_link: str | None = None
    """emulated link of each rank to its replicas (distributed, data parallel): one setting (30mbit,20ms);
    the replicas' sync then takes at least its bytes' transfer at that speed (default: --link's setting, else
    unpaced)"""
    grad_bucket_mb: float = field(25.0, check=above(0))
    """gradient bucket size of the data-parallel synchronization, in MB"""
    dp_elastic: bool = False
    """replicas that come and go (distributed, --grad-sync diloco:...): every replica pipeline a process
    group of its own, meeting the others only at the outer steps through a lighthouse (torchft, the elastic
    extra); a replica that fails or is stopped leaves the others training, and one started later joins"""
    dp_lighthouse: str | None = None
    """with --dp-elastic: the lighthouse (http://HOST:PORT) of replicas already running; give it with
    --dp-replica to run that one replica pipeline (default: this launch starts a lighthouse and every
    replica, and writes its address to the run directory's lighthouse.txt)"""
    dp_replica: int | None = field(None, check=at_least(0))
    """with --dp-elastic and --dp-lighthouse: which replica this launch runs (0 .. data_parallel-1: whose
    shard of the data it trains on); its world is one pipeline, --stages processes"""
    dp_join: bool = True
    """with --dp-replica: before training, meet the other replicas through the lighthouse: those starting
    too start together, and replicas already training are joined at their next outer step with their weights
    and state (--no-dp-join: start from the initial weights at once)"""

    def validate(self) -> Self:
        """The fields' checks, then the specs parsed (gradient sync, schedule, blocks per stage, slow stages,
        links) and what needs the distributed runtime or a GPU."""
        from aqsgd.parallel.sync import parse_grad_sync
        from aqsgd.pipeline.balance import parse_slow_stages
        from aqsgd.pipeline.schedule import get_schedule

        check_fields(self)
        if self.data_parallel > 1 and self.runtime != "distributed":
            raise bad("data_parallel", f"{self.data_parallel} replicas need --runtime distributed (one "
                      "process per stage and replica); the local runtime runs one pipeline")
        if parsed("grad_sync", parse_grad_sync, self.grad_sync).kind == "diloco" and self.data_parallel < 2:
            raise bad("grad_sync", f"{self.grad_sync} averages replicas at its outer steps: it needs "
                      "--data-parallel 2 or more")
        self._check_elastic()
        parsed("schedule", get_schedule, self.schedule)
        if self.layers is not None and len(self.layers) != self.stages:
            raise bad("layers", f"{len(self.layers)} counts for {self.stages} stages")
        if self.layers is not None and min(self.layers) < 1:
            raise bad("layers",
                      f"every stage needs at least one block, got {','.join(map(str, self.layers))}")
        if self.emulate_slow_stage is not None:
            parsed("emulate_slow_stage", lambda text: parse_slow_stages(text, self.stages),
                   self.emulate_slow_stage)
        self._check_links()
        return self

    def _check_elastic(self) -> None:
        for name in ("dp_lighthouse", "dp_replica"):
            if getattr(self, name) is not None and not self.dp_elastic:
                raise bad(name, "is for replicas that come and go: it needs --dp-elastic")
        if not self.dp_elastic:
            return
        from aqsgd.parallel.sync import parse_grad_sync

        if parse_grad_sync(self.grad_sync).kind != "diloco":
            raise bad("dp_elastic", f"replicas meet only at outer steps: it needs --grad-sync diloco:<H>..., "
                      f"got {self.grad_sync}")
        if self.dp_backend == "nccl":
            raise bad("dp_elastic", "the outer steps' groups are torchft's gloo groups: --dp-backend nccl "
                      "cannot be used with it")
        if (self.dp_replica is None) != (self.dp_lighthouse is None):
            given, missing = (("dp_replica", "--dp-lighthouse") if self.dp_lighthouse is None
                              else ("dp_lighthouse", "--dp-replica"))
            raise bad(given, f"runs one replica pipeline among running ones: it needs {missing} too")
        if self.dp_replica is not None and self.dp_replica >= self.data_parallel:
            raise bad("dp_replica", f"replica {self.dp_replica} of --data-parallel {self.data_parallel}: "
                      f"give 0 to {self.data_parallel - 1} (the replica's shard of the data)")
        address = r"https?://[^\s/:]+:\d+/?"
        if self.dp_lighthouse is not None and not re.fullmatch(address, self.dp_lighthouse):
            raise bad("dp_lighthouse", f"{self.dp_lighthouse!r} is no lighthouse address (http://HOST:PORT)")

    @property
    def world_replicas(self) -> int:
        """Replicas in this launch's process group: one where this launch is one replica pipeline of replicas
        that come and go (``--dp-replica``), else ``data_parallel``."""
        return 1 if self.dp_replica is not None else self.data_parallel

    def resolved_batching(self, train: Any) -> str:
        """``batching`` with ``auto`` resolved for the training data ``train``: ``bucket`` for examples of
        their own lengths (instruction and chat data), else ``max-length``."""
        from aqsgd.data.datasets.ragged import RaggedDataset

        if self.batching != "auto":
            return self.batching
        return "bucket" if isinstance(train, RaggedDataset) else "max-length"

    def _check_links(self) -> None:
        """``--link`` and the backends: what needs stage processes, data parallelism or a GPU."""
        from aqsgd.comm.link import parse_links

        distributed = self.runtime == "distributed"
        if self.link is not None and not distributed:
            raise bad("link", "emulates the links between stage processes: it needs --runtime distributed "
                      "(the local runtime passes tensors in memory)")
        if self.dp_link is not None:
            from aqsgd.comm.link import LinkSpec

            if self.data_parallel < 2:
                raise bad("dp_link", "emulates the links between replicas: it needs --data-parallel 2 or "
                          "more")
            parsed("dp_link", LinkSpec.parse, self.dp_link)
        if self.link is not None:
            schedules = parsed("link", lambda text: parse_links(text, self.stages - 1), self.link)
            if self.data_parallel > 1 and len(set(schedules)) > 1:
                raise bad("link", "one setting per boundary is for a single pipeline; with --data-parallel "
                          "the replicas' links are no boundary of it: give one setting")
            if self.data_parallel > 1 and any(s.varies for s in schedules):
                raise bad("link", "a setting that changes during the run (~SPEC@STEP) is for a single "
                          "pipeline; with --data-parallel give one fixed setting")
        if self.p2p_backend != "gloo" and not distributed:
            raise bad("p2p_backend", "carries packets between stage processes: it needs --runtime "
                      "distributed (the local runtime passes tensors in memory)")
        if self.dp_backend != "auto" and self.data_parallel < 2:
            raise bad("dp_backend", "is the backend of the data-parallel gradient sync: it needs "
                      "--data-parallel 2 or more")
        if self.device == "cpu" and "nccl" in (self.p2p_backend, self.dp_backend):
            which = "p2p_backend" if self.p2p_backend == "nccl" else "dp_backend"
            raise bad(which, "nccl runs on GPUs only; it needs --device cuda (or auto on a machine with one)")



@dataclasses.dataclass(kw_only=True)
class CompressionSection(_Section):
    """What crosses each stage boundary."""

    forward: str = DEFAULT_FORWARD
    """activations: [SCHEME:]CODEC, scheme direct|delta|ef|ef21 (see `aqsgd codecs`), or auto[:FLOOR][:err=E]:
    AQ-SGD with the bits of each boundary chosen from its measured link (fp16, q8, q6, q4, q3, q2:l2;
    distributed) and each level's measured relative error at most E (default 0.1; none: no budget); the
    default is AQ-SGD's deltas in a quarter of each row's dimensions (a basis the boundary learns), their
    coefficients on the entropy-coded 4-bit grid: about 0.6-0.8 bits a value; with --lora,
    delta:q2:rot64:l2:midrise:zstd (about 2.2 bits)"""
    backward: str = DEFAULT_BACKWARD
    """activation gradients: [SCHEME:]CODEC, or auto[:FLOOR][:err=E] (bf16, q8, q6, q4 chosen per link); the
    default is the gradients in a basis of their own, with error feedback, coded as the forward's; with
    --lora, direct:q4:rot64:l2:zstd"""
    cache: str = "memory"
    """AQ-SGD cache: memory[:fp16|bf16|fp32], disk[:dtype], lowbit<b>[:block<N>]"""
    ef_key: str = field("slot", check=one_of("slot", "sample"))
    """error-feedback state key: slot or sample"""
    warmup_epochs: int = 1
    """epochs without compression first (AQ-SGD fills its cache there), but for auto links and a
    --warmup-codec"""
    warmup_codec: str = "default"
    """what the warm-up epochs and AQ-SGD's first visits send on every direction compressed with a fixed
    direct, delta or ef setting: none (in full, as in the AQ-SGD paper) or a codec such as q8 (AQ-SGD then
    caches what it decodes to, and its next visit's delta carries the difference; ef starts its error
    after it); auto links send their level. default: the default setting's own, q4:rot128:step1:rc (about
    2.2 bits a value), where --forward and --backward are the defaults too, and none with any other"""

    def validate(self) -> Self:
        """The fields' checks, then every spec parsed: each direction's, the warm-up codec's (and that it has
        a direction to apply to) and the cache's."""
        from aqsgd.schemes.factory import make_cache

        check_fields(self)
        self.specs  # noqa: B018 (parsed here, once: the one-line error naming the option)
        if self.warmup != "none":
            self._check_warmup_codec()
        if not self.cache.startswith("disk"):
            parsed("cache", lambda spec: make_cache(spec, 1, row_shape=(1,), path="/dev/null"), self.cache)
        return self

    def _check_warmup_codec(self) -> None:
        """A warm-up codec is a codec, and some direction sends with it."""
        from aqsgd.compress import make_codec

        parsed("warmup_codec", make_codec, self.warmup)
        fixed = self.fixed_compressed()
        for d, spec in fixed.items():
            if spec.scheme not in ("direct", "delta", "ef"):
                raise bad("warmup_codec", f"--{d} {getattr(self, d)}: {spec.scheme} keeps the warm-up's "
                          "exact values (its estimate); only direct, delta and ef directions take a warm-up "
                          "codec")
        if not fixed:
            raise bad("warmup_codec", f"is for directions compressed with a fixed setting; --forward "
                      f"{self.forward} and --backward {self.backward} have none (auto links send their "
                      "level in the warm-up)")
        if self.warmup_epochs == 0 and all(spec.scheme != "delta" for spec in fixed.values()):
            raise bad("warmup_codec", "with --warmup-epochs 0 only AQ-SGD's first visits go in full, and no "
                      "direction here is delta: nothing would be sent with it")

    @functools.cached_property
    def specs(self) -> dict[str, Any]:
        """Each direction's setting parsed, once (a bad one: the one-line error naming the option): an
        ``AutoSpec`` for ``auto``, else a ``DirectionSpec``. What the links and schemes are built from."""
        from aqsgd.pipeline.compression import DirectionSpec
        from aqsgd.train.adaptive import is_auto, parse_auto

        def parse(d: str, text: str) -> Any:
            return parse_auto(text, d) if is_auto(text) else DirectionSpec.parse(text)

        return {d: parsed(d, lambda t, d=d: parse(d, t), getattr(self, d)) for d in ("forward", "backward")}

    @property
    def warmup(self) -> str:
        """The warm-up codec in force: ``--warmup-codec``, with ``default`` resolved (the default setting's
        warm-up codec when both directions are the defaults, else ``none``)."""
        if self.warmup_codec != "default":
            return self.warmup_codec
        defaults = self.forward == DEFAULT_FORWARD and self.backward == DEFAULT_BACKWARD
        return DEFAULT_WARMUP_CODEC if defaults else "none"

    def fixed_compressed(self) -> dict[str, Any]:
        """The directions compressed with a fixed setting (not auto, codec not none), by name, as parsed
        ``DirectionSpec``: where ``--warmup-codec`` applies, and what an uncompressed warm-up keeps from being
        used."""
        return {d: s for d, s in self.specs.items() if getattr(s, "codec", "none") != "none"}


@dataclasses.dataclass(kw_only=True)
class OptimSection(_Section):
    """The optimization."""

    epochs: int = field(2, check=at_least(1))
    """training epochs"""
    max_steps: int | None = field(None, check=at_least(1))
    """stop after this many optimizer steps"""
    optimizer: str = field("adamw", check=one_of("adamw", "sgd"))
    """adamw or sgd"""
    lr: float = field(2e-4, check=above(0))
    """peak learning rate"""
    weight_decay: float = field(0.01, check=at_least(0))
    """AdamW weight decay (none on norms and biases)"""
    lr_warmup: float = field(0.1, check=fraction())
    """linear LR warm-up, as a fraction of the total steps"""
    max_grad_norm: float = field(1.0, check=at_least(0))
    """clip the global gradient norm (0: off)"""
    skip_nonfinite: int = field(0, check=at_least(0, " (0: stop at the first non-finite step)"))
    """a step whose loss or gradient norm is NaN or infinite never updates the model; 0 stops the run there
    (one line naming the step, the value and what to change), N > 0 skips up to N such steps in a row and
    stops at the next"""
    grad_accum: int = field(1, check=at_least(1))
    """pipeline passes accumulated per optimizer step"""
    dtype: str = field("auto", check=one_of("auto", "fp32", "bf16"))
    """compute dtype: auto (bf16 autocast on a GPU that supports it, else fp32), fp32, or bf16 (autocast)"""
    seed: int = field(0, check=_SEED_RANGE)
    """seed of initialization, data order and stochastic rounding (0 to 2**32 - 1)"""


@dataclasses.dataclass(kw_only=True)
class RunSection(_Section):
    """Evaluation, checkpoints, the run directory and what is logged."""

    eval_every: int | None = field(None, check=at_least(0, " (0: never)"))
    """evaluate every N steps (default: every epoch; 0: never, not even at the end)"""
    output_dir: str = "runs"
    """parent folder of run directories"""
    run_name: str | None = None
    """run directory name inside --output-dir (default: task-forward-backward); an existing run is never
    appended to: continue it with --resume or replace it with --overwrite"""
    overwrite: bool = False
    """replace an existing run directory of the same name (its metrics and checkpoints are deleted)"""
    checkpoint_every: int | None = field(None, check=at_least(0, " (0: never)"))
    """checkpoint every N steps (default: every epoch; 0: never, not even at the end)"""
    checkpoint_minutes: float = field(10.0, check=at_least(0, " (0: by steps or epochs only)"))
    """also checkpoint after a step when this many minutes have passed since the last checkpoint (or the
    start), so that an interruption loses minutes, not an epoch (0: by steps or epochs only)"""
    keep_checkpoints: int = field(2, check=at_least(1))
    """how many checkpoints to keep"""
    resume: str | None = None
    """continue a run (its directory or a checkpoint folder) with the settings it was trained with; options
    given beside it override those that may change"""
    progress: bool = True
    """show a progress bar"""
    tensorboard: bool = True
    """also write TensorBoard events"""
    trace: bool = False
    """write a chrome trace (torch.profiler) of the last training step per process"""

    def validate(self) -> Self:
        """The fields' checks and a run name that is a plain folder name."""
        check_fields(self)
        if self.run_name is not None:
            check_run_name(self.run_name)
        return self



SECTIONS: dict[str, type] = {"task": TaskSection, "model": ModelSection, "pipeline": PipelineSection,
                             "compression": CompressionSection, "optim": OptimSection, "run": RunSection}
SECTION_TITLES = {"task": "task and data", "model": "model", "pipeline": "pipeline",
                  "compression": "compression", "optim": "optimization",
                  "run": "evaluation, logging, checkpoints"}


@functools.cache
def options() -> tuple[Option, ...]:
    """Every field of every section, in order."""
    out = [o for section, cls in SECTIONS.items() for o in section_options(section, cls)]
    flats = [o.flat for o in out]
    if len(set(flats)) != len(flats):
        raise TypeError(f"flat option names must be unique: {sorted(n for n in flats if flats.count(n) > 1)}")
    return tuple(out)


@functools.cache
def _by_flat() -> dict[str, Option]:
    return {o.flat: o for o in options()}


@dataclasses.dataclass(kw_only=True)
class TrainConfig:
    """A whole run's settings, one section per concern (see the module docstring)."""

    task: TaskSection = dataclasses.field(default_factory=TaskSection)
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    pipeline: PipelineSection = dataclasses.field(default_factory=PipelineSection)
    compression: CompressionSection = dataclasses.field(default_factory=CompressionSection)
    optim: OptimSection = dataclasses.field(default_factory=OptimSection)
    run: RunSection = dataclasses.field(default_factory=RunSection)

    # -- construction and conversion ---------------------------------------------------------------------
    @classmethod
    def of(cls, **flat: Any) -> Self:
        """A config from options by their flat names (``TrainConfig.of(task="wiki", stages=2)``); an unknown
        name is a :class:`SpecError`. Values are taken as given (types are checked by :meth:`from_flat`).
        With ``lora`` true, ``forward`` and ``backward`` not named take :data:`LORA_FORWARD` and
        :data:`LORA_BACKWARD` (a run's saved settings name both, so its resume keeps what it trained with)."""
        if flat.get("lora"):
            flat = {**{d: v for d, v in (("forward", LORA_FORWARD), ("backward", LORA_BACKWARD))
                       if d not in flat}, **flat}
        return cls().replace(**flat)

    def replace(self, **flat: Any) -> Self:
        """A copy with the options named by their flat names changed."""
        by_flat = _by_flat()
        unknown = sorted(set(flat) - set(by_flat))
        if unknown:
            raise SpecError(f"unknown options {unknown}; see `aqsgd train --help`")
        changes: dict[str, dict[str, Any]] = {}
        for k, v in flat.items():
            o = by_flat[k]
            changes.setdefault(o.section, {})[o.name] = list(v) if isinstance(v, tuple) and o.is_list else v
        return dataclasses.replace(
            self, **{s: dataclasses.replace(getattr(self, s), **c)  # type: ignore[arg-type]
                     for s, c in changes.items()})

    @classmethod
    def from_flat(cls, data: dict[str, Any], *, source: str = "config") -> Self:
        """A config from plain ``{flat name: value}`` values (JSON, the command line), types checked; unknown
        names are an error naming them and ``source``."""
        by_flat = _by_flat()
        unknown = sorted(set(data) - set(by_flat))
        if unknown:
            raise SpecError(f"{source}: unknown options {unknown}; see `aqsgd train --help`")
        return cls.of(**{k: typed(by_flat[k], v, source) for k, v in data.items()})

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "config") -> Self:
        """A config from its nested form (:meth:`to_dict`, a TOML preset): one table per section; an unknown
        table, an unknown key or a key in the wrong table is an error naming it."""
        return cls.from_flat(flatten_tables(data, source, options()), source=source)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def flat(self) -> dict[str, Any]:
        """``{flat name: value}`` of every option."""
        return {o.flat: getattr(getattr(self, o.section), o.name) for o in options()}

    # -- derived -------------------------------------------------------------------------------------------
    @property
    def task_name(self) -> str:
        """The data's name: ``--task``, else the training file's stem or the dataset's name, else ``bbc``."""
        t = self.task
        if t.name is not None:
            return t.name
        if t.train_file is not None:
            return Path(t.train_file).stem or "data"
        if t.dataset is not None:
            return re.sub(r"[^A-Za-z0-9_.+=-]", "-", t.dataset)
        return "bbc"

    @property
    def own_data(self) -> bool:
        """Whether the run trains on the user's data (``--train-file`` or ``--dataset``)."""
        return self.task.train_file is not None or self.task.dataset is not None

    @property
    def batch_size(self) -> int:
        """Samples per pipeline pass of one replica."""
        return self.pipeline.micro_batches * self.pipeline.micro_batch_size

    @property
    def global_batch_size(self) -> int:
        """Samples per pipeline pass over all data-parallel replicas."""
        return self.batch_size * self.pipeline.data_parallel

    @property
    def world_size(self) -> int:
        """Processes of a distributed run's process group: one per stage and replica in it (a replica that
        comes and goes, ``--dp-replica``, is a group of its own)."""
        return self.pipeline.stages * self.pipeline.world_replicas

    # -- checks --------------------------------------------------------------------------------------------
    def validate(self) -> Self:
        """Check every value; raise SpecError naming the option (as it is spelled on the command line). Each
        section checks its own values (``TaskSection.validate``...); here only what reads two sections."""
        from aqsgd.train.adaptive import is_auto

        for section in SECTIONS:
            getattr(self, section).validate()
        compression, epochs = self.compression, self.optim.epochs
        if not 0 <= compression.warmup_epochs <= epochs:
            raise bad("warmup_epochs", f"must be in 0..epochs ({epochs}), got {compression.warmup_epochs}")
        for direction in ("forward", "backward"):  # auto: bits chosen per measured link (train.adaptive)
            if is_auto(getattr(compression, direction)) and self.pipeline.runtime != "distributed":
                raise bad(direction, "auto chooses the bits of each link from its measured speed: it needs "
                          "--runtime distributed (the local runtime has no links)")
        if self.pipeline.dp_elastic:  # last: every other refusal is said without torchft installed too
            from aqsgd.parallel.elastic import elastic_available

            if not elastic_available():
                raise bad("dp_elastic", "needs torchft: pip install 'aqsgd[elastic]' (torch >= 2.7)")
        return self


def flatten_config(data: dict[str, Any]) -> dict[str, Any]:
    """A saved config (``config.json``, a checkpoint's ``trainer.json``) as ``{flat name: value}``: nested
    (tables) or flat (written before the nesting); unknown keys are kept as they are."""
    if all(isinstance(v, dict) for v in data.values()) and set(data) <= set(SECTIONS):
        names = {(o.section, o.name): o.flat for o in options()}
        return {names.get((s, k), k): v for s, table in data.items() for k, v in table.items()}
    return dict(data)


_RUN_NAME = re.compile(r"[A-Za-z0-9_.+=-]+")


def check_run_name(name: str) -> str:
    """A run directory name is one plain path component: it can never point outside ``--output-dir``."""
    if not _RUN_NAME.fullmatch(name) or name in (".", ".."):
        raise SpecError(f"--run-name: {name!r} must be a plain folder name (letters, digits and . _ + = -), "
                        f"not a path")
    return name


def load_toml(path: str | Path) -> dict[str, Any]:
    """A preset's settings as ``{flat name: value}``: one table per section (``[task]``, ``[model]``,
    ``[pipeline]``, ``[compression]``, ``[optim]``, ``[run]``) holding that section's fields. An unknown table
    or key, a key in the wrong table, a key given twice (TOML's own error) or a value of the wrong type is an
    error naming it."""
    source = f"--config {Path(path)}"
    flat = flatten_tables(read_toml(path), source, options())
    return {k: typed(_by_flat()[k], v, source) for k, v in flat.items()}
