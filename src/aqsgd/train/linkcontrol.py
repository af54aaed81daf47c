"""The run's links as one component: their emulated settings over the steps, what they carried, and the codecs
the bits-per-link rule chooses for them.

A :class:`LinkController` owns everything of a run that concerns its links between stages:

* ``--link`` (:mod:`aqsgd.comm.link`): each boundary's emulated link, parsed once; a schedule that changes
  during the run is applied at the step boundaries (both ends of a link read the same schedule, so they
  change together, before the step's first packet);
* what this process's links carried since the last step (:meth:`measure`: wire bytes, busy seconds, seconds
  held back, from the transport's :class:`~aqsgd.comm.transport.LinkStats`) and its senders' error probes;
* with ``--forward auto`` / ``--backward auto``, the :class:`~aqsgd.train.adaptive.LinkRule` (the default
  :class:`~aqsgd.train.adaptive.LinkPolicy`, or one a caller gives): it is fed every step's gathered
  statistics (:meth:`after_step`, the same on every process, so every process makes the same choice), and
  its choices are applied to the engine's schemes through the one way a runner exposes
  (:meth:`~aqsgd.pipeline.runner.StageRunner.set_link`);
* its part of each metrics row, of the checkpoint (the links' levels and what the rule measured) and of the
  run's summary.

The trainer calls its hooks: :meth:`attach` once the engine exists, :meth:`before_step`, :meth:`measure`
and :meth:`after_step` around each step, :meth:`resync` after work between steps, :meth:`state` and
:meth:`load_state` with the checkpoints, :meth:`summary` at the end.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from aqsgd.comm.link import LinkSchedule, LinkSpec, boundary_links, parse_links
from aqsgd.comm.transport import StatsKey
from aqsgd.pipeline.compression import BACKWARD_CHANNEL, FORWARD_CHANNEL, DirectionSpec
from aqsgd.train.adaptive import BITS, AutoSpec, LinkPolicy, LinkRule, RuleFactory, link_name, parse_link
from aqsgd.train.stepstats import StageStats, link_sample, probe_fields, step_sample

if TYPE_CHECKING:
    from aqsgd.comm import Transport
    from aqsgd.parallel import ProcessGrid
    from aqsgd.train.config import TrainConfig
    from aqsgd.train.engine import PipelineEngine

__all__ = ["LinkController"]

log = logging.getLogger(__name__)


def _channel(direction: str) -> int:
    return FORWARD_CHANNEL if direction == "forward" else BACKWARD_CHANNEL


class LinkController:
    """The links of one process of a run (see the module docstring). ``rule``: builds the
    :class:`~aqsgd.train.adaptive.LinkRule` of a run with auto links (default: :class:`LinkPolicy`)."""

    def __init__(self, cfg: TrainConfig, rule: RuleFactory = LinkPolicy) -> None:
        p = cfg.pipeline
        specs = cfg.compression.specs  # parsed once, by the config
        self.autos: dict[str, AutoSpec | None] = {
            d: spec if isinstance(spec, AutoSpec) else None for d, spec in specs.items()}
        self.rule: LinkRule | None = (rule(p.stages - 1, self.autos["forward"], self.autos["backward"])
                                      if any(self.autos.values()) else None)
        self.fixed: dict[str, DirectionSpec | None] = {
            d: spec if isinstance(spec, DirectionSpec) else None for d, spec in specs.items()}
        self.schedules: list[LinkSchedule] = parse_links(p.link, p.stages - 1) if p.link else []
        self.dp_link: LinkSpec | None = LinkSpec.parse(p.dp_link) if p.dp_link else None
        self.stages = p.stages
        self.passes = p.micro_batches * cfg.optim.grad_accum  # micro-batches a step, over its passes
        self.fills = cfg.optim.grad_accum
        self._varying: dict[int, LinkSchedule] = {}  # this process's links whose setting changes
        self._transport: Transport | None = None
        self._engine: PipelineEngine | None = None
        self._grid: ProcessGrid | None = None
        self._seen: dict[StatsKey, Any] = {}  # the transport's counters at the last step (see measure)
        self._writes = False

    # -- building ----------------------------------------------------------------------------------------
    def initial_specs(self) -> tuple[DirectionSpec, DirectionSpec]:
        """The forward and backward settings the schemes are built with: an auto link's at the top of its
        ladder (every link starts there), a fixed direction's own."""

        def initial(direction: str) -> DirectionSpec:
            auto, fixed = self.autos[direction], self.fixed[direction]
            if auto is not None:
                return DirectionSpec(auto.scheme, auto.ladder[0])
            assert fixed is not None
            return fixed

        return initial("forward"), initial("backward")

    def process_links(self, grid: ProcessGrid) -> tuple[dict[int, LinkSpec] | None, LinkSpec | None]:
        """This process's links by the rank at their other end (its boundaries' settings), for its transport,
        and the setting of its replicas' sync (``--dp-link``, else the one ``--link`` then has; a schedule
        that varies is refused with replicas). None where they are not given."""
        if not self.schedules:
            return None, self.dp_link
        schedules = boundary_links(self.schedules, grid.stage, lambda s: grid.rank_of_stage[s])
        self._varying = {dst: schedule for dst, schedule in schedules.items() if schedule.varies}
        return ({dst: schedule.initial for dst, schedule in schedules.items()},
                self.dp_link or self.schedules[0].initial)

    def pace(self, transport: Transport) -> None:
        """Links whose setting changes during the run (``--link ...~SPEC@STEP``) are paced from the start, and
        changed at the step boundaries of their schedule (:meth:`before_step`)."""
        for dst, schedule in self._varying.items():
            transport.set_link(dst, schedule.initial)

    def attach(self, engine: PipelineEngine, transport: Transport | None, grid: ProcessGrid | None, *,
               writes_metrics: bool) -> None:
        """Take the run's engine and (distributed) transport: each auto link's sender probes every rung's
        error (every few steps), and its level applies to the warm-up too."""
        self._engine, self._transport, self._grid, self._writes = engine, transport, grid, writes_metrics
        if self.rule is not None:
            probes = self.rule.probes()
            for name in self.rule.specs():
                b, direction, _ = parse_link(name)
                engine.set_link(b, _channel(direction), probe=probes.get(name), compress_warmup=True)

    # -- each step -------------------------------------------------------------------------------------
    def before_step(self, step: int) -> None:
        """Give this process's emulated links the setting their schedule has at ``step`` (counted from 1),
        and have the probing senders probe if it is a probing step."""
        if self._varying and self._transport is not None:
            for dst, schedule in self._varying.items():
                self._transport.set_link(dst, schedule.at(step))
            if self._writes and step > 1:
                for b, schedule in enumerate(self.schedules):
                    if schedule.at(step) != schedule.at(step - 1):
                        log.info("step %d: emulated link of boundary %d now %s", step, b, schedule.at(step))
        if self.rule is not None and self._engine is not None:  # every few steps (adaptive.PROBE_EVERY)
            self._engine.probe_now(self.rule.probes_at(step))

    def measure(self, stage: int) -> dict[str, Any]:
        """The link fields of ``stage``'s :class:`~aqsgd.train.stepstats.StageStats` for the last step: what
        this process's links carried (to the next stage forward and the previous one backward, wire bytes and
        busy seconds; from the previous stage forward and the next one backward, the seconds their messages
        arrived held back; zeros in the local runtime, which has no links) and its senders' probes."""
        out: dict[str, Any] = {}
        schemes = self._engine.schemes() if self._engine is not None else {}
        for b, channel, direction in ((stage, FORWARD_CHANNEL, "forward"), (stage - 1, BACKWARD_CHANNEL,
                                                                             "backward")):
            scheme = schemes.get((b, channel, "sender"))
            out.update(probe_fields(scheme.take_probe() if scheme is not None else None, direction))
        return {**self._link_deltas(), **out}

    def _link_deltas(self) -> dict[str, float]:
        if self._transport is None or self._grid is None:
            return {}
        now = self._transport.stats
        stage, ranks = self._grid.stage, self._grid.rank_of_stage

        def delta(peer: int, channel: int, direction: str, field: str) -> float:
            if not 0 <= peer < len(ranks):
                return 0.0
            key = StatsKey(ranks[peer], channel, direction)
            cur, before = now.get(key), self._seen.get(key)
            return float((getattr(cur, field) if cur else 0) - (getattr(before, field) if before else 0))

        out = {"fw_wire_bytes": delta(stage + 1, FORWARD_CHANNEL, "send", "wire_bytes"),
               "fw_busy_s": delta(stage + 1, FORWARD_CHANNEL, "send", "busy_s"),
               "bw_wire_bytes": delta(stage - 1, BACKWARD_CHANNEL, "send", "wire_bytes"),
               "bw_busy_s": delta(stage - 1, BACKWARD_CHANNEL, "send", "busy_s"),
               "in_fw_held_s": delta(stage - 1, FORWARD_CHANNEL, "recv", "backlog_s"),
               "in_bw_held_s": delta(stage + 1, BACKWARD_CHANNEL, "recv", "backlog_s")}
        self._seen = now
        return out

    def after_step(self, stats: Sequence[StageStats], step: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Take a step's gathered statistics: the rule chooses the links' codecs for the next step (applied
        here), and the link parts of the step's metrics row are returned, those that go before its timing
        (each link's traffic, the codecs this step sent with and their bits) and after it (each rung's probed
        error, the rule's inputs)."""
        codecs = None
        if self.rule is not None:
            codecs = self.rule.specs()  # what this step sent with
            # (compressed: every step sent the links' codecs, the warm-up's too: see attach)
            changes = self.rule.step(step_sample(stats), self.passes, fills=self.fills)
            self._apply(changes)
            if changes and self._writes:
                log.info("step %d: links now %s", step, ", ".join(f"{k} {v}" for k, v in changes.items()))
        before: dict[str, Any] = {}
        links = self._traffic(stats, step)
        if links:  # distributed: each boundary's link as measured (bytes on the wire, busy seconds, Mbit/s)
            before["links"] = links
        if codecs:  # the spec each auto link sent this step with, and its bits (TensorBoard plots them)
            before["codecs"] = codecs
            before["link_bits"] = {k: BITS[v.split(":", 1)[1]] for k, v in codecs.items()}
        after: dict[str, Any] = {}
        if codecs:  # the relative error every rung made on this step's probed message
            after["link_errors"] = self._errors(stats)
        if self.rule is not None:  # what the rule saw after this step
            after["link_policy"] = self.rule.overview()
        return before, after

    def _apply(self, specs: dict[str, str]) -> None:
        """``{"b0.forward": spec}`` onto this process's schemes of those links (before the next step)."""
        if self._engine is None:
            return
        for name, spec in specs.items():  # SCHEME:RUNG of the link's ladder (checked with the config)
            b, direction, _ = parse_link(name)
            scheme, rung = spec.split(":", 1)
            self._engine.set_link(b, _channel(direction), codec=DirectionSpec(scheme, rung))

    def _traffic(self, stats: Sequence[StageStats], step: int) -> dict[str, dict[str, Any]]:
        """What each link carried and how long it was busy doing it (distributed runs only)."""
        if self._transport is None:
            return {}
        out = {}
        for b in range(self.stages - 1):
            for direction in ("forward", "backward"):
                name = link_name(b, direction)
                seen = link_sample(stats, name)  # its sender's figures, what its receiver saw held back
                busy = seen.seconds
                out[name] = {"wire_bytes": int(seen.wire), "busy_s": seen.busy_s, "held_back_s": seen.held_s,
                             "mbit_s": 8e-6 * seen.wire / busy if busy > 0 else None,
                             **({"emulated": str(self.schedules[b].at(step))} if self.schedules else {})}
        return out

    def _errors(self, stats: Sequence[StageStats]) -> dict[str, dict[str, float]]:
        """Per auto link, each rung's relative error ``||x - x_hat|| / ||x||`` on the message its sender
        probed this step (the root mean square over its samples; links that probed nothing are left out)."""
        assert self.rule is not None
        out = {}
        for name, ladder in self.rule.probes().items():
            seen = link_sample(stats, name)
            if seen.probed > 0:
                out[name] = {rung: math.sqrt(e / seen.probed) for rung, e in zip(ladder, seen.err2)}
        return out

    def resync(self) -> None:
        """After work between two steps (an evaluation, a checkpoint): the links' statistics restart from
        here, so that the next step's are its own, not the evaluation's fp32 traffic."""
        if self._transport is not None:
            self._seen = self._transport.stats

    # -- checkpoints and summary -------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The links' part of a checkpoint: their levels by spec (an index would change meaning with the
        ladder) and what the rule measured of them; empty without auto links."""
        if self.rule is None:
            return {}
        return {"link_levels": self.rule.specs(), "link_policy": self.rule.state()}

    def load_state(self, saved: dict[str, Any]) -> None:
        """Continue from a checkpoint's :meth:`state` (before the schemes are loaded: their codecs are checked
        against the saved ones)."""
        if self.rule is None or not saved.get("link_levels"):
            return
        self.rule.restore(saved["link_levels"])
        if saved.get("link_policy"):
            self.rule.load_state(saved["link_policy"])
        self._apply(self.rule.specs())

    def summary(self) -> dict[str, Any]:
        """The links' part of the run's summary: what the rule knows of each link."""
        return {"links": self.rule.describe()} if self.rule is not None else {}
