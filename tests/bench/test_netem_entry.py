"""``python -m aqsgd.bench.netem ARGS`` is ``aqsgd bench netem ARGS``, without the benchmark importing the
command line (it hands over to ``python -m aqsgd``)."""

from __future__ import annotations

import subprocess
import sys


def test_python_m_aqsgd_bench_netem_is_the_bench_netem_command():
    proc = subprocess.run([sys.executable, "-m", "aqsgd.bench.netem", "--stages", "3"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2
    assert "aqsgd bench netem: error: argument --stages: invalid choice: 3" in proc.stderr
