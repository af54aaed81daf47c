"""The training config's checks: each section checks its own values, ``TrainConfig.validate`` runs them and
the checks that read two sections, and every bad value gives one line naming its option."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from aqsgd.errors import SpecError
from aqsgd.train.config import (
    DEFAULT_BACKWARD,
    DEFAULT_FORWARD,
    DEFAULT_WARMUP_CODEC,
    CompressionSection,
    ModelSection,
    OptimSection,
    PipelineSection,
    RunSection,
    TaskSection,
    TrainConfig,
    load_toml,
)

BAD = [
    ({'lr': float("nan")},
     "--lr: must be a finite number, got nan"),
    ({'timeout': float("inf")},
     "--timeout: must be a finite number, got inf"),
    ({'dropout': float("nan")},
     "--dropout: must be a finite number, got nan"),
    ({'eval_split': float("-inf")},
     "--eval-split: must be a finite number, got -inf"),
    ({'lora_alpha': float("nan"), 'lora': True},
     "--lora-alpha: must be a finite number, got nan"),
    ({'checkpoint_minutes': float("nan")},
     "--checkpoint-minutes: must be a finite number, got nan"),
    ({'stages': 0},
     "--stages: must be >= 1, got 0"),
    ({'micro_batches': 0},
     "--micro-batches: must be >= 1, got 0"),
    ({'micro_batch_size': 0},
     "--micro-batch-size: must be >= 1, got 0"),
    ({'epochs': 0},
     "--epochs: must be >= 1, got 0"),
    ({'grad_accum': 0},
     "--grad-accum: must be >= 1, got 0"),
    ({'max_length': 0},
     "--max-length: must be >= 1, got 0"),
    ({'keep_checkpoints': 0},
     "--keep-checkpoints: must be >= 1, got 0"),
    ({'data_parallel': 0},
     "--data-parallel: must be >= 1, got 0"),
    ({'hidden_size': 0},
     "--hidden-size: must be >= 1, got 0"),
    ({'vocab_size': 0},
     "--vocab-size: must be >= 1, got 0"),
    ({'balance_passes': 0},
     "--balance-passes: must be >= 1, got 0"),
    ({'seed': -1},
     "--seed: must be in 0..4294967295 (2**32 - 1), got -1"),
    ({'seed': 4294967296},
     "--seed: must be in 0..4294967295 (2**32 - 1), got 4294967296"),
    ({'skip_nonfinite': -1},
     "--skip-nonfinite: must be >= 0 (0: stop at the first non-finite step), got -1"),
    ({'max_steps': 0},
     "--max-steps: must be >= 1, got 0"),
    ({'model_layers': 0},
     "--model-layers: must be >= 1, got 0"),
    ({'threads': 0},
     "--threads: must be >= 1, got 0"),
    ({'eval_every': -1},
     "--eval-every: must be >= 0 (0: never), got -1"),
    ({'checkpoint_every': -1},
     "--checkpoint-every: must be >= 0 (0: never), got -1"),
    ({'max_train_samples': -1},
     "--max-train-samples: must be >= 0 (0: all), got -1"),
    ({'max_eval_samples': -1},
     "--max-eval-samples: must be >= 0 (0: all), got -1"),
    ({'checkpoint_minutes': -1.0},
     "--checkpoint-minutes: must be >= 0 (0: by steps or epochs only), got -1.0"),
    ({'lora_rank': 4},
     "--lora-rank: 4 sets the LoRA adapters, but this run has none: add --lora (or leave --lora-rank out)"),
    ({'lora_alpha': 8.0},
     "--lora-alpha: 8.0 sets the LoRA adapters, but this run has none: add --lora (or leave --lora-alpha "
     "out)"),
    ({'lora_dropout': 0.1},
     "--lora-dropout: 0.1 sets the LoRA adapters, but this run has none: add --lora (or leave "
     "--lora-dropout out)"),
    ({'lora_targets': 'q_proj'},
     "--lora-targets: q_proj sets the LoRA adapters, but this run has none: add --lora (or leave "
     "--lora-targets out)"),
    ({'lora_rank': 4, 'lora_alpha': 8.0},
     "--lora-rank: 4 sets the LoRA adapters, but this run has none: add --lora (or leave --lora-rank out)"),
    ({'lora': True, 'lora_rank': 0},
     "--lora-rank: must be >= 1, got 0"),
    ({'lora': True, 'lora_alpha': 0.0},
     "--lora-alpha: must be > 0, got 0.0"),
    ({'lora': True, 'lora_dropout': 1.0},
     "--lora-dropout: must be in [0, 1), got 1.0"),
    ({'lora': True, 'lora_dropout': -0.1},
     "--lora-dropout: must be in [0, 1), got -0.1"),
    ({'lora': True, 'lora_targets': ' , '},
     "--lora-targets: must name at least one module"),
    ({'lora': True, 'lora_targets': ''},
     "--lora-targets: must name at least one module"),
    ({'dropout': 1.0},
     "--dropout: must be in [0, 1), got 1.0"),
    ({'dropout': -0.5},
     "--dropout: must be in [0, 1), got -0.5"),
    ({'warmup_epochs': -1},
     "--warmup-epochs: must be in 0..epochs (2), got -1"),
    ({'warmup_epochs': 3},
     "--warmup-epochs: must be in 0..epochs (2), got 3"),
    ({'lr': 0.0},
     "--lr: must be > 0, got 0.0"),
    ({'lr': -0.001},
     "--lr: must be > 0, got -0.001"),
    ({'lr_warmup': 1.0},
     "--lr-warmup: must be in [0, 1), got 1.0"),
    ({'lr_warmup': -0.1},
     "--lr-warmup: must be in [0, 1), got -0.1"),
    ({'weight_decay': -1.0},
     "--weight-decay: must be >= 0, got -1.0"),
    ({'max_grad_norm': -1.0},
     "--max-grad-norm: must be >= 0, got -1.0"),
    ({'timeout': 0.0},
     "--timeout: must be > 0 seconds, got 0.0"),
    ({'runtime': 'remote'},
     "--runtime: 'remote' is not one of local, distributed"),
    ({'optimizer': 'adam'},
     "--optimizer: 'adam' is not one of adamw, sgd"),
    ({'device': 'tpu'},
     "--device: 'tpu' is not one of auto, cpu, cuda"),
    ({'p2p_backend': 'mpi'},
     "--p2p-backend: 'mpi' is not one of gloo, nccl"),
    ({'dp_backend': 'mpi'},
     "--dp-backend: 'mpi' is not one of auto, gloo, nccl"),
    ({'dtype': 'fp16'},
     "--dtype: 'fp16' is not one of auto, fp32, bf16"),
    ({'balance': 'random'},
     "--balance: 'random' is not one of layers, params, measured"),
    ({'ef_key': 'step'},
     "--ef-key: 'step' is not one of slot, sample"),
    ({'data_parallel': 2},
     "--data-parallel: 2 replicas need --runtime distributed (one process per stage and replica); the local "
     "runtime runs one pipeline"),
    ({'grad_sync': 'q99'},
     "--grad-sync: invalid grad sync spec 'q99': bits must be 1..8, got 99..."),
    ({'grad_sync': 'bogus'},
     "--grad-sync: invalid grad sync spec 'bogus': unknown method 'bogus'..."),
    ({'grad_sync': 'powersgd:rank0'},
     "--grad-sync: invalid grad sync spec 'powersgd:rank0': unknown option 'rank0' (powersgd takes rank<R>, "
     "R >= 1)..."),
    ({'grad_bucket_mb': 0.0},
     "--grad-bucket-mb: must be > 0, got 0.0"),
    ({'schedule': 'zigzag'},
     "--schedule: unknown schedule 'zigzag'..."),
    ({'forward': 'auto'},
     "--forward: auto chooses the bits of each link from its measured speed: it needs --runtime distributed "
     "(the local runtime has no links)"),
    ({'backward': 'auto'},
     "--backward: auto chooses the bits of each link from its measured speed: it needs --runtime "
     "distributed (the local runtime has no links)"),
    ({'forward': 'auto:bad', 'runtime': 'distributed'},
     "--forward: auto:bad: the floor must be one of the forward ladder fp16, q8, q6, q4, q3, q2:l2"),
    ({'forward': 'auto:q4:err=2', 'runtime': 'distributed'},
     "--forward: auto:q4:err=2: err= takes a relative error in (0, 1), such as 0.1, or none; got '2'"),
    ({'backward': 'auto:q2', 'runtime': 'distributed'},
     "--backward: auto:q2: the floor must be one of the backward ladder bf16, q8, q6, q4"),
    ({'forward': 'bogus:q2'},
     "--forward: invalid codec spec 'bogus:q2': unknown codec name..."),
    ({'forward': 'delta:q99'},
     "--forward: invalid codec spec 'q99': quantization bits must be an integer in 1..8, got 99..."),
    ({'backward': 'nonsense'},
     "--backward: invalid codec spec 'nonsense': unknown codec name..."),
    ({'forward': 'ef:topk:0.1'},
     "--forward: invalid codec spec 'topk:0.1': 'topk' is not topk<fraction>..."),
    ({'forward': 'auto:bad'},
     "--forward: auto:bad: the floor must be one of the forward ladder fp16, q8, q6, q4, q3, q2:l2"),
    ({'warmup_codec': 'zzz'},
     "--warmup-codec: invalid codec spec 'zzz': unknown codec name..."),
    ({'warmup_codec': 'q8', 'forward': 'ef21:q4'},
     "--warmup-codec: --forward ef21:q4: ef21 keeps the warm-up's exact values (its estimate); only direct, "
     "delta and ef directions take a warm-up codec"),
    ({'warmup_codec': 'q8', 'forward': 'none', 'backward': 'none'},
     "--warmup-codec: is for directions compressed with a fixed setting; --forward none and --backward none "
     "have none (auto links send their level in the warm-up)"),
    ({'warmup_codec': 'q8', 'forward': 'auto', 'backward': 'auto', 'runtime': 'distributed'},
     "--warmup-codec: is for directions compressed with a fixed setting; --forward auto and --backward auto "
     "have none (auto links send their level in the warm-up)"),
    ({'warmup_codec': 'q8', 'warmup_epochs': 0, 'forward': 'direct:q4'},
     "--warmup-codec: with --warmup-epochs 0 only AQ-SGD's first visits go in full, and no direction here "
     "is delta: nothing would be sent with it"),
    ({'warmup_codec': 'q8', 'backward': 'ef21:q4'},
     "--warmup-codec: --backward ef21:q4: ef21 keeps the warm-up's exact values (its estimate); only "
     "direct, delta and ef directions take a warm-up codec"),
    ({'cache': 'bogus'},
     "--cache: invalid cache spec 'bogus'..."),
    ({'cache': 'lowbit9'},
     "--cache: invalid cache spec 'lowbit9'..."),
    ({'cache': 'memory:fp64'},
     "--cache: invalid cache spec 'memory:fp64': storage dtype 'fp64'..."),
    ({'layers': [1, 1]},
     "--layers: 2 counts for 4 stages"),
    ({'layers': [1, 0, 1, 1]},
     "--layers: every stage needs at least one block, got 1,0,1,1"),
    ({'layers': [0, 1]},
     "--layers: 2 counts for 4 stages"),
    ({'emulate_slow_stage': '9:2'},
     "--emulate-slow-stage: stage 9 is not a stage of the 4-stage pipeline (0..3)"),
    ({'emulate_slow_stage': 'bad'},
     "--emulate-slow-stage: 'bad' is not STAGE:FACTOR (e.g. 1:2, stage 1 twice as slow)"),
    ({'link': '100mbit'},
     "--link: emulates the links between stage processes: it needs --runtime distributed (the local runtime "
     "passes tensors in memory)"),
    ({'link': 'bogus', 'runtime': 'distributed'},
     "--link: invalid bandwidth 'bogus'..."),
    ({'link': '1gbit/2gbit', 'runtime': 'distributed'},
     "--link: 2 link settings for 3 stage boundaries: give one for all, or one per boundary separated by /"),
    ({'link': '1gbit/2gbit/3gbit', 'runtime': 'distributed', 'data_parallel': 2},
     "--link: one setting per boundary is for a single pipeline; with --data-parallel the replicas' links "
     "are no boundary of it: give one setting"),
    ({'link': '200mbit~20mbit@5', 'runtime': 'distributed', 'data_parallel': 2},
     "--link: a setting that changes during the run (~SPEC@STEP) is for a single pipeline; with "
     "--data-parallel give one fixed setting"),
    ({'run_name': '../x'},
     "--run-name: '../x' must be a plain folder name (letters, digits and . _ + = -), not a path"),
    ({'run_name': '.'},
     "--run-name: '.' must be a plain folder name (letters, digits and . _ + = -), not a path"),
    ({'p2p_backend': 'nccl'},
     "--p2p-backend: carries packets between stage processes: it needs --runtime distributed (the local "
     "runtime passes tensors in memory)"),
    ({'p2p_backend': 'nccl', 'runtime': 'distributed', 'device': 'cpu'},
     "--p2p-backend: nccl runs on GPUs only; it needs --device cuda (or auto on a machine with one)"),
    ({'dp_backend': 'gloo'},
     "--dp-backend: is the backend of the data-parallel gradient sync: it needs --data-parallel 2 or more"),
    ({'dp_backend': 'nccl', 'data_parallel': 2, 'runtime': 'distributed', 'device': 'cpu'},
     "--dp-backend: nccl runs on GPUs only; it needs --device cuda (or auto on a machine with one)"),
    ({'train_file': 'a.csv', 'dataset': 'x'},
     "--dataset: give either --train-file or --dataset, not both"),
    ({'task': 'wiki', 'train_file': 'a.csv'},
     "--task: 'wiki' and --train-file both name the data; give one"),
    ({'task': 'wiki', 'dataset': 'x'},
     "--task: 'wiki' and --dataset both name the data; give one"),
    ({'eval_file': 'b.csv'},
     "--eval-file: needs --train-file (the training data in the same format)"),
    ({'eval_split': 0.0},
     "--eval-split: must be in (0, 1), got 0.0"),
    ({'eval_split': 1.0},
     "--eval-split: must be in (0, 1), got 1.0"),
    ({'text_column': ' '},
     "--text-column: must name a column, got an empty string"),
    ({'text_pair_column': ''},
     "--text-pair-column: must name a column, got an empty string"),
    ({'label_column': '  '},
     "--label-column: must name a column, got an empty string"),
    ({'txt_unit': 'word'},
     "--txt-unit: 'word' is not one of line, paragraph, file"),
    ({'txt_unit': 'paragraph'},
     "--txt-unit: paragraph cuts .txt files into documents, and neither --train-file nor --eval-file is one"),
]
"""One bad value each (the rest default) and the line it gives; a line ending in "..." is the start of a
longer one (a spec's grammar follows)."""

GOOD = [{}, {"seed": 2**32 - 1}, {"eval_every": 0}, {"lora": True, "lora_targets": "q_proj,v_proj"},
        {"dropout": 0.0}, {"warmup_epochs": 3, "epochs": 3}, {"data_parallel": 2, "runtime": "distributed"},
        {"forward": "auto", "runtime": "distributed"}, {"warmup_codec": "q8"},
        {"warmup_codec": "q8", "warmup_epochs": 0}, {"cache": "disk:int8"}, {"cache": "lowbit4"},
        {"layers": [1, 1, 1, 1]}, {"emulate_slow_stage": "1:2"},
        {"link": "1gbit/2gbit/3gbit", "runtime": "distributed"},
        {"run_name": "ok-name"}, {"dp_backend": "gloo", "data_parallel": 2, "runtime": "distributed"},
        {"eval_file": "b.csv", "train_file": "a.csv"}, {"txt_unit": "paragraph", "train_file": "a.txt"},
        {"txt_unit": "file", "train_file": "a.csv", "eval_file": "b.TXT"}]


def _error(flat: dict) -> str:
    with pytest.raises(SpecError) as e:
        TrainConfig.of(**flat).validate()
    return str(e.value)


@pytest.mark.parametrize("flat, line", BAD, ids=[repr(f) for f, _ in BAD])
def test_a_bad_value_is_one_line_naming_its_option(flat, line):
    message = _error(flat)
    assert "\n" not in message
    assert message.startswith(line[:-3]) if line.endswith("...") else message == line


@pytest.mark.parametrize("flat", GOOD, ids=[repr(f) for f in GOOD])
def test_good_values_pass(flat):
    config = TrainConfig.of(**flat)
    assert config.validate() is config


@pytest.mark.parametrize("section, fields, line", [
    (TaskSection, {"eval_split": 1.0}, "--eval-split: must be in (0, 1), got 1.0"),
    (TaskSection, {"eval_file": "b.csv"},
     "--eval-file: needs --train-file (the training data in the same format)"),
    (ModelSection, {"layers": 0}, "--model-layers: must be >= 1, got 0"),
    (ModelSection, {"lora_rank": 0}, "--lora-rank: 0 sets the LoRA adapters, but this run has none: add "
                                     "--lora (or leave --lora-rank out)"),
    (PipelineSection, {"runtime": "remote"}, "--runtime: 'remote' is not one of local, distributed"),
    (PipelineSection, {"link": "100mbit"},
     "--link: emulates the links between stage processes: it needs --runtime distributed (the local runtime "
     "passes tensors in memory)"),
    (CompressionSection, {"warmup_codec": "q8", "forward": "ef21:q4"},
     "--warmup-codec: --forward ef21:q4: ef21 keeps the warm-up's exact values (its estimate); only direct, "
     "delta and ef directions take a warm-up codec"),
    (OptimSection, {"lr": 0.0}, "--lr: must be > 0, got 0.0"),
    (OptimSection, {"seed": -1}, "--seed: must be in 0..4294967295 (2**32 - 1), got -1"),
    (RunSection, {"run_name": "../x"}, "--run-name: '../x' must be a plain folder name (letters, digits and "
                                       ". _ + = -), not a path"),
])
def test_each_section_checks_its_own_values(section, fields, line):
    with pytest.raises(SpecError, match="^" + re.escape(line) + "$"):
        section(**fields).validate()
    assert section().validate() == section()


@pytest.mark.parametrize("flat, line", [
    ({"warmup_epochs": 3}, "--warmup-epochs: must be in 0..epochs (2), got 3"),
    ({"forward": "auto"}, "--forward: auto chooses the bits of each link from its measured speed: it needs "
                          "--runtime distributed (the local runtime has no links)"),
])
def test_checks_across_sections_are_the_configs(flat, line):
    """Each section alone is fine; only the whole config sees the clash."""
    config = TrainConfig.of(**flat)
    for name in ("task", "model", "pipeline", "compression", "optim", "run"):
        getattr(config, name).validate()
    assert _error(flat) == line


@pytest.mark.parametrize("preset", sorted((Path(__file__).parents[2] / "configs").glob("*.toml")),
                         ids=lambda p: p.name)
def test_every_preset_in_configs_loads(preset):
    """The presets the docs point to are valid settings (every key known, every value in range)."""
    cfg = TrainConfig.of(**load_toml(preset)).validate()
    assert cfg.task.max_length >= 1


def test_the_default_preset_compresses_as_the_embedded_default():
    """``configs/minilm-bbc-aqsgd.toml`` names the default setting (warm-up codec resolved) and the defaults'
    other compression fields."""
    preset = TrainConfig.of(**load_toml(Path(__file__).parents[2] / "configs" / "minilm-bbc-aqsgd.toml"))
    default = TrainConfig().to_dict()["compression"]
    assert preset.to_dict()["compression"] == {**default, "warmup_codec": DEFAULT_WARMUP_CODEC}
    assert preset.compression.warmup == TrainConfig().compression.warmup == DEFAULT_WARMUP_CODEC


@pytest.mark.parametrize("flat, warmup", [
    ({}, DEFAULT_WARMUP_CODEC),  # the default setting, warm-up included
    ({"warmup_codec": "none"}, "none"),  # the paper's warm-up in full, asked for
    ({"warmup_codec": "q8"}, "q8"),
    # a setting of one's own keeps the paper's warm-up unless one is asked for: no direction then sends a
    # warm-up it was not measured with, and none that takes no warm-up codec (ef21, auto, none) is refused
    ({"forward": "delta:q2:l2"}, "none"),
    ({"backward": "ef21:q4"}, "none"),
    ({"forward": "none", "backward": "none"}, "none"),
    ({"forward": "auto", "backward": "auto", "runtime": "distributed"}, "none"),
    ({"forward": DEFAULT_FORWARD, "backward": DEFAULT_BACKWARD}, DEFAULT_WARMUP_CODEC),
])
def test_the_default_warmup_codec_goes_with_the_default_setting_only(flat, warmup):
    cfg = TrainConfig.from_flat(flat).validate()
    assert cfg.compression.warmup == warmup
