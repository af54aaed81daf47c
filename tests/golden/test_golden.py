"""Golden behaviour: the per-step training losses (and final evaluation losses) of four runs, recorded once
and compared bit for bit, so that a refactor that claims "behaviour unchanged" is held to it on CPU.

The runs go through the command line, the interface users keep:

(a) the default job (``aqsgd train``) cut to ``--max-steps 12``;
(b) a 2-stage distributed run on synthetic data with AQ-SGD fw2/bw4;
(c) data parallelism, 2 stages x 2 replicas, gradients synchronized with ``q8``;
(d) a resume from the checkpoint in the middle of a local run with error-feedback state on both sides.

Re-record (only when a change of numerics is intended, and say why in the commit):
``python tests/golden/test_golden.py --record``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from aqsgd.cli import main

GOLDEN = Path(__file__).with_name("losses.json")
_QUIET = ["--no-progress", "--no-tensorboard"]
_SYNTH = ["--task", "synthetic-lm", "--max-train-samples", "64", "--max-eval-samples", "16", "--max-length", "32",
          "--micro-batches", "2", "--micro-batch-size", "4", "--epochs", "2", "--warmup-epochs", "1"]
CASES: dict[str, list[str]] = {
    "default_job": ["--max-steps", "12"],
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
            "eval": [r[k]["loss"] for r in rows if r["kind"] == "eval" for k in ("compressed", "uncompressed")]}


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


@pytest.mark.parametrize("name", list(CASES))
def test_golden_losses(name: str, tmp_path: Path) -> None:
    golden = json.loads(GOLDEN.read_text())[name]
    got = run_case(name, tmp_path)
    assert got == golden, f"{name}: losses differ from the recorded golden values"


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        raise SystemExit("usage: python tests/golden/test_golden.py --record")
    import tempfile

    recorded = {}
    for case in CASES:
        with tempfile.TemporaryDirectory() as d:
            recorded[case] = run_case(case, Path(d))
        print(case, recorded[case])
    GOLDEN.write_text(json.dumps(recorded, indent=1) + "\n")
