"""Top-k gradient (and pseudo-gradient) sync with error feedback (``topk<P>%[:q<b>]``): three gloo processes,
every check in one spawned run, on test_sync's parameters (two buckets of uneven size)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from aqsgd.comm.testing import run_processes
from aqsgd.compress.bitpack import packed_nbytes
from aqsgd.parallel import TopKSync, make_grad_sync, parse_grad_sync

from .test_sync import WORLD, _mean_over_ranks, _params, _set_grads

ROUNDS = 4


def _flat(ps) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in ps])


def _worker(rank: int, world: int) -> dict:
    out: dict = {}
    ps = _params(rank)
    sync = make_grad_sync("topk5%:q2", bucket_mb=0.004)
    assert isinstance(sync, TopKSync)
    sent, own, avgs = [], torch.zeros(sum(p.numel() for p in ps)), []
    for t in range(ROUNDS):
        g = torch.Generator().manual_seed(100 * t + rank)
        grads = [torch.randn(p.shape, generator=g) for p in ps]
        own += torch.cat([x.reshape(-1) for x in grads])
        _set_grads(ps, grads)
        sent.append(sync.sync(ps))
        avg = _flat(ps)
        every = [torch.empty_like(avg) for _ in range(world)]
        dist.all_gather(every, avg)
        out.setdefault("identical", []).append(all(torch.equal(every[0], e) for e in every[1:]))
        avgs.append(avg)
    out["bytes"], out["buckets"] = sent, sync.bucket_numels
    # error feedback: what each rank has been given equals what it sent plus what it still holds
    held = torch.cat([sync.ef[i] for i in sorted(sync.ef)])
    mean_given = _mean_over_ranks([own])[0]
    mean_held = _mean_over_ranks([held])[0]
    out["ef_gap"] = float((mean_given - (torch.stack(avgs).sum(0) + mean_held)).abs().max())
    out["nonzero"] = [int((a != 0).sum()) for a in avgs]
    # the state round trip
    state = {k: v.clone() for k, v in sync.state_dict().items()}
    other = make_grad_sync("topk5%:q2", bucket_mb=0.004)
    other.load_state_dict(state)
    out["state_ok"] = sorted(other.state_dict()) == sorted(state) and all(
        torch.equal(other.state_dict()[k], v) for k, v in state.items())
    # everything kept, 8 bits: the average within the 8-bit grid's error of the exact mean
    ps = _params(rank)
    mean = _mean_over_ranks([p.grad.clone() for p in ps])
    make_grad_sync("topk100%:q8", bucket_mb=0.004).sync(ps)
    scale = max(float(m.abs().max()) for m in mean)
    out["full_err"] = max(float((p.grad - m).abs().max()) for p, m in zip(ps, mean)) / scale
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_processes(_worker, WORLD, timeout_s=120)


def test_every_rank_gets_the_same_average(ranks):
    assert all(all(r["identical"]) for r in ranks)


def test_bytes_by_hand(ranks):
    for r in ranks:
        assert r["buckets"] == [1200, 1037]
        per_round = 0
        for n in r["buckets"]:
            k = math.ceil(0.05 * n)  # 60, 52
            per_round += (WORLD - 1) * (4 * k + 2 * math.ceil(k / 64) + packed_nbytes(k, 2))
        assert r["bytes"] == [per_round] * ROUNDS
    # against the fp32 ring all-reduce of 2237 values at D = 3 (2 (D-1)/D of 4 bytes a value): about 1/10
    assert ranks[0]["bytes"][0] / (4 * 2237 * 4 / 3) < 0.12


def test_error_feedback_keeps_what_was_not_sent(ranks):
    # mean over ranks of everything given = everything averaged + the mean of what the ranks still hold
    assert all(r["ef_gap"] < 1e-4 for r in ranks)
    # at most D x 5 % of the values move in one sync
    assert all(n <= WORLD * (60 + 52) for n in ranks[0]["nonzero"])


def test_state_round_trip_and_everything_kept_is_close(ranks):
    assert all(r["state_ok"] for r in ranks)
    assert all(r["full_err"] < 1 / 127 for r in ranks)  # one 8-bit step of the block's largest value


@pytest.mark.parametrize("spec, why", [
    ("topk0%", "the share kept must be in (0, 100] %, got 0%"),
    ("topk101%", "the share kept must be in (0, 100] %, got 101%"),
    ("topk3%:q9", "bits must be 1..8, got 9"),
    ("topk3%:rank2", "unknown option 'rank2' (top-k takes q<bits> and block<N>)"),
])
def test_bad_topk_specs(spec, why):
    with pytest.raises(ValueError, match=f"^invalid grad sync spec '{spec}': " + why.replace("(", r"\(")
                       .replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        parse_grad_sync(spec)
