"""Which rank each process of a job takes: the position its machine asks for.

A process's rank is its place in the grid (``rank = replica * stages + stage``, see
:mod:`aqsgd.parallel.grid`). torchrun's c10d rendezvous numbers the machines in the order they join and
ignores ``--node-rank``, so which machine got which stage was left to chance. Here each machine may say where
it goes:

* ``AQSGD_NODE_RANK=N`` (set on every machine, ``0..M-1`` over the M machines): the processes are ordered by
  ``(node rank, LOCAL_RANK)`` and take ranks in that order, so machine 0 holds ranks ``0..L-1`` (stage 0
  upwards), machine 1 the next ones, and so on;
* unset (or empty) everywhere: each process keeps the rank it was started with (today's order; the local
  launcher's).

:func:`take_seat` meets the job's store (the ``env://`` rendezvous that ``init_process_group`` would open),
and every process publishes a :class:`Claim` (its started rank, host, machine, node rank and local rank)
under ``aqsgd/placement/``; once all are there, every process computes the same ranks (:func:`positions`)
and ``init_process_group`` runs with this process's one. A machine is a torchrun agent (``GROUP_RANK``), or
the host name without one. Node ranks that collide, leave gaps or are set on some machines only end every
process with the same one-line :class:`~aqsgd.errors.SpecError` naming the hosts and ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import socket
from collections.abc import Sequence
from typing import Any

from aqsgd.errors import ConfigMismatchError, SpecError

__all__ = ["NODE_RANK_ENV", "Claim", "Seat", "node_rank_given", "positions", "take_seat"]

log = logging.getLogger(__name__)

NODE_RANK_ENV = "AQSGD_NODE_RANK"
_PREFIX = "aqsgd/placement/"


@dataclasses.dataclass(frozen=True)
class Claim:
    """What one process says about itself: the rank it was started with, its host, its machine (processes of
    one machine share it), its ``AQSGD_NODE_RANK`` as given (None: unset) and its ``LOCAL_RANK``."""

    rank: int
    host: str
    machine: str
    node_rank: str | None
    local_rank: int

    @classmethod
    def here(cls) -> Claim:
        """This process's claim, from its environment (``RANK``, ``GROUP_RANK``, ``LOCAL_RANK``)."""
        host = socket.gethostname()
        group = os.environ.get("GROUP_RANK")
        return cls(rank=int(os.environ["RANK"]), host=host,
                   machine=host if group is None else f"{host}/group {group}",
                   node_rank=node_rank_given(), local_rank=int(os.environ.get("LOCAL_RANK", "0")))


def node_rank_given() -> str | None:
    """This process's ``AQSGD_NODE_RANK`` as given, or None where it is unset or empty: ``AQSGD_NODE_RANK=``
    (a script's ``AQSGD_NODE_RANK=$NODE`` with NODE unset) asks for no placement, as an unset one does."""
    value = os.environ.get(NODE_RANK_ENV)
    return value if value is not None and value.strip() else None


@dataclasses.dataclass(frozen=True)
class Seat:
    """This process's place in a job about to start: the job's ``store``, the ``rank`` it takes (its
    position), ``world_size``, and the ``claim`` it made (``claim.rank`` is the rank it was started with)."""

    store: Any
    rank: int
    world_size: int
    claim: Claim

    def init_process_group(self, backend: str, timeout_s: float) -> None:
        """``init_process_group`` on the job's store with this seat's rank (as ``env://`` would do it, under
        the same ``default_pg`` key prefix)."""
        import torch.distributed as dist

        dist.init_process_group(backend, store=dist.PrefixStore("default_pg", self.store), rank=self.rank,
                                world_size=self.world_size, timeout=datetime.timedelta(seconds=timeout_s))

    def describe(self) -> str | None:
        """One line on how this process was placed (None when no node rank was given)."""
        if self.claim.node_rank is None:
            return None
        return (f"{NODE_RANK_ENV}={self.claim.node_rank} on {self.claim.host}: rank {self.rank} of "
                f"{self.world_size} (started as rank {self.claim.rank})")


def take_seat(timeout_s: float) -> Seat:
    """Collective over every process of the job (started as ranks, before ``init_process_group``): meet the
    job's store from the environment (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``), exchange
    claims and return this process's :class:`Seat`. A process that has not arrived within ``timeout_s``
    ends in a :class:`~aqsgd.errors.ConfigMismatchError` naming the missing ranks."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    claim = Claim.here()
    shared = dist.PrefixStore(_PREFIX, store)
    claims = _exchange(shared, claim, world_size, timeout_s)
    try:
        ranks = positions(claims)
    except SpecError:
        _all_read(shared, rank, world_size)
        raise
    return Seat(store, ranks[rank], world_size, claim)


def _exchange(store: Any, claim: Claim, world_size: int, timeout_s: float) -> list[Claim]:
    """Publish ``claim`` and read every process's, in started-rank order."""
    store.set(str(claim.rank), json.dumps(dataclasses.asdict(claim)))
    keys = [str(r) for r in range(world_size)]
    try:
        store.wait(keys)
    except RuntimeError:  # DistStoreError: a timeout, or the store's host is gone
        missing = [r for r in range(world_size) if not _has(store, str(r))]
        raise ConfigMismatchError(
            f"placing the stages: rank(s) {', '.join(map(str, missing)) or '?'} of {world_size} did not "
            f"arrive within {timeout_s:.0f} s; start all {world_size} processes (stages x data_parallel)"
        ) from None
    return [Claim(**json.loads(store.get(k))) for k in keys]


def _all_read(store: Any, rank: int, world_size: int, timeout_s: float = 10.0) -> None:
    """Before every process stops on the same bad placement: wait (at most ``timeout_s``) until all have read
    the claims, so that the process hosting the store (rank 0 where torchrun's agent does not host it) does
    not leave while another still reads, which would end that one with a connection error instead."""
    store.set(f"read/{rank}", "1")
    with contextlib.suppress(RuntimeError):
        store.wait([f"read/{r}" for r in range(world_size)], datetime.timedelta(seconds=timeout_s))


def _has(store: Any, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except RuntimeError:
        return False


def positions(claims: Sequence[Claim]) -> list[int]:
    """The rank each process takes, indexed by the rank it was started with (``claims`` in that order): its
    started rank when no node rank is given, else its place in the order ``(node rank, local rank)`` (module
    docstring). Raises :class:`~aqsgd.errors.SpecError` naming the hosts where node ranks are set on some
    machines only, are not integers, differ within a machine, collide or leave gaps."""
    if all(c.node_rank is None for c in claims):
        return list(range(len(claims)))
    unset = [c for c in claims if c.node_rank is None]
    if unset:
        raise SpecError(f"{NODE_RANK_ENV} is set on some machines but not on {_where(unset)}: set it on "
                        "every machine (0, 1, ...), or on none")
    node_of = _node_ranks(claims)
    _check_numbering(node_of, claims)
    order = sorted(claims, key=lambda c: (node_of[c.machine], c.local_rank, c.rank))
    ranks = [0] * len(claims)
    for position, c in enumerate(order):
        ranks[c.rank] = position
    return ranks


def _node_ranks(claims: Sequence[Claim]) -> dict[str, int]:
    """Each machine's node rank, after checking that it is a non-negative integer, one per machine."""
    node_of: dict[str, int] = {}
    for c in claims:
        try:
            node = int(str(c.node_rank).strip())
        except ValueError:
            node = -1
        if node < 0:
            raise SpecError(f"{NODE_RANK_ENV}={c.node_rank!r} on {_where([c])} is not a node rank (0, 1, ... "
                            "one per machine)")
        if node_of.setdefault(c.machine, node) != node:
            mine = [d for d in claims if d.machine == c.machine]
            given = ", ".join(f"{d.node_rank} (rank {d.rank})" for d in mine)
            raise SpecError(f"{NODE_RANK_ENV} differs between the processes of {c.host}: {given}; set one "
                            "value per machine")
    return node_of


def _check_numbering(node_of: dict[str, int], claims: Sequence[Claim]) -> None:
    """The machines' node ranks are exactly ``0..M-1``: no two machines share one, and none is left out."""
    by_node: dict[int, list[str]] = {}
    for machine, node in node_of.items():
        by_node.setdefault(node, []).append(machine)
    machines = len(node_of)
    for node, shared in sorted(by_node.items()):
        if len(shared) > 1:
            holders = [c for c in claims if c.machine in shared]
            raise SpecError(f"{NODE_RANK_ENV}={node} is set on {len(shared)} machines: {_where(holders)}; "
                            f"give each machine its own node rank 0..{machines - 1}")
    unused = [n for n in range(machines) if n not in by_node]
    if unused:
        given = "; ".join(f"{_where([c for c in claims if c.machine == m])}: {n}"
                          for n, (m,) in sorted(by_node.items()))
        raise SpecError(f"{NODE_RANK_ENV} leaves node rank(s) {', '.join(map(str, unused))} unused "
                        f"({given}); number the {machines} machines 0..{machines - 1}")


def _where(claims: Sequence[Claim]) -> str:
    """``host-a (ranks 0, 1), host-b (rank 2)``: the machines of ``claims`` and their started ranks."""
    ranks: dict[str, list[int]] = {}
    hosts: dict[str, str] = {}
    for c in claims:
        ranks.setdefault(c.machine, []).append(c.rank)
        hosts[c.machine] = c.host
    parts = []
    for machine, rs in ranks.items():
        rs.sort()
        label = "rank" if len(rs) == 1 else "ranks"
        parts.append(f"{hosts[machine]} ({label} {', '.join(map(str, rs))})")
    return ", ".join(parts)
