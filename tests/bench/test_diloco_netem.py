"""``benchmarks.diloco_netem``: its runs are valid training options over whole outer rounds, and its window's
figures are what the docs say (the runs themselves need root and minutes: run by hand)."""

from __future__ import annotations

import pytest

from aqsgd.parallel import parse_grad_sync
from aqsgd.train.config import TrainConfig
from benchmarks.diloco_netem import DEFAULT_WINDOWS, _options, _window, main


@pytest.mark.parametrize("setting", list(DEFAULT_WINDOWS))
def test_every_run_is_a_valid_training_over_whole_rounds(setting, tmp_path):
    steps, first = DEFAULT_WINDOWS[setting]
    cfg = TrainConfig.from_flat(_options(setting, steps, tmp_path, "r"), source="test").validate()
    assert cfg.pipeline.stages == 2 and cfg.pipeline.data_parallel == 2 and cfg.optim.max_steps == steps
    every = parse_grad_sync(cfg.pipeline.grad_sync).every
    if every:  # DiLoCo: the window is whole rounds, so it holds their outer steps in proportion
        assert (steps - first + 1) % every == 0 and first > 1
    else:
        assert first > 1  # the first steps (process groups, warm caches) are left out


def test_the_window_means_the_slowest_stage_and_sums_the_link():
    rows = [{"step": s, "stages": [{"step_s": s, "sync_bytes": 10.0}, {"step_s": 2 * s, "sync_bytes": 5.0}]}
            for s in (1, 2, 3)]
    got = _window(rows, 2)
    assert got == {"steps": 2, "step_s": (4 + 6) / 2, "link_bytes": 15.0}
    with pytest.raises(RuntimeError, match="no training rows from step 4"):
        _window(rows, 4)


def test_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0 and "shaped link" in capsys.readouterr().out
