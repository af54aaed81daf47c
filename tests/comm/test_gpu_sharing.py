"""Processes that share a GPU: NCCL cannot put two ranks of one group on one GPU ("invalid usage" on a real
one), so ``--dp-backend auto`` takes gloo where replicas of a stage would, and an explicit ``nccl`` is refused
in one line before the run starts. The placement rule is checked here on the CPU, with the GPU count given."""

from __future__ import annotations

import pytest
import torch

from aqsgd.comm.device import gpu_sharing, ranks_sharing_a_gpu, resolve_dp_backend
from aqsgd.errors import SpecError
from aqsgd.parallel import GridLayout
from aqsgd.train import driver
from aqsgd.train.config import TrainConfig

CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize("groups,local,gpus,expected", [
    ([range(4)], 4, 4, None),                       # one GPU each
    ([range(4)], 4, 2, (0, 2, 0)),                  # 4 processes on 2 GPUs: ranks 0 and 2 on GPU 0
    ([range(4)], 4, 1, (0, 1, 0)),
    # 2 stages x 2 replicas on 2 GPUs: stage 0's replicas share
    ([[0, 2], [1, 3]], 4, 2, (0, 2, 0)),
    ([[0, 2], [1, 3]], 4, 4, None),
    ([[0, 3], [1, 4], [2, 5]], 6, 3, (0, 3, 0)),    # 3 stages x 2 replicas on 3 GPUs
    # two machines of 3 processes: replicas on different machines
    ([[0, 3], [1, 4], [2, 5]], 3, 1, None),
    ([[0, 2], [1, 3]], 2, 1, None),
])
def test_which_ranks_share_a_gpu(groups, local, gpus, expected):
    assert ranks_sharing_a_gpu(groups, local_world_size=local, device_count=gpus) == expected


def test_auto_takes_gloo_where_replicas_share_and_nccl_is_refused():
    layout = GridLayout(2, 2)
    shared = gpu_sharing([layout.dp_ranks(s) for s in range(2)], layout.label, world_size=4, device_count=2)
    assert shared == "stage 0 replica 0 and stage 0 replica 1 would share GPU 0 (4 processes on 2 GPUs)"
    assert resolve_dp_backend("auto", CUDA, shared_gpu=shared) == "gloo"
    assert resolve_dp_backend("auto", CUDA) == "nccl"
    assert resolve_dp_backend("gloo", CUDA, shared_gpu=shared) == "gloo"
    with pytest.raises(SpecError) as e:
        resolve_dp_backend("nccl", CUDA, shared_gpu=shared)
    assert str(e.value) == ("--dp-backend nccl: stage 0 replica 0 and stage 0 replica 1 would share GPU 0 (4 "
                            "processes on 2 GPUs), and NCCL cannot put two ranks of one group on one GPU; "
                            "use --dp-backend gloo (or auto), or give every process a GPU of its own")


@pytest.mark.parametrize("kw,gpus,needle", [
    (dict(p2p_backend="nccl", stages=4), 2, "--p2p-backend nccl: stage 0 and stage 2 would share GPU 0 (4 "
                                            "processes on 2 GPUs), and NCCL cannot put two ranks of one "
                                            "group on one GPU; use --p2p-backend gloo"),
    (dict(dp_backend="nccl", stages=2, data_parallel=2), 2, "--dp-backend nccl: stage 0 replica 0 and stage "
                                                            "0 replica 1 would share GPU 0"),
    (dict(dp_backend="nccl", stages=2, data_parallel=2), 4, None),
    (dict(dp_backend="auto", stages=2, data_parallel=2), 1, None),  # auto: gloo, said by the trainer
    (dict(p2p_backend="nccl", stages=2), 2, None),
])
def test_the_launcher_refuses_nccl_on_a_shared_gpu_before_starting(monkeypatch, kw, gpus, needle):
    monkeypatch.setattr(driver, "resolve_device", lambda spec: CUDA)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = TrainConfig.of(runtime="distributed", **kw)
    if needle is None:
        driver._check_gpu_sharing(cfg, device_count=gpus)
        return
    with pytest.raises(SpecError) as e:
        driver._check_gpu_sharing(cfg, device_count=gpus)
    assert str(e.value).startswith(needle) and "\n" not in str(e.value)
