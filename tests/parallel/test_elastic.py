"""Replicas that come and go (aqsgd.parallel.elastic, on torchft): a replica pipeline killed mid-run, one
started later; the others go on, the joiner takes a peer's state and every replica ends bit-identical.

Each replica is a pipeline of two stage processes with a world of its own (as a replica launched alone would
be); the replicas meet only through torchft's lighthouse and the outer steps' process groups. The stages'
models are independent linear layers (the membership is under test here, not the pipeline)."""

from __future__ import annotations

import copy
import json
import multiprocessing
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from aqsgd.parallel.elastic import elastic_available

pytestmark = pytest.mark.skipif(not elastic_available(), reason="torchft (the elastic extra) not installed")

STAGES = 2
STEPS = 36
EVERY = 4
STEP_S = 0.1
HOLD_AT = 18  # mid-round: the others wait there for the joiner to ask for its first quorum


def _batch(replica: int, stage: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * replica + 100 * stage + step)
    x = torch.randn(8, 16, generator=g)
    return x, x.flip(1) + 0.1 * torch.randn(8, 16, generator=g)


def _replica(replica: int, stage: int, port: int, lighthouse: str, out: str, spec: str, die_at: int,
             join: bool, die_in_round: int = -1, freeze: bool = False, fail_in_round: int = -1) -> None:
    import logging

    import torch.distributed as dist
    from torch import nn

    from aqsgd.parallel import make_outer_sync
    from aqsgd.parallel.elastic import ElasticGroup

    logging.basicConfig(level=logging.INFO, filename=f"{out}/replica{replica}-stage{stage}.log",
                        format="%(name)s %(levelname)s %(message)s")
    import faulthandler
    # a hang shows where it is stuck, and ends
    tb = open(f"{out}/replica{replica}-stage{stage}.tb", "w")
    faulthandler.dump_traceback_later(150, exit=True, file=tb)
    store = dist.TCPStore("127.0.0.1", port, STAGES, is_master=stage == 0, wait_for_workers=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("pipeline", store), rank=stage, world_size=STAGES)
    torch.manual_seed(stage)  # every replica starts from the same weights
    model = nn.Linear(16, 16, bias="fragments" in spec)  # (a fragment a parameter)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    holder: dict = {}

    def state_fn() -> dict:
        return {"outer": holder["outer"].shared_state(), "model": copy.deepcopy(model.state_dict()),
                "inner": copy.deepcopy(opt.state_dict())}

    def load_fn(state: dict) -> None:
        holder["outer"].load_state_dict(state["outer"])
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["inner"])

    group = ElasticGroup(replica=replica, stage=stage, num_stages=STAGES, lighthouse=lighthouse,
                         store=("127.0.0.1", port), state_fn=state_fn, load_fn=load_fn,
                         timeout_s=5 if freeze else 30)
    outer = holder["outer"] = make_outer_sync(spec, list(model.parameters()), membership=group)
    outer.end = STEPS
    if die_in_round >= 0:  # the replica goes inside that round's outer step, once its quorum has formed:
        # stage 0 before it averages (its peers are left inside their collective), stage 1 after (its peers
        # averaged with it, and learn only from their stage 0 that the outer step failed)
        average = outer.average
        real_sync = average.sync

        def sync(params, **kw):
            if outer.rounds == die_in_round:
                if freeze:  # both stages wait here, before averaging, for the test to stop them (SIGSTOP
                    # from outside: the whole process, its heartbeats too, as a frozen machine)
                    Path(f"{out}/frozen-{replica}-{stage}").touch()
                    while True:
                        time.sleep(0.05)
                if stage == 0:
                    os._exit(3)
                real_sync(params, **kw)
                os._exit(3)
            return real_sync(params, **kw)

        average.sync = sync
    if fail_in_round >= 0 and stage == 0:  # that round's averaging succeeds everywhere but raises here
        # afterwards, once: the others take the outer step, this replica does not (its stages agree that
        # one of them failed) and is behind them
        average, failed = outer.average, []
        real_sync = average.sync

        def sync(params, **kw):
            nbytes = real_sync(params, **kw)
            if outer.rounds == fail_in_round and not failed:
                failed.append(True)
                raise RuntimeError("injected: this replica's averaging failed after the others' succeeded")
            return nbytes

        average.sync = sync
    Path(f"{out}/ready-{replica}-{stage}").touch()
    if join:
        Path(f"{out}/joining-stage{stage}").touch()
        outer.join()
    else:  # the first replicas start together (as one launch starts them)
        while not all(Path(f"{out}/ready-{r}-{s}").exists() for r in range(3) for s in range(STAGES)):
            time.sleep(0.05)
    while outer.taken < STEPS:
        step = outer.taken
        if step == die_at:
            os._exit(3)  # the whole replica pipeline goes, without a goodbye
        # the joiner's start-up takes seconds: the others must not be done before it asks
        if step == HOLD_AT and not (Path(out) / "no-joiner").exists():
            while not all(Path(f"{out}/joining-stage{s}").exists() for s in range(STAGES)):
                time.sleep(0.05)
        x, y = _batch(replica, stage, step)
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        outer.step()
        time.sleep(STEP_S)
        Path(f"{out}/replica{replica}-stage{stage}.tmp").write_text(str(outer.taken))
        os.replace(f"{out}/replica{replica}-stage{stage}.tmp", f"{out}/replica{replica}-stage{stage}.step")
    from aqsgd.comm.testing import listening_sockets

    torch.save({"weight": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                "anchor": torch.cat([a.detach().reshape(-1) for a in outer.anchors]),
                "history": group.history, "rounds": outer.rounds, "taken": outer.taken,
                "listening": [s for s in listening_sockets() if s[1] != port]},  # but the test's own store
               f"{out}/replica{replica}-stage{stage}.pt")
    group.shutdown()
    dist.destroy_process_group()


def _start(ctx, replica: int, out: Path, lighthouse: str, spec: str, die_at: int = -1,
           join: bool = False, die_in_round: int = -1, freeze: bool = False, fail_in_round: int = -1) -> list:
    from aqsgd.comm.launch import free_port

    port = free_port()
    procs = [ctx.Process(target=_replica, args=(replica, s, port, lighthouse, str(out), spec, die_at, join,
                                                die_in_round, freeze, fail_in_round))
             for s in range(STAGES)]
    for p in procs:
        p.start()
    return procs


def _exit_codes(procs: dict[int, list]) -> dict[int, list[int | None]]:
    """Each replica's processes' exit codes, once they have ended (3 minutes at most)."""
    for r, ps in procs.items():
        for p in ps:
            p.join(180)
            assert not p.is_alive(), f"replica {r} still running"
    return {r: [p.exitcode for p in ps] for r, ps in procs.items()}


def _stop(procs: dict[int, list], lighthouse) -> None:
    """Kill what is still running, and the lighthouse."""
    for ps in procs.values():
        for p in ps:
            if p.is_alive():
                p.kill()
    lighthouse.shutdown()


def _wait_for(path: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path.name}")
        time.sleep(0.01)


def _wait_step(out: Path, replica: int, step: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    f = out / f"replica{replica}-stage0.step"
    while time.monotonic() < deadline:
        if f.exists() and f.read_text() and int(f.read_text()) >= step:
            return
        time.sleep(0.05)
    raise TimeoutError(f"replica {replica} did not reach step {step}")


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["diloco:4:q8", "diloco:4:topk10%:q4", "diloco:4:fragments2:q8",
                                  "diloco:4:fragments2:delay1:q8"])
def test_replica_killed_and_one_joining(tmp_path, spec):
    from aqsgd.parallel.elastic import Lighthouse

    ctx = multiprocessing.get_context("spawn")
    lighthouse = Lighthouse(min_replicas=1, join_timeout_s=30.0, heartbeat_timeout_s=1.5)
    procs = {}
    try:
        for r, die_at in ((0, -1), (1, -1), (2, 10)):
            procs[r] = _start(ctx, r, tmp_path, lighthouse.address, spec, die_at=die_at)
        _wait_step(tmp_path, 0, 12)
        procs[3] = _start(ctx, 3, tmp_path, lighthouse.address, spec, join=True)
        codes = _exit_codes(procs)
        assert codes == {0: [0, 0], 1: [0, 0], 2: [3, 3], 3: [0, 0]}, codes
    finally:
        _stop(procs, lighthouse)
    for stage in range(STAGES):
        ends = {r: torch.load(tmp_path / f"replica{r}-stage{stage}.pt") for r in (0, 1, 3)}
        for r in (1, 3):
            assert torch.equal(ends[r]["weight"], ends[0]["weight"]), (stage, r)
            assert torch.equal(ends[r]["anchor"], ends[0]["anchor"]), (stage, r)
            assert ends[r]["taken"] == STEPS
        assert ends[0]["rounds"] == ends[3]["rounds"] == STEPS // EVERY
        # the manager (stage 0) and the gloo groups listen on loopback only, as the lighthouse does: the
        # joiner's state came over the stage's gloo group, not over an HTTP server on every interface
        for r in (0, 1, 3):
            assert ends[r]["listening"] and all(a == "127.0.0.1" for a, _ in ends[r]["listening"]), \
                (r, stage, ends[r]["listening"])
        members = [m for _, m in ends[0]["history"]]
        assert members[0] == (0, 1, 2) and members[1] == (0, 1) and members[-1] == (0, 1, 3), members
        log = (tmp_path / f"replica0-stage{stage}.log").read_text()
        # (before, or inside where it went with its averaging in flight: with a delay, the round that ends
        # at its last step)
        assert re.search(rf"stage {stage}: replica 2 left (before|inside) the outer step", log), log
        assert f"stage {stage}: replica 3 joined at the outer step" in log
    joiner = (tmp_path / "replica3-stage0.log").read_text()
    assert f"took the current weights and outer state from a peer; joins at step {HOLD_AT + 2}" in joiner
    print(json.dumps({"members": [list(m) for _, m in ends[0]["history"]]}))


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["diloco:4:q8", "diloco:4:topk10%:q4", "diloco:4:fragments2:q8",
                                  "diloco:4:fragments2:delay1:q8"])
def test_a_replica_lost_inside_the_outer_step(tmp_path, spec):
    """Replica 2 goes inside the averaging of its third outer step: its stage 0 after the quorum formed,
    before it averages, its stage 1 right after averaging. Replicas 0 and 1 see stage 0's collective fail;
    both their stages (stage 1 averaged fine) leave the outer step untaken, form the next quorum without
    replica 2 and average the same pseudo-gradients again; they end bit-identical, each outer step taken
    once."""
    procs, lighthouse = _three_replicas_losing_the_third(tmp_path, spec)
    try:
        codes = _exit_codes(procs)
        assert codes == {0: [0, 0], 1: [0, 0], 2: [3, 3]}, codes
    finally:
        _stop(procs, lighthouse)
    _retried_without_replica_2(tmp_path, spec, lambda stage: "" if stage == 0 else
                               "(another stage of this replica failed in it)")


def _three_replicas(out: Path, spec: str, **special) -> tuple[dict[int, list], object]:
    """Replicas 0-2 started together, no joiner, ``special`` (keywords of :func:`_start`) for one of them
    (``replica``): ``(processes by replica, lighthouse)``."""
    from aqsgd.parallel.elastic import Lighthouse

    ctx = multiprocessing.get_context("spawn")
    (out / "no-joiner").touch()
    lighthouse = Lighthouse(min_replicas=1, join_timeout_s=30.0, heartbeat_timeout_s=1.5)
    which = special.pop("replica")
    procs: dict[int, list] = {}
    try:
        for r in range(3):
            procs[r] = _start(ctx, r, out, lighthouse.address, spec, **(special if r == which else {}))
    except BaseException:
        _stop(procs, lighthouse)
        raise
    return procs, lighthouse


def _three_replicas_losing_the_third(out: Path, spec: str, *, freeze: bool = False):
    """Replica 2 goes inside its third outer step (``freeze``: waits there to be stopped)."""
    return _three_replicas(out, spec, replica=2, die_in_round=2, freeze=freeze)


def _retried_without_replica_2(out: Path, spec: str, why) -> None:
    """Replicas 0 and 1 after replica 2 was lost inside the third round's outer step (delayed: the second's,
    averaged on the worker thread, found failed when it is applied a step later): bit-identical, every outer
    step taken once, the failed one logged (``why(stage)``: what the log says after "failed"), tried again
    without replica 2."""
    at = 2 * EVERY + 1 if "delay1" in spec else 3 * EVERY
    for stage in range(STAGES):
        ends = {r: torch.load(out / f"replica{r}-stage{stage}.pt") for r in (0, 1)}
        assert torch.equal(ends[1]["weight"], ends[0]["weight"]), stage
        assert torch.equal(ends[1]["anchor"], ends[0]["anchor"]), stage
        for r in (0, 1):
            assert ends[r]["taken"] == STEPS and ends[r]["rounds"] == STEPS // EVERY, (stage, r)
        members = [m for _, m in ends[0]["history"]]
        assert members == [(0, 1, 2), (0, 1)], members
        for r in (0, 1):
            log = (out / f"replica{r}-stage{stage}.log").read_text()
            assert f"stage {stage} replica {r}: the outer step at step {at} failed {why(stage)}" in log, log
            assert "averaging again with the replicas still there (try 2 of 3)" in log
            assert f"stage {stage}: replica 2 left inside the outer step at step {at}" in log


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["diloco:4:q8", "diloco:4:fragments2:delay1:q8"])
def test_a_replica_frozen_inside_the_outer_step(tmp_path, spec):
    """Replica 2 is stopped (SIGSTOP, both stages) inside its third outer step, before it averages, and
    never goes on: a frozen machine rather than a closed connection. Replicas 0 and 1 wait in their collective
    until the group's timeout (5 s here), leave the outer step untaken, form the next quorum without it (its
    heartbeats stopped) and average again; they finish, bit-identical, each outer step taken once."""
    procs, lighthouse = _three_replicas_losing_the_third(tmp_path, spec, freeze=True)
    try:
        for s, p in enumerate(procs[2]):
            _wait_for(tmp_path / f"frozen-2-{s}")
            os.kill(p.pid, signal.SIGSTOP)
        codes = _exit_codes({r: procs[r] for r in (0, 1)})
        assert codes == {0: [0, 0], 1: [0, 0]}, codes
        assert all(p.is_alive() for p in procs[2])  # stopped, not gone
    finally:
        _stop(procs, lighthouse)
    # (both stages time out themselves: each logs its own error)
    _retried_without_replica_2(tmp_path, spec, lambda stage: "(")


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["diloco:4:q8", "diloco:4:fragments2:q8", "diloco:4:fragments2:delay1:q8"])
def test_a_replica_whose_averaging_alone_failed_takes_the_others_outer_step(tmp_path, spec):
    """An outer step that failed on one replica only (replica 1's stage 0 raises after averaging, in its
    third outer step; replicas 0 and 2 averaged with it and take the step): replica 1 leaves the step untaken
    and asks for the next quorum, which finds it behind the others. It takes their state (with the step it
    missed), takes part in their outer step then with nothing to add, and goes on from there; all three finish
    bit-identical. (Before, it averaged its missed step again while the others averaged their next one: the
    collectives did not match.)"""
    procs, lighthouse = _three_replicas(tmp_path, spec, replica=1, fail_in_round=2)
    try:
        codes = _exit_codes(procs)
        assert codes == {0: [0, 0], 1: [0, 0], 2: [0, 0]}, codes
    finally:
        _stop(procs, lighthouse)
    at = 2 * EVERY + 1 if "delay1" in spec else 3 * EVERY
    for stage in range(STAGES):
        ends = {r: torch.load(tmp_path / f"replica{r}-stage{stage}.pt") for r in range(3)}
        for r in (1, 2):
            assert torch.equal(ends[r]["weight"], ends[0]["weight"]), (stage, r)
            assert torch.equal(ends[r]["anchor"], ends[0]["anchor"]), (stage, r)
        for r in range(3):
            assert ends[r]["taken"] == STEPS and ends[r]["rounds"] == STEPS // EVERY, (stage, r)
            assert [m for _, m in ends[r]["history"]] == [(0, 1, 2)], (stage, r)
        for r in (0, 2):
            assert "failed" not in (tmp_path / f"replica{r}-stage{stage}.log").read_text()
        log = (tmp_path / f"replica1-stage{stage}.log").read_text()
        why = "(RuntimeError: injected" if stage == 0 else "(another stage of this replica failed in it)"
        assert f"stage {stage} replica 1: the outer step at step {at} failed {why}" in log, log
        assert re.search(rf"stage {stage} replica 1: the others took the outer step at step {at} without "
                         rf"this replica; took their state and goes on from step \d+", log), log
