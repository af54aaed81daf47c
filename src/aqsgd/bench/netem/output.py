"""What the netem benchmark writes: a markdown table, the JSON report and a plot of speed-up against
bandwidth."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from aqsgd.bench.netem.sweep import NetemBenchConfig, variant_label

__all__ = ["markdown_table", "plot_speedups", "write_json"]


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The sweep's rows as a markdown table (one line per bandwidth and setting)."""
    head = ("| Mbit/s | link goodput | setting | samples/s | speed-up vs fp32 | ideal | efficiency | "
            "fp32 comm:compute |")
    lines = [head, "|" + "---:|" * 2 + ":---|" + "---:|" * 5]
    for r in rows:
        lines.append(f"| {r['bandwidth_mbps']:g} | {r['link_mbps']:.1f} | {variant_label(r)} | "
                     f"{r['samples_per_s']:.1f} | {r['speedup_vs_fp32']:.2f} | {r['ideal_speedup']:.2f} | "
                     f"{r['efficiency']:.2f} | {r['comm_compute_ratio']:.2f} |")
    return "\n".join(lines)


def write_json(report: Mapping[str, Any], path: str | Path, *, cfg: NetemBenchConfig, command: str,
               machine: str) -> None:
    """The report, the configuration, the command and the machine as JSON."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"benchmark": "netem", "command": command, "machine": machine,
                                      "config": dataclasses.asdict(cfg), **report}, indent=1, default=list))


def plot_speedups(rows: Sequence[Mapping[str, Any]], path: str | Path, *, title: str = "") -> None:
    """PNG of measured (solid) and ideal (dotted) speed-up vs fp32 against bandwidth, one colour per
    setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    names = list(dict.fromkeys(variant_label(r) for r in rows))
    for k, name in enumerate(names):
        pts = sorted((r["bandwidth_mbps"], r["speedup_vs_fp32"], r["ideal_speedup"]) for r in rows
                     if variant_label(r) == name)
        colour = f"C{k}"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=colour, label=name)
        ax.plot([p[0] for p in pts], [p[2] for p in pts], ":", color=colour, alpha=0.7)
    ax.set_xscale("log")
    ax.set_xlabel("link bandwidth per direction (Mbit/s, tc tbf)")
    ax.set_ylabel("speed-up vs fp32 (samples/s)")
    ax.set_title(title or "pipeline over shaped veth links (dotted: ideal)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
