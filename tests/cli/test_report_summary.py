"""The end-of-run summary table of ``aqsgd train``: the uncompressed evaluation leads as the model's quality,
the compressed one is labelled for what it is (and left out where nothing was compressed), and the numbers
read right for one stage, slow runs and runs that saved nothing."""

from __future__ import annotations

from typing import Any

import pytest

from aqsgd.cli.train import print_summary


def summary(**over: Any) -> dict[str, Any]:
    """A summary as the trainer returns it: AQ-SGD over 2 local stages, an LM evaluated both ways."""
    s = {"task": "wiki", "setting": "delta:q2/direct:q4", "stages": 2, "data_parallel": 1,
         "grad_sync": "allreduce", "runtime": "local", "steps": 8, "final_train_loss": 4.4727,
         "eval": {"compressed": {"loss": 8.3, "perplexity": 4126.0},
                  "uncompressed": {"loss": 4.04, "perplexity": 57.2}},
         "bytes_sent": 219_136, "raw_bytes": 393_216, "compression_ratio": 393_216 / 219_136,
         "traffic_saved": 1 - 219_136 / 393_216, "grad_sync_bytes": 0, "samples_per_s": 3.6,
         "run_dir": "runs/r"}
    s.update(over)
    return s


def printed(capsys, monkeypatch, s: dict[str, Any]) -> list[str]:
    monkeypatch.setenv("COLUMNS", "200")  # one row a line
    print_summary(s)
    return capsys.readouterr().out.splitlines()


def row(lines: list[str], label: str) -> str:
    """The value of the row whose label is ``label`` exactly."""
    found = [cells for line in lines
             if len(cells := [c.strip() for c in line.strip("│┃ ").split("│")]) == 2 and cells[0] == label]
    assert len(found) == 1, (label, lines)
    return found[0][1]


def labels(lines: list[str]) -> list[str]:
    return [line.strip("│ ").split("│")[0].strip() for line in lines if line.startswith("│")]


def test_aqsgd_run_leads_with_the_uncompressed_evaluation_and_notes_the_missing_cache(capsys, monkeypatch):
    lines = printed(capsys, monkeypatch, summary())
    assert "wiki · delta:q2/direct:q4 · 2 stages (local)" in lines[0]
    names = labels(lines)
    assert names.index("eval perplexity") < names.index("eval perplexity, through compressed boundaries "
                                                        "(no cache)")
    assert row(lines, "eval perplexity") == "57.2000"
    assert row(lines, "eval perplexity, through compressed boundaries (no cache)") == "4126.0000"
    assert not any("compression on" in line or "compression off" in line for line in lines)
    note = [line for line in lines if "per-sample cache" in line]
    assert len(note) == 1 and "not the model's quality" in note[0]
    assert row(lines, "traffic saved vs fp32") == "44.3% (1.79x less)"


def test_direct_codecs_are_labelled_without_the_cache_note(capsys, monkeypatch):
    lines = printed(capsys, monkeypatch, summary(setting="direct:q8/direct:q8"))
    assert row(lines, "eval loss, through compressed boundaries") == "8.3000"
    assert not any("cache" in line for line in lines)


@pytest.mark.parametrize("setting", ["delta:q2/direct:q4", "none/none"])
def test_one_stage_shows_one_evaluation_and_no_codecs(capsys, monkeypatch, setting):
    same = {"loss": 4.6856, "perplexity": 108.3742}
    lines = printed(capsys, monkeypatch, summary(setting=setting, stages=1, eval={"compressed": same,
                                                                                  "uncompressed": same},
                                                 bytes_sent=0, raw_bytes=0, compression_ratio=None,
                                                 traffic_saved=None, samples_per_s=0.0123))
    assert lines[0].strip() == "wiki · 1 stage"  # not "delta:q2/direct:q4 · 1 stages (local)"
    assert [n for n in labels(lines) if n.startswith("eval")] == ["eval loss", "eval perplexity"]
    assert not any("compress" in line or "bytes" in line for line in lines)
    assert row(lines, "samples/s") == "0.0123"  # not 0.0


def test_uncompressed_run_saved_nothing(capsys, monkeypatch):
    same = {"loss": 4.6856}
    lines = printed(capsys, monkeypatch, summary(setting="none/none", eval={"compressed": same,
                                                                            "uncompressed": same},
                                                 bytes_sent=197_632, raw_bytes=196_608,
                                                 compression_ratio=196_608 / 197_632,
                                                 traffic_saved=1 - 197_632 / 196_608))
    assert "wiki · uncompressed · 2 stages (local)" in lines[0]
    assert [n for n in labels(lines) if n.startswith("eval")] == ["eval loss"]
    assert row(lines, "traffic saved vs fp32") == "none (0.5% more)"  # not "-0.5% (0.99x less)"
    lines = printed(capsys, monkeypatch, summary(bytes_sent=1000, raw_bytes=1000, compression_ratio=1.0,
                                                 traffic_saved=0.0))
    assert row(lines, "traffic saved vs fp32") == "none"  # not "0.0% (1.00x less)"


@pytest.mark.parametrize("rate,shown", [(0.0123, "0.0123"), (0.1, "0.100"), (6.55, "6.55"), (42.0, "42.0"),
                                        (1234.5, "1,234")])
def test_samples_per_second_keeps_significant_digits(capsys, monkeypatch, rate, shown):
    assert row(printed(capsys, monkeypatch, summary(samples_per_s=rate)), "samples/s") == shown


def test_replicas_of_one_stage_keep_the_runtime(capsys, monkeypatch):
    lines = printed(capsys, monkeypatch, summary(stages=1, data_parallel=2, runtime="distributed",
                                                 grad_sync="q8", grad_sync_bytes=4096))
    assert lines[0].strip() == "wiki · 1 stage x 2 replicas (distributed)"
    assert row(lines, "bytes sent between replicas (q8)") == "4,096"


def test_text_runs_show_real_tokens_and_the_pads_sent(capsys, monkeypatch):
    lines = printed(capsys, monkeypatch, summary(tokens_per_s=412.3, pad_tokens_sent=0, batching="bucket"))
    assert row(lines, "real tokens/s (bucket)") == "412"
    assert row(lines, "pad tokens sent between stages") == "0"
    assert not any("tokens" in line for line in printed(capsys, monkeypatch, summary()))
