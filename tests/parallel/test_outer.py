"""Outer steps (DiLoCo, ``--grad-sync diloco:H``): the spec and its one-line refusals, the outer step on its
own (2 processes), and training 2 stages x 2 replicas: H = 1 with lr 1 and no momentum is per-step parameter
averaging, the replicas end every round (and the run) with bit-identical weights, the bytes go only at the
rounds' ends, and a resume inside a round continues it exactly.

The training checks share one spawned run of four processes (start-up dominates), as test_dp_training's do.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from aqsgd.comm.testing import run_processes
from aqsgd.compress.bitpack import packed_nbytes
from aqsgd.errors import SpecError
from aqsgd.parallel import AllReduceSync, OuterSync, make_outer_sync, parse_grad_sync
from aqsgd.train.config import TrainConfig
from aqsgd.train.trainer import Trainer

from .test_dp_training import D, S, _cfg, _losses, _q8_bytes, _stage_numel, _SyncBytes

STEPS = 8  # rounds of H = 3 end at steps 3 and 6, and at the run's last step, 8


# -- the spec ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, every, lr, momentum, average", [
    ("diloco:50", 50, 0.7, 0.9, "allreduce"),
    ("diloco:1:lr1:momentum0", 1, 1.0, 0.0, "allreduce"),
    ("diloco:10:q8", 10, 0.7, 0.9, "q8"),
    ("diloco:10:lr0.5:q4:block256", 10, 0.5, 0.9, "q4:block256"),
])
def test_diloco_specs_parse(spec, every, lr, momentum, average):
    p = parse_grad_sync(spec)
    assert (p.kind, p.every, p.outer_lr, p.momentum, p.average) == ("diloco", every, lr, momentum, average)


@pytest.mark.parametrize("spec, why", [
    ("diloco", "diloco needs the outer step's interval H in steps first (diloco:50)"),
    ("diloco:0", "the outer step's interval H must be at least 1 step, got 0"),
    ("diloco:-5", "the outer step's interval H must be at least 1 step, got -5"),
    ("diloco:5:lr0", "the outer learning rate must be positive, got 0"),
    ("diloco:5:lr-0.7", "the outer learning rate must be positive, got -0.7"),
    ("diloco:5:lrx", "'lrx': lr takes a number"),
    ("diloco:5:momentum1", "the outer momentum must be in [0, 1), got 1"),
    ("diloco:5:powersgd", "diloco averages its pseudo-gradients with allreduce, q<bits>[:block<N>] or "
                          "topk<P>%[:q<bits>], got 'powersgd'"),
    ("diloco:5:q8:lr0.5", "diloco averages its pseudo-gradients with allreduce, q<bits>[:block<N>] or "
                          "topk<P>%[:q<bits>], got 'q8:lr0.5'"),
])
def test_bad_diloco_specs_are_refused_in_one_line(tmp_path, spec, why):
    with pytest.raises(SpecError) as e:
        _cfg(tmp_path, grad_sync=spec).validate()
    assert str(e.value).startswith(f"--grad-sync: invalid grad sync spec {spec!r}: {why}. Valid: ")
    assert "\n" not in str(e.value)


def test_diloco_with_one_replica_is_refused(tmp_path):
    with pytest.raises(SpecError, match=r"^--grad-sync: diloco:50 averages replicas at its outer steps: it "
                                        r"needs --data-parallel 2 or more$"):
        _cfg(tmp_path, grad_sync="diloco:50", data_parallel=1).validate()


# -- the outer step alone -----------------------------------------------------------------------------
def _outer_worker(rank: int, world: int, spec: str, moves: list[list[float]]) -> dict[str, Any]:
    torch.manual_seed(0)  # the same start on every replica
    model = nn.Linear(5, 3)
    outer = make_outer_sync(spec, list(model.parameters()))
    out: dict[str, Any] = {"weights": [], "bytes": []}
    for move in moves:  # each replica moves its weights its own way, as its inner steps would
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.full_like(p, move[rank]) * torch.arange(p.numel()).view_as(p))
        out["bytes"].append(outer.step())
        out["weights"].append([p.detach().numpy().copy() for p in model.parameters()])
    # (numpy: tensors would cross back through shared memory that the ending process takes with it)
    out["state"] = {k: v.numpy().copy() for k, v in outer.state_dict().items()}
    return out


def test_h1_lr1_no_momentum_sets_every_replica_to_the_mean():
    moves = [[0.5, -0.25], [0.125, 0.75]]
    ranks = run_processes(_outer_worker, 2, args=("diloco:1:lr1:momentum0", moves), timeout_s=120)
    a, b = ({k: [[torch.from_numpy(w) for w in ws] for ws in r[k]] if k == "weights" else r[k] for k in r}
            for r in ranks)
    torch.manual_seed(0)
    start = [p.detach().clone() for p in nn.Linear(5, 3).parameters()]
    for r, move in enumerate(moves):
        for i, s in enumerate(start):
            step = torch.arange(s.numel(), dtype=torch.float32).view_as(s)
            mean = s + step * (move[0] + move[1]) / 2  # the mean of the two replicas' weights
            torch.testing.assert_close(a["weights"][r][i], mean, rtol=0, atol=1e-6)
            assert torch.equal(a["weights"][r][i], b["weights"][r][i])  # bit-identical on both
            start[i] = a["weights"][r][i]
    n = sum(s.numel() for s in start)
    assert a["bytes"] == b["bytes"] == [4 * n] * 2  # the ring all-reduce of one fp32 copy at D = 2


def test_the_outer_step_is_nesterov_sgd_on_the_averaged_pseudo_gradient():
    moves = [[0.5, -0.25], [0.125, 0.75], [0.0, 0.0]]
    ranks = run_processes(_outer_worker, 2, args=("diloco:1", moves), timeout_s=120)
    for r in ranks:
        r["weights"] = [[torch.from_numpy(w) for w in ws] for ws in r["weights"]]
    torch.manual_seed(0)
    ref = [nn.Parameter(p.detach().clone()) for p in nn.Linear(5, 3).parameters()]
    opt = torch.optim.SGD(ref, lr=0.7, momentum=0.9, nesterov=True)
    local = [p.detach().clone() for p in ref]
    for r, move in enumerate(moves):
        for p, w in zip(ref, local):
            step = torch.arange(p.numel(), dtype=torch.float32).view_as(p)
            w.add_(step * (move[0] + move[1]) / 2)  # the mean of the replicas' moves
            p.grad = p.detach() - w
        opt.step()
        for i, p in enumerate(ref):
            torch.testing.assert_close(ranks[0]["weights"][r][i], p.detach(), rtol=1e-6, atol=1e-6)
            assert torch.equal(ranks[0]["weights"][r][i], ranks[1]["weights"][r][i])
            local[i] = p.detach().clone()
    # the state: every anchor, its momentum, the round's steps and the rounds taken
    state = ranks[0]["state"]
    assert int(state["rounds"]) == 3 and int(state["steps"]) == 0 and int(state["taken"]) == 3
    assert sorted(state) == ["anchor.0", "anchor.1", "momentum.0", "momentum.1", "rounds", "steps", "taken"]


def _world_of_one_worker(rank: int, world: int) -> list[int]:
    model = nn.Linear(4, 2)
    outer = OuterSync(list(model.parameters()), AllReduceSync(), every=3)
    outer.end = 4  # the run's last step ends a round too
    return [outer.step() for _ in range(4)] + [outer.rounds, outer.taken]


def test_rounds_end_every_h_steps_and_at_the_runs_end():
    (steps,) = run_processes(_world_of_one_worker, 1, timeout_s=60)
    # a world of one sends nothing, but the rounds are counted: steps 3 and 4 (the end)
    assert steps == [0, 0, 0, 0, 2, 4]


@pytest.mark.parametrize("kw, match", [
    (dict(every=0), "the outer step's interval must be at least 1 step, got 0"),
    (dict(every=2, lr=0.0), "the outer learning rate must be positive, got 0.0"),
    (dict(every=2, momentum=1.0), r"the outer momentum must be in \[0, 1\), got 1.0"),
])
def test_outer_sync_refuses_bad_settings(kw, match):
    sync = AllReduceSync.__new__(AllReduceSync)  # no process group is needed to be refused
    with pytest.raises(ValueError, match=match):
        OuterSync([nn.Parameter(torch.zeros(2))], sync, **kw)


# -- training ------------------------------------------------------------------------------------------
def _worker(rank: int, world: int, runs: list[tuple[str, str, int | None]]) -> dict[str, dict]:
    out = {}
    for name, text, stop_at in runs:
        sync = _SyncBytes()
        cfg = TrainConfig.from_dict(json.loads(text))
        trainer = Trainer(cfg, on_step=[sync])
        trainer.run(stop_at=stop_at)
        (stage,) = trainer.engine.stages
        module = trainer.engine.stages[stage]
        out[name] = {"coords": (trainer.grid.stage, trainer.grid.replica), "history": trainer.history,
                     "sync_bytes": sync.finish(trainer),
                     "params": {n: p.detach().cpu().numpy().copy() for n, p in module.named_parameters()}}
    return out


@pytest.fixture(scope="module")
def outer_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("outer")
    sgd = dict(optimizer="sgd", max_grad_norm=0.0, weight_decay=0.0, lr=0.05, forward="none", backward="none",
               max_steps=5)
    cfgs = {"per-step": _cfg(tmp, **sgd, grad_sync="allreduce"),
            "diloco-1": _cfg(tmp, **sgd, grad_sync="diloco:1:lr1:momentum0"),
            "h3-q8": _cfg(tmp, grad_sync="diloco:3:q8", max_steps=STEPS, checkpoint_every=4),
            "h3-topk": _cfg(tmp, grad_sync="diloco:3:topk5%:q2", max_steps=STEPS),
            "h3-part": _cfg(tmp, grad_sync="diloco:3:q8", max_steps=STEPS, checkpoint_every=4)}
    cfgs = {name: cfg.replace(run_name=name) for name, cfg in cfgs.items()}
    runs = [(n, c.to_json(), 5 if n == "h3-part" else None) for n, c in cfgs.items()]
    # the interrupted run continued from its step-4 checkpoint: one step into the second round
    resumed = cfgs["h3-part"].replace(resume=str(Path(cfgs["h3-part"].run.output_dir) / "h3-part"),
                                      overwrite=False)
    runs.append(("h3-resumed", resumed.to_json(), None))
    ranks = run_processes(_worker, S * D, args=(runs,), timeout_s=420)
    for r in ranks:
        for run in r.values():
            run["params"] = {n: torch.from_numpy(v) for n, v in run["params"].items()}
    return cfgs, ranks


def test_h1_without_momentum_is_per_step_parameter_averaging(outer_run):
    # inner SGD without clipping or weight decay: the mean of the replicas' SGD steps is the SGD step on the
    # mean gradient, so per-step parameter averaging trains as the per-step gradient all-reduce does (up to
    # float rounding: the outer step computes start - mean(start - w_i))
    _, ranks = outer_run
    for r in ranks:
        for name, value in r["diloco-1"]["params"].items():
            torch.testing.assert_close(value, r["per-step"]["params"][name], rtol=1e-5, atol=1e-6)
    a, b = _losses(ranks[1]["per-step"]["history"]), _losses(ranks[1]["diloco-1"]["history"])
    assert len(a) == len(b) == 5 and a[-1] < a[0]
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-5, atol=0)


def test_replicas_agree_after_every_round_and_bytes_go_at_its_end_only(outer_run):
    cfgs, ranks = outer_run
    numel = _stage_numel(cfgs["h3-q8"])
    for r in ranks:
        stage, _ = r["h3-q8"]["coords"]
        # rounds end at steps 3 and 6 (q8 with error feedback) and at the run's last step, 8
        q8 = _q8_bytes(numel[stage])
        assert r["h3-q8"]["sync_bytes"] == [0, 0, q8, 0, 0, q8, 0, q8]
    for a, b in ((ranks[0], ranks[2]), (ranks[1], ranks[3])):  # replicas 0 and 1 of each stage
        for name, value in a["h3-q8"]["params"].items():
            assert torch.equal(value, b["h3-q8"]["params"][name]), name
    losses = _losses(ranks[1]["h3-q8"]["history"])
    assert len(losses) == STEPS and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    # the final checkpoint: each replica's own weights (equal, the run ended a round) and the stage's agreed
    ckpt = Path(cfgs["h3-q8"].run.output_dir) / "h3-q8" / "checkpoints" / f"step-{STEPS:08d}"
    for stage in range(S):
        agreed = load_file(str(ckpt / f"stage{stage}" / "model.safetensors"))
        for replica in range(D):
            own = load_file(str(ckpt / f"stage{stage}" / f"replica{replica}" / "model.safetensors"))
            assert own.keys() == agreed.keys() and all(torch.equal(own[k], agreed[k]) for k in own)
            assert (ckpt / f"stage{stage}" / f"replica{replica}" / "outer.safetensors").is_file()


def test_topk_pseudo_gradients_agree_and_send_a_fraction(outer_run):
    cfgs, ranks = outer_run
    numel = _stage_numel(cfgs["h3-topk"])
    for r in ranks:
        stage, _ = r["h3-topk"]["coords"]
        k = math.ceil(0.05 * numel[stage])  # 4-byte indices, 2-bit values with an fp16 scale per 64
        topk = (D - 1) * (4 * k + 2 * math.ceil(k / 64) + packed_nbytes(k, 2))
        assert r["h3-topk"]["sync_bytes"] == [0, 0, topk, 0, 0, topk, 0, topk]
        assert topk < _q8_bytes(numel[stage]) / 4
    for a, b in ((ranks[0], ranks[2]), (ranks[1], ranks[3])):
        for name, value in a["h3-topk"]["params"].items():
            assert torch.equal(value, b["h3-topk"]["params"][name]), name
    losses = _losses(ranks[1]["h3-topk"]["history"])
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


def test_a_resume_inside_a_round_continues_it_exactly(outer_run):
    cfgs, ranks = outer_run
    full = _losses(ranks[1]["h3-q8"]["history"])
    resumed = _losses(ranks[1]["h3-resumed"]["history"])
    assert resumed == full[4:]  # steps 5-8, from the checkpoint of step 4 (one step into round 2)
    for r in ranks:
        # (the hook's first reading in the resumed process is the fresh engine's 0, before step 5)
        assert r["h3-resumed"]["sync_bytes"][1:] == r["h3-q8"]["sync_bytes"][4:]
        for name, value in r["h3-q8"]["params"].items():
            assert torch.equal(value, r["h3-resumed"]["params"][name]), name
    # mid-round the replicas' own weights differ, and the stage's file holds the last agreed ones
    ckpt = Path(cfgs["h3-part"].run.output_dir) / "h3-part" / "checkpoints" / "step-00000004"
    own = [load_file(str(ckpt / "stage0" / f"replica{r}" / "model.safetensors")) for r in range(D)]
    assert any(not torch.equal(own[0][k], own[1][k]) for k in own[0])
    outer = load_file(str(ckpt / "stage0" / "replica0" / "outer.safetensors"))
    assert int(outer["steps"]) == 1 and int(outer["rounds"]) == 1
