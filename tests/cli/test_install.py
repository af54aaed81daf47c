"""The README is the contract of a fresh machine: the base install runs every command it shows, the test
extras add only test tools, CI runs exactly the README's test command, and the documented entry points
exist."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "aqsgd"
# import name -> distribution name, where they differ
_DIST = {"torch": "torch", "yaml": "pyyaml"}
# imported only behind a guard that turns their absence into a one-line error naming the package
# pyarrow: the [parquet] extra; triton: the GPU kernels, with PyTorch's CUDA builds (and the [test] extra)
_OPTIONAL = {"datasets", "huggingface_hub", "typing_extensions", "pyarrow", "triton", "torchft"}


def _requirement_names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in reqs}


def _third_party_imports() -> set[str]:
    names: set[str] = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "aqsgd"}


def test_base_dependencies_cover_every_import():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = _requirement_names(project["dependencies"])
    missing = sorted(n for n in _third_party_imports() - _OPTIONAL if _DIST.get(n, n).lower() not in base)
    assert not missing, f"imported by aqsgd but not installed by `pip install .`: {missing}"
    # what `aqsgd train` writes and `aqsgd report` draws, and the SmolLM2 conversion, need no extra either
    assert {"tensorboard", "matplotlib", "transformers", "gguf", "accelerate"} <= base
    # the test extra adds the test tools, pyarrow (the .parquet reader of --train-file is tested) and triton
    # (its interpreter runs the GPU kernels on CPU tensors)
    assert _requirement_names(project["optional-dependencies"]["test"]) == {"pytest", "hypothesis", "pyarrow",
                                                                            "triton"}
    assert _requirement_names(project["optional-dependencies"]["parquet"]) == {"pyarrow"}
    # replicas that come and go (aqsgd.parallel.elastic): torchft, imported only where they are asked for
    assert _requirement_names(project["optional-dependencies"]["elastic"]) == {"torchft"}


def test_ci_runs_the_readme_test_command_in_a_fresh_environment():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    block = re.search(r"## Tests\s+```bash\n(.+?)\n```", readme, re.S)
    assert block, "the README has a Tests section with one command"
    command = block.group(1).strip()
    assert command in ci.splitlines()
    assert "python3 -m venv" in ci and "pip install --quiet torch==2.13.0" in ci
    assert "-c .ci/floor.txt" in ci and "ruff check src tests benchmarks" in ci


def test_the_floor_ci_installs_is_every_declared_lower_bound():
    """A range we declare is a range we test: .ci/floor.txt pins each dependency (base and test extras) at the
    lower bound pyproject.toml declares, and the floor job of .ci/run installs it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {}
    for req in [*project["dependencies"], *project["optional-dependencies"]["test"]]:
        name, bound = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", req.split(";")[0].strip()).groups()
        declared[name.lower()] = bound
    pinned = dict(line.split("==") for line in (ROOT / ".ci" / "floor.txt").read_text().splitlines()
                  if line.strip() and not line.startswith("#"))
    assert set(pinned) == set(declared)
    for name, bound in declared.items():
        got = pinned[name].split(".")
        want = bound.split(".")
        assert got[: len(want)] == want and all(p == "0" for p in got[len(want):]) or pinned[name] == bound, (
            f"{name}: declared >={bound}, the floor job installs {pinned[name]}")


@pytest.mark.parametrize("module", ["aqsgd", "aqsgd.cli"])
def test_python_dash_m_runs_the_command(module):
    out = subprocess.run([sys.executable, "-m", module, "train", "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "usage: aqsgd train" in out.stdout


@pytest.mark.parametrize("command", [["train"], ["codecs"], ["report"], ["data"], ["bench", "codecs"],
                                     ["bench", "pipeline"], ["bench", "convergence"], ["bench", "netem"]])
@pytest.mark.slow
def test_help_states_each_default_at_most_once(command):
    keep = {k: v for k, v in os.environ.items() if k == "PYTHONPATH"}  # where aqsgd is found, not installed
    out = subprocess.run([sys.executable, "-m", "aqsgd", *command, "--help"], capture_output=True, text=True,
                         env={"COLUMNS": "400", "PATH": "", **keep})
    assert out.returncode == 0, out.stderr
    assert "(default: None)" not in out.stdout
    for line in out.stdout.splitlines():
        assert line.count("(default") <= 1, line
