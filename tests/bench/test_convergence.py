"""The convergence study's machinery on the synthetic task: seeds, pairing with fp32, resuming, refusing a
study with other settings, the result files and the CLI."""

from __future__ import annotations

import json

import pytest

from aqsgd.bench.convergence import TASKS, run_study, study_table, write_results
from aqsgd.cli import main

SETTINGS = ["fp32", "aqsgd fw2/bw4"]


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    return runs, run_study("synthetic-lm", runs, settings=SETTINGS, seeds=[0, 1], overrides={"epochs": 2})


def test_every_setting_runs_once_per_seed(study):
    runs, results = study
    assert set(results["runs"]) == {"fp32", "aqsgd fw2/bw4", "fp32 @seed1", "aqsgd fw2/bw4 @seed1"}
    assert (results["runs"]["fp32 @seed1"]["seed"] == 1
            and (runs / "synthetic-lm" / "fp32-seed1" / "summary.json").exists())
    # a finished run keeps its metrics, not its checkpoints
    assert not (runs / "synthetic-lm" / "fp32-seed1" / "checkpoints").exists()
    # another seed is another data order: other losses
    assert results["runs"]["fp32"]["train_loss"] != results["runs"]["fp32 @seed1"]["train_loss"]


def test_table_pairs_each_seed_with_fp32_of_that_seed(study):
    _, results = study
    rows = {r["setting"]: r for r in study_table(results)}
    fp32, aq = rows["fp32"], rows["aqsgd fw2/bw4"]
    assert fp32["seeds"] == aq["seeds"] == [0, 1] and fp32["metric"] == "perplexity"
    assert fp32["rel_off_vs_fp32"] == 0 and fp32["rel_off_vs_fp32_std"] == 0
    ref = fp32["eval_off_runs"]
    paired = [(v - r) / r for v, r in zip(aq["eval_on_runs"], ref)]
    assert aq["rel_vs_fp32"] == pytest.approx(sum(paired) / 2)
    assert aq["rel_vs_fp32_std"] == pytest.approx(abs(paired[0] - paired[1]) / 2 ** 0.5)
    assert aq["eval_on"] == pytest.approx(sum(aq["eval_on_runs"]) / 2)


def test_best_evaluation_is_the_lowest_perplexity_of_each_run(study):
    _, results = study
    rows = {r["setting"]: r for r in study_table(results)}
    for seed, key in enumerate(["fp32", "fp32 @seed1"]):
        curve = [e["uncompressed"]["perplexity"] for e in results["runs"][key]["eval"]]
        assert len(curve) == 2 and rows["fp32"]["best_off_runs"][seed] == min(curve)
    assert rows["fp32"]["rel_best_off_vs_fp32"] == 0
    aq = rows["aqsgd fw2/bw4"]
    paired = [(v - r) / r for v, r in zip(aq["best_off_runs"], rows["fp32"]["best_off_runs"])]
    assert aq["rel_best_off_vs_fp32"] == pytest.approx(sum(paired) / 2)


def test_study_continues_and_refuses_other_settings(study):
    runs, results = study
    again = run_study("synthetic-lm", runs, settings=SETTINGS, seeds=[0, 1], overrides={"epochs": 2})
    assert again["runs"] == json.loads(json.dumps(results["runs"]))  # nothing re-run
    with pytest.raises(ValueError, match="other settings"):
        run_study("synthetic-lm", runs, settings=SETTINGS, overrides={"epochs": 3})


def test_result_files(study, tmp_path):
    runs, results = study
    path, png = write_results("synthetic-lm", results, runs, tmp_path, command="test", machine="here",
                              tag="seeds")
    assert path.name == "convergence-synthetic-lm-seeds.json" and png.read_bytes()[:4] == b"\x89PNG"
    saved = json.loads(path.read_text())
    assert saved["complete"] is False  # direct fw2/bw4 of the default settings did not run
    assert len(saved["table"]) == 2


def test_a_study_continued_from_its_json_writes_the_table_without_the_plot(study, tmp_path, caplog):
    # the run directories stayed on another machine: the JSON (table, curves) is written, the plot is not
    runs, results = study
    caplog.set_level("WARNING", logger="aqsgd.bench.convergence")
    path, png = write_results("synthetic-lm", results, tmp_path / "elsewhere", tmp_path, command="test",
                              machine="here")
    assert png is None and len(json.loads(path.read_text())["table"]) == 2
    assert any("not redrawn: run directories not found" in r.getMessage() for r in caplog.records)


def test_cli(tmp_path, capsys):
    code = main(["bench", "convergence", "synthetic-lm", "--settings", "fp32", "--epochs", "2", "--seeds",
                 "0,1", "--runs-dir", str(tmp_path / "runs"), "--results-dir", str(tmp_path / "out"),
                 "--tag", "t"])
    assert code == 0
    out = capsys.readouterr().out
    assert ("means over seeds 0, 1" in out
            and (tmp_path / "out" / "convergence-synthetic-lm-t.json").exists())
    # a second command grows the study: the result file names both commands, each run the one that made it
    assert main(["bench", "convergence", "synthetic-lm", "--settings", "fp32", "aqsgd fw2/bw4", "--epochs",
                 "2", "--runs-dir", str(tmp_path / "runs"), "--results-dir", str(tmp_path / "out"),
                 "--tag", "t"]) == 0
    saved = json.loads((tmp_path / "out" / "convergence-synthetic-lm-t.json").read_text())
    assert len(saved["commands"]) == 2 and "--seeds 0,1" in saved["commands"][0]
    assert "--seeds" not in saved["runs"]["aqsgd fw2/bw4"]["command"]
    assert saved["runs"]["fp32 @seed1"]["command"] == saved["commands"][0]
    # every run names the machine it ran on, and the file all of them
    assert all(r["machine"] == saved["machine"] for r in saved["runs"].values()) and saved["machine"]
    # the table of the grown study: fp32's means are over both seeds, the added setting ran seed 0 only
    assert "means over seeds 0, 1" in capsys.readouterr().out


def test_the_seeds_in_the_title_are_the_rows_own():
    from aqsgd.cli.bench.convergence import _seeds_note

    rows = [{"setting": "fp32", "seeds": [0, 1, 2]}, {"setting": "q8", "seeds": [0]},
            {"setting": "q4", "seeds": [1, 2]}]
    assert _seeds_note(rows) == " (means over seeds 0, 1, 2)"
    assert [r["setting"] for r in rows] == ["fp32", "q8 (seed 0)", "q4 (seeds 1, 2)"]
    assert _seeds_note([{"setting": "fp32", "seeds": [0]}]) == ""


def test_fewer_bits_study_reports_loss_gap_wire_bits_and_step_time(tmp_path):
    """The `fewer-bits` study: its own result file with its settings only, and per row the training-loss gap
    to fp32, the bits per value that crossed the wire and the step time; zstd trains bit for bit as
    without."""
    runs = tmp_path / "runs"
    names = ["fp32", "aqsgd fw2/bw4 rot", "aqsgd fw2/bw4 rot zstd"]
    results = run_study("synthetic-lm", runs, settings=names, overrides={"epochs": 2}, study="fewer-bits")
    rot, rotz = results["runs"]["aqsgd fw2/bw4 rot"], results["runs"]["aqsgd fw2/bw4 rot zstd"]
    assert rot["train_loss"] == rotz["train_loss"]
    path, _ = write_results("synthetic-lm", results, runs, tmp_path / "out", command="test", machine="here",
                            study="fewer-bits")
    assert path.name == "fewer-bits-synthetic-lm.json"
    saved = json.loads(path.read_text())
    assert saved["study"] == "fewer-bits" and set(saved["runs"]) == {"fp32", "aqsgd fw2/bw4 rot zstd"}
    rows = {r["setting"]: r for r in saved["table"]}
    assert rows["fp32"]["train_loss_gap"] == 0.0
    assert 31.9 < rows["fp32"]["wire_bits_per_value"] < 32.5  # fp32 plus the headers
    z = rows["aqsgd fw2/bw4 rot zstd"]
    assert z["train_loss_gap"] is not None and z["step_s"] > 0
    # 2-bit codes and a scale per 64 values (2.25 bits) or fewer after zstd; more than nothing
    assert 0.5 < z["wire_bits_per_value"] < 2.6 and 2 < z["wire_bits_per_value_backward"] < 4.6
    assert rot["traffic"]["forward_bits_per_value"] > rotz["traffic"]["forward_bits_per_value"] * 0.99
    # a setting outside the study's own, asked for by name, stays in its file when a later command writes it
    # asking for others (or for none)
    path, _ = write_results("synthetic-lm", results, runs, tmp_path / "out", command="test", machine="here",
                            study="fewer-bits", settings=["aqsgd fw2/bw4 rot"])
    assert "aqsgd fw2/bw4 rot" in json.loads(path.read_text())["runs"]
    path, _ = write_results("synthetic-lm", results, runs, tmp_path / "out", command="test", machine="here",
                            study="fewer-bits")
    assert set(json.loads(path.read_text())["runs"]) == {"fp32", *names[1:]}


@pytest.mark.slow
def test_the_subspace_study_records_and_draws_what_each_basis_held(tmp_path):
    """A run with a subspace stage records, from its last checkpoint (read before it is deleted), each
    boundary direction's rank, the warm-up's energy by rank and what each basis held; the study draws it."""
    runs = tmp_path / "runs"
    results = run_study("synthetic-lm", runs, settings=["aqsgd pca/4 ec/ef pca/4 ec"],
                        overrides={"epochs": 2}, study="subspace")
    energy = results["runs"]["aqsgd pca/4 ec/ef pca/4 ec"]["subspace"]
    assert set(energy) == {"b0-forward", "b0-backward", "b1-forward", "b1-backward"}  # 3 stages
    for e in energy.values():
        assert e["rank"] == -(-e["width"] // 4) and e["bases"] >= 1
        cum = e["warmup_energy_by_rank"]
        assert len(cum) == e["width"] and abs(cum[-1] - 1) < 1e-9 and cum == sorted(cum)
        assert all(0 <= h <= 1 + 1e-9 for h in e.get("held", []))
    _, png = write_results("synthetic-lm", results, runs, tmp_path / "out", command="test", machine="cpu",
                           study="subspace")
    assert (tmp_path / "out" / "subspace-synthetic-lm-energy.png").stat().st_size > 1000


def test_a_continued_study_keeps_the_machine_its_runs_ran_on(tmp_path):
    # a study file written elsewhere (its runs name no machine; the file does): continued here, its runs
    # keep that machine, and a setting it already holds is not run again
    study_dir = tmp_path / "synthetic-lm"
    study_dir.mkdir()
    (study_dir / "study.json").write_text(json.dumps({
        "task": "synthetic-lm", "base_config": TASKS["synthetic-lm"], "machine": "there",
        "runs": {"fp32": {"setting": "fp32", "seed": 0}}}))
    results = run_study("synthetic-lm", tmp_path, settings=["fp32"], machine="here")
    assert results["runs"]["fp32"]["machine"] == "there"
