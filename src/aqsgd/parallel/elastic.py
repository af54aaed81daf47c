"""Replicas that come and go: one stage's outer-step group re-formed at every outer step, on torchft.

With outer steps (:mod:`aqsgd.parallel.outer`) the replicas of a stage meet only every H steps, which makes
membership cheap to renegotiate: a replica pipeline that died (or was stopped) is simply absent from the
next outer step, which averages whoever is there; a replica started later joins at an outer step by taking
the current weights and outer state from a peer.

The membership engine is torchft's (PyPI ``torchft``, the ``elastic`` extra), not ours:

* a **lighthouse** (:class:`Lighthouse`, torchft's ``LighthouseServer``) decides every *quorum*: the replicas
  alive (heartbeats) and asking for one. Its ``join_timeout`` is how long a quorum waits for replicas that
  have not asked yet; a replica whose heartbeats stop for ``heartbeat_timeout`` is left out;
* each replica pipeline's stages share one torchft ``Manager`` server (hosted by stage 0, reached by the
  others through the replica's own ``TCPStore``): the stages of a replica ask for the quorum together (its
  *group ranks* are the stages), so a replica is in or out as a whole pipeline;
* each stage's collectives run on torchft's ``ProcessGroupGloo``, which the manager reconfigures for every
  new quorum (a fresh gloo group of the stage's members, rank = position in the quorum);
* an outer step counts only when every stage of the replica averaged without an error (``should_commit``,
  agreed among its stages): a replica lost inside the averaging makes its peers' collective fail, and they
  average again over the next quorum (:meth:`aqsgd.parallel.outer.OuterSync.step`);
* a replica *behind* the quorum (a joiner: fewer outer steps taken) *heals*: torchft fetches a peer's state
  (``state_fn`` of that peer) and hands it to ``load_fn`` before the quorum returns. It travels over the
  stage's own gloo group (torchft's ``PGTransport``), not over torchft's default HTTP checkpoint server, which
  would listen on every interface and serve the replica's whole state to whoever asks.

Where a replica listens: its manager server listens on, and tells the lighthouse and its peers, this
machine's address on the route to the lighthouse (:func:`address_towards`): 127.0.0.1 when the lighthouse is
on loopback (one machine: nothing listens beyond it), the interface that reaches the lighthouse otherwise, so
that a replica on another machine can reach it when it joins. (torchft's manager listens on ``[::]``
whatever it is told: :func:`_manager_server_on`.)

:class:`ElasticGroup` is that for one stage process; :meth:`ElasticGroup.form` returns a :class:`Round`:
the group to average over, its members (replica indices, in group-rank order), how many of them
contribute (a replica that has just healed takes part in the collectives with a zero pseudo-gradient, so that
the average is over the replicas that trained in the round) and what they average (an *intent*, which a
healed replica follows: its own plan was made from the state it has just replaced). Membership changes
are logged (``replica 2 left before step 40``), and :attr:`ElasticGroup.history` keeps every round's
members for the run's summary.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from aqsgd.comm.launch import address_towards

__all__ = ["ElasticGroup", "Lighthouse", "Round", "agreed_intent", "elastic_available"]

log = logging.getLogger(__name__)


def elastic_available() -> bool:
    """Whether torchft (the ``elastic`` extra) is installed."""
    _quiet()
    try:
        import torchft  # noqa: F401
    except ImportError:
        return False
    return True


def _quiet() -> None:
    """torchft logs every quorum, heartbeat and commit at INFO (its servers on stderr, read from RUST_LOG when
    it loads; its Python side on its loggers): warnings and errors only. The membership changes are logged
    here, once each."""
    os.environ.setdefault("RUST_LOG", "warn")
    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _torchft() -> Any:
    _quiet()
    try:
        import torchft
        import torchft._torchft
        import torchft.process_group
    except ImportError as e:  # pragma: no cover - the message is the point
        raise ImportError("replicas that come and go need torchft: pip install 'aqsgd[elastic]'") from e
    return torchft


@contextmanager
def _manager_server_on(host: str) -> Iterator[None]:
    """torchft's ``Manager`` builds its server with ``bind="[::]:<port>"`` (every interface) and no way to
    say otherwise: while one is built, its server is built on ``host`` instead, at the same port."""
    import torchft.manager as manager

    real = manager.ManagerServer
    where = f"[{host}]" if ":" in host else host

    def on_host(*args: Any, bind: str, **kwargs: Any) -> Any:
        return real(*args, bind=f"{where}:{bind.rsplit(':', 1)[1]}", **kwargs)

    manager.ManagerServer = on_host  # type: ignore[assignment]
    try:
        yield
    finally:
        manager.ManagerServer = real  # type: ignore[misc]


class Lighthouse:
    """torchft's lighthouse on ``bind`` (default: a free loopback port): where every replica's manager asks
    for the quorum. ``min_replicas``: the fewest replicas an outer step may have; ``join_timeout_s``: how long
    a quorum waits for replicas alive but not asking yet (a new one, or a late one): keep it above a round's
    length; ``heartbeat_timeout_s``: how long a silent replica counts as alive."""

    def __init__(self, *, min_replicas: int = 1, join_timeout_s: float = 600.0,
                 heartbeat_timeout_s: float = 5.0, bind: str = "127.0.0.1:0") -> None:
        if min_replicas < 1:
            raise ValueError(f"min_replicas must be at least 1, got {min_replicas}")
        ft = _torchft()
        self._server = ft._torchft.LighthouseServer(
            bind=bind, min_replicas=min_replicas, join_timeout_ms=int(join_timeout_s * 1000),
            quorum_tick_ms=50, heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000))
        self._host = bind.rsplit(":", 1)[0].strip("[]")

    @property
    def address(self) -> str:
        """``http://host:port``, for :class:`ElasticGroup`'s ``lighthouse``: the address it listens on
        (torchft names this machine's host name instead, which need not resolve to it), or the host name where
        it listens on every interface."""
        server = self._server.address()
        if self._host in ("", "0.0.0.0", "::"):
            return server
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{server.rsplit(':', 1)[1]}"

    def shutdown(self) -> None:
        self._server.shutdown()


#: ints in an intent (:meth:`ElasticGroup.form`): what a member is about to average, as its caller encodes it
INTENT_INTS = 3


@dataclasses.dataclass(frozen=True)
class Round:
    """One outer step's group: ``members`` (replica indices in group-rank order), ``contributors`` (how many
    trained in the round), ``healed`` (this replica has just taken a peer's state), ``group`` (the process
    group of this stage's members), ``rank`` (this replica's place in it), ``intent`` (what the members
    that have a plan of their own average: :func:`agreed_intent`; empty where none has)."""

    members: tuple[int, ...]
    contributors: int
    healed: bool
    group: Any
    rank: int
    intent: tuple[int, ...] = ()

    @property
    def world(self) -> int:
        return len(self.members)


def agreed_intent(rows: list[list[int]], stage: int, step: int | None = None) -> tuple[int, ...]:
    """What a quorum's members average, from its all-gather's ``rows`` (replica, contributes, healed, then
    the intent's integers; all zero: none): the intent of the members that have one and were not healed in
    it, which must be one and the same (a quorum whose members are in different outer steps would run
    collectives that do not match; refused in one line), or ``()`` where none has one (replicas starting
    together)."""
    plans: dict[tuple[int, ...], list[int]] = {}
    for row in rows:
        plan = tuple(int(v) for v in row[3:])
        if not row[2] and any(plan):
            plans.setdefault(plan, []).append(int(row[0]))
    if len(plans) > 1:
        where = f" at step {step}" if step is not None else ""
        each = "; ".join(f"replica{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {list(p)}"
                         for p, r in plans.items())
        raise RuntimeError(f"stage {stage}: the replicas of the quorum{where} are in different outer steps "
                           f"({each})")
    return next(iter(plans), ())


class ElasticGroup:
    """Stage ``stage`` (of ``num_stages``) of replica ``replica``, among replicas that come and go (module
    docstring). ``store``: ``(host, port)`` of the replica pipeline's own ``TCPStore`` (its stages find their
    manager there); ``state_fn`` / ``load_fn``: what a joining replica takes from a peer (called in torchft's
    quorum thread while this stage waits in :meth:`form`)."""

    def __init__(self, *, replica: int, stage: int, num_stages: int, lighthouse: str, store: tuple[str, int],
                 state_fn: Callable[[], dict[str, Any]] | None = None,
                 load_fn: Callable[[dict[str, Any]], None] | None = None, timeout_s: float = 60.0,
                 quorum_timeout_s: float = 600.0, min_replicas: int = 1) -> None:
        ft = _torchft()
        self.replica, self.stage, self.num_stages = replica, stage, num_stages
        #: what a joiner takes from this replica, and how this replica takes it from a peer (settable: the
        #: trainer binds them once its engine exists)
        self.state_fn, self.load_fn = state_fn, load_fn
        self._healed = False
        timeout = datetime.timedelta(seconds=timeout_s)
        self.pg = ft.process_group.ProcessGroupGloo(timeout=timeout)
        #: where this replica's manager listens, as its peers reach it
        self.host = address_towards(lighthouse)
        from torchft.checkpointing.pg_transport import PGTransport

        with _manager_server_on(self.host):
            self.manager = ft.Manager(
                pg=self.pg, load_state_dict=self._load, state_dict=self._state, min_replica_size=min_replicas,
                use_async_quorum=False, timeout=timeout,
                quorum_timeout=datetime.timedelta(seconds=quorum_timeout_s),
                connect_timeout=timeout, rank=stage, world_size=num_stages, store_addr=store[0],
                store_port=store[1], lighthouse_addr=lighthouse, replica_id=f"replica{replica}",
                hostname=self.host, init_sync=False,
                checkpoint_transport=PGTransport(self.pg, timeout, torch.device("cpu")))
        self.history: list[tuple[int, tuple[int, ...]]] = []  # (round, members) whenever they changed
        self.rounds = 0
        self._failed = False  # the last quorum's outer step failed: the next quorum is its try again

    def _state(self) -> dict[str, Any]:
        if self.state_fn is None:
            raise RuntimeError("a replica asked for this one's state, but it has none to give (no state_fn)")
        return self.state_fn()

    def _load(self, state: dict[str, Any]) -> None:
        if self.load_fn is None:
            raise RuntimeError("this replica is behind the others but cannot take their state (no load_fn)")
        self.load_fn(state)
        self._healed = True

    def form(self, *, contributing: bool = True, step: int | None = None,
             intent: tuple[int, ...] = ()) -> Round:
        """Collective over the replicas that ask: wait for the lighthouse's quorum (a replica behind the
        others first heals: ``load_fn`` gets a peer's state), then agree on the members, the contributors and
        what they average (one all-gather of a few integers). ``contributing=False``: this replica has
        nothing to add this round. ``intent``: :data:`INTENT_INTS` integers saying what this replica is about
        to average (none: it follows the others); a healed replica's is not counted. ``step``: for the log
        lines."""
        if intent and (len(intent) != INTENT_INTS or not any(intent)):
            raise ValueError(f"an intent is {INTENT_INTS} integers, not all zero; got {intent}")
        self._healed = False
        self.manager.start_quorum(allow_heal=True)
        err = self.manager.errored()
        if err is not None:
            raise RuntimeError(f"stage {self.stage} replica {self.replica}: the outer step's quorum failed: "
                               f"{err.original_exception}") from err.original_exception
        group = self.pg.parent  # the gloo group of this quorum (torchft rebuilds it for every new quorum)
        world, rank = group.size(), group.rank()
        healed = self._healed
        width = 3 + INTENT_INTS
        mine = torch.tensor([self.replica, int(contributing and not healed), int(healed),
                             *(intent or (0,) * INTENT_INTS)], dtype=torch.int64)
        every = torch.zeros(width * world, dtype=torch.int64)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(every, mine, group=group)
        rows = every.view(world, width).tolist()
        members = tuple(int(row[0]) for row in rows)
        contributors = sum(int(row[1]) for row in rows)
        agreed = agreed_intent(rows, self.stage, step)
        where = f" at step {step}" if step is not None else ""
        before = self.history[-1][1] if self.history else None
        if members != before:
            if before is not None:
                left = sorted(set(before) - set(members))
                joined = sorted(set(members) - set(before))
                if left:  # (in a try again: lost inside the outer step that failed)
                    log.warning("stage %d: replica%s %s left %s the outer step%s; averaging over %s",
                                self.stage, "s" if len(left) > 1 else "", ", ".join(map(str, left)),
                                "inside" if self._failed else "before", where, list(members))
                if joined:
                    log.info("stage %d: replica%s %s joined at the outer step%s", self.stage,
                             "s" if len(joined) > 1 else "", ", ".join(map(str, joined)), where)
            self.history.append((self.rounds, members))
        return Round(members, max(contributors, 1), healed, group, rank, agreed)

    def report_error(self, error: Exception) -> None:
        """This stage's part of the outer step failed (a collective of the quorum's group raised): the
        replica's :meth:`commit` says no."""
        self.manager.report_error(error)

    def error(self) -> str:
        """The error reported in this quorum (for messages), or ``"none"``."""
        err = self.manager.errored()
        return "none" if err is None else str(err.original_exception)

    def commit(self) -> bool:
        """After the outer step's averaging: whether every stage of this replica took part without an error
        (torchft's ``should_commit``, agreed among the replica's stages). If so, the outer step counts (the
        manager's step, which tells a joiner it is behind); if not, the replica tries it again with the next
        quorum (:mod:`aqsgd.parallel.outer`)."""
        self._failed = not self.manager.should_commit()
        if self._failed:
            return False
        self.rounds += 1
        return True

    def state_dict(self) -> dict[str, int]:
        """For checkpoints: the outer steps committed, and the manager's step (a replica whose step is behind
        the quorum's takes a peer's state: a resumed one must be as far as it was)."""
        return {"rounds": self.rounds, **self.manager.state_dict()}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.rounds = int(state["rounds"])
        self.manager.load_state_dict({k: int(v) for k, v in state.items() if k != "rounds"})

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
