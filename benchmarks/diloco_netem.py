"""``python -m benchmarks.diloco_netem``: the diloco study's sync settings over a real shaped link, beside the model.

The diloco study (``aqsgd bench convergence minilm-bbc-dp2 --study diloco``) computes each run's time over a
slow data-parallel link from its loopback steps and its sync bytes (:mod:`aqsgd.bench.dpsync`). This runs a
window of the same training (MiniLM on BBC, 2 stages x 2 replicas, boundaries uncompressed) in network
namespaces (:class:`aqsgd.bench.netem.cluster.NetemCluster`), twice per setting, one run after the other:

- ``fast``: every link at ``--fast`` Mbit/s (default 1000);
- ``slow``: the same, but the link between the two replicas' sites (the chain's middle link, which every
  sync crosses: replica 0's stages are nodes 0-1, replica 1's nodes 3-2) shaped to ``--mbit`` (default 30)
  Mbit/s in each direction with ``tc tbf``. Both stages' syncs share it, as two sites joined by one line
  would; the pipeline boundaries stay on their own fast links.

Per setting it prints the mean step over the window (the slowest stage's step seconds; the window spans
whole outer rounds for DiLoCo), the sync bytes a step over the shared link (both stages, one direction), the
slow run's step as the model predicts it from the fast run (fast step + bytes x 8 / the link's measured TCP
goodput) and the measured slow step. Writes the rows as JSON with ``--json``. Needs root and iproute2.
"""  # noqa: E501, RUF100 (line 1 is the --help description: __doc__.splitlines()[0])

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from aqsgd.bench.convergence import TASKS
from aqsgd.bench.netem.cluster import NetemCluster
from aqsgd.bench.netem.runs import train_rows
from aqsgd.bench.netem.shape import LinkShape
from aqsgd.bench.settings import SETTINGS

TASK = "minilm-bbc-dp2"
#: setting -> (steps run, first step of the timed window[, its last step, default the run's last]): the
#: window is whole outer rounds for DiLoCo (steps 11-40: three rounds of 10; 11-60: one of 50, whose outer
#: step, at the run's last step, 60, is the run's final sync) and steps 3-N for per-step sync. ``... rounds``
#: and the streamed settings run past their window and leave the rest out (a run's final sync is never
#: delayed): the window holds one outer step of every parameter, for the streamed ones both fragments' syncs
#: (launched at 25 and 50) and the steps they overlap, up to the step that applies each.
DEFAULT_WINDOWS: dict[str, tuple[int, ...]] = {
    "fp32": (6, 3), "sync q8": (12, 3), "diloco10 avg q8": (40, 11), "diloco50 avg q8": (60, 11),
    "diloco50 avg topk3% q2": (60, 11), "diloco50 avg q8 rounds": (61, 11, 60),
    "diloco50 avg topk3% q2 rounds": (61, 11, 60), "diloco50 avg q8 stream": (63, 13, 62),
    "diloco50 avg topk3% q2 stream": (61, 11, 60)}


def _setting(name: str) -> str:
    """The study setting a row runs (``... rounds``: the setting, timed over whole rounds)."""
    return name.removesuffix(" rounds")


def _options(setting: str, steps: int, out: Path, run_name: str) -> dict[str, Any]:
    s = SETTINGS[_setting(setting)]
    return {**TASKS[TASK], **s.overrides, "forward": s.forward, "backward": s.backward, "max_steps": steps,
            "eval_every": 0, "checkpoint_every": 0, "progress": False, "tensorboard": False,
            "device": "cpu", "seed": 0, "output_dir": str(out), "run_name": run_name, "overwrite": True}


def _window(rows: list[dict[str, Any]], first: int, last: int | None = None) -> dict[str, float]:
    """Mean over the steps from ``first`` to ``last`` (None: the end): the slowest stage's step seconds and
    the sync bytes that cross the shared link in one direction (each stage's per-rank bytes, summed over the
    stages)."""
    rows = [r for r in rows if first <= r["step"] <= (last or r["step"]) and r.get("stages")]
    if not rows:
        raise RuntimeError(f"no training rows from step {first} on")
    return {"steps": len(rows),
            "step_s": statistics.fmean(max(st["step_s"] for st in r["stages"]) for r in rows),
            "link_bytes": statistics.fmean(sum(st.get("sync_bytes", 0.0) for st in r["stages"])
                                           for r in rows)}


def table(report: dict[str, Any]) -> list[str]:
    """The report's rows as a markdown table (also ``python -m benchmarks.render``'s)."""
    mbit = f"{report['mbit']:g} Mbit/s"
    out = [f"| setting | MB a step over the slow link | step, {report['fast_mbit']:g} Mbit/s | "
           f"model at {mbit} | measured at {mbit} | measured / model |", "|---|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        out.append(f"| {r['setting']} | {r['slow']['link_bytes'] / 1e6:.3f} | {r['fast']['step_s']:.3f} s | "
                   f"{r['model_s']:.3f} s | {r['slow']['step_s']:.3f} s | {r['measured_vs_model']:.2f} |")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.diloco_netem", description=__doc__.splitlines()[0])
    p.add_argument("--settings", nargs="+", default=list(DEFAULT_WINDOWS), choices=list(DEFAULT_WINDOWS))
    p.add_argument("--mbit", type=float, default=30.0, help="the replicas' link, Mbit/s (default: 30)")
    p.add_argument("--fast", type=float, default=1000.0, help="every other link, Mbit/s (default: 1000)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default: 1)")
    p.add_argument("--workdir", default=None, help="run directories and logs (default: a temporary folder)")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="diloco-netem-"))
    base = TASKS[TASK]
    rows: list[dict[str, Any]] = []
    with NetemCluster(base["stages"] * base["data_parallel"]) as cluster:
        # the link between node 1 (replica 0's last stage) and node 2 (replica 1's)
        middle = base["stages"] - 1

        def shape(slow: bool) -> dict[str, float]:
            cluster.shape_all(LinkShape(rate_mbit=args.fast))
            if slow:
                cluster.shape_link(middle, middle + 1, LinkShape(rate_mbit=args.mbit))
            return {"forward_mbps": cluster.measure_goodput(middle, middle + 1),
                    "backward_mbps": cluster.measure_goodput(middle + 1, middle)}

        for name in args.settings:
            steps, first, *rest = DEFAULT_WINDOWS[name]
            last = rest[0] if rest else None
            row: dict[str, Any] = {"setting": name,
                                   "grad_sync": SETTINGS[_setting(name)].overrides.get("grad_sync"),
                                   "steps": steps, "window_from": first, "window_to": last or steps}
            for kind in ("fast", "slow"):
                goodput = shape(kind == "slow")
                run_name = f"{name.replace(' ', '_').replace('%', 'pc')}-{kind}"
                t0 = time.monotonic()
                outcomes = cluster.run_train(_options(name, steps, work / "runs", run_name),
                                             work / "logs" / run_name, deadline_s=1800, threads=args.threads)
                bad = [o for o in outcomes if not o.ok]
                if bad:
                    print(f"{name} ({kind}): rank {bad[0].stage} failed: {bad[0].error}\n{bad[0].log_tail}",
                          file=sys.stderr)
                    return 1
                row[kind] = {**_window(train_rows(work / "runs" / run_name), first, last), "link": goodput,
                             "run_s": time.monotonic() - t0}
                print(f"{name:<24} {kind}: {row[kind]['steps']} steps, {row[kind]['step_s']:.3f} s a step, "
                      f"{row[kind]['link_bytes'] / 1e6:.3f} MB a step over the replicas' link "
                      f"(goodput {min(goodput.values()):.1f} Mbit/s), run {row[kind]['run_s']:.0f} s",
                      flush=True)
            rate = min(row["slow"]["link"].values()) * 1e6
            row["model_s"] = row["fast"]["step_s"] + 8.0 * row["slow"]["link_bytes"] / rate
            row["measured_vs_model"] = row["slow"]["step_s"] / row["model_s"]
            print(f"{name:<24} model {row['model_s']:.3f} s a step, measured {row['slow']['step_s']:.3f} s "
                  f"({row['measured_vs_model']:.2f}x the model)", flush=True)
            rows.append(row)
    command = "python -m benchmarks.diloco_netem " + " ".join(sys.argv[1:] if argv is None else argv)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.machine())
    machine = f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}"
    report = {"benchmark": "diloco-netem", "task": TASK, "mbit": args.mbit, "fast_mbit": args.fast,
              "threads": args.threads, "command": command, "machine": machine, "rows": rows}
    print("\n" + "\n".join(table(report)))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
