"""The trainer end to end on the synthetic task: metrics, evaluation both ways, checkpoints and resume."""

from __future__ import annotations

import json

import pytest

from aqsgd.errors import SpecError
from aqsgd.train.config import TrainConfig
from aqsgd.train.trainer import Trainer


def _cfg(tmp_path, **kw):
    base = dict(task="synthetic-lm", max_train_samples=48, max_eval_samples=16, max_length=12, stages=3,
                micro_batches=2, micro_batch_size=4, epochs=3, lr=3e-3, output_dir=str(tmp_path),
                progress=False, tensorboard=False, forward="delta:q2:stochastic", backward="direct:q4",
                cache_dir=str(tmp_path / "cache"))
    base.update(kw)
    return TrainConfig.of(**base)


def _losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if r["kind"] == "train"]


def test_metrics_summary_and_both_evals(tmp_path):
    summary = Trainer(_cfg(tmp_path, run_name="a", tensorboard=True)).run()
    run = tmp_path / "a"
    assert (run / "summary.json").exists() and (run / "config.json").exists()
    assert any((run / "tensorboard").iterdir())
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert len(train) == 3 * 6 and len(evals) == 3
    assert [r["phase"] for r in train[:6]] == ["warmup"] * 6 and train[6]["phase"] == "train"
    # warm-up sends fp32; afterwards 2-bit activations / 4-bit gradients cut traffic several-fold
    assert train[0]["ratio"] == pytest.approx(1.0, rel=0.05)
    assert train[-1]["ratio"] > 5
    assert set(train[-1]["bytes"]) == {"b0.forward", "b0.backward", "b1.forward", "b1.backward"}
    for e in evals:
        assert ({"loss", "perplexity"} <= set(e["compressed"])
                and {"loss", "perplexity"} <= set(e["uncompressed"]))
    assert summary["steps"] == 18 and summary["compression_ratio"] > 1 and 0 < summary["traffic_saved"] < 1
    assert train[-1]["loss"] < train[0]["loss"]


def test_resume_continues_exactly(tmp_path):
    full = Trainer(_cfg(tmp_path, run_name="full")).run()
    interrupted = Trainer(_cfg(tmp_path, run_name="part", checkpoint_every=4))
    interrupted.run(stop_at=10)  # checkpoints at steps 4 and 8, then "dies" after step 10
    resumed = Trainer(_cfg(tmp_path, run_name="part", checkpoint_every=4,
                           resume=str(tmp_path / "part"))).run()
    expect = dict(_losses(tmp_path / "full"))
    got = _losses(tmp_path / "part")
    # steps 9 and 10 ran twice (before the interruption and again after resuming from step 8); resuming cut
    # the first records of them from metrics.jsonl, so every step is recorded once
    assert [s for s, _ in got] == list(range(1, 19))
    for step, loss in got:
        assert loss == expect[step], step  # bit-identical on CPU
    assert resumed["final_train_loss"] == full["final_train_loss"]


def test_resume_refuses_other_settings(tmp_path):
    Trainer(_cfg(tmp_path, run_name="r", epochs=1, warmup_epochs=0)).run()
    with pytest.raises(Exception, match="forward"):
        Trainer(_cfg(tmp_path, run_name="r2", epochs=1, warmup_epochs=0, forward="direct:q8",
                     resume=str(tmp_path / "r"))).run()


@pytest.mark.parametrize("field,value,needle", [("stages", 0, "--stages"), ("forward", "q9", "--forward"),
                                                ("schedule", "zigzag", "--schedule"),
                                                ("warmup_epochs", 5, "--warmup-epochs"),
                                                ("runtime", "cloud", "--runtime"),
                                                ("layers", [1, 1], "--layers")])
def test_invalid_values_name_the_option(tmp_path, field, value, needle):
    with pytest.raises(SpecError, match=needle):
        _cfg(tmp_path, **{field: value}).validate()


@pytest.mark.parametrize("kw, needle", [
    (dict(warmup_codec="q9"), "--warmup-codec: .*q9"),
    (dict(warmup_codec="q8", backward="ef21:q4"),
     "--warmup-codec: --backward ef21:q4: ef21 keeps the warm-up's"),
    (dict(warmup_codec="q8", forward="none", backward="none"),
     "--warmup-codec: is for directions compressed"),
    (dict(warmup_codec="q8", runtime="distributed", forward="auto", backward="auto"),
     "--forward auto and --backward auto have none"),
    (dict(warmup_codec="q8", warmup_epochs=0, forward="direct:q4"),
     "--warmup-codec: with --warmup-epochs 0 "),
])
def test_a_warmup_codec_needs_a_fixed_direct_or_delta_direction(tmp_path, kw, needle):
    with pytest.raises(SpecError, match=needle):
        _cfg(tmp_path, **kw).validate()
    _cfg(tmp_path, warmup_codec="q8", backward="none").validate()  # one such direction is enough
    _cfg(tmp_path, warmup_codec="q8", warmup_epochs=0).validate()  # delta's first visits


def test_a_warmup_codec_compresses_the_warmup_and_the_first_visits(tmp_path):
    # the warm-up epoch's activations and gradients go as q8 (a quarter of fp32, plus scales and headers),
    # where the plain run sends them in full; after it both send the same codecs
    runs = {}
    for name, kw in (("full", {}), ("q8", dict(warmup_codec="q8"))):
        summary = Trainer(_cfg(tmp_path, run_name=name, epochs=2, **kw)).run()
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        runs[name] = ([r for r in rows if r["kind"] == "train"], summary)
    (full, full_summary), (q8, q8_summary) = runs["full"], runs["q8"]
    assert full[0]["ratio"] == pytest.approx(1.0, rel=0.05) and 3.2 < q8[0]["ratio"] < 4
    assert [r["phase"] for r in q8] == [r["phase"] for r in full]
    assert q8[-1]["ratio"] == pytest.approx(full[-1]["ratio"], rel=0.01)
    assert q8_summary["traffic_saved"] > full_summary["traffic_saved"] + 0.1
    assert q8[-1]["loss"] < q8[0]["loss"]


def test_eval_set_larger_than_the_training_set(tmp_path):
    """Evaluation sample ids go beyond the AQ-SGD caches' capacity (one row per training sample): evaluation
    must not touch (or prefetch from) the caches."""
    summary = Trainer(_cfg(tmp_path, run_name="big-eval", max_train_samples=16, max_eval_samples=40, epochs=2,
                           cache="disk")).run()
    assert summary["steps"] == 4 and summary["eval"]["compressed"]["loss"] > 0


def test_dropout_override_reaches_every_dropout_module():
    import torch.nn as nn

    from aqsgd.pipeline.materialize import ModelRecipe
    from aqsgd.models import with_dropout as _with_dropout

    config = {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
              "intermediate_size": 64, "vocab_size": 50, "max_position_embeddings": 16, "num_labels": 3,
              "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1}
    recipe = ModelRecipe("bert-cls", config)
    assert _with_dropout(recipe, None) is recipe
    off = _with_dropout(recipe, 0.0)
    assert off.config["hidden_dropout_prob"] == off.config["attention_probs_dropout_prob"] == 0.0
    assert off.config["classifier_dropout"] == 0.0 and off.config["hidden_size"] == 32
    before = [m.p for m in recipe.build("cpu").modules() if isinstance(m, nn.Dropout)]
    after = [m.p for m in off.build("cpu").modules() if isinstance(m, nn.Dropout)]
    assert before and set(before) == {0.1} and len(after) == len(before) and set(after) == {0.0}
    with pytest.raises(SpecError, match="resnet models have no dropout setting"):
        _with_dropout(ModelRecipe("resnet", {"in_channels": 1, "num_classes": 2}), 0.0)
    with pytest.raises(SpecError, match="--dropout"):
        TrainConfig.of(dropout=1.5).validate()


def test_trace_profiles_the_last_step_with_the_schedule_labels(tmp_path):
    Trainer(_cfg(tmp_path, run_name="t", epochs=1, warmup_epochs=0, trace=True)).run()
    events = json.loads((tmp_path / "t" / "trace.json").read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    for stage in range(3):
        assert f"stage{stage} FORWARD mb0" in names and f"stage{stage} BACKWARD mb1" in names
    assert "stage0 SEND_F mb0" in names and "stage2 RECV_F mb0" in names and "optimizer step" in names


def test_hooks_run_before_every_step_and_evaluation_and_checkpoints_can_be_off(tmp_path):
    seen = []
    trainer = Trainer(_cfg(tmp_path, run_name="h", eval_every=0, checkpoint_every=0),
                      on_step=[lambda t, step: seen.append((step, t.position["step"]))])
    summary = trainer.run()
    assert seen == [(s, s - 1) for s in range(1, summary["steps"] + 1)]
    rows = [json.loads(line) for line in (tmp_path / "h" / "metrics.jsonl").read_text().splitlines()]
    assert {r["kind"] for r in rows} == {"train"} and summary["eval"] is None
    assert not (tmp_path / "h" / "checkpoints").exists()
    assert [len(r["stages"]) for r in rows] == [3] * len(rows)
    assert all(r["stages"][0]["fw_bytes"] + r["stages"][1]["fw_bytes"] == r["bytes"]["b0.forward"]
               + r["bytes"]["b1.forward"] for r in rows)


@pytest.mark.parametrize("kw, warned", [
    (dict(epochs=1), True),  # the default warm-up epoch is the whole run
    (dict(epochs=3, max_steps=6), True),  # 6 steps per epoch: all of them in the warm-up
    (dict(epochs=3, max_steps=7), False),
    (dict(epochs=1, warmup_epochs=0), False),
    (dict(epochs=1, forward="none", backward="none"), False),  # nothing to compress: nothing to say
    (dict(epochs=1, warmup_codec="q8"), False),  # the warm-up itself is compressed
])
def test_a_run_that_will_never_compress_says_so(tmp_path, caplog, kw, warned):
    with caplog.at_level("WARNING", logger="aqsgd.train.trainer"):
        Trainer(_cfg(tmp_path, **kw))
    lines = [r.getMessage() for r in caplog.records if "will be compressed" in r.getMessage()]
    assert len(lines) == int(warned)
    if warned:
        assert "--warmup-epochs 1, 6 steps each" in lines[0] and "--forward delta:q2:stochastic" in lines[0]
