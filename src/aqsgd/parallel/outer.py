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
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from aqsgd.comm.link import LinkSpec
from aqsgd.parallel.sync import DEFAULT_BUCKET_MB, GradSync, GradSyncSpec, make_grad_sync, parse_grad_sync

log = logging.getLogger(__name__)

__all__ = ["OuterSync", "make_outer_sync", "DILOCO_LR", "DILOCO_MOMENTUM"]

DILOCO_LR = GradSyncSpec.outer_lr  # the paper's: 0.7, Nesterov momentum 0.9
DILOCO_MOMENTUM = GradSyncSpec.momentum


class OuterSync:
    """DiLoCo's outer step for the trainable parameters ``params`` of one stage (module docstring)."""

    def __init__(self, params: Sequence[nn.Parameter], average: GradSync, *, every: int,
                 lr: float = DILOCO_LR, momentum: float = DILOCO_MOMENTUM, membership: Any = None) -> None:
        if every < 1:
            raise ValueError(f"the outer step's interval must be at least 1 step, got {every}")
        if not lr > 0:
            raise ValueError(f"the outer learning rate must be positive, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"the outer momentum must be in [0, 1), got {momentum}")
        self.params = [p for p in params if p.requires_grad]
        self.average = average
        self.every, self.lr, self.momentum = every, lr, momentum
        with torch.no_grad():
            self.anchors = [nn.Parameter(p.detach().to(average.device, torch.float32, copy=True))
                            for p in self.params]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.optimizer = torch.optim.SGD(self.anchors, lr=lr, momentum=momentum, nesterov=momentum > 0)
        self.steps = 0  # inner steps taken in the current round
        self.taken = 0  # inner steps taken in all
        self.end = 0  # the run's last step (0: none known): a round ends there too (the replicas end agreed)
        self.rounds = 0
        self.last_bytes = 0
        self.last_raw_bytes = 0
        #: an :class:`~aqsgd.parallel.elastic.ElasticGroup`: the group is re-formed at every outer step
        #: (replicas that come and go); None: the fixed group of ``average``
        self.membership = membership
        self.last_round: Any = None  # the last outer step's :class:`~aqsgd.parallel.elastic.Round`

    @property
    def due(self) -> bool:
        """Whether the next :meth:`step` ends the round (takes the outer step): H steps into it, or the run's
        last step."""
        return self.steps + 1 >= self.every or (self.end > 0 and self.taken + 1 >= self.end)

    def agreed(self, param: nn.Parameter) -> torch.Tensor | None:
        """The replicas' agreed value of ``param`` (the anchor: the last outer step's result), or None for a
        parameter the outer steps do not hold (frozen, a buffer)."""
        i = self._index.get(id(param))
        return None if i is None else self.anchors[i]

    def step(self, *, compress: bool = True) -> int:
        """Count one inner step; at the round's end, the outer step (``compress=False``: the pseudo-gradients
        averaged in fp32, as in the warm-up). Returns the bytes this rank sent (0 inside a round)."""
        due = self.due
        self.steps += 1
        self.taken += 1
        self.last_bytes = self.last_raw_bytes = 0
        if not due:
            return 0
        contributing = True
        if self.membership is not None:
            rnd = self._regroup(contributing=True)
            contributing = not rnd.healed  # the state just taken holds a peer's weights, not ours
        with torch.no_grad():
            for a, p in zip(self.anchors, self.params):
                if contributing:
                    a.grad = a.detach() - p.detach().to(a.device, torch.float32)
                else:
                    a.grad = torch.zeros_like(a)
        return self._outer_step(compress)

    def join(self, *, compress: bool | Callable[[], bool] = True) -> bool:
        """A replica started late, before its first step: ask for the next quorum; if the others are ahead,
        take a peer's state (weights, outer state: the membership's ``load_fn``), take part in that outer step
        with nothing to add, and end it with the others' weights. Returns whether it joined running peers
        (False: it is among the first, and starts from its own initial weights)."""
        if self.membership is None:
            raise ValueError("join() needs a membership (replicas that come and go)")
        rnd = self._regroup(contributing=False)
        if not rnd.healed:
            self.membership.commit()
            return False
        # the peer's counters already count the step that ends its round
        with torch.no_grad():
            for a in self.anchors:
                a.grad = torch.zeros_like(a)
        self._outer_step(compress() if callable(compress) else compress)
        return True

    def _regroup(self, *, contributing: bool) -> Any:
        rnd = self.membership.form(contributing=contributing, step=self.taken)
        self.average.regroup(rnd.group, world=rnd.world, rank=rnd.rank)
        self.average.contributors = rnd.contributors
        self.last_round = rnd
        if rnd.healed:
            log.info("stage %d replica %d: took the current weights and outer state from a peer; joins at "
                     "step %d", self.membership.stage, self.membership.replica, self.taken)
        return rnd

    def _outer_step(self, compress: bool) -> int:
        self.last_bytes = self.average.sync(self.anchors, compress=compress)
        self.last_raw_bytes = self.average.last_raw_bytes
        self.optimizer.step()
        with torch.no_grad():
            for a, p in zip(self.anchors, self.params):
                p.copy_(a)
                a.grad = None
        self.steps = 0
        self.rounds += 1
        if self.membership is not None:
            self.membership.commit()
        return self.last_bytes

    # -- checkpoints --------------------------------------------------------------------------------------
    def shared_state(self) -> dict[str, torch.Tensor]:
        """What a joining replica takes from a peer: :meth:`state_dict` without the averaging's error
        feedback (a replica's own; the joiner's starts at zero)."""
        return {k: v.detach().clone() for k, v in self.state_dict().items() if not k.startswith("average.")}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors only: ``anchor.<i>``, ``momentum.<i>`` (once the first outer step made them), ``steps``,
        ``taken``, ``rounds`` and the averaging's own state under ``average.``."""
        out: dict[str, torch.Tensor] = {"steps": torch.tensor(self.steps), "taken": torch.tensor(self.taken),
                                        "rounds": torch.tensor(self.rounds)}
        for i, a in enumerate(self.anchors):
            out[f"anchor.{i}"] = a.detach()
            buf = self.optimizer.state.get(a, {}).get("momentum_buffer")
            if buf is not None:
                out[f"momentum.{i}"] = buf
        out.update({f"average.{k}": v for k, v in self.average.state_dict().items()})
        return out

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        anchors = sorted(int(k.split(".")[1]) for k in state if k.startswith("anchor."))
        if anchors != list(range(len(self.anchors))):
            raise ValueError(f"the outer state holds {len(anchors)} anchors, this stage has "
                             f"{len(self.anchors)} trainable parameters")
        with torch.no_grad():
            for i, a in enumerate(self.anchors):
                saved = state[f"anchor.{i}"]
                if saved.shape != a.shape:
                    raise ValueError(f"outer anchor {i}: saved shape {tuple(saved.shape)}, parameter "
                                     f"{tuple(a.shape)}")
                a.copy_(saved)
                if f"momentum.{i}" in state:
                    self.optimizer.state[a]["momentum_buffer"] = state[f"momentum.{i}"].to(a.device,
                                                                                          copy=True)
                else:
                    self.optimizer.state.pop(a, None)
        self.steps = int(state["steps"])
        self.taken = int(state["taken"])
        self.rounds = int(state["rounds"])
        self.average.load_state_dict({k[len("average."):]: v for k, v in state.items()
                                      if k.startswith("average.")})


def make_outer_sync(spec: str, params: Sequence[nn.Parameter], group: Any = None, *,
                    bucket_mb: float = DEFAULT_BUCKET_MB, link: LinkSpec | None = None,
                    device: torch.device | str = "cpu", membership: Any = None) -> OuterSync:
    """The :class:`OuterSync` of a ``diloco:...`` spec over ``group``, its averaging built by
    :func:`~aqsgd.parallel.sync.make_grad_sync` from the spec's averaging part. ``membership``: an
    :class:`~aqsgd.parallel.elastic.ElasticGroup` instead of a fixed group (``group`` is then unused)."""
    parsed = parse_grad_sync(spec)
    if parsed.kind != "diloco":
        raise ValueError(f"{spec!r} is no outer-step spec (diloco:<H>...)")
    average = make_grad_sync(parsed.average, group, bucket_mb=bucket_mb, link=link, device=device)
    if membership is not None:
        average.regroup(None, world=1, rank=0)  # until the first outer step forms the group
    return OuterSync(params, average, every=parsed.every, lr=parsed.outer_lr, momentum=parsed.momentum,
                     membership=membership)
