"""``aqsgd train --dp-elastic`` started here: a lighthouse and every replica pipeline, each a run of its own.

Replicas that come and go (:mod:`aqsgd.parallel.elastic`) must not share a process group: a process lost
would take every collective of the group down with it. So this launch starts torchft's lighthouse, then one
launcher process per replica (``--dp-replica r --dp-lighthouse ADDR --no-dp-join``), each of which starts
that replica's stage processes in a process group of their own (the usual distributed launch, see
:mod:`aqsgd.train.driver`) and writes a run directory of its own, ``RUN/replica{r}``. A replica that fails
ends alone: its launcher reports it (the one-line error of a failed stage) and the others go on; their next
outer step averages without it. The lighthouse's address is in ``RUN/lighthouse.txt`` for a replica started
later (``--dp-replica r --dp-lighthouse ADDR``, which joins at the next outer step); each replica's launcher
process id is in ``RUN/replica{r}.pid`` (SIGTERM to it stops that replica alone).

At the end ``RUN/replicas.json`` holds, per replica, whether it finished, its last step, the steps it missed
(a replica that finished may have missed some too: behind the others at an outer step, it took their state
and went on from their place) and its error; the summary returned is the lowest finished replica's, with
that table under ``replicas``. The run fails (:class:`~aqsgd.errors.StageFailedError`) only if no replica
finished.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
import os
import shutil
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from aqsgd.data.datasets import registered_tasks
from aqsgd.errors import Interrupted, StageFailedError
from aqsgd.train.checkpoint.layout import CheckpointError
from aqsgd.train.checkpoint.read import latest_checkpoint
from aqsgd.train.config import TrainConfig
from aqsgd.train.rundir import last_logged_step, prepare_run_dir, resolve_run_dir
from aqsgd.train.tasks import setup_task

__all__ = ["run_replicas", "replica_config", "START_ENV", "start_together"]

log = logging.getLogger(__name__)

#: ``FOLDER:D:STAGES``, set by this launch for its replicas' processes: they start together
#: (:func:`start_together`)
START_ENV = "AQSGD_ELASTIC_START"


def start_together(replica: int, stage: int, *, timeout_s: float = 300.0) -> None:
    """The replicas of one launch start together: each stage process, its manager up (heartbeating to the
    lighthouse), marks itself ready in the launch's folder and waits for every stage of every replica, so
    that the first quorum finds them all (the lighthouse waits for every live replica, not for one whose
    manager is not up yet; a replica up late would join at the first outer step instead, its first round
    lost). Gives up after ``timeout_s`` (a replica that failed to start), naming the missing ones. Nothing
    to do outside such a launch."""
    spec = os.environ.get(START_ENV)
    if not spec:
        return
    folder, replicas, stages = spec.rsplit(":", 2)
    ready = Path(folder)
    ready.mkdir(parents=True, exist_ok=True)
    (ready / f"{replica}-{stage}").touch()
    every = {f"{r}-{s}" for r in range(int(replicas)) for s in range(int(stages))}
    deadline = time.monotonic() + timeout_s
    while (missing := every - {p.name for p in ready.iterdir()}) and time.monotonic() < deadline:
        time.sleep(0.1)
    if missing:
        log.warning("replica %d: replicas %s were not up after %.0f s; starting without them (they join at "
                    "an outer step when they are)", replica, sorted({int(m.split("-")[0]) for m in missing}),
                    timeout_s)


def replica_config(cfg: TrainConfig, replica: int, lighthouse: str, run_dir: Path) -> TrainConfig:
    """The settings of replica ``replica``'s own launch: its index, the lighthouse, its run directory
    ``run_dir / replica{r}``. It joins as any replica does (``--dp-join``): the replicas up at its start meet
    in a first quorum and start together; one that comes up after the others have started joins them at
    their next outer step with their state (inside a training step only where it is behind them: an outer
    step that failed on it alone, or it was frozen; :mod:`aqsgd.parallel.outer`).

    With ``--resume`` (the launch's directory) each replica continues from its own newest checkpoint; one
    that has none (it failed before its first) starts again from the initial weights, in its directory
    replaced, and takes its peers' state at the first quorum (they are ahead)."""
    own = run_dir / f"replica{replica}"
    child = cfg.replace(dp_replica=replica, dp_lighthouse=lighthouse, output_dir=str(run_dir),
                        run_name=f"replica{replica}")
    if cfg.run.resume is None:
        return child
    if latest_checkpoint(own) is not None:
        return child.replace(resume=str(own), overwrite=False)
    log.warning("replica %d: no checkpoint in %s; it starts again and takes its peers' state at the first "
                "outer step", replica, own)
    return child.replace(resume=None, overwrite=True)


def _replica_main(run_training: Callable[..., Any], cfg_json: str, data: Any, tasks: Any, out: Any,
                  start: str) -> None:
    """One replica's launcher process: its distributed launch (``run_training``: the driver's), the outcome
    sent back."""
    from aqsgd.data.datasets import register_task
    from aqsgd.logs import configure

    configure(logging.INFO, "%(asctime)s %(levelname)s [pid %(process)d] %(message)s")
    for spec in tasks:
        register_task(spec, replace=True)
    cfg = TrainConfig.from_dict(json.loads(cfg_json))
    code = 1
    os.environ[START_ENV] = start
    try:
        out.put((cfg.pipeline.dp_replica, "finished", run_training(cfg, data=data), None))
        code = 0
    except BaseException as e:  # noqa: BLE001 - every outcome goes back to the launch
        line = str(e).splitlines()[0] if str(e) else type(e).__name__
        out.put((cfg.pipeline.dp_replica, "failed", None, f"{type(e).__name__}: {line}"))
        log.debug("replica %s failed:\n%s", cfg.pipeline.dp_replica, traceback.format_exc())
    finally:
        # the outcome delivered, this launcher ends at once: a failed launch may leave threads of PyTorch's
        # launcher behind, which would keep the process (and a replica that looks alive) for the whole run
        out.close()
        out.join_thread()
        logging.shutdown()
        os._exit(code)


@dataclasses.dataclass
class ReplicaOutcome:
    replica: int
    status: str  # finished, failed
    last_step: int | None
    missed: str | None  # "11-36": the steps it did not train (as its own: "8-12, 20-24" where it finished)
    error: str | None
    run_dir: str

    def line(self) -> str:
        where = "before step 1" if self.last_step is None else f"after step {self.last_step}"
        if self.status == "finished":
            behind = (f", behind the others (took their state) and missed steps {self.missed}" if self.missed
                      else "")
            return f"replica {self.replica}: finished{behind} ({self.run_dir})"
        missed = f", missed steps {self.missed}" if self.missed else ""
        return f"replica {self.replica}: stopped {where}{missed}: {self.error} ({self.run_dir})"


def run_replicas(cfg: TrainConfig, run_training: Callable[..., Any], *,
                 data: tuple[Dataset, Dataset] | None = None) -> dict[str, Any]:
    """Start the lighthouse and every replica (module docstring), each launched by ``run_training`` (the
    driver's, given by it: no import circle) in a process of its own; wait for them all; report."""
    setup = setup_task(cfg, data=data)
    run_dir = resolve_run_dir(cfg, None if data is None else setup.name)
    if cfg.run.resume is not None and not any(latest_checkpoint(run_dir / f"replica{r}") is not None
                                              for r in range(cfg.pipeline.data_parallel)):
        raise CheckpointError(f"--resume {cfg.run.resume}: no replica of an elastic launch has a checkpoint "
                              f"in {run_dir} (replica0 .. replica{cfg.pipeline.data_parallel - 1}); give the "
                              "launch's run directory")
    lock = prepare_run_dir(cfg, run_dir)  # checked, cleared (--overwrite), created, locked: as any run's
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1, sort_keys=True) + "\n")
    try:
        return _run(cfg, run_training, data, run_dir)
    finally:
        lock.release()


def _run(cfg: TrainConfig, run_training: Callable[..., Any], data: tuple[Dataset, Dataset] | None,
         run_dir: Path) -> dict[str, Any]:
    from aqsgd.parallel.elastic import Lighthouse

    p = cfg.pipeline
    lighthouse = Lighthouse(min_replicas=1, heartbeat_timeout_s=min(p.timeout, 10.0))
    (run_dir / "lighthouse.txt").write_text(lighthouse.address + "\n")
    log.info("replicas that come and go: lighthouse at %s (also in %s); %d replicas of %d stages, each a "
             "process group and a run directory of its own", lighthouse.address, run_dir / "lighthouse.txt",
             p.data_parallel, p.stages)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    tasks = registered_tasks()
    procs = {}
    ready = run_dir / ".start"
    shutil.rmtree(ready, ignore_errors=True)  # an earlier launch's marks (resumed): start together again
    start = f"{ready}:{p.data_parallel}:{p.stages}"
    try:
        for r in range(p.data_parallel):
            child = replica_config(cfg, r, lighthouse.address, run_dir)
            procs[r] = ctx.Process(target=_replica_main, name=f"replica{r}",
                                   args=(run_training, child.to_json(), data, tasks, out, start))
            procs[r].start()
            # stop one replica alone: kill -TERM $(cat RUN/replica<r>.pid) (its launcher stops its stages)
            (run_dir / f"replica{r}.pid").write_text(f"{procs[r].pid}\n")
        results: dict[int, tuple[str, Any, str | None]] = {}
        while len(results) < len(procs):
            try:
                r, status, summary, error = out.get(timeout=1.0)
                results[r] = (status, summary, error)
                if status == "failed":
                    log.warning("replica %d stopped: %s; the others go on", r, error)
                continue
            except Exception:  # noqa: BLE001 - queue.Empty: look for launchers that died without a word
                pass
            for r, proc in procs.items():
                if r not in results and not proc.is_alive() and out.empty():
                    results[r] = ("failed", None, f"its launcher exited with code {proc.exitcode}")
        for proc in procs.values():
            proc.join()
    except KeyboardInterrupt:
        for proc in procs.values():
            proc.terminate()
        raise Interrupted(2, "interrupted") from None
    finally:
        lighthouse.shutdown()
    return _report(run_dir, results)


def _report(run_dir: Path, results: dict[int, tuple[str, Any, str | None]]) -> dict[str, Any]:
    outcomes = []
    total = None
    for r in sorted(results):
        status, summary, error = results[r]
        own = run_dir / f"replica{r}"
        last = summary["steps"] if summary else last_logged_step(own)
        if summary:
            total = summary["steps"]
        outcomes.append([r, status, last, error, str(own)])
    rows = []
    for r, status, last, error, own in outcomes:
        missed = None
        if status == "finished":
            behind = results[r][1].get("elastic", {}).get("behind", [])
            missed = ", ".join(f"{a}-{b}" if a < b else str(a) for a, b in behind) or None
        elif total is not None:
            first = (last or 0) + 1
            missed = f"{first}-{total}" if first < total else str(total)
        rows.append(ReplicaOutcome(r, status, last, missed, error, own))
    (run_dir / "replicas.json").write_text(json.dumps([dataclasses.asdict(o) for o in rows], indent=1) + "\n")
    for o in rows:
        (log.info if o.status == "finished" and not o.missed else log.warning)("%s", o.line())
    finished = [results[o.replica][1] for o in rows if o.status == "finished"]
    if not finished:
        raise StageFailedError("no replica finished: " + "; ".join(o.line() for o in rows))
    return {**finished[0], "replicas": [dataclasses.asdict(o) for o in rows]}
