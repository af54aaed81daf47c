"""Golden behaviour: the per-step training losses (and final evaluation losses) of four runs, recorded once
and compared bit for bit, so that a refactor that claims "behaviour unchanged" is held to it on CPU.

The runs go through the command line, the interface users keep:

(a) the default job (``aqsgd train``) on 192 of its articles (6 steps an epoch) for 12 steps: its warm-up
    epoch, then an epoch of the default setting;
(b) a 2-stage distributed run on synthetic data with AQ-SGD fw2/bw4;
(c) data parallelism, 2 stages x 2 replicas, gradients synchronized with ``q8``;
(d) a resume from the checkpoint in the middle of a local run with error-feedback state on both sides.

Re-record (only when a change of numerics is intended, and say why in the commit):
``python tests/golden/test_golden.py --record``, on every platform at hand, and delete the changed cases'
values of the others (their old values would fail there; the case is then compared with the platforms that
hold it). The default job's were re-recorded when the default setting became the subspace codec.

The same code gives other float32 losses on another CPU (oneDNN and MKL pick kernels by CPU model: the
values recorded on an AMD EPYC differ from an Intel Xeon's in the 7th digit, and with AQ-SGD's rounding
the difference grows). So the losses are recorded per platform (torch version, CPU ISA, CPU model):
on a recorded platform they must be equal bit for bit; on another one they are compared with every
recorded platform's within a relative 2e-3 (ten times the largest difference between the platforms recorded so
far, 1.8e-4), which still catches a real change of behaviour, and the message says how to record the platform
(``--record`` adds it, keeping the others).
"""

from __future__ import annotations

import json
import math
import platform
import sys
from pathlib import Path

import pytest
import torch

from aqsgd.cli import main

GOLDEN = Path(__file__).with_name("losses.json")
# on the CPU wherever the suite runs: the losses are the CPU's (on a GPU machine --device auto would train on
# CUDA with bf16 autocast, and no recorded platform would match)
_QUIET = ["--no-progress", "--no-tensorboard", "--device", "cpu"]
_SYNTH = ["--task", "synthetic-lm", "--max-train-samples", "64", "--max-eval-samples", "16", "--max-length",
          "32", "--micro-batches", "2", "--micro-batch-size", "4", "--epochs", "2", "--warmup-epochs", "1"]
CASES: dict[str, list[str]] = {
    "default_job": ["--max-train-samples", "192", "--max-steps", "12"],
    "distributed_aqsgd": [*_SYNTH, "--runtime", "distributed", "--stages", "2", "--forward", "delta:q2",
                          "--backward", "direct:q4"],
    "data_parallel_q8": [*_SYNTH, "--runtime", "distributed", "--stages", "2", "--data-parallel", "2",
                         "--grad-sync", "q8", "--forward", "delta:q2", "--backward", "direct:q4"],
    "resume": [*_SYNTH, "--stages", "3", "--forward", "delta:q2:l2", "--backward", "ef21:q4",
               "--checkpoint-every", "6", "--keep-checkpoints", "5"],
}


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _losses(run_dir: Path) -> dict[str, list[float]]:
    rows = _rows(run_dir)
    return {"train": [r["loss"] for r in rows if r["kind"] == "train"],
            "eval": [r[k]["loss"] for r in rows if r["kind"] == "eval"
                     for k in ("compressed", "uncompressed")]}


def run_case(name: str, out: Path) -> dict[str, list]:
    args = ["train", *CASES[name], *_QUIET, "--output-dir", str(out), "--run-name", name]
    assert main(args) == 0
    result = _losses(out / name)
    if name == "resume":  # continue from the middle checkpoint: the resumed steps are golden too
        folders = sorted(p for p in (out / name / "checkpoints").iterdir() if not p.name.endswith(".tmp"))
        middle = folders[len(folders) // 2 - 1]
        assert main(["train", *CASES[name], *_QUIET, "--output-dir", str(out), "--run-name", "resumed",
                     "--resume", str(middle)]) == 0
        resumed = _losses(out / "resumed")
        result["resumed_from"] = [middle.name]
        result["resumed_train"] = resumed["train"]
    return result


REL_TOL = 2e-3


def platform_key() -> str:
    """What the float32 numerics depend on besides the code: torch, the CPU's ISA level and model."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"torch {torch.__version__.split('+')[0]}, {torch.backends.cpu.get_cpu_capability()}, {model}"


def _close(got: dict[str, list], want: dict[str, list]) -> bool:
    if got.keys() != want.keys():
        return False
    for k in got:
        if len(got[k]) != len(want[k]):
            return False
        for a, b in zip(got[k], want[k]):
            if isinstance(a, str) or isinstance(b, str):
                if a != b:
                    return False
            elif not math.isclose(a, b, rel_tol=REL_TOL):
                return False
    return True


@pytest.mark.parametrize("name", list(CASES))
def test_golden_losses(name: str, tmp_path: Path) -> None:
    platforms = json.loads(GOLDEN.read_text())["platforms"]
    got = run_case(name, tmp_path)
    key = platform_key()
    if name in platforms.get(key, {}):
        assert got == platforms[key][name], f"{name}: losses differ from the golden values recorded on {key}"
        return
    # (a platform recorded before a case's intended change holds no values for it: compared as unrecorded)
    near = [p for p, cases in platforms.items() if name in cases and _close(got, cases[name])]
    assert near, (f"{name}: losses differ by more than {REL_TOL} (relative) from every recorded platform's; "
                  f"this platform ({key}) is not recorded: `python {__file__} --record` adds it")


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        raise SystemExit("usage: python tests/golden/test_golden.py --record")
    import tempfile

    recorded = {}
    for case in CASES:
        with tempfile.TemporaryDirectory() as d:
            recorded[case] = run_case(case, Path(d))
        print(case, recorded[case])
    data = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {"platforms": {}}
    data["platforms"][platform_key()] = recorded
    GOLDEN.write_text(json.dumps(data, indent=1) + "\n")
    print(f"recorded {platform_key()} in {GOLDEN}")
