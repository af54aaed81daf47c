"""``python -m benchmarks.convergence [TASK...]``: the convergence study (same as
``aqsgd bench convergence``)."""

import sys

from aqsgd.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "convergence", *sys.argv[1:]]))
