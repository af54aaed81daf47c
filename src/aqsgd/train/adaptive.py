"""Bits chosen per link: ``--forward auto`` / ``--backward auto`` pick, for every boundary and direction, the
least compression that keeps the link's time per micro-batch within the pipeline's compute time per
micro-batch, from the links as they are measured while training.

The ladders (one scheme per direction, so a change of bits never invalidates state: AQ-SGD's caches hold
activations, not codes):

* activations, AQ-SGD (``delta``): fp16 -> q8 -> q6 -> q4 -> q3 -> q2:l2. Each bit fewer about doubles the
  error, so a rung two bits down errs about 4x: q6 is the rung for a link whose q4 is over the error budget
  (below) and whose q8 is more than it needs. Without it, the 50 Mbit/s link of ``aqsgd bench adaptive``'s
  ``uneven`` sent q8 for 40 steps after the warm-up (q4 erred by 11-13 %, over the budget's margin; q6 errs
  about a quarter of that), and the fast links q8 where q6 was within half the budget;
* activation gradients, ``direct``: bf16 -> q8 -> q6 -> q4. Not fp16: activation gradients have no bound
  that fp16's range (65504) respects. In a 4-block Llama of width 256 (``aqsgd bench adaptive``) they grew
  about 100x per stage going backward and reached 3e4 in fp32 training, 1.6e5 in a run that sent them as fp16,
  which then stopped at step 79 when the cast overflowed; bf16 has fp32's range, the quantized rungs a scale
  per group.

``auto:q3`` stops the ladder at q3 (the quality floor: never fewer bits than that), and ``auto:err=E`` sets
the error budget (below; default :data:`MAX_ERROR`, ``err=none`` for none); both: ``auto:q3:err=0.05``.

**The error budget.** Fewer bits cost progress per step, which seconds alone do not show (in ``aqsgd bench
adaptive`` a fixed q3 stepped 3 % faster than q4 and reached the target loss 34 % later). So every auto
link's sender probes, on the first micro-batch of every :data:`PROBE_EVERY`-th step, what each rung of its
ladder would make of the tensor it sends (:meth:`~aqsgd.schemes.base.BoundaryScheme.set_probe`; an encode
and a decode per rung, 1.9 ms per activation link of a 0.4 s step in ``aqsgd bench adaptive``, run where the
stage would wait anyway: the message is recorded when it is sent and measured before a receive whose message
has not arrived, else at the step's end, :meth:`~aqsgd.pipeline.runner.StageRunner.run`): the relative error
``||x - x_hat|| / ||x||`` of the tensor the receiver would compute with (for AQ-SGD ``x_hat = m + C(x - m)``,
so the error is the delta's, which shrinks as training settles; in the warm-up, where nothing is cached yet,
the activation's own: what the warm-up sends, below). A level whose error is over the budget is never chosen:
the link's floor is the level before the first rung over it. The error is the median of the last
:data:`ERROR_WINDOW` steps' probes, not a mean: one batch can make an error that says nothing of the next
(in ``aqsgd bench adaptive`` three of 120 batches had one sample whose gradient set every channel's scale and
zeroed the other samples', probed at 87 % for every quantized rung; an exponential mean sent the gradient
links back to bf16 for the 12-15 steps it took to forget it, 0.6 s of a 0.4 s step each on the 20 Mbit/s
link), while an error that stays is followed after ``ERROR_WINDOW // 2 + 1`` probes. While fewer than
:data:`ERROR_WINDOW` probes are in (a run's first steps), an even count takes the lower of its two middle
probes, not their mean: in the 4-stage ``uneven`` run of ``aqsgd bench adaptive`` two of the spikes above
were the probes of steps 13 and 17, the window then held four (steps 5-17: step 1's probe was dropped with
its timing), and the mean of a spike and a plain probe (61 %) sent the gradient links back to bf16 for 4
steps (0.06 s a step). The run's first step, left out of the link's timing (one-time work), now gives its
probe. Going to more compression than now needs the rung's
error under :data:`ERROR_MARGIN` times the budget, so that a rung near the budget does not flap; going back
up when the error rises takes no patience beyond the median's. Before anything is probed the time rule alone
applies.

The rule, after every step, for each link (boundary and direction), with ``t(L)`` the time one micro-batch's
tensor takes on the link at level ``L``::

    t(L) = per_message + 8 * (fixed + payload * bits(L) / bits(current)) / throughput
    budget = max over stages of compute seconds per micro-batch

``payload`` is what the current codec sent per micro-batch, ``fixed`` what the wire carried besides it
(preambles, headers: it does not shrink with the bits), ``throughput`` the link's wire bits per busy second
(:class:`~aqsgd.comm.transport.LinkStats`), the link busy for the longer of what its sender and its receiver
saw (:func:`link_seconds`); these and the budget are exponential means over steps
(:data:`SMOOTHING`). The throughput is averaged as its inverse, seconds per bit (the quantity ``t(L)`` is
linear in): a link that becomes 100 times slower weighs at once (one slow step makes the mean at least
``SMOOTHING`` times the slow one's), while a link that becomes faster is believed over a few steps.

``per_message`` is what each message costs whatever its size (a message waiting for a core on a loaded host,
a real link's round trip): taken as bandwidth it would make a fast link look slow, and compress it where fewer
bits save nothing. It is told apart by a least-squares fit of a message's busy seconds on its wire bits over
exponential means (weight :data:`REGRESSION_SMOOTHING`) of ``1, x, y, x^2, xy``, once the sizes have varied
(:data:`SIZE_SPREAD`: the ladder's top at the first step, then the first choice, every change of level); until
then it is 0 (or the last value told apart), and the throughput is what is left of the busy time besides it.
A step more than 2x off what the link's model predicts for its size restarts the fit (a link that became
slower while its messages became smaller would read as a cost per message). Where no level fits, the least
compressed level within 5 % of the fastest one's time is taken: the floor, unless per-message costs make the
levels' times alike.

A link that keeps up with the compute still costs time: the first micro-batch of every pipeline pass crosses
every boundary before the last stage can start, and the last one's gradients cross them all again, so each
link's ``t(L)`` is on the step's critical path once per pass whatever the overlap (the pipeline's fill and
drain). A level *fits* when both hold (``floor``: the link's floor, the error budget's)::

    t(L) <= budget
    fills * (t(L) - t(floor)) <= TOLERANCE * step / links

with ``fills`` the pipeline passes per step (gradient accumulation), ``step`` the measured step time and
``links`` the number of auto links: together the links spend at most :data:`TOLERANCE` of the step on carrying
more bits than their floors. (Without the second rule, measured by ``aqsgd bench adaptive`` on the CPU, auto
kept 8-16 bits where the link allowed it and reached the target loss 1.08-1.14x later than the best fixed
rung.) The levels that may fit run from the floor up to the link's *ceiling* only: the most compressed level
whose error is within :data:`QUIET` times the budget (level 0 while nothing is probed or there is no
budget; becoming a ceiling more compressed than the current level takes ``ERROR_MARGIN`` times that, as for
the floor). Bits above the floor buy a smaller error, which is worth time only while the error is a good part
of the budget: in ``aqsgd bench adaptive`` the tolerance kept the 1 Gbit/s link's gradients at bf16 (error
0.2 %) where q8 errs by 1-2 % and the floor, q6, by 5-9 %; their ceiling is q8. A floor whose own error is
under ``QUIET`` times the budget is its ceiling: the link takes it however fast it is.

The level goes at once to the least compressed ``L`` that fits when the current one no longer fits or is
over the error budget (the floor if none fits), and back up to less compression only after :data:`PATIENCE`
steps in a row in which a level fits with margin, both rules with their right-hand sides times ``UP_MARGIN``
(hysteresis: a link near the edge, or a noisy measurement, does not make it flip every step).

**The warm-up sends the level too.** An auto link's schemes send the warm-up epochs (and AQ-SGD's first visit
of a sample) with the link's codec instead of in full
(:meth:`~aqsgd.schemes.base.BoundaryScheme.compress_warmup`): the same rule chooses it, from the activation's
own probed error. AQ-SGD caches what the first visit decodes to, and its next visit sends ``x - m``, the first
visit's error with the change, so the cache converges as from an exact start. In ``aqsgd bench adaptive``'s
``uneven`` the full-precision warm-up took 16 of 120 steps at 0.66 s, against 0.33 s after it: a third of the
time to the target loss, while the rule had chosen q6 and q8 for those steps from their first probes.

Not every step is a sample of the links: the first step of a run, or of a resumed one, does one-time work
(kernels built, buffers allocated) and gives its error probes and nothing else. The trainer
keeps the other steps comparable: after an evaluation or a checkpoint every process waits for the others
(:meth:`~aqsgd.train.trainer.Trainer._resync`), as after every step's metrics all-reduce. Without that, in
``aqsgd bench adaptive`` every step after an evaluation measured the 1 Gbit/s link at 2.5-50 Mbit/s (a stage
that left the evaluation first sent while its receiver was still evaluating), and its activations went a rung
or two down each time, then back up over the next steps.

Every input is a sum all-reduced over the run's processes (the trainer's per-step statistics), so every
process computes the same levels at the same step, and the sender and the receiver of a link switch together
at a step boundary, before the next step's first packet.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Mapping
from typing import Any, Protocol

__all__ = ["BITS", "LADDERS", "AutoSpec", "LinkPolicy", "LinkRule", "LinkSample", "RuleFactory", "StepSample",
           "is_auto", "link_name", "link_seconds", "parse_auto", "parse_link"]

LADDERS: dict[str, tuple[str, ...]] = {
    "forward": ("fp16", "q8", "q6", "q4", "q3", "q2:l2"),
    "backward": ("bf16", "q8", "q6", "q4"),
}
# the ladders of checkpoints that saved each link's level as an index (before the activations' q6 rung):
# written out, not derived from LADDERS: they must keep what those checkpoints meant if LADDERS changes
LADDERS_BEFORE_Q6: dict[str, tuple[str, ...]] = {
    "forward": ("fp16", "q8", "q4", "q3", "q2:l2"),
    "backward": ("bf16", "q8", "q6", "q4"),
}
SCHEMES = {"forward": "delta", "backward": "direct"}
BITS = {"fp16": 16.0, "bf16": 16.0, "q8": 8.0, "q6": 6.0, "q4": 4.0, "q3": 3.0, "q2:l2": 2.0}
UP_MARGIN = 0.7
MAX_ERROR = 0.1  # the default error budget: a level's relative error at most this
ERROR_MARGIN = 0.8  # a more compressed level is taken only with its error this far under the budget
QUIET = 0.5  # an error under this share of the budget is not worth time to lower further
ERROR_WINDOW = 5  # a rung's error is the median of this many probes
PROBE_EVERY = 4  # steps from one probe to the next (the first step probes)
TOLERANCE = 0.05  # the share of the step that all auto links together may spend above their floors
PATIENCE = 3  # steps in a row that must leave room before a link takes fewer compression
SMOOTHING = 0.3  # weight of the newest step in the exponential means
REGRESSION_SMOOTHING = 0.1  # ... in the per-message regression's, which needs the sizes of several levels
SIZE_SPREAD = 0.1  # the relative spread of message sizes below which the regression is not trusted


def link_seconds(sent_busy_s: float, held_back_s: float) -> float:
    """The seconds a link was busy in a step: the sender's view (from each message's hand-over to its send's
    completion) or the receiver's (the spacing of the messages the link held back), whichever is longer. On an
    emulated link they agree; on a real one a send completes once the kernel has taken the bytes, so a slow
    link whose backlog fits the socket buffers only shows at the receiver, where its messages arrive spaced
    by their time on the line."""
    return max(sent_busy_s, held_back_s)


def link_name(boundary: int, direction: str) -> str:
    """A link's name: boundary ``b`` (between stages ``b`` and ``b + 1``) and direction, ``b0.forward``."""
    return f"b{boundary}.{direction}"


def parse_link(name: str) -> tuple[int, str, int]:
    """``b1.backward`` -> the boundary, the direction and the stage that sends on it (``b`` forward,
    ``b + 1`` backward)."""
    b, direction = name[1:].split(".")
    return int(b), direction, int(b) + (direction == "backward")


@dataclasses.dataclass(frozen=True)
class LinkSample:
    """What one link (a boundary's direction) carried in a step, summed over the run's processes: the fp32
    bytes of its tensors (``raw``), the codec's bytes (``sent``), the bytes on the wire (``wire``), the
    seconds its sender saw it busy and those its receiver saw its messages held back (:func:`link_seconds`),
    and its sender's error probe: each rung's summed squared relative error (``err2``) over ``probed``
    samples (``probed`` 0: nothing was probed)."""

    raw: float = 0.0
    sent: float = 0.0
    wire: float = 0.0
    busy_s: float = 0.0
    held_s: float = 0.0
    err2: tuple[float, ...] = ()
    probed: float = 0.0

    @property
    def seconds(self) -> float:
        """The seconds the link was busy in the step (:func:`link_seconds`)."""
        return link_seconds(self.busy_s, self.held_s)


@dataclasses.dataclass(frozen=True)
class StepSample:
    """One step as a link rule sees it: every link's :class:`LinkSample` by name (``b0.forward``), the
    slowest stage's compute seconds and the step's seconds (the longest any stage measured)."""

    links: Mapping[str, LinkSample]
    compute_s: float
    step_s: float


class LinkRule(Protocol):
    """What chooses the codecs of a run's auto links from what they measured (:class:`LinkPolicy` is the
    rule of ``--forward auto`` / ``--backward auto``). Every process holds one and feeds it the same samples,
    so all make the same choices at the same step; another rule is one class with these methods, given to
    the trainer as a :data:`RuleFactory`."""

    def specs(self) -> dict[str, str]:
        """Every link's current spec, by name."""
        ...

    def step(self, sample: StepSample, micro_batches: int, *, fills: int = 1) -> dict[str, str]:
        """Take a step's sample; return the links whose spec changes from the next step on, with it."""
        ...

    def probes(self) -> dict[str, tuple[str, ...]]:
        """The codecs each link's sender probes the error of, by link name (none: no probe)."""
        ...

    def probes_at(self, step: int) -> bool:
        """Whether the senders probe at ``step`` (counted from 1)."""
        ...

    def restore(self, levels: Mapping[str, str | int]) -> None:
        """The links' specs of a checkpoint (:meth:`specs`), for a resumed run."""
        ...

    def state(self) -> dict[str, Any]:
        """What the rule measured (JSON), for a checkpoint."""
        ...

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state`."""
        ...

    def describe(self) -> dict[str, Any]:
        """What the rule knows of each link, for the run's summary."""
        ...

    def overview(self) -> dict[str, Any]:
        """The rule's inputs after a step, for that step's metrics row."""
        ...


RuleFactory = Callable[[int, "AutoSpec | None", "AutoSpec | None"], LinkRule]
"""Builds a run's :class:`LinkRule` from its number of boundaries and the ``auto`` spec of each direction
(None: that direction is fixed); :class:`LinkPolicy` is one."""


def is_auto(spec: str) -> bool:
    return spec == "auto" or spec.startswith("auto:")


@dataclasses.dataclass(frozen=True)
class AutoSpec:
    """One direction's ladder and error budget, from ``auto[:FLOOR][:err=E]``."""

    direction: str
    ladder: tuple[str, ...]
    max_error: float | None = MAX_ERROR  # the largest relative error a level may make (None: no budget)

    @property
    def scheme(self) -> str:
        return SCHEMES[self.direction]

    def spec(self, level: int) -> str:
        """The ``--forward``/``--backward`` spec of ``level``."""
        return f"{self.scheme}:{self.ladder[level]}"


def parse_auto(text: str, direction: str) -> AutoSpec:
    """``auto``, ``auto:FLOOR`` (FLOOR one of the direction's ladder), either followed by ``:err=E`` (the
    error budget, a relative error in (0, 1), or ``none``); ValueError naming the bad part."""
    ladder = LADDERS[direction]
    rest, sep, err = text.partition(":err=")
    max_error: float | None = MAX_ERROR
    if sep:
        if err == "none":
            max_error = None
        else:
            try:
                max_error = float(err)
            except ValueError:
                max_error = math.nan
            if not 0 < max_error < 1:
                raise ValueError(f"{text}: err= takes a relative error in (0, 1), such as 0.1, or none; "
                                 f"got {err!r}")
    head, _, floor = rest.partition(":")
    if head != "auto":
        raise ValueError(f"{text}: expected auto, auto:FLOOR or either with :err=E")
    if not floor:
        return AutoSpec(direction, ladder, max_error)
    if floor not in ladder:
        raise ValueError(f"auto:{floor}: the floor must be one of the {direction} ladder "
                         f"{', '.join(ladder)}")
    return AutoSpec(direction, ladder[: ladder.index(floor) + 1], max_error)


@dataclasses.dataclass
class _Link:
    auto: AutoSpec
    level: int = 0
    seconds_per_bit: float | None = None  # busy seconds per wire bit (the inverse of the throughput)
    fixed: float | None = None  # wire bytes per micro-batch besides the codec's payload
    payload: float | None = None  # the codec's bytes per micro-batch at the current level
    roomy: int = 0  # steps in a row in which a less compressed level fitted with margin
    # exponential means over steps of 1, x, y, x^2, xy with x a message's wire bits and y its busy seconds:
    # the regression y = per_message + x * seconds_per_bit that tells a per-message cost from bandwidth
    moments: list[float] | None = None
    per_message: float = 0.0  # seconds each message costs whatever its size, as last told apart
    # the last ERROR_WINDOW probes, oldest first: each rung's mean squared relative error over the samples
    errors: list[list[float]] = dataclasses.field(default_factory=list)

    def error(self, level: int) -> float | None:
        """The relative error ``||x - x_hat|| / ||x||`` the rung ``level`` makes on this link, as probed (the
        root mean square over the samples of each one's own; the median of the last probes, the lower middle
        one of an even count: two lone batches' spikes among four probes are still ignored)."""
        if not self.errors:
            return None
        return math.sqrt(statistics.median_low(e[level] for e in self.errors))

    def floor(self) -> int:
        """The most compressed level within the error budget: the one before the first rung whose error is
        over it (taking more compression than the current level needs its error under ``ERROR_MARGIN`` times
        the budget). The ladder's last level while nothing is probed or there is no budget."""
        budget = self.auto.max_error
        last = len(self.auto.ladder) - 1
        if budget is None or not self.errors:
            return last
        for level in range(1, last + 1):
            err = self.error(level)
            if err is not None and err > budget * (1.0 if level <= self.level else ERROR_MARGIN):
                return level - 1
        return last

    def ceiling(self, floor: int) -> int:
        """The least compressed level worth time above the ``floor`` (:meth:`floor`): the most compressed one,
        the floor at most, whose error is within ``QUIET`` times the budget (``ERROR_MARGIN`` under that for a
        level more compressed than the current one, as for the floor). Level 0 while nothing is probed or
        there is no budget."""
        budget = self.auto.max_error
        if budget is None or not self.errors:
            return 0
        for level in range(floor, 0, -1):
            err = self.error(level)
            if err is not None and err <= QUIET * budget * (1.0 if level <= self.level else ERROR_MARGIN):
                return level
        return 0


class LinkPolicy:
    """The levels of every link of a run (``boundaries`` stage boundaries, the directions given as
    :class:`AutoSpec`), updated by :meth:`step` from one step's statistics."""

    def __init__(self, boundaries: int, forward: AutoSpec | None, backward: AutoSpec | None) -> None:
        self.links: dict[str, _Link] = {}
        self.budget: float | None = None  # compute seconds per micro-batch of the slowest stage
        self.step_s: float | None = None  # the step time
        self.fills = 1  # pipeline passes per step
        self.steps = 0
        self.timing = False  # whether step() takes the steps' times: not this process's first (one-time work)
        for b in range(boundaries):
            for auto in (forward, backward):
                if auto is not None:
                    self.links[link_name(b, auto.direction)] = _Link(auto)

    def specs(self) -> dict[str, str]:
        """Every link's current spec, by name (``b0.forward``)."""
        return {name: link.auto.spec(link.level) for name, link in self.links.items()}

    _STATE = ("seconds_per_bit", "fixed", "payload", "roomy", "moments", "per_message", "errors")

    def state(self) -> dict[str, Any]:
        """What the policy has measured (JSON), for a checkpoint: a resumed run continues from it instead of
        learning its links again."""
        links = {name: {k: getattr(link, k) for k in self._STATE} for name, link in self.links.items()}
        return {"budget": self.budget, "step_s": self.step_s, "steps": self.steps, "links": links}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state`; links this run does not have are skipped, and errors of another ladder."""
        self.budget, self.step_s, self.steps = state["budget"], state["step_s"], int(state["steps"])
        for name, saved in state["links"].items():
            link = self.links.get(name)
            if link is None:
                continue
            for k in self._STATE:
                if k in saved:
                    setattr(link, k, saved[k])
            if "errors" not in saved and saved.get("err2") and saved.get("samples"):  # an older checkpoint:
                link.errors = [[e / saved["samples"] for e in saved["err2"]]]  # the probes' exponential means
            if any(len(e) != len(link.auto.ladder) for e in link.errors):
                link.errors = []

    def restore(self, levels: Mapping[str, str | int]) -> None:
        """The levels of a checkpoint, for a resumed run: ``{name: spec}`` (:meth:`specs`), or, from a
        checkpoint written before the activations' ladder had q6, ``{name: level}`` with the level an index
        into :data:`LADDERS_BEFORE_Q6`. A rung past the ladder's floor (a resume with ``auto:FLOOR``) is the
        floor."""
        for name, saved in levels.items():
            link = self.links.get(name)
            if link is None:
                continue
            ladder = link.auto.ladder
            if isinstance(saved, str):
                rung = saved.split(":", 1)[1]
            else:
                old = LADDERS_BEFORE_Q6[link.auto.direction]
                rung = old[min(int(saved), len(old) - 1)]
            link.level = ladder.index(rung) if rung in ladder else len(ladder) - 1

    def step(self, sample: StepSample, micro_batches: int, *, fills: int = 1) -> dict[str, str]:
        """Take one step's :class:`StepSample` and return the links whose spec changes, with their new
        spec. ``micro_batches``: in the whole step; ``fills``: pipeline passes per
        step. Every message of an auto link is sent with its level's codec, in the warm-up too
        (:meth:`~aqsgd.schemes.base.BoundaryScheme.compress_warmup`), so the codec bytes are the level's
        payload. The first step of a policy (of a run, or of a resumed one after :meth:`load_state`) gives its
        probes and nothing else: see the module's docstring."""
        self.steps += 1
        if not self.timing:  # one-time work (kernels built, buffers allocated): not a sample of the links,
            self.timing = True
            for name, link in self.links.items():  # but its probe counts
                self._probed(link, sample.links.get(name, _NOTHING))
            return {}
        n = max(micro_batches, 1)
        self.fills = max(fills, 1)
        self.budget = _smooth(self.budget, sample.compute_s / n)
        self.step_s = _smooth(self.step_s, sample.step_s)
        changes = {}
        for name, link in self.links.items():
            seen = sample.links.get(name, _NOTHING)
            busy, wire, raw, sent = seen.seconds, seen.wire, seen.raw, seen.sent
            if wire <= 0 or busy <= 0 or raw <= 0 or sent <= 0:
                continue
            bits = BITS[link.auto.ladder[link.level]]
            before = link.per_message
            _regress(link, 8.0 * wire / n, busy / n)
            if abs(link.per_message - before) > 0.1 * busy / n:  # newly told apart: the mean of seconds
                link.seconds_per_bit = None  # per bit held it, and restarts from this step
            # the seconds per bit besides the messages' per-message cost (all of it while that is unknown)
            bandwidth_s = max(busy - n * link.per_message, 0.0) or busy
            link.seconds_per_bit = _smooth(link.seconds_per_bit, bandwidth_s / (8.0 * wire))
            link.fixed = _smooth(link.fixed, max(wire - sent, 0.0) / n)
            link.payload = _smooth(link.payload, sent / n)
            self._probed(link, seen)
            new = self._choose(link)
            if new != link.level:
                # the payload scales with the bits: what the new level will send, until it is measured
                link.payload *= BITS[link.auto.ladder[new]] / bits
                link.level, link.roomy = new, 0
                changes[name] = link.auto.spec(new)
        return changes

    @staticmethod
    def _probed(link: _Link, seen: LinkSample) -> None:
        """Take the step's error probe of the link's sender, if it made one."""
        if seen.probed <= 0:
            return
        link.errors = [*link.errors, [e / seen.probed for e in seen.err2[: len(link.auto.ladder)]]]
        del link.errors[:-ERROR_WINDOW]

    @staticmethod
    def _seconds(link: _Link, level: int) -> float:
        """``t(L)``: the seconds one micro-batch's tensor takes on the link at ``level``, as measured."""
        ratio = BITS[link.auto.ladder[level]] / BITS[link.auto.ladder[link.level]]
        nbytes = link.fixed + link.payload * ratio  # type: ignore[operator]
        return link.per_message + 8.0 * nbytes * link.seconds_per_bit  # type: ignore[operator]

    def _share(self) -> float:
        """The seconds of the step each link may spend above its floor."""
        return TOLERANCE * (self.step_s or 0.0) / max(len(self.links), 1)

    def _choose(self, link: _Link) -> int:
        def seconds(level: int) -> float:
            return self._seconds(link, level)

        # the rungs within the error budget, down to the first whose error is too small to be worth lowering
        lowest = link.floor()
        levels = range(link.ceiling(lowest), lowest + 1)
        budget = self.budget or 0.0
        share = self._share()
        floor = seconds(levels[-1])

        def fits(level: int, margin: float = 1.0) -> bool:
            return (seconds(level) <= margin * budget
                    and self.fills * (seconds(level) - floor) <= margin * share)

        if link.level not in levels or not fits(link.level):  # too slow or too coarse now: the least
            # compression that fits, or, if none does, the least compression within 5 % of the fastest
            # level's time (the floor, unless a per-message cost makes fewer bits save next to nothing)
            fastest = min(seconds(lv) for lv in levels)
            return next((lv for lv in levels if fits(lv)),
                        next(lv for lv in levels if seconds(lv) <= 1.05 * fastest))
        roomy = next((lv for lv in range(levels[0], link.level) if fits(lv, UP_MARGIN)), None)
        link.roomy = link.roomy + 1 if roomy is not None else 0
        return roomy if roomy is not None and link.roomy >= PATIENCE else link.level

    def describe(self) -> dict[str, Any]:
        """What the policy knows of each link, for the metrics: its spec and level, throughput (Mbit/s,
        besides the per-message cost), per-message cost (ms), the level's relative error, the error budget's
        floor, the ceiling and every rung's ``t(L)`` (ms; None until the link is measured)."""
        return {name: {"spec": link.auto.spec(link.level), "level": link.level,
                       "mbit_s": None if link.seconds_per_bit is None else 1e-6 / link.seconds_per_bit,
                       "per_message_ms": 1e3 * link.per_message, "error": link.error(link.level),
                       "floor": link.auto.ladder[link.floor()],
                       "ceiling": link.auto.ladder[link.ceiling(link.floor())],
                       # t(L) of every rung, as the rule saw it after this step
                       "ms": ({r: 1e3 * self._seconds(link, lv) for lv, r in enumerate(link.auto.ladder)}
                              if link.seconds_per_bit is not None and link.payload is not None else None)}
                for name, link in self.links.items()}

    def overview(self) -> dict[str, Any]:
        """The rule's inputs after a step, for each step's metrics row: the compute budget per micro-batch,
        the share of the step each link may spend above its floor (both ms) and :meth:`describe`."""
        return {"budget_ms": None if self.budget is None else 1e3 * self.budget,
                "share_ms": 1e3 * self._share(),
                "links": self.describe()}

    def probes_at(self, step: int) -> bool:
        """Whether the links' senders probe at ``step`` (counted from 1): every :data:`PROBE_EVERY`-th, and
        the first step this policy takes (a resumed run's, whatever its number), so that its probes are in
        before its first choice: a checkpoint's errors of another ladder (one written before the activations'
        q6 rung) are dropped, and the first step makes no choice but gives its probes."""
        return (step - 1) % PROBE_EVERY == 0 or not self.timing

    def probes(self) -> dict[str, tuple[str, ...]]:
        """The codecs each link's sender probes (its whole ladder), by link name."""
        return {name: link.auto.ladder for name, link in self.links.items()}


_NOTHING = LinkSample()  # a link no process reported on in a step


def _regress(link: _Link, x: float, y: float) -> None:
    """Add one step's message (``x`` wire bits, ``y`` busy seconds: per message, means over the step) to the
    link's regression, and tell its per-message cost apart when the messages' sizes have varied enough."""
    sample = (1.0, x, y, x * x, x * y)
    if link.seconds_per_bit is not None:  # a link that changed (2x off what it was) starts a new regression:
        expected = link.per_message + x * link.seconds_per_bit  # sizes from before and times from after
        if not expected / 2 <= y <= 2 * expected:  # would read as a cost of size (or of none)
            link.moments = None
    old = link.moments or sample
    link.moments = [(1 - REGRESSION_SMOOTHING) * o + REGRESSION_SMOOTHING * v for o, v in zip(old, sample)]
    w, sx, sy, sxx, sxy = link.moments
    mx, my = sx / w, sy / w
    var = sxx / w - mx * mx
    if var <= (SIZE_SPREAD * mx) ** 2:  # sizes too alike: keep what was told apart before
        return
    slope = (sxy / w - mx * my) / var
    link.per_message = min(max(my - slope * mx, 0.0), my)


def _smooth(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
