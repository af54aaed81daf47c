"""Transport between real processes (2 spawned ranks over gloo on 127.0.0.1).

Each multi-process scenario runs once per module (a fixture) and the tests check its observations; the
rank functions live at module level so that spawned children can import them.
"""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch

from aqsgd.comm import (
    BACKWARD,
    FORWARD,
    PREAMBLE_BYTES,
    LinkSpec,
    PeerFailure,
    StatsKey,
    Transport,
    TransportError,
)
from aqsgd.comm.testing import ProcessFailure, run_processes
from aqsgd.comm.wire import (
    _FLAG_CHECKSUM,
    _FLAG_INLINE,
    _FLAG_REFUSED,
    _INLINE_START,
    _TAG_BASE,
    _build_preamble,
    _parse_preamble,
)
from aqsgd.compress import HEADER_BYTES, make_codec
from aqsgd.errors import PacketError

CODECS = ["none", "fp16", "bf16", "q2", "q4:token", "q3:block16:stochastic", "topk0.1", "topk0.25+q8"]
MESSAGES = 10


# ---------------------------------------------------------------------------- rank functions
def _messages(src: int, channel: int) -> list[list]:
    """The packet lists ``src`` sends on ``channel``: deterministic, so both sides and the parent agree."""
    g = torch.Generator().manual_seed(1000 * src + channel)
    out = []
    for i in range(MESSAGES):
        n = 0 if i == 3 else 1 + int(torch.randint(0, 3, (1,), generator=g))
        packets = []
        for _ in range(n):
            codec = make_codec(CODECS[int(torch.randint(0, len(CODECS), (1,), generator=g))])
            shape = (int(torch.randint(1, 6, (1,), generator=g)),
                     int(torch.randint(1, 40, (1,), generator=g)))
            x = torch.randn(shape, generator=g)
            packets.append(codec.encode(x, generator=g).with_tag(
                int(torch.randint(0, 2**31, (1,), generator=g))))
        # the same bytes as a strided view and as a view at an odd offset into a larger tensor
        if i in (5, 6):
            packets = [dataclasses.replace(p,
                                           payload=_strided(p.payload) if i == 5 else _offset(p.payload, 3))
                       for p in packets]
        out.append(packets)
    return out


def _strided(payload: torch.Tensor) -> torch.Tensor:
    wide = torch.zeros(2 * payload.numel(), dtype=torch.uint8)
    wide[::2] = payload
    return wide[::2]


def _offset(payload: torch.Tensor, offset: int) -> torch.Tensor:
    longer = torch.full((offset + payload.numel(),), 0xAB, dtype=torch.uint8)
    longer[offset:] = payload
    return longer[offset:]


def _roundtrip_rank(rank: int, world_size: int) -> dict:
    peer = 1 - rank
    with Transport(timeout_s=20) as t:
        recvs = {ch: [t.irecv(peer, ch) for _ in range(MESSAGES)] for ch in (FORWARD, BACKWARD)}
        sends = [t.isend(msg, peer, ch) for i in range(MESSAGES) for ch in (FORWARD, BACKWARD)
                 for msg in [_messages(rank, ch)[i]]]
        received = {ch: [[p.to_bytes() for p in h.wait()] for h in hs] for ch, hs in recvs.items()}
        for h in sends:
            h.wait()
        stats = {tuple(k): (v.messages, v.packets, v.packet_bytes, v.overhead_bytes, v.wait_s)
                 for k, v in t.stats.items()}
        t.reset_stats()
        after_reset = t.stats
    return {"received": received, "stats": stats, "after_reset": after_reset}


def _emulation_rank(rank: int, world_size: int) -> dict:
    out: dict = {}
    raw = make_codec("none")
    big = raw.encode(torch.zeros(500_000))  # 2,000,000 payload bytes
    chunks = [raw.encode(torch.zeros(62_500)) for _ in range(8)]  # 8 x 250,000 bytes
    small = raw.encode(torch.zeros(256))  # 1 KiB
    medium = [raw.encode(torch.zeros(5_000)) for _ in range(10)]  # 10 x 20 kB (4.1 ms each)
    # Bandwidth only: one 2 MB message, then 8 x 250 kB spread over both channels (one shared line).
    with Transport(timeout_s=20, links={1: LinkSpec(40e6, 0.0)}) as t:
        if rank == 0:
            t.recv(1, BACKWARD)  # both sides ready
            t0 = time.time()
            t.isend([big], 1, FORWARD).wait()
            out["big_sender_s"] = time.time() - t0
            out["big_t0"] = t0
            out["chunks_t0"] = time.time()
            hs = [t.isend([c], 1, FORWARD if i % 2 else BACKWARD) for i, c in enumerate(chunks)]
            for h in hs:
                h.wait()
        else:
            fwd = [t.irecv(0, FORWARD) for _ in range(5)]
            bwd = [t.irecv(0, BACKWARD) for _ in range(4)]
            t.send([], 0, BACKWARD)
            fwd[0].wait()
            out["big_t1"] = time.time()
            for h in fwd[1:] + bwd:
                h.wait()
            out["chunks_t1"] = time.time()
    # Latency: 20 ms one-way on a 40 Mbit/s line.
    with Transport(timeout_s=20, links=LinkSpec(40e6, 0.02)) as t:
        if rank == 0:
            t.recv(1, BACKWARD)
            out["small_t0"] = time.time()
            t.send([small], 1, FORWARD)
            t.recv(1, BACKWARD)  # the receiver got it
            out["burst_t0"] = time.time()
            for h in [t.isend([m], 1, FORWARD) for m in medium]:
                h.wait()
        else:
            small_h = t.irecv(0, FORWARD)
            burst = [t.irecv(0, FORWARD) for _ in range(10)]
            t.isend([], 0, BACKWARD)
            small_h.wait()
            out["small_t1"] = time.time()
            t.isend([], 0, BACKWARD)
            for h in burst:
                h.wait()
            out["burst_t1"] = time.time()
            held = t.stats[StatsKey(0, FORWARD, "recv")]
            out["held_back"] = (held.backlog_bytes, held.backlog_s)
    return out


def _failure_rank(rank: int, world_size: int) -> dict:
    out: dict = {}
    t = Transport(timeout_s=2.0, peer_labels={0: "stage 0", 1: "stage 1"})
    if rank == 1:
        t.recv(0, BACKWARD, timeout=30)  # "exit now"
        os._exit(0)
    silent = t.irecv(1, FORWARD)
    t0 = time.monotonic()
    try:
        silent.wait()
    except PeerFailure as e:
        out["timeout"] = (type(e).__name__, str(e), e.rank, e.label, time.monotonic() - t0)
    t.send([], 1, BACKWARD)
    t0 = time.monotonic()
    try:
        t.recv(1, BACKWARD, timeout=30)
    except PeerFailure as e:
        out["death"] = (type(e).__name__, str(e), e.rank, e.label, time.monotonic() - t0)
    try:  # the stale receive on the other channel fails too, instead of waiting forever
        silent.wait(10)
    except PeerFailure as e:
        out["stale"] = (type(e).__name__, str(e))
    try:
        h = t.isend([make_codec("q2").encode(torch.ones(4, 4))], 1, FORWARD)
        h.wait(10)
        out["send_after_death"] = ("ok", "")
    except PeerFailure as e:
        out["send_after_death"] = (type(e).__name__, str(e))
    t0 = time.monotonic()
    t.close()
    out["close_s"] = time.monotonic() - t0
    try:
        t.irecv(1, FORWARD)
    except TransportError as e:
        out["after_close"] = str(e)
    return out


# Payload bytes of the messages of the two-part fallback scenario: the first exceeds the initial receive size
# (two gloo messages, the receive size becomes its length), the next ones fit (one gloo message each) up to
# one that exceeds the new size again, with two packets (their payloads concatenated), after which a
# two-packet message of 200 kB fits. Two-part: messages 0 and 4.
_FALLBACK_SIZES = [[100_000], [1_024], [100_000], [], [150_000, 150_000], [64, 200_000], [40]]
_TWO_PART = {0, 4}


def _fallback_messages(src: int) -> list[list]:
    g = torch.Generator().manual_seed(7 + src)
    raw = make_codec("none")
    out = []
    for sizes in _FALLBACK_SIZES:
        out.append([raw.encode(torch.randn(n // 4, generator=g)).with_tag(n) for n in sizes])
    out[-1] = [make_codec("q2").encode(torch.randn(4, 16, generator=g))]  # a packet with a real codec
    return out


def _counting(calls: dict, name: str, fn):
    def wrapper(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return fn(*args, **kwargs)
    return wrapper


def _fallback(rank: int, checksum: bool) -> dict:
    """Both ranks send ``_fallback_messages`` to each other on FORWARD; counts the gloo messages."""
    from aqsgd.comm.workers import _Worker

    peer = 1 - rank
    calls: dict = {}
    originals = _Worker._recv_into, _Worker._isend
    _Worker._recv_into = _counting(calls, "recv", _Worker._recv_into)
    _Worker._isend = _counting(calls, "isend", _Worker._isend)
    try:
        with Transport(timeout_s=20, checksum=checksum) as t:
            recvs = [t.irecv(peer, FORWARD) for _ in _FALLBACK_SIZES]
            sends = [t.isend(m, peer, FORWARD) for m in _fallback_messages(rank)]
            received = [[p.to_bytes() for p in h.wait()] for h in recvs]
            for h in sends:
                h.wait()
            stats = {tuple(k): (v.messages, v.packets, v.packet_bytes, v.overhead_bytes)
                     for k, v in t.stats.items()}
            sizes = (t._senders[(peer, FORWARD)].capacity, t._receivers[(peer, FORWARD)].capacity)
    finally:
        _Worker._recv_into, _Worker._isend = originals
    return {"received": received, "stats": stats, "calls": calls, "sizes": sizes}


def _mismatch(rank: int) -> dict:
    """Rank 0 checksums, rank 1 does not; each sends one message to the other (rank 0 a two-part one)."""
    peer = 1 - rank
    out: dict = {}
    labels = {0: "stage 0", 1: "stage 1"}
    with Transport(timeout_s=20, checksum=rank == 0, peer_labels=labels) as t:
        first, second = t.irecv(peer, FORWARD), t.irecv(peer, FORWARD)
        size = 200_000 if rank == 0 else 1_000
        sent = t.isend([make_codec("none").encode(torch.ones(size // 4))], peer, FORWARD)
        for name, h in (("first", first), ("second", second)):
            try:
                h.wait(10)
                out[name] = ("ok", "", None, None)
            except PeerFailure as e:
                out[name] = (type(e).__name__, str(e), e.rank, e.label)
        try:
            sent.wait(10)  # the receiver took the whole message in before it refused it
            out["sent"] = "ok"
        except PeerFailure as e:
            out["sent"] = f"{type(e).__name__}: {e}"
    return out


def _corrupted(rank: int, checksum: bool) -> dict:
    """Rank 0 hand-builds a message whose payload does not match its header's CRC (one flipped bit; without
    checksums the header carries none) and sends it with a plain gloo send; rank 1 receives it."""
    import torch.distributed as dist

    if rank == 0:
        packet = make_codec("none").encode(torch.arange(256, dtype=torch.float32))
        header = packet.header_bytes(checksum=checksum)
        payload = bytearray(packet.payload.numpy().tobytes())
        payload[100] ^= 0x10
        flags = _FLAG_INLINE | (_FLAG_CHECKSUM if checksum else 0)
        preamble = _build_preamble(1, FORWARD, 0, len(payload), 0.0, header, flags)
        dist.send(torch.frombuffer(bytearray(preamble + payload), dtype=torch.uint8), 1,
                  tag=_TAG_BASE + FORWARD)
        return {}
    with Transport(timeout_s=20, checksum=checksum, peer_labels={0: "stage 0"}) as t:
        try:
            got = t.recv(0, FORWARD)
        except PeerFailure as e:
            return {"error": (type(e).__name__, str(e), e.rank)}
        expected = make_codec("none").encode(torch.arange(256, dtype=torch.float32)).payload
        return {"delivered": int((got[0].payload != expected).sum())}


def _layout_messages() -> list[list]:
    """Messages whose layouts repeat, change and come back, with a new tag and new values each time."""
    g = torch.Generator().manual_seed(11)
    q2, raw = make_codec("q2"), make_codec("none")
    a = lambda tag: [q2.encode(torch.randn(4, 16, generator=g)).with_tag(tag, kind=2)]  # noqa: E731
    b = lambda tag: [raw.encode(torch.randn(3, generator=g)).with_tag(tag),  # noqa: E731
                     q2.encode(torch.randn(8, 8, generator=g))]
    return [a(1), a(2), b(3), b(4), a(5), [], a(6)]


def _layouts(rank: int, corrupt: str) -> dict:
    """Rank 0 sends ``_layout_messages`` through a transport, then hand-builds one more message that repeats
    the last layout with a corrupted header CRC or payload (the preamble's own CRC valid); rank 1 receives."""
    import torch.distributed as dist

    messages = _layout_messages()
    if rank == 0:
        with Transport(timeout_s=20) as t:
            for m in messages:
                t.isend(m, 1, FORWARD).wait()
            packet = messages[-1][0].with_tag(7, kind=2)
            header = bytearray(packet.header_bytes())
            payload = bytearray(packet.payload.numpy().tobytes())
            if corrupt == "header":
                header[62] ^= 0x01
            else:
                payload[3] ^= 0x10
            preamble = _build_preamble(1, FORWARD, len(messages), len(payload), 0.0, bytes(header),
                                       _FLAG_INLINE | _FLAG_CHECKSUM)
            dist.send(torch.frombuffer(bytearray(preamble + payload), dtype=torch.uint8), 1,
                      tag=_TAG_BASE + FORWARD)
            dist.barrier()
        return {}
    out: dict = {}
    with Transport(timeout_s=20, peer_labels={0: "stage 0"}) as t:
        got = [t.recv(0, FORWARD) for _ in messages]
        out["equal"] = [[p.to_bytes() for p in g] == [p.to_bytes() for p in m] for g, m in zip(got, messages)]
        out["tags"] = [[p.tag for p in g] for g in got]
        try:
            t.recv(0, FORWARD)
            out["last"] = "delivered"
        except PeerFailure as e:
            out["last"] = str(e)
        dist.barrier()
    return out


def _pooled(rank: int) -> dict:
    """Rank 0 sends 3 bursts of 10 equal-sized messages with different values (no wait inside a burst, so
    several are in flight at once, then their buffers come back to the link's pool); rank 1 receives them."""
    g = torch.Generator().manual_seed(5)
    raw = make_codec("none")
    bursts = [[[raw.encode(torch.randn(1000, generator=g))] for _ in range(10)] for _ in range(3)]
    with Transport(timeout_s=20) as t:
        if rank == 0:
            for burst in bursts:
                for h in [t.isend(m, 1, FORWARD) for m in burst]:
                    h.wait()
            sizes = {size: len(free) for size, free in t._senders[(1, FORWARD)]._free.items()}
            t.recv(1, BACKWARD)
            return {"pool": sizes}
        got = [[t.recv(0, FORWARD) for _ in burst] for burst in bursts]
        t.send([], 0, BACKWARD)
        return {"equal": all(r[0].to_bytes() == m[0].to_bytes() for gb, b in zip(got, bursts)
                             for r, m in zip(gb, b))}


def _options_rank(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    out: dict = {}
    for checksum in (True, False):
        out[f"fallback_{checksum}"] = _fallback(rank, checksum)
        dist.barrier()
    out["mismatch"] = _mismatch(rank)
    dist.barrier()
    for checksum in (True, False):
        out[f"corrupted_{checksum}"] = _corrupted(rank, checksum)
        dist.barrier()
    for corrupt in ("header", "payload"):
        out[f"layout_{corrupt}"] = _layouts(rank, corrupt)
        dist.barrier()
    out["pooled"] = _pooled(rank)
    return out


def _raising_rank(rank: int, world_size: int) -> None:
    if rank == 1:
        raise RuntimeError("boom on purpose")


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def roundtrip():
    return run_processes(_roundtrip_rank, 2, timeout_s=60)


@pytest.fixture(scope="module")
def emulation():
    r0, r1 = run_processes(_emulation_rank, 2, timeout_s=60)
    return {**r0, **r1}


@pytest.fixture(scope="module")
def failure():
    r0, _ = run_processes(_failure_rank, 2, timeout_s=60, may_exit={1})
    return r0


@pytest.fixture(scope="module")
def options():
    return run_processes(_options_rank, 2, timeout_s=90)


# ---------------------------------------------------------------------------- tests
def test_packets_roundtrip_exactly_in_fifo_order_on_two_channels_both_ways(roundtrip):
    for rank, result in enumerate(roundtrip):
        peer = 1 - rank
        for ch in (FORWARD, BACKWARD):
            expected = [[p.to_bytes() for p in msg] for msg in _messages(peer, ch)]
            assert result["received"][ch] == expected


def test_stats_count_exactly_the_packet_bytes(roundtrip):
    for rank, result in enumerate(roundtrip):
        peer = 1 - rank
        stats = result["stats"]
        for ch in (FORWARD, BACKWARD):
            for direction, src in (("send", rank), ("recv", peer)):
                msgs = _messages(src, ch)
                n_packets = sum(len(m) for m in msgs)
                messages, packets, packet_bytes, overhead, wait_s = stats[(peer, ch, direction)]
                assert messages == MESSAGES and packets == n_packets
                assert packet_bytes == sum(p.nbytes for m in msgs for p in m)
                assert overhead == MESSAGES * PREAMBLE_BYTES - n_packets * HEADER_BYTES
                assert wait_s >= 0.0
        assert result["after_reset"] == {}


def test_bandwidth_emulation(emulation):
    e2e = emulation["big_t1"] - emulation["big_t0"]
    assert 0.3 <= e2e <= 0.5, e2e
    assert 0.3 <= emulation["big_sender_s"] <= 0.5, emulation["big_sender_s"]
    spread = emulation["chunks_t1"] - emulation["chunks_t0"]  # 2 MB on two channels sharing one line
    assert 0.3 <= spread <= 0.5, spread


def test_the_receiver_sees_a_burst_held_back_at_the_links_rate(emulation):
    # 10 x 20 kB handed over at once to a 40 Mbit/s line: each arrives one transmission time (4.1 ms) after
    # the one before, though the sender handed them over together
    nbytes, seconds = emulation["held_back"]
    assert nbytes >= 9 * (20_000 + PREAMBLE_BYTES), nbytes
    assert 8 * nbytes / seconds / 1e6 == pytest.approx(40, rel=0.15)


def test_latency_emulation_overlaps(emulation):
    small = emulation["small_t1"] - emulation["small_t0"]
    tx_small = 8 * (PREAMBLE_BYTES + 1024) / 40e6
    assert 0.02 + tx_small <= small + 1e-3 <= 0.02 + tx_small + 0.02, small
    burst = emulation["burst_t1"] - emulation["burst_t0"]
    expected = 0.02 + 10 * 8 * (PREAMBLE_BYTES + 20_000) / 40e6  # ~61 ms; serialized latency: ~241 ms
    # Upper slack: gloo's two rendezvous per message cost ~2-4 ms each on a loaded 2-core machine.
    assert expected - 1e-3 <= burst <= expected + 0.05, burst


def test_silent_peer_times_out_naming_it(failure):
    kind, message, rank, label, elapsed = failure["timeout"]
    assert kind == "PeerTimeout" and rank == 1 and label == "stage 1"
    assert "stage 1 (rank 1) did not send forward activations within 2 s" in message
    assert 2.0 <= elapsed < 3.0


def test_dead_peer_raises_peer_failure_quickly(failure):
    kind, message, rank, label, elapsed = failure["death"]
    assert kind == "PeerFailure" and rank == 1 and label == "stage 1"
    assert "stage 1 (rank 1)" in message and "backward gradients" in message
    assert elapsed < 5.0
    kind, message = failure["stale"]
    assert kind == "PeerFailure" and "stage 1 (rank 1)" in message
    kind, message = failure["send_after_death"]
    assert kind == "PeerFailure" and "stage 1 (rank 1)" in message
    assert failure["close_s"] < 3.0
    assert "closed" in failure["after_close"]


def test_run_processes_reraises_with_rank():
    with pytest.raises(ProcessFailure, match=r"rank 1 failed: RuntimeError: boom on purpose") as info:
        run_processes(_raising_rank, 2, timeout_s=60)
    assert info.value.rank == 1


def test_preamble_roundtrip_and_corruption():
    headers = bytes(range(64)) * 2
    buf = _build_preamble(2, 1, 7, 123, 1.5, headers)
    assert len(buf) == PREAMBLE_BYTES
    assert _parse_preamble(buf) == (2, 1, 7, 123, 1.5)
    for pos in (0, 5, 9, 70, PREAMBLE_BYTES - 1):
        bad = bytearray(buf)
        bad[pos] ^= 0x40
        with pytest.raises(PacketError):
            _parse_preamble(bytes(bad))
    with pytest.raises(PacketError, match="preamble"):
        _parse_preamble(buf[:-1])


def test_transport_needs_an_initialized_process_group():
    with pytest.raises(TransportError, match="init_process_group"):
        Transport()


def test_stats_key_is_a_named_tuple():
    assert StatsKey(1, FORWARD, "send") == (1, 0, "send")


@pytest.mark.parametrize("checksum", [True, False])
def test_messages_over_the_receive_size_go_in_two_parts_and_raise_it(options, checksum):
    """A message larger than the tracked receive size (64 KiB of payload at first) travels as preamble +
    payload and raises the size on both sides; the smaller ones after it travel in one gloo message; every
    message arrives intact and the byte counts are exact, with payload checksums on and off."""
    assert _FALLBACK_SIZES[0][0] > _INLINE_START and sum(_FALLBACK_SIZES[4]) > _FALLBACK_SIZES[0][0]
    for rank, result in enumerate(options):
        peer = 1 - rank
        r = result[f"fallback_{checksum}"]
        sent, received = _fallback_messages(rank), _fallback_messages(peer)
        assert r["received"] == [[p.to_bytes() for p in m] for m in received]
        n = len(_FALLBACK_SIZES)
        for direction, msgs in (("send", sent), ("recv", received)):
            packets = sum(len(m) for m in msgs)
            assert r["stats"][(peer, FORWARD, direction)] == (
                n, packets, sum(p.nbytes for m in msgs for p in m),
                n * PREAMBLE_BYTES - packets * HEADER_BYTES)
        # gloo messages: one per message plus one per two-part message, both ways
        assert r["calls"] == {"recv": n + len(_TWO_PART), "isend": n + len(_TWO_PART)}
        largest = PREAMBLE_BYTES + sum(_FALLBACK_SIZES[4])
        assert r["sizes"] == (largest, largest)


def test_checksum_setting_mismatch_fails_the_link_naming_the_peer(options):
    expect = {0: ("stage 1 (rank 1)", "without", "checksum=True"),
              1: ("stage 0 (rank 0)", "with", "checksum=False")}
    for rank, result in enumerate(options):
        r = result["mismatch"]
        peer, how, mine = expect[rank]
        kind, message, who, label = r["first"]
        assert kind == "PeerFailure" and who == 1 - rank and label == f"stage {1 - rank}"
        assert len(message.splitlines()) == 1
        assert message.startswith(f"{peer} sends forward activations {how} payload checksums")
        assert mine in message and "same setting" in message
        assert r["second"][:2] == r["first"][:2]  # the link stays failed
        assert r["sent"] == "ok"  # the whole message was taken in, a two-part one included (rank 0's)


def test_corrupted_payload_is_detected_with_checksums(options):
    kind, message, who = options[1]["corrupted_True"]["error"]
    assert kind == "PeerFailure" and who == 0
    assert message == ("stage 0 (rank 0) sent a malformed message on forward activations: corrupted packet "
                       "payload (CRC mismatch)")


def test_without_checksums_a_corrupted_payload_goes_unnoticed(options):
    """What ``checksum=False`` gives up: the same flipped bit is delivered as it came (trusted links only)."""
    assert options[1]["corrupted_False"] == {"delivered": 1}


@pytest.mark.parametrize("corrupt", ["header", "payload"])
def test_repeated_layouts_arrive_exactly_and_corruption_is_still_caught(options, corrupt):
    """The receiver parses a header layout once and reuses it while messages repeat it (tags, CRCs and values
    change); layouts that change and come back arrive exactly, and a message that repeats a known layout is
    still checked: a corrupted header CRC or payload fails the link naming the peer."""
    got = options[1][f"layout_{corrupt}"]
    assert got["equal"] == [True] * 7
    assert got["tags"] == [[1], [2], [3, 0], [4, 0], [5], [], [6]]
    assert got["last"] == ("stage 0 (rank 0) sent a malformed message on forward activations: corrupted "
                           f"packet {corrupt} (CRC mismatch)")


def test_message_buffers_are_reused_only_after_their_send_completed(options):
    """A sender link builds messages in buffers it reuses once their sends completed: bursts of equal-sized
    messages in flight together all arrive exactly, and the pool keeps at most 4 buffers of the size."""
    assert options[1]["pooled"] == {"equal": True}
    assert options[0]["pooled"]["pool"] == {576 + 4000: 4}


def test_preamble_flags():
    for flags in (0, _FLAG_INLINE, _FLAG_CHECKSUM, _FLAG_INLINE | _FLAG_CHECKSUM, _FLAG_REFUSED,
                  _FLAG_INLINE | _FLAG_REFUSED):
        buf = _build_preamble(0, 0, 0, 0, 0.0, b"", flags)
        assert _parse_preamble(buf) == (0, 0, 0, 0, 0.0) and buf[32] == flags
    with pytest.raises(PacketError, match="malformed"):
        _parse_preamble(_build_preamble(0, 0, 0, 0, 0.0, b"", 0x08))


class _FakeTransport:
    """What a handle asks of its transport: the default timeout, names, and the wait-time counter."""

    timeout_s = 5.0
    peer_labels: dict = {}
    _cuda = False

    def __init__(self) -> None:
        self.waited = 0.0

    def describe_peer(self, rank: int) -> str:
        return f"rank {rank}"

    def channel_name(self, channel: int) -> str:
        return f"channel {channel}"

    def _add_wait(self, key: StatsKey, seconds: float) -> None:
        assert key.peer == 1 and key.channel == FORWARD
        self.waited += seconds


def test_handle_completes_once_and_stays_complete():
    """A handle's completion (a bare lock) is set once: a second finish (close() racing a background thread)
    is ignored, and wait()/done() may be called any number of times, from several threads."""
    import threading

    from aqsgd.comm import RecvHandle, SendHandle
    from aqsgd.errors import PeerTimeout

    fake = _FakeTransport()
    h = RecvHandle(fake, 1, FORWARD, StatsKey(1, FORWARD, "recv"))
    assert not h.done()
    with pytest.raises(PeerTimeout, match="rank 1 did not send channel 0 within 0.01 s"):
        h.wait(timeout=0.01)
    with pytest.raises(PeerTimeout):
        h.wait(timeout=-1)  # a negative timeout: no wait at all
    got = []
    waiters = [threading.Thread(target=lambda: got.append(h.wait())) for _ in range(3)]
    for w in waiters:
        w.start()
    h._finish(["first"])
    h._finish(["second"])
    for w in waiters:
        w.join(5)
    assert got == [["first"]] * 3 and h.done() and h.wait() == ["first"]
    s = SendHandle(fake, 1, FORWARD, StatsKey(1, FORWARD, "send"))
    s._finish(error=TransportError("closed"))
    for _ in range(2):
        with pytest.raises(TransportError, match="closed"):
            s.wait()
    assert s.done() and fake.waited > 0
