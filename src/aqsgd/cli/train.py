"""``aqsgd train``: fine-tune a model over a compressed pipeline.

Every field of the nested :class:`~aqsgd.train.config.TrainConfig` is an option, grouped below by its section;
``--config PRESET.toml`` loads a preset (one table per section) first and the options given on the command
line override it. ``--resume RUN`` continues a run with the settings it was trained with (options given
beside it override those that may change: ``--epochs``, ``--lr``, ``--eval-every``...). With no arguments it
runs the embedded default: MiniLM fine-tuned on BBC news over a 4-stage local pipeline, one warm-up epoch
on the entropy-coded 4-bit grid, then AQ-SGD's deltas and the gradients each in a learned basis of a quarter
of the row's dimensions (about 0.6 bits a value each way).

``--runtime distributed`` starts one process per stage on this machine through PyTorch's elastic launcher;
with ``--data-parallel D`` it starts ``stages x D`` (D replicas of the pipeline, each on its own shard of
every global batch, gradients averaged per stage with ``--grad-sync``). Across machines, start the same
command under ``torchrun`` (it sets RANK/WORLD_SIZE/MASTER_ADDR) with a world size of exactly ``stages x D``:
every process then runs its own stage of its own replica (rank = replica x stages + stage), e.g.::

    AQSGD_NODE_RANK=$NODE torchrun --nnodes 4 --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 -m aqsgd train --runtime distributed --stages 4 --run-name bbc-aqsgd

``AQSGD_NODE_RANK`` (0..M-1, one per machine) says which machine holds which stages (torchrun's c10d
rendezvous orders them arbitrarily otherwise).
"""

from __future__ import annotations

import argparse
from typing import Any

from aqsgd.errors import SpecError
from aqsgd.train.config import SECTION_TITLES, TrainConfig, load_toml, options


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
    default means "derived", which the text explains); each ``%`` doubled (argparse formats help with
    ``%``)."""
    if default is not None and "(default" not in text:
        shown = ",".join(map(str, default)) if isinstance(default, list) else default
        text = f"{text} (default: {shown})"
    return text.replace("%", "%%")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="fine-tune a model over a compressed pipeline", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="PRESET.toml",
                   help="load settings from a TOML preset (options override it)")
    from aqsgd.cli.options import plain_text  # (the help of an option is its field's docstring: reST)

    groups = {k: p.add_argument_group(v) for k, v in SECTION_TITLES.items()}
    for o in options():
        help_text = _help_text(plain_text(o.help), o.default)
        group = groups[o.section]
        if o.base is bool:
            group.add_argument(o.flag, dest=o.flat, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=help_text)
            continue
        conv = _parse_list if o.is_list else o.base
        conv = _optional(conv) if o.optional else conv
        # only the options given are set (``--max-steps none`` is a value given: it overrides a resumed run's)
        group.add_argument(o.flag, dest=o.flat, type=conv, default=argparse.SUPPRESS, metavar=o.flat.upper(),
                           help=help_text)
    p.set_defaults(func=run)


def build_config(args: argparse.Namespace) -> TrainConfig:
    """The run's settings: with ``--resume RUN``, the settings RUN was trained with first; then the preset of
    ``--config``; then the options on the command line."""
    values: dict[str, Any] = {}
    if getattr(args, "resume", None):
        from aqsgd.train.resume import resume_settings

        values.update(resume_settings(args.resume))
    given = load_toml(args.config) if args.config else {}
    for o in options():
        if hasattr(args, o.flat):
            given[o.flat] = getattr(args, o.flat)
    values.update(given)
    if values.get("balance") == "measured" and given.get("layers") is not None:
        # (a measured run's saved settings hold the split it chose as --layers: --resume reuses it)
        raise SpecError("--balance measured chooses the blocks per stage itself: give it or --layers, not "
                        "both")
    return TrainConfig.from_flat(values).validate()


def run(args: argparse.Namespace) -> int:
    from aqsgd.train.driver import run_training

    summary = run_training(build_config(args))
    if summary:
        print_summary(summary)
    return 0


def print_summary(s: dict[str, Any]) -> None:
    """The end-of-run table. The uncompressed evaluation comes first: it is the model's quality. The one
    through the compressed boundaries follows, labelled as such, only where the run has one (not for one
    stage, nor an uncompressed forward); an AQ-SGD run's has no cache, which a note under the table says."""
    from rich.console import Console
    from rich.table import Table

    from aqsgd.train.report.reader import (
        NO_CACHE_NOTE,
        compressed_eval_label,
        evaluates_compressed,
        evaluates_without_cache,
        format_rate,
        is_uncompressed,
    )

    stages, replicas = s["stages"], s.get("data_parallel", 1)
    forward, _, backward = str(s.get("setting") or "").partition("/")
    layout = f"{stages} stage{'' if stages == 1 else 's'}"
    if replicas > 1:
        layout += f" x {replicas} replicas"
    if stages > 1 or replicas > 1:
        layout += f" ({s['runtime']})"
    # one stage has no boundary: its codecs were never used, and are not named
    setting = [] if stages == 1 else ["uncompressed" if is_uncompressed(forward) and is_uncompressed(backward)
                                      else s["setting"]]
    table = Table(title=" · ".join([s["task"], *setting, layout]))
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("steps", str(s["steps"]))
    if s.get("final_train_loss") is not None:
        table.add_row("final training loss", f"{s['final_train_loss']:.4f}")
    evals, notes = s.get("eval") or {}, []
    for k, v in (evals.get("uncompressed") or {}).items():
        table.add_row(f"eval {k}", f"{v:.4f}")
    if evaluates_compressed(forward, stages):
        for k, v in (evals.get("compressed") or {}).items():
            table.add_row(f"eval {k}, {compressed_eval_label(forward, stages)}", f"{v:.4f}")
        if evals.get("compressed") and evaluates_without_cache(forward, stages):
            notes.append(NO_CACHE_NOTE)
    if stages > 1:
        if s.get("warmup_codec", "none") != "none":
            table.add_row("warm-up sent as", s["warmup_codec"])
        table.add_row("bytes sent between stages", f"{s['bytes_sent']:,}")
        table.add_row("bytes at fp32", f"{s['raw_bytes']:,}")
        if s.get("traffic_saved") is not None:
            table.add_row("traffic saved vs fp32", _traffic_saved(s["traffic_saved"], s["compression_ratio"]))
    if replicas > 1:
        table.add_row(f"bytes sent between replicas ({s['grad_sync']})", f"{s['grad_sync_bytes']:,}")
    if s.get("samples_per_s"):
        table.add_row("samples/s", format_rate(s["samples_per_s"]))
    if s.get("tokens_per_s"):  # text: real tokens, and how the examples were batched
        table.add_row(f"real tokens/s ({s['batching']})", format_rate(s["tokens_per_s"]))
        if stages > 1:
            table.add_row("pad tokens sent between stages", f"{s['pad_tokens_sent']:,}")
    table.add_row("run directory", s["run_dir"])
    console = Console()
    console.print(table)
    for note in notes:
        console.print(note, soft_wrap=True, markup=False)


def _traffic_saved(saved: float, ratio: float | None) -> str:
    """``44.3% (1.79x less)``; ``none`` where nothing was saved (not ``-0.0% (1.00x less)``), with how much
    more was sent where the packets' own bytes outweigh it (``none (0.5% more)``); no ratio where it reads
    1.00."""
    pct = f"{100 * abs(saved):.1f}"
    if pct == "0.0":
        return "none"
    if saved < 0:
        return f"none ({pct}% more)"
    if ratio is None or f"{ratio:.2f}" == "1.00":
        return f"{pct}%"
    return f"{pct}% ({ratio:.2f}x less)"
