"""Link specs and the pacer's schedule (pure Python, no processes)."""

from __future__ import annotations

import math
import threading

import pytest

from aqsgd.comm import LinkSpec, Pacer, parse_bandwidth, parse_latency


@pytest.mark.parametrize(
    "text, bps",
    [
        ("100mbit", 100e6),
        ("1gbit", 1e9),
        ("500kbit", 500e3),
        ("2.5gbit", 2.5e9),
        ("1bit", 1.0),
        ("1.5e2mbit", 150e6),
        (" 40MBit ", 40e6),
        ("inf", None),
        ("unlimited", None),
        (None, None),
        (8e6, 8e6),
        (math.inf, None),
    ],
)
def test_parse_bandwidth(text, bps):
    assert parse_bandwidth(text) == bps


@pytest.mark.parametrize("text", ["", "100", "100mb", "fast", "-1mbit", "0mbit", "1e400gbit", "mbit", 0,
                                  -5.0])
def test_parse_bandwidth_errors_name_valid_forms(text):
    with pytest.raises(ValueError, match="kbit.*mbit.*gbit"):
        parse_bandwidth(text)


@pytest.mark.parametrize(
    "text, seconds",
    [("10ms", 0.01), ("0.5s", 0.5), ("250us", 250e-6), ("0", 0.0), ("0ms", 0.0), (" 20 MS", 0.02),
     (0.1, 0.1)],
)
def test_parse_latency(text, seconds):
    assert parse_latency(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "10", "0.5", "ten ms", "-1ms", "10min", "inf", math.nan, -0.1])
def test_parse_latency_errors_name_valid_forms(text):
    with pytest.raises(ValueError, match="ms"):
        parse_latency(text)


def test_linkspec_parse_and_validation():
    assert LinkSpec.parse("100mbit") == LinkSpec(100e6, 0.0)
    assert LinkSpec.parse("100mbit, 10ms") == LinkSpec(100e6, 0.01)
    assert LinkSpec.parse("inf,20ms") == LinkSpec(None, 0.02)
    assert LinkSpec().unlimited and not LinkSpec(None, 0.01).unlimited
    assert LinkSpec.parse(str(LinkSpec(40e6, 0.02))) == LinkSpec(40e6, 0.02)
    for bad in ["", "1mbit,2ms,3ms", "10ms"]:
        with pytest.raises(ValueError, match="bandwidth"):
            LinkSpec.parse(bad)
    with pytest.raises(ValueError):
        LinkSpec(0.0)
    with pytest.raises(ValueError):
        LinkSpec(1e6, -1.0)


def test_back_to_back_messages_are_spaced_by_tx_time():
    pacer = Pacer(LinkSpec(8e6, 0.0))  # 1 byte per microsecond
    slots = [pacer.schedule(1000, now=0.0) for _ in range(5)]
    assert [s.start for s in slots] == pytest.approx([0.0, 1e-3, 2e-3, 3e-3, 4e-3])
    assert [s.depart for s in slots] == pytest.approx([1e-3, 2e-3, 3e-3, 4e-3, 5e-3])


def test_idle_line_starts_at_once_and_latency_overlaps():
    pacer = Pacer(LinkSpec(8e6, 0.02))
    first = pacer.schedule(1000, now=10.0)
    assert first == pytest.approx((10.0, 10.001, 10.021))
    # Ten back-to-back messages: the last arrives after latency + 10 tx, not 10 latencies.
    pacer.reset()
    slots = [pacer.schedule(1000, now=0.0) for _ in range(10)]
    assert slots[-1].arrive == pytest.approx(0.02 + 10 * 1e-3)
    # After the line drained, a new message starts when handed over.
    late = pacer.schedule(1000, now=1.0)
    assert late.start == 1.0 and late.arrive == pytest.approx(1.021)


def test_throughput_never_exceeds_bandwidth():
    bps = 40e6
    pacer = Pacer(LinkSpec(bps, 0.005))
    sizes = [137, 50_000, 1, 9_999, 250_000, 0, 4096] * 3
    t, total, first_start = 0.0, 0, None
    for i, n in enumerate(sizes):
        s = pacer.schedule(n, now=t)
        first_start = s.start if first_start is None else first_start
        total += n
        assert s.depart - first_start >= 8 * total / bps - 1e-12
        t += 1e-4 * (i % 3)  # handed over faster than the line drains
    assert s.depart - first_start == pytest.approx(8 * total / bps)


def test_unlimited_link_adds_nothing_and_pacer_is_thread_safe():
    pacer = Pacer(LinkSpec())
    assert pacer.schedule(10**9, now=5.0) == (5.0, 5.0, 5.0)
    pacer = Pacer(LinkSpec(8e6))
    departs: list[float] = []

    def worker():
        for _ in range(200):
            departs.append(pacer.schedule(100, now=0.0).depart)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert sorted(departs) == pytest.approx([(i + 1) * 1e-4 for i in range(800)])
    with pytest.raises(ValueError):
        pacer.schedule(-1)


def test_one_link_setting_per_boundary():
    from aqsgd.comm.link import boundary_links, parse_links

    one = parse_links("100mbit,5ms", 3)
    assert [s.initial for s in one] == [LinkSpec(100e6, 0.005)] * 3 and not any(s.varies for s in one)
    each = parse_links("1gbit / 50mbit,20ms/200mbit", 3)
    assert [s.initial for s in each] == [LinkSpec(1e9, 0.0), LinkSpec(50e6, 0.02), LinkSpec(200e6, 0.0)]
    ranks = [10, 11, 12, 13]  # a replica's pipeline ranks, by stage
    assert boundary_links(each, 0, ranks.__getitem__) == {11: each[0]}
    assert boundary_links(each, 1, ranks.__getitem__) == {10: each[0], 12: each[1]}
    assert boundary_links(each, 3, ranks.__getitem__) == {12: each[2]}
    with pytest.raises(ValueError, match="2 link settings for 3 stage boundaries"):
        parse_links("1gbit/50mbit", 3)
    with pytest.raises(ValueError, match="invalid bandwidth 'fast'"):
        parse_links("1gbit/fast", 2)


def test_a_link_schedule_gives_each_step_its_setting():
    from aqsgd.comm.link import LinkSchedule, parse_links

    drop = LinkSchedule.parse("200mbit~20mbit,10ms@50~200mbit@80")
    assert drop.varies and drop.initial == LinkSpec(200e6, 0.0)
    assert [drop.at(s) for s in (1, 49, 50, 79, 80, 1000)] == [
        LinkSpec(200e6, 0.0), LinkSpec(200e6, 0.0), LinkSpec(20e6, 0.01), LinkSpec(20e6, 0.01),
        LinkSpec(200e6, 0.0), LinkSpec(200e6, 0.0)]
    assert LinkSchedule.parse(str(drop)) == drop  # written back as it reads
    links = parse_links("1gbit/200mbit~20mbit@5/1gbit", 3)
    assert [s.varies for s in links] == [False, True, False] and links[1].at(5).bandwidth_bps == 20e6
    for bad, why in (("200mbit~20mbit", "write ~SPEC@STEP"), ("200mbit~20mbit@1", "write ~SPEC@STEP"),
                     ("200mbit~20mbit@x", "write ~SPEC@STEP"),
                     ("1gbit~20mbit@9~5mbit@9", "the steps of its changes must increase"),
                     ("1gbit~fast@9", "invalid bandwidth 'fast'")):
        with pytest.raises(ValueError, match=why):
            LinkSchedule.parse(bad)


def test_a_retuned_pacer_gives_the_next_message_the_new_setting():
    now = [0.0]
    pacer = Pacer(LinkSpec(8e6), clock=lambda: now[0])  # 1 MB/s
    assert pacer.schedule(1000).depart == pytest.approx(1e-3)
    pacer.retune(LinkSpec(8e5, 0.5))  # 10x slower, with latency: from the next message on
    t = pacer.schedule(1000)
    assert (t.start, t.depart, t.arrive) == pytest.approx((1e-3, 11e-3, 0.511))


def test_link_option_per_boundary_is_checked_with_the_other_options():
    from aqsgd.errors import SpecError
    from aqsgd.train.config import TrainConfig

    base = dict(runtime="distributed", stages=3)
    TrainConfig.of(**base, link="1gbit/50mbit,20ms").validate()
    with pytest.raises(SpecError, match="--link: 3 link settings for 2 stage boundaries"):
        TrainConfig.of(**base, link="1gbit/1gbit/1gbit").validate()
    with pytest.raises(SpecError, match="--link: one setting per boundary is for a single pipeline"):
        TrainConfig.of(**base, link="1gbit/50mbit", data_parallel=2).validate()
    TrainConfig.of(**base, link="1gbit", data_parallel=2).validate()
    TrainConfig.of(**base, link="1gbit/200mbit~20mbit@9").validate()
    with pytest.raises(SpecError, match="--link: a setting that changes during the run"):
        TrainConfig.of(**base, link="1gbit~20mbit@9", data_parallel=2).validate()
    with pytest.raises(SpecError, match="--link: invalid link change '20mbit'"):
        TrainConfig.of(**base, link="1gbit~20mbit").validate()
