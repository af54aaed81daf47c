"""Pipeline schedules as plain data.

A schedule turns ``(stage, num_stages, num_microbatches)`` into the ordered list of :class:`Action`
that one stage executes in one training step.  Plans are plain data, so they can be printed, parsed,
compared and validated without starting any process.

Communication model (used by :func:`validate` and :func:`execution_order`):

* there are two FIFO channels between neighbouring stages ``s`` and ``s + 1``: activations flow
  ``s -> s + 1`` (``SEND_F`` on ``s`` pairs with ``RECV_F`` on ``s + 1``) and gradients flow
  ``s + 1 -> s`` (``SEND_B`` on ``s + 1`` pairs with ``RECV_B`` on ``s``);
* messages carry no tag, so the n-th send on a channel pairs with the n-th receive;
* sends are buffered (they never block), receives block until the message has been sent.
"""

from __future__ import annotations

import enum
import re
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


class ActionKind(enum.Enum):
    """What a stage does in one step of its plan; the value is the textual prefix."""

    FORWARD = "F"
    BACKWARD = "B"
    SEND_F = "SF"
    RECV_F = "RF"
    SEND_B = "SB"
    RECV_B = "RB"

    @property
    def is_compute(self) -> bool:
        """True for FORWARD and BACKWARD."""
        return self in (ActionKind.FORWARD, ActionKind.BACKWARD)

    @property
    def is_send(self) -> bool:
        """True for SEND_F and SEND_B."""
        return self in (ActionKind.SEND_F, ActionKind.SEND_B)

    @property
    def is_recv(self) -> bool:
        """True for RECV_F and RECV_B."""
        return self in (ActionKind.RECV_F, ActionKind.RECV_B)


FORWARD = ActionKind.FORWARD
BACKWARD = ActionKind.BACKWARD
SEND_F = ActionKind.SEND_F
RECV_F = ActionKind.RECV_F
SEND_B = ActionKind.SEND_B
RECV_B = ActionKind.RECV_B

_ACTION_RE = re.compile(r"^(SF|RF|SB|RB|F|B)(\d+)$")


@dataclass(frozen=True)
class Action:
    """One step of a stage's plan, e.g. ``Action(FORWARD, 3)``, written ``F3``."""

    kind: ActionKind
    microbatch: int

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ActionKind):
            raise TypeError(f"Action.kind must be an ActionKind, got {self.kind!r}")
        if self.microbatch < 0:
            raise ValueError(f"Action.microbatch must be >= 0, got {self.microbatch}")

    def __str__(self) -> str:
        return f"{self.kind.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse the textual form (``F0``, ``B3``, ``SF0``, ``RF0``, ``SB1``, ``RB1``)."""
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ValueError(f"cannot parse action {text!r}; expected e.g. F0, B3, SF0, RF0, SB1, RB1")
        return cls(ActionKind(match.group(1)), int(match.group(2)))


def format_plan(plan: Iterable[Action]) -> str:
    """Render a plan as space-separated actions, e.g. ``"RF0 F0 SF0"``."""
    return " ".join(str(a) for a in plan)


def parse_plan(text: str) -> list[Action]:
    """Inverse of :func:`format_plan` (accepts any whitespace and commas as separators)."""
    return [Action.parse(tok) for tok in re.split(r"[\s,]+", text.strip()) if tok]


ScheduleFn = Callable[[int, int, int], list[Action]]


def _check_args(stage: int, num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage must be in [0, {num_stages}), got {stage}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")


def _forward(stage: int, num_stages: int, mb: int) -> list[Action]:
    """Forward of one micro-batch with its receive before and its send after."""
    actions = [] if stage == 0 else [Action(RECV_F, mb)]
    actions.append(Action(FORWARD, mb))
    if stage < num_stages - 1:
        actions.append(Action(SEND_F, mb))
    return actions


def _backward(stage: int, num_stages: int, mb: int) -> list[Action]:
    """Backward of one micro-batch with its receive before and its send after."""
    actions = [] if stage == num_stages - 1 else [Action(RECV_B, mb)]
    actions.append(Action(BACKWARD, mb))
    if stage > 0:
        actions.append(Action(SEND_B, mb))
    return actions


def gpipe(stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
    """GPipe: all forwards, then all backwards (in micro-batch order), as in the AQ-SGD paper."""
    _check_args(stage, num_stages, num_microbatches)
    plan: list[Action] = []
    for mb in range(num_microbatches):
        plan += _forward(stage, num_stages, mb)
    for mb in range(num_microbatches):
        plan += _backward(stage, num_stages, mb)
    return plan


def one_f_one_b(stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
    """1F1B (PipeDream-flush): ``min(S - stage - 1, M)`` warm-up forwards, steady 1F1B, cool-down backwards.

    At most ``S - stage`` micro-batches are in flight (forwarded but not yet backwarded) on a stage.
    """
    _check_args(stage, num_stages, num_microbatches)
    warmup = min(num_stages - stage - 1, num_microbatches)
    plan: list[Action] = []
    fwd = bwd = 0
    for _ in range(warmup):
        plan += _forward(stage, num_stages, fwd)
        fwd += 1
    while fwd < num_microbatches:
        plan += _forward(stage, num_stages, fwd)
        fwd += 1
        plan += _backward(stage, num_stages, bwd)
        bwd += 1
    while bwd < num_microbatches:
        plan += _backward(stage, num_stages, bwd)
        bwd += 1
    return plan


SCHEDULES: dict[str, ScheduleFn] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def get_schedule(name: str) -> ScheduleFn:
    """Look a schedule function up by name (``"gpipe"`` or ``"1f1b"``)."""
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; valid names: {', '.join(sorted(SCHEDULES))}") from None


def build_plans(schedule: str | ScheduleFn, num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """The plans of all stages for one step: ``plans[stage]`` is that stage's action list."""
    fn = get_schedule(schedule) if isinstance(schedule, str) else schedule
    return [fn(stage, num_stages, num_microbatches) for stage in range(num_stages)]


class ScheduleError(ValueError):
    """A plan is inconsistent, unmatched or deadlocks."""


def peak_in_flight(plan: Sequence[Action]) -> int:
    """Largest number of micro-batches forwarded but not yet backwarded at any point of ``plan``."""
    live = peak = 0
    for action in plan:
        if action.kind is FORWARD:
            live += 1
            peak = max(peak, live)
        elif action.kind is BACKWARD:
            live -= 1
    return peak


def _channel(stage: int, action: Action) -> tuple[int, int, str]:
    """The (src, dst, direction) channel an action sends on or receives from."""
    kind = action.kind
    if kind is SEND_F:
        return (stage, stage + 1, "F")
    if kind is RECV_F:
        return (stage - 1, stage, "F")
    if kind is SEND_B:
        return (stage, stage - 1, "B")
    if kind is RECV_B:
        return (stage + 1, stage, "B")
    raise AssertionError(f"{action} is not a communication action")


def _check_stage(stage: int, num_stages: int, plan: Sequence[Action]) -> int:
    """Per-stage checks; returns the number of micro-batches the stage processes."""
    first, last = stage == 0, stage == num_stages - 1
    positions: dict[ActionKind, dict[int, int]] = {kind: {} for kind in ActionKind}
    for pos, action in enumerate(plan):
        seen = positions[action.kind]
        if action.microbatch in seen:
            raise ScheduleError(f"stage {stage}: {action} appears more than once")
        seen[action.microbatch] = pos
        if first and action.kind in (RECV_F, SEND_B):
            raise ScheduleError(f"stage {stage}: the first stage cannot {action.kind.name} ({action})")
        if last and action.kind in (SEND_F, RECV_B):
            raise ScheduleError(f"stage {stage}: the last stage cannot {action.kind.name} ({action})")
    fwd, bwd = positions[FORWARD], positions[BACKWARD]
    num_mb = len(fwd)
    if sorted(fwd) != list(range(num_mb)):
        raise ScheduleError(f"stage {stage}: forwarded micro-batches {sorted(fwd)} are not 0..{num_mb - 1}")
    if sorted(bwd) != sorted(fwd):
        raise ScheduleError(
            f"stage {stage}: backwarded micro-batches {sorted(bwd)} differ from forwarded {sorted(fwd)}"
        )
    required: list[tuple[ActionKind, bool]] = [
        (RECV_F, not first),
        (SEND_F, not last),
        (RECV_B, not last),
        (SEND_B, not first),
    ]
    for kind, needed in required:
        have = sorted(positions[kind])
        want = list(range(num_mb)) if needed else []
        if have != want:
            raise ScheduleError(f"stage {stage}: {kind.name} for micro-batches {have}, expected {want}")
    for mb in range(num_mb):
        if bwd[mb] < fwd[mb]:
            raise ScheduleError(f"stage {stage}: B{mb} comes before F{mb}")
        if mb in positions[RECV_F] and positions[RECV_F][mb] > fwd[mb]:
            raise ScheduleError(f"stage {stage}: RF{mb} comes after F{mb}")
        if mb in positions[SEND_F] and positions[SEND_F][mb] < fwd[mb]:
            raise ScheduleError(f"stage {stage}: SF{mb} comes before F{mb}")
        if mb in positions[RECV_B] and positions[RECV_B][mb] > bwd[mb]:
            raise ScheduleError(f"stage {stage}: RB{mb} comes after B{mb}")
        if mb in positions[SEND_B] and positions[SEND_B][mb] < bwd[mb]:
            raise ScheduleError(f"stage {stage}: SB{mb} comes before B{mb}")
    return num_mb


def execution_order(plans: Sequence[Sequence[Action]]) -> list[tuple[int, Action]]:
    """Simulate blocking point-to-point execution of all stages and return a global serial order.

    Each stage runs its plan as far as it can (sends are buffered, receives block until the matching
    send happened); stages take turns until all are done.  The returned ``(stage, action)`` order is
    one valid interleaving, usable to run all stages in a single process.

    Raises:
        ScheduleError: a receive does not match the message at the head of its channel, or no stage
            can make progress (deadlock).
    """
    num_stages = len(plans)
    pointers = [0] * num_stages
    channels: dict[tuple[int, int, str], deque[int]] = {}
    order: list[tuple[int, Action]] = []
    while True:
        progressed = False
        for stage, plan in enumerate(plans):
            while pointers[stage] < len(plan):
                action = plan[pointers[stage]]
                if action.kind.is_send:
                    src, dst, direction = _channel(stage, action)
                    if not 0 <= dst < num_stages:
                        raise ScheduleError(f"stage {stage}: {action} sends to non-existent stage {dst}")
                    channels.setdefault((src, dst, direction), deque()).append(action.microbatch)
                elif action.kind.is_recv:
                    key = _channel(stage, action)
                    queue = channels.get(key)
                    if not queue:
                        break
                    if queue[0] != action.microbatch:
                        raise ScheduleError(
                            f"stage {stage}: {action} would receive micro-batch {queue[0]} from stage "
                            f"{key[0]} (sends and receives are in different orders)"
                        )
                    queue.popleft()
                order.append((stage, action))
                pointers[stage] += 1
                progressed = True
        if all(p == len(plan) for p, plan in zip(pointers, plans, strict=True)):
            break
        if not progressed:
            blocked = ", ".join(
                f"stage {s} at {plans[s][p]}" for s, p in enumerate(pointers) if p < len(plans[s])
            )
            raise ScheduleError(f"deadlock: {blocked}")
    leftovers = {key: list(q) for key, q in channels.items() if q}
    if leftovers:
        raise ScheduleError(f"messages sent but never received: {leftovers}")
    return order


def validate(plans: Sequence[Sequence[Action]]) -> None:
    """Check a full plan (one action list per stage) for one training step.

    Checks that every stage forwards and backwards each micro-batch exactly once (backward after
    forward), that all stages process the same micro-batches, that receives precede and sends follow
    the computation they serve, that the first stage never receives activations / sends gradients
    and the last never sends activations / receives gradients, that every send is matched in order by
    a receive on the neighbour, and that blocking execution finishes without deadlock.

    Raises:
        ScheduleError: (a ``ValueError``) describing the first problem found.
    """
    if not plans:
        raise ScheduleError("a plan needs at least one stage")
    counts = [_check_stage(stage, len(plans), plan) for stage, plan in enumerate(plans)]
    if len(set(counts)) != 1:
        raise ScheduleError(f"stages process different numbers of micro-batches: {counts}")
    if counts[0] == 0:
        raise ScheduleError("the plan processes no micro-batch")
    for stage in range(len(plans) - 1):
        for send_kind, recv_kind, src, dst in (
            (SEND_F, RECV_F, stage, stage + 1),
            (SEND_B, RECV_B, stage + 1, stage),
        ):
            sends = [a.microbatch for a in plans[src] if a.kind is send_kind]
            recvs = [a.microbatch for a in plans[dst] if a.kind is recv_kind]
            if sends != recvs:
                raise ScheduleError(
                    f"stage {src} sends {send_kind.name} in order {sends} but stage {dst} receives "
                    f"{recv_kind.name} in order {recvs}"
                )
    execution_order(plans)
