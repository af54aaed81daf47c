"""GradSync on its own: three gloo processes (an uneven split into chunks), every check in one spawned run."""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist

from aqsgd.comm import LinkSpec
from aqsgd.comm.testing import run_processes
from aqsgd.errors import SpecError
from aqsgd.parallel import GridLayout, QuantizedSync, allreduce_bytes, make_grad_sync, parse_grad_sync

WORLD = 3
# 2237 values; 4 KiB buckets -> [1200] and [30 + 1000 + 7] (no parameter splits)
SHAPES = [(40, 30), (30,), (50, 20), (7,)]


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g)
    return ps


def _set_grads(ps, grads) -> None:
    for p, g in zip(ps, grads):
        p.grad = g.clone()


def _mean_over_ranks(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for g in grads:
        every = [torch.empty_like(g) for _ in range(WORLD)]
        dist.all_gather(every, g)
        out.append(torch.stack(every).sum(0) / WORLD)
    return out


def _all_same(ps) -> bool:
    flat = torch.cat([p.grad.reshape(-1) for p in ps])
    every = [torch.empty_like(flat) for _ in range(WORLD)]
    dist.all_gather(every, flat)
    return all(torch.equal(every[0], e) for e in every[1:])


def _worker(rank: int, world: int) -> dict:
    out: dict = {}
    ps = _params(rank)
    grads = [p.grad.clone() for p in ps]
    mean = _mean_over_ranks(grads)
    err = lambda: max(float((p.grad - m).abs().max()) for p, m in zip(ps, mean))  # noqa: E731

    # fp32 all-reduce: the average (sum order is gloo's, so allclose), identical everywhere
    s = make_grad_sync("allreduce", bucket_mb=0.004)
    out["allreduce_bytes"] = s.sync(ps)
    out["allreduce_err"], out["allreduce_same"] = err(), _all_same(ps)
    out["buckets"] = s.bucket_numels

    # q8: identical on every rank, close to the average, exact byte count
    for spec in ("q8", "q4:block32"):
        _set_grads(ps, grads)
        q = make_grad_sync(spec, bucket_mb=0.004)
        out[f"{spec}_bytes"] = q.sync(ps, compress=True)
        out[f"{spec}_raw"] = q.last_raw_bytes
        out[f"{spec}_err"], out[f"{spec}_same"] = err(), _all_same(ps)
        out[f"{spec}_expected"] = sum(q.expected_bytes(n) for n in out["buckets"])

    # warm-up phase: fp32 all-reduce, error buffers untouched
    q = make_grad_sync("q8", bucket_mb=0.004)
    _set_grads(ps, grads)
    out["warmup_bytes"] = q.sync(ps, compress=False)
    out["warmup_err"], out["warmup_state"] = err(), q.state_dict()

    # error feedback: the same gradient every step at 2 bits; the running mean of what arrives converges to
    # the true mean (the error is carried, not lost), whereas one step alone is off by a coarse 2-bit step
    q2 = make_grad_sync("q2", bucket_mb=0.004)
    total = [torch.zeros_like(g) for g in grads]
    steps = 64
    for k in range(steps):
        _set_grads(ps, grads)
        q2.sync(ps)
        if k == 0:
            out["ef_first_err"] = err()
        for t, p in zip(total, ps):
            t.add_(p.grad)
    out["ef_avg_err"] = max(float((t / steps - m).abs().max()) for t, m in zip(total, mean))

    # state_dict round trip: a fresh object loaded from a checkpoint continues bit-identically
    for spec in ("q4", "powersgd:rank2"):
        a = make_grad_sync(spec, bucket_mb=0.004)
        for _ in range(3):
            _set_grads(ps, grads)
            a.sync(ps)
        state = a.state_dict()
        assert all(isinstance(v, torch.Tensor) for v in state.values())
        b = make_grad_sync(spec, bucket_mb=0.004)
        b.load_state_dict({k: v.clone() for k, v in state.items()})
        _set_grads(ps, grads)
        a.sync(ps)
        ga = [p.grad.clone() for p in ps]
        _set_grads(ps, grads)
        b.sync(ps)
        out[f"{spec}_roundtrip"] = all(torch.equal(x, p.grad) for x, p in zip(ga, ps))
        out[f"{spec}_state_keys"] = sorted(state)
        out[f"{spec}_same"] = _all_same(ps)
        try:
            b.load_state_dict({"bogus": torch.zeros(1)})
        except KeyError as e:
            out[f"{spec}_bad_key"] = str(e)

    # PowerSGD on host buckets on a machine with a GPU (gloo sync): torch's hook then synchronizes the
    # bucket's device, which raises for a host device; emulated here (a GPU machine's torch.cuda, as it
    # behaves)
    def cuda_synchronize(device=None):
        if device is not None and torch.device(device).type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {torch.device(device)}")

    results = []
    for gpu_machine in (False, True):
        with pytest.MonkeyPatch.context() as mp:
            if gpu_machine:
                mp.setattr(torch.cuda, "is_available", lambda: True)
                mp.setattr(torch.cuda, "synchronize", cuda_synchronize)
            sync = make_grad_sync("powersgd:rank2", bucket_mb=0.004)
            _set_grads(ps, grads)
            sync.sync(ps)
            results.append([p.grad.clone() for p in ps])
            out["powersgd_restores_synchronize"] = torch.cuda.synchronize is cuda_synchronize if gpu_machine \
                else True
    out["powersgd_on_a_gpu_machine"] = all(torch.equal(a, b) for a, b in zip(*results))

    # PowerSGD bytes: P and Q plus the fp32 remainder, each a ring all-reduce
    p = make_grad_sync("powersgd:rank2", bucket_mb=100)
    _set_grads(ps, grads)
    out["powersgd_bytes"], out["powersgd_raw"] = p.sync(ps), p.last_raw_bytes

    # contributors: rank 2 takes part with zeros (a replica that has just joined); the sum is divided by the 2
    # ranks that contribute, so the result is the mean of ranks 0 and 1
    mine = grads if rank < 2 else [torch.zeros_like(g) for g in grads]
    two = _mean_over_ranks(mine)
    two = [t * WORLD / 2 for t in two]
    for spec in ("allreduce", "q8", "topk100%:q8"):
        c = make_grad_sync(spec, bucket_mb=0.004)
        c.contributors = 2
        _set_grads(ps, mine)
        c.sync(ps)
        out[f"contrib_{spec}_err"] = max(float((p.grad - m).abs().max()) for p, m in zip(ps, two))
        out[f"contrib_{spec}_same"] = _all_same(ps)
    # regroup: a q8 sync over all three, then over ranks 0 and 1 only (a replica left): no stale buffer size
    g01 = dist.new_group([0, 1])
    q = make_grad_sync("q8", bucket_mb=0.004)
    _set_grads(ps, grads)
    q.sync(ps)
    ef1_before = {i: t[: b.numel].clone() for (i, t), b in zip(sorted(q.ef1.items()), q._buckets)}
    if rank < 2:
        q.regroup(g01, world=2, rank=rank)
        out["regroup_ef2_dropped"] = q.ef2 == {}
        out["regroup_ef1_kept"] = all(torch.equal(q.ef1[i][: t.numel()], t) for i, t in ef1_before.items())
        _set_grads(ps, grads)
        q.sync(ps)
        pair = [torch.empty_like(torch.cat([p.grad.reshape(-1) for p in ps])) for _ in range(2)]
        dist.all_gather(pair, torch.cat([p.grad.reshape(-1) for p in ps]), group=g01)
        out["regroup_same"] = torch.equal(pair[0], pair[1])
        out["regroup_bytes"], out["regroup_expected"] = q.last_bytes, sum(q.expected_bytes(n)
                                                                           for n in q.bucket_numels)
    dist.barrier()

    # link emulation: a sync is not shorter than its bytes over the emulated line
    slow = make_grad_sync("q8", bucket_mb=0.004, link=LinkSpec(bandwidth_bps=2e6, latency_s=0.01))
    _set_grads(ps, grads)
    t0 = time.monotonic()
    nbytes = slow.sync(ps)
    out["paced_s"], out["paced_min_s"] = time.monotonic() - t0, 8 * nbytes / 2e6 + 2 * 0.01
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_processes(_worker, WORLD, timeout_s=120)


def test_allreduce_is_the_exact_average(ranks):
    total = sum(math.prod(s) for s in SHAPES)
    assert sum(ranks[0]["buckets"]) == total and ranks[0]["buckets"] == [1200, 1037]
    for r in ranks:
        assert r["allreduce_err"] < 1e-6 and r["allreduce_same"]
        assert r["allreduce_bytes"] == sum(allreduce_bytes(4 * n, WORLD) for n in r["buckets"])
        assert (r["warmup_err"] < 1e-6 and r["warmup_bytes"] == r["allreduce_bytes"]
                and r["warmup_state"] == {})


def test_quantized_sync_is_identical_everywhere_and_close(ranks):
    for r in ranks:
        # q8: per value at most half a step in each phase, relative to its block max (|g| <~ 4 here)
        assert r["q8_same"] and r["q8_err"] < 2 * 4.5 / 254
        assert r["q4:block32_same"] and r["q4:block32_err"] < 2 * 4.5 / 14
        for spec in ("q8", "q4:block32"):
            assert r[f"{spec}_bytes"] == r[f"{spec}_expected"]


def test_quantized_byte_counts_by_hand(ranks):
    # D = 3: each bucket of n values is cut in 3 chunks of c = ceil(n / 3) rounded up to the block; each rank
    # sends 2 of its 3 chunks in the all-to-all and its one reduced chunk to 2 peers in the all-gather.
    def q(n, bits, block):
        c = math.ceil(math.ceil(n / 3) / block) * block
        return 2 * 2 * (c // block * 2 + math.ceil(c * bits / 8))

    b = ranks[0]["buckets"]
    assert ranks[0]["q8_bytes"] == sum(q(n, 8, 64) for n in b)
    assert ranks[0]["q4:block32_bytes"] == sum(q(n, 4, 32) for n in b)
    fp32 = ranks[0]["q8_raw"]
    assert fp32 == sum(-(-4 * 4 * n // 3) for n in b)  # ring all-reduce: 2 (D-1)/D * 4n
    assert 0.25 < ranks[0]["q8_bytes"] / fp32 < 0.29  # a quarter, plus scales and padding


def test_error_feedback_carries_the_quantization_error(ranks):
    for r in ranks:
        assert r["ef_first_err"] > 0.3  # one 2-bit sync is coarse
        assert r["ef_avg_err"] < r["ef_first_err"] / 10


def test_state_dict_round_trip(ranks):
    for r in ranks:
        assert r["q4_roundtrip"] and r["powersgd:rank2_roundtrip"] and r["powersgd:rank2_same"]
        assert r["q4_state_keys"] == ["ef1.0", "ef1.1", "ef2.0", "ef2.1"]
        assert {"iter", "error.0", "p.0", "q.0"} <= set(r["powersgd:rank2_state_keys"])
        assert "bogus" in r["q4_bad_key"] and "bogus" in r["powersgd:rank2_bad_key"]


def test_powersgd_bytes(ranks):
    # rank 2 factors of the two matrices (P: n x 2, Q: m x 2), the vectors in fp32; each an all-reduce
    expect = sum(allreduce_bytes(4 * k, WORLD) for k in (30 + 7, 40 * 2 + 50 * 2, 30 * 2 + 20 * 2))
    assert ranks[0]["powersgd_bytes"] == expect
    assert ranks[0]["powersgd_raw"] == allreduce_bytes(4 * sum(math.prod(s) for s in SHAPES), WORLD)


def test_link_pacing(ranks):
    for r in ranks:
        assert r["paced_s"] >= r["paced_min_s"] > 0.02


def test_contributors_divide_the_sum(ranks):
    for r in ranks:
        assert r["contrib_allreduce_err"] < 1e-6 and r["contrib_allreduce_same"]
        assert r["contrib_q8_err"] < 2 * 4.5 / 254 and r["contrib_q8_same"]
        assert r["contrib_topk100%:q8_err"] < 4.5 / 254 and r["contrib_topk100%:q8_same"]


def test_regroup_after_a_replica_left(ranks):
    for r in ranks[:2]:
        assert r["regroup_ef2_dropped"] and r["regroup_ef1_kept"] and r["regroup_same"]
        assert r["regroup_bytes"] == r["regroup_expected"] > 0
    assert "regroup_same" not in ranks[2]


def test_spec_parsing():
    assert parse_grad_sync("allreduce").kind == "allreduce"
    q = parse_grad_sync("q4:block256")
    assert (q.kind, q.bits, q.block) == ("quant", 4, 256)
    assert parse_grad_sync("q8").block == 64
    assert parse_grad_sync("powersgd:rank4").rank == 4
    assert parse_grad_sync("powersgd").rank == 1
    for bad in ("q0", "q8:block0", "q8:stochastic", "powersgd:r4", "adam", "q8:block64:block32"):
        with pytest.raises(SpecError, match="Valid: grad sync spec"):
            parse_grad_sync(bad)


def test_grid_layout():
    g = GridLayout.for_world(6, 3, 2)
    assert [g.coords(r) for r in range(6)] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    assert g.rank_of_stage(1) == [3, 4, 5] and g.dp_ranks(2) == [2, 5]
    assert g.label(4) == "stage 1 replica 1" and GridLayout(2).label(1) == "stage 1"
    with pytest.raises(ValueError, match="start exactly 6"):
        GridLayout.for_world(4, 3, 2)
    with pytest.raises(ValueError, match="data_parallel"):
        GridLayout(2, 0)


def test_quantized_sync_needs_a_group():
    with pytest.raises((RuntimeError, ValueError)):
        QuantizedSync(None)  # no process group initialized in the test process


def test_powersgd_on_host_buckets_of_a_gpu_machine(ranks):
    """torch's hook calls torch.cuda.synchronize(bucket.device) whenever CUDA is available; host buckets (gloo
    sync of GPU parameters) must not fail there, and train exactly as on a machine without a GPU."""
    assert all(r["powersgd_on_a_gpu_machine"] and r["powersgd_restores_synchronize"] for r in ranks)
