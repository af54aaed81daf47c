"""Real slow links: stage processes in Linux network namespaces joined by shaped veth links.

``aqsgd bench pipeline`` emulates links inside the transport; this package runs training over *real* TCP links
instead (root and iproute2 needed; without them every entry point raises :class:`NetemUnavailable` saying what
is missing):

* :mod:`~aqsgd.bench.netem.cluster`: :class:`NetemCluster`, a chain of network namespaces joined by veth links
  shaped with ``tc``, which runs ``aqsgd train`` in them one process per rank, the way torchrun starts it,
  and the helpers that inject faults from outside (link cuts and impairments, killing or stopping a rank);
  what it needs of the host is :mod:`~aqsgd.bench.netem.host`, a link's shape (:class:`LinkShape`)
  :mod:`~aqsgd.bench.netem.shape`, a training run's command line, processes and outcomes
  :mod:`~aqsgd.bench.netem.runs`;
* :mod:`~aqsgd.bench.netem.sweep`: the benchmark (:func:`bench_netem`, ``aqsgd bench netem``), pipeline
  throughput against bandwidth for named settings, next to the ideal speed-up, or every setting over one tc
  setting per boundary, which may change during the run (:func:`bench_netem_links`);
* :mod:`~aqsgd.bench.netem.output`: its markdown table, JSON report and plot.

The user-space wire that delays and drops frames where the kernel has no ``sch_netem`` is
:mod:`aqsgd.bench.netem_wire`. The command line (``aqsgd bench netem``) is :mod:`aqsgd.cli.netem`.
"""

from aqsgd.bench.netem.cluster import NetemCluster
from aqsgd.bench.netem.host import (NetemError, NetemUnavailable, check_netem, cleanup_stale,
                                   netem_unavailable_reason)
from aqsgd.bench.netem.runs import NetemRun, StageOutcome, snake_nodes, sync_link_load, train_argv, train_rows
from aqsgd.bench.netem.shape import LinkShape
from aqsgd.bench.netem.output import markdown_table, plot_speedups, write_json
from aqsgd.bench.netem.sweep import (
    DEFAULT_SETTINGS,
    NetemBenchConfig,
    bandwidth_grid,
    bench_netem,
    bench_netem_links,
    train_options,
    variant_label,
)

__all__ = [
    "DEFAULT_SETTINGS",
    "LinkShape",
    "NetemBenchConfig",
    "NetemCluster",
    "NetemError",
    "NetemRun",
    "NetemUnavailable",
    "StageOutcome",
    "bandwidth_grid",
    "bench_netem",
    "bench_netem_links",
    "check_netem",
    "cleanup_stale",
    "markdown_table",
    "netem_unavailable_reason",
    "plot_speedups",
    "snake_nodes",
    "sync_link_load",
    "train_argv",
    "train_options",
    "train_rows",
    "variant_label",
    "write_json",
]
