"""``python -m aqsgd.bench.netem ARGS``: the same as ``aqsgd bench netem ARGS``."""

import sys

from aqsgd.cli import main

sys.exit(main(["bench", "netem", *sys.argv[1:]]))
