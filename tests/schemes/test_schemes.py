"""Boundary schemes: AQ-SGD delta, direct, EF and EF21, with sender/receiver state kept identical."""

import pytest
import torch

from aqsgd.compress import make_codec
from aqsgd.errors import CacheError, PacketMismatchError, SchemeError, SpecError
from aqsgd.schemes import Kind, Phase, make_scheme


def pair(name, codec, **kw):
    return make_scheme(name, codec, "sender", **kw), make_scheme(name, codec, "receiver", **kw)


def all_rows(cache, n):
    ids = torch.arange(n)
    seen = cache.visited(ids)
    return seen, cache.get(ids[seen])


def assert_caches_equal(s, r, n):
    s_seen, s_rows = all_rows(s.cache, n)
    r_seen, r_rows = all_rows(r.cache, n)
    assert torch.equal(s_seen, r_seen)
    assert torch.equal(s_rows, r_rows)


class DriftingActivations:
    """Per-sample activations that drift slowly from epoch to epoch, as a model's do during fine-tuning."""

    def __init__(self, n=40, shape=(6, 16), drift=0.02, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.base = torch.randn(n, *shape, generator=g) * 2
        self.direction = torch.randn(n, *shape, generator=g)
        self.drift = drift
        self.g = g

    def __call__(self, ids, epoch):
        return self.base[ids] + self.drift * epoch * self.direction[ids] + 0.002 * torch.randn(
            (len(ids), *self.base.shape[1:]), generator=self.g)


def run_epochs(sender, receiver, data, epochs, batch, n, *, check=None, warmup_epochs=0):
    """Shuffled ids, partial last batch; returns the mean relative error of the last epoch."""
    g = torch.Generator().manual_seed(123)
    errs = []
    for epoch in range(epochs):
        phase = Phase.WARMUP if epoch < warmup_epochs else Phase.TRAIN
        perm = torch.randperm(n, generator=g)
        errs = []
        for slot, start in enumerate(range(0, n, batch)):
            ids = perm[start : start + batch]
            x = data(ids, epoch)
            y = receiver.recv(sender.send(x, ids, phase=phase, slot=slot), ids, phase=phase, slot=slot)
            errs.append(float((y - x).norm() / x.norm()))
            if check:
                check(ids, x, y, epoch)
    return sum(errs) / len(errs)


def test_aqsgd_2bit_beats_direct_2bit_and_caches_stay_identical():
    n, batch = 40, 7  # 40 = 5 * 7 + 5: a partial last batch
    data = DriftingActivations(n)
    s, r = pair("delta", "q2", num_samples=n, dtype=torch.float32)

    def check(ids, x, y, epoch):
        assert_caches_equal(s, r, n)
        if epoch > 0:  # after the (full-precision) first visit the receiver computes with m(i)
            assert torch.equal(y, r.cache.get(ids))

    delta_err = run_epochs(s, r, data, epochs=6, batch=batch, n=n, check=check)
    ds, dr = pair("direct", "q2")
    direct_err = run_epochs(ds, dr, DriftingActivations(n), epochs=6, batch=batch, n=n)
    assert delta_err < direct_err / 8, (delta_err, direct_err)


def test_aqsgd_caches_identical_with_stochastic_rounding_lowbit_and_topk():
    n = 23
    for codec, cache in [("q2:stochastic", "memory"), ("q3:token", "lowbit4"), ("topk0.3", "memory:fp32"),
                         ("topk0.3+q4", "memory:bf16")]:
        s, r = pair("delta", codec, num_samples=n, cache=cache, row_shape=(6, 16))
        run_epochs(s, r, DriftingActivations(n), epochs=3, batch=5, n=n,
                   check=lambda ids, x, y, epoch: assert_caches_equal(s, r, n))


def test_first_visit_full_precision_and_mixed_batches():
    s, r = pair("delta", "q2", num_samples=10, cache="memory:fp32")
    x = torch.randn(4, 3, 5)
    ids = torch.tensor([0, 1, 2, 3])
    packets = s.send(x, ids)
    assert [p.kind for p in packets] == [Kind.RAW]
    assert torch.equal(r.recv(packets, ids), x)  # full precision the first time
    ids2 = torch.tensor([2, 7, 3, 9])  # two seen, two new
    x2 = torch.randn(4, 3, 5)
    packets = s.send(x2, ids2)
    assert [p.kind for p in packets] == [Kind.DELTA, Kind.RAW]
    assert [p.shape[0] for p in packets] == [2, 2]
    y2 = r.recv(packets, ids2)
    assert torch.equal(y2[[1, 3]], x2[[1, 3]])
    assert torch.equal(y2, r.cache.get(ids2))
    # bytes: the seen rows at 2 bits, the new ones at 32 bits
    q2 = make_codec("q2")
    assert packets[0].nbytes == q2.wire_bytes((2, 3, 5))


def test_warmup_fills_cache_then_only_deltas_travel():
    n = 12
    s, r = pair("delta", "q4", num_samples=n)
    x = torch.randn(n, 8)
    ids = torch.arange(n)
    y = r.recv(s.send(x, ids, phase="warmup"), ids, phase="warmup")
    assert torch.equal(y, x)
    assert bool(s.cache.visited(ids).all()) and bool(r.cache.visited(ids).all())
    packets = s.send(x + 0.01, ids)
    assert [p.kind for p in packets] == [Kind.DELTA]


@pytest.mark.parametrize("cache", ["memory", "memory:fp32", "lowbit4"])
def test_a_compressed_warmup_sends_the_codec_and_both_sides_cache_what_was_decoded(cache):
    # --forward auto: the warm-up and the first visits go as C(x), not in full; both caches hold decode(C(x))
    n = 23
    s, r = pair("delta", "q6", num_samples=n, cache=cache, row_shape=(6, 16))
    for scheme in (s, r):
        scheme.compress_warmup()
    data = DriftingActivations(n)
    q6 = make_codec("q6")
    ids = torch.arange(5)
    x = data(ids, 0)
    packets = s.send(x, ids, phase="warmup")
    assert [p.kind for p in packets] == [Kind.DIRECT]
    assert packets[0].nbytes == q6.wire_bytes((5, 6, 16))
    y = r.recv(packets, ids, phase="warmup")
    assert torch.equal(y, q6.decode(q6.encode(x)))
    assert 0 < float((y - x).norm() / x.norm()) < 0.05
    assert_caches_equal(s, r, n)
    # a mixed batch after the warm-up: the seen rows' deltas, then the new rows as C(x)
    ids2 = torch.tensor([3, 7, 4, 9])
    x2 = data(ids2, 1)
    packets = s.send(x2, ids2)
    assert [p.kind for p in packets] == [Kind.DELTA, Kind.DIRECT]
    assert packets[1].nbytes == q6.wire_bytes((2, 6, 16))
    r.recv(packets, ids2)
    assert_caches_equal(s, r, n)
    # later visits correct the first visit's error: AQ-SGD's update does whatever m starts from
    first = float((r.cache.get(ids) - x).norm() / x.norm())
    for _ in range(3):
        r.recv(s.send(x, ids), ids)
    assert_caches_equal(s, r, n)
    if cache != "lowbit4":  # (whose own 4-bit rows are the floor of what it holds)
        assert float((r.cache.get(ids) - x).norm() / x.norm()) < first / 4


def test_a_compressed_warmup_of_direct_and_the_schemes_that_refuse_it():
    s, r = pair("direct", "q8")
    for scheme in (s, r):
        scheme.compress_warmup()
    x = torch.randn(4, 32)
    packets = s.send(x, phase="warmup")
    assert [p.kind for p in packets] == [Kind.DIRECT]
    assert torch.equal(r.recv(packets, phase="warmup"), make_codec("q8").decode(packets[0]))
    with pytest.raises(PacketMismatchError, match="kinds"):  # a receiver that expects the warm-up in full
        make_scheme("direct", "q8", "receiver").recv(packets, phase="warmup")
    with pytest.raises(SchemeError, match="a ef21 scheme sends its warm-up in full"):
        make_scheme("ef21", "topk0.3", "sender").compress_warmup()


def test_error_feedback_sends_a_compressed_warmup_and_starts_its_error_after_it():
    s, r = pair("ef", "q2")
    for scheme in (s, r):
        scheme.compress_warmup(codec="q8")
    x = torch.randn(4, 32)
    packets = s.send(x, phase="warmup")
    q8 = make_codec("q8")
    assert [(p.kind, p.nbytes) for p in packets] == [(Kind.DIRECT, q8.wire_bytes((4, 32)))]
    assert torch.equal(r.recv(packets, phase="warmup"), q8.decode(q8.encode(x)))
    assert not s.state.buffers  # the warm-up's error is not carried: the error starts at zero after it
    y = torch.randn(4, 32)
    q2 = make_codec("q2")
    assert torch.equal(r.recv(s.send(y)), q2.decode(q2.encode(y)))


def test_a_warmup_codec_of_its_own():
    # --warmup-codec q8 on a fixed delta:q2 / direct:q4: the warm-up and first visits go as q8, the rest as
    # the scheme's codec; both caches hold what q8 decodes to
    n = 12
    s, r = pair("delta", "q2", num_samples=n, cache="memory:fp32", row_shape=(6, 16))
    for scheme in (s, r):
        scheme.compress_warmup(codec="q8")
    q2, q8 = make_codec("q2"), make_codec("q8")
    data = DriftingActivations(n)
    ids = torch.arange(4)
    x = data(ids, 0)
    packets = s.send(x, ids, phase="warmup")
    assert [(p.kind, p.nbytes) for p in packets] == [(Kind.DIRECT, q8.wire_bytes((4, 6, 16)))]
    assert torch.equal(r.recv(packets, ids, phase="warmup"), q8.decode(q8.encode(x)))
    assert_caches_equal(s, r, n)
    ids2 = torch.tensor([2, 5, 3])
    packets = s.send(data(ids2, 1), ids2)
    assert [(p.kind, p.nbytes) for p in packets] == [(Kind.DELTA, q2.wire_bytes((2, 6, 16))),
                                                     (Kind.DIRECT, q8.wire_bytes((1, 6, 16)))]
    r.recv(packets, ids2)
    assert_caches_equal(s, r, n)
    other = make_scheme("delta", "q2", "receiver", num_samples=n, cache="memory:fp32", row_shape=(6, 16))
    other.compress_warmup(codec="q6")  # sides that disagree on the warm-up codec fail by name
    with pytest.raises(PacketMismatchError, match="another codec"):
        other.recv(s.send(data(ids, 0), ids, phase="warmup"), ids, phase="warmup")
    ds, dr = pair("direct", "q4")
    for scheme in (ds, dr):
        scheme.compress_warmup(codec="q8")
    g = torch.randn(4, 32)
    assert ds.send(g, phase="warmup")[0].nbytes == q8.wire_bytes((4, 32))
    assert torch.equal(dr.recv(ds.send(g, phase="warmup"), phase="warmup"), q8.decode(q8.encode(g)))
    assert torch.equal(dr.recv(ds.send(g)), make_codec("q4").decode(make_codec("q4").encode(g)))


def test_eval_phases_leave_state_untouched():
    n = 6
    s, r = pair("delta", "q2", num_samples=n, cache="memory:fp32")
    ids = torch.arange(n)
    x = torch.randn(n, 4)
    r.recv(s.send(x, ids), ids)
    before = r.cache.get(ids).clone()
    z = torch.randn(n, 4) * 5
    y = r.recv(s.send(z, ids, phase="eval"), ids, phase="eval")
    assert torch.equal(y, make_codec("q2").roundtrip(z))  # C(z), not through the cache
    y = r.recv(s.send(z, ids, phase="eval_raw"), ids, phase="eval_raw")
    assert torch.equal(y, z)
    assert torch.equal(r.cache.get(ids), before) and torch.equal(s.cache.get(ids), before)


def test_mismatched_ids_phase_side_and_codec_are_clear_errors():
    s, r = pair("delta", "q2", num_samples=8)
    x = torch.randn(2, 4)
    packets = s.send(x, [0, 1])
    with pytest.raises(PacketMismatchError, match="sample ids"):
        r.recv(packets, [0, 2])
    with pytest.raises(PacketMismatchError, match="sample ids"):
        r.recv(packets, [0, 1], slot=1)
    with pytest.raises(PacketMismatchError, match="phase"):
        r.recv(packets, [0, 1], phase="eval")
    with pytest.raises(SchemeError, match="cannot recv"):
        s.recv(packets, [0, 1])
    with pytest.raises(SchemeError, match="cannot send"):
        r.send(x, [0, 1])
    with pytest.raises(SchemeError, match="sample ids"):
        s.send(x)
    with pytest.raises(SchemeError, match="2 rows"):
        s.send(x, [0, 1, 2])
    ds, _ = pair("direct", "q2")
    _, dr4 = pair("direct", "q4")
    with pytest.raises(PacketMismatchError, match="another codec"):
        dr4.recv(ds.send(x))


def test_capacity_and_configuration_errors():
    s = make_scheme("delta", "q2", "sender", num_samples=4)
    with pytest.raises(CacheError):
        s.send(torch.randn(1, 3), [4])
    with pytest.raises(SpecError, match="num_samples"):
        make_scheme("delta", "q2", "sender")
    with pytest.raises(SpecError, match="valid"):
        make_scheme("aqsgd2", "q2", "sender")
    with pytest.raises(SpecError, match="valid"):
        make_scheme("ef", "q2", "sender", key="epoch")
    with pytest.raises(SpecError, match="cache"):
        make_scheme("delta", "q2", "sender", num_samples=4, cache="ssd")


@pytest.mark.parametrize("key", ["slot", "sample"])
def test_error_feedback_recovers_what_topk_drops(key):
    """A constant signal through TopK 10%: direct never sends the small entries; with EF the running mean
    of what arrives converges to the signal, with EF21 the output itself does."""
    x = torch.linspace(-1, 1, 200).view(2, 100)
    ids = torch.tensor([0, 1])
    steps = 60
    results = {}
    for name in ("direct", "ef", "ef21"):
        s, r = pair(name, "topk0.1", num_samples=2, key=key)
        outs = [r.recv(s.send(x, ids), ids) for _ in range(steps)]
        results[name] = (torch.stack(outs).mean(0), outs[-1])
    err = {k: float((m - x).abs().max()) for k, (m, _) in results.items()}
    assert err["ef"] < 0.1 * err["direct"], err
    assert float((results["ef21"][1] - x).abs().max()) < 1e-2
    assert float((results["direct"][1] - x).abs().max()) > 0.5


def test_ef21_receiver_and_sender_state_identical_and_partial_slots():
    s, r = pair("ef21", "q2")
    g = torch.Generator().manual_seed(0)
    for step in range(5):
        for slot, rows in enumerate([4, 4, 3]):
            x = torch.randn(rows, 5, generator=g)
            r.recv(s.send(x, slot=slot), slot=slot)
    for slot in range(3):
        assert torch.equal(s.state.buffers[slot], r.state.buffers[slot])
    assert s.state_nbytes == (4 + 4 + 3) * 5 * 4  # fp32 buffers sized by each slot's largest batch


def test_delta_save_load_continues_identically(tmp_path):
    n = 9
    data = DriftingActivations(n, shape=(3, 4))
    s, r = pair("delta", "q2:stochastic", num_samples=n)
    run_epochs(s, r, data, epochs=2, batch=4, n=n)
    s.save(tmp_path / "s")
    r.save(tmp_path / "r")
    s2, r2 = pair("delta", "q2:stochastic", num_samples=n)
    s2.load(tmp_path / "s")
    r2.load(tmp_path / "r")
    ids = torch.tensor([3, 1, 8])
    x = data(ids, 5)
    p1, p2 = s.send(x, ids), s2.send(x, ids)  # same generator state: same stochastic rounding
    assert [a.to_bytes() for a in p1] == [b.to_bytes() for b in p2]
    assert torch.equal(r.recv(p1, ids), r2.recv(p2, ids))
    with pytest.raises(SchemeError, match="does not match"):
        make_scheme("delta", "q4", "sender", num_samples=n).load(tmp_path / "s")


def test_ef_slot_state_save_load(tmp_path):
    s, r = pair("ef", "q2")
    x = torch.randn(3, 4)
    for slot in range(2):
        r.recv(s.send(x, slot=slot), slot=slot)
    s.save(tmp_path)
    s2 = make_scheme("ef", "q2", "sender")
    s2.load(tmp_path)
    assert torch.equal(s2.state.buffers[1], s.state.buffers[1])
