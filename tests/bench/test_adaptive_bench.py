"""``aqsgd bench adaptive``: its measures on made-up runs, then the command end to end on a tiny pipeline."""

from __future__ import annotations

import json

import pytest

from aqsgd.bench.adaptive import (AdaptiveBenchConfig, _run_record, bench_adaptive, best_fixed,
                                  bits_over_steps, combine, fixed_settings, format_scenario, setting_specs,
                                  smoothed, summarize, time_to_target, train_config)


def test_the_fixed_settings_are_the_rungs_of_autos_ladders():
    assert fixed_settings() == {
        "fixed fp16": ("delta:fp16", "direct:bf16"), "fixed q8": ("delta:q8", "direct:q8"),
        "fixed q6": ("delta:q6", "direct:q6"), "fixed q4": ("delta:q4", "direct:q6"),
        "fixed q3": ("delta:q3", "direct:q4"),
        "fixed q2:l2": ("delta:q2:l2", "direct:q4")}


def test_time_to_target_sums_step_times_until_the_smoothed_loss_reaches_it():
    losses = [4.0, 3.0, 2.0, 1.0, 1.0]
    assert smoothed(losses) == [4.0, 3.5, 3.0, 2.0, 4 / 3]
    assert time_to_target(losses, [1.0, 2.0, 3.0, 4.0, 5.0], 2.0) == 10.0
    assert time_to_target(losses, [1.0] * 5, 0.5) is None  # never reached


def _run(setting, losses, step_s, ppl, codecs=None):
    return {"setting": setting, "loss": losses, "step_s": step_s, "codecs": codecs or [None] * len(losses),
            "final": {"perplexity": ppl}}


def test_summary_target_from_fp32_and_the_best_fixed_setting_in_hindsight():
    runs = [_run("fp32", [4.0, 3.0, 2.0, 1.0], [2.0] * 4, 10.0),
            _run("fixed q8", [4.0, 3.0, 2.0, 1.0], [1.0] * 4, 10.1),
            _run("fixed q2:l2", [4.0, 3.5, 3.0, 3.0], [0.5] * 4, 12.0),
            _run("auto", [4.0, 3.0, 2.0, 1.0], [0.9] * 4, 10.05)]
    s = summarize(runs)
    assert s["target_at_step"] == 3 and s["target_loss"] == 3.0  # fp32's mean of 3 steps at 3 of its 4
    assert s["best_fixed"] == "fixed q8"  # q2:l2 is faster per step but never gets there
    by = {r["setting"]: r for r in runs}
    assert by["auto"]["time_to_target_s"] == pytest.approx(2.7)
    assert by["fixed q2:l2"]["time_to_target_s"] is None
    assert by["auto"]["perplexity_vs_fp32"] == pytest.approx(0.005)


def test_a_failed_setting_is_reported_with_its_steps_and_the_others_still_summarized():
    def rows(losses):
        return [{"kind": "train", "loss": x, "time": {"step": 1.0}, "bytes_sent": 10} for x in losses]

    runs = [_run_record("fp32", rows([4.0, 3.0, 2.0, 1.0])),
            _run_record("fixed q8", rows([4.0, 2.0, 1.0, 0.5])),
            _run_record("auto", rows([4.0, 3.0]), error="stage 1 failed: DivergedError: training diverged at "
                                                        "step 3: loss nan")]
    s = summarize(runs)
    assert s["best_fixed"] == "fixed q8"
    auto = runs[-1]
    assert auto["time_to_target_s"] is None and auto["final_perplexity"] is None
    assert auto["median_step_s"] == 1.0
    text = format_scenario("drop", {"link": "x", **s, "runs": runs})
    assert "auto" in text and "FAILED after 2 steps: stage 1 failed: DivergedError" in text
    with pytest.raises(RuntimeError, match="the fp32 run, which sets the target loss, failed: boom"):
        summarize([_run_record("fp32", [], error="boom")])


def test_quality_is_the_mean_perplexity_of_the_evaluations_in_the_last_quarter():
    def rows(ppl_by_step):
        out = [{"kind": "train", "step": s, "loss": 1.0, "time": {"step": 1.0}, "bytes_sent": 1}
               for s in range(1, 9)]
        return out + [{"kind": "eval", "step": s, "uncompressed": {"perplexity": p}} for s, p in ppl_by_step]

    fp32 = _run_record("fp32", rows([(2, 9.0), (4, 5.0), (6, 4.0), (8, 2.0)]))
    auto = _run_record("auto", rows([(2, 9.0), (4, 5.0), (6, 3.0), (8, 3.3)]))
    assert fp32["late_perplexity"] == 3.0 and fp32["final"]["perplexity"] == 2.0  # steps 6 and 8 of 8
    summarize([fp32, auto])
    assert auto["perplexity_vs_fp32"] == pytest.approx(0.05) and auto["final_perplexity"] == 3.3


def test_bits_over_steps_reads_the_spec_each_link_sent_with():
    run = _run("auto", [1.0] * 3, [1.0] * 3, 1.0,
               codecs=[{"b0.forward": "delta:fp16", "b0.backward": "direct:bf16"},
                       {"b0.forward": "delta:q2:l2", "b0.backward": "direct:q6"},
                       {"b0.forward": "delta:q3", "b0.backward": "direct:q6"}])
    assert bits_over_steps(run) == {"b0.backward": [16.0, 6.0, 6.0], "b0.forward": [16.0, 2.0, 3.0]}


def test_bad_settings_and_scenarios_are_refused_in_one_line():
    with pytest.raises(ValueError, match="fp32 is needed"):
        bench_adaptive(AdaptiveBenchConfig(settings=("auto",)))
    with pytest.raises(ValueError, match="unknown flat; valid: uneven, drop"):
        bench_adaptive(AdaptiveBenchConfig(scenarios=("flat",)))
    with pytest.raises(ValueError, match="2 to 4 stages"):
        bench_adaptive(AdaptiveBenchConfig(stages=5))
    with pytest.raises(ValueError, match="setting 'fixed q5': valid are fp32, auto, fixed fp16"):
        bench_adaptive(AdaptiveBenchConfig(settings=("fp32", "fixed q5")))
    with pytest.raises(ValueError, match="auto:err=1.5: err= takes a relative error"):
        bench_adaptive(AdaptiveBenchConfig(settings=("fp32", "auto:err=1.5")))


def test_auto_with_another_error_budget_is_a_setting_of_its_own():
    assert setting_specs("auto:err=0.15") == ("auto:err=0.15", "auto:err=0.15")
    assert setting_specs("fixed q4") == ("delta:q4", "direct:q6")
    c = train_config(AdaptiveBenchConfig(), "uneven", "auto:err=0.15", "/tmp/x")
    assert (c.compression.forward, c.compression.backward) == ("auto:err=0.15", "auto:err=0.15")
    assert c.run.run_name == "auto-err=0.15"
    # a fixed setting with a warm-up codec of its own
    assert setting_specs("fixed q4 warmup q8") == ("delta:q4", "direct:q6")
    c = train_config(AdaptiveBenchConfig(), "uneven", "fixed q4 warmup q8", "/tmp/x")
    assert c.compression.warmup_codec == "q8" and c.run.run_name == "fixed-q4-warmup-q8"
    plain = train_config(AdaptiveBenchConfig(), "uneven", "fixed q4", "/tmp/x")
    assert plain.compression.warmup_codec == "none"
    for bad, needle in (("auto warmup q8", "valid are fp32"),
                        ("fixed q4 warmup q9", "invalid codec spec 'q9'")):
        with pytest.raises(ValueError, match=f"setting '{bad}': {needle}"):
            setting_specs(bad)


def test_the_link_of_each_scenario_by_stages_and_steps():
    cfg = AdaptiveBenchConfig(stages=3, steps=20, latency_ms=5)
    assert cfg.link("uneven") == "1gbit,5ms/50mbit,5ms"
    assert cfg.link("drop") == "1gbit,5ms/200mbit,5ms~20mbit,5ms@11"
    assert AdaptiveBenchConfig(stages=2, steps=8).link("drop") == "200mbit~20mbit@5"


def test_repeats_are_combined_into_medians_with_never_as_the_longest():
    fp32 = _run("fp32", [4.0, 3.0, 2.0, 1.0], [2.0] * 4, 10.0)
    autos = [_run("auto", [4.0, 3.0, 2.0, 1.0], [t] * 4, p)
             for t, p in ((0.9, 10.1), (1.2, 10.2), (1.0, 10.0))]
    q8s = [_run("fixed q8", loss, [1.0] * 4, 10.0) for loss in ([4.0, 3.0, 2.0, 1.0], [4.0, 4.0, 4.0, 4.0],
                                                                  [4.0, 4.0, 4.0, 4.0])]
    summarize([fp32, *autos, *q8s])
    auto, q8 = combine(autos), combine(q8s)
    assert auto["time_to_target_s"] == pytest.approx(3.0)  # of 2.7, 3.6 and 3.0
    assert auto["median_step_s"] == 1.0 and auto["perplexity_vs_fp32"] == pytest.approx(0.01)
    assert [r["time_to_target_s"] for r in auto["repeats"]] == pytest.approx([2.7, 3.6, 3.0])
    assert auto["loss"] == autos[0]["loss"]  # the per-step figures are the first repeat's
    assert q8["time_to_target_s"] is None  # reached once in three: the median is never
    assert best_fixed([fp32, auto, q8]) is None
    assert combine([fp32]) == fp32 and "repeats" not in fp32
    text = format_scenario("uneven", {"link": "x", "target_loss": 3.0, "target_at_step": 3,
                                      "best_fixed": None, "runs": [fp32, auto, q8]})
    assert "repeats: 2.70 s, 3.60 s, 3.00 s" in text and "repeats: 3.00 s, never, never" in text
    with pytest.raises(ValueError, match="repeats: 0; at least 1"):
        bench_adaptive(AdaptiveBenchConfig(repeats=0))


@pytest.mark.slow
def test_the_command_end_to_end_on_a_tiny_pipeline(tmp_path):
    from aqsgd.cli import main

    out = tmp_path / "adaptive.json"
    assert main(["bench", "adaptive", "--stages", "2", "--scenarios", "drop", "--settings", "fp32", "auto",
                 "--steps", "6", "--train-samples", "32", "--hidden", "64", "--seq-len", "32",
                 "--repeats", "2", "--json", str(out), "--png", str(tmp_path / "adaptive.png")]) == 0
    result = json.loads(out.read_text())
    drop = result["scenarios"]["drop"]
    assert drop["link"] == "200mbit~20mbit@4"
    auto = next(r for r in drop["runs"] if r["setting"] == "auto")
    assert [e["b0.forward"] for e in auto["emulated"]] == ["200mbit,0ms"] * 3 + ["20mbit,0ms"] * 3
    assert all(c["b0.forward"].startswith("delta:") for c in auto["codecs"])
    # the probed errors of every rung, per step: more bits, less error (the warm-up probes the activation)
    errors = auto["link_errors"][0]["b0.forward"]
    assert list(errors) == ["fp16", "q8", "q6", "q4", "q3", "q2:l2"]
    assert errors["fp16"] < errors["q8"] < errors["q4"]
    assert next(r for r in drop["runs"] if r["setting"] == "fp32")["link_errors"] is None
    assert len(auto["loss"]) == 6 and auto["final_perplexity"] > 1
    assert len(auto["repeats"]) == 2 and "repeats" not in drop["runs"][0]  # fp32 runs once
    assert (tmp_path / "adaptive.png").stat().st_size > 10_000
