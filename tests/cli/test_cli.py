import json
import subprocess
import sys

import pytest
import torch

from aqsgd.cli import main


def test_codecs_lists_grammar_and_describes(capsys):
    assert main(["codecs"]) == 0
    assert "q<bits" in capsys.readouterr().out
    assert main(["codecs", "q2", "topk0.1+q8", "--shape", "4,8"]) == 0
    out = capsys.readouterr().out
    assert "q2" in out and "topk0.1+q8:token" in out


def test_bad_codec_is_one_clear_line(capsys):
    assert main(["codecs", "q9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("aqsgd: error: invalid codec spec 'q9'") and "Valid:" in err


def test_bench_codecs_json(tmp_path):
    path = tmp_path / "codecs.json"
    rc = main(["bench", "codecs", "--codecs", "q2", "fp16", "topk0.1", "--shape", "4,16,32", "--repeats", "2",
               "--warmup", "1", "--json", str(path)])
    assert rc == 0
    data = json.loads(path.read_text())
    assert data["benchmark"] == "codecs" and data["machine"]
    rows = data["rows"]
    assert [r["codec"] for r in rows] == ["q2", "fp16", "topk0.1"]
    for r in rows:
        for key in ("codec", "device", "shape", "encode_gbps", "decode_gbps", "clone_gbps", "wire_bytes",
                    "ratio"):
            assert key in r
        assert r["encode_gbps"] > 0 and r["decode_gbps"] > 0 and r["clone_gbps"] > 0
    assert rows[0]["wire_bytes"] == 64 + 32 * 2 + 4 * 16 * 32 // 4
    # the fused kernels (numba, a base dependency) are on: every codec is timed with them off too
    for r in rows:
        assert r["eager_encode_gbps"] > 0 and r["eager_decode_gbps"] > 0


def test_bench_codecs_without_fused_kernels_has_no_eager_columns(tmp_path):
    from aqsgd.compress import kernels

    path = tmp_path / "codecs.json"
    with kernels.defaulting_to("eager"):
        assert main(["bench", "codecs", "--codecs", "q4", "--shape", "2,8,16", "--repeats", "1", "--warmup",
                     "1", "--device", "cpu", "--json", str(path)]) == 0
    (row,) = json.loads(path.read_text())["rows"]
    assert row["eager_encode_gbps"] is None and row["eager_decode_gbps"] is None


def test_console_script_entry_point():
    out = subprocess.run([sys.executable, "-m", "aqsgd.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("aqsgd ")


def test_hub_warnings_print_once():
    # huggingface_hub's logger has a stderr handler of its own; propagating to the root handler the CLI
    # configures would print each of its warnings twice
    probe = ("from aqsgd.cli import main\nmain(['models'])\n"
             "from huggingface_hub.utils import logging as hub_logging\n"
             "hub_logging.get_logger('huggingface_hub.probe').warning('hub-probe')\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("hub-probe") == 1, out.stderr


def test_bench_codecs_records_versions_and_profiles_only_on_cuda(tmp_path):
    path = tmp_path / "codecs.json"
    assert main(["bench", "codecs", "--codecs", "q4", "--shape", "2,8,16", "--repeats", "1", "--warmup", "1",
                 "--device", "cpu", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["versions"]["torch"] == torch.__version__
    (row,) = data["rows"]
    assert row["encode_kernels"] is None and row["decode_kernel_us"] is None  # the profile is CUDA's


# ---------------------------------------------------------------------------- --help is plain text
def _commands(parser, path=()):
    """The argv prefix of every command and subcommand (``()``: ``aqsgd`` itself)."""
    import argparse

    yield path
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


_REST_MARKUP = (":class:", ":func:", ":mod:", ":meth:", ":attr:", "``")


def test_no_help_shows_rest_markup(capsys):
    from aqsgd.cli import build_parser

    commands = list(_commands(build_parser()))
    assert ("train",) in commands and ("bench", "codecs") in commands and ("eval",) in commands
    for command in commands:
        with pytest.raises(SystemExit) as exit_:
            main([*command, "--help"])
        assert exit_.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith("usage: aqsgd")
        shown = [m for m in _REST_MARKUP if m in out]
        assert not shown, f"aqsgd {' '.join(command)} --help shows {shown}"


def test_train_help_names_the_config_class_and_keeps_the_example_block(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "Every field of the nested TrainConfig is an option" in out
    # the literal block keeps its lines (and its indent) under a line that ends in one colon
    assert "stage), e.g.:\n\n    AQSGD_NODE_RANK=$NODE torchrun " in out


def test_option_help_from_a_docstring_is_plain_text(capsys, monkeypatch):
    import dataclasses

    from aqsgd.cli import train
    from aqsgd.train.config import options

    first, *rest = options()
    marked = dataclasses.replace(first, help="as :class:`~aqsgd.train.config.TrainConfig` says; ``none``: "
                                             "unset (see :func:`aqsgd.train.config.options`)")
    monkeypatch.setattr(train, "options", lambda: (marked, *rest))
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "as TrainConfig says; none: unset (see aqsgd.train.config.options)" in out


@pytest.mark.parametrize(("text", "plain"), [
    (":class:`~a.b.C` and :func:`x.y`", "C and x.y"),
    (":py:meth:`a.B.c` or :ref:`the guide <guide>`", "a.B.c or the guide"),
    ("``--lr`` and ``a\nb``", "--lr and a\nb"),
    ("For example::\n\n    ``kept`` :class:`kept`\n\nthen ``x``",
     "For example:\n\n    ``kept`` :class:`kept`\n\nthen x"),
    ("As shown ::\n\n  run it\n", "As shown\n\n  run it\n"),
    ("::\n\n  code\n", "\n\n  code\n"),
])
def test_plain_text(text, plain):
    from aqsgd.cli.options import plain_text

    assert plain_text(text) == plain


# ---------------------------------------------------------------------------- values that start with "-"
def test_a_negative_value_reaches_the_options_own_check(capsys):
    # argparse alone takes "-5mbit" (and "-1e-3", which is no plain negative number) for an unknown option
    assert main(["train", "--runtime", "distributed", "--link", "-5mbit"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("aqsgd: error: --link: invalid bandwidth '-5mbit'"), err
    assert "expected one argument" not in err
    assert main(["train", "--lr", "-1e-3"]) == 2
    assert capsys.readouterr().err.strip() == "aqsgd: error: --lr: must be > 0, got -0.001"
    assert main(["train", "--lr", "-1"]) == 2
    assert capsys.readouterr().err.strip() == "aqsgd: error: --lr: must be > 0, got -1.0"


def test_a_dash_value_of_a_string_option_is_a_plain_string(capsys):
    from aqsgd.cli import build_parser

    args = build_parser().parse_args(["train", "--run-name", "-x", "--forward", "-q2"])
    assert args.run_name == "-x" and type(args.run_name) is str and type(args.forward) is str
    args = build_parser().parse_args(["bench", "codecs", "--codecs", "-q9", "q2", "--shape", "2,3"])
    assert args.codecs == ["-q9", "q2"] and all(type(c) is str for c in args.codecs)


def test_an_option_after_an_option_is_still_an_option(capsys):
    # a known option (or an ambiguous prefix of some) is never taken for the value of the one before it
    with pytest.raises(SystemExit):
        main(["train", "--lr", "--epochs", "2"])
    assert "argument --lr: expected one argument" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--run-name", "--l", "x"])
    assert "ambiguous option: --l could match" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
