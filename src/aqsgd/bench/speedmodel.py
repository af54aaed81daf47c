"""The speed model of the pipeline benchmarks: the step time a pipeline schedule can reach.

``aqsgd bench pipeline`` (links emulated in the transport) and ``aqsgd bench netem`` (real shaped links) both
read their measured step times against :func:`step_time`, through :func:`row_step_time`; efficiency =
ideal step time / measured step time. docs/design.md ("Speed model") has the derivation in prose.

Machine model
-------------
* Stage ``s`` is one compute resource. A micro-batch costs it ``c_s`` seconds (forward + backward + the
  encode/decode of its messages, all measured), split into a forward ``f_s = (1 - beta) c_s`` and a backward
  ``b_s = beta c_s`` with ``beta`` = :data:`BACKWARD_SHARE` (2/3: a backward computes the gradients of both
  the inputs and the weights, about twice the forward's work). The split only matters when the links and the
  compute are of similar speed; in both limits below the step depends on ``c_s`` alone.
* Every boundary has one serial line per direction (the links are full duplex): a forward message of
  boundary ``k`` (stage ``k`` to ``k+1``) occupies its line for ``lf_k = 8 bytes / bandwidth`` seconds, a
  backward message ``lb_k``; messages on one line go one after the other in the order they were sent, and
  arrive one propagation ``latency`` after leaving the line (latency overlaps: it does not occupy the line).
  This is the transport's link emulation (docs/design.md, "Link emulation") and the chain of shaped links of
  the netem benchmark.
* Sends do not block the sender (``isend`` enqueues; a sender thread drains the line), receives block only
  the compute that needs the data; nothing else costs time (no per-message software overhead, no optimizer
  step, no loss reduction).

:func:`step_time` replays the schedule's own per-stage action lists
(:func:`aqsgd.pipeline.schedule.build_plans`) on that machine: every action starts as soon as its stage and,
for a receive, its message are ready, so the result is the length of the critical path of the step, the
shortest step the schedule allows. It includes the fill and drain of the pipeline (the bubble), the transfer
time of the messages the schedule cannot overlap with compute, and the stalls of a schedule that limits the
micro-batches in flight.

Closed forms (uniform stages ``c = f + b``, uniform links ``lf``, ``lb``, latency ``L``, ``M`` micro-batches,
``S`` stages):

* Any schedule is bounded below by the flow-shop bound (:func:`pipeline_bound`): one micro-batch's round
  trip ``R = S c + (S - 1)(lf + lb + 2 L)`` plus ``M - 1`` periods of the slowest resource,
  ``T >= R + (M - 1) max(c, lf, lb)``. With no communication every schedule here reaches it:
  ``T = (M + S - 1) c``, the compute bubble, ``(M + S - 1) / M`` times the ``M c`` of one stage.
* GPipe runs all forwards, then all backwards, so the two directions of a link never overlap; exactly
  ``T = S f + (S - 1)(lf + L) + (M - 1) max(f, lf) + S b + (S - 1)(lb + L) + (M - 1) max(b, lb)``
  (only communication: ``(M + S - 2)(lf + lb)``).
* 1F1B lets stage ``s`` hold at most ``S - s`` micro-batches in flight: the forward of micro-batch
  ``j + S - s`` waits for the backward of ``j``, which ends one round trip from stage ``s`` after the forward
  of ``j`` began. Stage 0's steady-state period is therefore at least
  ``R / S = c + (S - 1)/S (lf + lb + 2 L)``, and
  ``T ~ R + (M - 1) max(c + (S - 1)/S (lf + lb + 2 L), lf, lb)``: with communication, even when it is faster
  than compute, 1F1B does not hide it completely. (The replay gives the exact figure; this steady-state
  estimate ignores the warm-up and cool-down phases.)
* One stage: ``M c``, no bubble.

Data parallelism adds the paced gradient sync after the pipeline's step (``sync_s``): a stage's sync cannot
start before its last backward, and stage 0, whose step is the one measured, is the last to get there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from aqsgd.pipeline.schedule import (
    BACKWARD,
    FORWARD,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    build_plans,
    execution_order,
)

__all__ = ["BACKWARD_SHARE", "pipeline_bound", "row_step_time", "step_time", "transfer_time"]

BACKWARD_SHARE = 2.0 / 3.0
"""Share of a micro-batch's compute time spent in its backward (the rest is its forward)."""


def transfer_time(nbytes: float, bandwidth_bps: float) -> float:
    """Seconds a message of ``nbytes`` occupies a line of ``bandwidth_bps`` bit/s."""
    if not bandwidth_bps > 0:
        raise ValueError(f"bandwidth must be > 0 bit/s, got {bandwidth_bps}")
    return 8.0 * nbytes / bandwidth_bps


def _per(value: float | Sequence[float], n: int, what: str) -> list[float]:
    values = [float(value)] * n if isinstance(value, (int, float)) else [float(v) for v in value]
    if len(values) != n:
        raise ValueError(f"{what}: expected {n} values, got {len(values)}")
    if any(not (v >= 0 and math.isfinite(v)) for v in values):
        raise ValueError(f"{what} must be finite and >= 0, got {values}")
    return values


def step_time(schedule: str, num_stages: int, num_microbatches: int, compute_s: float | Sequence[float],
              forward_s: float | Sequence[float] = 0.0, backward_s: float | Sequence[float] = 0.0, *,
              latency_s: float = 0.0, sync_s: float = 0.0, backward_share: float = BACKWARD_SHARE) -> float:
    """The shortest step ``schedule`` (``"gpipe"`` or ``"1f1b"``) allows on the machine of the module docs.

    ``compute_s``: per micro-batch, forward + backward + codec time of each stage (one value for all stages,
    or ``num_stages`` values); ``forward_s`` / ``backward_s``: line time of one forward (activation) /
    backward (gradient) message of each boundary (one value, or ``num_stages - 1``; see
    :func:`transfer_time`); ``latency_s``: one-way propagation delay of every link; ``sync_s``: gradient-sync
    time added at the end.
    """
    s, m = num_stages, num_microbatches
    comp = _per(compute_s, s, "compute_s")
    lines = {"F": _per(forward_s, s - 1, "forward_s"), "B": _per(backward_s, s - 1, "backward_s")}
    if not 0.0 <= backward_share <= 1.0:
        raise ValueError(f"backward_share must be in [0, 1], got {backward_share}")
    clock = [0.0] * s  # when each stage's compute is next free
    line_free: dict[tuple[str, int], float] = {}  # (direction, boundary) -> when the line is next free
    arrival: dict[tuple[str, int, int], float] = {}  # (direction, receiving stage, micro-batch) -> arrival
    for stage, action in execution_order(build_plans(schedule, s, m)):
        kind, mb = action.kind, action.microbatch
        if kind is FORWARD:
            clock[stage] += (1.0 - backward_share) * comp[stage]
        elif kind is BACKWARD:
            clock[stage] += backward_share * comp[stage]
        elif kind is SEND_F or kind is SEND_B:
            direction, boundary, dst = (("F", stage, stage + 1) if kind is SEND_F
                                        else ("B", stage - 1, stage - 1))
            start = max(clock[stage], line_free.get((direction, boundary), 0.0))
            line_free[(direction, boundary)] = depart = start + lines[direction][boundary]
            arrival[(direction, dst, mb)] = depart + latency_s
        elif kind is RECV_F or kind is RECV_B:
            clock[stage] = max(clock[stage], arrival.pop(("F" if kind is RECV_F else "B", stage, mb)))
    return max(clock) + sync_s


def pipeline_bound(num_stages: int, num_microbatches: int, compute_s: float, forward_s: float = 0.0,
                   backward_s: float = 0.0, *, latency_s: float = 0.0) -> float:
    """The flow-shop lower bound on any schedule's step with uniform stages and links (module docs):
    ``S c + (S - 1)(lf + lb + 2 L) + (M - 1) max(c, lf, lb)``."""
    s, m = num_stages, num_microbatches
    links = (forward_s, backward_s) if s > 1 else (0.0, 0.0)
    return (s * compute_s + (s - 1) * (forward_s + backward_s + 2 * latency_s)
            + (m - 1) * max(compute_s, *links))


def row_step_time(row: Mapping[str, Any], bandwidth_mbps: float | None = None) -> float:
    """:func:`step_time` of one benchmark row (:func:`aqsgd.bench.pipeline.measure` and the row fields of
    both benchmarks) at ``bandwidth_mbps`` (default: the row's ``bandwidth_mbps``).

    Per-stage compute (``stage_compute_per_mb_s``) and per-boundary bytes (``fw_bytes_per_mb``,
    ``bw_bytes_per_mb``) are used where the row has them; rows without them (older result files) use the
    busiest stage's ``compute_per_mb_s`` for every stage and the larger message ``bytes_per_mb`` for both
    directions of every boundary. The gradient sync is ``sync_bytes`` paced at the same bandwidth, times
    ``sync_load`` (how many stages' syncs share the busiest link) when the row has one."""
    bps = (row["bandwidth_mbps"] if bandwidth_mbps is None else bandwidth_mbps) * 1e6
    stages = int(row.get("stages", 1))
    compute = row.get("stage_compute_per_mb_s") or row["compute_per_mb_s"]
    fw = row.get("fw_bytes_per_mb") or [row["bytes_per_mb"]] * (stages - 1)
    bw = row.get("bw_bytes_per_mb") or [row["bytes_per_mb"]] * (stages - 1)
    sync = row.get("sync_bytes", 0) * max(row.get("sync_load", 1), 1)
    return step_time(row.get("schedule", "1f1b"), stages, int(row.get("num_microbatches", 1)), compute,
                     [transfer_time(n, bps) for n in fw], [transfer_time(n, bps) for n in bw],
                     latency_s=row.get("latency_ms", 0.0) / 1e3, sync_s=transfer_time(sync, bps))
