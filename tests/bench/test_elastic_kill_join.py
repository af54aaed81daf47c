"""``benchmarks.elastic_kill_join``: its runs are valid training options at 2 and 4 replicas, 400 samples a
replica, and a run with fewer than 2 replicas is refused in one line (the runs themselves take minutes: run by
hand)."""

from __future__ import annotations

import pytest

from aqsgd.cli import build_parser
from aqsgd.cli.train import build_config
from benchmarks.elastic_kill_join import main, task


@pytest.mark.parametrize(("replicas", "seed", "sync"), [
    (2, 0, "diloco:10:lr1:momentum0:q8"), (4, 1, "diloco:10:lr1:momentum0:q8"),
    (2, 0, "diloco:50:lr1:momentum0:fragments2:delay5:topk3%:q2")])
def test_the_runs_are_valid_elastic_trainings(replicas, seed, sync, tmp_path):
    args = build_parser().parse_args(["train", *task(replicas, seed, sync), "--output-dir", str(tmp_path)])
    flat = build_config(args).flat()
    assert flat["data_parallel"] == replicas and flat["stages"] == 2 and flat["dp_elastic"]
    assert flat["max_train_samples"] == 400 * replicas and flat["seed"] == seed
    assert flat["grad_sync"] == sync


def test_one_replica_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--replicas", "1"])
    assert "--replicas must be at least 2 (replica 1 is the one killed), got 1" in capsys.readouterr().err
