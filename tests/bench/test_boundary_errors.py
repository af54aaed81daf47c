"""The boundary-error probe's measurements on a tensor built like a Llama hidden state: one position of every
sequence ~100x larger than the others (an attention sink)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.boundary_errors import markdown_table, relative_errors


@pytest.fixture
def sink_activation():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, 64, generator=g)
    x[:, 0] *= 100.0
    return x


def test_a_shared_channel_scale_sends_the_other_positions_as_zeros(sink_activation):
    channel = relative_errors("q2", sink_activation)
    token = relative_errors("q2:token", sink_activation)
    # position 0 sets every channel's scale: the rest falls in the zero bin (error ~1, nothing sent)
    assert channel["other_positions"] > 0.95 and channel["position0"] < 0.6
    # a scale per position keeps them (2-bit max-abs on Gaussian rows: ~0.7)
    assert token["other_positions"] < 0.8
    # fp16 scales: 128 rows vs 64 channels
    assert token["wire_bytes"] - channel["wire_bytes"] == (128 - 64) * 2
    # the overall error is dominated by position 0's share of the norm
    assert channel["all"] == pytest.approx(channel["position0"], rel=0.05)


def test_lossless_and_fine_specs_are_exact_or_close(sink_activation):
    assert relative_errors("q8:token", sink_activation)["all"] < 0.02


def test_table_gives_ranges_over_boundaries():
    rows = [{"tensor": "delta", "spec": "q2", "wire_bytes": 100, "all": a, "position0": 0.1,
             "other_positions": 0.9}
            for a in (0.2, 0.5)]
    lines = markdown_table({"rows": rows})
    assert lines[2] == "| delta | `q2` | 100 | 0.20–0.50 | 0.10 | 0.90 |"


def test_probe_runs_on_a_local_model(tmp_path, monkeypatch):
    """The whole probe on a tiny random Llama saved as a local folder, on random tokens instead of the wiki
    task."""
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    from aqsgd.data import datasets
    from benchmarks.boundary_errors import BACKWARD_SPECS, FORWARD_SPECS, main

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2)).save_pretrained(tmp_path / "tiny")

    def load_task(name, split, *, seq_len, max_samples):
        ids = torch.randint(0, 64, (max_samples, seq_len), generator=torch.Generator().manual_seed(1))
        return [{"sample_id": i, "input_ids": ids[i], "attention_mask": torch.ones_like(ids[i]),
                 "labels": ids[i]}
                for i in range(max_samples)]

    monkeypatch.setattr(datasets, "load_task", load_task)
    out = tmp_path / "r.json"
    assert main(["--model", str(tmp_path / "tiny"), "--seq-len", "8", "--samples", "12", "--steps", "2",
                 "--batch", "4", "--lr", "1e-2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["boundaries"] == [0, 1, 2]
    assert len(result["rows"]) == 3 * (2 * len(FORWARD_SPECS) + len(BACKWARD_SPECS))
    for r in result["rows"]:
        assert r["shape"] == [4, 8, 32] and r["delta_norm_over_activation_norm"] > 0 and r["all"] > 0
