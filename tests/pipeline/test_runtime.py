"""The stage runner (shared by the local and distributed runtimes) against the unsplit model."""

from __future__ import annotations

import pytest
import torch

from aqsgd.compress import make_codec
from aqsgd.pipeline.compression import FORWARD_CHANNEL, CompressionConfig
from aqsgd.pipeline.partition import partition_model
from aqsgd.pipeline.runner import LocalPipeline
from aqsgd.schemes import DeltaScheme

from .test_partition import BATCH, CASES, reference_step, split_batch

MODELS = ["gpt2", "llama-padded", "bert", "mlp", "resnet"]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("num_microbatches", [1, 4])
@pytest.mark.parametrize("num_stages", [2, 4])
@pytest.mark.parametrize("name", MODELS)
def test_uncompressed_runner_matches_unsplit_model(name, num_stages, num_microbatches, schedule):
    case = CASES[name]()
    ref_loss, ref_grads = reference_step(case)
    pipe = LocalPipeline(partition_model(case.model, num_stages), CompressionConfig.simple("none", "none"),
                         schedule=schedule)
    loss = pipe.step(split_batch(case.batch, num_microbatches))
    torch.testing.assert_close(loss, ref_loss)
    for n, p in case.model.named_parameters():
        if n in ref_grads:
            torch.testing.assert_close(p.grad, ref_grads[n], msg=lambda m, n=n: f"{n}: {m}")


def _aqsgd_pipeline(case, stages=4, schedule="1f1b"):
    comp = CompressionConfig.simple("delta:q2", "direct:q4", num_samples=BATCH)
    return LocalPipeline(partition_model(case.model, stages), comp, schedule=schedule)


def test_aqsgd_caches_identical_and_bytes_match_formula():
    case = CASES["gpt2"]()
    pipe = _aqsgd_pipeline(case)
    opt = torch.optim.SGD(case.model.parameters(), lr=0.1)
    mbs = split_batch(case.batch, 4)
    losses = []
    for step in range(4):
        opt.zero_grad()
        losses.append(float(pipe.step(mbs, phase="warmup" if step == 0 else "train")))
        opt.step()
        for b in range(pipe.num_stages - 1):
            sender = pipe.runners[b].schemes[(b, 0, "sender")]
            receiver = pipe.runners[b + 1].schemes[(b, 0, "receiver")]
            assert isinstance(sender, DeltaScheme)
            ids = torch.arange(BATCH)
            assert torch.equal(sender.cache.get(ids), receiver.cache.get(ids))
    assert all(torch.isfinite(torch.tensor(losses)))
    # after warm-up every micro-batch travels as one 2-bit delta forward and one 4-bit gradient backward
    act_shape = (BATCH // 4, 12, 32)
    fw, bw = make_codec("q2").wire_bytes(act_shape), make_codec("q4").wire_bytes(act_shape)
    for s, stats in enumerate(pipe.stats()):
        assert stats.bytes_sent["forward"] == (4 * fw if s < pipe.num_stages - 1 else 0)
        assert stats.bytes_sent["backward"] == (4 * bw if s > 0 else 0)


def test_eval_phases_and_compression_on_off():
    case = CASES["bert"]()
    pipe = _aqsgd_pipeline(case, stages=2)
    mbs = split_batch(case.batch, 2)
    ref = float(case.loss(case.model, case.batch).detach())
    raw = float(pipe.step(mbs, phase="eval_raw"))
    assert raw == pytest.approx(ref, rel=1e-5)
    comp = float(pipe.step(mbs, phase="eval"))
    assert comp != raw  # 2-bit activations change the loss a little
    assert all(p.grad is None for p in case.model.parameters())


def test_data_parallel_replicas_draw_independent_rounding():
    """Stochastic rounding: the replicas of one boundary get their own random streams (their errors average
    out in the gradient all-reduce); replica 0 keeps the seed of a run without data parallelism."""
    cfg = CompressionConfig.simple("direct:q2:stochastic", "none", seed=3)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))

    def sent(replica: int) -> torch.Tensor:
        sender = cfg.make(0, FORWARD_CHANNEL, "sender", row_shape=(64,), dtype=torch.float32, device="cpu",
                          replica=replica)
        receiver = cfg.make(0, FORWARD_CHANNEL, "receiver", row_shape=(64,), dtype=torch.float32, device="cpu",
                            replica=replica)
        return receiver.recv(sender.send(x))

    assert torch.equal(sent(0), sent(0))  # deterministic per replica
    assert not torch.equal(sent(0), sent(1))
    assert cfg.scheme_seed(0, FORWARD_CHANNEL, 0) == 3 * 1000  # unchanged for replica 0
    seeds = {cfg.scheme_seed(b, ch, r) for b in range(4) for ch in (0, 1) for r in range(4)}
    assert len(seeds) == 32
