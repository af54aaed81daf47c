"""The sender's error probe (``BoundaryScheme.set_probe``), which the bits chosen per link read: each probe
codec's squared error on what the scheme sends, measured without changing what it sends or stores."""

import pytest
import torch

from aqsgd.compress import make_codec
from aqsgd.schemes import Phase, make_scheme

LADDER = ["fp16", "q8", "q4", "q2:l2"]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                reason="needs CUDA"))]


def _error2(codec: str, d: torch.Tensor, x: torch.Tensor | None = None) -> float:
    """Per sample (row), ``||d - C(d)||^2 / ||x||^2``, summed over the samples."""
    c = make_codec(codec)
    x = d if x is None else x
    err = (d - c.decode(c.encode(d)).float()).flatten(1).square().sum(1)
    return float((err / x.flatten(1).square().sum(1)).sum())


@pytest.mark.parametrize("device", DEVICES)
def test_direct_probe_measures_each_codec_on_the_tensor_and_changes_nothing(device):
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(4, 8, 32, generator=g).to(device) for _ in range(3)]
    probed = make_scheme("direct", "q6", "sender", device=device)
    plain = make_scheme("direct", "q6", "sender")
    probed.set_probe(LADDER)
    assert probed.take_probe() is None  # nothing sent yet
    for slot, x in enumerate(xs):  # only slot 0 is probed: one message per step
        a, b = probed.send(x, phase=Phase.TRAIN, slot=slot), plain.send(x.cpu(), phase=Phase.TRAIN, slot=slot)
        assert [p.to_bytes() for p in a] == [p.to_bytes() for p in b]
    errs, samples = probed.take_probe()
    assert samples == 4
    assert errs == pytest.approx([_error2(c, xs[0].cpu()) for c in LADDER], rel=1e-5)
    assert errs[0] < errs[1] < errs[2] < errs[3]  # more bits, less error
    assert probed.take_probe() is None  # taken: reset
    probed.set_probe(None)
    probed.send(xs[0], phase=Phase.TRAIN, slot=0)
    assert probed.take_probe() is None


def test_delta_probe_measures_the_delta_against_the_cache_before_its_update():
    n, shape = 8, (6, 16)
    g = torch.Generator().manual_seed(1)
    base = torch.randn(n, *shape, generator=g)
    ids = torch.arange(n)
    probed = make_scheme("delta", "q4", "sender", num_samples=n, row_shape=shape)
    plain = make_scheme("delta", "q4", "sender", num_samples=n, row_shape=shape)
    probed.set_probe(LADDER)
    for s in (probed, plain):
        s.send(base, ids, phase=Phase.WARMUP, slot=1)  # fills the caches (slot 1: not probed)
    assert probed.take_probe() is None
    x = base + 0.05 * torch.randn(n, *shape, generator=g)
    m = probed.cache.get(ids)
    a, b = probed.send(x, ids, phase=Phase.TRAIN, slot=0), plain.send(x, ids, phase=Phase.TRAIN, slot=0)
    assert [p.to_bytes() for p in a] == [p.to_bytes() for p in b]  # same packets, same caches
    assert torch.equal(probed.cache.get(ids), plain.cache.get(ids))
    errs, samples = probed.take_probe()
    d = x - m  # the receiver computes m + C(d): its error is d - C(d), relative to x
    assert samples == n
    assert errs == pytest.approx([_error2(c, d, x) for c in LADDER], rel=1e-5)
    # the current codec's probed error is the error the receiver's tensor really has, but for the rounding of
    # the cache's stored rows (the probe decodes in fp32)
    real = ((x - probed.cache.get(ids)).flatten(1).square().sum(1) / x.flatten(1).square().sum(1)).sum()
    assert errs[2] == pytest.approx(float(real), rel=0.01)


def test_delta_probe_in_the_warmup_measures_the_tensor_itself():
    # no row is cached yet: the probe measures C(x) against x, what a delta against an empty cache would be
    x = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(2))
    s = make_scheme("delta", "q4", "sender", num_samples=4, row_shape=(6, 16))
    s.set_probe(["q8", "q4"])
    s.send(x, torch.arange(4), phase=Phase.WARMUP, slot=0)
    errs, _ = s.take_probe()
    assert errs == pytest.approx([_error2("q8", x), _error2("q4", x)], rel=1e-5)


def test_delta_probe_measures_first_visits_after_the_warmup_as_the_tensor_itself():
    # --warmup-epochs 0: a micro-batch of seen and new samples; the probe sums the seen rows' delta errors and
    # the new rows' own (an auto link sends them with its codec, so the choice needs their error too)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 6, 16, generator=g)
    s = make_scheme("delta", "q4", "sender", num_samples=8, row_shape=(6, 16))
    s.set_probe(["q8", "q4"])
    s.send(x[:2], torch.arange(2), phase=Phase.TRAIN, slot=0)  # every row new
    errs, samples = s.take_probe()
    assert samples == 2 and errs == pytest.approx([_error2(c, x[:2]) for c in ("q8", "q4")], rel=1e-5)
    m = s.cache.get(torch.arange(2))
    s.send(x, torch.arange(4), phase=Phase.TRAIN, slot=0)  # rows 0, 1 seen, 2, 3 new
    errs, samples = s.take_probe()
    want = [_error2(c, x[:2] - m, x[:2]) + _error2(c, x[2:]) for c in ("q8", "q4")]
    assert samples == 4 and errs == pytest.approx(want, rel=1e-5)


def test_the_probe_measures_each_sample_against_its_own_norm():
    # one sample 1000x larger than the others sets every channel's scale: the others quantize to zero. Their
    # error is 100 % of their own values, which an error relative to the whole tensor would hide: that one is
    # the large sample's own q4 error alone.
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 8, 32, generator=g)
    x[0] *= 1000
    x[3] = 0  # a sample with nothing in it is not counted
    s = make_scheme("direct", "q4", "sender")
    s.set_probe(["q4"])
    s.send(x, phase=Phase.TRAIN, slot=0)
    (err,), samples = s.take_probe()
    assert samples == 3 and (err / samples) ** 0.5 > 0.8
    c = make_codec("q4")
    assert float((x - c.decode(c.encode(x))).norm() / x.norm()) < 0.15


def test_a_step_not_probed_measures_nothing_and_sends_the_same():
    """``probe_now(False)``: the trainer probes every few steps (adaptive.PROBE_EVERY); between them the
    slot-0 message is sent as it would be, with no probe."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 8, 32, generator=g)
    probed = make_scheme("direct", "q4", "sender")
    probed.set_probe(LADDER)
    probed.probe_now(False)
    quiet = probed.send(x, phase=Phase.TRAIN, slot=0)
    assert probed.take_probe() is None
    probed.probe_now(True)
    loud = probed.send(x, phase=Phase.TRAIN, slot=0)
    errs, samples = probed.take_probe()
    assert samples == 4 and errs == pytest.approx([_error2(c, x) for c in LADDER], rel=1e-5)
    assert [p.to_bytes() for p in quiet] == [p.to_bytes() for p in loud]



def test_a_send_records_its_message_and_the_probe_runs_later(monkeypatch):
    """The probe's encodes and decodes are off the message's path: ``send`` records the message, and
    ``run_probe`` (the runner: while the stage waits) or ``take_probe`` measures it, with the same sums."""
    x = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(4))
    s = make_scheme("direct", "q6", "sender")
    s.set_probe(LADDER)
    encodes = []
    for c in s._probe:
        real = c.encode
        monkeypatch.setattr(c, "encode", lambda t, real=real, **kw: encodes.append(t) or real(t, **kw))
    s.send(x, phase=Phase.TRAIN, slot=0)
    assert s.probe_pending and not encodes  # recorded, not measured
    assert s.run_probe() and len(encodes) == len(LADDER) and not s.probe_pending
    assert not s.run_probe()  # nothing left
    errs, samples = s.take_probe()
    assert samples == 4 and errs == pytest.approx([_error2(c, x) for c in LADDER], rel=1e-5)
    s.send(x, phase=Phase.TRAIN, slot=0)
    errs2, _ = s.take_probe()  # not run yet: take_probe runs it
    assert errs2 == errs
    s.send(x, phase=Phase.TRAIN, slot=0)
    s.send(2 * x, phase=Phase.TRAIN, slot=0)  # a second message before the first was measured: both count
    errs3, samples3 = s.take_probe()
    assert samples3 == 8 and errs3 == pytest.approx([2 * e for e in errs], rel=1e-5)
