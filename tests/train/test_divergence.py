"""A diverging run stops at its first non-finite step with one line and a non-zero exit (or skips such steps
when asked); NaN never reaches the weights, metrics.jsonl or a checkpoint, and a codec that refuses a NaN
activation says where it was."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aqsgd.compress.base import deferring_checks
from aqsgd.errors import DivergedError
from aqsgd.train.config import TrainConfig
from aqsgd.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
# the divergence command of the issue that found it: plain SGD at lr 10 without clipping or compression
DIVERGING = ["--config", str(ROOT / "configs" / "synthetic-quick.toml"), "--optimizer", "sgd", "--lr", "10",
             "--max-grad-norm", "0", "--forward", "none", "--backward", "none", "--max-steps", "30",
             "--no-progress", "--no-tensorboard"]


def _cfg(tmp_path, **kw):
    base = dict(task="synthetic-lm", max_train_samples=32, max_eval_samples=8, max_length=12, stages=2,
                micro_batches=2, micro_batch_size=4, epochs=2, warmup_epochs=0, lr=3e-3,
                output_dir=str(tmp_path), run_name="run", progress=False, tensorboard=False, forward="none",
                backward="none",
                cache_dir=str(tmp_path / "cache"), checkpoint_every=1, keep_checkpoints=8)
    base.update(kw)
    return TrainConfig.of(**base)


def _rows(tmp_path, kind="train"):
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


class Poison:
    """An ``on_step`` hook: at the given steps every gradient of ``stage``'s first parameter becomes NaN (for
    that step only); ``weights``: its weight itself becomes NaN instead. Records each parameter before each
    step."""

    def __init__(self, steps, *, stage=0, weights=False):
        self.steps, self.stage, self.weights = set(steps), stage, weights
        self.handle = None
        self.before: dict[int, torch.Tensor] = {}

    def __call__(self, trainer, step):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        param = next(trainer.engine.stages[self.stage].parameters())
        self.before[step] = param.detach().clone()
        if step in self.steps:
            if self.weights:
                with torch.no_grad():
                    param.fill_(float("nan"))
            else:
                self.handle = param.register_hook(lambda g: torch.full_like(g, float("nan")))


def test_the_diverging_command_stops_at_its_first_non_finite_step(tmp_path):
    out = subprocess.run([sys.executable, "-m", "aqsgd.cli", "train", *DIVERGING,
                          "--output-dir", str(tmp_path), "--run-name", "run",
                          "--cache-dir", str(tmp_path / "cache")],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 3, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("aqsgd: error:")]
    assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    line = errors[0]
    step = int(line.split("training diverged at step ")[1].split(":")[0])
    assert "gradient norm nan" in line or "gradient norm inf" in line, line
    assert "lower the learning rate (now --lr 10)" in line and "--max-grad-norm 1; now 0, off" in line, line
    assert "--skip-nonfinite N" in line, line
    # stopped at the first non-finite step: every step before it is logged, finite, and none after it
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, step)), line
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    # no train row holds a NaN anywhere. An evaluation of the diverging weights may read inf or NaN (on a
    # GPU in bf16 the file held a NaN, here perplexity inf): that is what the model gives, so it is logged
    assert not any("NaN" in json.dumps(r) for r in rows)
    # the newest checkpoint is the one the message names, and it holds finite weights
    checkpoints = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))
    assert checkpoints and f"the last complete checkpoint is {checkpoints[-1]}" in line, line
    from safetensors.torch import load_file

    for f in checkpoints[-1].glob("stage*/model.safetensors"):
        assert all(torch.isfinite(t).all() for t in load_file(str(f)).values() if t.is_floating_point())


def test_a_non_finite_step_is_not_applied_and_stops_the_run(tmp_path):
    poison = Poison([3])
    trainer = Trainer(_cfg(tmp_path), on_step=[poison])
    with pytest.raises(DivergedError) as e:
        trainer.run()
    text = str(e.value)
    assert "\n" not in text
    assert text.startswith("training diverged at step 3: loss ") and (
        ", gradient norm nan; the step was not applied. To go on: lower the learning rate (now --lr 0.003), "
        "clip harder (--max-grad-norm below 1)" in text)
    assert text.endswith(f"the last complete checkpoint is "
                         f"{tmp_path / 'run' / 'checkpoints' / 'step-00000002'} (continue with `aqsgd train "
                         f"--resume {tmp_path / 'run'}`)")
    assert [r["step"] for r in _rows(tmp_path)] == [1, 2]
    param = next(trainer.engine.stages[0].parameters())
    assert param.detach().equal(poison.before[3])  # the NaN gradients never reached the weights
    assert not (tmp_path / "run" / "checkpoints" / "step-00000003").exists()
    assert e.value.exit_code == 3


def test_skip_nonfinite_skips_isolated_steps_and_keeps_training(tmp_path):
    poison = Poison([3, 5])
    summary = Trainer(_cfg(tmp_path, skip_nonfinite=1), on_step=[poison]).run()
    rows = _rows(tmp_path)
    skipped = [r["step"] for r in rows if r.get("skipped")]
    assert skipped == [3, 5] and summary["steps"] == 8
    for r in rows:
        if r["step"] in (3, 5):
            assert r["loss"] is None and r["grad_norm"] is None and r["skipped"].endswith("gradient norm nan")
        else:
            assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])
    # a skipped step leaves the weights as they were; the LR schedule still moves on
    assert poison.before[4].equal(poison.before[3]) and not poison.before[3].equal(poison.before[2])
    assert rows[2]["lr"] != rows[1]["lr"] != rows[3]["lr"]
    assert math.isfinite(summary["final_train_loss"])


def test_skip_nonfinite_stops_after_n_in_a_row(tmp_path):
    with pytest.raises(DivergedError, match=r"training diverged at step 4: .* \(2 such steps in a row; "
                                            r"--skip-nonfinite 1 allows 1\)"):
        Trainer(_cfg(tmp_path, skip_nonfinite=1), on_step=[Poison([3, 4])]).run()


def test_grad_norm_is_logged_without_clipping(tmp_path):
    Trainer(_cfg(tmp_path, max_grad_norm=0.0, epochs=1)).run()
    assert all(r["grad_norm"] > 0 for r in _rows(tmp_path))


@pytest.mark.parametrize("stage,needle", [
    (0, "the activations that stage 0 sends across boundary 0 (forward) hold NaN or Inf (micro-batch 0, "
        "codec q2)"),
    # a NaN weight on the last stage: NaN loss, whose gradient stage 1 sends back
    (1, "the activation gradients that stage 1 sends across boundary 0 (backward) hold NaN or Inf "
        "(micro-batch 0, codec q4)"),
])
@pytest.mark.parametrize("deferred", [False, True])
def test_a_codec_refusing_nan_names_the_step_boundary_and_direction(tmp_path, stage, needle, deferred):
    """``deferred``: the codecs' checks left on the device as on a GPU (forced on the CPU), read by the
    runtime at the hand-over: the same error at the same step."""
    cfg = _cfg(tmp_path, forward="direct:q2", backward="direct:q4")
    with deferring_checks(True if deferred else None), pytest.raises(DivergedError) as e:
        Trainer(cfg, on_step=[Poison([2], stage=stage, weights=True)]).run()
    assert str(e.value).startswith(
        f"training diverged at step 2: {needle}; the step was not applied"), str(e.value)


def test_a_refusal_received_or_met_after_a_lost_peer_is_named_as_the_sender_names_it():
    """Distributed: the receiving stage of a refusal (see aqsgd.comm.wire) and a sending stage whose peer
    stopped on receiving one report the sender's one line."""
    from types import SimpleNamespace

    from aqsgd.errors import NonFiniteError, PeerFailure
    from aqsgd.pipeline.runner import StageRunner

    text = "q4: input holds NaN or Inf; refusing to encode (a diverged step should be caught, not sent)"

    class Handle:
        def __init__(self, error):
            self.error = error

        def done(self):
            return True

        def wait(self, timeout=None):
            raise self.error

    refusal = NonFiniteError(f"stage 0 (rank 0) sent no forward activations, its codec refused them: {text}")
    refusal.sender_message = text
    runner = SimpleNamespace(stage=1, pending_sends=[], _sent=[])
    runner._refused = lambda *a: StageRunner._refused(runner, *a)
    with pytest.raises(NonFiniteError) as e:
        StageRunner._received(runner, Handle(refusal), 0, 3)
    assert str(e.value) == ("the activations that stage 0 sends across boundary 0 (forward) hold NaN or Inf "
                            "(micro-batch 3, codec q4)")
    runner.pending_sends, runner._sent = [Handle(NonFiniteError(text))], [(1, 2, "backward")]
    with pytest.raises(NonFiniteError) as e:
        StageRunner._received(runner, Handle(PeerFailure("lost stage 0")), 0, 3)
    assert str(e.value) == ("the activation gradients that stage 1 sends across boundary 0 (backward) hold "
                            "NaN or Inf (micro-batch 2, codec q4)")


@pytest.mark.slow
def test_distributed_stages_all_stop_at_the_same_step(tmp_path):
    """Every stage learns of the NaN from the norm's all-reduce: one line naming the divergence, exit 3."""
    out = subprocess.run([sys.executable, "-m", "aqsgd.cli", "train", *DIVERGING, "--runtime", "distributed",
                          "--output-dir", str(tmp_path), "--run-name", "run",
                          "--cache-dir", str(tmp_path / "cache"), "--timeout", "30"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 3, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("aqsgd: error:")]
    assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert ": DivergedError: training diverged at step " in errors[0], errors[0]
    step = int(errors[0].split("training diverged at step ")[1].split(":")[0])
    assert [r["step"] for r in _rows(tmp_path)] == list(range(1, step))
