"""How many threads each process of a job computes with: its share of the cores of its machine.

PyTorch's intra-op pool (and OpenMP's and MKL's) takes every core of the machine in every process. N stage
processes on one machine then run N times as many compute threads as there are cores, and OpenMP threads
that wait at a barrier spin while the threads they wait for have no core: 4 stage processes on 2 cores were
seen taking 40-90 s for a stage's compute of one step that takes 2-3 s. ``torchrun`` sets
``OMP_NUM_THREADS=1`` when it starts several processes per machine for this reason; the processes that
:func:`~aqsgd.comm.launch.launch_local` starts get the same care from :func:`thread_share`:

* a thread count given with the run (``--threads``) wins;
* else ``OMP_NUM_THREADS`` set in the environment (by the user, or by torchrun);
* else ``max(1, cores // processes on this machine)``, where the cores are those this process may run on
  (its CPU affinity, which a container or ``taskset`` may narrow), not every core of the machine; a process
  alone on its machine keeps PyTorch's default (every core).

The share is PyTorch's intra-op thread count in each process (which the fused codec kernels of
:mod:`aqsgd.compress.kernels.numba` and the top-k passes follow: they run on ``torch.get_num_threads()``
threads at most) and its inter-op pool's size; a spawned process also gets it as ``OMP_NUM_THREADS``,
``MKL_NUM_THREADS`` and ``NUMBA_NUM_THREADS`` (the size of numba's pool), each where the environment does not
set it already (``--threads`` sets all three).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator, Mapping

from aqsgd.errors import SpecError

__all__ = ["THREAD_VARS", "ThreadShare", "apply_threads", "intra_op_threads", "thread_share", "usable_cores"]

log = logging.getLogger(__name__)

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
"""The variables that size a spawned process's thread pools: OpenMP's (PyTorch's intra-op pool), MKL's and
numba's."""


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask), which can be fewer than the machine has."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity on this platform
        return os.cpu_count() or 1


@dataclasses.dataclass(frozen=True)
class ThreadShare:
    """The threads each of ``processes`` processes on a machine of ``cores`` usable cores computes with, and
    where the number comes from: ``--threads``, ``OMP_NUM_THREADS`` or ``share`` (cores // processes). None
    threads: PyTorch's default, left as it is (a process alone on its machine, nothing set)."""

    threads: int | None
    processes: int
    cores: int
    source: str
    omp: str | None = None  # OMP_NUM_THREADS as the environment had it

    def describe(self) -> str:
        """One line for the start of a run: ``4 stage processes on 2 cores: 1 thread each (OMP_NUM_THREADS
        unset; --threads to change)``."""
        procs = f"{self.processes} stage process{'es' if self.processes != 1 else ''}"
        cores = f"{self.cores} core{'s' if self.cores != 1 else ''}"
        if self.threads is None:
            threads = "all of them"
        else:
            threads = f"{self.threads} thread{'s' if self.threads != 1 else ''}"
            threads += " each" if self.processes != 1 else ""
        if self.source == "--threads":
            why = f"--threads {self.threads}"
        elif self.omp is None:
            why = "OMP_NUM_THREADS unset; --threads to change"
        else:
            why = f"OMP_NUM_THREADS={self.omp}; --threads to change"
        return f"{procs} on {cores}: {threads} ({why})"

    def child_environ(self, environ: Mapping[str, str]) -> dict[str, str]:
        """The variables a spawned process gets (:data:`THREAD_VARS`): those ``environ`` leaves unset, every
        one of them where the count is ``--threads``; none where the count is PyTorch's default."""
        if self.threads is None:
            return {}
        forced = self.source == "--threads"
        return {k: str(self.threads) for k in THREAD_VARS if forced or not environ.get(k, "").strip()}


def thread_share(processes: int, *, threads: int | None = None, environ: Mapping[str, str] | None = None,
                 cores: int | None = None) -> ThreadShare:
    """The threads of each of ``processes`` processes on this machine (module docstring): ``threads``
    (``--threads``) if given, else ``OMP_NUM_THREADS`` from ``environ`` (default ``os.environ``), else the
    ``cores`` (default :func:`usable_cores`) shared out, at least one each (None, PyTorch's default, for a
    process alone on its machine). A value of ``OMP_NUM_THREADS`` that is no thread count is a
    :class:`~aqsgd.errors.SpecError` naming it."""
    environ = os.environ if environ is None else environ
    cores = usable_cores() if cores is None else cores
    processes = max(1, processes)
    omp = environ.get("OMP_NUM_THREADS", "").strip() or None
    if threads is not None:
        return ThreadShare(threads, processes, cores, "--threads", omp)
    if omp is not None:
        return ThreadShare(_omp_threads(omp), processes, cores, "OMP_NUM_THREADS", omp)
    if processes == 1:
        return ThreadShare(None, processes, cores, "share")
    return ThreadShare(max(1, cores // processes), processes, cores, "share")


def _omp_threads(value: str) -> int:
    """The thread count of an ``OMP_NUM_THREADS`` value (the first level of a nested list such as ``4,2``)."""
    first = value.split(",", 1)[0].strip()
    if not first.isdigit() or int(first) < 1:
        raise SpecError(f"OMP_NUM_THREADS={value!r} is not a number of threads: set a whole number >= 1, or "
                        "unset it to share the cores between the processes")
    return int(first)


def apply_threads(threads: int | None) -> None:
    """Compute on ``threads`` threads in this process (None: as PyTorch chose): PyTorch's intra-op pool, and
    its inter-op pool where that is still possible (its size can be set once, before any inter-op work;
    PyTorch refuses it later, and the pool keeps its size)."""
    if threads is None:
        return
    import torch

    torch.set_num_threads(threads)
    if torch.get_num_interop_threads() == threads:
        return
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError as e:  # set already, or inter-op work ran: the pool stays as it is
        log.debug("the inter-op pool keeps %d threads (%s)", torch.get_num_interop_threads(), e)


@contextlib.contextmanager
def intra_op_threads(threads: int | None) -> Iterator[None]:
    """PyTorch's intra-op pool at ``threads`` threads inside the block (unchanged where None), as before
    after it: for a run in the calling process, which outlives the run."""
    if threads is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
