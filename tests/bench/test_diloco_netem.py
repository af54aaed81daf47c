"""``benchmarks.diloco_netem``: its runs are valid training options over whole outer rounds, and its window's
figures are what the docs say (the runs themselves need root and minutes: run by hand)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from aqsgd.parallel import OuterSync, parse_grad_sync
from aqsgd.train.config import TrainConfig
from benchmarks.diloco_netem import DEFAULT_WINDOWS, _options, _window, main


class _Bytes:
    """A world-of-one averaging that says it sent ``nbytes``."""

    device, last_raw_bytes = torch.device("cpu"), 0

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def sync(self, params, *, compress=True) -> int:
        return self.nbytes

    def state_dict(self) -> dict:
        return {}


@pytest.mark.parametrize("setting", list(DEFAULT_WINDOWS))
def test_every_run_is_a_valid_training_over_whole_rounds(setting, tmp_path):
    steps, first, *rest = DEFAULT_WINDOWS[setting]
    last = rest[0] if rest else steps
    cfg = TrainConfig.from_flat(_options(setting, steps, tmp_path, "r"), source="test").validate()
    assert cfg.pipeline.stages == 2 and cfg.pipeline.data_parallel == 2 and cfg.optim.max_steps == steps
    spec = parse_grad_sync(cfg.pipeline.grad_sync)
    if spec.every:  # DiLoCo: the window is whole rounds, so it holds their outer steps in proportion
        assert (last - first + 1) % spec.every == 0 and first > 1 and last <= steps
    if last < steps:  # the final sync left out: the window applies one round's sync of every fragment
        outer = OuterSync([nn.Parameter(torch.zeros(1)) for _ in range(spec.fragments)],
                          [_Bytes(10**f) for f in range(spec.fragments)], every=spec.every, delay=spec.delay)
        outer.end = steps
        sent = [outer.step() for _ in range(steps)]  # counted at the step that applies each sync
        outer.close()
        rounds = (last - first + 1) // spec.every
        assert sum(sent[first - 1:last]) == rounds * sum(10**f for f in range(spec.fragments)), sent


def test_the_window_means_the_slowest_stage_and_sums_the_link():
    rows = [{"step": s, "stages": [{"step_s": s, "sync_bytes": 10.0}, {"step_s": 2 * s, "sync_bytes": 5.0}]}
            for s in (1, 2, 3)]
    got = _window(rows, 2)
    assert got == {"steps": 2, "step_s": (4 + 6) / 2, "link_bytes": 15.0}
    assert _window(rows, 1, 2) == {"steps": 2, "step_s": (2 + 4) / 2, "link_bytes": 15.0}
    with pytest.raises(RuntimeError, match="no training rows from step 4"):
        _window(rows, 4)


def test_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0 and "shaped link" in capsys.readouterr().out
