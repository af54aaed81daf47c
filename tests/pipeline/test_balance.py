"""Balancing by measurement: the split search against brute force, the cost model on synthetic profiles, the
block timer, the emulated slow stage and its option."""

from __future__ import annotations

import itertools
import random
import time

import pytest
import torch
from torch import nn

from aqsgd.pipeline.balance import (MIN_GAIN, CostModel, ForwardTimer, StageProfile, choose_split,
                                    fit_cost_model, parse_slow_stages)
from aqsgd.pipeline.compression import CompressionConfig
from aqsgd.pipeline.partition import balanced_counts, min_max_split
from aqsgd.pipeline.local import LocalPipeline
from aqsgd.schemes import Phase


def _splits(n: int, s: int):
    for cuts in itertools.combinations(range(1, n), s - 1):
        bounds = (0, *cuts, n)
        yield [b - a for a, b in zip(bounds, bounds[1:])]


def _brute_force(n: int, s: int, cost) -> float:
    best = float("inf")
    for counts in _splits(n, s):
        start, worst = 0, 0.0
        for stage, c in enumerate(counts):
            worst = max(worst, cost(stage, start, start + c))
            start += c
        best = min(best, worst)
    return best


def _worst(counts, cost) -> float:
    start, worst = 0, 0.0
    for stage, c in enumerate(counts):
        worst = max(worst, cost(stage, start, start + c))
        start += c
    return worst


@pytest.mark.parametrize("seed", range(40))
def test_min_max_split_matches_brute_force_on_unequal_stages(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 10)
    s = rng.randint(1, n)
    costs = [rng.uniform(0.1, 5.0) for _ in range(n)]
    speed = [rng.uniform(0.5, 4.0) for _ in range(s)]
    fixed = [rng.uniform(0.0, 3.0) for _ in range(s)]

    def cost(stage, start, end):
        return speed[stage] * sum(costs[start:end]) + fixed[stage]

    counts = min_max_split(n, s, cost)
    assert len(counts) == s and sum(counts) == n and min(counts) >= 1
    assert _worst(counts, cost) == pytest.approx(_brute_force(n, s, cost))


def test_balanced_counts_is_the_equal_speed_case():
    costs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    for s in range(1, 5):
        counts = balanced_counts(costs, s, first_extra=2.0, last_extra=7.0)
        model = CostModel(costs, [1.0] * s, [2.0 if i == 0 else 0.0 for i in range(s)])
        model.fixed[-1] += 7.0
        assert _worst(counts, model.stage_time) == pytest.approx(_brute_force(8, s, model.stage_time))


def _synthetic_profiles(counts, cost, speed, fixed, noise=None):
    """What a profile of stages with ``counts`` blocks would measure, the truth being ``cost`` per block,
    ``speed`` and ``fixed`` per stage; the backward takes twice the forward."""
    out, start = [], 0
    for s, n in enumerate(counts):
        blocks = [speed[s] * c / 3 for c in cost[start:start + n]]
        if noise is not None:
            blocks = [b * noise[start + k] for k, b in enumerate(blocks)]
        compute = speed[s] * sum(cost[start:start + n]) + fixed[s]
        out.append(StageProfile(compute, compute / 3, blocks))
        start += n
    return out


def test_the_cost_model_predicts_every_split_of_stages_of_unequal_speed():
    # blocks whose cost is proportional to their parameters (linear layers), three stages of unequal speed
    cost = [2.0, 7.0, 1.0, 3.0, 3.0, 5.0, 4.0, 1.5, 6.0]
    params = [1000 * c for c in cost]
    speed, fixed = [1.0, 2.5, 1.2], [4.0, 0.5, 6.0]
    profiled = [3, 3, 3]

    def truth(stage, start, end):
        return speed[stage] * sum(cost[start:end]) + fixed[stage]

    model = fit_cost_model(_synthetic_profiles(profiled, cost, speed, fixed), profiled, params)
    assert model.fixed == pytest.approx(fixed)
    for counts in _splits(9, 3):
        starts = itertools.accumulate([0, *counts])
        assert model.predict(counts) == pytest.approx([truth(s, a, a + n) for s, (a, n) in
                                                       enumerate(zip(starts, counts))])
    assert _worst(model.best_split(), truth) == pytest.approx(_brute_force(9, 3, truth))


def test_the_cost_model_recovers_speeds_of_stages_holding_blocks_of_one_size():
    # transformer-like: identical blocks, stage 1 three times slower, embeddings on stage 0, head on stage 2
    params = [1000] * 8
    cost = [1.0] * 8
    speed, fixed = [1.0, 3.0, 1.0], [0.6, 0.0, 1.5]
    profiled = [3, 3, 2]
    noise = [1.3, 0.9, 0.8, 1.2, 1.0, 0.8, 1.1, 0.9]  # per-block timings vary; one size's blocks cost alike

    def truth(stage, start, end):
        return speed[stage] * sum(cost[start:end]) + fixed[stage]

    model = fit_cost_model(_synthetic_profiles(profiled, cost, speed, fixed, noise), profiled, params)
    for counts in _splits(8, 3):
        assert model.predict(counts) == pytest.approx([truth(s, a, a + n) for s, (a, n) in
                                                       enumerate(zip(itertools.accumulate([0, *counts]),
                                                                     counts))], rel=0.05)
    best = model.best_split()
    assert _worst(best, truth) == pytest.approx(_brute_force(8, 3, truth))
    assert best[1] < min(best[0], best[2])


def test_a_stage_of_parameter_free_blocks_takes_the_median_speed():
    # an MLP: Linear, ReLU, Linear, ReLU; the second stage holds only... a Linear and a ReLU each
    params = [1000, 0, 1000, 0, 1000, 0]
    profiles = [StageProfile(3.0, 1.0, [0.9, 0.1]), StageProfile(6.0, 2.0, [1.8, 0.2]),
                StageProfile(3.0, 1.0, [0.9, 0.1])]
    model = fit_cost_model(profiles, [2, 2, 2], params)
    assert model.speed[1] == pytest.approx(2 * model.speed[0])
    assert model.block_cost[1] == pytest.approx(model.block_cost[0] / 9)
    odd = fit_cost_model([StageProfile(1.0, 0.5, [0.5]), StageProfile(1.0, 0.5, [0.5])], [1, 1], [0, 10])
    assert odd.speed[0] == pytest.approx(odd.speed[1])  # the stage of a parameter-free block: the median


def test_untimed_blocks_count_as_the_whole_stage_by_parameters():
    model = fit_cost_model([StageProfile(4.0), StageProfile(4.0)], [2, 2], [1, 3, 2, 2])
    assert model.fixed == [0.0, 0.0]
    assert model.predict([2, 2]) == pytest.approx([4.0, 4.0])
    assert model.block_cost[1] == pytest.approx(3 * model.block_cost[0])


def test_the_profiled_split_is_kept_unless_another_is_clearly_faster():
    even = CostModel([1.0] * 4, [1.0, 1.0], [0.0, 0.05])  # the best split gains under MIN_GAIN
    assert choose_split(even, [2, 2]) == [2, 2]
    slow = CostModel([1.0] * 4, [1.0, 2.0], [0.0, 0.0])
    assert choose_split(slow, [2, 2]) == [3, 1]
    assert choose_split(slow, [2, 2], min_gain=0.6) == [2, 2]  # 4 -> 3 s is 25 %
    assert 0 < MIN_GAIN < 0.1


def test_fit_refuses_profiles_that_do_not_fit_the_split():
    with pytest.raises(ValueError, match="do not fit"):
        fit_cost_model([StageProfile(1.0)], [2], [1.0])
    with pytest.raises(ValueError, match="a stage of 2 blocks timed 1"):
        fit_cost_model([StageProfile(1.0, 1.0, [0.5])], [2], [1.0, 1.0])


def test_parse_slow_stages():
    assert parse_slow_stages("1:2", 2) == {1: 2.0}
    assert parse_slow_stages("0:1.5, 2:3", 3) == {0: 1.5, 2: 3.0}
    for text, needle in (("1", "is not STAGE:FACTOR"), ("a:2", "is not STAGE:FACTOR"),
                         ("2:2", "stage 2 is not a stage of the 2-stage pipeline"),
                         ("1:0.5", "the factor must be a finite number >= 1"),
                         ("1:inf", "the factor must be a finite number >= 1"),
                         ("1:nan", "the factor must be a finite number >= 1"),
                         ("1:2,1:3", "stage 1 is given twice")):
        with pytest.raises(ValueError, match=needle):
            parse_slow_stages(text, 2)


class _Sleep(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        time.sleep(self.seconds)
        return x * self.scale


class _Stage(nn.Module):
    """A stage of sleeping blocks, ``hidden`` from ``batch["x"]`` on the first, the mean as its loss on the
    last."""

    def __init__(self, index: int, num_stages: int, seconds: list[float]) -> None:
        super().__init__()
        self.index, self.num_stages = index, num_stages
        self.layers = nn.ModuleList(_Sleep(s) for s in seconds)

    def forward(self, hidden, batch):
        x = batch["x"] if self.index == 0 else hidden
        for layer in self.layers:
            x = layer(x)
        return x.mean() if self.index == self.num_stages - 1 else x


def test_the_timer_times_stages_and_their_blocks_inside_their_forward_only():
    stage = _Stage(0, 2, [0.01, 0.03])
    timer = ForwardTimer({0: stage})
    x = torch.ones(2, 3)
    with timer.attached():
        for _ in range(2):
            stage(None, {"x": x})
        stage.layers[1](x)  # outside the stage's forward (as a recomputation in the backward): not counted
    assert timer.calls[0] == 2
    assert timer.block_s[0][0] >= 0.02 and timer.block_s[0][1] >= 0.06
    assert timer.block_s[0][1] < 0.06 + 0.03 * 0.9 + 0.05  # the call outside was left out
    assert timer.forward_s[0] >= sum(timer.block_s[0])
    stage(None, {"x": x})  # detached: nothing counted
    assert timer.calls[0] == 2
    timer.reset()
    assert timer.calls[0] == 0 and timer.block_s[0] == [0.0, 0.0]


def test_an_emulated_slow_stage_computes_factor_times_longer():
    stages = [_Stage(0, 2, [0.01]), _Stage(1, 2, [0.01])]
    pipe = LocalPipeline(stages, CompressionConfig.simple("none", "none"))
    pipe.runners[1].slowdown = 3.0
    batch = [{"x": torch.ones(2, 3)} for _ in range(2)]
    pipe.step(batch, Phase.TRAIN)
    fast, slow = (r.stats.compute_s for r in pipe.runners)
    assert fast >= 2 * 0.01
    assert slow >= 3 * 2 * 0.01  # each forward's sleep (and backward's) stretched three times
    assert slow > 2 * fast
