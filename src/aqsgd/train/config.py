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

import ast
import dataclasses
import functools
import inspect
import json
import math
import re
import textwrap
import tomllib
import typing
from pathlib import Path
from typing import Any, Self

from aqsgd.errors import SpecError

__all__ = ["TrainConfig", "TaskSection", "ModelSection", "PipelineSection", "CompressionSection",
           "OptimSection", "RunSection", "Option", "options", "load_toml", "flatten_config", "check_run_name"]


MAX_SEED = 2**32 - 1
"""The largest --seed: every seeded generator (numpy's SeedSequence, torch's manual_seed, the synthetic data's
per-sample seeds) takes it without overflow."""


def _flag(default: Any = dataclasses.MISSING, *, flat: str, **kw: Any) -> Any:
    """A field whose flat (command-line) name is not its own name."""
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata={"flat": flat}, **kw)
    return dataclasses.field(default=default, metadata={"flat": flat}, **kw)


@dataclasses.dataclass(kw_only=True)
class TaskSection:
    """Which task (data) a run trains on, and how much of it."""

    name: str | None = _flag(None, flat="task")
    """task: bbc (the default), wiki, fashion-mnist, mnist, synthetic-lm (offline); wikitext-2, glue-cola,
    glue-qnli, cifar10 (hub); a task registered from Python; leave it unset to train on --train-file or
    --dataset"""
    train_file: str | None = None
    """your training data: .jsonl, .json, .csv, .tsv, .txt (one document per line; see --txt-unit) or
    .parquet; a label column makes it text classification, none makes it causal-LM fine-tuning"""
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
    eval_split: float = 0.1
    """fraction of the training data held out for evaluation (seeded) when there is no evaluation file or
    split"""
    max_length: int = 64
    """tokens per sample (text tasks): padded/truncated length or LM chunk length"""
    max_train_samples: int | None = None
    """use only the first N training samples (default: 600 for the built-in tasks, all of your own data; 0:
    all)"""
    max_eval_samples: int | None = None
    """use only the first N evaluation samples (default: 200 for the built-in tasks, all of your own data; 0:
    all)"""
    cache_dir: str | None = None
    """data and weights cache (default $AQSGD_CACHE or ~/.cache/aqsgd)"""


@dataclasses.dataclass(kw_only=True)
class ModelSection:
    """The model and what to change in it."""

    name: str | None = _flag(None, flat="model")
    """model: a Hugging Face hub name (e.g. Qwen/Qwen2.5-0.5B) or a local folder of any supported family (see
    `aqsgd models`), or minilm, smollm2, resnet, tiny-llama, tiny-gpt2 (default: the task's model)"""
    layers: int | None = _flag(None, flat="model_layers")
    """keep only the first N transformer blocks of the model (a reduced model)"""
    dropout: float | None = None
    """set every dropout probability of a transformers model to P (e.g. 0: with dropout a sample's activations
    differ between epochs, which AQ-SGD's deltas carry; default: the model's own)"""
    hidden_size: int = 64
    """hidden size of the random tiny-llama / tiny-gpt2 models"""
    vocab_size: int = 128
    """vocabulary of the random tiny models and of the synthetic-lm task's tokens"""
    lora: bool = False
    """fine-tune LoRA adapters (with peft) instead of every weight: the base weights are frozen, and neither
    optimised, checkpointed nor synchronised between replicas; a classifier's new head is trained whole"""
    lora_rank: int = 8
    """rank of the LoRA adapters"""
    lora_alpha: float = 16.0
    """LoRA scaling numerator (the update is scaled by alpha / rank)"""
    lora_dropout: float = 0.0
    """dropout on the LoRA adapters' input (default 0, as peft's: with dropout a sample's activations differ
    between epochs, which AQ-SGD's deltas carry)"""
    lora_targets: str | None = None
    """modules that get adapters, comma-separated names (e.g. q_proj,v_proj; default: the family's attention
    projections)"""


@dataclasses.dataclass(kw_only=True)
class PipelineSection:
    """How the model is cut into stages and how the stages run."""

    stages: int = 4
    """number of pipeline stages"""
    layers: list[int] | None = None
    """blocks per stage, comma-separated (default: split as --balance says)"""
    balance: str = "layers"
    """how blocks are split without --layers: layers (as many per stage), params (the fewest parameters on
    the largest stage) or measured (for stages of unequal speed: time every stage's forward and backward for
    --balance-passes pipeline passes with the layers split, then train with the split whose slowest stage is
    predicted fastest; the split is recorded as the run's --layers, which --resume, export and eval reuse)"""
    balance_passes: int = 4
    """pipeline passes --balance measured times (after one that warms up) before it chooses the split"""
    emulate_slow_stage: str | None = None
    """an emulation for benchmarks and tests (as --link): STAGE:FACTOR[,STAGE:FACTOR...] makes a stage FACTOR
    times slower, sleeping FACTOR-1 times each forward's and backward's duration after it (1:2: stage 1
    twice as slow, as if it shared its cores)"""
    schedule: str = "1f1b"
    """pipeline schedule: gpipe or 1f1b"""
    micro_batches: int = 4
    """micro-batches per pipeline pass"""
    micro_batch_size: int = 8
    """samples per micro-batch"""
    activation_checkpointing: bool = False
    """recompute each block's activations in the backward pass instead of keeping them (less memory per stage,
    about one more forward of compute; the same numbers)"""
    runtime: str = "local"
    """local: all stages in this process; distributed: one process per stage (started here with PyTorch's
    launcher, or by torchrun)"""
    device: str = "auto"
    """where the stages compute: auto (CUDA when available), cpu or cuda; a distributed process takes
    cuda:(LOCAL_RANK mod device count)"""
    threads: int | None = None
    """CPU threads each process computes with (PyTorch's operations, the codec kernels); default:
    OMP_NUM_THREADS where it is set (torchrun sets 1 for several processes per machine), else every core in
    the local runtime, and in a distributed run the machine's cores shared by its processes (cores //
    processes, at least 1)"""
    p2p_backend: str = "gloo"
    """how packets cross stage boundaries (distributed): gloo (TCP; robust on slow links, GPU tensors are
    staged through pinned host memory) or nccl (GPU to GPU; for fast links)"""
    dp_backend: str = "auto"
    """backend of the data-parallel gradient sync: auto (nccl on GPU, else gloo), gloo or nccl"""
    timeout: float = 60.0
    """seconds a stage waits for a neighbour before failing (distributed)"""
    checksum: bool = True
    """send a CRC-32 of every packet payload between stages and check it on receipt (distributed, gloo: NCCL
    carries none); --no-checksum skips it on trusted links (TCP still checks its segments); the same on every
    stage, free to change on --resume"""
    link: str | None = None
    """emulated links between stages (distributed): one setting for every boundary (100mbit,5ms) or one per
    boundary separated by / (1gbit/50mbit,20ms/200mbit: stages 0-1, 1-2, 2-3); a setting may change during
    the run: 200mbit~20mbit@50 is 20mbit from step 50 on"""
    data_parallel: int = 1
    """replicas of the pipeline (distributed runtime); world size = stages x data_parallel"""
    grad_sync: str = "allreduce"
    """data-parallel gradient synchronization: allreduce, q<bits>[:block<N>], powersgd[:rank<R>] (e.g. q8,
    q4:block256, powersgd:rank4)"""
    grad_bucket_mb: float = 25.0
    """gradient bucket size of the data-parallel synchronization, in MB"""


@dataclasses.dataclass(kw_only=True)
class CompressionSection:
    """What crosses each stage boundary."""

    forward: str = "delta:q2:l2"
    """activations: [SCHEME:]CODEC, scheme direct|delta|ef|ef21 (see `aqsgd codecs`), or auto[:FLOOR][:err=E]:
    AQ-SGD with the bits of each boundary chosen from its measured link (fp16, q8, q6, q4, q3, q2:l2;
    distributed) and each level's measured relative error at most E (default 0.1; none: no budget); the
    default is AQ-SGD at 2 bits with MSE-clipped per-channel scales"""
    backward: str = "direct:q4"
    """activation gradients: [SCHEME:]CODEC, or auto[:FLOOR][:err=E] (bf16, q8, q6, q4 chosen per link)"""
    cache: str = "memory"
    """AQ-SGD cache: memory[:fp16|bf16|fp32], disk[:dtype], lowbit<b>[:block<N>]"""
    ef_key: str = "slot"
    """error-feedback state key: slot or sample"""
    warmup_epochs: int = 1
    """epochs without compression first (AQ-SGD fills its cache there), but for auto links and a
    --warmup-codec"""
    warmup_codec: str = "none"
    """what the warm-up epochs and AQ-SGD's first visits send on every direction compressed with a fixed
    direct or delta setting: none (in full, as in the AQ-SGD paper) or a codec such as q8 (AQ-SGD then caches
    what it decodes to, and its next visit's delta carries the difference); auto links send their level"""

    def fixed_compressed(self) -> dict[str, Any]:
        """The directions compressed with a fixed setting (not auto, codec not none), by name (forward,
        backward), as parsed :class:`~aqsgd.pipeline.compression.DirectionSpec`: where ``--warmup-codec``
        applies, and what an uncompressed warm-up keeps from being used."""
        from aqsgd.pipeline.compression import DirectionSpec
        from aqsgd.train.adaptive import is_auto

        texts = {"forward": self.forward, "backward": self.backward}
        specs = {d: DirectionSpec.parse(text) for d, text in texts.items() if not is_auto(text)}
        return {d: spec for d, spec in specs.items() if spec.codec != "none"}


@dataclasses.dataclass(kw_only=True)
class OptimSection:
    """The optimization."""

    epochs: int = 2
    """training epochs"""
    max_steps: int | None = None
    """stop after this many optimizer steps"""
    optimizer: str = "adamw"
    """adamw or sgd"""
    lr: float = 2e-4
    """peak learning rate"""
    weight_decay: float = 0.01
    """AdamW weight decay (none on norms and biases)"""
    lr_warmup: float = 0.1
    """linear LR warm-up, as a fraction of the total steps"""
    max_grad_norm: float = 1.0
    """clip the global gradient norm (0: off)"""
    skip_nonfinite: int = 0
    """a step whose loss or gradient norm is NaN or infinite never updates the model; 0 stops the run there
    (one line naming the step, the value and what to change), N > 0 skips up to N such steps in a row and
    stops at the next"""
    grad_accum: int = 1
    """pipeline passes accumulated per optimizer step"""
    dtype: str = "auto"
    """compute dtype: auto (bf16 autocast on a GPU that supports it, else fp32), fp32, or bf16 (autocast)"""
    seed: int = 0
    """seed of initialization, data order and stochastic rounding (0 to 2**32 - 1)"""


@dataclasses.dataclass(kw_only=True)
class RunSection:
    """Evaluation, checkpoints, the run directory and what is logged."""

    eval_every: int | None = None
    """evaluate every N steps (default: every epoch; 0: never, not even at the end)"""
    output_dir: str = "runs"
    """parent folder of run directories"""
    run_name: str | None = None
    """run directory name inside --output-dir (default: task-forward-backward); an existing run is never
    appended to: continue it with --resume or replace it with --overwrite"""
    overwrite: bool = False
    """replace an existing run directory of the same name (its metrics and checkpoints are deleted)"""
    checkpoint_every: int | None = None
    """checkpoint every N steps (default: every epoch; 0: never, not even at the end)"""
    checkpoint_minutes: float = 10.0
    """also checkpoint after a step when this many minutes have passed since the last checkpoint (or the
    start), so that an interruption loses minutes, not an epoch (0: by steps or epochs only)"""
    keep_checkpoints: int = 2
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


SECTIONS: dict[str, type] = {"task": TaskSection, "model": ModelSection, "pipeline": PipelineSection,
                             "compression": CompressionSection, "optim": OptimSection, "run": RunSection}
SECTION_TITLES = {"task": "task and data", "model": "model", "pipeline": "pipeline",
                  "compression": "compression", "optim": "optimization",
                  "run": "evaluation, logging, checkpoints"}


def _attribute_docs(cls: type) -> dict[str, str]:
    """The docstring under each annotated field of a dataclass (``ast``: Python keeps none at run time)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


@dataclasses.dataclass(frozen=True)
class Option:
    """One field of the config as the command line and the TOML reader see it."""

    section: str
    name: str  # the field's name inside its section
    flat: str  # its flat name (``--flat-name`` on the command line)
    help: str
    base: type  # int, float, str or bool
    optional: bool  # None allowed
    is_list: bool
    default: Any

    @property
    def flag(self) -> str:
        return "--" + self.flat.replace("_", "-")


@functools.cache
def options() -> tuple[Option, ...]:
    """Every field of every section, in order."""
    out = []
    for section, cls in SECTIONS.items():
        docs = _attribute_docs(cls)
        hints = typing.get_type_hints(cls)
        defaults = cls()
        for f in dataclasses.fields(cls):
            if f.name not in docs:
                raise TypeError(f"{cls.__name__}.{f.name} has no docstring")
            t, optional = hints[f.name], False
            args = typing.get_args(t)
            if type(None) in args:
                optional, t = True, next(a for a in args if a is not type(None))
            is_list = typing.get_origin(t) is list
            base = typing.get_args(t)[0] if is_list else t
            out.append(Option(section, f.name, f.metadata.get("flat", f.name), docs[f.name], base, optional,
                              is_list, getattr(defaults, f.name)))
    flats = [o.flat for o in out]
    if len(set(flats)) != len(flats):
        raise TypeError(f"flat option names must be unique: {sorted(n for n in flats if flats.count(n) > 1)}")
    return tuple(out)


@functools.cache
def _by_flat() -> dict[str, Option]:
    return {o.flat: o for o in options()}


def _typed(opt: Option, value: Any, source: str) -> Any:
    """``value`` checked against the option's type (an int where a float is expected is converted)."""
    if value is None and opt.optional:
        return None

    def one(v: Any) -> Any:
        if opt.base is float and isinstance(v, int) and not isinstance(v, bool):
            return float(v)
        if isinstance(v, opt.base) and not (opt.base is int and isinstance(v, bool)):
            return v
        raise SpecError(f"{source}: {opt.flat} must be {_type_name(opt)}, got {v!r}")

    if opt.is_list:
        if not isinstance(value, list):
            raise SpecError(f"{source}: {opt.flat} must be {_type_name(opt)}, got {value!r}")
        return [one(v) for v in value]
    return one(value)


def _type_name(opt: Option) -> str:
    name = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}[opt.base]
    if opt.is_list:
        name = f"a list of {name.split(' ', 1)[1]}s"
    return name + (" (or omitted)" if opt.optional else "")


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
        name is a :class:`SpecError`. Values are taken as given (types are checked by :meth:`from_flat`)."""
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
        return cls.of(**{k: _typed(by_flat[k], v, source) for k, v in data.items()})

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "config") -> Self:
        """A config from its nested form (:meth:`to_dict`, a TOML preset): one table per section; an unknown
        table, an unknown key or a key in the wrong table is an error naming it."""
        return cls.from_flat(_flatten_tables(data, source), source=source)

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
        """Processes of a distributed run: one per stage and replica."""
        return self.pipeline.stages * self.pipeline.data_parallel

    # -- checks --------------------------------------------------------------------------------------------
    def validate(self) -> Self:
        """Check every value; raise SpecError naming the option (as it is spelled on the command line)."""
        from aqsgd.comm.link import parse_links
        from aqsgd.compress import make_codec
        from aqsgd.train.adaptive import is_auto, parse_auto
        from aqsgd.parallel.sync import parse_grad_sync
        from aqsgd.pipeline.balance import parse_slow_stages
        from aqsgd.pipeline.compression import DirectionSpec
        from aqsgd.pipeline.schedule import get_schedule
        from aqsgd.schemes.factory import make_cache

        v = self.flat()

        def bad(name: str, why: str) -> SpecError:
            return SpecError(f"--{name.replace('_', '-')}: {why}")

        def parsed(name: str, parse: Any) -> None:
            try:
                parse(v[name])
            except ValueError as e:
                raise bad(name, str(e)) from None

        for name, value in v.items():  # floats: no NaN or infinity anywhere
            if isinstance(value, float) and not math.isfinite(value):
                raise bad(name, f"must be a finite number, got {value}")
        for name in ("stages", "micro_batches", "micro_batch_size", "epochs", "grad_accum", "max_length",
                     "keep_checkpoints", "data_parallel", "hidden_size", "vocab_size", "balance_passes"):
            if v[name] < 1:
                raise bad(name, f"must be >= 1, got {v[name]}")
        if not 0 <= v["seed"] <= MAX_SEED:
            raise bad("seed", f"must be in 0..{MAX_SEED} (2**32 - 1), got {v['seed']}")
        if v["skip_nonfinite"] < 0:
            raise bad("skip_nonfinite", f"must be >= 0 (0: stop at the first non-finite step), got "
                      f"{v['skip_nonfinite']}")
        for name in ("max_steps", "model_layers", "threads"):
            if v[name] is not None and v[name] < 1:
                raise bad(name, f"must be >= 1, got {v[name]}")
        for name in ("eval_every", "checkpoint_every"):
            if v[name] is not None and v[name] < 0:
                raise bad(name, f"must be >= 0 (0: never), got {v[name]}")
        for name in ("max_train_samples", "max_eval_samples"):
            if v[name] is not None and v[name] < 0:
                raise bad(name, f"must be >= 0 (0: all), got {v[name]}")
        if v["checkpoint_minutes"] < 0:
            raise bad("checkpoint_minutes", f"must be >= 0 (0: by steps or epochs only), got "
                      f"{v['checkpoint_minutes']}")
        if not v["lora"]:  # an adapter setting without adapters would be ignored: say so instead
            given = [n for n in ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets")
                     if v[n] != getattr(ModelSection, n)]
            if given:
                raise bad(given[0], f"{v[given[0]]} sets the LoRA adapters, but this run has none: add "
                          f"--lora (or leave --{given[0].replace('_', '-')} out)")
        if v["lora_rank"] < 1:
            raise bad("lora_rank", f"must be >= 1, got {v['lora_rank']}")
        if not v["lora_alpha"] > 0:
            raise bad("lora_alpha", f"must be > 0, got {v['lora_alpha']}")
        if not 0 <= v["lora_dropout"] < 1:
            raise bad("lora_dropout", f"must be in [0, 1), got {v['lora_dropout']}")
        if v["lora_targets"] is not None and not [t for t in v["lora_targets"].split(",") if t.strip()]:
            raise bad("lora_targets", "must name at least one module")
        if v["dropout"] is not None and not 0 <= v["dropout"] < 1:
            raise bad("dropout", f"must be in [0, 1), got {v['dropout']}")
        if v["warmup_epochs"] < 0 or v["warmup_epochs"] > v["epochs"]:
            raise bad("warmup_epochs", f"must be in 0..epochs ({v['epochs']}), got {v['warmup_epochs']}")
        if not v["lr"] > 0:
            raise bad("lr", f"must be > 0, got {v['lr']}")
        if not 0 <= v["lr_warmup"] < 1:
            raise bad("lr_warmup", f"must be in [0, 1), got {v['lr_warmup']}")
        for name in ("weight_decay", "max_grad_norm"):
            if v[name] < 0:
                raise bad(name, f"must be >= 0, got {v[name]}")
        if not v["timeout"] > 0:
            raise bad("timeout", f"must be > 0 seconds, got {v['timeout']}")
        for name, valid in (("runtime", ("local", "distributed")), ("optimizer", ("adamw", "sgd")),
                            ("device", ("auto", "cpu", "cuda")), ("p2p_backend", ("gloo", "nccl")),
                            ("dp_backend", ("auto", "gloo", "nccl")),
                            ("dtype", ("auto", "fp32", "bf16")),
                            ("balance", ("layers", "params", "measured")),
                            ("ef_key", ("slot", "sample"))):
            if v[name] not in valid:
                raise bad(name, f"{v[name]!r} is not one of {', '.join(valid)}")
        if v["data_parallel"] > 1 and v["runtime"] != "distributed":
            raise bad("data_parallel", f"{v['data_parallel']} replicas need --runtime distributed (one "
                      "process per stage and replica); the local runtime runs one pipeline")
        parsed("grad_sync", parse_grad_sync)
        if not v["grad_bucket_mb"] > 0:
            raise bad("grad_bucket_mb", f"must be > 0, got {v['grad_bucket_mb']}")
        parsed("schedule", get_schedule)
        for direction in ("forward", "backward"):
            if is_auto(v[direction]):  # bits chosen per link (aqsgd.train.adaptive): measured links needed
                parsed(direction, lambda text, d=direction: parse_auto(text, d))
                if v["runtime"] != "distributed":
                    raise bad(direction, "auto chooses the bits of each link from its measured speed: it "
                              "needs --runtime distributed (the local runtime has no links)")
            else:
                parsed(direction, DirectionSpec.parse)
        if v["warmup_codec"] != "none":
            parsed("warmup_codec", make_codec)
            fixed = self.compression.fixed_compressed()
            for d, spec in fixed.items():
                if spec.scheme not in ("direct", "delta"):
                    raise bad("warmup_codec", f"--{d} {v[d]}: {spec.scheme} keeps the warm-up's exact values "
                              "(error feedback); only direct and delta directions take a warm-up codec")
            if not fixed:
                raise bad("warmup_codec", f"is for directions compressed with a fixed setting; --forward "
                          f"{v['forward']} and --backward {v['backward']} have none (auto links send their "
                          "level in the warm-up)")
            if v["warmup_epochs"] == 0 and all(spec.scheme != "delta" for spec in fixed.values()):
                raise bad("warmup_codec", "with --warmup-epochs 0 only AQ-SGD's first visits go in full, and "
                          "no direction here is delta: nothing would be sent with it")
        if not v["cache"].startswith("disk"):
            parsed("cache", lambda spec: make_cache(spec, 1, row_shape=(1,), path="/dev/null"))
        if v["layers"] is not None and len(v["layers"]) != v["stages"]:
            raise bad("layers", f"{len(v['layers'])} counts for {v['stages']} stages")
        if v["layers"] is not None and min(v["layers"]) < 1:
            raise bad("layers",
                      f"every stage needs at least one block, got {','.join(map(str, v['layers']))}")
        if v["emulate_slow_stage"] is not None:
            parsed("emulate_slow_stage", lambda text: parse_slow_stages(text, v["stages"]))
        if v["link"] is not None and v["runtime"] != "distributed":
            raise bad("link", "emulates the links between stage processes: it needs --runtime distributed "
                      "(the local runtime passes tensors in memory)")
        if v["run_name"] is not None:
            check_run_name(v["run_name"])
        if v["link"] is not None:
            parsed("link", lambda text: parse_links(text, v["stages"] - 1))
            schedules = parse_links(v["link"], v["stages"] - 1)
            if v["data_parallel"] > 1 and len(set(schedules)) > 1:
                raise bad("link", "one setting per boundary is for a single pipeline; with --data-parallel "
                          "the replicas' links are no boundary of it: give one setting")
            if v["data_parallel"] > 1 and any(s.varies for s in schedules):
                raise bad("link", "a setting that changes during the run (~SPEC@STEP) is for a single "
                          "pipeline; with --data-parallel give one fixed setting")
        if v["p2p_backend"] != "gloo" and v["runtime"] != "distributed":
            raise bad("p2p_backend", "carries packets between stage processes: it needs --runtime "
                      "distributed (the local runtime passes tensors in memory)")
        if v["dp_backend"] != "auto" and v["data_parallel"] < 2:
            raise bad("dp_backend", "is the backend of the data-parallel gradient sync: it needs "
                      "--data-parallel 2 or more")
        if v["device"] == "cpu" and "nccl" in (v["p2p_backend"], v["dp_backend"]):
            which = "p2p_backend" if v["p2p_backend"] == "nccl" else "dp_backend"
            raise bad(which, "nccl runs on GPUs only; it needs --device cuda (or auto on a machine with one)")
        own = [n for n in ("train_file", "dataset") if v[n] is not None]
        if len(own) > 1:
            raise bad("dataset", "give either --train-file or --dataset, not both")
        if own and v["task"] is not None:
            raise bad("task", f"{v['task']!r} and --{own[0].replace('_', '-')} both name the data; give one")
        if v["eval_file"] is not None and v["train_file"] is None:
            raise bad("eval_file", "needs --train-file (the training data in the same format)")
        if not 0 < v["eval_split"] < 1:
            raise bad("eval_split", f"must be in (0, 1), got {v['eval_split']}")
        for name in ("text_column", "text_pair_column", "label_column"):
            if v[name] is not None and not v[name].strip():
                raise bad(name, "must name a column, got an empty string")
        from aqsgd.data.datasets.records import TXT_UNITS

        if v["txt_unit"] not in TXT_UNITS:
            raise bad("txt_unit", f"{v['txt_unit']!r} is not one of {', '.join(TXT_UNITS)}")
        if v["txt_unit"] != "line" and not any(str(v[n]).lower().endswith(".txt")
                                               for n in ("train_file", "eval_file") if v[n] is not None):
            raise bad("txt_unit", f"{v['txt_unit']} cuts .txt files into documents, and neither --train-file "
                      "nor --eval-file is one")
        return self


def _flatten_tables(data: dict[str, Any], source: str) -> dict[str, Any]:
    """``{table: {key: value}}`` to ``{flat name: value}``, naming an unknown table, an unknown key or a key
    in the wrong table."""
    by_section = {s: {o.name: o for o in options() if o.section == s} for s in SECTIONS}
    by_flat = _by_flat()
    flat: dict[str, Any] = {}
    for table, values in data.items():
        if not isinstance(values, dict):
            if table in by_flat:
                o = by_flat[table]
                raise SpecError(f"{source}: {table!r} belongs in table [{o.section}] (as {o.name} = ...)")
            raise SpecError(f"{source}: unknown key {table!r}; settings go in the tables "
                            f"{', '.join(f'[{s}]' for s in SECTIONS)}")
        if table not in by_section:
            raise SpecError(f"{source}: unknown table [{table}]; tables are {', '.join(SECTIONS)}")
        for key, value in values.items():
            name = key.replace("-", "_")
            o = by_section[table].get(name)
            if o is None:
                home = [x for x in options() if x.flat == name or (x.name == name and x.section != table)]
                where = ""
                if home:
                    where = f"; {key!r} belongs in [{home[0].section}]"
                    where += f" (as {home[0].name})" if home[0].name != name else ""
                raise SpecError(f"{source}: unknown key {key!r} in [{table}]{where}; see "
                                "`aqsgd train --help`")
            flat[o.flat] = value  # unique: TOML refuses a key twice in a table, and tables map to sections
    return flat


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
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"--config: no such file {p}")
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise SpecError(f"--config {p}: {e}") from None
    source = f"--config {p}"
    flat = _flatten_tables(data, source)
    by_flat = _by_flat()
    return {k: _typed(by_flat[k], v, source) for k, v in flat.items()}
