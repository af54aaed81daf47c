"""``aqsgd bench convergence``: the papers' convergence claims, measured on this machine.

Same seed, data order, model initialization and number of steps for every setting; a local pipeline (the
numerics of the distributed one). Settings: fp32; direct quantization fw2/bw4, fw3/bw6, fw4/bw8; AQ-SGD at the
same bits; TopK 10 % and 30 % on activations and gradients, without and with error feedback (EF, EF21); AQ-SGD
with TopK 30 %. Every compressed run starts with the same uncompressed warm-up epoch (AQ-SGD fills its cache
there; for the others it keeps the comparison fair). Each run's curves and final metrics with compression on
and off at evaluation go to ``<out>/<task>/<setting>/`` (a normal run directory), and one JSON per task
collects them all.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable

from aqsgd.train.config import TrainConfig

__all__ = ["SETTINGS", "TASKS", "run_study"]

log = logging.getLogger(__name__)

# name -> (forward, backward); ordered so that an interrupted study has the most telling runs first
SETTINGS: dict[str, tuple[str, str]] = {
    "fp32": ("none", "none"),
    "aqsgd fw2/bw4": ("delta:q2", "direct:q4"),
    "direct fw2/bw4": ("direct:q2", "direct:q4"),
    "aqsgd fw3/bw6": ("delta:q3", "direct:q6"),
    "direct fw3/bw6": ("direct:q3", "direct:q6"),
    "aqsgd fw4/bw8": ("delta:q4", "direct:q8"),
    "direct fw4/bw8": ("direct:q4", "direct:q8"),
    "topk10%": ("direct:topk0.1", "direct:topk0.1"),
    "topk10% + ef": ("ef:topk0.1", "ef:topk0.1"),
    "topk10% + ef21": ("ef21:topk0.1", "ef21:topk0.1"),
    "topk30%": ("direct:topk0.3", "direct:topk0.3"),
    "topk30% + ef": ("ef:topk0.3", "ef:topk0.3"),
    "aqsgd + topk30%": ("delta:topk0.3", "direct:topk0.3"),
}

# reduced tasks that fit the CPU budget (well under an hour each on 2 idle cores)
TASKS: dict[str, dict[str, Any]] = {
    "minilm-bbc": dict(task="bbc", model="minilm", max_length=64, max_train_samples=400, max_eval_samples=200,
                       stages=4, micro_batches=4, micro_batch_size=8, epochs=3, warmup_epochs=1, lr=2e-4),
    # the full 30-block SmolLM2-135M (truncating blocks breaks the pretrained model: eval loss 18 instead of 3),
    # so the reduction is in tokens and samples
    "smollm2-wiki": dict(task="wiki", model="smollm2", max_length=32, max_train_samples=256, max_eval_samples=64,
                         stages=4, micro_batches=2, micro_batch_size=4, epochs=4, warmup_epochs=1, lr=5e-5),
}

# the settings each task runs by default (the LM task is ~50x more expensive per sample on CPU)
DEFAULT_SETTINGS: dict[str, list[str]] = {
    "minilm-bbc": [name for name in SETTINGS if name != "topk10% + ef21"],
    "smollm2-wiki": ["fp32", "aqsgd fw2/bw4", "direct fw2/bw4", "aqsgd fw4/bw8", "direct fw4/bw8", "topk30%",
                     "topk30% + ef", "aqsgd + topk30%"],
}


def _slug(name: str) -> str:
    return name.replace(" ", "").replace("/", "-").replace("%", "").replace("+", "-")


def run_study(task: str, out_dir: str | Path, *, settings: list[str] | None = None, overrides: dict[str, Any] | None = None,
              progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run every setting on one task; returns (and writes) the collected results."""
    from aqsgd.train.report import load_run
    from aqsgd.train.trainer import Trainer

    out = Path(out_dir) / task
    base = {**TASKS[task], **(overrides or {})}
    results: dict[str, Any] = {"task": task, "base_config": base, "runs": {}}
    result_path = out / "study.json"
    if result_path.exists():  # continue an interrupted study
        results["runs"] = json.loads(result_path.read_text()).get("runs", {})
    for name in settings or DEFAULT_SETTINGS[task]:
        if name in results["runs"]:
            continue
        fw, bw = SETTINGS[name]
        cfg = TrainConfig(**base, forward=fw, backward=bw, output_dir=str(out), run_name=_slug(name),
                          progress=False, tensorboard=False, seed=0)
        if progress:
            progress(f"{task}: {name} ({fw} / {bw})")
        t0 = time.perf_counter()
        summary = Trainer(cfg).run()
        run = load_run(out / _slug(name))
        results["runs"][name] = {
            "forward": fw, "backward": bw, "summary": summary, "wall_s": time.perf_counter() - t0,
            "train_loss": [(r["step"], r["loss"]) for r in run.train_rows],
            "eval": [{"step": r["step"], "compressed": r["compressed"], "uncompressed": r["uncompressed"]}
                     for r in run.eval_rows],
        }
        out.mkdir(parents=True, exist_ok=True)
        result_path.write_text(json.dumps(results, indent=1))
    return results


def study_table(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Final metrics per setting, with the relative difference of the main metric to fp32."""
    rows = []
    base = results["runs"].get("fp32")
    for name, r in results["runs"].items():
        s = r["summary"]
        metric = s["main_metric"]
        on = (s.get("eval") or {}).get("compressed", {}).get(metric)
        off = (s.get("eval") or {}).get("uncompressed", {}).get(metric)
        ref = (base["summary"].get("eval") or {}).get("uncompressed", {}).get(metric) if base else None
        rows.append({"setting": name, "forward": r["forward"], "backward": r["backward"], "metric": metric,
                     "final_train_loss": s["final_train_loss"], "eval_on": on, "eval_off": off,
                     "rel_vs_fp32": (on - ref) / abs(ref) if (on is not None and ref) else None,
                     "rel_off_vs_fp32": (off - ref) / abs(ref) if (off is not None and ref) else None,
                     "compression_ratio": s["compression_ratio"], "steps": s["steps"], "wall_s": r["wall_s"]})
    return rows


def write_results(task: str, results: dict[str, Any], runs_dir: str | Path, out_dir: str | Path, *, command: str,
                  machine: str) -> tuple[Path, Path]:
    """The study's JSON (table, curves, final metrics) and a PNG of its runs under ``out_dir``."""
    from aqsgd.train.report import load_run, plot_runs

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = {**results, "table": study_table(results), "machine": machine, "command": command,
               "complete": set(results["runs"]) >= set(DEFAULT_SETTINGS[task])}
    path = out / f"convergence-{task}.json"
    path.write_text(json.dumps(results, indent=1))
    runs = [load_run(Path(runs_dir) / task / _slug(name), label=name) for name in results["runs"]]
    png = out / f"convergence-{task}.png"
    plot_runs(runs, png, baseline="fp32" if "fp32" in results["runs"] else None)
    return path, png
