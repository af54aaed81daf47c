"""Outer steps (DiLoCo) over one stage's data-parallel group: replicas train alone for H steps, then agree.

DiLoCo (Douillard et al. 2023, arXiv 2311.08105): every replica of a stage takes H steps with its own inner
optimizer (the run's AdamW) on its own data, touching no other replica; then, in one *outer step*, the
replicas average their *pseudo-gradients* ``Δ_i = θ_start - θ_i`` (how far each moved since the round began)
and every replica applies the same outer optimizer step to ``θ_start`` (SGD with Nesterov momentum, lr 0.7,
momentum 0.9, the paper's), which becomes the next round's start and every replica's weights. Traffic:
one stage's parameters every H steps instead of one stage's gradients every step.

:class:`OuterSync` holds the round's start (the *anchor*, fp32, on the synchronization's device) as the
parameters of a ``torch.optim.SGD``: the averaged pseudo-gradient is their ``.grad``, so the outer step is
PyTorch's own SGD, its momentum buffers the outer state. The averaging is a :class:`~aqsgd.parallel.sync.
GradSync` (fp32 all-reduce or ``q<b>`` with error feedback in both phases), whose result is the same bytes on
every replica: the anchors, and with them every replica's weights after the outer step, stay bit-identical.
The pseudo-gradient's compression error is not lost: ``q<b>`` carries it into the next round's (error
feedback).

With H = 1, fp32 averaging, lr 1 and no momentum the outer step sets every replica to ``θ_start - mean(θ_start
- θ_i)``, the mean of the replicas' weights: per-step parameter averaging.

Every train step counts (a step a replica skipped for a non-finite loss too), so that every replica enters
the outer step's collectives at the same step; a round also ends at the run's last step (``end``), so that
the replicas end the run with the same weights. The state (anchors, momentum, the steps taken in the round,
the averaging's error feedback) is tensors only, for the engine's checkpoints: a resume inside a round
continues it exactly.

Streaming (Streaming DiLoCo, Douillard et al. 2025, arXiv 2501.18512), ``fragments<N>``: the trainable
parameters are split into N fragments of about equal size (:func:`split_fragments`), each with its own
averaging (and error feedback); fragment ``f`` ends its rounds ``f * H // N`` steps before fragment 0 does, so
a stage sends 1/N of its parameters at a time, N times a round, instead of all of them at once. Every fragment
ends a round at the run's last step too. ``delay<T>`` overlaps a fragment's averaging with T steps of compute:
its pseudo-gradients are taken at the round's end and averaged on a worker thread over a process group of its
own (the engine's own collectives never wait behind it); T steps later the outer step is applied and the
weights trained meanwhile are mixed in, ``θ ← mix · θ_local + (1 - mix) · θ_outer`` (mix 0.5, the paper's).
The anchors stay bit-identical on every replica; the replicas' own weights agree again at the run's end, whose
sync is never delayed. T < H / N, so at most one averaging is in flight. A checkpoint taken while one is
waits for its bytes and saves its result, so a resume applies it at the same step.

Replicas that come and go (a ``membership``, :mod:`aqsgd.parallel.elastic`): every outer step (each
fragment's) forms a quorum of the replicas there, averages over it, and is applied only once every stage of
the replica has averaged without an error; a replica lost inside the averaging makes the others try it again
over the next quorum, from the same pseudo-gradients and error feedback
(:meth:`OuterSync._agreed_outer_step`). Where the others took an outer step that failed here alone, that
quorum finds this replica behind them and gives it a peer's state: it takes part in the outer step they are
in with nothing to add (:meth:`OuterSync._follow`, as a joiner does) and goes on from their place. Every
quorum agrees on what its members average (:meth:`OuterSync._intent`), so that one behind follows it.
With a delay the quorum is formed at the round's end and the averaging agreed when it is applied, where a
failed one is tried again at once (:meth:`OuterSync._agreed_launch`); a checkpoint does not wait for the
averaging in flight but saves what it started from, and a resume averages it again at its step.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, NamedTuple

import torch
from torch import nn

from aqsgd.comm.link import LinkSpec
from aqsgd.parallel.sync import DEFAULT_BUCKET_MB, GradSync, GradSyncSpec, make_grad_sync, parse_grad_sync

log = logging.getLogger(__name__)

__all__ = ["OuterSync", "make_outer_sync", "split_fragments", "DILOCO_LR", "DILOCO_MOMENTUM",
           "DILOCO_MIX"]

DILOCO_LR = GradSyncSpec.outer_lr  # the paper's: 0.7, Nesterov momentum 0.9
DILOCO_MOMENTUM = GradSyncSpec.momentum
DILOCO_MIX = GradSyncSpec.mix  # Streaming DiLoCo's: half local, half outer
#: tries of one outer step among replicas that come and go (each replica lost inside it costs one)
TRIES = 3
# what an outer step's quorum is for (its intent's kind, :meth:`OuterSync._intent`): an outer step averaged
# and applied now; a delayed one launched (averaged on the worker thread, applied ``delay`` steps on); a
# delayed one averaged again where it is applied (its first try failed, or a resume)
NOW, LAUNCH, AGAIN = 1, 2, 3


def _one_line(error: BaseException, limit: int = 160) -> str:
    """``error`` for a log line: the first sentence of its first line, without the source location that gloo
    puts in front (``[.../pair.cc:537] Read error ...: Connection reset by peer. This is typically ...``), at
    most ``limit`` characters."""
    lines = str(error).strip().splitlines()
    text = re.sub(r"^\[[^\]]*:\d+\]\s*", "", lines[0] if lines else "")
    text = re.split(r"(?<=\.)\s", text, maxsplit=1)[0]
    text = text if len(text) <= limit else text[: limit - 3].rstrip() + "..."
    return f"{type(error).__name__}: {text}"


class _Averaging(NamedTuple):
    """One fragment's averaging as an outer step's failed try must leave it
    (:meth:`OuterSync._averaging_state`): its error feedback (copies) and the group it last averaged over."""

    state: dict[str, torch.Tensor]
    group: Any
    world: int
    rank: int


@dataclasses.dataclass
class _Retry:
    """What a delayed outer step among replicas that come and go is tried again from, should its averaging
    fail: the averaging's state before it (:meth:`OuterSync._averaging_state`), the pseudo-gradients taken at
    the round's end, whether it was compressed and whether this replica contributed."""

    saved: _Averaging
    grads: list[torch.Tensor]
    compress: bool
    contributing: bool


def split_fragments(sizes: Sequence[int], n: int) -> list[list[int]]:
    """Indices of parameters of ``sizes`` values in ``n`` fragments of about equal total size: the largest
    first, each into the lightest fragment so far (the lowest-numbered on a tie); each fragment's indices in
    order. Deterministic, so every replica splits alike."""
    if not 1 <= n <= len(sizes):
        raise ValueError(f"{n} fragments of {len(sizes)} trainable parameters: give 1..{len(sizes)}")
    loads, out = [0] * n, [[] for _ in range(n)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        f = min(range(n), key=lambda f: (loads[f], f))
        loads[f] += sizes[i]
        out[f].append(i)
    return [sorted(f) for f in out]


class OuterSync:
    """DiLoCo's outer step for the trainable parameters ``params`` of one stage (module docstring).

    ``average``: the averaging of the pseudo-gradients, one per fragment (a sequence), or one for a stage in
    one fragment; ``delay`` and ``mix``: streaming's overlap (module docstring)."""

    def __init__(self, params: Sequence[nn.Parameter], average: GradSync | Sequence[GradSync], *, every: int,
                 lr: float = DILOCO_LR, momentum: float = DILOCO_MOMENTUM, membership: Any = None,
                 delay: int = 0, mix: float = DILOCO_MIX) -> None:
        averages = list(average) if isinstance(average, (list, tuple)) else [average]
        fragments = len(averages)
        if every < 1:
            raise ValueError(f"the outer step's interval must be at least 1 step, got {every}")
        if not lr > 0:
            raise ValueError(f"the outer learning rate must be positive, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"the outer momentum must be in [0, 1), got {momentum}")
        if not 1 <= fragments <= every:
            raise ValueError(f"{fragments} fragments with rounds of {every} steps: give 1..{every}")
        if not 0 <= delay < every // fragments:
            raise ValueError(f"the delay must be 0..{every // fragments - 1} steps, got {delay}")
        if not 0 <= mix < 1:
            raise ValueError(f"mix must be in [0, 1), got {mix}")
        self.params = [p for p in params if p.requires_grad]
        self.averages = averages
        self.average = averages[0]
        self.every, self.lr, self.momentum = every, lr, momentum
        self.delay, self.mix = delay, mix
        self.fragments = split_fragments([p.numel() for p in self.params], fragments)
        # fragment f ends its rounds f * H // N steps before fragment 0 does
        self.offsets = [f * every // fragments for f in range(fragments)]
        with torch.no_grad():
            self.anchors = [nn.Parameter(p.detach().to(averages[0].device, torch.float32, copy=True))
                            for p in self.params]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.optimizer = torch.optim.SGD(self.anchors, lr=lr, momentum=momentum, nesterov=momentum > 0)
        self.steps = 0  # inner steps taken in fragment 0's current round
        self.taken = 0  # inner steps taken in all
        self.end = 0  # the run's last step (0: none known): a round ends there too (the replicas end agreed)
        self.rounds = 0  # fragment 0's rounds ended
        self.last_bytes = 0
        self.last_raw_bytes = 0
        #: an :class:`~aqsgd.parallel.elastic.ElasticGroup`: the group is re-formed at every outer step
        #: (replicas that come and go); None: the fixed group of ``average``
        self.membership = membership
        self.last_round: Any = None  # the last outer step's :class:`~aqsgd.parallel.elastic.Round`
        #: whether the last :meth:`step` took a peer's state (this replica was behind: the others took an
        #: outer step without it): its counters, and the caller's place in the data, are the others' now
        self.healed_in_step = False
        # the delayed averaging in flight: (fragment, the step it is applied at, its bytes' future; None: to
        # be averaged at that step, a resume of replicas that come and go)
        self._pending: tuple[int, int, Future[int] | None] | None = None
        # with a membership, what a delayed averaging that failed is tried again from: _Retry
        self._retry: _Retry | None = None
        self._worker: ThreadPoolExecutor | None = None

    def _due(self, fragment: int) -> bool:
        """Whether the next :meth:`step` ends ``fragment``'s round."""
        return ((self.steps + 1 + self.offsets[fragment]) % self.every == 0
                or (self.end > 0 and self.taken + 1 >= self.end))

    @property
    def due(self) -> bool:
        """Whether the next :meth:`step` takes an outer step (a fragment's round ends, the run's last step, a
        delayed averaging applied)."""
        return (any(self._due(f) for f in range(len(self.fragments)))
                or (self._pending is not None and self._pending[1] <= self.taken + 1))

    def agreed(self, param: nn.Parameter) -> torch.Tensor | None:
        """The replicas' agreed value of ``param`` (the anchor: the last outer step's result), or None for a
        parameter the outer steps do not hold (frozen, a buffer)."""
        i = self._index.get(id(param))
        return None if i is None else self.anchors[i]

    def step(self, *, compress: bool = True) -> int:
        """Count one inner step; at a fragment's round's end, its outer step (``compress=False``: the
        pseudo-gradients averaged in fp32, as in the warm-up). Returns the bytes this rank sent (0 inside a
        round; a delayed averaging's bytes count at the step that applies it)."""
        due = [f for f in range(len(self.fragments)) if self._due(f)]
        final = self.end > 0 and self.taken + 1 >= self.end
        self.steps += 1
        self.taken += 1
        self.last_bytes = self.last_raw_bytes = 0
        self.healed_in_step = False
        if self._pending is not None and (self._pending[1] <= self.taken or final):
            self._apply_pending()
        if not due or self.healed_in_step:  # (behind the others: this step is theirs now, and was followed)
            return self.last_bytes
        if self.membership is not None:
            if self.delay and not final:  # (one fragment's round ends)
                self._agreed_launch(due[0], compress, contributing=True)
            elif self._agreed_outer_step(due, compress, contributing=True):
                for f in due:
                    self._end_round(f)
            return self.last_bytes
        for f in due:
            self._pseudo_gradients(f)
            self._end_round(f)
            if self.delay and not final:
                self._launch(f, compress)
            else:
                self._outer_step(f, compress)
        return self.last_bytes

    def join(self) -> bool:
        """A replica started late, before its first step: ask for the next quorum; if the others are ahead,
        take a peer's state (weights, outer state: the membership's ``load_fn``), take part in the outer step
        they are in with nothing to add (:meth:`_follow`), and end it with the others' weights. Returns
        whether it joined running peers (False: it is among the first, and starts from its own initial
        weights)."""
        if self.membership is None:
            raise ValueError("join() needs a membership (replicas that come and go)")
        rnd = self._regroup([], contributing=False)
        if not rnd.healed:
            if not self.membership.commit():
                raise RuntimeError(f"stage {self.membership.stage} replica {self.membership.replica}: the "
                                   f"first quorum failed: {self.membership.error()}")
            return False
        log.info("stage %d replica %d: took the current weights and outer state from a peer; joins at step "
                 "%d", self.membership.stage, self.membership.replica, self.taken)
        self.last_bytes = self.last_raw_bytes = 0
        self._follow(rnd)
        self.healed_in_step = False  # (before its first step: nothing of its own was replaced)
        return True

    def _behind(self, rnd: Any, at: int) -> None:
        """This replica, in its outer step at step ``at``, found itself behind the others in ``rnd`` (they
        took an outer step that failed here, or went on without it while its heartbeats had stopped) and took
        their state: it follows their outer step (:meth:`_follow`), and its own step is over."""
        m = self.membership
        log.warning("stage %d replica %d: the others took the outer step at step %d without this replica; "
                    "took their state and goes on from step %d", m.stage, m.replica, at, self.taken)
        self.healed_in_step = True
        self._follow(rnd)

    def _follow(self, rnd: Any) -> None:
        """Take part in the outer step the others are in (``rnd``'s intent: which fragments, applied now,
        launched or averaged again, compressed or not) with nothing to add, as a replica that has just taken
        a peer's state (its counters are the peer's, inside that peer's step) or has no plan of its own; end
        it as they do. After a delayed outer step averaged again, the step may end a fragment's round too:
        that outer step is followed as well. Where the others have no outer step either (they are meeting
        before their first step: a launch resumed), there is nothing to follow. Either way the fragments not
        averaged now start their rounds' rest from the agreed weights."""
        m = self.membership
        mask, kind, compress = rnd.intent or (0, 0, 0)
        due = [f for f in range(len(self.fragments)) if mask >> f & 1]
        if rnd.intent and (not due or kind not in (NOW, LAUNCH, AGAIN)):
            raise RuntimeError(f"stage {m.stage} replica {m.replica}: the quorum's intent {list(rnd.intent)} "
                               f"names no outer step of this stage's {len(self.fragments)} fragments")
        with torch.no_grad():  # the other fragments start their rounds' rest from the replicas' agreed
            # weights: what this replica adds to their next outer step is what it trained itself
            for f in range(len(self.fragments)):
                if f not in due:
                    for i in self.fragments[f]:
                        self.params[i].copy_(self.anchors[i])
        if not rnd.intent:  # the others are meeting too, outside an outer step (all starting, or resumed):
            # nothing to average; the quorum counts as theirs does
            if not m.commit():
                raise RuntimeError(f"stage {m.stage} replica {m.replica}: the quorum failed: {m.error()}")
            return
        saved = self._averaging_state(due)
        self._adopt(rnd, due)
        if kind == LAUNCH:
            self._agreed_launch(due[0], bool(compress), contributing=False, formed=rnd, saved=saved)
            return
        if not self._agreed_outer_step(due, bool(compress), contributing=False, formed=rnd, saved=saved,
                                       mix=self.mix if kind == AGAIN else 0.0, kind=kind):
            return  # (behind again, and followed)
        if kind == NOW:
            for f in due:
                self._end_round(f)
            return
        # the delayed outer step was applied inside the others' step (its counters, already counted): a round
        # that ends at it is the step's next outer step
        final = self.end > 0 and self.taken >= self.end
        if any((self.steps + self.offsets[f]) % self.every == 0 or final for f in range(len(self.fragments))):
            self._follow(self._regroup([], contributing=False))

    def _agreed_outer_step(self, due: list[int], compress: bool, *, contributing: bool, formed: Any = None,
                           saved: list[_Averaging] | None = None,
                           grads: list[list[torch.Tensor]] | None = None, mix: float = 0.0,
                           first: Callable[[], list[int]] | None = None, kind: int | None = None) -> bool:
        """The outer step of the fragments ``due`` among replicas that come and go: the quorum (``formed``:
        already formed), their averaging, then the membership's agreement that every stage of this replica
        averaged without an error; only then the outer step. A replica lost inside the averaging makes its
        peers' collective fail (the connection closes, or the group's timeout passes): they leave the
        weights, the outer state and the error feedback as they were before it (``saved``: taken before
        ``formed``), form the next quorum without it and average the same pseudo-gradients again, up to
        :data:`TRIES` times. ``contributing=False``: a joiner, which takes part with nothing to add.

        A delayed outer step (:meth:`_agreed_launch`) comes here when it is applied: ``first``, its first
        try, made on the worker thread (its bytes, or the error it raised); ``grads``, the pseudo-gradients
        taken at the round's end (a try again averages those, not what the weights moved since); ``mix``,
        streaming's mix of the weights trained meanwhile.

        A quorum that finds this replica behind the others (they took an outer step that failed here) gives it
        their state: it follows their outer step instead (:meth:`_behind`) and returns False (True: this
        outer step was taken)."""
        membership = self.membership
        saved = saved if saved is not None else self._averaging_state(due)
        at = self.taken
        kind = kind or (AGAIN if grads is not None else NOW)  # (what a try again's quorum is for)
        for attempt in range(1, TRIES + 1):
            sent, error = [0] * len(due), None
            try:
                if first is not None:
                    sent = first()
                else:
                    rnd = formed
                    if rnd is None:
                        rnd = self._regroup(due, contributing=contributing, intent=self._intent(due, kind,
                                                                                               compress))
                        if rnd.healed:
                            self._behind(rnd, at)
                            return False
                    for k, f in enumerate(due):
                        self._pseudo_gradients(f, contributing and not rnd.healed,
                                               None if grads is None else grads[k])
                        sent[k] = self.averages[f].sync(self._anchors(f), compress=compress)
            except RuntimeError as e:  # torch.distributed's errors (gloo's closed connection, a timeout)
                error = e
                membership.report_error(e)
            first = formed = None
            if membership.commit():
                for f, nbytes in zip(due, sent):
                    self._count(nbytes, f)
                self._apply(due, mix=mix)
                return True
            self._restore_averaging(due, saved)
            why = _one_line(error) if error is not None else "another stage of this replica failed in it"
            if attempt == TRIES:
                raise RuntimeError(f"stage {membership.stage} replica {membership.replica}: the outer step "
                                   f"at step {self.taken} failed {TRIES} times; the last: {why}")
            log.warning("stage %d replica %d: the outer step at step %d failed (%s); averaging again with "
                        "the replicas still there (try %d of %d)", membership.stage, membership.replica,
                        self.taken, why, attempt + 1, TRIES)

    def _agreed_launch(self, fragment: int, compress: bool, *, contributing: bool, formed: Any = None,
                       saved: list[_Averaging] | None = None) -> None:
        """A delayed outer step among replicas that come and go: the quorum now, the averaging on the worker
        thread over its group (:meth:`_launch`), and ``delay`` steps on its agreement and the outer step
        (:meth:`_apply_pending`, through :meth:`_agreed_outer_step`, which tries a failed one again at once,
        without overlap). Where the quorum itself fails, the outer step is tried again now."""
        saved = saved if saved is not None else self._averaging_state([fragment])
        at = self.taken
        try:
            rnd = formed if formed is not None else self._regroup(
                [fragment], contributing=contributing, intent=self._intent([fragment], LAUNCH, compress))
        except RuntimeError as e:
            error = e

            def failed() -> list[int]:
                raise error

            if self._agreed_outer_step([fragment], compress, contributing=contributing, saved=saved,
                                       first=failed):
                self._end_round(fragment)
            return
        if rnd.healed and formed is None:
            self._behind(rnd, at)
            return
        self._end_round(fragment)  # (after the quorum: a replica healed in it takes this step's counters)
        self._pseudo_gradients(fragment, contributing)
        grads = [a.grad.detach().clone() for a in self._anchors(fragment)]  # type: ignore[union-attr]
        self._retry = _Retry(saved[0], grads, compress, contributing)
        self._launch(fragment, compress)

    def _averaging_state(self, fragments: list[int]) -> list[_Averaging]:
        """The error feedback (copies) and group of ``fragments``' averagings, as an outer step's failed try
        must leave them: a try that failed may have updated the error feedback with a message nobody
        received."""
        return [_Averaging({k: v.detach().clone() for k, v in a.state_dict().items()}, a.group, a.world,
                           a.group_rank) for a in (self.averages[f] for f in fragments)]

    def _restore_averaging(self, fragments: list[int], saved: list[_Averaging]) -> None:
        for f, before in zip(fragments, saved):
            average = self.averages[f]
            average.load_state_dict(before.state)
            # the group as before the try: the next quorum's regroup adapts the state from it
            average.group, average.world, average.group_rank = before.group, before.world, before.rank
            for i in self.fragments[f]:
                self.anchors[i].grad = None

    def _regroup(self, fragments: list[int], *, contributing: bool, intent: tuple[int, ...] = ()) -> Any:
        """The next quorum (``intent``: what this replica is about to average, :meth:`_intent`; none: it
        follows the others), and ``fragments``' averagings over its group, unless it found this replica
        behind (healed: what it was about to average is no longer its own)."""
        rnd = self.membership.form(contributing=contributing, step=self.taken, intent=intent)
        self.last_round = rnd
        if not rnd.healed:
            self._adopt(rnd, fragments)
        return rnd

    def _adopt(self, rnd: Any, fragments: list[int]) -> None:
        """``fragments``' averagings over ``rnd``'s group, divided by its contributors."""
        for f in fragments:
            self.averages[f].regroup(rnd.group, world=rnd.world, rank=rnd.rank)
            self.averages[f].contributors = rnd.contributors

    @staticmethod
    def _intent(fragments: list[int], kind: int, compress: bool) -> tuple[int, int, int]:
        """What an outer step's quorum is for, as the membership exchanges it: the fragments (a bit each),
        the kind (:data:`NOW`, :data:`LAUNCH`, :data:`AGAIN`), whether compressed."""
        return sum(1 << f for f in fragments), kind, int(compress)

    def _pseudo_gradients(self, fragment: int, contributing: bool = True,
                          given: list[torch.Tensor] | None = None) -> None:
        """Each anchor's ``.grad`` in ``fragment``: how far the weights moved in the round (zero for a replica
        that has nothing to add; ``given``: these, taken before)."""
        with torch.no_grad():
            for j, i in enumerate(self.fragments[fragment]):
                a = self.anchors[i]
                if not contributing:
                    a.grad = torch.zeros_like(a)
                elif given is not None:
                    a.grad = given[j].clone()
                else:
                    a.grad = a.detach() - self.params[i].detach().to(a.device, torch.float32)

    def _anchors(self, fragment: int) -> list[nn.Parameter]:
        return [self.anchors[i] for i in self.fragments[fragment]]

    def _outer_step(self, fragment: int, compress: bool) -> None:
        """Average ``fragment``'s pseudo-gradients now and apply the outer step: its weights become the
        anchors."""
        self._count(self.averages[fragment].sync(self._anchors(fragment), compress=compress), fragment)
        self._apply([fragment], mix=0.0)

    def _launch(self, fragment: int, compress: bool) -> None:
        """Average ``fragment``'s pseudo-gradients on the worker thread, to be applied ``delay`` steps on."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="outer-sync")
        future = self._worker.submit(self.averages[fragment].sync, self._anchors(fragment), compress=compress)
        self._pending = (fragment, self.taken + self.delay, future)

    def _apply_pending(self) -> None:
        fragment, _, future = self._pending  # type: ignore[misc]
        self._pending = None
        if self.membership is not None:
            retry, self._retry = self._retry, None
            assert retry is not None
            self._agreed_outer_step([fragment], retry.compress, contributing=retry.contributing,
                                    saved=[retry.saved], grads=[retry.grads], mix=self.mix,
                                    first=None if future is None else (lambda: [future.result()]))
            return
        self._count(future.result(), fragment)  # type: ignore[union-attr]
        self._apply([fragment], mix=self.mix)

    def _count(self, nbytes: int, fragment: int) -> None:
        self.last_bytes += nbytes
        self.last_raw_bytes += self.averages[fragment].last_raw_bytes

    def _apply(self, fragments: list[int], *, mix: float) -> None:
        """The outer optimizer's step on ``fragments``' anchors (their ``.grad``: the averaged
        pseudo-gradients; no other anchor has one); the weights become the new anchors, or ``mix * weights +
        (1 - mix) * anchors``. One step for several fragments is theirs one by one: SGD steps each parameter
        on its own."""
        self.optimizer.step()
        with torch.no_grad():
            for fragment in fragments:
                for i in self.fragments[fragment]:
                    a, p = self.anchors[i], self.params[i]
                    if mix:
                        p.mul_(mix).add_(a.to(p.device, p.dtype), alpha=1.0 - mix)
                    else:
                        p.copy_(a)
                    a.grad = None

    def _end_round(self, fragment: int) -> None:
        """Fragment 0's round ended: count it, and start the next."""
        if fragment == 0:
            self.steps = 0
            self.rounds += 1

    def wait(self) -> None:
        """Let a delayed averaging in flight finish (its result is kept, applied at its step). Among replicas
        that come and go its error is kept too, for the step that applies it (which tries it again)."""
        if self._pending is not None and self._pending[2] is not None:
            if self.membership is not None:
                wait_futures([self._pending[2]])
            else:
                self._pending[2].result()

    def close(self) -> None:
        """Stop the worker thread (after the averaging in flight, if any)."""
        self.wait()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    # -- checkpoints --------------------------------------------------------------------------------------
    def shared_state(self) -> dict[str, torch.Tensor]:
        """What a joining replica takes from a peer: :meth:`state_dict` without the averaging's error
        feedback (a replica's own; the joiner's starts at zero). A delayed averaging to be tried again (one
        in flight, among replicas that come and go) is the joiner's to take part in with nothing to add: the
        pseudo-gradients it holds are the peer's."""
        state = {k: v.detach().clone() for k, v in self.state_dict().items()
                 if not k.startswith(("average", "membership."))}
        if "pending.again" in state:
            state["pending.again"][1] = 0  # (whether compressed, whether this replica contributes)
        return state

    @staticmethod
    def _average_prefix(fragment: int) -> str:
        return "average." if fragment == 0 else f"average{fragment}."

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors only: ``anchor.<i>``, ``momentum.<i>`` (once the first outer step made them), ``steps``,
        ``taken``, ``rounds``, the averaging's own state under ``average.`` (fragment f > 0: ``average<f>.``)
        and, with a delayed averaging in flight (waited for), ``pending`` (its fragment and the step it is
        applied at) and its averaged pseudo-gradients ``pending.<i>``; with a membership, its own state under
        ``membership.`` (the quorums counted: a replica resumed with it is as far as the others), and for a
        delayed averaging in flight (not waited for) the pseudo-gradients it started from as ``pending.<i>``,
        with ``pending.again`` (whether compressed, whether this replica contributed) and the averaging's
        state from before it."""
        out: dict[str, torch.Tensor] = {"steps": torch.tensor(self.steps), "taken": torch.tensor(self.taken),
                                        "rounds": torch.tensor(self.rounds)}
        for i, a in enumerate(self.anchors):
            out[f"anchor.{i}"] = a.detach()
            buf = self.optimizer.state.get(a, {}).get("momentum_buffer")
            if buf is not None:
                out[f"momentum.{i}"] = buf
        retry = None
        if self._pending is not None and self.membership is not None:
            # among replicas that come and go, the averaging in flight is not waited for: what is saved is
            # what it started from (the pseudo-gradients, the averaging's state before it), and a resume
            # averages it again at its step, over that step's quorum
            fragment, at, _ = self._pending
            retry = self._retry
            assert retry is not None
            out["pending"] = torch.tensor([fragment, at])
            out["pending.again"] = torch.tensor([int(retry.compress), int(retry.contributing)])
            for i, g in zip(self.fragments[fragment], retry.grads):
                out[f"pending.{i}"] = g
        elif self._pending is not None:
            self.wait()
            fragment, at, _ = self._pending
            out["pending"] = torch.tensor([fragment, at])
            for i in self.fragments[fragment]:
                out[f"pending.{i}"] = self.anchors[i].grad.detach()  # type: ignore[union-attr]
        for f, average in enumerate(self.averages):
            kept = retry.saved.state if retry is not None and f == self._pending[0] else average.state_dict()
            out.update({f"{self._average_prefix(f)}{k}": v for k, v in kept.items()})
        if self.membership is not None:  # the quorums counted (a resumed replica is not taken as behind),
            # and the last group's size and this replica's place in it (what the error feedback was kept for)
            out.update({f"membership.{k}": torch.tensor(v) for k, v in self.membership.state_dict().items()})
            # (fragment f > 0: world<f>, rank<f>: each fragment's averaging was regrouped at its own steps)
            for f, average in enumerate(self.averages):
                world, rank = average.world, average.group_rank
                if retry is not None and f == self._pending[0]:  # type: ignore[index]
                    world, rank = retry.saved.world, retry.saved.rank
                out[f"membership.world{f or ''}"] = torch.tensor(world)
                out[f"membership.rank{f or ''}"] = torch.tensor(rank)
        return out

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        anchors = sorted(int(k.split(".")[1]) for k in state if k.startswith("anchor."))
        if anchors != list(range(len(self.anchors))):
            raise ValueError(f"the outer state holds {len(anchors)} anchors, this stage has "
                             f"{len(self.anchors)} trainable parameters")
        self.close()
        self._pending = self._retry = None
        with torch.no_grad():
            for i, a in enumerate(self.anchors):
                saved = state[f"anchor.{i}"]
                if saved.shape != a.shape:
                    raise ValueError(f"outer anchor {i}: saved shape {tuple(saved.shape)}, parameter "
                                     f"{tuple(a.shape)}")
                a.copy_(saved)
                a.grad = None
                if f"momentum.{i}" in state:
                    self.optimizer.state[a]["momentum_buffer"] = state[f"momentum.{i}"].to(a.device,
                                                                                          copy=True)
                else:
                    self.optimizer.state.pop(a, None)
        self.steps = int(state["steps"])
        self.taken = int(state["taken"])
        self.rounds = int(state["rounds"])
        if "pending" in state:
            fragment, at = (int(v) for v in state["pending"])
            if not 0 <= fragment < len(self.fragments):
                raise ValueError(f"the outer state's delayed averaging is of fragment {fragment}, this stage "
                                 f"has {len(self.fragments)}")
            if "pending.again" in state:  # (replicas that come and go: averaged again at its step)
                self._pending = (fragment, at, None)
            else:
                for i in self.fragments[fragment]:
                    self.anchors[i].grad = state[f"pending.{i}"].to(self.anchors[i].device, copy=True)
                done: Future[int] = Future()
                done.set_result(0)  # its bytes were counted before the checkpoint
                self._pending = (fragment, at, done)
        ours = {k[len("membership."):]: int(v) for k, v in state.items() if k.startswith("membership.")}
        if ours and self.membership is not None:
            # the group as it was (the next quorum's, if alike, keeps the error feedback loaded below)
            for f, average in enumerate(self.averages):
                world, rank = ours.pop(f"world{f or ''}", None), ours.pop(f"rank{f or ''}", None)
                if world is not None and rank is not None:
                    average.regroup(None, world=world, rank=rank)
            self.membership.load_state_dict(ours)
        for f, average in enumerate(self.averages):
            prefix = self._average_prefix(f)
            average.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
        if self._pending is not None and self._pending[2] is None:
            fragment = self._pending[0]
            compress, contributing = (bool(v) for v in state["pending.again"])
            grads = [state[f"pending.{i}"].to(self.anchors[i].device, copy=True)
                     for i in self.fragments[fragment]]
            self._retry = _Retry(self._averaging_state([fragment])[0], grads, compress, contributing)


def make_outer_sync(spec: str, params: Sequence[nn.Parameter], group: Any = None, *,
                    bucket_mb: float = DEFAULT_BUCKET_MB, link: LinkSpec | None = None,
                    device: torch.device | str = "cpu", membership: Any = None) -> OuterSync:
    """The :class:`OuterSync` of a ``diloco:...`` spec over ``group``, its averaging (one per fragment) built
    by :func:`~aqsgd.parallel.sync.make_grad_sync` from the spec's averaging part. ``membership``: an
    :class:`~aqsgd.parallel.elastic.ElasticGroup` instead of a fixed group (``group`` is then unused). With
    a delay, ``group`` should be one nothing else uses (the averaging runs on a worker thread)."""
    parsed = parse_grad_sync(spec)
    if parsed.kind != "diloco":
        raise ValueError(f"{spec!r} is no outer-step spec (diloco:<H>...)")
    averages = [make_grad_sync(parsed.average, group, bucket_mb=bucket_mb, link=link, device=device)
                for _ in range(parsed.fragments)]
    if membership is not None:
        for average in averages:  # until the first outer step forms the group
            average.regroup(None, world=1, rank=0)
    return OuterSync(params, averages, every=parsed.every, lr=parsed.outer_lr, momentum=parsed.momentum,
                     membership=membership, delay=parsed.delay, mix=parsed.mix)
