"""Balancing stages by measurement: a cost model fitted to a short profile of the running stages, and the
split that makes the slowest stage as fast as the model predicts possible.

The model
---------
Stage ``s`` spends, per micro-batch (forward and backward together),

    T_s(blocks) = speed_s * sum(cost_b for b in blocks) + fixed_s

``fixed_s`` is what the stage computes whatever blocks it holds (the embeddings on the first stage, the final
norm, head and loss on the last, a mask built on every stage); ``cost_b`` is what block ``b`` costs on a
stage of speed 1; ``speed_s`` is how slow stage ``s`` is (a stage sharing its cores or its GPU with another
process is slower on every block alike).

One profile, with the default split, measures per stage its compute per micro-batch ``T_s`` (forward and
backward), its forward alone ``F_s`` and, inside that forward, each of its blocks' forward ``f_b``. Then

* the blocks' share of the stage's compute is ``r_s = sum(f_b) / F_s`` (the backward is taken to split as the
  forward does), so ``fixed_s = (1 - r_s) T_s`` and the blocks cost ``A_s = r_s T_s`` together;
* a block's parameter count ``p_b`` relates blocks *across* stages (blocks of equal size cost the same on
  equal stages: ``speed_s = A_s / sum(p_b)`` over the stage's blocks), while the measured ``f_b`` relate the
  blocks *within* a stage: ``cost_b = A_s (f_b / sum f) / speed_s``, where the ``f_b`` of the stage's blocks
  of one size are replaced by their mean (identical transformer layers cost the same; residual blocks of
  different widths, or an MLP's activations and linear layers, keep their own measured costs).

With the profiled split the model reproduces every measured ``T_s``; for another split it moves each block's
cost to its new stage at that stage's speed. :func:`min_max_split` then finds the contiguous split whose
largest predicted ``T_s`` is smallest (exact). A stage whose blocks hold no parameter (activations only) has
no speed of its own: it takes the median of the others'.

Emulation
---------
``--emulate-slow-stage STAGE:FACTOR`` (:func:`parse_slow_stages`) makes a stage ``FACTOR`` times slower: its
runner sleeps ``FACTOR - 1`` times each forward's and backward's duration after it. It is for benchmarks and
tests on one machine, as ``--link`` emulates slow networks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import nn

from aqsgd.pipeline.checkpointing import stage_blocks
from aqsgd.pipeline.partition import min_max_split

__all__ = ["StageProfile", "CostModel", "fit_cost_model", "choose_split", "ForwardTimer", "parse_slow_stages",
           "MIN_GAIN"]

MIN_GAIN = 0.03
"""The profiled split is kept unless another is predicted to make the slowest stage at least this much (a
fraction) faster: timings of a few passes are noisy, and equal stages should not trade blocks on noise."""


@dataclasses.dataclass
class StageProfile:
    """What one stage measured per micro-batch (seconds): ``compute_s`` its forward and backward,
    ``forward_s`` its module's forward alone, ``block_forward_s`` each of its blocks' forward (empty where the
    stage's blocks could not be timed: its compute is then taken as all blocks), and ``peak_bytes`` its
    device's peak memory while profiling (None where not measurable)."""

    compute_s: float
    forward_s: float = 0.0
    block_forward_s: list[float] = dataclasses.field(default_factory=list)
    peak_bytes: int | None = None


@dataclasses.dataclass
class CostModel:
    """``stage_time(s, start, end) = speed[s] * sum(block_cost[start:end]) + fixed[s]`` (see the module
    docstring)."""

    block_cost: list[float]
    speed: list[float]
    fixed: list[float]

    def __post_init__(self) -> None:
        self._prefix = [0.0]
        for c in self.block_cost:
            self._prefix.append(self._prefix[-1] + c)

    @property
    def num_stages(self) -> int:
        return len(self.speed)

    def stage_time(self, stage: int, start: int, end: int) -> float:
        """Predicted seconds per micro-batch of ``stage`` holding blocks ``[start, end)``."""
        return self.speed[stage] * (self._prefix[end] - self._prefix[start]) + self.fixed[stage]

    def predict(self, counts: Sequence[int]) -> list[float]:
        """Predicted seconds per micro-batch of every stage for ``counts`` blocks per stage."""
        out, start = [], 0
        for s, n in enumerate(counts):
            out.append(self.stage_time(s, start, start + n))
            start += n
        return out

    def best_split(self) -> list[int]:
        """Blocks per stage minimising the largest predicted stage time."""
        return min_max_split(len(self.block_cost), self.num_stages, self.stage_time)


def fit_cost_model(profiles: Sequence[StageProfile], counts: Sequence[int],
                   params: Sequence[float]) -> CostModel:
    """The cost model of stages profiled with ``counts`` blocks each, the blocks having ``params`` parameters
    (see the module docstring)."""
    if len(profiles) != len(counts) or sum(counts) != len(params):
        raise ValueError(f"{len(profiles)} profiles, counts {list(counts)} and {len(params)} blocks do not "
                         "fit")
    tiny = 1e-12
    fixed, busy, shares, units = [], [], [], []
    start = 0
    for prof, n in zip(profiles, counts):
        blocks = list(prof.block_forward_s)
        if len(blocks) not in (0, n):
            raise ValueError(f"a stage of {n} blocks timed {len(blocks)}")
        timed = sum(blocks)
        ratio = min(1.0, timed / prof.forward_s) if blocks and timed > 0 and prof.forward_s > 0 else 1.0
        total = max(prof.compute_s, tiny)
        fixed.append(total * (1.0 - ratio))
        busy.append(total * ratio)
        p = [max(float(x), 0.0) for x in params[start:start + n]]
        if blocks and timed > 0:
            # blocks of one size are taken to cost the same: the mean of their measured times (what sets one
            # apart, e.g. the first block of a stage reading its input from memory, is not the block's)
            groups: dict[float, list[float]] = {}
            for size, t in zip(p, blocks):
                groups.setdefault(size, []).append(t)
            shares.append([statistics.fmean(groups[size]) / timed for size in p])
        else:
            shares.append([x / sum(p) for x in p] if sum(p) > 0 else [1.0 / n] * n)
        units.append(sum(p))
        start += n
    known = [b / u for b, u in zip(busy, units) if u > 0]
    if not known:  # no block holds a parameter: blocks count alike
        units = [float(n) for n in counts]
        known = [b / u for b, u in zip(busy, units)]
    fallback = statistics.median(known)
    speed = [b / u if u > 0 else fallback for b, u in zip(busy, units)]
    cost = [b * w / sp for b, sh, sp in zip(busy, shares, speed) for w in sh]
    return CostModel(cost, speed, fixed)


def choose_split(model: CostModel, profiled: Sequence[int], min_gain: float = MIN_GAIN) -> list[int]:
    """The split to train with: the model's best, unless it is predicted to make the slowest stage less than
    ``min_gain`` faster than the ``profiled`` one (which is then kept)."""
    best = model.best_split()
    now, then = max(model.predict(profiled)), max(model.predict(best))
    return list(profiled) if then > now * (1.0 - min_gain) else best


class ForwardTimer:
    """Times the forward of stage modules and of each of their blocks (forward hooks) while :meth:`attached`:
    a block's time counts only inside its stage's forward, so the recomputation of activation checkpointing
    (during the backward) is left out. ``sync``: wait for the device at every hook (a GPU computes
    asynchronously)."""

    def __init__(self, stages: Mapping[int, nn.Module], *, sync: bool = False) -> None:
        self.stages = dict(stages)
        self.sync = sync
        self.calls = {i: 0 for i in self.stages}
        self.forward_s = {i: 0.0 for i in self.stages}
        blocks = {i: stage_blocks(m) for i, m in self.stages.items()}
        self.blocks = {i: list(b) if b is not None else [] for i, b in blocks.items()}
        self.block_s = {i: [0.0] * len(b) for i, b in self.blocks.items()}
        self._active: dict[int, float | None] = {i: None for i in self.stages}
        self._block_t0: dict[tuple[int, int], float] = {}

    def _now(self) -> float:
        if self.sync and torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def reset(self) -> None:
        for i in self.stages:
            self.calls[i], self.forward_s[i] = 0, 0.0
            self.block_s[i] = [0.0] * len(self.blocks[i])

    @contextlib.contextmanager
    def attached(self) -> Iterator[ForwardTimer]:
        handles = []
        for i, module in self.stages.items():
            handles.append(module.register_forward_pre_hook(lambda *_, i=i: self._stage_start(i)))
            handles.append(module.register_forward_hook(lambda *_, i=i: self._stage_end(i)))
            for k, block in enumerate(self.blocks[i]):
                handles.append(block.register_forward_pre_hook(lambda *_, i=i, k=k: self._block_start(i, k)))
                handles.append(block.register_forward_hook(lambda *_, i=i, k=k: self._block_end(i, k)))
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def _stage_start(self, i: int) -> None:
        self._active[i] = self._now()

    def _stage_end(self, i: int) -> None:
        t0 = self._active[i]
        if t0 is not None:
            self.forward_s[i] += self._now() - t0
            self.calls[i] += 1
        self._active[i] = None

    def _block_start(self, i: int, k: int) -> None:
        if self._active[i] is not None:
            self._block_t0[(i, k)] = self._now()

    def _block_end(self, i: int, k: int) -> None:
        t0 = self._block_t0.pop((i, k), None)
        if t0 is not None and self._active[i] is not None:
            self.block_s[i][k] += self._now() - t0


def parse_slow_stages(text: str, num_stages: int) -> dict[int, float]:
    """``STAGE:FACTOR[,STAGE:FACTOR...]`` (``--emulate-slow-stage``) as ``{stage: factor}``; ValueError (one
    line) for a malformed entry, a stage outside the pipeline, a stage given twice or a factor below 1."""
    out: dict[int, float] = {}
    for entry in text.split(","):
        stage_text, sep, factor_text = entry.strip().partition(":")
        try:
            if not sep:
                raise ValueError
            stage, factor = int(stage_text), float(factor_text)
        except ValueError:
            raise ValueError(f"{entry.strip()!r} is not STAGE:FACTOR (e.g. 1:2, stage 1 twice as "
                             "slow)") from None
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage {stage} is not a stage of the {num_stages}-stage pipeline "
                             f"(0..{num_stages - 1})")
        if stage in out:
            raise ValueError(f"stage {stage} is given twice")
        if not factor >= 1.0 or factor == float("inf"):
            raise ValueError(f"stage {stage}: the factor must be a finite number >= 1 (1: as fast as it is), "
                             f"got {factor_text}")
        out[stage] = factor
    return out
