"""Tests for pipeline schedules as data (no processes involved)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aqsgd.pipeline.schedule import (
    BACKWARD,
    FORWARD,
    RECV_B,
    RECV_F,
    SCHEDULES,
    SEND_B,
    SEND_F,
    Action,
    ScheduleError,
    build_plans,
    execution_order,
    format_plan,
    get_schedule,
    gpipe,
    one_f_one_b,
    parse_plan,
    peak_in_flight,
    validate,
)

SIZES = [(s, m) for s in range(1, 6) for m in range(1, 9)]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize(("num_stages", "num_microbatches"), SIZES)
def test_all_schedules_validate(name: str, num_stages: int, num_microbatches: int) -> None:
    plans = build_plans(name, num_stages, num_microbatches)
    validate(plans)
    order = execution_order(plans)
    assert len(order) == sum(len(p) for p in plans)


@pytest.mark.parametrize(("num_stages", "num_microbatches"), SIZES)
def test_one_f_one_b_memory_bound(num_stages: int, num_microbatches: int) -> None:
    for stage in range(num_stages):
        plan = one_f_one_b(stage, num_stages, num_microbatches)
        assert peak_in_flight(plan) <= num_stages - stage
        assert peak_in_flight(plan) == min(num_stages - stage, num_microbatches)


@pytest.mark.parametrize(("num_stages", "num_microbatches"), SIZES)
def test_gpipe_keeps_everything_in_flight(num_stages: int, num_microbatches: int) -> None:
    for stage in range(num_stages):
        assert peak_in_flight(gpipe(stage, num_stages, num_microbatches)) == num_microbatches


@given(st.integers(1, 5), st.integers(1, 8), st.sampled_from(sorted(SCHEDULES)))
def test_text_roundtrip(num_stages: int, num_microbatches: int, name: str) -> None:
    for plan in build_plans(name, num_stages, num_microbatches):
        assert parse_plan(format_plan(plan)) == plan
        assert [Action.parse(str(a)) for a in plan] == plan


def test_textual_forms() -> None:
    assert [str(Action(k, 3)) for k in (FORWARD, BACKWARD, SEND_F, RECV_F, SEND_B, RECV_B)] == [
        "F3",
        "B3",
        "SF3",
        "RF3",
        "SB3",
        "RB3",
    ]
    assert Action.parse("SB12") == Action(SEND_B, 12)
    for bad in ("X1", "F", "F-1", "SF", "1F", ""):
        with pytest.raises(ValueError):
            Action.parse(bad)


def test_known_plans() -> None:
    assert format_plan(gpipe(0, 2, 2)) == "F0 SF0 F1 SF1 RB0 B0 RB1 B1"
    assert format_plan(gpipe(1, 2, 2)) == "RF0 F0 RF1 F1 B0 SB0 B1 SB1"
    assert format_plan(one_f_one_b(0, 3, 4)) == ("F0 SF0 F1 SF1 F2 SF2 RB0 B0 F3 SF3 RB1 B1 RB2 B2 RB3 B3")
    assert format_plan(one_f_one_b(2, 3, 2)) == "RF0 F0 B0 SB0 RF1 F1 B1 SB1"
    assert format_plan(gpipe(0, 1, 2)) == "F0 F1 B0 B1"


def test_get_schedule() -> None:
    assert get_schedule("gpipe") is gpipe
    assert get_schedule("1f1b") is one_f_one_b
    with pytest.raises(ValueError, match="1f1b, gpipe"):
        get_schedule("interleaved")


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        gpipe(2, 2, 1)
    with pytest.raises(ValueError):
        one_f_one_b(0, 0, 1)
    with pytest.raises(ValueError):
        one_f_one_b(0, 1, 0)


def _plans(*texts: str) -> list[list[Action]]:
    return [parse_plan(t) for t in texts]


@pytest.mark.parametrize(
    ("plans", "message"),
    [
        (_plans("F0 SF0 RB0 B0", "RF0 F0 B0 SB0 B0"), "more than once"),
        (_plans("F0 SF0 RB0 B0 F1 SF1 RB1 B1", "RF0 F0 B0 SB0"), "different numbers"),
        (_plans("B0 F0"), "before F0"),
        (_plans("F0 B0", "RF0 F0 B0 SB0"), "SEND_F"),
        (_plans("SF0 F0 RB0 B0", "RF0 F0 B0 SB0"), "SF0 comes before F0"),
        (_plans("F0 SF0 RB0 B0", "F0 RF0 B0 SB0"), "RF0 comes after F0"),
        (_plans("RF0 F0 B0"), "first stage cannot RECV_F"),
        (_plans("F0 SF0 B0"), "last stage cannot SEND_F"),
        (_plans("F1 B1"), "not 0..0"),
        (_plans("F0 SF0 F1 SF1 RB0 B0 RB1 B1", "RF1 F1 RF0 F0 B0 SB0 B1 SB1"), "in order \\[1, 0\\]"),
        # Both stages wait for a gradient before sending the activation the other one needs.
        (_plans("F0 RB0 SF0 B0", "RF0 F0 B0 SB0"), "deadlock: stage 0 at RB0, stage 1 at RF0"),
        (
            _plans("F0 SF0 F1 SF1 RB1 B1 RB0 B0", "RF0 F0 RF1 F1 B0 SB0 B1 SB1"),
            "order",
        ),
        ([], "at least one stage"),
    ],
)
def test_validate_rejects(plans: list[list[Action]], message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        validate(plans)


def test_order_mismatch_and_deadlock_detected() -> None:
    # Stage 1 sends gradient 1 before gradient 0 while stage 0 receives them in order 0, 1.
    plans = _plans("F0 SF0 RB0 B0 F1 SF1 RB1 B1", "RF0 F0 RF1 F1 B1 SB1 B0 SB0")
    with pytest.raises(ScheduleError, match="order"):
        validate(plans)
    # Stage 0 waits for a gradient before sending the activation that stage 1 waits for.
    deadlocked = _plans("RB0 F0 SF0 B0", "RF0 F0 B0 SB0")
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(deadlocked)
    with pytest.raises(ScheduleError, match="deadlock"):
        execution_order(deadlocked)
