"""The named compression settings every benchmark draws from (``aqsgd bench pipeline``, ``bench netem`` and the
convergence study): one table, so a name means the same codecs everywhere. Each benchmark picks its default
list of names from it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["Setting", "SETTINGS", "setting"]


@dataclasses.dataclass(frozen=True)
class Setting:
    """The boundary codecs of one setting (``--forward`` / ``--backward``), plus ``overrides``: more training
    options by their flat names (as on the command line, e.g. ``{"cache": "lowbit4"}``)."""

    forward: str
    backward: str
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)


SETTINGS: dict[str, Setting] = {
    "fp32": Setting("none", "none"),
    "fp16": Setting("fp16", "fp16"),
    "aqsgd fw2/bw4": Setting("delta:q2", "direct:q4"),
    "direct fw2/bw4": Setting("direct:q2", "direct:q4"),
    "aqsgd fw3/bw6": Setting("delta:q3", "direct:q6"),
    "direct fw3/bw6": Setting("direct:q3", "direct:q6"),
    "aqsgd fw4/bw8": Setting("delta:q4", "direct:q8"),
    "direct fw4/bw8": Setting("direct:q4", "direct:q8"),
    "topk10%": Setting("direct:topk0.1", "direct:topk0.1"),
    "topk10% + ef": Setting("ef:topk0.1", "ef:topk0.1"),
    "topk10% + ef21": Setting("ef21:topk0.1", "ef21:topk0.1"),
    "topk30%": Setting("direct:topk0.3", "direct:topk0.3"),
    "topk30% + ef": Setting("ef:topk0.3", "ef:topk0.3"),
    "aqsgd + topk30%": Setting("delta:topk0.3", "direct:topk0.3"),
    # ablations: one direction compressed, the other fp32
    "aqsgd fw2 only": Setting("delta:q2", "none"),
    "direct fw2 only": Setting("direct:q2", "none"),
    "bw4 only": Setting("none", "direct:q4"),
    # the same bits with one scale per token (row) instead of per channel: +16 bits per row of 384-768 values
    "aqsgd fw2/bw4 token": Setting("delta:q2:token", "direct:q4:token"),
    "direct fw2/bw4 token": Setting("direct:q2:token", "direct:q4:token"),
    # unbiased (stochastic) rounding of AQ-SGD's deltas: m follows a in expectation
    "aqsgd fw2/bw4 stochastic": Setting("delta:q2:stochastic", "direct:q4"),
    # MSE-optimal clipping of the 2-bit activations (scale = min(max-abs, 1.71 rms) per channel): the zero
    # bin shrinks from half the channel's max-abs to 0.86 rms, so more of each delta gets through
    "aqsgd fw2/bw4 l2": Setting("delta:q2:l2", "direct:q4"),
    "direct fw2/bw4 l2": Setting("direct:q2:l2", "direct:q4"),
    # all four 2-bit codes (no zero level) with a scale per token: on SmolLM2 the attention-sink position
    # (~100x the others) sets every per-channel scale, and a midrise grid then sends the other positions'
    # near-zero values of those channels as +-step/2 (benchmarks/boundary_errors.py)
    "aqsgd fw2/bw4 token l2 midrise": Setting("delta:q2:token:l2:midrise", "direct:q4"),
}


def setting(name: str) -> Setting:
    """The setting called ``name``; ValueError listing the names there are."""
    try:
        return SETTINGS[name]
    except KeyError:
        raise ValueError(f"unknown setting {name!r}; settings are: {', '.join(SETTINGS)}") from None
