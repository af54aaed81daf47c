"""``python -m aqsgd.bench.netem ARGS``: the same as ``aqsgd bench netem ARGS``.

The command line sits above the benchmarks (:mod:`aqsgd.cli.netem` imports this package), so this module does
not import it: it replaces the process with ``python -m aqsgd bench netem ARGS``, as
:meth:`~aqsgd.bench.netem.cluster.NetemCluster.run_train` starts ``python -m aqsgd train``."""

import os
import sys

os.execv(sys.executable, [sys.executable, "-m", "aqsgd", "bench", "netem", *sys.argv[1:]])
