"""The project's GPU check: one prepared command on a machine with a GPU and no internet, one JSON and one
markdown report.

Here (with the project's environment active, from the repository root)::

    python -m benchmarks.gpu_check prepare       # builds .gpu/ (ignored by git): wheels, the offline data

On the GPU machine, from a copy of the working tree with ``.gpu/`` carried along::

    python3 -m benchmarks.gpu_check run --budget 470 --out "$OUT"

With a session's 15 minutes of device time (starting the machine took about 40 s of it): ``--budget 500`` in a
first call (every step; the suite gets what is left, about 2 minutes), then ``--only suite --budget 240
--suite-reverse`` in a second call on the still-warm machine: the whole suite with 14 workers took more than
4 minutes there (cut at 91 % twice), so the second call runs it from its end, and the two calls together
cover it. On an H200 (2026-11-30) one call with ``--budget 555`` and ``--only`` leaving out ``overhead`` and
the ``dist`` steps ran the whole suite in 240 s. The tracked files and ``.gpu/`` together exceed the 64 MiB a
call carries; ``prepare`` says so (see docs/bench-pipeline.md, "The GPU check").

``prepare`` puts into ``.gpu/`` what such a machine lacks: wheels of the base dependencies its image has not
(``isal``, ``zstandard``, ``gguf``, for its Python), the MiniLM weights cast to fp16 (so that the tree stays
under what a remote call carries) and the BBC articles. ``run`` installs the wheels into ``/tmp/site``, points
``AQSGD_CACHE`` at a copy of the data and runs the steps below, each in a process of its own with its own time
limit inside ``--budget`` seconds (a step that would not fit is skipped and said so):

* ``codecs``: ``aqsgd bench codecs --device cuda`` (each codec's rate against a same-tensor ``clone()``);
  ``codecs-topk11`` the TopK rows again with 11-bit radix digits (``AQSGD_TOPK_DIGIT_BITS=11``; 8 is the
  default);
* ``codecs-subspace``: the default's subspace codec (dense and tiled bases, with and without its range coder)
  in the same bench;
* ``no-sync``: no host synchronisation inside an encode or a decode on the GPU, NaN input and corrupt packets
  included (the CUDA tests of ``tests/compress/test_deferred_checks.py`` under
  ``torch.cuda.set_sync_debug_mode("error")``; Triton kernels compile in it);
* ``default-job``: ``aqsgd train`` as the README shows it (samples/s, accuracy with compression on and off);
* ``overhead``: ``aqsgd bench overhead --device cuda`` on a 251 M-parameter Qwen2-style model (plain
  transformers loop vs the local pipeline at 1 and 4 stages);
* ``dist-fp32`` / ``dist-aqsgd``: 4 stage processes sharing the GPU over an emulated 1 Gbit/s link
  (``--runtime distributed --link 1gbit``) on a 55 M-parameter Qwen2-style folder and text file made here;
* ``dp-gloo``: 2 stages x 2 replicas on the one GPU with ``q8`` gradient sync (``--dp-backend auto`` must take
  gloo there and say so), and ``dp-nccl`` that an explicit ``--dp-backend nccl`` is refused in one line;
* ``suite``: the whole test suite (pytest-xdist where installed), in the time that is left; each failure is
  written to ``suite-failures.txt`` as it happens (one line: the test and its error; see
  :mod:`benchmarks.pytest_failure_log`), so a suite cut short by the time limit still says what failed.

The report (``gpu-check.json``, ``gpu-check.md`` in ``--out``) holds the machine, the versions, every step's
exit status, seconds and figures; ``log.txt`` the output of every step.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / ".gpu"
WHEELS = ("isal", "zstandard", "gguf")  # base dependencies the GPU image lacks
OVERHEAD = ["--hidden", "1024", "--layers", "16", "--heads", "16", "--kv-heads", "8", "--intermediate",
            "2816", "--vocab", "32000", "--seq-len", "256", "--micro-batch-size", "8", "--micro-batches", "4",
            "--stages", "1,4", "--rounds", "5", "--steps", "3"]
DIST = ["--max-length", "256", "--epochs", "3", "--warmup-epochs", "1", "--max-train-samples", "320",
        "--eval-every", "0", "--checkpoint-every", "0", "--no-progress", "--no-tensorboard", "--stages", "4",
        "--runtime", "distributed", "--link", "1gbit", "--timeout", "60"]
SMOKE_OVERHEAD = ["--hidden", "32", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--intermediate",
                  "48", "--vocab", "64", "--seq-len", "8", "--micro-batch-size", "2", "--micro-batches", "2",
                  "--stages", "1,2", "--rounds", "1", "--steps", "1"]


# -------------------------------------------------------------------------------------------------- prepare
def prepare() -> None:
    """Build ``.gpu/`` here (see the module docstring)."""
    exclude = ROOT / ".git" / "info" / "exclude"
    if exclude.parent.parent.is_dir():  # a checkout: .gpu/ stays out of git
        exclude.parent.mkdir(exist_ok=True)
        if "/.gpu/" not in (exclude.read_text().split() if exclude.exists() else []):
            with open(exclude, "a") as f:
                f.write("/.gpu/\n")
    shutil.rmtree(GPU, ignore_errors=True)
    (GPU / "whl").mkdir(parents=True)
    (GPU / "cache").mkdir()
    from importlib.metadata import version

    for name in WHEELS:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp",
                        "--platform", "manylinux_2_28_x86_64",
                        "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
                        "-d", str(GPU / "whl"), f"{name}=={version(name)}"], check=True)
    from aqsgd.data import default_cache_dir, require

    require("minilm")
    require("bbc")
    cache = default_cache_dir()
    minilm = GPU / "cache" / "minilm"
    shutil.copytree(cache / "minilm", minilm)
    for extra in ("README.md", "data_config.json"):
        (minilm / extra).unlink(missing_ok=True)
    from safetensors.torch import load_file, save_file

    weights = minilm / "model.safetensors"
    tensors = load_file(str(weights))
    save_file({k: (v.half() if v.is_floating_point() else v).contiguous() for k, v in tensors.items()},
              str(weights), metadata={"format": "pt"})
    with tarfile.open(GPU / "cache" / "bbc.tgz", "w:gz") as tar:
        tar.add(cache / "bbc", arcname="bbc")
    size = sum(f.stat().st_size for f in GPU.rglob("*") if f.is_file())
    print(f"built {GPU} ({size / 2**20:.1f} MiB): carry it along and run there "
          "`python3 -m benchmarks.gpu_check run --budget 470 --out $OUT`")
    tracked = _tracked_bytes()
    if tracked is not None and tracked + size > TRAVEL_LIMIT:
        print(f"note: the tracked files ({tracked / 2**20:.1f} MiB) and {GPU.name}/ together are "
              f"{(tracked + size) / 2**20:.1f} MiB, over the {TRAVEL_LIMIT >> 20} MiB a remote call "
              "carries: set benchmarks/results files over 200 KB aside for the call (the docs-link tests "
              "then fail there), or carry .gpu/whl alone for steps that need no MiniLM (all but default-job)")


TRAVEL_LIMIT = 64 << 20  # what one call to a lent GPU machine carries (tracked files and carried paths)


def _tracked_bytes() -> int | None:
    """The bytes of the files git tracks here; None outside a checkout."""
    try:
        names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return sum((ROOT / n).stat().st_size for n in names.decode().split("\0") if n and (ROOT / n).is_file())


# -------------------------------------------------------------------------------------------------- run
class Check:
    """The steps of one run, each in a process of its own, within one time budget."""

    def __init__(self, budget: float, out: Path, work: Path, *, smoke: bool = False) -> None:
        self.t0, self.budget, self.out, self.work, self.smoke = time.monotonic(), budget, out, work, smoke
        self.steps: list[dict] = []
        self.log = open(out / "log.txt", "w")  # noqa: SIM115 - closed in report()

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    def step(self, name: str, limit: float, argv: list[str], cwd: Path | None = None) -> dict:
        """Run ``argv`` with at most ``limit`` seconds (less where the budget has less); its output to the
        log."""
        t = min(limit, self.left() - 10)
        record: dict = {"name": name, "command": " ".join(argv), "limit_s": round(t, 1)}
        if t < 5:
            record.update(rc=None, seconds=0.0, skipped="no time left")
            self._note(f"=== {name}: skipped, no time left")
            self.steps.append(record)
            return record
        self._note(f"=== {name} (limit {t:.0f} s, {self.left():.0f} s left): {record['command']}")
        start = time.monotonic()
        try:
            proc = subprocess.run(argv, cwd=cwd or ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=t)
            record["rc"], text = proc.returncode, proc.stdout
        except subprocess.TimeoutExpired as e:
            record["rc"], text = "timeout", (e.stdout or b"").decode(errors="replace") if isinstance(
                e.stdout, bytes) else (e.stdout or "")
        record["seconds"] = round(time.monotonic() - start, 1)
        record["output"] = text
        self._note(text.rstrip())
        self._note(f"=== {name}: rc={record['rc']} in {record['seconds']} s")
        self.steps.append(record)
        return record

    def _note(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")
        self.log.flush()

    def report(self, env: dict) -> dict:
        self.log.close()
        steps = [{k: v for k, v in s.items() if k != "output"} for s in self.steps]
        data = {"check": "gpu", "env": env, "budget_s": self.budget,
                "seconds": round(time.monotonic() - self.t0, 1), "steps": steps}
        (self.out / "gpu-check.json").write_text(json.dumps(data, indent=1))
        (self.out / "gpu-check.md").write_text(markdown(data))
        return data


def _summary(run_dir: Path) -> dict:
    try:
        s = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    out = {"samples_per_s": s.get("samples_per_s"), "final_train_loss": s.get("final_train_loss")}
    for name, vals in (s.get("eval") or {}).items():
        for k, v in vals.items():
            out[f"eval_{k}_{name}"] = v
    return out


def _median_samples_per_s(run_dir: Path, after_epoch: int = 0) -> float | None:
    try:
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    except (OSError, ValueError):
        return None
    v = [r["samples_per_s"] for r in rows if r.get("kind") == "train" and r.get("epoch", 0) > after_epoch
         and r.get("samples_per_s")]
    return statistics.median(v) if v else None


def _pytest_counts(text: str) -> dict:
    found = re.findall(r"(\d+) (passed|failed|errors?|skipped)",
                       text.splitlines()[-1] if text.strip() else "")
    return {k.rstrip("s") if k.startswith("error") else k: int(n) for n, k in found}


def _make_model(folder: Path, tokenizer: Path, hidden: int, layers: int) -> None:
    """A random Qwen2-style folder with MiniLM's tokenizer and a causal-LM text file, for the distributed
    step."""
    import random

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    cfg = AutoConfig.for_model("qwen2", vocab_size=len(tok) + 64, hidden_size=hidden,
                               intermediate_size=hidden * 11 // 4,
                               num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                               num_key_value_heads=max(1, hidden // 128), max_position_embeddings=1024,
                               pad_token_id=tok.pad_token_id, bos_token_id=tok.cls_token_id,
                               eos_token_id=tok.sep_token_id, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(folder / "model"))
    tok.save_pretrained(str(folder / "model"))
    rng = random.Random(0)
    words = ("the a network slow pipeline stage model data train bits cache link fast good bad river "
             "mountain city engine signal value paper result method table figure gradient activation "
             "quantize compress").split()
    (folder / "docs.txt").write_text("\n".join(" ".join(rng.choices(words, k=300)) for _ in range(700))
                                     + "\n")


def run(budget: float, out: Path, *, only: set[str] | None = None, smoke: bool = False,
        suite_reverse: bool = False) -> dict:
    """The check (module docstring). ``only``: the steps to run; ``smoke``: tiny settings, for a CPU run that
    checks the check itself; ``suite_reverse``: the suite in reverse order (the tests a time limit cut off
    first)."""
    out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "aqsgd-gpu-check"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = os.environ
    if (GPU / "whl").is_dir() and any((GPU / "whl").iterdir()):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--no-compile", "--target", "/tmp/site", *map(str, (GPU / "whl").iterdir())],
                       check=False)
        env["PYTHONPATH"] = os.pathsep.join(["/tmp/site", str(ROOT / "src"), str(ROOT),
                                             env.get("PYTHONPATH", "")])
    else:
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    if (GPU / "cache").is_dir():
        cache = work / "cache"
        shutil.copytree(GPU / "cache" / "minilm", cache / "minilm")
        with tarfile.open(GPU / "cache" / "bbc.tgz") as tar:
            tar.extractall(cache, filter="data")
        env["AQSGD_CACHE"] = str(cache)
    env.update(PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    check = Check(budget, out, work, smoke=smoke)
    probe = subprocess.run([sys.executable, "-c", "import json, sys, torch, transformers, numba; "
                            "print(json.dumps({'python': sys.version.split()[0], 'torch': torch.__version__, "
                            "'transformers': transformers.__version__, 'numba': numba.__version__, 'cuda': "
                            "torch.cuda.is_available(), 'gpu': torch.cuda.get_device_name() if "
                            "torch.cuda.is_available() else None}))"],
                           capture_output=True, text=True)
    envinfo = json.loads(probe.stdout) if probe.returncode == 0 else {"probe": probe.stderr[-500:]}
    device = "cuda" if envinfo.get("cuda") else "cpu"
    aq = [sys.executable, "-m", "aqsgd"]

    def wanted(name: str) -> bool:
        return only is None or name in only

    runs = work / "runs"

    if wanted("codecs"):
        shape = ["--shape", "4,16,64", "--repeats", "2", "--codecs", "q2", "fp16"] if smoke else []
        r = check.step("codecs", 100, [*aq, "bench", "codecs", "--device", device, *shape, "--json",
                                      str(out / "codecs.json")])
        r["figures"] = _codec_figures(out / "codecs.json")
    if wanted("codecs-topk11"):
        # TopK's radix in three passes of 11-bit digits, beside the default four of 8 in the codecs step: the
        # histogram's cost depends on Triton's lowering (aqsgd.compress.kernels.triton)
        env["AQSGD_TOPK_DIGIT_BITS"] = "11"
        topk = ["--shape", "4,16,64", "--repeats", "2"] if smoke else []
        topk += ["--codecs", "topk0.1", "topk0.1+q8", "--json", str(out / "codecs-topk11.json")]
        r = check.step("codecs-topk11", 45, [*aq, "bench", "codecs", "--device", device, *topk])
        env.pop("AQSGD_TOPK_DIGIT_BITS", None)
        r["figures"] = _codec_figures(out / "codecs-topk11.json")
    if wanted("codecs-subspace"):
        # the default's subspace codec (aqsgd.train.config.DEFAULT_FORWARD's inner spec), with dense and tiled
        # bases and without its range coder, beside the same codec without the subspace
        sub = ["--shape", "4,16,64", "--repeats", "2"] if smoke else []
        sub += ["--codecs", "q4:rot128:step1:rc:pca/4", "q4:rot128:step1:rc:pca/4:tile64", "q4:pca/4",
                "q4:pca/4:tile64", "q4:rot128:step1:rc", "--json", str(out / "codecs-subspace.json")]
        r = check.step("codecs-subspace", 60, [*aq, "bench", "codecs", "--device", device, *sub])
        r["figures"] = _codec_figures(out / "codecs-subspace.json")
    if wanted("no-sync"):
        r = check.step("no-sync", 120, [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                       "-rfEs", "tests/compress/test_deferred_checks.py", "-k", "cuda"])
        r["figures"] = _pytest_counts(r.get("output", ""))
    if wanted("default-job"):
        extra = ["--max-steps", "2", "--max-train-samples", "32", "--max-eval-samples", "16"] if smoke else []
        r = check.step("default-job", 120, [*aq, "train", "--no-progress", "--no-tensorboard", "--output-dir",
                                             str(runs), "--run-name", "default", *extra])
        r["figures"] = _summary(runs / "default")
    if wanted("overhead"):
        sizes = SMOKE_OVERHEAD if smoke else OVERHEAD
        r = check.step("overhead", 150, [*aq, "bench", "overhead", "--device", device, *sizes, "--json",
                                         str(out / "overhead.json")])
        try:
            r["figures"] = json.loads((out / "overhead.json").read_text())["ratio"]
        except (OSError, ValueError, KeyError):
            r["figures"] = {}
    if wanted("dist-fp32") or wanted("dist-aqsgd"):
        folder = work / "qwen"
        hidden, layers = (32, 4) if smoke else (512, 8)
        tokenizer = Path(env.get("AQSGD_CACHE", "")) / "minilm"
        model_ok = True
        try:
            _make_model(folder, tokenizer if tokenizer.is_dir() else _minilm_folder(), hidden, layers)
        except Exception as e:  # noqa: BLE001 - the step says why it could not run
            check._note(f"=== dist: no model folder ({type(e).__name__}: {e})")
            model_ok = False
        common = ["--model", str(folder / "model"), "--train-file", str(folder / "docs.txt"), *DIST,
                  "--output-dir", str(runs)]
        if smoke:
            common += ["--max-train-samples", "32", "--epochs", "2", "--max-length", "32"]
        for name, setting in (("dist-fp32", ["--forward", "none", "--backward", "none"]), ("dist-aqsgd", [])):
            if model_ok and wanted(name):
                r = check.step(name, 100, [*aq, "train", *common, *setting, "--run-name", name])
                r["figures"] = {"samples_per_s_after_warmup": _median_samples_per_s(runs / name,
                                                                                    after_epoch=0)}
    dp = [*aq, "train", "--task", "synthetic-lm", "--model", "tiny-llama", "--stages", "2", "--runtime",
          "distributed", "--data-parallel", "2", "--grad-sync", "q8", "--max-steps", "4", "--no-progress",
          "--no-tensorboard", "--output-dir", str(runs)]
    if wanted("dp-gloo"):
        r = check.step("dp-gloo", 75, [*dp, "--run-name", "dp-auto"])
        r["figures"] = {"said_gloo": "goes over gloo" in r.get("output", "")}
    if wanted("dp-nccl"):
        r = check.step("dp-nccl", 40, [*dp, "--run-name", "dp-nccl", "--dp-backend", "nccl"])
        errors = [x for x in r.get("output", "").splitlines() if x.startswith("aqsgd: error:")]
        r["figures"] = {"refused_in_one_line": len(errors) == 1 and "--dp-backend nccl" in errors[0],
                        "line": errors[0] if errors else None}
    if wanted("suite"):
        # the default job's golden losses are MiniLM's released fp32 weights'; the ones carried here are
        # cast to fp16 (see prepare), so that case's losses are not comparable and is left out
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                "benchmarks.pytest_failure_log", "-rfE", "--maxfail", "60",
                "--deselect", "tests/golden/test_golden.py::test_golden_losses[default_job]"]
        if _importable("xdist"):
            argv += ["-n", str(min(14, os.cpu_count() or 2))]
        if _importable("pytest_timeout"):
            argv += ["--timeout", "240"]
        failures = out / "suite-failures.txt"  # written as tests fail, so kept on a timeout
        failures.unlink(missing_ok=True)
        env["AQSGD_TEST_LOG"] = str(failures)
        if suite_reverse:
            env["AQSGD_TEST_REVERSE"] = "1"
        r = check.step("suite", 420, [*argv, *(["tests/compress/test_registry.py"] if smoke else ["tests"])])
        env.pop("AQSGD_TEST_LOG", None)
        env.pop("AQSGD_TEST_REVERSE", None)
        r["figures"] = _pytest_counts(r.get("output", ""))
        if failures.exists():
            r["figures"]["failures"] = failures.read_text().splitlines()
    return check.report(envinfo)


def _minilm_folder() -> Path:
    from aqsgd.data import require

    return Path(require("minilm"))


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _codec_figures(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        rows = data["rows"]
    except (OSError, ValueError, KeyError):
        return {}
    keep = ("codec", "encode_vs_clone", "decode_vs_clone", "eager_encode_gbps", "encode_gbps",
            "encode_queued_gbps", "decode_queued_gbps", "clone_gbps", "encode_kernels", "encode_kernel_us",
            "decode_kernels", "decode_kernel_us", "encode_slowest", "decode_slowest", "ratio")
    return {"rows": [{k: r.get(k) for k in keep if k in r} for r in rows],
            **({"launch_us": data["launch_us"]} if data.get("launch_us") else {})}


def markdown(data: dict) -> str:
    env = data["env"]
    lines = [f"# GPU check: {env.get('gpu') or 'no GPU'}", "",
             f"Python {env.get('python')}, torch {env.get('torch')}, transformers {env.get('transformers')}, "
             f"numba {env.get('numba')}; {data['seconds']} s of a {data['budget_s']:.0f} s budget.", "",
             "| step | exit | seconds | figures |", "|---|---|---|---|"]
    for s in data["steps"]:
        figures = s.get("skipped") or json.dumps(s.get("figures", {}), default=str)
        lines.append(f"| {s['name']} | {s.get('rc')} | {s.get('seconds')} | {figures} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("prepare", help="build .gpu/ here")
    r = sub.add_parser("run", help="run the check (on the GPU machine)")
    r.add_argument("--budget", type=float, default=470.0, help="seconds for all steps (default: 470)")
    r.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/gpu-check")),
                   help="where the report goes (default: $OUT)")
    r.add_argument("--only", default=None, help="comma-separated steps to run (default: all)")
    r.add_argument("--smoke", action="store_true", help="tiny settings: check the check itself on a CPU")
    r.add_argument("--suite-reverse", action="store_true",
                   help="run the suite's tests in reverse order: a second call reaches first what the first "
                        "call's time limit cut off")
    args = parser.parse_args(argv)
    if args.what == "prepare":
        prepare()
        return 0
    data = run(args.budget, args.out, only=set(args.only.split(",")) if args.only else None, smoke=args.smoke,
               suite_reverse=args.suite_reverse)
    failed = [s["name"] for s in data["steps"] if s.get("rc") not in (0, None) and s["name"] != "dp-nccl"]
    print(f"report: {args.out / 'gpu-check.md'}"
          + (f"; steps that failed: {', '.join(failed)}" if failed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
