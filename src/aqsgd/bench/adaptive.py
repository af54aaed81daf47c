"""``aqsgd bench adaptive``: bits chosen per link (``--forward auto`` / ``--backward auto``) against every
fixed rung of the ladder, over uneven emulated links.

Every scenario is a pipeline of ``stages`` processes whose boundaries have links of their own (``--link``, one
setting per boundary, possibly changing during the run: ``drop`` is a middle link that falls from 200 to 20
Mbit/s halfway). In each scenario every setting trains the same random tiny Llama on the same synthetic data
(:class:`~aqsgd.data.synthetic.SyntheticLM`), same seed and steps:

* ``fp32``: nothing compressed;
* ``auto``: AQ-SGD with the bits of each link chosen while training (:mod:`aqsgd.train.adaptive`);
  ``auto:err=E`` the same with the error budget ``E`` (to compare budgets side by side);
* ``fixed <rung>``: every link at one rung of the same ladders (activations ``delta:<rung>``, gradients the
  rung :data:`FIXED_BACKWARD` pairs with it: ``fixed q4`` sends ``direct:q6``), the choices ``auto`` picks
  from; ``fixed <rung> warmup <codec>`` the same with ``--warmup-codec <codec>``.

All settings start with a warm-up epoch (AQ-SGD fills its cache there): uncompressed for fp32 and the fixed
settings (``<codec>`` with ``warmup <codec>``), at each link's chosen level for auto
(:mod:`aqsgd.train.adaptive`). Per run:

* ``time_to_target_s``: training seconds (the sum of the step times, warm-up included) until the training
  loss, as a mean over :data:`SMOOTH` steps, is at or below the *target*: the loss ``fp32`` reaches (the same
  mean) at :data:`TARGET_AT` of its steps; None if never;
* quality: the evaluation (compression off: the model as it is exported) every ``steps / evals`` steps;
  ``final_perplexity`` the last one's perplexity, ``late_perplexity`` the mean of those at or after
  :data:`TARGET_AT` of the steps, and ``perplexity_vs_fp32`` that mean relative to fp32's (one evaluation
  alone moves by about a percent from one step to the next once a small training set is memorised: the
  mean of the last few is the steadier measure);
* the spec every link sent with at every step (``auto``), for the plot of bits per link over time.

Every setting runs in stage processes of its own, which first train a short copy of the run and drop it (a
codec's kernels are compiled at its first use, and a fresh process pays one-off costs). A setting whose run
fails (a diverged step: NaN or Inf in a loss or at a boundary) is reported with its error and the steps it
made; the other settings still run. Links are emulated in the transport (sleeps), so the compute is real and
shares this machine's cores.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from aqsgd.bench.pipeline import _bench_entry
from aqsgd.comm.launch import launch_local
from aqsgd.compress import make_codec
from aqsgd.errors import StageFailedError
from aqsgd.train.adaptive import BITS, LADDERS, parse_auto
from aqsgd.train.config import TrainConfig

__all__ = ["AdaptiveBenchConfig", "SCENARIOS", "bench_adaptive", "fixed_settings", "plot", "summarize",
           "time_to_target"]

SMOOTH = 3  # steps in the running mean of the training loss
TARGET_AT = 0.75  # the target loss: fp32's at this fraction of its steps

# scenario -> --link, with {half} the step from which a link changes and {lat} the links' latency
SCENARIOS: dict[str, str] = {
    "uneven": "1gbit{lat}/50mbit{lat}/200mbit{lat}",
    "drop": "1gbit{lat}/200mbit{lat}~20mbit{lat}@{half}/200mbit{lat}",
}


# the gradients' rung beside each activation rung in ``fixed <rung>``: as many bits or more, and 6 beside 4
# (AQ-SGD's usual pairing: gradients need more bits than activation deltas)
FIXED_BACKWARD = {"fp16": "bf16", "q8": "q8", "q6": "q6", "q4": "q6", "q3": "q4", "q2:l2": "q4"}


def fixed_settings() -> dict[str, tuple[str, str]]:
    """``fixed <rung>`` -> (forward, backward) for every rung of the activation ladder."""
    return {f"fixed {rung}": (f"delta:{rung}", f"direct:{FIXED_BACKWARD[rung]}")
            for rung in LADDERS["forward"]}


def all_settings() -> dict[str, tuple[str, str]]:
    return {"fp32": ("none", "none"), "auto": ("auto", "auto"), **fixed_settings()}


def setting_specs(name: str) -> tuple[str, str]:
    """A setting's ``(--forward, --backward)``: one of :func:`all_settings`, or ``auto:err=E`` (auto on both
    directions with the error budget ``E``, or ``none``: to compare budgets in one run), or ``fixed <rung>
    warmup <codec>`` (that fixed setting with ``--warmup-codec <codec>``); ValueError naming the setting
    otherwise."""
    known = all_settings()
    base, codec = _split_warmup(name)
    if base in known and (codec is None or base.startswith("fixed ")):
        if codec is not None:
            try:
                make_codec(codec)
            except ValueError as e:
                raise ValueError(f"setting {name!r}: {e}") from None
        return known[base]
    if name.startswith("auto:err="):
        parse_auto(name, "forward")  # a bad budget: its own message
        return name, name
    raise ValueError(f"setting {name!r}: valid are {', '.join(known)}, auto:err=E (E in (0, 1) or none) and "
                     "'fixed RUNG warmup CODEC'")


def warmup_codec(name: str) -> str:
    """The ``--warmup-codec`` of a setting (``fixed q4 warmup q8``: q8), ``none`` where it names none."""
    return _split_warmup(name)[1] or "none"


def _split_warmup(name: str) -> tuple[str, str | None]:
    base, sep, codec = name.partition(" warmup ")
    return (base, codec.strip()) if sep else (name, None)


@dataclasses.dataclass
class AdaptiveBenchConfig:
    stages: int = 4
    scenarios: Sequence[str] = tuple(SCENARIOS)
    settings: Sequence[str] = tuple(all_settings())
    hidden: int = 256
    layers: int = 4
    seq_len: int = 128
    vocab: int = 512
    microbatch_size: int = 4
    num_microbatches: int = 4
    train_samples: int = 64  # 4 steps per epoch: the warm-up, then AQ-SGD revisits its cache
    steps: int = 40
    evals: int = 8  # evaluations per run, every steps / evals steps
    eval_samples: int = 32
    lr: float = 1e-3
    latency_ms: float = 0.0
    seed: int = 0
    # every setting but fp32 (whose losses set the target, the same in every run) runs this many times, the
    # settings in turn; times to target and step times are medians over the repeats
    repeats: int = 1

    def link(self, scenario: str) -> str:
        """The scenario's ``--link``: 4 stages' links; 3 stages take the first two, 2 stages the middle one
        (the slow or changing link)."""
        lat = f",{self.latency_ms:g}ms" if self.latency_ms else ""
        parts = SCENARIOS[scenario].format(half=self.steps // 2 + 1, lat=lat).split("/")
        return "/".join(parts[1:2] if self.stages == 2 else parts[: self.stages - 1])


def train_config(cfg: AdaptiveBenchConfig, scenario: str, setting: str, output_dir: str) -> TrainConfig:
    forward, backward = setting_specs(setting)
    batch = cfg.microbatch_size * cfg.num_microbatches
    return TrainConfig.of(
        task="synthetic-lm", model="tiny-llama", model_layers=cfg.layers, hidden_size=cfg.hidden,
        vocab_size=cfg.vocab, max_length=cfg.seq_len, max_train_samples=cfg.train_samples,
        max_eval_samples=cfg.eval_samples, stages=cfg.stages, micro_batches=cfg.num_microbatches,
        micro_batch_size=cfg.microbatch_size, forward=forward, backward=backward, warmup_epochs=1,
        warmup_codec=warmup_codec(setting),
        epochs=-(-cfg.steps * batch // cfg.train_samples), max_steps=cfg.steps, lr=cfg.lr, lr_warmup=0.0,
        seed=cfg.seed, eval_every=max(1, cfg.steps // max(cfg.evals, 1)), checkpoint_every=0, progress=False,
        tensorboard=False,
        runtime="distributed", link=cfg.link(scenario), timeout=300.0, output_dir=output_dir,
        run_name=setting.replace(" ", "-").replace(":", "-"), overwrite=True)


def _epoch(cfg: AdaptiveBenchConfig) -> int:
    """Steps per epoch (the warm-up's length)."""
    return -(-cfg.train_samples // (cfg.microbatch_size * cfg.num_microbatches))


def smoothed(losses: Sequence[float]) -> list[float]:
    """The running mean of the last :data:`SMOOTH` losses at every step."""
    return [statistics.fmean(losses[max(0, i + 1 - SMOOTH): i + 1]) for i in range(len(losses))]


def time_to_target(losses: Sequence[float], step_s: Sequence[float], target: float) -> float | None:
    """Seconds of training (the steps' times summed) until the smoothed loss is at or below ``target``."""
    elapsed = 0.0
    for loss, dt in zip(smoothed(losses), step_s):
        elapsed += dt
        if loss <= target:
            return elapsed
    return None


def _run_record(setting: str, rows: list[dict[str, Any]], error: str | None = None) -> dict[str, Any]:
    """One setting's figures from its ``metrics.jsonl`` rows; ``error``: the first line of its failure, if it
    failed (its rows are then the steps it made)."""
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    final = evals[-1]["uncompressed"] if evals else None
    steps = max((r["step"] for r in rows if "step" in r), default=0)
    late = [e["uncompressed"]["perplexity"] for e in evals if e["step"] >= TARGET_AT * steps]
    return {
        "setting": setting, "forward": setting_specs(setting)[0], "backward": setting_specs(setting)[1],
        "warmup_codec": warmup_codec(setting),
        "loss": [r["loss"] for r in train], "step_s": [r["time"]["step"] for r in train],
        "codecs": [r.get("codecs") for r in train],
        # auto: every rung's relative error on each link's probed micro-batch (aqsgd.train.adaptive)
        "link_errors": ([r.get("link_errors") for r in train] if any("link_errors" in r for r in train)
                        else None),
        "emulated": [{k: v.get("emulated") for k, v in r.get("links", {}).items()} for r in train],
        "mbit_s": [{k: v.get("mbit_s") for k, v in r.get("links", {}).items()} for r in train],
        "bytes_sent": sum(r["bytes_sent"] for r in train), "train_s": sum(r["time"]["step"] for r in train),
        "final": final, "error": error,
        "evals": [{"step": e["step"], "perplexity": e["uncompressed"]["perplexity"]} for e in evals],
        "late_perplexity": statistics.fmean(late) if late and error is None else None,
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The target loss, and every run's time to it, median step time, final perplexity and late perplexity
    (the mean of the last evaluations, the last one's where a run has no such mean) relative to fp32's (added
    to the runs in place); ``best_fixed``: the fixed setting that reached the target first."""
    fp32 = next(r for r in runs if r["setting"] == "fp32")
    if not fp32["loss"] or fp32.get("error"):
        raise RuntimeError("the fp32 run, which sets the target loss, failed: "
                           f"{fp32.get('error') or 'no steps'}")
    at = max(0, round(TARGET_AT * len(fp32["loss"])) - 1)
    target = smoothed(fp32["loss"])[at]

    def late(r: dict[str, Any]) -> float | None:
        return r.get("late_perplexity") or (r["final"]["perplexity"] if r["final"] else None)

    ref = late(fp32)
    for r in runs:
        r["time_to_target_s"] = time_to_target(r["loss"], r["step_s"], target)
        r["median_step_s"] = statistics.median(r["step_s"]) if r["step_s"] else None
        r["final_perplexity"] = r["final"]["perplexity"] if r["final"] else None
        ppl = late(r)
        r["perplexity_vs_fp32"] = None if ppl is None or ref is None else ppl / ref - 1
    return {"target_loss": target, "target_at_step": at + 1, "best_fixed": best_fixed(runs)}


def bench_adaptive(cfg: AdaptiveBenchConfig, work_dir: str | None = None,
                   progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every scenario of ``cfg`` with every setting; ``{scenario: {"link", "runs", "target_loss", ...}}``."""
    for name in cfg.settings:
        setting_specs(name)
    if "fp32" not in cfg.settings:
        raise ValueError("settings: fp32 is needed (the target loss is its); valid: "
                         f"{', '.join(all_settings())} and auto:err=E")
    if not 2 <= cfg.stages <= 4:
        raise ValueError(f"stages: {cfg.stages}; the scenarios have links for 2 to 4 stages")
    bad = [s for s in cfg.scenarios if s not in SCENARIOS]
    if bad:
        raise ValueError(f"scenarios: unknown {', '.join(bad)}; valid: {', '.join(SCENARIOS)}")
    if cfg.repeats < 1:
        raise ValueError(f"repeats: {cfg.repeats}; at least 1")
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="aqsgd-bench-adaptive-") as tmp:
        for scenario in cfg.scenarios:
            root = str(Path(work_dir or tmp) / scenario)
            if progress:
                reps = f", {cfg.repeats} repeats of each but fp32" if cfg.repeats > 1 else ""
                progress(f"{scenario}: links {cfg.link(scenario)}, {len(cfg.settings)} settings x "
                         f"{cfg.steps} steps{reps}")
            records: dict[str, list[dict[str, Any]]] = {s: [] for s in cfg.settings}
            # the settings in turn, repeat after repeat: a machine that slows down for a while weighs on all
            for rep in range(cfg.repeats):
                for setting in cfg.settings:
                    if rep and setting == "fp32":
                        continue
                    c = train_config(cfg, scenario, setting, root)
                    if rep:
                        c = c.replace(run_name=f"{c.run.run_name}-{rep + 1}")
                    records[setting].append(_run_setting(cfg, setting, c, progress))
            flat = [r for rs in records.values() for r in rs]
            figures = summarize(flat)  # each run's figures against fp32's target
            runs = [combine(rs) for rs in records.values()]
            out[scenario] = {"link": cfg.link(scenario), "runs": runs, **figures,
                             "best_fixed": best_fixed(runs)}
            if progress:
                progress(format_scenario(scenario, out[scenario]))
    return out


def _run_setting(cfg: AdaptiveBenchConfig, setting: str, c: TrainConfig,
                 progress: Callable[[str], None] | None) -> dict[str, Any]:
    """Run one setting (4 stage processes) and read its record from its ``metrics.jsonl``."""
    # one-off costs (kernels compiled at a codec's first use, allocator growth, first connections) are paid by
    # a short copy of the run first, dropped
    warm = c.replace(run_name=f"warm-up-{c.run.run_name}", max_steps=min(cfg.steps, _epoch(cfg) + 2),
                     eval_every=0)
    error, started = None, time.perf_counter()
    try:
        launch_local(_bench_entry, cfg.stages, json.dumps([warm.to_json(), c.to_json()]),
                     run_id="aqsgd-bench-adaptive")
    except StageFailedError as e:  # a diverged run: reported, and the next setting runs
        error = str(e).splitlines()[0]
        if progress:
            progress(f"  {setting}: failed: {error}")
    metrics = Path(c.run.output_dir) / c.run.run_name / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    record = _run_record(setting, rows, error)
    if progress and not error:  # what each run took: the bench runs for many minutes
        steps = record["step_s"]
        progress(f"  {setting}: median step {statistics.median(steps) if steps else float('nan'):.3f} s; "
                 f"{time.perf_counter() - started:.0f} s with its warm-up copy")
    return record


_PER_REPEAT = ("time_to_target_s", "median_step_s", "late_perplexity", "perplexity_vs_fp32", "train_s",
               "error")


def combine(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One setting's record from its repeats (summarized): the first repeat's per-step figures, the medians of
    the repeats' times to target (``never`` counted as the longest) and of all their step times, and each
    repeat's figures under ``repeats``."""
    out = dict(records[0])
    if len(records) == 1:
        return out
    times = [math.inf if r["time_to_target_s"] is None else r["time_to_target_s"] for r in records]
    ttt = statistics.median(times)
    steps = [s for r in records for s in r["step_s"]]
    ppl = [r["perplexity_vs_fp32"] for r in records if r["perplexity_vs_fp32"] is not None]
    out.update(time_to_target_s=None if math.isinf(ttt) else ttt,
               median_step_s=statistics.median(steps) if steps else None,
               perplexity_vs_fp32=statistics.median(ppl) if ppl else None,
               repeats=[{k: r.get(k) for k in _PER_REPEAT} for r in records])
    return out


def best_fixed(runs: list[dict[str, Any]]) -> str | None:
    """The fixed setting that reached the target first (known only in hindsight), or None."""
    fixed = [r for r in runs if r["setting"].startswith("fixed") and r["time_to_target_s"] is not None]
    return min(fixed, key=lambda r: r["time_to_target_s"])["setting"] if fixed else None


def _seconds(t: float | None) -> str:
    return "never" if t is None else f"{t:.2f} s"


def format_scenario(name: str, result: dict[str, Any]) -> str:
    lines = [f"{name} ({result['link']}): target loss {result['target_loss']:.4f} (fp32 at step "
             f"{result['target_at_step']}); best fixed: {result['best_fixed']}"]
    for r in result["runs"]:
        t, rel, ppl = r["time_to_target_s"], r["perplexity_vs_fp32"], r.get("late_perplexity")
        med = r["median_step_s"]
        lines.append(f"  {r['setting']:<14} to target {'never' if t is None else f'{t:7.2f} s'}   "
                     f"median step {'-' if med is None else f'{med:.3f} s'}   late perplexity "
                     f"{'-' if ppl is None else f'{ppl:.4f}'}"
                     f" ({'-' if rel is None else f'{100 * rel:+.2f} %'} vs fp32)"
                     + (f"   FAILED after {len(r['loss'])} steps: {r['error']}" if r.get("error") else "")
                     + ("   repeats: " + ", ".join(_seconds(x["time_to_target_s"]) for x in r["repeats"])
                        if r.get("repeats") else ""))
    return "\n".join(lines)


def bits_over_steps(run: dict[str, Any]) -> dict[str, list[float | None]]:
    """Bits per value each link sent with at every step (from an ``auto`` run's codecs)."""
    names = sorted({k for c in run["codecs"] if c for k in c})
    return {n: [None if not c or n not in c else BITS[c[n].partition(":")[2]] for c in run["codecs"]]
            for n in names}


def plot(results: dict[str, Any], path: str | Path, title: str) -> None:
    """Per scenario: training loss against training time for every setting (top), and the bits each link of
    ``auto`` sent with at every step next to its emulated bandwidth (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(results), figsize=(6.5 * len(results), 8), squeeze=False)
    for col, (scenario, res) in enumerate(results.items()):
        top, bottom = axes[0][col], axes[1][col]
        for r in res["runs"]:
            elapsed, t = [], 0.0
            for dt in r["step_s"]:
                t += dt
                elapsed.append(t)
            style = dict(lw=2.2, color="black") if r["setting"] == "auto" else dict(lw=1.0, alpha=0.8)
            top.plot(elapsed, smoothed(r["loss"]), label=r["setting"], **style)
        top.axhline(res["target_loss"], color="grey", ls=":", lw=1)
        top.set(title=f"{scenario}: {res['link']}", xlabel="training time (s)",
                ylabel=f"training loss (mean of {SMOOTH} steps)")
        top.legend(fontsize=7)
        auto = next((r for r in res["runs"] if r["setting"] == "auto"), None)
        if auto is None:
            continue
        steps = range(1, len(auto["loss"]) + 1)
        for name, bits in bits_over_steps(auto).items():
            bottom.plot(steps, [b if b is not None else float("nan") for b in bits], drawstyle="steps-post",
                        ls="-" if name.endswith("forward") else "--", label=f"{name} bits")
        bottom.set(xlabel="step", ylabel="bits per value (auto)", ylim=(0, 17))
        twin = bottom.twinx()
        for name in sorted({k for e in auto["emulated"] for k in e if k.endswith("forward")}):
            mbit = [_mbit(e.get(name)) for e in auto["emulated"]]
            twin.plot(steps, mbit, color="grey", lw=0.8, ls=":")
            twin.annotate(name.split(".")[0], (steps[-1], mbit[-1]), fontsize=7, color="grey")
        twin.set(yscale="log", ylabel="emulated link (Mbit/s, dotted)")
        bottom.legend(fontsize=7, loc="lower left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _mbit(spec: str | None) -> float:
    if not spec:
        return float("nan")
    bw = spec.split(",")[0]
    return float("nan") if bw == "inf" else float(bw.removesuffix("mbit"))
