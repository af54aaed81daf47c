import json
import subprocess
import sys

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
