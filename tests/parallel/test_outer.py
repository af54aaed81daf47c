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
from aqsgd.parallel.elastic import elastic_available
from aqsgd.parallel import AllReduceSync, OuterSync, make_outer_sync, parse_grad_sync
from aqsgd.parallel.outer import split_fragments
from aqsgd.train.config import TrainConfig
from aqsgd.train.trainer import Trainer

from .test_dp_training import D, S, _cfg, _losses, _q8_bytes, _stage_numel, _SyncBytes

STEPS = 8  # rounds of H = 3 end at steps 3 and 6, and at the run's last step, 8
# streamed: two fragments, rounds of 4 steps, fragment 1's ending at steps 2 and 6, fragment 0's at 4, each
# averaging applied a step later; both at step 8 at once
STREAM = "diloco:4:fragments2:delay1:q8"


# -- the spec ------------------------------------------------------------------------------------------
# (streaming: fragments, delay, mix; (1, 0, 0.5) is not streamed)
@pytest.mark.parametrize("spec, every, lr, momentum, average, streaming", [
    ("diloco:50", 50, 0.7, 0.9, "allreduce", (1, 0, 0.5)),
    ("diloco:1:lr1:momentum0", 1, 1.0, 0.0, "allreduce", (1, 0, 0.5)),
    ("diloco:10:q8", 10, 0.7, 0.9, "q8", (1, 0, 0.5)),
    ("diloco:10:lr0.5:q4:block256", 10, 0.5, 0.9, "q4:block256", (1, 0, 0.5)),
    ("diloco:50:fragments2:delay5:q8", 50, 0.7, 0.9, "q8", (2, 5, 0.5)),
    ("diloco:10:delay3:mix0.25:fragments2:lr1:momentum0", 10, 1.0, 0.0, "allreduce", (2, 3, 0.25)),
    ("diloco:12:fragments4:topk3%:q2", 12, 0.7, 0.9, "topk3%:q2", (4, 0, 0.5)),
])
def test_diloco_specs_parse(spec, every, lr, momentum, average, streaming):
    p = parse_grad_sync(spec)
    assert (p.kind, p.every, p.outer_lr, p.momentum, p.average) == ("diloco", every, lr, momentum, average)
    assert (p.fragments, p.delay, p.mix) == streaming


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
    ("diloco:10:fragments0", "fragments must be 1..H (10), got 0"),
    ("diloco:10:fragments11", "fragments must be 1..H (10), got 11"),
    ("diloco:10:fragmentsx", "'fragmentsx': fragments takes a whole number"),
    ("diloco:10:fragments2:delay5", "the delay must be 0..4 steps (under H / fragments: a fragment's result "
                                    "lands before the next fragment's sync), got 5"),
    ("diloco:10:delay-1", "the delay must be 0..9 steps (under H / fragments: a fragment's result lands "
                          "before the next fragment's sync), got -1"),
    ("diloco:10:mix0.5", "mix weighs the steps taken during a delayed sync: it needs delay<T>, T >= 1"),
    ("diloco:10:delay2:mix1", "mix (the local weights' share) must be in [0, 1), got 1"),
    ("diloco:10:lr1:lr0.5", "lr given twice"),
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


@pytest.mark.skipif(not elastic_available(), reason="torchft (the elastic extra) not installed")
def test_elastic_replicas_take_streamed_outer_steps(tmp_path):
    for sync in ("diloco:4:fragments2", "diloco:4:fragments2:delay1"):
        _cfg(tmp_path, grad_sync=sync, dp_elastic=True).validate()


# -- streaming ----------------------------------------------------------------------------------------
def test_fragments_split_the_values_evenly_and_deterministically():
    # the largest first, each into the lightest fragment (the lower on a tie)
    assert split_fragments([10, 3, 7, 1], 2) == [[0, 3], [1, 2]]
    assert split_fragments([5, 5, 5, 5], 4) == [[0], [1], [2], [3]]
    assert split_fragments([4, 4], 1) == [[0, 1]]
    for n in (2, 3, 5):
        parts = split_fragments(list(range(1, 13)), n)
        assert sorted(i for part in parts for i in part) == list(range(12))  # each parameter once
        loads = [sum(i + 1 for i in part) for part in parts]
        assert max(loads) - min(loads) <= 12
    with pytest.raises(ValueError, match=r"^3 fragments of 2 trainable parameters: give 1..2$"):
        split_fragments([4, 4], 3)


class _Recorder:
    """An averaging of a world of one (no process group) that records which anchors it averaged, and when."""

    device = torch.device("cpu")
    last_raw_bytes = 0

    def __init__(self, log: list, name: int) -> None:
        self.log, self.name = log, name

    def sync(self, params, *, compress=True) -> int:
        self.log.append((self.name, len(params)))
        return 0

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state) -> None:
        assert not state


def test_fragments_end_their_rounds_staggered_and_all_at_the_runs_end():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))  # 4 parameters: 16, 4, 8, 2 values
    calls: list = []
    outer = OuterSync(list(model.parameters()), [_Recorder(calls, f) for f in range(2)], every=4)
    assert outer.fragments == [[0], [1, 2, 3]] and outer.offsets == [0, 2]  # 16 values against 14
    outer.end = 10
    due = []
    for step in range(1, 11):
        calls.clear()
        outer.step()
        due.append((step, sorted(f for f, _ in calls)))
    # fragment 1 two steps before fragment 0, both every 4 steps; both at the run's last step
    assert [d for d in due if d[1]] == [(2, [1]), (4, [0]), (6, [1]), (8, [0]), (10, [0, 1])]
    assert outer.rounds == 3 and outer.taken == 10


@pytest.mark.parametrize("kw, match", [
    (dict(every=4, delay=2), r"^the delay must be 0..1 steps, got 2$"),
    (dict(every=4, delay=1, mix=1.0), r"^mix must be in \[0, 1\), got 1.0$"),
])
def test_streaming_refuses_bad_settings(kw, match):
    params = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match=match):
        OuterSync(params, [_Recorder([], 0), _Recorder([], 1)], **kw)


def _streaming_worker(rank: int, world: int, spec: str, steps: int, cut: int) -> dict[str, Any]:
    """Replica ``rank`` moves every weight by ``2 rank + 1`` a step; its weights after every step, its bytes,
    and the same run again, stopped after ``cut`` steps and continued from its state in fresh objects."""

    def fresh() -> tuple[list[nn.Parameter], OuterSync]:
        params = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2))]  # fragment 0, fragment 1
        outer = make_outer_sync(spec, params)
        outer.end = steps
        return params, outer

    def train(params, outer, first, last, out):
        for _ in range(first, last + 1):
            with torch.no_grad():
                for p in params:
                    p.add_(2 * rank + 1)
            out["bytes"].append(outer.step())
            out["weights"].append([p.detach().tolist() for p in params])

    full: dict[str, list] = {"bytes": [], "weights": []}
    params, outer = fresh()
    train(params, outer, 1, steps, full)
    outer.close()
    cont: dict[str, list] = {"bytes": [], "weights": []}
    params, outer = fresh()
    train(params, outer, 1, cut, cont)
    state = {k: v.clone() for k, v in outer.state_dict().items()}
    weights = [p.detach().clone() for p in params]
    outer.close()
    params, outer = fresh()  # a new process's objects, from the checkpoint
    with torch.no_grad():
        for p, w in zip(params, weights):
            p.copy_(w)
    outer.load_state_dict(state)
    train(params, outer, cut + 1, steps, cont)
    outer.close()
    return {"full": full, "resumed": cont, "pending": sorted(k for k in state if k.startswith("pending"))}


def test_a_delayed_sync_lands_t_steps_later_mixed_with_the_steps_taken_meanwhile():
    # H = 4, two fragments (3 and 2 values), the averaging overlapped with 1 step, lr 1 without momentum
    # (the anchor becomes the mean of the replicas' weights when the round ended), mix 0.5. Replica 0 moves
    # by 1 a step, replica 1 by 3. Fragment 1 ends rounds at steps 2 and 6 (applied at 3 and 7), fragment 0
    # at step 4 (applied at 5); both at the run's last step, 8, at once. By hand, fragment 1: at step 2 the
    # weights are 2 and 6, the anchor becomes 4; step 3 moves them to 3 and 9, mixed with 4: 3.5 and 6.5; at
    # step 6 they are 6.5 and 15.5, the anchor 4 + 7 = 11; step 7: 7.5 and 18.5, mixed: 9.25 and 14.75;
    # step 8: 10.25 and 17.75, whose mean both take
    f1 = {0: [1, 2, 3.5, 4.5, 5.5, 6.5, 9.25, 14], 1: [3, 6, 6.5, 9.5, 12.5, 15.5, 14.75, 14]}
    # fragment 0: at step 4 the weights are 4 and 12 (anchor 8); step 5: 5 and 15, mixed: 6.5 and 11.5;
    # step 8: 9.5 and 20.5, whose mean both take
    f0 = {0: [1, 2, 3, 4, 6.5, 7.5, 8.5, 15], 1: [3, 6, 9, 12, 11.5, 14.5, 17.5, 15]}
    ranks = run_processes(_streaming_worker, 2, args=("diloco:4:lr1:momentum0:fragments2:delay1", 8, 4),
                          timeout_s=120)
    for rank, r in enumerate(ranks):
        got = r["full"]["weights"]
        assert [w[0] for w in got] == [[v] * 3 for v in f0[rank]]
        assert [w[1] for w in got] == [[v] * 2 for v in f1[rank]]
        # the bytes of the fp32 ring all-reduce at D = 2 (4 bytes a value), counted when a sync is applied
        assert r["full"]["bytes"] == [0, 0, 8, 0, 12, 0, 8, 20]
        # stopped at step 4 with fragment 0's averaging in flight: its result is in the state, and the run
        # continued from it is the uninterrupted one (its bytes counted before the stop)
        assert r["pending"] == ["pending", "pending.0"]
        assert r["resumed"]["weights"] == got
        assert r["resumed"]["bytes"] == [0, 0, 8, 0, 0, 0, 8, 20]


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
            "h3-part": _cfg(tmp, grad_sync="diloco:3:q8", max_steps=STEPS, checkpoint_every=4),
            "stream": _cfg(tmp, grad_sync=STREAM, max_steps=STEPS),
            "stream-part": _cfg(tmp, grad_sync=STREAM, max_steps=STEPS, checkpoint_every=4)}
    cfgs = {name: cfg.replace(run_name=name) for name, cfg in cfgs.items()}
    runs = [(n, c.to_json(), 5 if n.endswith("-part") else None) for n, c in cfgs.items()]
    # the interrupted runs continued from their step-4 checkpoints: one step into the second round; and with
    # fragment 0's averaging in flight, to be applied at step 5
    for name in ("h3", "stream"):
        part = cfgs[f"{name}-part"]
        resumed = part.replace(resume=str(Path(part.run.output_dir) / f"{name}-part"), overwrite=False)
        runs.append((f"{name}-resumed", resumed.to_json(), None))
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


def test_streamed_fragments_overlap_their_sync_and_the_replicas_end_agreed(outer_run):
    cfgs, ranks = outer_run
    for r in ranks:
        sent = r["stream"]["sync_bytes"]
        # each fragment's bytes counted at the step that applies them: 3 and 7 (fragment 1), 5 (fragment 0),
        # and both at the run's last step
        assert [i + 1 for i, b in enumerate(sent) if b] == [3, 5, 7, 8]
        # fragment 0 at 5, fragment 1 at 7 (8-bit codes) are the last step's two; fragment 1's first sync,
        # begun at step 2 in the warm-up epoch, went in fp32
        assert sent[4] + sent[6] == sent[7] and sent[2] > sent[6] > 0
    for a, b in ((ranks[0], ranks[2]), (ranks[1], ranks[3])):  # the run's last sync is never delayed
        for name, value in a["stream"]["params"].items():
            assert torch.equal(value, b["stream"]["params"][name]), name
    losses = _losses(ranks[1]["stream"]["history"])
    assert len(losses) == STEPS and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


def test_a_resume_with_an_averaging_in_flight_applies_it_at_its_step(outer_run):
    cfgs, ranks = outer_run
    assert _losses(ranks[1]["stream-resumed"]["history"]) == _losses(ranks[1]["stream"]["history"])[4:]
    for r in ranks:
        for name, value in r["stream"]["params"].items():
            assert torch.equal(value, r["stream-resumed"]["params"][name]), name
    ckpt = Path(cfgs["stream-part"].run.output_dir) / "stream-part" / "checkpoints" / "step-00000004"
    outer = load_file(str(ckpt / "stage0" / "replica0" / "outer.safetensors"))
    assert outer["pending"].tolist() == [0, 5]  # fragment 0's, applied at step 5


def test_a_quorum_agrees_on_what_its_members_average_or_refuses_in_one_line():
    from aqsgd.parallel.elastic import agreed_intent
    from aqsgd.parallel.outer import LAUNCH, NOW, OuterSync

    launch = list(OuterSync._intent([1], LAUNCH, True))
    assert launch == [0b10, LAUNCH, 1]
    # rows: replica, contributes, healed, then the intent (zeros: none)
    assert agreed_intent([[0, 1, 0, *launch], [1, 1, 0, *launch]], stage=0) == tuple(launch)
    # a healed member's own plan (made from the state it replaced) and a joiner's none are not counted
    healed = list(OuterSync._intent([0], NOW, True))
    rows = [[0, 1, 0, *launch], [1, 0, 1, *healed], [3, 0, 0, 0, 0, 0]]
    assert agreed_intent(rows, stage=1) == tuple(launch)
    assert agreed_intent([[0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]], stage=0) == ()  # starting together
    with pytest.raises(RuntimeError) as e:
        agreed_intent([[0, 1, 0, *launch], [2, 1, 0, *healed], [1, 1, 0, *launch]], stage=1, step=12)
    assert str(e.value) == ("stage 1: the replicas of the quorum at step 12 are in different outer steps "
                            "(replicas 0, 1: [2, 2, 1]; replica 2: [1, 1, 1])")


def _shared_state_worker(rank: int, world: int) -> tuple:
    from aqsgd.parallel.outer import _Retry

    class _Members:  # what the state asks of a membership
        def state_dict(self) -> dict:
            return {"rounds": 2}

    model = nn.Linear(4, 2)
    outer = OuterSync(list(model.parameters()), AllReduceSync(), every=4, delay=1, membership=_Members())
    # a delayed averaging in flight, to be tried again at step 5 if it fails (or by a resume)
    outer._pending = (0, 5, None)
    outer._retry = _Retry(outer._averaging_state([0])[0], [torch.ones_like(a) for a in outer.anchors],
                          True, True)
    shared = {k: v.tolist() for k, v in outer.shared_state().items()}  # (lists: back through a pipe)
    return outer.state_dict()["pending.again"].tolist(), shared


def test_a_joiner_takes_part_in_a_peers_averaging_in_flight_with_nothing_to_add():
    ((own, shared),) = run_processes(_shared_state_worker, 1, timeout_s=60)
    assert own == [1, 1]  # (compressed, this replica contributes): its checkpoint's
    assert shared["pending.again"] == [1, 0]  # the joiner's: the pseudo-gradients are the peer's
    assert "pending.0" in shared and not any(k.startswith(("average", "membership.")) for k in shared)
