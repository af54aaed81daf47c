"""The stage runner (shared by the local and distributed runtimes) against the unsplit model."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from aqsgd.compress import make_codec
from aqsgd.compress.base import deferring_checks
from aqsgd.errors import NonFiniteError, PacketError
from aqsgd.pipeline import local as local_module
from aqsgd.pipeline import runner as runner_module
from aqsgd.pipeline.compression import BACKWARD_CHANNEL, FORWARD_CHANNEL, CompressionConfig
from aqsgd.pipeline.partition import partition_model
from aqsgd.pipeline.local import LocalPipeline
from aqsgd.schemes import DeltaScheme
from aqsgd.train.engine import OptimConfig, PipelineEngine

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
            sender = pipe.runners[b].schemes[(b, FORWARD_CHANNEL, "sender")]
            receiver = pipe.runners[b + 1].schemes[(b, FORWARD_CHANNEL, "receiver")]
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
        receiver = cfg.make(0, FORWARD_CHANNEL, "receiver", row_shape=(64,), dtype=torch.float32,
                            device="cpu", replica=replica)
        return receiver.recv(sender.send(x))

    assert torch.equal(sent(0), sent(0))  # deterministic per replica
    assert not torch.equal(sent(0), sent(1))
    assert cfg.scheme_seed(0, FORWARD_CHANNEL, 0) == 3 * 1000  # unchanged for replica 0
    seeds = {cfg.scheme_seed(b, ch, r) for b in range(4) for ch in (FORWARD_CHANNEL, BACKWARD_CHANNEL)
             for r in range(4)}
    assert len(seeds) == 32


def test_schedule_actions_are_labelled_for_the_profiler():
    case = CASES["mlp"]()
    pipe = LocalPipeline(partition_model(case.model, 2), CompressionConfig.simple("q8", "q8"),
                         schedule="1f1b")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        pipe.step(split_batch(case.batch, 2))
    names = {e.name for e in prof.events()}
    for m in (0, 1):
        assert {f"stage0 FORWARD mb{m}", f"stage0 SEND_F mb{m}", f"stage0 encode F mb{m}",
                f"stage0 RECV_B mb{m}", f"stage0 wait B mb{m}", f"stage0 decode B mb{m}",
                f"stage0 BACKWARD mb{m}"} <= names
        assert {f"stage1 RECV_F mb{m}", f"stage1 wait F mb{m}", f"stage1 decode F mb{m}",
                f"stage1 FORWARD mb{m}", f"stage1 BACKWARD mb{m}", f"stage1 SEND_B mb{m}",
                f"stage1 encode B mb{m}"} <= names
    assert {"stage0 wait sends", "stage1 wait sends"} <= names


def test_outside_a_profiler_no_label_is_made(monkeypatch):
    """Labels cost dispatcher calls per action; without a profiler recording the runner makes none, and the
    step's numbers are those of a labelled step."""

    made = []
    real = runner_module.record_function
    monkeypatch.setattr(runner_module, "record_function", lambda name: made.append(name) or real(name))
    case = CASES["mlp"]()
    stages = partition_model(case.model, 2)
    plain = LocalPipeline(copy.deepcopy(stages),
                          CompressionConfig.simple("q8", "q8")).step(split_batch(case.batch, 2))
    assert made == []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        labelled = LocalPipeline(stages,
                                 CompressionConfig.simple("q8", "q8")).step(split_batch(case.batch, 2))
    assert "stage0 FORWARD mb0" in made
    assert torch.equal(plain, labelled)


def test_runner_state_round_trip_builds_the_schemes(tmp_path):
    """A runner's state names each scheme with the shape and dtype it was built for; a fresh runner given the
    folders their save() wrote builds the same schemes and continues bit for bit."""
    comp = CompressionConfig.simple("delta:q2:stochastic", "ef21:q4", num_samples=BATCH)
    case = CASES["gpt2"]()
    pipe = LocalPipeline(partition_model(case.model, 2), comp)
    mbs = split_batch(case.batch, 2)
    for phase in ("warmup", "train"):
        pipe.step(mbs, phase=phase)
    folders = []
    for i, runner in enumerate(pipe.runners):
        state = runner.state_dict()
        assert set(state) == {(0, FORWARD_CHANNEL, "sender" if i == 0 else "receiver"),
                              (0, BACKWARD_CHANNEL, "receiver" if i == 0 else "sender")}
        for key, entry in state.items():
            assert entry["shape"] == [BATCH // 2, 12, 32] and entry["dtype"] == "float32"
            assert entry["scheme"] is runner.schemes[key]
            entry["scheme"].save(tmp_path / f"{i}-{key[1]}")
        folders.append({key: {**entry, "scheme": tmp_path / f"{i}-{key[1]}"} for key, entry in state.items()})
    fresh = LocalPipeline(partition_model(case.model, 2), comp)
    for runner, state in zip(fresh.runners, folders):
        runner.load_state_dict(state)
    assert [sorted(r.schemes) for r in fresh.runners] == [sorted(r.schemes) for r in pipe.runners]
    assert float(fresh.step(mbs)) == float(pipe.step(mbs))
    with pytest.raises(ValueError, match="has no scheme"):
        fresh.runners[0].load_state_dict(
            {(0, FORWARD_CHANNEL, "receiver"): folders[1][(0, FORWARD_CHANNEL, "receiver")]})


def _engine(model, stages=2):
    return PipelineEngine(dict(enumerate(partition_model(model, stages))), stages,
                          CompressionConfig.simple("q8", "q8"), OptimConfig(lr=1e-2))


def test_engine_state_round_trip_with_tied_weights():
    """The engine's state holds a tied tensor once; a fresh engine loads it strictly and continues exactly."""
    mbs = split_batch(CASES["gpt2"]().batch, 2)
    a, b = _engine(CASES["gpt2"]().model, 1), _engine(CASES["gpt2"]().model, 1)
    a.train_step(mbs)
    state = a.state_dict()
    model = state[0]["model"]
    assert ("wte.weight" in model) != ("lm_head.weight" in model)
    assert state[0]["optimizer_class"] == "AdamW" and state[0]["schemes"] == {}
    assert b.load_state_dict(state) == {0: ([], [])}
    assert a.train_step(mbs) == b.train_step(mbs)
    with pytest.raises(ValueError, match="unknown state entries"):
        b.load_state_dict({0: {"weights": model}})
    with pytest.raises(ValueError, match="does not own stage"):
        b.load_state_dict({1: {}})
    with pytest.raises(ValueError, match="weights do not fit stage 0"):
        b.load_state_dict({0: {"model": {"extra": torch.zeros(1), **model}}})


def test_evaluate_keeps_logits_without_leaving_the_stage_flag_set():
    case = CASES["bert"]()
    engine = _engine(case.model)
    loss, logits = engine.evaluate(split_batch(case.batch, 2), "eval_raw", keep_logits=True)
    assert loss == pytest.approx(float(case.loss(case.model, case.batch).detach()), rel=1e-5)
    assert [tuple(t.shape) for t in logits] == [(BATCH // 2, 3)] * 2
    assert not engine.stages[1].keep_logits
    assert engine.evaluate(split_batch(case.batch, 2), "eval_raw")[1] is None


# -- checks of received packets: at once on the CPU, pending until the step's end where deferred (a GPU) -----
def _corrupt_first_forward_packet(monkeypatch, scale_bytes):
    """The local transport hands the next stage the first forward packet with its first fp16 scale set to
    ``scale_bytes`` (as a corrupted link would)."""
    real = local_module._LocalView.isend
    done = []

    def isend(self, packets, dst, channel):
        if channel == FORWARD_CHANNEL and not done:
            done.append(True)
            payload = packets[0].payload.clone()
            payload[:2] = torch.tensor(scale_bytes, dtype=torch.uint8)
            packets = [dataclasses.replace(packets[0], payload=payload), *packets[1:]]
        return real(self, packets, dst, channel)

    monkeypatch.setattr(local_module._LocalView, "isend", isend)


def _q4_engine(case):
    return PipelineEngine(dict(enumerate(partition_model(case.model, 2))), 2,
                          CompressionConfig.simple("direct:q4", "direct:q4"), OptimConfig(lr=1e-2))


@pytest.mark.parametrize("deferred", [False, True])
def test_a_corrupt_packet_received_raises_its_error_before_the_optimizer_step(monkeypatch, deferred):
    """A negative scale (the decoded activations stay finite): at once in the decode; deferred (as on a GPU,
    forced here), the stage runs on what it decoded and its runner raises the same error at the step's end,
    before the optimizer steps."""
    case = CASES["gpt2"]()
    engine = _q4_engine(case)
    before = [p.detach().clone() for p in case.model.parameters()]
    _corrupt_first_forward_packet(monkeypatch, (0x00, 0xBC))  # -1.0
    with deferring_checks(True if deferred else None), pytest.raises(PacketError) as e:
        engine.train_step(split_batch(case.batch, 2))
    assert str(e.value) == "q4: packet holds invalid (non-finite or negative) scales"
    assert any(entry.name == "end_step" for entry in e.traceback) == deferred
    assert all(torch.equal(a, b) for a, b in zip(before, case.model.parameters()))


@pytest.mark.parametrize("deferred", [False, True])
def test_a_corrupt_packet_that_makes_nan_is_reported_before_the_refusal_it_causes(monkeypatch, deferred):
    """A NaN scale: deferred, the last stage's loss and gradients are NaN and its codec refuses to send them
    back; the runner reports the corrupt packet it received, the cause, not the refusal."""
    case = CASES["gpt2"]()
    engine = _q4_engine(case)
    _corrupt_first_forward_packet(monkeypatch, (0x00, 0x7E))
    with deferring_checks(True if deferred else None), pytest.raises(PacketError) as e:
        engine.train_step(split_batch(case.batch, 2))
    assert str(e.value) == "q4: packet holds invalid (non-finite or negative) scales"
    assert any(entry.name == "_send" for entry in e.traceback) == deferred


@pytest.mark.parametrize("deferred", [False, True])
def test_a_refused_aqsgd_send_is_a_refusal_not_its_own_decode_error(deferred):
    """AQ-SGD with a low-bit cache (the sender decodes its own packet to update its cache, step by step): NaN
    activations are refused with the one-line refusal, deferred or not; the sender's decode of its own
    refused packet (NaN scales) and its cache's rounding of it are not what is reported."""
    case = CASES["gpt2"]()
    comp = CompressionConfig.simple("delta:q4", "direct:q4", num_samples=BATCH, cache="lowbit4")
    pipe = LocalPipeline(partition_model(case.model, 2), comp)
    mbs = split_batch(case.batch, 2)
    pipe.step(mbs, phase="warmup")  # fills the caches
    with torch.no_grad():
        next(pipe.runners[0].module.parameters()).fill_(float("nan"))
    with deferring_checks(True if deferred else None), pytest.raises(NonFiniteError) as e:
        pipe.step(mbs, phase="train")
    assert str(e.value) == ("the activations that stage 0 sends across boundary 0 (forward) hold NaN or Inf "
                            "(micro-batch 0, codec q4)")


class _LateRecv:
    """A receive whose message has not arrived when the runner looks (``done`` False); its ``wait`` calls
    ``on_wait`` first."""

    def __init__(self, handle, on_wait):
        self.handle, self.on_wait = handle, on_wait

    def done(self):
        return False

    def wait(self, timeout=None):
        self.on_wait()
        return self.handle.wait(timeout)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_error_probes_run_while_a_stage_waits_or_at_the_step_end(schedule, monkeypatch):
    """A sender's error probe (set_probe) is measured where its stage would wait anyway: before a receive
    whose message has not arrived, or, where every message was there (the local runtime), at the step's end
    before the sends are waited for. The step's numbers and the probe's are those of a step with no probe."""
    case = CASES["mlp"]()
    comp = CompressionConfig.simple("q8", "q8")
    plain = LocalPipeline(partition_model(copy.deepcopy(case.model), 3), copy.deepcopy(comp),
                          schedule=schedule)
    pipe = LocalPipeline(partition_model(case.model, 3), comp, schedule=schedule)
    for r in pipe.runners:
        for b, channel in ((r.stage, FORWARD_CHANNEL), (r.stage - 1, BACKWARD_CHANNEL)):
            if 0 <= b < 2:
                r.set_link(b, channel, probe=["q4", "q2"])
    seen = []  # (stage, what): where each stage's probes ran

    def late(runner):  # stage 0's receives (of gradients) have not arrived when it comes to them
        real = runner.transport.irecv

        def irecv(src, channel):
            return _LateRecv(real(src, channel), lambda: seen.append(
                (runner.stage, "wait", [k for k, s in runner.schemes.items() if s.probe_pending])))
        return irecv

    monkeypatch.setattr(pipe.runners[0].transport, "irecv", late(pipe.runners[0]))
    ends = {}
    for r in pipe.runners:
        real_end = r.end_step

        def end_step(r=r, real_end=real_end):
            ends[r.stage] = [k for k, s in r.schemes.items() if s.probe_pending]
            out = real_end()
            assert not any(s.probe_pending for s in r.schemes.values())
            return out
        monkeypatch.setattr(r, "end_step", end_step)
    mbs = split_batch(case.batch, 4)
    loss, ref = pipe.step(mbs), plain.step(mbs)
    assert torch.equal(loss, ref)
    # stage 0 measured its activations' probe before its first wait for a gradient, so nothing was left for
    # its step's end; the other stages' receives were there, so theirs waited for the step's end
    assert seen[0] == (0, "wait", []) and ends[0] == []
    assert ends[1] == [(1, FORWARD_CHANNEL, "sender"), (0, BACKWARD_CHANNEL, "sender")]
    assert ends[2] == [(1, BACKWARD_CHANNEL, "sender")]
    for r, keys in ((pipe.runners[0], [(0, FORWARD_CHANNEL)]),
                    (pipe.runners[1], [(1, FORWARD_CHANNEL), (0, BACKWARD_CHANNEL)]),
                    (pipe.runners[2], [(1, BACKWARD_CHANNEL)])):
        for b, channel in keys:
            errs, samples = r.schemes[(b, channel, "sender")].take_probe()
            assert samples > 0 and 0 < errs[0] < errs[1]
