"""Bad input and reused run directories: every probe of the "trust" review ends in one line naming the input,
and an existing run is never appended to or overwritten without being asked."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from aqsgd.errors import ConfigMismatchError, SpecError
from aqsgd.train.checkpoint import CheckpointError
from aqsgd.train.config import TrainConfig, load_toml
from aqsgd.train.rundir import RunDirError, RunDirLock, truncate_metrics
from aqsgd.train.trainer import Trainer


def _cfg(tmp_path, **kw):
    base = dict(task="synthetic-lm", max_train_samples=32, max_eval_samples=8, max_length=12, stages=2,
                micro_batches=2, micro_batch_size=4, epochs=2, warmup_epochs=1, lr=3e-3,
                output_dir=str(tmp_path), progress=False, tensorboard=False, forward="delta:q2",
                backward="direct:q4",
                cache_dir=str(tmp_path / "cache"))
    base.update(kw)
    return TrainConfig.of(**base)


def _rows(run_dir, kind=None):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if kind is None or r["kind"] == kind]


# -- validation: each value is refused with one line naming the option ---------------------------------------
@pytest.mark.parametrize("field,value,needle", [
    ("lr", float("inf"), "--lr: must be a finite number"),
    ("weight_decay", float("nan"), "--weight-decay: must be a finite number"),
    ("max_grad_norm", float("nan"), "--max-grad-norm: must be a finite number"),
    ("max_grad_norm", -1.0, "--max-grad-norm: must be >= 0"),
    ("timeout", float("nan"), "--timeout: must be a finite number"),
    ("timeout", float("inf"), "--timeout: must be a finite number"),
    ("timeout", 0.0, "--timeout: must be > 0"),
    ("timeout", -5.0, "--timeout: must be > 0"),
    ("link", "100mbit", "--link: .*needs --runtime distributed"),
    ("layers", [0, 2], "--layers: every stage needs at least one block"),
    ("max_train_samples", -5, "--max-train-samples: must be >= 0"),
    ("max_eval_samples", -1, "--max-eval-samples: must be >= 0"),
    ("run_name", "../../escape", "--run-name: '../../escape' must be a plain folder name"),
    ("run_name", "..", "--run-name"),
    ("run_name", "a/b", "--run-name"),
    ("seed", -1, "--seed: must be in 0..4294967295 \\(2\\*\\*32 - 1\\), got -1"),
    ("seed", 2**63, "--seed: must be in 0..4294967295 \\(2\\*\\*32 - 1\\), got 9223372036854775808"),
    ("skip_nonfinite", -1, "--skip-nonfinite: must be >= 0"),
])
def test_bad_values_are_one_line_errors(tmp_path, field, value, needle):
    with pytest.raises(SpecError, match=needle) as e:
        _cfg(tmp_path, **{field: value}).validate()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kw,needle", [
    (dict(stages=99), "--stages 99: cannot split a model with 4 layers into 99 stages"),
    (dict(layers=[5, 5]), "--layers 5,5: .*adds up to 10 but the model has 4"),
    (dict(model_layers=99), "--model-layers: the model has only 4 blocks, asked for 99"),
])
def test_model_shape_errors_name_the_option(tmp_path, kw, needle):
    with pytest.raises(SpecError, match=needle):
        Trainer(_cfg(tmp_path, **kw))
    assert not (tmp_path / "synthetic-lm-delta-q2-direct-q4").exists()  # refused before writing anything


def test_model_layers_on_a_resnet_is_refused(tmp_path):
    with pytest.raises(SpecError, match="--model-layers"):
        from aqsgd.train.tasks import _model_recipe

        _model_recipe(_cfg(tmp_path, model="resnet", model_layers=2), "image-classification", object(), None)


@pytest.mark.parametrize("toml,needle", [
    ('[pipeline]\nstages = "two"\n', "stages must be an integer, got 'two'"),
    ("[pipeline]\nstages = 2.5\n", "stages must be an integer, got 2.5"),
    ("[optim]\nlr = \"fast\"\n", "lr must be a number"),
    ("[pipeline]\nlayers = [1, \"x\"]\n", "layers must be a list of integers"),
    ("[compression]\nstages = 2\n", "unknown key 'stages' in \\[compression\\]; 'stages' belongs in "
                                    "\\[pipeline\\]"),
    ("[model]\nmodel_layers = 2\n", "'model_layers' belongs in \\[model\\] \\(as layers\\)"),
    ("[task]\ntask = 'bbc'\n", "'task' belongs in \\[task\\] \\(as name\\)"),
    ("[pipelines]\nstages = 2\n", "unknown table \\[pipelines\\]"),
    ("stages = 2\n", "'stages' belongs in table \\[pipeline\\]"),
    ("[pipeline]\nstages = 3\nstages = 3\n", "Cannot overwrite a value"),
    ("[optim]\nlearning_rate = 1\n", "unknown key 'learning_rate' in \\[optim\\]"),
    ("[run]\nprogress = 1\n", "progress must be true or false"),
])
def test_toml_presets_are_checked_key_by_key(tmp_path, toml, needle):
    path = tmp_path / "preset.toml"
    path.write_text(toml)
    with pytest.raises(SpecError, match=needle) as e:
        load_toml(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_toml_preset_values_of_the_right_type_load(tmp_path):
    path = tmp_path / "preset.toml"
    path.write_text('[task]\nname = "synthetic-lm"\n[optim]\nlr = 1\n[pipeline]\nlayers = [1, 3]\n'
                    'stages = 2\n')
    cfg = TrainConfig.from_flat(load_toml(path)).validate()
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float) and cfg.pipeline.layers == [1, 3]
    assert cfg.task.name == "synthetic-lm"


def test_non_utf8_preset_is_one_line(tmp_path):
    path = tmp_path / "preset.toml"
    path.write_bytes(b"task = \"\xff\xfe\"\n")
    with pytest.raises(SpecError, match="--config"):
        load_toml(path)


def test_distributed_runtime_needs_a_process_group(tmp_path):
    with pytest.raises(ConfigMismatchError, match="needs torch.distributed initialized"):
        Trainer(_cfg(tmp_path, runtime="distributed"))


def test_max_steps_inside_an_epoch_still_evaluates_and_checkpoints(tmp_path):
    summary = Trainer(_cfg(tmp_path, run_name="m", max_steps=3)).run()  # 4 steps per epoch
    assert summary["steps"] == 3 and summary["eval"] is not None
    assert [r["step"] for r in _rows(tmp_path / "m", "eval")] == [3]
    assert (tmp_path / "m" / "checkpoints" / "step-00000003" / "COMPLETE").exists()


# -- run directories -----------------------------------------------------------------------------------------
def test_an_existing_run_is_never_reused_silently(tmp_path):
    Trainer(_cfg(tmp_path, run_name="r", epochs=1, warmup_epochs=0)).run()
    before = (tmp_path / "r" / "metrics.jsonl").read_text()
    with pytest.raises(RunDirError, match="already exists: continue it with --resume .* --overwrite"):
        Trainer(_cfg(tmp_path, run_name="r", epochs=1, warmup_epochs=0))
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == before
    # the default name too
    Trainer(_cfg(tmp_path, epochs=1, warmup_epochs=0)).run()
    with pytest.raises(RunDirError, match="already exists"):
        Trainer(_cfg(tmp_path, epochs=1, warmup_epochs=0))
    # --overwrite starts afresh: one run's rows only
    Trainer(_cfg(tmp_path, run_name="r", epochs=1, warmup_epochs=0, overwrite=True)).run()
    assert [r["step"] for r in _rows(tmp_path / "r", "train")] == [1, 2, 3, 4]


def test_overwrite_refuses_a_folder_that_is_not_a_run(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "thesis.tex").write_text("precious")
    with pytest.raises(RunDirError, match="does not look like a run directory"):
        Trainer(_cfg(tmp_path, run_name="notes", overwrite=True))
    assert (tmp_path / "notes" / "thesis.tex").read_text() == "precious"


def test_overwrite_and_resume_of_the_same_run_conflict(tmp_path):
    Trainer(_cfg(tmp_path, run_name="r", epochs=1, warmup_epochs=0)).run()
    with pytest.raises(RunDirError, match="--overwrite would delete"):
        Trainer(_cfg(tmp_path, run_name="r", resume=str(tmp_path / "r"), overwrite=True))


def test_a_run_directory_in_use_is_locked(tmp_path):
    (tmp_path / "busy").mkdir()
    lock = RunDirLock(tmp_path / "busy")
    with pytest.raises(RunDirError, match=r"in use by another run \(pid \d+"):
        Trainer(_cfg(tmp_path, run_name="busy"))
    lock.release()
    Trainer(_cfg(tmp_path, run_name="busy", epochs=1, warmup_epochs=0)).run()


def test_a_second_process_cannot_take_the_lock(tmp_path):
    (tmp_path / "r").mkdir()
    code = ("import sys, time; from aqsgd.train.rundir import RunDirLock; l = "
            "RunDirLock(__import__('pathlib').Path(sys.argv[1])); print('locked', flush=True); "
            "time.sleep(30)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "r")], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirError, match=f"pid {holder.pid}"):
            RunDirLock(tmp_path / "r")
    finally:
        holder.kill()
        holder.wait()
    RunDirLock(tmp_path / "r").release()  # released when its holder died


def test_resume_continues_in_its_own_directory_and_cuts_metrics(tmp_path):
    cfg = _cfg(tmp_path, run_name="p", checkpoint_every=3)
    Trainer(cfg).run(stop_at=5)
    Trainer(_cfg(tmp_path, checkpoint_every=3, resume=str(tmp_path / "p"))).run()  # no --run-name: into p
    assert [r["step"] for r in _rows(tmp_path / "p", "train")] == list(range(1, 9))
    assert not (tmp_path / "synthetic-lm-delta-q2-direct-q4").exists()


def test_truncate_metrics_drops_later_steps_and_torn_lines(tmp_path):
    rows = [{"kind": "train", "step": s} for s in range(1, 6)] + [{"kind": "eval", "step": 4}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"kind": "tra')
    assert truncate_metrics(tmp_path, 4) == 2
    assert [json.loads(x)["step"]
            for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 4]


# -- resume settings -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("finished")
    Trainer(_cfg(tmp, run_name="r")).run()
    return tmp


@pytest.mark.parametrize("kw,needle", [
    (dict(layers=[1, 3]), "layers=None \\(this run: \\[1, 3\\]\\)"),
    (dict(model_layers=2), "model_layers=None"),
    (dict(max_length=16), "max_length=12"),
    (dict(optimizer="sgd"), "optimizer='adamw'"),
    (dict(forward="direct:q8"), "forward='delta:q2'"),
    (dict(micro_batch_size=2, micro_batches=4), "micro_batches=2 .* micro_batch_size=4"),
])
def test_resume_with_settings_that_change_the_state_is_refused(finished_run, kw, needle):
    cfg = _cfg(finished_run, run_name="other", epochs=3, resume=str(finished_run / "r"), **kw)
    with pytest.raises(CheckpointError, match=needle) as e:
        Trainer(cfg).run()
    assert "must match" in str(e.value) and "\n" not in str(e.value)


def test_resume_warns_about_changed_settings_and_continues(finished_run, caplog):
    cfg = _cfg(finished_run, run_name="longer", epochs=3, lr=1e-3, resume=str(finished_run / "r"))
    with caplog.at_level("WARNING"):
        summary = Trainer(cfg).run()
    assert summary["steps"] == 12
    warning = next(r.getMessage() for r in caplog.records if "changed settings" in r.getMessage())
    assert "epochs 2 -> 3" in warning and "lr 0.003 -> 0.001" in warning


def test_resume_with_nothing_left_to_train_is_an_error(finished_run):
    cfg = _cfg(finished_run, run_name="again", resume=str(finished_run / "r"))
    with pytest.raises(CheckpointError, match="nothing left to train; raise --epochs or --max-steps"):
        Trainer(cfg).run()


def test_saved_configs_flatten_whether_nested_or_written_before_the_nesting():
    from aqsgd.train.config import flatten_config

    cfg = TrainConfig.of(task="wiki", model="smollm2", model_layers=3, stages=2, forward="delta:q4")
    assert flatten_config(cfg.to_dict()) == cfg.flat()
    old = {"task": "wiki", "model": "smollm2", "model_layers": 3, "stages": 2, "forward": "delta:q4"}
    assert flatten_config(old) == old  # a checkpoint's flat config from before the nesting
    assert TrainConfig.from_flat(old) == cfg
    assert TrainConfig.from_dict(json.loads(cfg.to_json())) == cfg


@pytest.mark.parametrize("data,needle", [
    ({"pipeline": {"stages": "2"}}, "stages must be an integer"),
    ({"pipelines": {}}, "unknown table \\[pipelines\\]"),
    ({"stages": 2}, "'stages' belongs in table \\[pipeline\\]"),
    ({"optim": {"stages": 2}}, "'stages' belongs in \\[pipeline\\]"),
])
def test_nested_configs_name_the_bad_key(data, needle):
    with pytest.raises(SpecError, match=needle):
        TrainConfig.from_dict(data, source="config.json")


def test_unknown_option_names_are_errors():
    with pytest.raises(SpecError, match="unknown options \\['stage'\\]"):
        TrainConfig.of(stage=2)


# -- the probes of the "no silent wrong results" review ------------------------------------------------------
@pytest.mark.parametrize("seed", ["-1", str(2**63)])
def test_a_bad_seed_writes_nothing_before_it_is_refused(tmp_path, capsys, seed):
    from aqsgd.cli import main

    argv = ["train", "--task", "synthetic-lm", "--seed", seed, "--cache-dir", str(tmp_path / "cache"),
            "--output-dir", str(tmp_path / "runs"), "--no-progress"]
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith("aqsgd: error: --seed: must be in 0..4294967295")
    assert not (tmp_path / "cache").exists() and not (tmp_path / "runs").exists()


def test_a_missing_model_folder_with_a_builtin_task_is_one_line(tmp_path):
    with pytest.raises(SpecError, match=f"^--model {tmp_path / 'nope'}: no such folder$"):
        Trainer(_cfg(tmp_path, model=str(tmp_path / "nope")))


def test_a_partly_deleted_last_checkpoint_points_to_the_previous_one(tmp_path):
    Trainer(_cfg(tmp_path, run_name="p", checkpoint_every=2, keep_checkpoints=3)).run(stop_at=6)
    checkpoints = tmp_path / "p" / "checkpoints"
    (checkpoints / "step-00000006" / "stage1" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError) as e:
        Trainer(_cfg(tmp_path, checkpoint_every=2, resume=str(tmp_path / "p"))).run()
    assert str(e.value) == (f"{checkpoints / 'step-00000006' / 'stage1' / 'model.safetensors'}: missing "
                            f"(listed in rank0.manifest.json); the previous complete checkpoint is "
                            f"{checkpoints / 'step-00000004'}: continue from it with --resume "
                            f"{checkpoints / 'step-00000004'}")
    (checkpoints / "step-00000006" / "MANIFEST.json").unlink()
    with pytest.raises(CheckpointError,
                       match="the previous complete checkpoint is .*step-00000004: continue from it"):
        Trainer(_cfg(tmp_path, checkpoint_every=2, resume=str(tmp_path / "p"))).run()
    summary = Trainer(_cfg(tmp_path, checkpoint_every=2, resume=str(checkpoints / "step-00000004"))).run()
    assert summary["steps"] == 8
