"""What each stage sent and spent in one optimizer step, gathered from every process.

A :class:`StageStats` is one stage's figures of a step: the codec and fp32 bytes of each direction it sent,
its compute, codec and waiting seconds, the data-parallel sync's bytes, and what its links carried (wire bytes
and busy seconds of the links it sends on, seconds the links it receives on held messages back) with its
senders' error probes. Distributed, every process fills its own stage's and :func:`gather` sums them over the
run (one contributor per replica of each stage), so that every process holds the same figures: the metrics
row and the link rule's choices are computed from them alike everywhere.

The all-reduce carries the fields as floats in the dataclass's field order; the order is defined here once,
by the dataclass, and read back into the same class (:meth:`StageStats.from_floats`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from aqsgd.train.adaptive import LADDERS, LinkSample, StepSample, link_name, parse_link

__all__ = ["StageStats", "gather", "step_sample"]

_FW_RUNGS, _BW_RUNGS = len(LADDERS["forward"]), len(LADDERS["backward"])


@dataclasses.dataclass
class StageStats:
    """One stage's figures of one step (summed over the stage's replicas once gathered). The fields before
    the probes are the ``stages`` entries of a metrics row, under these names."""

    fw_bytes: float = 0.0  # codec bytes sent forward (activations) and backward (their gradients)
    bw_bytes: float = 0.0
    fw_raw: float = 0.0  # what fp32 would have sent
    bw_raw: float = 0.0
    compute_s: float = 0.0
    encode_s: float = 0.0
    decode_s: float = 0.0
    wait_s: float = 0.0
    sync_bytes: float = 0.0  # the data-parallel gradient sync's bytes this process sent
    step_s: float = 0.0  # the step as this process timed it
    tokens: float = 0.0  # the real tokens of its micro-batches (text)
    fw_tokens_sent: float = 0.0  # token positions it sent forward and backward, and how many were padding
    fw_pad_sent: float = 0.0
    bw_tokens_sent: float = 0.0
    bw_pad_sent: float = 0.0
    # what its links to the next stage (forward) and the previous one (backward) carried
    fw_wire_bytes: float = 0.0
    fw_busy_s: float = 0.0
    bw_wire_bytes: float = 0.0
    bw_busy_s: float = 0.0
    in_fw_held_s: float = 0.0  # seconds the links it receives on held their messages back
    in_bw_held_s: float = 0.0
    # its senders' error probes: each rung's summed squared relative error, and the samples probed
    fw_err2: tuple[float, ...] = (0.0,) * _FW_RUNGS
    fw_probed: float = 0.0
    bw_err2: tuple[float, ...] = (0.0,) * _BW_RUNGS
    bw_probed: float = 0.0

    _PROBES = ("fw_err2", "fw_probed", "bw_err2", "bw_probed")

    def to_floats(self) -> list[float]:
        out: list[float] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out.extend(value) if isinstance(value, tuple) else out.append(float(value))
        return out

    @classmethod
    def from_floats(cls, values: Sequence[float]) -> StageStats:
        kw: dict[str, Any] = {}
        i = 0
        for f in dataclasses.fields(cls):
            width = len(f.default) if isinstance(f.default, tuple) else 0
            kw[f.name] = tuple(values[i : i + width]) if width else values[i]
            i += width or 1
        return cls(**kw)

    def row(self, replicas: int) -> dict[str, float]:
        """Its entry of a metrics row: the mean over the stage's replicas, probes left out."""
        return {f.name: getattr(self, f.name) / replicas for f in dataclasses.fields(self)
                if f.name not in self._PROBES}

    def sent(self, direction: str) -> tuple[float, float, float, float]:
        """The fp32, codec and wire bytes and busy seconds of what it sent in ``direction``."""
        d = "fw" if direction == "forward" else "bw"
        return (getattr(self, f"{d}_raw"), getattr(self, f"{d}_bytes"), getattr(self, f"{d}_wire_bytes"),
                getattr(self, f"{d}_busy_s"))


def probe_fields(probe: tuple[list[float], float] | None, direction: str) -> dict[str, Any]:
    """A sender's :meth:`~aqsgd.schemes.base.BoundaryScheme.take_probe` as the fields of ``direction`` (zeros
    where nothing was probed or a floor shortened the ladder)."""
    d = "fw" if direction == "forward" else "bw"
    rungs = [0.0] * len(LADDERS[direction])
    samples = 0.0
    if probe is not None:
        errs, samples = probe
        rungs[: len(errs)] = errs
    return {f"{d}_err2": tuple(rungs), f"{d}_probed": samples}


def gather(mine: dict[int, StageStats], stages: int, distributed: bool) -> list[StageStats]:
    """Every stage's figures: those of the stages this process owns, summed with every other process's when
    distributed (row ``i``: one contributor per replica of stage ``i``)."""
    rows = [mine.get(i, StageStats()).to_floats() for i in range(stages)]
    if distributed:
        t = torch.tensor(rows, dtype=torch.float64)
        dist.all_reduce(t)
        rows = t.tolist()
    return [StageStats.from_floats(r) for r in rows]


def link_sample(stats: Sequence[StageStats], name: str) -> LinkSample:
    """Link ``name``'s figures: its sender's, with the seconds its receiver (the stage after, forward; before,
    backward) saw the link hold messages back."""
    b, direction, sender = parse_link(name)
    st = stats[sender]
    raw, sent, wire, busy = st.sent(direction)
    if direction == "forward":
        held, err2, probed = stats[b + 1].in_fw_held_s, st.fw_err2, st.fw_probed
    else:
        held, err2, probed = stats[b].in_bw_held_s, st.bw_err2, st.bw_probed
    return LinkSample(raw=raw, sent=sent, wire=wire, busy_s=busy, held_s=held, err2=err2, probed=probed)


def step_sample(stats: Sequence[StageStats]) -> StepSample:
    """A step as a link rule sees it (:class:`~aqsgd.train.adaptive.StepSample`), every link of the run."""
    links = {link_name(b, d): link_sample(stats, link_name(b, d))
             for b in range(len(stats) - 1) for d in ("forward", "backward")}
    return StepSample(links, compute_s=max(s.compute_s for s in stats), step_s=max(s.step_s for s in stats))
