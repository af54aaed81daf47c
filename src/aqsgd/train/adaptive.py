"""Bits chosen per link: ``--forward auto`` / ``--backward auto`` pick, for every boundary and direction, the
least compression that keeps the link's time per micro-batch within the pipeline's compute time per
micro-batch, from the links as they are measured while training.

The ladders (one scheme per direction, so a change of bits never invalidates state: AQ-SGD's caches hold
activations, not codes):

* activations, AQ-SGD (``delta``): fp16 -> q8 -> q4 -> q3 -> q2:l2;
* activation gradients, ``direct``: bf16 -> q8 -> q6 -> q4. Not fp16: activation gradients have no bound
  that fp16's range (65504) respects. In a 4-block Llama of width 256 (``aqsgd bench adaptive``) they grew
  about 100x per stage going backward and reached 3e4 in fp32 training, 1.6e5 in a run that sent them as fp16,
  which then stopped at step 79 when the cast overflowed; bf16 has fp32's range, the quantized rungs a scale
  per group.

``auto:q3`` stops the ladder at q3 (the quality floor: never fewer bits than that).

The rule, after every step, for each link (boundary and direction), with ``t(L)`` the time one micro-batch's
tensor takes on the link at level ``L``::

    t(L) = 8 * (fixed + payload * bits(L) / bits(current)) / throughput
    budget = max over stages of compute seconds per micro-batch

``payload`` is what the current codec sent per micro-batch, ``fixed`` what the wire carried besides it
(preambles, headers: it does not shrink with the bits), ``throughput`` the link's wire bits per busy second
(:class:`~aqsgd.comm.transport.LinkStats`), the link busy for the longer of what its sender and its receiver
saw (:func:`link_seconds`); these and the budget are exponential means over steps
(:data:`SMOOTHING`). The throughput is averaged as its inverse, seconds per bit (the quantity ``t(L)`` is
linear in): a link that becomes 100 times slower weighs at once (one slow step makes the mean at least
``SMOOTHING`` times the slow one's), while a link that becomes faster is believed over a few steps.

A link that keeps up with the compute still costs time: the first micro-batch of every pipeline pass crosses
every boundary before the last stage can start, and the last one's gradients cross them all again, so each
link's ``t(L)`` is on the step's critical path once per pass whatever the overlap (the pipeline's fill and
drain). A level *fits* when both hold::

    t(L) <= budget
    fills * (t(L) - t(floor)) <= TOLERANCE * step / links

with ``fills`` the pipeline passes per step (gradient accumulation), ``step`` the measured step time and
``links`` the number of auto links: together the links spend at most :data:`TOLERANCE` of the step on carrying
more bits than their floors. (Without the second rule, measured by ``aqsgd bench adaptive`` on the CPU, auto
kept 8-16 bits where the link allowed it and reached the target loss 1.08-1.14x later than the best fixed
rung.)

The level goes at once to the least compressed ``L`` that fits when the current one no longer does (the
floor if none does), and back up to less compression only after :data:`PATIENCE` steps in a row in which a
level fits with margin, both rules with their right-hand sides times ``UP_MARGIN`` (hysteresis: a link near
the edge, or a noisy measurement, does not make it flip every step).

Every input is a sum all-reduced over the run's processes (the trainer's per-step statistics), so every
process computes the same levels at the same step, and the sender and the receiver of a link switch together
at a step boundary, before the next step's first packet.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["BITS", "LADDERS", "AutoSpec", "LinkPolicy", "is_auto", "link_seconds", "parse_auto"]

LADDERS: dict[str, tuple[str, ...]] = {
    "forward": ("fp16", "q8", "q4", "q3", "q2:l2"),
    "backward": ("bf16", "q8", "q6", "q4"),
}
SCHEMES = {"forward": "delta", "backward": "direct"}
BITS = {"fp16": 16.0, "bf16": 16.0, "q8": 8.0, "q6": 6.0, "q4": 4.0, "q3": 3.0, "q2:l2": 2.0}
UP_MARGIN = 0.7
TOLERANCE = 0.05  # the share of the step that all auto links together may spend above their floors
PATIENCE = 3  # steps in a row that must leave room before a link takes fewer compression
SMOOTHING = 0.3  # weight of the newest step in the exponential means


def link_seconds(sent_busy_s: float, held_back_s: float) -> float:
    """The seconds a link was busy in a step: the sender's view (from each message's hand-over to its send's
    completion) or the receiver's (the spacing of the messages the link held back), whichever is longer. On an
    emulated link they agree; on a real one a send completes once the kernel has taken the bytes, so a slow
    link whose backlog fits the socket buffers only shows at the receiver, where its messages arrive spaced
    by their time on the line."""
    return max(sent_busy_s, held_back_s)


def is_auto(spec: str) -> bool:
    return spec == "auto" or spec.startswith("auto:")


@dataclasses.dataclass(frozen=True)
class AutoSpec:
    """One direction's ladder, from ``auto`` or ``auto:FLOOR``."""

    direction: str
    ladder: tuple[str, ...]

    @property
    def scheme(self) -> str:
        return SCHEMES[self.direction]

    def spec(self, level: int) -> str:
        """The ``--forward``/``--backward`` spec of ``level``."""
        return f"{self.scheme}:{self.ladder[level]}"


def parse_auto(text: str, direction: str) -> AutoSpec:
    """``auto`` or ``auto:FLOOR`` (FLOOR one of the direction's ladder); ValueError naming the choices."""
    ladder = LADDERS[direction]
    _, _, floor = text.partition(":")
    if not floor:
        return AutoSpec(direction, ladder)
    if floor not in ladder:
        raise ValueError(f"auto:{floor}: the floor must be one of the {direction} ladder "
                         f"{', '.join(ladder)}")
    return AutoSpec(direction, ladder[: ladder.index(floor) + 1])


@dataclasses.dataclass
class _Link:
    auto: AutoSpec
    level: int = 0
    seconds_per_bit: float | None = None  # busy seconds per wire bit (the inverse of the throughput)
    fixed: float | None = None  # wire bytes per micro-batch besides the codec's payload
    payload: float | None = None  # the codec's bytes per micro-batch at the current level
    roomy: int = 0  # steps in a row in which a less compressed level fitted with margin


class LinkPolicy:
    """The levels of every link of a run (``boundaries`` stage boundaries, the directions given as
    :class:`AutoSpec`), updated by :meth:`step` from one step's statistics."""

    def __init__(self, boundaries: int, forward: AutoSpec | None, backward: AutoSpec | None) -> None:
        self.links: dict[str, _Link] = {}
        self.budget: float | None = None  # compute seconds per micro-batch of the slowest stage
        self.step_s: float | None = None  # the step time
        self.fills = 1  # pipeline passes per step
        self.steps = 0
        for b in range(boundaries):
            for auto in (forward, backward):
                if auto is not None:
                    self.links[f"b{b}.{auto.direction}"] = _Link(auto)

    def specs(self) -> dict[str, str]:
        """Every link's current spec, by name (``b0.forward``)."""
        return {name: link.auto.spec(link.level) for name, link in self.links.items()}

    def levels(self) -> dict[str, int]:
        return {name: link.level for name, link in self.links.items()}

    def restore(self, levels: Mapping[str, int]) -> None:
        """The levels of a checkpoint (``{name: level}``), for a resumed run."""
        for name, level in levels.items():
            if name in self.links:
                self.links[name].level = min(int(level), len(self.links[name].auto.ladder) - 1)

    def step(self, stages: Sequence[Mapping[str, float]], micro_batches: int, *, compressed: bool,
             fills: int = 1) -> dict[str, str]:
        """Take one step's per-stage statistics (the trainer's gathered rows: ``fw_raw``, ``fw_bytes``,
        ``fw_wire_bytes``, ``fw_busy_s``, the same for ``bw``, ``compute_s``, and what a stage's receivers saw
        held back, ``in_fw_held_s`` and ``in_bw_held_s``, and ``step_s``) and return the links whose spec
        changes, with their new spec. ``micro_batches``: in the whole step; ``fills``: pipeline passes per
        step. ``compressed``: whether the step sent the links' codecs (in the uncompressed warm-up only the
        throughput is learnt; the payload then follows from the raw bytes)."""
        self.steps += 1
        if self.steps == 1:  # one-time work (kernels built, buffers allocated): not a sample of the link
            return {}
        n = max(micro_batches, 1)
        self.fills = max(fills, 1)
        self.budget = _smooth(self.budget, max(float(s["compute_s"]) for s in stages) / n)
        self.step_s = _smooth(self.step_s, max(float(s["step_s"]) for s in stages))
        changes = {}
        for name, link in self.links.items():
            b = int(name[1:].split(".")[0])
            forward = link.auto.direction == "forward"
            st, d = (stages[b], "fw") if forward else (stages[b + 1], "bw")
            # what the receiving end saw held back: the stage after (forward) or before (backward)
            held = float(stages[b + 1]["in_fw_held_s"] if forward else stages[b]["in_bw_held_s"])
            busy = link_seconds(float(st[f"{d}_busy_s"]), held)
            wire, raw, sent = float(st[f"{d}_wire_bytes"]), float(st[f"{d}_raw"]), float(st[f"{d}_bytes"])
            if wire <= 0 or busy <= 0 or raw <= 0 or sent <= 0:
                continue
            bits = BITS[link.auto.ladder[link.level]]
            link.seconds_per_bit = _smooth(link.seconds_per_bit, busy / (8.0 * wire))
            link.fixed = _smooth(link.fixed, max(wire - sent, 0.0) / n)
            link.payload = _smooth(link.payload, (sent if compressed else raw * bits / 32.0) / n)
            new = self._choose(link, bits)
            if new != link.level:
                # the payload scales with the bits: what the new level will send, until it is measured
                link.payload *= BITS[link.auto.ladder[new]] / bits
                link.level, link.roomy = new, 0
                changes[name] = link.auto.spec(new)
        return changes

    def _choose(self, link: _Link, bits: float) -> int:
        def seconds(level: int) -> float:
            nbytes = link.fixed + link.payload * BITS[link.auto.ladder[level]] / bits  # type: ignore[operator]
            return 8.0 * nbytes * link.seconds_per_bit  # type: ignore[operator]

        levels = range(len(link.auto.ladder))
        budget = self.budget or 0.0
        share = TOLERANCE * (self.step_s or 0.0) / max(len(self.links), 1)
        floor = seconds(levels[-1])

        def fits(level: int, margin: float = 1.0) -> bool:
            return (seconds(level) <= margin * budget
                    and self.fills * (seconds(level) - floor) <= margin * share)

        if not fits(link.level):  # too slow now: the least compression that fits, or the floor
            return next((lv for lv in levels if fits(lv)), levels[-1])
        roomy = next((lv for lv in range(link.level) if fits(lv, UP_MARGIN)), None)
        link.roomy = link.roomy + 1 if roomy is not None else 0
        return roomy if roomy is not None and link.roomy >= PATIENCE else link.level

    def describe(self) -> dict[str, Any]:
        """What the policy knows of each link, for the metrics: its spec, throughput (Mbit/s) and level."""
        return {name: {"spec": link.auto.spec(link.level), "level": link.level,
                       "mbit_s": None if link.seconds_per_bit is None else 1e-6 / link.seconds_per_bit}
                for name, link in self.links.items()}


def _smooth(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
