"""``python -m benchmarks.balance_measured``: ``--balance measured`` against every split, one stage made slower.

A random Llama of ``--blocks`` blocks (saved to a temporary folder) fine-tuned on the synthetic LM task over a
``--stages``-stage pipeline, distributed on this machine (one process per stage, gloo on loopback, ``--threads``
torch threads each), with stage ``--slow-stage`` made ``--factor`` times slower by ``--emulate-slow-stage``
(it sleeps that much longer after each forward and backward, leaving its cores to the other stages). Every
contiguous split of the blocks is trained with ``--layers``, and the same run with ``--balance measured``
(which profiles with the even split first, then trains with the split it chooses); all in one process group,
in ``--rounds`` rounds that each take the runs in a rotated order (the machine's load drifts: each run's
neighbours change from round to round). A run's figure is the median of its steps' times after
``--warmup-steps``; a split's, the median over the rounds. Boundaries are uncompressed (fp32): the balance is
about compute.

Prints one line per split and the measured run's, and the ratio of the measured run's step time to the best
split's (the target: at most 1.10); ``--json PATH`` writes them with the command and the machine.
"""  # noqa: E501, RUF100 (line 1 is the --help description: __doc__.splitlines()[0])

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

TARGET = 1.10


def all_splits(blocks: int, stages: int) -> list[list[int]]:
    """Every contiguous split of ``blocks`` blocks into ``stages`` non-empty stages."""
    out = []
    for cuts in itertools.combinations(range(1, blocks), stages - 1):
        bounds = (0, *cuts, blocks)
        out.append([b - a for a, b in zip(bounds, bounds[1:])])
    return out


def save_model(folder: Path, blocks: int, hidden: int, vocab: int, seq_len: int) -> Path:
    """A random Llama of ``blocks`` blocks saved with ``save_pretrained`` in ``folder``."""
    import torch

    from aqsgd.models import tiny_recipe

    torch.manual_seed(0)
    model = tiny_recipe("llama", layers=blocks, hidden=hidden, vocab=vocab, seq_len=seq_len).build("cpu")
    model.save_pretrained(str(folder))
    return folder


def _worker(rank: int, world: int, cfg_json: str, plan: list[tuple[str, list[int] | None]], warmup: int,
            threads: int) -> dict[str, Any] | None:
    """Train every run of ``plan`` in turn (``(name, layers)``; None: ``--balance measured``); the process
    that writes the metrics returns each run's median step time and split."""
    import torch

    from aqsgd.train.config import TrainConfig
    from aqsgd.train.trainer import Trainer

    torch.set_num_threads(threads)
    cfg = TrainConfig.from_dict(json.loads(cfg_json))
    out: dict[str, Any] = {}
    for i, (name, layers) in enumerate(plan):
        gc.collect()  # the previous runs' trainers: no collection of theirs during this run's steps
        run = cfg.replace(run_name=f"{i:03d}-{name.replace(',', '-')}", layers=layers,
                          balance="measured" if layers is None else "layers")
        trainer = Trainer(run)
        trainer.run()
        if trainer.writes_metrics:
            times = [row["time"]["step"] for row in trainer.history][warmup:]
            out.setdefault(name, []).append({"median_s": statistics.median(times),
                                             "layers": trainer.cfg.pipeline.layers,
                                             "balance": trainer.balance})
        del trainer
    return out or None


def measure(*, blocks: int = 8, stages: int = 2, slow_stage: int = 1, factor: float = 2.0, hidden: int = 128,
            vocab: int = 128, seq_len: int = 32, micro_batches: int = 4, micro_batch_size: int = 4,
            steps: int = 10, warmup_steps: int = 3, rounds: int = 3, threads: int = 1,
            balance_passes: int = 4, workdir: str | None = None) -> dict[str, Any]:
    """Run the comparison (see the module docstring) and return its figures."""
    from aqsgd.comm.testing import run_processes
    from aqsgd.train.config import TrainConfig
    from aqsgd.train.tasks import setup_task

    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        folder = save_model(Path(tmp) / "model", blocks, hidden, vocab, seq_len)
        cfg = TrainConfig.of(
            task="synthetic-lm", model=str(folder), vocab_size=vocab, max_length=seq_len,
            max_train_samples=micro_batches * micro_batch_size * (steps + 2), max_eval_samples=4,
            stages=stages, micro_batches=micro_batches, micro_batch_size=micro_batch_size, epochs=1,
            max_steps=steps, warmup_epochs=0, forward="none", backward="none", eval_every=0,
            checkpoint_every=0, runtime="distributed", balance_passes=balance_passes,
            emulate_slow_stage=f"{slow_stage}:{factor:g}", output_dir=str(Path(tmp) / "runs"),
            cache_dir=str(Path(tmp) / "cache"), progress=False, tensorboard=False, timeout=300.0)
        setup_task(cfg)  # the weights file, once, before the processes start
        runs: list[tuple[str, list[int] | None]] = [
            *((",".join(map(str, s)), s) for s in all_splits(blocks, stages)), ("measured", None)]
        plan = []
        for r in range(rounds):  # each round in another order
            k = (r * len(runs)) // max(rounds, 1)
            plan += runs[k:] + runs[:k]
        results = run_processes(_worker, stages, args=(cfg.to_json(), plan, warmup_steps, threads),
                                timeout_s=3600, pg_timeout_s=300)
    found = next(r for r in results if r)
    rows = {name: {"step_ms": 1e3 * statistics.median(x["median_s"] for x in runs_),
                   "rounds_ms": [1e3 * x["median_s"] for x in runs_],
                   "layers": runs_[0]["layers"]}
            for name, runs_ in found.items()}
    chosen = [x["layers"] for x in found["measured"]]
    best_name = min((n for n in rows if n != "measured"), key=lambda n: rows[n]["step_ms"])
    even = ",".join(map(str, found["measured"][0]["balance"]["profiled_layers"]))
    return {
        "benchmark": "balance-measured", "blocks": blocks, "stages": stages,
        "emulate_slow_stage": f"{slow_stage}:{factor:g}", "hidden": hidden, "seq_len": seq_len,
        "micro_batches": micro_batches, "micro_batch_size": micro_batch_size, "steps": steps,
        "warmup_steps": warmup_steps, "rounds": rounds, "threads": threads,
        "splits": {n: r for n, r in rows.items() if n != "measured"},
        "measured": {**rows["measured"], "chosen_per_round": chosen,
                     "profiles": [x["balance"] for x in found["measured"]]},
        "best_split": best_name, "best_ms": rows[best_name]["step_ms"],
        "even_split": even, "even_ms": rows[even]["step_ms"],
        "measured_over_best": rows["measured"]["step_ms"] / rows[best_name]["step_ms"],
        "target": TARGET,
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.balance_measured",
                                description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--slow-stage", type=int, default=1)
    p.add_argument("--factor", type=float, default=2.0)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per stage process")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    out = measure(blocks=a.blocks, stages=a.stages, slow_stage=a.slow_stage, factor=a.factor, hidden=a.hidden,
                  seq_len=a.seq_len, micro_batches=a.micro_batches, micro_batch_size=a.micro_batch_size,
                  steps=a.steps, warmup_steps=a.warmup_steps, rounds=a.rounds, threads=a.threads)
    for name, row in out["splits"].items():
        mark = " (best)" if name == out["best_split"] else ""
        print(f"split {name:>12}: {row['step_ms']:8.1f} ms per step{mark}")
    m = out["measured"]
    print(f"measured {','.join(map(str, m['layers'])):>9}: {m['step_ms']:8.1f} ms per step "
          f"(chosen per round: {' '.join(','.join(map(str, c)) for c in m['chosen_per_round'])})")
    print(f"measured / best = {out['measured_over_best']:.3f} (target <= {TARGET}); even split "
          f"{out['even_split']} / best = {out['even_ms'] / out['best_ms']:.3f}")
    if a.json:
        import torch

        out["command"] = "python -m benchmarks.balance_measured " + shlex.join(argv or sys.argv[1:])
        out["machine"] = f"{_cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
