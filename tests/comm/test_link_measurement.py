"""Each boundary's link is measured while training: the bytes it carried and the time it was busy, per step in
``metrics.jsonl`` (``links``), so the achieved throughput of every link can be read (and acted on)."""

from __future__ import annotations

import json

import pytest

from aqsgd.cli import main


@pytest.mark.slow
def test_every_boundary_link_is_measured_per_step(tmp_path):
    argv = ["train", "--task", "synthetic-lm", "--runtime", "distributed", "--stages", "3", "--link",
            "inf/4mbit,5ms", "--max-steps", "3", "--max-train-samples", "32", "--max-length", "12",
            "--micro-batches", "2", "--micro-batch-size", "4", "--warmup-epochs", "0", "--output-dir",
            str(tmp_path), "--run-name", "r", "--no-progress", "--no-tensorboard"]
    assert main(argv) == 0
    rows = [json.loads(r) for r in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 3
    for r in train:
        links = r["links"]
        assert set(links) == {"b0.forward", "b0.backward", "b1.forward", "b1.backward"}
        for name, link in links.items():
            # the wire carries the packets and their preambles: more than the codec's bytes
            assert link["wire_bytes"] > r["bytes"][name] > 0 and link["busy_s"] > 0, (name, link)
        slow = links["b1.forward"]
        # the 4 Mbit/s boundary cannot carry its bytes faster than 4 Mbit/s (the pacer's floor on the time),
        # and its measured rate is that link's, not the unlimited one's
        assert slow["busy_s"] >= 8 * slow["wire_bytes"] / 4e6 * 0.999
        assert 1.0 < slow["mbit_s"] <= 4.0 * 1.001
