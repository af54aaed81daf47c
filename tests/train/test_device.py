"""``--device auto|cpu|cuda``: resolving the device and backends, and every layer on the tensors' device.

Each device-parametrized test (the ``device`` fixture of ``tests/conftest.py``) runs on the CPU everywhere
and on the current GPU where torch sees one. On the CPU the GPU code paths must reduce to the CPU code bit for
bit: staging is a no-op and ``--device cpu`` trains exactly as the default does on a machine without a GPU.
"""

from __future__ import annotations

import json
import logging
import os
from types import SimpleNamespace

import pytest
import torch

from aqsgd.cli import main
from aqsgd.comm import FORWARD, Transport, TransportError
from aqsgd.comm.device import (HostStager, check_backends, group_backend, resolve_device, resolve_dp_backend,
                               world_backend)
from aqsgd.comm.testing import run_processes
from aqsgd.compress import make_codec
from aqsgd.compress.topk import _index_bytes, _index_values, index_dtype
from aqsgd.errors import CodecError, SpecError
from aqsgd.parallel import make_grad_sync
from aqsgd.schemes import DeltaScheme, EF21Scheme, EFScheme, Phase, Side
from aqsgd.schemes.cache import DiskCache, LowBitCache, MemoryCache
from aqsgd.schemes.cache.disk import _to_host
from aqsgd.train.config import TrainConfig
from aqsgd.train.feed import DataFeed
from aqsgd.train.trainer import Trainer

needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the error of a machine without a GPU")


# ---------------------------------------------------------------------------- resolving the device
def _fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> list[int]:
    """Pretend torch sees ``count`` GPUs; returns the list that records ``set_device`` calls."""
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: chosen.append(index))
    return chosen


def test_cpu_is_the_cpu_and_auto_without_a_gpu_is_the_cpu(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("cpu", distributed=True) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("auto", distributed=True) == torch.device("cpu")


def test_cuda_without_a_gpu_is_a_one_line_spec_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SpecError) as info:
        resolve_device("cuda")
    message = str(info.value)
    assert message.startswith("--device cuda: ") and "no CUDA device" in message and "\n" not in message


def test_unknown_device_is_a_spec_error():
    with pytest.raises(SpecError, match="--device tpu: not one of auto, cpu, cuda"):
        resolve_device("tpu")


def test_auto_takes_the_gpu_and_a_local_run_the_current_one(monkeypatch):
    chosen = _fake_gpus(monkeypatch, 2)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert chosen == []  # a local run leaves the current device alone


@pytest.mark.parametrize("local_rank, count, index", [(0, 1, 0), (3, 1, 0), (1, 2, 1), (4, 3, 1), (7, 8, 7)])
def test_distributed_process_takes_local_rank_mod_device_count(monkeypatch, local_rank, count, index):
    chosen = _fake_gpus(monkeypatch, count)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    assert resolve_device("auto", distributed=True) == torch.device("cuda", index)
    assert chosen == [index]  # made current before any process group binds to a GPU


def test_distributed_without_local_rank_is_rank_zero_and_a_bad_one_an_error(monkeypatch):
    chosen = _fake_gpus(monkeypatch, 4)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert resolve_device("cuda", distributed=True) == torch.device("cuda", 0) and chosen == [0]
    monkeypatch.setenv("LOCAL_RANK", "two")
    with pytest.raises(SpecError, match="LOCAL_RANK='two' is not an integer"):
        resolve_device("cuda", distributed=True)


def test_backends_follow_the_device():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve_dp_backend("auto", cpu) == "gloo" and resolve_dp_backend("auto", gpu) == "nccl"
    assert resolve_dp_backend("gloo", gpu) == "gloo" and resolve_dp_backend("nccl", gpu) == "nccl"
    assert world_backend(cpu) == "gloo" and world_backend(cpu, "nccl") == "gloo"
    assert world_backend(gpu, "gloo") == "gloo" and world_backend(gpu, "nccl") == "cpu:gloo,cuda:nccl"
    assert group_backend("nccl") == "cpu:gloo,cuda:nccl" and group_backend("gloo") == "gloo"
    check_backends(cpu, "gloo", "auto")
    check_backends(gpu, "nccl", "nccl")
    with pytest.raises(SpecError, match="--p2p-backend nccl: NCCL runs on GPUs only"):
        check_backends(cpu, "nccl", "auto")
    with pytest.raises(SpecError, match="--dp-backend nccl: NCCL runs on GPUs only"):
        check_backends(cpu, "gloo", "nccl")
    with pytest.raises(SpecError, match="--dp-backend mpi"):
        check_backends(gpu, "gloo", "mpi")


def test_config_refuses_nccl_on_the_cpu_and_unknown_devices():
    with pytest.raises(SpecError, match="p2p_backend|p2p-backend"):
        TrainConfig.of(device="cpu", p2p_backend="nccl").validate()
    with pytest.raises(SpecError, match="dp_backend|dp-backend"):
        TrainConfig.of(device="cpu", dp_backend="nccl").validate()
    with pytest.raises(SpecError, match="device"):
        TrainConfig.of(device="tpu").validate()


@needs_no_gpu
def test_trainer_with_device_cuda_and_no_gpu_fails_in_one_line(tmp_path):
    with pytest.raises(SpecError, match="^--device cuda: "):
        Trainer(_cfg(tmp_path, run_name="cuda", device="cuda"))


@needs_no_gpu
def test_bench_codecs_device_cuda_without_a_gpu(capsys):
    assert main(["bench", "codecs", "--device", "cuda", "--codecs", "q8", "--shape", "4,8", "--repeats", "1",
                 "--warmup", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("aqsgd: error: --device cuda: ") and "\n" not in err


def test_bench_codecs_runs_where_auto_says(capsys, tmp_path):
    out = tmp_path / "codecs.json"
    assert main(["bench", "codecs", "--codecs", "q4", "topk0.5", "--shape", "4,300", "--repeats", "1",
                 "--warmup", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert {r["device"].split(":")[0] for r in rows} == {"cuda" if torch.cuda.is_available() else "cpu"}
    queued = [r["encode_queued_gbps"] for r in rows] + [r["decode_queued_gbps"] for r in rows]
    if torch.cuda.is_available():  # a GPU's rates with calls queued, and what one launch costs
        assert all(q > 0 for q in queued) and data["launch_us"]["triton_queued"] > 0
        assert all(r["encode_slowest"] and r["encode_slowest"][0][1] > 0 for r in rows)
    else:
        assert queued == [None] * 4 and "launch_us" not in data
        assert [r["encode_slowest"] for r in rows] == [None, None]


def test_the_slowest_device_operations_are_summed_by_name():
    from aqsgd.bench.codecs import slowest

    ops = [("topk_hist", 40.0), ("fill", 2.0), ("topk_hist", 50.0), ("topk_write", 60.0), ("copy", 1.0)]
    assert slowest(ops) == [["topk_hist", 90.0, 2], ["topk_write", 60.0, 1], ["fill", 2.0, 1]]
    assert slowest([]) == []


def test_launch_costs_time_each_kind_of_call():
    """Under Triton's interpreter on the CPU (the kernel runs in Python: the figures say nothing of a GPU,
    the keys and the calls are what is checked); None where the Triton kernels do not run."""
    import subprocess
    import sys

    from aqsgd.compress.kernels import triton as triton_kernels

    if not triton_kernels.available("cpu"):
        from aqsgd.bench.codecs import launch_costs

        assert launch_costs(torch.device("cpu")) is None
    pytest.importorskip("triton")
    probe = ("import json, torch\nfrom aqsgd.bench.codecs import launch_costs\n"
             "print(json.dumps(launch_costs(torch.device('cpu'), repeats=3)))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    costs = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(costs) == {"sync", "torch_add", "torch_empty", "triton", "triton_unfused", "torch_add_queued",
                          "triton_queued", "triton_unfused_queued"}
    assert all(v > 0 for v in costs.values())


# ---------------------------------------------------------------------------- codecs
CODECS = ["none", "fp32", "fp16", "bf16", "q1", "q2", "q3:block16", "q4:token", "q8:midrise", "q4:l2:scale32",
          "q2:stochastic", "topk0.1", "topk0.25+q8", "topk0.5:tensor+bf16"]


@pytest.mark.parametrize("spec", CODECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_codec_roundtrip_stays_on_the_tensors_device(device, spec, dtype):
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(3, 5, 40, generator=g, device=device).to(dtype)
    codec = make_codec(spec)
    packet = codec.encode(x, generator=g)
    assert packet.payload.device == x.device and packet.nbytes == codec.wire_bytes(x.shape, dtype)
    y = codec.decode(packet)
    assert y.device == x.device and y.dtype == x.dtype and y.shape == x.shape
    if codec.lossless:
        assert torch.equal(y, x)
    # the bytes are the same wherever they are decoded
    assert torch.equal(codec.decode(packet.__class__.from_bytes(packet.to_bytes())).to(device), y)


@pytest.mark.parametrize("n", [200, 300, 70_000])  # positions of 1, 2 and 4 bytes
def test_topk_positions_are_the_bytes_of_the_narrow_unsigned_type(device, n):
    codec = make_codec("topk0.01+fp32")
    x = torch.randn(2, n, generator=torch.Generator().manual_seed(n)).to(device)
    packet = codec.encode(x)
    y = codec.decode(packet)
    kept = x.abs().topk(codec.layout(x.shape)[2], dim=1).indices
    assert torch.equal(y.gather(1, kept), x.gather(1, kept)) and int((y != 0).sum()) == kept.numel()
    idx = torch.randint(0, n, (17,), device=device)
    width = index_dtype(n).itemsize
    raw = _index_bytes(idx, width)
    assert raw.device == idx.device and raw.numel() == 17 * width
    assert torch.equal(_index_values(raw, width), idx)
    if device.type == "cpu":  # the bytes of the unsigned dtype itself, on the CPU where it is fully supported
        assert torch.equal(raw, idx.to(index_dtype(n)).view(torch.uint8).view(-1))


def test_stochastic_rounding_takes_a_generator_on_the_tensors_device(device):
    codec = make_codec("q3:stochastic")
    x = torch.randn(4, 64, device=device)
    a = codec.encode(x, generator=torch.Generator(device=device).manual_seed(5))
    b = codec.encode(x, generator=torch.Generator(device=device).manual_seed(5))
    assert torch.equal(a.payload, b.payload)
    if device.type == "cuda":
        with pytest.raises(CodecError, match="needs a generator on that device"):
            codec.encode(x, generator=torch.Generator().manual_seed(5))


# ---------------------------------------------------------------------------- caches and schemes
ROW = (6, 10)


def _cache(kind: str, device: torch.device, tmp_path, name: str = "c"):
    if kind == "memory":
        return MemoryCache(20, ROW, device=device)
    if kind == "lowbit":
        return LowBitCache(20, ROW, bits=4, block=16, device=device)
    return DiskCache(tmp_path / f"{name}.bin", 20, ROW, device=device)


@pytest.mark.parametrize("kind", ["memory", "lowbit", "disk"])
def test_every_cache_lives_on_the_device_and_loads_on_the_cpu(device, kind, tmp_path):
    cache = _cache(kind, device, tmp_path)
    ids = torch.tensor([3, 7, 11, 0])
    rows = torch.randn(4, *ROW, device=device) * 3
    stored = cache.put(ids, rows)
    assert stored.device == cache.device and cache.device.type == device.type
    assert cache._visited.device.type == "cpu"  # sample ids are host data: no device round trip
    cache.prefetch(ids)
    got = cache.get(ids)
    assert got.device == cache.device and torch.equal(got, stored)
    assert cache.visited(torch.arange(20)).tolist() == [i in (0, 3, 7, 11) for i in range(20)]
    cache.save(tmp_path / "saved")
    on_cpu = _cache(kind, torch.device("cpu"), tmp_path, "restored")
    on_cpu.load(tmp_path / "saved")
    assert torch.equal(on_cpu.get(ids), stored.cpu())
    for c in (cache, on_cpu):
        if isinstance(c, DiskCache):
            c.close()


def test_disk_cache_host_copy_is_a_no_op_on_the_cpu(device):
    t = torch.randn(3, 4, device=device, dtype=torch.float16)
    host = _to_host(t)
    assert host.device.type == "cpu" and torch.equal(host, t.cpu())
    if device.type == "cpu":
        assert host is t
    else:
        assert host.is_pinned()


def test_aqsgd_sides_stay_bit_identical_on_the_device(device):
    sender = DeltaScheme("q2", Side.SENDER, cache=MemoryCache(16, device=device), seed=3, device=device)
    receiver = DeltaScheme("q2", Side.RECEIVER, cache=MemoryCache(16, device=device), seed=3, device=device)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        ids = torch.randperm(16, generator=g)[:5]
        x = torch.randn(5, 8, generator=g).to(device)
        phase = Phase.WARMUP if step == 0 else Phase.TRAIN
        y = receiver.recv(sender.send(x, ids, phase=phase), ids, phase=phase)
        assert y.device == x.device
        assert torch.equal(sender.cache.get(ids), receiver.cache.get(ids))


@pytest.mark.parametrize("cls", [EFScheme, EF21Scheme])
def test_error_feedback_state_lives_on_the_device_and_loads_anywhere(device, cls, tmp_path):
    sender = cls("q4:stochastic", Side.SENDER, seed=2, device=device)
    assert sender.generator.device.type == device.type
    x = torch.randn(4, 12, device=device)
    for _ in range(2):
        sender.send(x, phase=Phase.TRAIN, slot=0)
    assert sender.state.buffers[0].device == x.device
    sender.save(tmp_path / "ef")
    here = cls("q4:stochastic", Side.SENDER, seed=2, device=device)
    here.load(tmp_path / "ef")
    assert torch.equal(here.state.buffers[0], sender.state.buffers[0])
    ours, theirs = here.send(x, phase=Phase.TRAIN)[0], sender.send(x, phase=Phase.TRAIN)[0]
    assert torch.equal(ours.payload, theirs.payload)
    on_cpu = cls("q4:stochastic", Side.SENDER, seed=2, device="cpu")
    on_cpu.load(tmp_path / "ef")
    assert on_cpu.state.buffers[0].device.type == "cpu"


def test_a_generator_saved_on_another_kind_of_device_restarts_from_the_seed(caplog):
    scheme = EFScheme("q2:stochastic", Side.SENDER, seed=9, device="cpu")
    fresh = torch.Generator().manual_seed(9).get_state()
    scheme.generator.manual_seed(123)
    with caplog.at_level(logging.WARNING, logger="aqsgd.schemes.base"):
        scheme.load_state_dict({"generator": torch.zeros(16, dtype=torch.uint8)})  # a CUDA generator's state
    assert torch.equal(scheme.generator.get_state(), fresh)
    assert "restarts from seed 9" in caplog.text
    with pytest.raises(RuntimeError):  # a damaged state of no known kind is still an error
        scheme.load_state_dict({"generator": torch.zeros(100, dtype=torch.uint8)})


# ---------------------------------------------------------------------------- transport and gradient sync
def test_host_staging_is_a_no_op_on_the_cpu():
    tensors = [torch.arange(5, dtype=torch.uint8), torch.ones(3)]
    out, event = HostStager("cpu").to_host(tensors)
    assert event is None and all(a is b for a, b in zip(out, tensors))


def _device_rank(rank: int, world_size: int, device_type: str) -> dict:
    device = torch.device("cpu") if device_type == "cpu" else resolve_device("cuda")
    out: dict = {}
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 40, generator=g).to(device)
    packets = [make_codec(spec).encode(x).with_tag(i) for i, spec in enumerate(["q2", "topk0.1+q8", "fp16"])]
    with Transport(timeout_s=30, device=device, backend="gloo") as t:
        if device.type == "cpu":
            staged, keep, ready, host = t._stage(tuple(packets))
            out["cpu_staging_is_identity"] = (all(a is b for a, b in zip(staged, packets)) and keep == ()
                                              and ready is None and host)
        if rank == 0:
            t.send(packets, 1, FORWARD)
            out["sent"] = [p.to_bytes(checksum=False) for p in packets]
        else:
            got = t.recv(0, FORWARD)
            out["received"] = [p.to_bytes(checksum=False) for p in got]
            out["devices"] = sorted({p.payload.device.type for p in got})
    try:
        Transport(device="cpu", backend="nccl")
    except TransportError as e:
        out["nccl_on_cpu"] = str(e)
    # gradient sync of parameters on the device through gloo: buckets and error feedback in host memory
    params = [torch.nn.Parameter(torch.zeros(30, 20, device=device)),
              torch.nn.Parameter(torch.zeros(7, device=device))]
    for spec in ("allreduce", "q8", "powersgd:rank2"):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(device)
        sync = make_grad_sync(spec, bucket_mb=0.001, device="cpu")
        sync.sync(params)
        flat = torch.cat([p.grad.reshape(-1) for p in params]).cpu()
        every = [torch.empty_like(flat) for _ in range(world_size)]
        torch.distributed.all_gather(every, flat)
        out[spec] = {"grad_devices": sorted({p.grad.device.type for p in params}),
                     "same": all(torch.equal(every[0], e) for e in every[1:]),
                     "state_devices": sorted({v.device.type for v in sync.state_dict().values()})}
        restored = make_grad_sync(spec, bucket_mb=0.001, device=device)
        restored.load_state_dict(sync.state_dict())
        out[spec]["restored_devices"] = sorted({v.device.type for k, v in restored.state_dict().items()
                                                if k != "iter"})
    return out


def test_transport_and_grad_sync_on_the_device(device):
    first, second = run_processes(_device_rank, 2, args=(device.type,), timeout_s=120)
    assert second["received"] == first["sent"] and second["devices"] == [device.type]
    if device.type == "cpu":
        assert first["cpu_staging_is_identity"] and second["cpu_staging_is_identity"]
    assert "needs a CUDA device" in first["nccl_on_cpu"]
    for spec in ("allreduce", "q8", "powersgd:rank2"):
        for r in (first, second):
            assert r[spec]["grad_devices"] == [device.type] and r[spec]["same"], (spec, r[spec])
            assert r[spec]["state_devices"] in ([], ["cpu"]), (spec, r[spec])
            assert r[spec]["restored_devices"] in ([], [device.type]), (spec, r[spec])
    assert first["q8"]["state_devices"] == ["cpu"] and first["q8"]["restored_devices"] == [device.type]


# ---------------------------------------------------------------------------- training
def _cfg(tmp_path, **kw):
    base = dict(task="synthetic-lm", max_train_samples=32, max_eval_samples=8, max_length=12, stages=3,
                micro_batches=2, micro_batch_size=4, epochs=2, warmup_epochs=1, lr=3e-3,
                output_dir=str(tmp_path), progress=False, tensorboard=False, forward="delta:q4",
                backward="ef21:q8", cache_dir=str(tmp_path / "cache"))
    base.update(kw)
    return TrainConfig.of(**base)


def _losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return ([r["loss"] for r in rows if r["kind"] == "train"],
            [r[k]["loss"] for r in rows if r["kind"] == "eval" for k in ("compressed", "uncompressed")])


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto means the GPU here")
def test_device_cpu_trains_bit_for_bit_as_the_default(tmp_path):
    Trainer(_cfg(tmp_path, run_name="default")).run()
    trainer = Trainer(_cfg(tmp_path, run_name="cpu", device="cpu"))
    assert trainer.device == torch.device("cpu")
    trainer.run()
    assert _losses(tmp_path / "cpu") == _losses(tmp_path / "default")


def test_training_on_the_device_and_resuming_on_the_cpu(device, tmp_path):
    trainer = Trainer(_cfg(tmp_path, run_name="run", device=device.type, checkpoint_every=4))
    assert trainer.device.type == device.type
    assert all(p.device.type == device.type for m in trainer.engine.stages.values() for p in m.parameters())
    trainer.run()
    train, evals = _losses(tmp_path / "run")
    assert len(train) == 8 and all(torch.isfinite(torch.tensor(train + evals)))
    # the checkpoint of step 4, written from the device, continues on the CPU
    resumed = Trainer(_cfg(tmp_path, run_name="resumed", device="cpu", checkpoint_every=4,
                           resume=str(tmp_path / "run" / "checkpoints" / "step-00000004")))
    resumed.run()
    again, _ = _losses(tmp_path / "resumed")
    if device.type == "cpu":
        assert again == train[4:]  # bit for bit
    else:  # other arithmetic on the GPU: close, not equal
        assert again[-4:] == pytest.approx(train[4:], rel=0.05)


def test_batches_stay_put_on_the_cpu_and_ids_stay_on_the_host():
    batch = {"input_ids": torch.ones(2, 3, dtype=torch.long), "sample_ids": torch.tensor([4, 5])}
    assert DataFeed.on_device(SimpleNamespace(device=torch.device("cpu")), batch) is batch
    if torch.cuda.is_available():
        moved = DataFeed.on_device(SimpleNamespace(device=torch.device("cuda", 0)), batch)
        assert moved["input_ids"].is_cuda and not moved["sample_ids"].is_cuda


def test_backend_options_that_would_do_nothing_are_refused():
    with pytest.raises(SpecError, match="^--p2p-backend: carries packets between stage processes"):
        TrainConfig.of(device="cuda", p2p_backend="nccl").validate()  # local runtime
    with pytest.raises(SpecError, match="^--dp-backend: .* needs --data-parallel 2"):
        TrainConfig.of(runtime="distributed", dp_backend="gloo").validate()
    TrainConfig.of(runtime="distributed", data_parallel=2, dp_backend="gloo").validate()


def test_dtype_auto_is_bf16_on_a_gpu_with_bf16_and_fp32_elsewhere(monkeypatch):
    from aqsgd.train.build import compute_dtype

    assert compute_dtype("auto", torch.device("cpu")) == "fp32"
    assert compute_dtype("bf16", torch.device("cpu")) == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert compute_dtype("auto", torch.device("cuda", 0)) == "bf16"
    assert compute_dtype("fp32", torch.device("cuda", 0)) == "fp32"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert compute_dtype("auto", torch.device("cuda", 0)) == "fp32"
