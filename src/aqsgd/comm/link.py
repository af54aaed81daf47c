"""Link emulation: a bandwidth/latency spec and a pacer that models one directed link as a serial line.

Spec strings
------------
Bandwidth uses tc's decimal units: ``"500kbit"``, ``"100mbit"``, ``"1gbit"``, ``"2.5gbit"`` (1 kbit =
1000 bit/s; ``bit``, ``kbit``, ``mbit``, ``gbit``, ``tbit``, case-insensitive); ``"inf"`` (also
``"unlimited"``/``"none"``) means no limit. Latency: ``"10ms"``, ``"0.5s"``, ``"250us"``, ``"0"``.
:meth:`LinkSpec.parse` reads ``"100mbit"`` or ``"100mbit,10ms"``.

Pacing model
------------
A :class:`Pacer` models one directed link (this process -> one peer) as a serial line of bandwidth ``B``
followed by a propagation delay ``L``. A message of ``n`` wire bytes handed over at time ``now``

* starts when the line is free: ``start = max(now, line_free)``,
* occupies the line for ``tx = 8 n / B``: it has left the line at ``depart = start + tx`` (the next
  message may start then: ``line_free = depart``),
* arrives at the peer at ``arrive = depart + L``.

The transport's sender thread sleeps until ``depart`` (so the sustained rate never exceeds ``B``, and
back-to-back messages are spaced by their transmission times), and the receiver does not deliver a message
before ``arrive``. Latency therefore overlaps: while one message is "in flight" for ``L``, the following
ones are already on the line, so ``k`` small messages sent back to back take ``L + k tx``, not ``k L``.
All times of the pacer are in one clock (``time.monotonic`` by default); the transport converts the
arrival time to wall-clock time (``time.time``) before it crosses to another process, which is only
meaningful between processes that share a clock (one machine, or hosts synchronized far better than ``L``).
"""

from __future__ import annotations

import dataclasses
import math
import re
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

__all__ = ["LinkSchedule", "LinkSpec", "Pacer", "Transmission", "boundary_links", "parse_bandwidth",
           "parse_latency", "parse_links"]

_BANDWIDTH_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_LATENCY_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_UNLIMITED = {"inf", "unlimited", "none"}
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)(?:e([+-]?\d+))?"
_BANDWIDTH_RE = re.compile(_NUMBER + r"\s*(bit|kbit|mbit|gbit|tbit)")
_LATENCY_RE = re.compile(_NUMBER + r"\s*(s|ms|us)?")

BANDWIDTH_HELP = ('bandwidth: <number><bit|kbit|mbit|gbit|tbit> (e.g. "500kbit", "100mbit", "2.5gbit") or '
                  '"inf"')
LATENCY_HELP = 'latency: <number><s|ms|us> (e.g. "10ms", "0.5s", "250us") or "0"'


def _number(mantissa: str, exponent: str | None) -> float:
    return float(mantissa + (f"e{exponent}" if exponent else ""))


def parse_bandwidth(text: str | float | None) -> float | None:
    """Bits per second from a spec string (numbers are taken as bit/s); None means unlimited."""
    if text is None:
        return None
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        s = str(text).strip().lower()
        if s in _UNLIMITED:
            return None
        m = _BANDWIDTH_RE.fullmatch(s)
        if not m:
            raise ValueError(f"invalid bandwidth {text!r}; valid {BANDWIDTH_HELP}")
        value = _number(m.group(1), m.group(2)) * _BANDWIDTH_UNITS[m.group(3)]
        if math.isinf(value):
            raise ValueError(f"invalid bandwidth {text!r}: out of range; valid {BANDWIDTH_HELP}")
    if math.isinf(value) and value > 0:
        return None
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"invalid bandwidth {text!r}: must be positive; valid {BANDWIDTH_HELP}")
    return value


def parse_latency(text: str | float) -> float:
    """Seconds from a spec string (a bare number, or a number of seconds)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        s = str(text).strip().lower()
        m = _LATENCY_RE.fullmatch(s)
        if not m or (m.group(3) is None and _number(m.group(1), m.group(2)) != 0):
            raise ValueError(f"invalid latency {text!r}; valid {LATENCY_HELP}")
        value = _number(m.group(1), m.group(2)) * _LATENCY_UNITS[m.group(3) or "s"]
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"invalid latency {text!r}: must be finite and >= 0; valid {LATENCY_HELP}")
    return value


@dataclasses.dataclass(frozen=True)
class LinkSpec:
    """One directed link: ``bandwidth_bps`` in bit/s (None = unlimited) and one-way ``latency_s``."""

    bandwidth_bps: float | None = None
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if self.bandwidth_bps is not None and not (
            self.bandwidth_bps > 0 and math.isfinite(self.bandwidth_bps)
        ):
            raise ValueError(f"bandwidth_bps must be positive and finite or None, got {self.bandwidth_bps}")
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"latency_s must be finite and >= 0, got {self.latency_s}")

    @classmethod
    def parse(cls, text: str) -> LinkSpec:
        """``"100mbit"``, ``"100mbit,10ms"``, ``"inf,20ms"``."""
        parts = [p.strip() for p in str(text).split(",")]
        if len(parts) > 2 or not parts[0]:
            raise ValueError(
                f"invalid link spec {text!r}; valid: <bandwidth>[,<latency>] with {BANDWIDTH_HELP}; "
                f"{LATENCY_HELP}"
            )
        return cls(parse_bandwidth(parts[0]), parse_latency(parts[1]) if len(parts) == 2 else 0.0)

    @property
    def unlimited(self) -> bool:
        """True when the link adds no delay at all (no bandwidth limit, no latency)."""
        return self.bandwidth_bps is None and self.latency_s == 0.0

    def tx_time(self, nbytes: int) -> float:
        """Seconds a message of ``nbytes`` occupies the line."""
        return 0.0 if self.bandwidth_bps is None else 8.0 * nbytes / self.bandwidth_bps

    def __str__(self) -> str:
        bw = "inf" if self.bandwidth_bps is None else f"{self.bandwidth_bps / 1e6:g}mbit"
        return f"{bw},{self.latency_s * 1e3:g}ms"


@dataclasses.dataclass(frozen=True)
class LinkSchedule:
    """One boundary's link over a run: ``initial`` from the first step, then each ``(step, spec)`` of
    ``changes`` from that (1-based) optimizer step on, in increasing order of steps.

    Written ``SPEC[~SPEC@STEP]...``: ``"200mbit~20mbit@50~200mbit@80"`` is 200 Mbit/s, 20 Mbit/s from step 50
    on, 200 Mbit/s again from step 80 on (each ``SPEC`` as :meth:`LinkSpec.parse` reads it, latency included:
    ``"1gbit,5ms~50mbit,40ms@10"``)."""

    initial: LinkSpec
    changes: tuple[tuple[int, LinkSpec], ...] = ()

    @classmethod
    def parse(cls, text: str) -> LinkSchedule:
        first, *rest = str(text).split("~")
        changes: list[tuple[int, LinkSpec]] = []
        for part in rest:
            spec, at, step = part.rpartition("@")
            if not at or not step.strip().isdigit() or int(step) < 2:
                raise ValueError(f"invalid link change {part!r} in {text!r}: write ~SPEC@STEP with STEP the "
                                 "optimizer step (2 or more) from which SPEC holds, e.g. 200mbit~20mbit@50")
            if changes and int(step) <= changes[-1][0]:
                raise ValueError(f"invalid link schedule {text!r}: the steps of its changes must increase")
            changes.append((int(step), LinkSpec.parse(spec)))
        return cls(LinkSpec.parse(first), tuple(changes))

    def at(self, step: int) -> LinkSpec:
        """The setting in force at (1-based) optimizer step ``step``."""
        spec = self.initial
        for start, change in self.changes:
            if step >= start:
                spec = change
        return spec

    @property
    def varies(self) -> bool:
        return bool(self.changes)

    def __str__(self) -> str:
        return "~".join([str(self.initial)] + [f"{spec}@{step}" for step, spec in self.changes])


def parse_links(text: str, boundaries: int) -> list[LinkSchedule]:
    """One :class:`LinkSchedule` per stage boundary from ``--link``: one setting for all of them
    (``"100mbit,5ms"``), or one per boundary separated by ``/`` (``"1gbit/50mbit,20ms/200mbit"``: boundary 0
    is the link between stages 0 and 1, and so on). Both directions of a boundary share its setting. Any
    setting may change during the run (``"1gbit/200mbit~20mbit@50/1gbit"``, see :class:`LinkSchedule`)."""
    parts = [p.strip() for p in str(text).split("/")]
    specs = [LinkSchedule.parse(p) for p in parts]
    if len(specs) == 1:
        return specs * boundaries
    if len(specs) != boundaries:
        raise ValueError(f"{len(specs)} link settings for {boundaries} stage boundar"
                         f"{'y' if boundaries == 1 else 'ies'}: give one for all, or one per boundary "
                         "separated by /")
    return specs


def boundary_links(specs: list[LinkSchedule], stage: int, rank_of_stage: Callable[[int], int]
                   ) -> dict[int, LinkSchedule]:
    """The links of the process running ``stage``, by the rank at their other end: boundary ``stage - 1``
    to the stage before, boundary ``stage`` to the stage after."""
    out = {}
    if stage > 0:
        out[rank_of_stage(stage - 1)] = specs[stage - 1]
    if stage < len(specs):
        out[rank_of_stage(stage + 1)] = specs[stage]
    return out


class Transmission(NamedTuple):
    """A message's schedule on a link, in the pacer's clock."""

    start: float  # it starts to occupy the line
    depart: float  # it has left the line (the sender may go on)
    arrive: float  # the peer may deliver it


class Pacer:
    """Schedules messages on one directed link (thread-safe). See the module docstring for the model."""

    def __init__(self, spec: LinkSpec, clock: Callable[[], float] = time.monotonic) -> None:
        self.spec = spec
        self.clock = clock
        self._line_free = -math.inf
        self._lock = threading.Lock()

    def schedule(self, nbytes: int, now: float | None = None) -> Transmission:
        """Reserve the line for a message of ``nbytes`` handed over at ``now`` (default: the clock)."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        with self._lock:
            t = self.clock() if now is None else now
            start = max(t, self._line_free)
            depart = start + self.spec.tx_time(nbytes)
            self._line_free = depart
            return Transmission(start, depart, depart + self.spec.latency_s)

    def retune(self, spec: LinkSpec) -> None:
        """From the next message on, the line has ``spec`` (a message already on it keeps its schedule)."""
        with self._lock:
            self.spec = spec

    def reset(self) -> None:
        """Forget the line's backlog (the next message starts at once)."""
        with self._lock:
            self._line_free = -math.inf
