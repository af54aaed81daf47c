"""``aqsgd bench convergence``: the papers' convergence claims, measured on this machine.

Same seed, data order, model initialization and number of steps for every setting; a local pipeline (the
numerics of the distributed one). Settings: fp32; direct quantization fw2/bw4, fw3/bw6, fw4/bw8; AQ-SGD at the
same bits; TopK 10 % and 30 % on activations and gradients, without and with error feedback (EF, EF21); AQ-SGD
with TopK 30 %. Every compressed run starts with the same uncompressed warm-up epoch (AQ-SGD fills its cache
there; for the others it keeps the comparison fair). Each run's curves and final metrics with compression on
and off at evaluation go to ``<out>/<task>/<setting>/`` (a normal run directory), and one JSON per task
collects them all.

The data-parallel tasks (``*-dp2``, ``*-dp4``: the ``diloco`` study) run on the distributed runtime, a process
per stage and replica; their records add each step's seconds and sync bytes, from which the study gives the
run's length over a slow data-parallel link and its time to fp32's loss (:mod:`aqsgd.bench.dpsync`).
"""

from __future__ import annotations

import json
import logging
import shutil
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from aqsgd.bench.dpsync import (LINK_MBIT, bytes_per_step, elapsed, eval_losses, plot_sync, sync_curve,
                                sync_delay, time_to_target)
from aqsgd.bench.settings import SETTINGS
from aqsgd.bench.subspace import boundary_energy, plot_energy
from aqsgd.train.config import TrainConfig
from aqsgd.train.report import HIGHER_IS_BETTER, load_run
from aqsgd.train.driver import run_training

__all__ = ["SETTINGS", "TASKS", "DEFAULT_TASKS", "STUDIES", "default_tasks", "run_study", "study_table",
           "write_results", "format_relative"]

log = logging.getLogger(__name__)

# reduced tasks that fit the CPU budget (well under an hour each on 2 idle cores)
TASKS: dict[str, dict[str, Any]] = {
    "minilm-bbc": dict(task="bbc", model="minilm", max_length=64, max_train_samples=400, max_eval_samples=200,
                       stages=4, micro_batches=4, micro_batch_size=8, epochs=3, warmup_epochs=1, lr=2e-4),
    # the full 30-block SmolLM2-135M (truncating blocks breaks the pretrained model: eval loss 18 instead of
    # 3), so the reduction is in tokens and samples
    "smollm2-wiki": dict(task="wiki", model="smollm2", max_length=32, max_train_samples=256,
                         max_eval_samples=64, stages=4, micro_batches=2, micro_batch_size=4, epochs=4,
                         warmup_epochs=1, lr=5e-5),
    # instruction tuning (the `instruct` study): SmolLM2 whole, examples of their own lengths cut to 128
    # tokens (bucketed: only real tokens cross), the loss and perplexity on the responses only
    "smollm2-instruct": dict(task="instruct", model="smollm2", max_length=128, max_train_samples=96,
                             max_eval_samples=32, stages=4, micro_batches=2, micro_batch_size=4, epochs=3,
                             warmup_epochs=1, lr=5e-5),
    # data parallelism over a slow link (the `diloco` study): 2 stages x 2 (4) replicas on the distributed
    # runtime, boundaries in fp32, no warm-up; long enough for rounds of 50 steps (global batch 16 (32))
    "minilm-bbc-dp2": dict(task="bbc", model="minilm", max_length=64, max_train_samples=800,
                           max_eval_samples=200, stages=2, micro_batches=2, micro_batch_size=4,
                           data_parallel=2, runtime="distributed", epochs=4, warmup_epochs=0, lr=2e-4),
    "minilm-bbc-dp4": dict(task="bbc", model="minilm", max_length=64, max_train_samples=1600,
                           max_eval_samples=200, stages=2, micro_batches=2, micro_batch_size=4,
                           data_parallel=4, runtime="distributed", epochs=4, warmup_epochs=0, lr=2e-4),
    # a smoke test of the study itself (seconds; a random-token LM, no data source needed)
    "synthetic-lm": dict(task="synthetic-lm", max_length=12, max_train_samples=48, max_eval_samples=16,
                         stages=3, micro_batches=2, micro_batch_size=4, epochs=3, warmup_epochs=1, lr=3e-3),
    # ... and of the diloco study (2 stages x 2 replicas: process start-up is most of it)
    "synthetic-lm-dp2": dict(task="synthetic-lm", max_length=12, max_train_samples=64, max_eval_samples=16,
                             stages=2, micro_batches=2, micro_batch_size=2, data_parallel=2,
                             runtime="distributed", epochs=2, warmup_epochs=0, lr=3e-3),
}
DEFAULT_TASKS = ["minilm-bbc", "smollm2-wiki"]

# the settings each task runs by default (the LM task is ~50x more expensive per sample on CPU)
DEFAULT_SETTINGS: dict[str, list[str]] = {
    # ordered so that an interrupted study has the most telling runs first
    "minilm-bbc": ["fp32", "aqsgd fw2/bw4", "direct fw2/bw4", "aqsgd fw3/bw6", "direct fw3/bw6",
                   "aqsgd fw4/bw8", "direct fw4/bw8", "topk10%", "topk10% + ef", "topk30%", "topk30% + ef",
                   "aqsgd + topk30%", "aqsgd fw2 only", "direct fw2 only", "bw4 only", "aqsgd fw2/bw4 token",
                   "direct fw2/bw4 token", "aqsgd fw2/bw4 stochastic", "aqsgd fw2/bw4 l2",
                   "direct fw2/bw4 l2", "aqsgd fw2/bw4 token l2 midrise"],
    "smollm2-wiki": ["fp32", "aqsgd fw2/bw4", "direct fw2/bw4", "aqsgd fw4/bw8", "direct fw4/bw8", "topk30%",
                     "topk30% + ef", "aqsgd + topk30%"],
    "synthetic-lm": ["fp32", "aqsgd fw2/bw4", "direct fw2/bw4"],
}

# the `fewer-bits` study: rotated tiles, outlier rows, the zstd stage, AQ-SGD at 1 bit and the 2025 peer
# (TAH-Quant), entropy-coded AQ-SGD deltas (`ec`: a uniform step and the range coder). The zstd stage is
# lossless, so a `zstd` run trains exactly as the same setting without it.
_FEWER_BITS = ["fp32", "aqsgd fw2/bw4 l2 zstd", "aqsgd fw2/bw4 rot zstd", "direct fw3/bw6 rot zstd",
               "tah-quant zstd", "direct fw4/bw6 rot zstd", "aqsgd fw2/bw4 rot outlier",
               "aqsgd fw2/bw4 l2 outlier", "aqsgd fw1/bw4 rot zstd", "aqsgd fw1/bw4", "aqsgd fw2 rot only",
               "bw4 rot only", "aqsgd fw3/bw4 rot zstd", "aqsgd fw2 ec/bw4 rot", "aqsgd fw1.5 ec/bw4 rot",
               "direct fw4 ec/bw6 rot", "direct fw3.5 ec/bw6 rot", "direct fw4/bw6 rot outlier zstd"]
FEWER_BITS_SETTINGS: dict[str, list[str]] = {
    "minilm-bbc": _FEWER_BITS, "smollm2-wiki": _FEWER_BITS,
    "synthetic-lm": ["fp32", "aqsgd fw2/bw4 rot zstd", "tah-quant"],
}
# the `lora` study: LoRA in fp32 and with AQ-SGD (max-abs l2 scales; rotated tiles with zstd) against full
# fine-tuning in fp32
_LORA = ["fp32", "lora fp32", "lora aqsgd fw2/bw4 l2", "lora aqsgd fw2/bw4 rot zstd"]
LORA_SETTINGS: dict[str, list[str]] = {"minilm-bbc": _LORA, "smollm2-wiki": _LORA,
                                       "synthetic-lm": ["fp32", "lora fp32", "lora aqsgd fw2/bw4 l2"]}
# the `instruct` study: fp32, aqsgd train's default setting and the entropy-coded deltas, full fine-tuning and
# LoRA, on instruction data
INSTRUCT_SETTINGS: dict[str, list[str]] = {
    "smollm2-instruct": ["fp32", "aqsgd fw2/bw4 l2", "aqsgd fw2 ec/bw4 rot", "lora fp32",
                         "lora aqsgd fw2/bw4 l2", "lora aqsgd fw2 ec/bw4 rot"],
}
# the `subspace` study: AQ-SGD's deltas and the gradients in bases the boundaries learn (pca/4: a quarter of
# a row's dimensions; 0.61 / 0.63 bits per value on MiniLM, bases included), full fine-tuning and LoRA,
# against fp32
_SUBSPACE = ["fp32", "aqsgd pca/4 ec/ef pca/4 ec", "lora fp32", "lora aqsgd pca/4 ec/ef pca/4 ec"]
SUBSPACE_SETTINGS: dict[str, list[str]] = {"minilm-bbc": _SUBSPACE, "smollm2-wiki": _SUBSPACE,
                                           "synthetic-lm": ["fp32", "aqsgd pca/4 ec/ef pca/4 ec"]}
# the `diloco` study: the replicas' sync per step in fp32 (the `fp32` row: all-reduce) and q8, against
# DiLoCo's outer steps every 10 and 50 steps with fp32, q8 and top-k 3 % + 2-bit pseudo-gradients, and with
# the outer step as plain averaging (lr 1, no momentum); the boundaries in fp32
_DILOCO = ["fp32", "sync q8", "diloco10", "diloco10 q8", "diloco10 topk3% q2", "diloco50", "diloco50 q8",
           "diloco50 topk3% q2", "diloco50 avg q8", "diloco50 avg topk3% q2", "diloco10 avg q8"]
DILOCO_SETTINGS: dict[str, list[str]] = {"minilm-bbc-dp2": _DILOCO, "minilm-bbc-dp4": _DILOCO,
                                         "synthetic-lm-dp2": ["fp32", "sync q8", "diloco10 q8"]}
#: the studies there are: their default settings per task (their result files are named ``<study>-<task>``)
STUDIES: dict[str, dict[str, list[str]]] = {"convergence": DEFAULT_SETTINGS,
                                            "fewer-bits": FEWER_BITS_SETTINGS, "lora": LORA_SETTINGS,
                                            "instruct": INSTRUCT_SETTINGS, "subspace": SUBSPACE_SETTINGS,
                                            "diloco": DILOCO_SETTINGS}


def default_tasks(study: str) -> list[str]:
    """The tasks a study runs when none is named: the default tasks it has settings for, else all of its own
    but the smoke tests (``instruct``: smollm2-instruct; ``diloco``: the data-parallel tasks)."""
    return ([t for t in DEFAULT_TASKS if t in STUDIES[study]]
            or [t for t in STUDIES[study] if not t.startswith("synthetic")])


def _slug(name: str) -> str:
    return name.replace(" ", "").replace("/", "-").replace("%", "").replace("+", "-")


def run_key(name: str, seed: int) -> str:
    """A run's key in the study: the setting's name, with ``@seed<N>`` for seeds other than 0."""
    return name if seed == 0 else f"{name} @seed{seed}"


def run_study(task: str, out_dir: str | Path, *, settings: list[str] | None = None,
              overrides: dict[str, Any] | None = None, seeds: list[int] | None = None,
              progress: Callable[[str], None] | None = None, command: str | None = None,
              keep_checkpoints: bool = False, study: str = "convergence",
              machine: str | None = None) -> dict[str, Any]:
    """Run every setting on one task, once per seed (default: seed 0; the seed sets the data order, the
    initialization of new heads and stochastic rounding); returns (and writes) the collected results. A
    study is continued from ``<out_dir>/<task>/study.json``; one with other task settings is refused.
    ``command`` is recorded with every run it adds (a study grown by several commands names them all), and
    so is ``machine`` (the runs of a continued study that name none take the machine its file names, if
    any). A finished run's checkpoints are deleted unless ``keep_checkpoints``: the study needs its curves,
    not its resume points, and those of an LLM run take gigabytes each (a 13-run SmolLM2 study kept ~45
    GB)."""
    out = Path(out_dir) / task
    base = {**TASKS[task], **(overrides or {})}
    results: dict[str, Any] = {"task": task, "base_config": base, "runs": {}}
    result_path = out / "study.json"
    if result_path.exists():  # continue an interrupted study
        previous = json.loads(result_path.read_text())
        if previous.get("base_config", base) != base:
            raise ValueError(f"{result_path} holds a study of {task} with other settings "
                             f"({previous['base_config']}, now {base}); use another --runs-dir")
        results["runs"] = previous.get("runs", {})
        if previous.get("machine"):  # a study file written by write_results: its runs ran there
            for r in results["runs"].values():
                r.setdefault("machine", previous["machine"])
    for seed in seeds or [0]:
        for name in settings or STUDIES[study][task]:
            key = run_key(name, seed)
            if key in results["runs"]:
                continue
            setting = SETTINGS[name]
            fw, bw = setting.forward, setting.backward
            run_name = _slug(name) + (f"-seed{seed}" if seed else "")
            # a run directory of a setting the study has not recorded is what an interrupted study left
            # behind: that run starts afresh
            lr = {"lr": base["lr"] * setting.lr_factor} if setting.lr_factor != 1.0 else {}
            cfg = TrainConfig.of(**{**base, **setting.overrides, **lr}, forward=fw, backward=bw,
                                 output_dir=str(out), run_name=run_name, progress=False, tensorboard=False,
                                 seed=seed, overwrite=True)
            if progress:
                progress(f"{task}: {key} ({fw} / {bw})")
            t0 = time.perf_counter()
            summary = run_training(cfg)
            run = load_run(out / run_name)
            results["runs"][key] = _run_record(name, seed, run_name, fw, bw, summary, run,
                                               time.perf_counter() - t0)
            if command:
                results["runs"][key]["command"] = command
            if machine:
                results["runs"][key]["machine"] = machine
            energy = boundary_energy(out / run_name)  # read before the checkpoints go
            if energy:
                results["runs"][key]["subspace"] = energy
            out.mkdir(parents=True, exist_ok=True)
            result_path.write_text(json.dumps(results, indent=1))
            if not keep_checkpoints:
                shutil.rmtree(out / run_name / "checkpoints", ignore_errors=True)
    return results


def _traffic(run: Any) -> dict[str, Any]:
    """Over the compressed training steps: bits on the wire per fp32 value in each direction (packet bytes,
    headers and scales included, divided by the fp32 bytes they stand for), the median step time, and the
    mean training loss of every epoch."""
    rows = [r for r in run.train_rows if r.get("phase") == "train" and r.get("stages")]

    def bits(kind: str) -> float | None:
        sent = sum(st[f"{kind}_bytes"] for r in rows for st in r["stages"])
        raw = sum(st[f"{kind}_raw"] for r in rows for st in r["stages"])
        return 32.0 * sent / raw if raw else None

    steps = [r["time"]["step"] for r in rows if r.get("time")]
    epochs: dict[int, list[float]] = {}
    for r in run.train_rows:
        if r.get("loss") is not None and r.get("epoch") is not None:
            epochs.setdefault(int(r["epoch"]), []).append(float(r["loss"]))
    return {"forward_bits_per_value": bits("fw"), "backward_bits_per_value": bits("bw"),
            "step_s": statistics.median(steps) if steps else None,
            "epoch_train_loss": {str(e): statistics.fmean(v) for e, v in sorted(epochs.items())}}


def _run_record(name: str, seed: int, run_name: str, fw: str, bw: str, summary: dict[str, Any], run: Any,
                wall_s: float) -> dict[str, Any]:
    record = {"setting": name, "seed": seed, "run_dir": run_name,
              "forward": fw, "backward": bw, "summary": summary, "wall_s": wall_s, "traffic": _traffic(run),
              "train_loss": [(r["step"], r["loss"]) for r in run.train_rows],
              "eval": [{"step": r["step"], "compressed": r["compressed"], "uncompressed": r["uncompressed"]}
                       for r in run.eval_rows],
              }
    if summary.get("data_parallel", 1) > 1:  # each step's seconds and sync bytes: its time over a slow link
        record["sync_curve"] = sync_curve(run.train_rows)
    return record


def study_table(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Final metrics per setting (means over its seeds), with the relative difference of the main metric to
    fp32's with compression off at evaluation; each seed is compared with fp32 of the same seed (paired) and
    with several seeds the spread of those differences is given too (``*_std``, sample standard deviation).

    ``best_off`` is the best evaluation without compression over the run's evaluations (highest accuracy,
    lowest perplexity), compared with fp32's best the same way (``rel_best_off_vs_fp32``): where fp32
    overfits, a run that learns more slowly can end *closer* to fp32's final value than it ever came to
    fp32's best, and the two comparisons together show it."""
    groups: dict[str, dict[int, dict[str, Any]]] = {}
    for key, r in results["runs"].items():
        groups.setdefault(r.get("setting", key), {})[r.get("seed", 0)] = r

    def final(r: dict[str, Any], which: str) -> float | None:
        s = r["summary"]
        return (s.get("eval") or {}).get(which, {}).get(s["main_metric"])

    def best(r: dict[str, Any]) -> float | None:
        metric = r["summary"]["main_metric"]
        vals = [e["uncompressed"][metric] for e in r.get("eval", [])
                if metric in (e.get("uncompressed") or {})]
        if not vals:
            return None
        return max(vals) if HIGHER_IS_BETTER.get(metric, False) else min(vals)

    def rel(value: float | None, ref: float | None) -> float | None:
        return (value - ref) / abs(ref) if (value is not None and ref) else None

    def mean(values: list[float | None]) -> float | None:
        vals = [v for v in values if v is not None]
        return statistics.fmean(vals) if vals else None

    def std(values: list[float | None]) -> float | None:
        vals = [v for v in values if v is not None]
        return statistics.stdev(vals) if len(vals) > 1 else None

    base = groups.get("fp32", {})
    rows = []
    for name, by_seed in groups.items():
        seeds = sorted(by_seed)
        runs = [by_seed[k] for k in seeds]
        fp32_runs = [base.get(k) for k in seeds]  # fp32 of the same seed, the pair of each run
        refs = [final(b, "uncompressed") if b else None for b in fp32_runs]
        on, off = [final(r, "compressed") for r in runs], [final(r, "uncompressed") for r in runs]
        rel_on, rel_off = ([rel(v, ref) for v, ref in zip(on, refs)],
                           [rel(v, ref) for v, ref in zip(off, refs)])
        best_refs = [best(b) if b else None for b in fp32_runs]
        best_off = [best(r) for r in runs]
        rel_best = [rel(v, ref) for v, ref in zip(best_off, best_refs)]
        gaps = [_gap(r, b) for r, b in zip(runs, fp32_runs)]
        traffic = [r.get("traffic") or {} for r in runs]
        first = runs[0]
        rows.append({"setting": name, "forward": first["forward"], "backward": first["backward"],
                     "metric": first["summary"]["main_metric"], "seeds": seeds,
                     "final_train_loss": mean([r["summary"]["final_train_loss"] for r in runs]),
                     "eval_on": mean(on), "eval_off": mean(off), "eval_on_runs": on, "eval_off_runs": off,
                     "rel_vs_fp32": mean(rel_on), "rel_off_vs_fp32": mean(rel_off),
                     "rel_vs_fp32_std": std(rel_on), "rel_off_vs_fp32_std": std(rel_off),
                     "best_off": mean(best_off), "best_off_runs": best_off,
                     "rel_best_off_vs_fp32": mean(rel_best), "rel_best_off_vs_fp32_std": std(rel_best),
                     "compression_ratio": mean([r["summary"]["compression_ratio"] for r in runs]),
                     "train_loss_gap": mean(gaps), "train_loss_gap_std": std(gaps),
                     "wire_bits_per_value": mean([t.get("forward_bits_per_value") for t in traffic]),
                     "wire_bits_per_value_backward": mean([t.get("backward_bits_per_value")
                                                           for t in traffic]),
                     "step_s": mean([t.get("step_s") for t in traffic]),
                     "steps": first["summary"]["steps"], "wall_s": sum(r["wall_s"] for r in runs),
                     **_sync_figures(runs, fp32_runs, mean, std)})
    return rows


def _sync_figures(runs: list[dict[str, Any]], fp32_runs: list[dict[str, Any] | None], mean: Callable,
                  std: Callable) -> dict[str, Any]:
    """With data parallelism (runs holding a ``sync_curve``): the sync's bytes per step (every rank's,
    summed), the run's length over a :data:`~aqsgd.bench.dpsync.LINK_MBIT` Mbit/s link, and the time to the
    paired fp32 run's final evaluation loss (compression off; :mod:`aqsgd.bench.dpsync`) with how many times
    sooner than fp32 it got there (None where a run never did)."""
    if not all(r.get("sync_curve") for r in runs):
        return {}

    reach, sooner = [], []
    for r, b in zip(runs, fp32_runs):
        ref_evals = eval_losses(b) if b and b.get("sync_curve") else []
        target = ref_evals[-1][1] if ref_evals else None
        got = (time_to_target(r["sync_curve"], eval_losses(r), target, delay=sync_delay(r))
               if target is not None else None)
        ref = time_to_target(b["sync_curve"], ref_evals, target) if target is not None else None
        reach.append(got[1] if got else None)
        sooner.append(ref[1] / got[1] if got and ref else None)
    return {"grad_sync": runs[0]["summary"].get("grad_sync"),
            "sync_bytes_per_step": mean([bytes_per_step(r) for r in runs]),
            "link_mbit": LINK_MBIT,
            "link_run_s": mean([elapsed(r["sync_curve"], delay=sync_delay(r))[-1] for r in runs]),
            "time_to_target_s": mean(reach), "time_to_target_runs": reach,
            "sooner_than_fp32": mean(sooner), "sooner_than_fp32_std": std(sooner)}


def _gap(run: dict[str, Any], fp32: dict[str, Any] | None) -> float | None:
    """Last epoch's mean training loss of ``run`` minus that of ``fp32`` (the same seed), in nats."""
    if not fp32:
        return None
    a, b = ((run.get("traffic") or {}).get("epoch_train_loss"),
            (fp32.get("traffic") or {}).get("epoch_train_loss"))
    if not a or not b:
        return None
    last = max(a, key=int)
    return a[last] - b[last] if last in b else None


def format_relative(value: float | None, spread: float | None = None) -> str:
    """A relative difference as a signed percentage, with its spread over seeds when there is one."""
    if value is None:
        return "-"
    return f"{100 * value:+.2f}%" + (f" ± {100 * spread:.2f}" if spread is not None else "")


def _recorded_settings(path: Path) -> set[str]:
    """The settings whose runs a study's result file already holds (none where there is no such file)."""
    try:
        runs = json.loads(path.read_text()).get("runs", {})
    except (OSError, ValueError):
        return set()
    return {r.get("setting", k) for k, r in runs.items()}


def write_results(task: str, results: dict[str, Any], runs_dir: str | Path, out_dir: str | Path, *,
                  command: str, machine: str, tag: str | None = None, study: str = "convergence",
                  settings: list[str] | None = None) -> tuple[Path, Path | None]:
    """The study's JSON (table, curves, final metrics) and a PNG of its runs under ``out_dir``, named
    ``<study>-<task>[-<tag>].json/.png``; a study's files hold its own settings only (several studies may
    share one runs directory, and so their fp32 runs), plus any other ``settings`` asked for by name, now or
    by an earlier command (those the file already holds are kept).
    ``command`` is this invocation; ``commands`` lists every command that added runs to the study, in order
    (runs recorded before commands were kept name none). The PNG is None (with a warning) when a seed-0 run
    directory is missing, e.g. for a study continued from its JSON on another machine: the JSON is still
    written."""
    from aqsgd.train.report import load_run, plot_runs

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{study}-{task}" + (f"-{tag}" if tag else "")
    path = out / f"{stem}.json"
    wanted = set(STUDIES[study][task])
    if study != "convergence":  # the convergence study keeps every run of its directory, as before
        keep = wanted | set(settings or []) | _recorded_settings(path)
        results = {**results, "runs": {k: r for k, r in results["runs"].items()
                                       if r.get("setting", k) in keep}}
    commands = list(dict.fromkeys(r["command"] for r in results["runs"].values() if r.get("command")))
    # the machines the runs ran on (run_study records each run's; a study grown on another machine has
    # runs of both), this invocation's where no run says
    machines = list(dict.fromkeys(r["machine"] for r in results["runs"].values() if r.get("machine")))
    results = {**results, "study": study, "table": study_table(results),
               "machine": "; ".join(machines or [machine]),
               "command": command, "commands": commands or [command],
               "complete": {r.get("setting", k) for k, r in results["runs"].items()} >= wanted}
    path.write_text(json.dumps(results, separators=(",", ":")))  # compact: result files stay under 1 MB
    # the curves of seed 0 (one per setting), drawn from the run directories (the records hold no byte curves)
    dirs = {r.get("setting", key): Path(runs_dir) / task / r.get("run_dir", _slug(key))
            for key, r in results["runs"].items() if r.get("seed", 0) == 0}
    missing = [str(d) for d in dirs.values() if not d.is_dir()]
    if missing:  # a study continued from its JSON elsewhere: the table is complete, the plot would not be
        log.warning("%s not redrawn: run directories not found: %s", f"{stem}.png", ", ".join(missing))
        return path, None
    png = out / f"{stem}.png"
    plot_runs([load_run(d, label=name) for name, d in dirs.items()], png,
              baseline="fp32" if "fp32" in results["runs"] else None)
    sync = {r.get("setting", key): r for key, r in results["runs"].items()
            if r.get("seed", 0) == 0 and r.get("sync_curve")}
    if sync:  # data parallel: evaluation against the time over the slow link, and the sync's bytes
        plot_sync(sync, out / f"{stem}-sync.png", title=f"{task}: the replicas' sync (seed 0)")
    for key, r in results["runs"].items():  # the first seed-0 run with a subspace stage: its bases' energy
        if r.get("subspace") and r.get("seed", 0) == 0:
            plot_energy(r["subspace"], out / f"{stem}-energy.png", title=f"{task}: {key}")
            break
    return path, png
