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
    assert token["wire_bytes"] - channel["wire_bytes"] == (128 - 64) * 2  # fp16 scales: 128 rows vs 64 channels
    # the overall error is dominated by position 0's share of the norm
    assert channel["all"] == pytest.approx(channel["position0"], rel=0.05)


def test_lossless_and_fine_specs_are_exact_or_close(sink_activation):
    assert relative_errors("q8:token", sink_activation)["all"] < 0.02


def test_table_gives_ranges_over_boundaries():
    rows = [{"tensor": "delta", "spec": "q2", "wire_bytes": 100, "all": a, "position0": 0.1, "other_positions": 0.9}
            for a in (0.2, 0.5)]
    lines = markdown_table({"rows": rows})
    assert lines[2] == "| delta | `q2` | 100 | 0.20–0.50 | 0.10 | 0.90 |"
