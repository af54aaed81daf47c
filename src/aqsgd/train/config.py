"""Training configuration: one dataclass, documented field by field, loadable from TOML presets and
overridable from the command line (every field is a ``--flag``; its docstring is its ``--help``)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import tomllib
import typing
from pathlib import Path
from typing import Any

from aqsgd.errors import SpecError

__all__ = ["TrainConfig", "load_toml", "config_fields", "check_run_name"]


def _f(default: Any, help: str, section: str, **kw: Any) -> Any:
    meta = {"help": help, "section": section, **kw}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass
class TrainConfig:
    # -- task, model, data -----------------------------------------------------------------------------
    task: str = _f("bbc", "task: bbc, wiki, fashion-mnist, mnist, synthetic-lm (offline); wikitext-2, glue-cola, "
                   "glue-qnli, cifar10 (hub)", "task")
    model: str | None = _f(None, "model: minilm, smollm2, resnet, tiny-llama, a hub name such as gpt2, or a local "
                           "folder (default: the task's model)", "task")
    max_length: int = _f(64, "tokens per sample (text tasks): padded/truncated length or LM chunk length", "task")
    max_train_samples: int | None = _f(600, "use only the first N training samples (0: all)", "task")
    max_eval_samples: int | None = _f(200, "use only the first N evaluation samples (0: all)", "task")
    cache_dir: str | None = _f(None, "data and weights cache (default $AQSGD_CACHE or ~/.cache/aqsgd)", "task")
    model_layers: int | None = _f(None, "keep only the first N transformer blocks of the model (a reduced model)",
                                  "task")
    dropout: float | None = _f(None, "set every dropout probability of a transformers model to P (e.g. 0: with "
                               "dropout a sample's activations differ between epochs, which AQ-SGD's deltas "
                               "carry; default: the model's own)", "task")
    # -- pipeline ----------------------------------------------------------------------------------------
    stages: int = _f(4, "number of pipeline stages", "pipeline")
    layers: list[int] | None = _f(None, "blocks per stage, comma-separated (default: balanced)", "pipeline")
    balance: str = _f("layers", "default balance: layers or params", "pipeline")
    schedule: str = _f("1f1b", "pipeline schedule: gpipe or 1f1b", "pipeline")
    micro_batches: int = _f(4, "micro-batches per pipeline pass", "pipeline")
    micro_batch_size: int = _f(8, "samples per micro-batch", "pipeline")
    runtime: str = _f("local", "local: all stages in this process; distributed: one process per stage (started "
                      "here with PyTorch's launcher, or by torchrun)", "pipeline")
    timeout: float = _f(60.0, "seconds a stage waits for a neighbour before failing (distributed)", "pipeline")
    link: str | None = _f(None, "emulated link between stages, e.g. 100mbit,5ms (distributed)", "pipeline")
    data_parallel: int = _f(1, "replicas of the pipeline (distributed runtime); world size = stages x data_parallel",
                            "pipeline")
    grad_sync: str = _f("allreduce", "data-parallel gradient synchronization: allreduce, q<bits>[:block<N>], "
                        "powersgd[:rank<R>] (e.g. q8, q4:block256, powersgd:rank4)", "pipeline")
    grad_bucket_mb: float = _f(25.0, "gradient bucket size of the data-parallel synchronization, in MB", "pipeline")
    # -- compression -------------------------------------------------------------------------------------
    forward: str = _f("delta:q2:l2", "activations: [SCHEME:]CODEC, scheme direct|delta|ef|ef21 (see `aqsgd codecs`); "
                      "the default is AQ-SGD at 2 bits with MSE-clipped per-channel scales", "compression")
    backward: str = _f("direct:q4", "activation gradients: [SCHEME:]CODEC", "compression")
    cache: str = _f("memory", "AQ-SGD cache: memory[:fp16|bf16|fp32], disk[:dtype], lowbit<b>[:block<N>]",
                    "compression")
    ef_key: str = _f("slot", "error-feedback state key: slot or sample", "compression")
    warmup_epochs: int = _f(1, "epochs without compression first (AQ-SGD fills its cache there)", "compression")
    # -- optimization ------------------------------------------------------------------------------------
    epochs: int = _f(2, "training epochs", "optim")
    max_steps: int | None = _f(None, "stop after this many optimizer steps", "optim")
    optimizer: str = _f("adamw", "adamw or sgd", "optim")
    lr: float = _f(2e-4, "peak learning rate", "optim")
    weight_decay: float = _f(0.01, "AdamW weight decay (none on norms and biases)", "optim")
    lr_warmup: float = _f(0.1, "linear LR warm-up, as a fraction of the total steps", "optim")
    max_grad_norm: float = _f(1.0, "clip the global gradient norm (0: off)", "optim")
    grad_accum: int = _f(1, "pipeline passes accumulated per optimizer step", "optim")
    dtype: str = _f("fp32", "compute dtype: fp32, or bf16 (autocast)", "optim")
    seed: int = _f(0, "seed of initialization, data order and stochastic rounding", "optim")
    # -- evaluation, logging, checkpoints ----------------------------------------------------------------
    eval_every: int | None = _f(None, "evaluate every N steps (default: every epoch)", "run")
    output_dir: str = _f("runs", "parent folder of run directories", "run")
    run_name: str | None = _f(None, "run directory name inside --output-dir (default: task-forward-backward); an "
                              "existing run is never appended to: continue it with --resume or replace it with "
                              "--overwrite", "run")
    overwrite: bool = _f(False, "replace an existing run directory of the same name (its metrics and "
                         "checkpoints are deleted)", "run")
    checkpoint_every: int | None = _f(None, "checkpoint every N steps (default: every epoch)", "run")
    keep_checkpoints: int = _f(2, "how many checkpoints to keep", "run")
    resume: str | None = _f(None, "resume from a run directory or checkpoint folder", "run")
    progress: bool = _f(True, "show a progress bar", "run")
    tensorboard: bool = _f(True, "also write TensorBoard events", "run")
    trace: bool = _f(False, "write a chrome trace of the last training step per stage", "run")

    # -- derived -------------------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        """Samples per pipeline pass of one replica."""
        return self.micro_batches * self.micro_batch_size

    @property
    def global_batch_size(self) -> int:
        """Samples per pipeline pass over all data-parallel replicas."""
        return self.batch_size * self.data_parallel

    @property
    def world_size(self) -> int:
        """Processes of a distributed run: one per stage and replica."""
        return self.stages * self.data_parallel

    def validate(self) -> TrainConfig:
        """Check every value; raise SpecError naming the option (as it is spelled on the command line)."""
        from aqsgd.parallel.sync import parse_grad_sync
        from aqsgd.pipeline.compression import DirectionSpec
        from aqsgd.pipeline.schedule import get_schedule
        from aqsgd.schemes.factory import make_cache

        def bad(name: str, why: str) -> SpecError:
            return SpecError(f"--{name.replace('_', '-')}: {why}")

        for f in dataclasses.fields(self):  # floats: no NaN or infinity anywhere
            v = getattr(self, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise bad(f.name, f"must be a finite number, got {v}")
        for name in ("stages", "micro_batches", "micro_batch_size", "epochs", "grad_accum", "max_length",
                     "keep_checkpoints", "data_parallel"):
            if getattr(self, name) < 1:
                raise bad(name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("max_steps", "eval_every", "checkpoint_every", "model_layers"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise bad(name, f"must be >= 1, got {v}")
        for name in ("max_train_samples", "max_eval_samples"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise bad(name, f"must be >= 0 (0: all), got {v}")
        if self.dropout is not None and not 0 <= self.dropout < 1:
            raise bad("dropout", f"must be in [0, 1), got {self.dropout}")
        if self.warmup_epochs < 0 or self.warmup_epochs > self.epochs:
            raise bad("warmup_epochs", f"must be in 0..epochs ({self.epochs}), got {self.warmup_epochs}")
        if not self.lr > 0:
            raise bad("lr", f"must be > 0, got {self.lr}")
        if not 0 <= self.lr_warmup < 1:
            raise bad("lr_warmup", f"must be in [0, 1), got {self.lr_warmup}")
        for name in ("weight_decay", "max_grad_norm"):
            if getattr(self, name) < 0:
                raise bad(name, f"must be >= 0, got {getattr(self, name)}")
        if not self.timeout > 0:
            raise bad("timeout", f"must be > 0 seconds, got {self.timeout}")
        for name, valid in (("runtime", ("local", "distributed")), ("optimizer", ("adamw", "sgd")),
                            ("dtype", ("fp32", "bf16")), ("balance", ("layers", "params")),
                            ("ef_key", ("slot", "sample"))):
            if getattr(self, name) not in valid:
                raise bad(name, f"{getattr(self, name)!r} is not one of {', '.join(valid)}")
        if self.data_parallel > 1 and self.runtime != "distributed":
            raise bad("data_parallel", f"{self.data_parallel} replicas need --runtime distributed (one process per "
                      f"stage and replica); the local runtime runs one pipeline")
        try:
            parse_grad_sync(self.grad_sync)
        except ValueError as e:
            raise bad("grad_sync", str(e)) from None
        if not self.grad_bucket_mb > 0:
            raise bad("grad_bucket_mb", f"must be > 0, got {self.grad_bucket_mb}")
        try:
            get_schedule(self.schedule)
        except ValueError as e:
            raise bad("schedule", str(e)) from None
        for name in ("forward", "backward"):
            try:
                DirectionSpec.parse(getattr(self, name))
            except ValueError as e:
                raise bad(name, str(e)) from None
        try:
            make_cache(self.cache, 1, row_shape=(1,), path="/dev/null") if not self.cache.startswith("disk") else None
        except ValueError as e:
            raise bad("cache", str(e)) from None
        if self.layers is not None and len(self.layers) != self.stages:
            raise bad("layers", f"{len(self.layers)} counts for {self.stages} stages")
        if self.layers is not None and min(self.layers) < 1:
            raise bad("layers", f"every stage needs at least one block, got {','.join(map(str, self.layers))}")
        if self.link is not None and self.runtime != "distributed":
            raise bad("link", "emulates the links between stage processes: it needs --runtime distributed (the "
                      "local runtime passes tensors in memory)")
        if self.run_name is not None:
            check_run_name(self.run_name)
        if self.link is not None:
            from aqsgd.comm import LinkSpec

            try:
                LinkSpec.parse(self.link)
            except ValueError as e:
                raise bad("link", str(e)) from None
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "config") -> TrainConfig:
        """A config from plain values (TOML, JSON): unknown keys and values of the wrong type are errors that
        name the key and ``source``."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise SpecError(f"unknown config keys {unknown}; see `aqsgd train --help`")
        return cls(**{k: _typed(known[k], v, source) for k, v in data.items()})


def _typed(f: dataclasses.Field, value: Any, source: str) -> Any:
    """``value`` checked against the field's type (an int where a float is expected is converted)."""
    base, optional, is_list = field_type(f)
    if value is None and optional:
        return None

    def one(v: Any) -> Any:
        if base is float and isinstance(v, int) and not isinstance(v, bool):
            return float(v)
        if isinstance(v, base) and not (base is int and isinstance(v, bool)):
            return v
        raise SpecError(f"{source}: {f.name} must be {_type_name(base, is_list, optional)}, got {v!r}")

    if is_list:
        if not isinstance(value, list):
            raise SpecError(f"{source}: {f.name} must be {_type_name(base, True, optional)}, got {value!r}")
        return [one(v) for v in value]
    return one(value)


def _type_name(base: type, is_list: bool, optional: bool) -> str:
    name = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}[base]
    if is_list:
        name = f"a list of {name.split(' ', 1)[1]}s"
    return name + (" (or omitted)" if optional else "")


_RUN_NAME = re.compile(r"[A-Za-z0-9_.+=-]+")


def check_run_name(name: str) -> str:
    """A run directory name is one plain path component: it can never point outside ``--output-dir``."""
    if not _RUN_NAME.fullmatch(name) or name in (".", ".."):
        raise SpecError(f"--run-name: {name!r} must be a plain folder name (letters, digits and . _ + = -), "
                        f"not a path")
    return name


def config_fields() -> list[dataclasses.Field]:
    return list(dataclasses.fields(TrainConfig))


def field_type(f: dataclasses.Field) -> tuple[type, bool, bool]:
    """(base type, optional?, list?) of a TrainConfig field."""
    hints = typing.get_type_hints(TrainConfig)
    t = hints[f.name]
    optional = False
    args = typing.get_args(t)
    if type(None) in args:
        optional = True
        t = next(a for a in args if a is not type(None))
    if typing.get_origin(t) is list:
        return typing.get_args(t)[0], optional, True
    return t, optional, False


def load_toml(path: str | Path) -> dict[str, Any]:
    """A preset: keys at the top level, or in the table of their section (``[task]``, ``[pipeline]``,
    ``[compression]``, ``[optim]``, ``[run]``, as ``aqsgd train --help`` groups them). An unknown key, a key
    in the wrong table, a key given twice or a value of the wrong type is an error naming it."""
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"--config: no such file {p}")
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise SpecError(f"--config {p}: {e}") from None
    fields = {f.name: f for f in config_fields()}
    sections = {f.metadata["section"] for f in fields.values()}
    flat: dict[str, Any] = {}

    def put(key: str, value: Any, table: str | None) -> None:
        name = key.replace("-", "_")
        where = f"[{table}] {key}" if table else key
        if name not in fields:
            raise SpecError(f"--config {p}: unknown key {where!r}; see `aqsgd train --help`")
        section = fields[name].metadata["section"]
        if table is not None and section != table:
            raise SpecError(f"--config {p}: {key!r} belongs in [{section}], not [{table}]")
        if name in flat:
            raise SpecError(f"--config {p}: {key!r} is given twice")
        flat[name] = _typed(fields[name], value, f"--config {p}")

    for k, v in data.items():
        if isinstance(v, dict):
            if k not in sections:
                raise SpecError(f"--config {p}: unknown table [{k}]; tables are {', '.join(sorted(sections))}")
            for k2, v2 in v.items():
                put(k2, v2, k)
        else:
            put(k, v, None)
    return flat
