"""``aqsgd train``: fine-tune a model over a compressed pipeline.

Every field of :class:`~aqsgd.train.config.TrainConfig` is an option; ``--config PRESET.toml`` loads a preset
first and the options given on the command line override it. With no arguments it runs the embedded default:
MiniLM fine-tuned on BBC news over a 4-stage local pipeline, AQ-SGD fw2/bw4 after one uncompressed epoch.

``--runtime distributed`` starts one process per stage on this machine through PyTorch's elastic launcher;
with ``--data-parallel D`` it starts ``stages x D`` (D replicas of the pipeline, each on its own shard of every
global batch, gradients averaged per stage with ``--grad-sync``). Across machines, start the same command
under ``torchrun`` (it sets RANK/WORLD_SIZE/MASTER_ADDR) with a world size of exactly ``stages x D``: every
process then runs its own stage of its own replica (rank = replica x stages + stage), e.g.::

    torchrun --nnodes 4 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m aqsgd train --runtime distributed --stages 4 --run-name bbc-aqsgd
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Any

from aqsgd.train.config import TrainConfig, config_fields, field_type, load_toml

_SECTIONS = {"task": "task, model, data", "pipeline": "pipeline", "compression": "compression",
             "optim": "optimization", "run": "evaluation, logging, checkpoints"}


def _parse_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _optional(conv):
    def parse(text: str):
        if text.lower() in ("none", "null", ""):
            return None
        return conv(text)

    parse.__name__ = getattr(conv, "__name__", "value")
    return parse


def _help_text(text: str, default: Any) -> str:
    """A field's help with its default appended, unless the text already says what the default is (a None
    default means "derived", which the text explains)."""
    if default is None or "(default" in text:
        return text
    shown = ",".join(map(str, default)) if isinstance(default, list) else default
    return f"{text} (default: {shown})"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="fine-tune a model over a compressed pipeline", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="PRESET.toml", help="load settings from a TOML preset (options override it)")
    groups = {k: p.add_argument_group(v) for k, v in _SECTIONS.items()}
    defaults = TrainConfig()
    for f in config_fields():
        base, optional, is_list = field_type(f)
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        help_text = _help_text(f.metadata["help"], default)
        group = groups[f.metadata["section"]]
        if base is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
            continue
        conv = _parse_list if is_list else base
        conv = _optional(conv) if optional else conv
        group.add_argument(flag, dest=f.name, type=conv, default=None, metavar=f.name.upper(), help=help_text)
    p.set_defaults(func=run)


def build_config(args: argparse.Namespace) -> TrainConfig:
    values: dict[str, Any] = load_toml(args.config) if args.config else {}
    for f in config_fields():
        v = getattr(args, f.name, None)
        if v is not None:
            values[f.name] = v
    return TrainConfig.from_dict(values).validate()


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def _worker(cfg_json: str) -> dict[str, Any] | None:
    """One stage process: run the trainer for this rank; the process that writes the metrics (last stage of
    replica 0) returns the summary."""
    import datetime

    import torch.distributed as dist

    from aqsgd.comm.launch import leave_process_group
    from aqsgd.train.job import check_same_settings
    from aqsgd.train.trainer import Trainer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [pid %(process)d] %(message)s")
    cfg = TrainConfig.from_dict(json.loads(cfg_json))
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=max(cfg.timeout, 10)))
    check_same_settings(cfg.to_dict())
    clean = False
    try:
        summary = Trainer(cfg).run()
        clean = True
    finally:
        leave_process_group(clean=clean, timeout_s=cfg.timeout)
    return summary if summary.get("final_train_loss") is not None else None


def run(args: argparse.Namespace) -> int:
    cfg = build_config(args)
    if cfg.runtime == "distributed" and _under_torchrun():
        summary = _worker(cfg.to_json())
        if summary:
            print_summary(summary)
        return 0
    if cfg.runtime == "distributed":
        from aqsgd.comm.launch import launch_local
        from aqsgd.train.rundir import check_run_dir, resolve_run_dir
        from aqsgd.train.tasks import setup_task
        from aqsgd.train.trainer import check_partition

        # prepare data sources and the weights file once, and check what would fail in every stage process alike
        check_run_dir(cfg, resolve_run_dir(cfg))
        check_partition(cfg, setup_task(cfg).recipe)
        from aqsgd.parallel.grid import GridLayout

        # a failing stage ends in StageFailedError: one line naming the stage at fault and the details file
        names = GridLayout(cfg.stages, cfg.data_parallel).label
        results = launch_local(_worker, cfg.world_size, cfg.to_json(), rank_names=names)
        summary = next((r for r in results if r), None)
    else:
        from aqsgd.train.trainer import Trainer

        summary = Trainer(cfg).run()
    if summary:
        print_summary(summary)
    return 0


def print_summary(s: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    replicas = s.get("data_parallel", 1)
    layout = f"{s['stages']} stages" + (f" x {replicas} replicas" if replicas > 1 else "")
    table = Table(title=f"{s['task']} · {s['setting']} · {layout} ({s['runtime']})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("steps", str(s["steps"]))
    if s.get("final_train_loss") is not None:
        table.add_row("final training loss", f"{s['final_train_loss']:.4f}")
    for name, vals in (s.get("eval") or {}).items():
        for k, v in vals.items():
            table.add_row(f"eval {k} (compression {'on' if name == 'compressed' else 'off'})", f"{v:.4f}")
    table.add_row("bytes sent between stages", f"{s['bytes_sent']:,}")
    table.add_row("bytes at fp32", f"{s['raw_bytes']:,}")
    if s.get("traffic_saved") is not None:
        table.add_row("traffic saved vs fp32", f"{100 * s['traffic_saved']:.1f}% ({s['compression_ratio']:.2f}x less)")
    if replicas > 1:
        table.add_row(f"bytes sent between replicas ({s['grad_sync']})", f"{s['grad_sync_bytes']:,}")
    if s.get("samples_per_s"):
        table.add_row("samples/s", f"{s['samples_per_s']:.1f}")
    table.add_row("run directory", s["run_dir"])
    Console().print(table)
