"""Threads of the processes of a job: each computes on its share of its machine's cores (``--threads`` wins,
then ``OMP_NUM_THREADS``, then cores // processes), in processes spawned here and under torchrun; the local
runtime keeps PyTorch's threads unless ``--threads`` is given.

Rank functions and task loaders live at module level so that spawned children can import them.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path

import pytest
import torch

from aqsgd.comm.launch import launch, launch_local, rank_thread_share
from aqsgd.comm.launch.threads import THREAD_VARS, thread_share, usable_cores
from aqsgd.data import DictDataset, TaskArgs, TaskSpec, register_task
from aqsgd.data.datasets import TASKS
from aqsgd.data.synthetic import SyntheticLM
from aqsgd.errors import SpecError
from aqsgd.train import run_training
from aqsgd.train.config import TrainConfig

_RECORD_ENV = "AQSGD_TEST_THREADS_DIR"
_TORCHRUN_VARS = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


# ---------------------------------------------------------------------------- what a process computes with
def _threads_here() -> dict:
    """This process's thread settings: PyTorch's pools, the variables, numba's pool."""
    import numba

    return {"pid": os.getpid(), "torch": torch.get_num_threads(), "interop": torch.get_num_interop_threads(),
            "numba": numba.config.NUMBA_NUM_THREADS, **{k: os.environ.get(k) for k in THREAD_VARS}}


def _rank_threads() -> dict:
    return _threads_here()


def _recording_rows(args: TaskArgs) -> DictDataset:
    """A task loader that records the threads of the process loading it (a stage process) in a file of the
    folder named by the environment, then gives the synthetic task's samples."""
    folder = os.environ.get(_RECORD_ENV)
    if folder:
        with open(os.path.join(folder, f"{os.getpid()}-{args.split}.json"), "w") as f:
            json.dump(_threads_here(), f)
    n, seed = (16, 0) if args.split == "train" else (4, 10_000)
    ds = SyntheticLM(n, args.seq_len, 64, seed=seed)
    rows = [ds[i] for i in range(n)]
    cols = {k: torch.stack([r[k] for r in rows]) for k in ("input_ids", "attention_mask", "labels")}
    return DictDataset(cols, info={"kind": "causal-lm"})


@pytest.fixture
def clean_env(monkeypatch):
    """No thread variable and no torchrun variable in the environment (the children inherit it)."""
    for k in (*THREAD_VARS, *_TORCHRUN_VARS, "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


@pytest.fixture
def torch_threads(monkeypatch):
    """This process's intra-op threads put back after the test; its inter-op pool's size, which can be set
    once per process, recorded instead of set."""
    before = torch.get_num_threads()
    interop: list[int] = []
    monkeypatch.setattr(torch, "set_num_interop_threads", interop.append)
    yield interop
    torch.set_num_threads(before)


@pytest.fixture
def recording_task(tmp_path, clean_env):
    folder = tmp_path / "threads"
    folder.mkdir()
    clean_env.setenv(_RECORD_ENV, str(folder))
    spec = register_task(TaskSpec("test-recording-threads", "causal-lm", True, "records threads",
                                  _recording_rows))
    yield spec, folder
    TASKS.pop(spec.name, None)


def _records(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


def _cfg(tmp_path: Path, task: str, **kw) -> TrainConfig:
    base = dict(task=task, model="tiny-llama", model_layers=2, hidden_size=32, vocab_size=64, max_length=8,
                stages=2, micro_batches=2, micro_batch_size=2, epochs=1, warmup_epochs=0, max_steps=2,
                lr_warmup=0.0, eval_every=0, checkpoint_every=0, output_dir=str(tmp_path / "runs"),
                progress=False, tensorboard=False, cache_dir=str(tmp_path / "cache"), timeout=120.0)
    base.update(kw)
    return TrainConfig.of(**base)


# ---------------------------------------------------------------------------- the share
def test_the_share_is_the_cores_over_the_processes_at_least_one():
    assert thread_share(4, environ={}, cores=2).threads == 1
    assert thread_share(2, environ={}, cores=2).threads == 1
    assert thread_share(3, environ={}, cores=8).threads == 2
    assert thread_share(4, environ={}, cores=64).threads == 16
    alone = thread_share(1, environ={}, cores=8)  # a process alone keeps PyTorch's own default
    assert alone.threads is None and alone.child_environ({}) == {}


def test_the_cores_are_those_of_the_affinity_mask_not_of_the_machine(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert usable_cores() == 2
    share = thread_share(2, environ={})
    assert (share.cores, share.threads) == (2, 1)


def test_omp_num_threads_in_the_environment_wins_over_the_share():
    # torchrun sets OMP_NUM_THREADS=1 where it starts several processes per machine
    share = thread_share(4, environ={"OMP_NUM_THREADS": "1"}, cores=64)
    assert (share.threads, share.source) == (1, "OMP_NUM_THREADS")
    assert thread_share(2, environ={"OMP_NUM_THREADS": "6"}, cores=2).threads == 6
    assert thread_share(1, environ={"OMP_NUM_THREADS": "3"}, cores=8).threads == 3
    assert thread_share(2, environ={"OMP_NUM_THREADS": "4,2"}, cores=2).threads == 4  # nested: first level
    assert thread_share(2, environ={"OMP_NUM_THREADS": " "}, cores=8).threads == 4  # empty: unset


def test_threads_given_with_the_run_win_over_omp_num_threads_and_the_share():
    share = thread_share(4, threads=3, environ={"OMP_NUM_THREADS": "1"}, cores=2)
    assert (share.threads, share.source) == (3, "--threads")
    assert thread_share(1, threads=2, environ={}, cores=8).threads == 2


@pytest.mark.parametrize("value", ["abc", "0", "-2", "1.5"])
def test_an_omp_num_threads_that_is_no_thread_count_is_one_line_naming_it(value):
    with pytest.raises(SpecError, match=r"^OMP_NUM_THREADS=.* is not a number of threads") as e:
        thread_share(2, environ={"OMP_NUM_THREADS": value}, cores=2)
    assert "\n" not in str(e.value)


def test_spawned_processes_get_the_variables_the_environment_leaves_unset():
    share = thread_share(4, environ={}, cores=8)
    assert share.child_environ({}) == {k: "2" for k in THREAD_VARS}
    assert share.child_environ({"MKL_NUM_THREADS": "1"}) == {"OMP_NUM_THREADS": "2", "NUMBA_NUM_THREADS": "2"}
    user = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    given = thread_share(4, threads=3, environ=user, cores=8)
    assert given.child_environ(user) == {k: "3" for k in THREAD_VARS}


def test_the_share_is_said_in_one_line():
    assert thread_share(4, environ={}, cores=2).describe() == \
        "4 stage processes on 2 cores: 1 thread each (OMP_NUM_THREADS unset; --threads to change)"
    assert thread_share(2, environ={"OMP_NUM_THREADS": "1"}, cores=8).describe() == \
        "2 stage processes on 8 cores: 1 thread each (OMP_NUM_THREADS=1; --threads to change)"
    assert thread_share(4, threads=2, environ={}, cores=2).describe() == \
        "4 stage processes on 2 cores: 2 threads each (--threads 2)"
    assert thread_share(1, environ={}, cores=8).describe() == \
        "1 stage process on 8 cores: all of them (OMP_NUM_THREADS unset; --threads to change)"


def test_threads_below_one_are_refused_naming_the_option():
    with pytest.raises(SpecError, match=r"^--threads: must be >= 1, got 0$"):
        TrainConfig.of(threads=0).validate()
    assert TrainConfig.of(threads=2).validate().pipeline.threads == 2


# ---------------------------------------------------------------------------- under torchrun
def _as_torchrun_rank(env, local_world: int, omp: str | None) -> None:
    started = {"TORCHELASTIC_RUN_ID": "test", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
               "LOCAL_WORLD_SIZE": str(local_world)}
    for k, v in started.items():
        env.setenv(k, v)
    if omp is not None:
        env.setenv("OMP_NUM_THREADS", omp)


def test_a_torchrun_rank_keeps_the_omp_num_threads_torchrun_set(clean_env, torch_threads, caplog):
    torch.set_num_threads(2)
    interop_before = torch.get_num_interop_threads()
    _as_torchrun_rank(clean_env, 4, "1")
    with caplog.at_level(logging.INFO, logger="aqsgd.comm.launch"):
        out = launch(_rank_threads, 1)
    assert out[0]["torch"] == 1
    assert torch_threads == ([] if interop_before == 1 else [1])
    # the run says it once it knows its stage (aqsgd.train.driver), so that the line carries the stage
    assert not [r for r in caplog.records if "stage process" in r.getMessage()]
    said = rank_thread_share(None).describe()
    assert said == thread_share(4, environ={"OMP_NUM_THREADS": "1"}).describe()
    assert said.startswith("4 stage processes on ") and said.endswith(
        ": 1 thread each (OMP_NUM_THREADS=1; --threads to change)")


def test_a_torchrun_rank_takes_its_share_of_the_affinity_and_threads_given_win(clean_env, torch_threads):
    clean_env.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    _as_torchrun_rank(clean_env, 2, None)
    assert launch(_rank_threads, 1)[0]["torch"] == 4
    _as_torchrun_rank(clean_env, 2, "1")
    assert launch(_rank_threads, 1, threads=3)[0]["torch"] == 3


def test_a_rank_alone_on_its_machine_keeps_pytorchs_threads(clean_env, torch_threads):
    torch.set_num_threads(2)
    _as_torchrun_rank(clean_env, 1, None)
    assert launch(_rank_threads, 1)[0]["torch"] == 2 and torch_threads == []


# ---------------------------------------------------------------------------- processes spawned here
def test_spawned_processes_compute_on_their_share_and_the_launcher_says_it(clean_env, caplog):
    share = thread_share(2, environ={})
    with caplog.at_level(logging.INFO, logger="aqsgd.comm.launch"):
        out = launch_local(_rank_threads, 2)
    assert share.threads == max(1, usable_cores() // 2)
    for r in out:
        assert r["torch"] == r["interop"] == r["numba"] == share.threads
        assert {k: r[k] for k in THREAD_VARS} == {k: str(share.threads) for k in THREAD_VARS}
    assert [r.getMessage() for r in caplog.records if "stage process" in r.getMessage()] == [share.describe()]
    assert all(k not in os.environ for k in THREAD_VARS)  # the launching process's environment is as it was


def test_threads_given_reach_spawned_processes_over_omp_num_threads(clean_env):
    clean_env.setenv("OMP_NUM_THREADS", "2")
    clean_env.setenv("MKL_NUM_THREADS", "2")
    out = launch_local(_rank_threads, 2, threads=1)
    assert [(r["torch"], r["numba"], r["OMP_NUM_THREADS"], r["MKL_NUM_THREADS"]) for r in out] == \
        [(1, 1, "1", "1")] * 2


def test_omp_num_threads_set_by_the_user_reaches_spawned_processes(clean_env):
    clean_env.setenv("OMP_NUM_THREADS", "1")
    clean_env.setenv("NUMBA_NUM_THREADS", "1")
    out = launch_local(_rank_threads, 2)
    assert [(r["torch"], r["OMP_NUM_THREADS"], r["MKL_NUM_THREADS"], r["NUMBA_NUM_THREADS"]) for r in out] \
        == [(1, "1", "1", "1")] * 2


def test_the_launch_leaves_this_processs_signal_handlers_as_it_found_them(clean_env):
    # PyTorch's launcher installs handlers that raise its SignalException, and leaves them installed
    watched = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
    before = [signal.getsignal(s) for s in watched]
    launch_local(_rank_threads, 1)
    assert [signal.getsignal(s) for s in watched] == before


@pytest.mark.slow
def test_stage_processes_of_a_distributed_run_use_at_most_their_share(tmp_path, recording_task):
    spec, folder = recording_task
    assert run_training(_cfg(tmp_path, spec.name, runtime="distributed", run_name="dist")) is not None
    stages = [r for r in _records(folder) if r["pid"] != os.getpid()]
    assert len({r["pid"] for r in stages}) == 2  # both stage processes recorded
    share = max(1, usable_cores() // 2)
    for r in stages:
        assert 1 <= r["torch"] <= share and r["numba"] <= share
        assert r["OMP_NUM_THREADS"] == str(share)


# ---------------------------------------------------------------------------- the local runtime
def test_a_local_run_keeps_pytorchs_threads_unless_threads_are_given(tmp_path, recording_task):
    spec, folder = recording_task
    before = torch.get_num_threads()
    run_training(_cfg(tmp_path, spec.name, run_name="local"))
    assert {r["torch"] for r in _records(folder)} == {before}
    for p in folder.glob("*.json"):
        p.unlink()
    run_training(_cfg(tmp_path, spec.name, run_name="local1", threads=1))
    assert {r["torch"] for r in _records(folder)} == {1}
    assert torch.get_num_threads() == before  # the calling process gets its threads back
