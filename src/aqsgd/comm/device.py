"""Where a process computes, which ``torch.distributed`` backends its groups use, host staging of GPU data.

Device
    :func:`resolve_device` turns ``--device auto|cpu|cuda`` into a ``torch.device``: ``auto`` is CUDA when
    ``torch.cuda.is_available()``, else the CPU; ``cuda`` without a CUDA device is a one-line
    :class:`~aqsgd.errors.SpecError`. In a distributed run every process takes
    ``cuda:(LOCAL_RANK mod device_count)`` (several stages may share one GPU) and makes it the current device,
    before any process group is created (NCCL needs it).

Backends
    Stage-to-stage packets (``--p2p-backend``) go over gloo by default: TCP, robust on slow links, with GPU
    payloads staged through pinned host memory by the transport; ``nccl`` sends them GPU to GPU over NCCL
    groups of their own. The world group (:func:`world_backend`) is plain gloo unless the stages talk NCCL:
    then it is ``cpu:gloo,cuda:nccl``, so that CPU tensors (metrics, settings checks, object broadcasts) keep
    going through gloo while GPU tensors (tied-weight gradients) use NCCL. Data-parallel gradient sync
    (``--dp-backend``, :func:`resolve_dp_backend`): ``auto`` is NCCL on a GPU and gloo otherwise; an NCCL
    replica group is built as ``cpu:gloo,cuda:nccl`` (:func:`group_backend`) so the trainer's CPU reductions
    over the replicas still work on it. NCCL cannot put two ranks of one group on one GPU: where processes
    share GPUs (:func:`ranks_sharing_a_gpu`), ``auto`` takes gloo for the replicas that would, and an explicit
    ``nccl`` (data-parallel, or ``--p2p-backend``, whose world group holds every process) is refused before
    the run starts.

Staging
    :class:`HostStager` copies GPU tensors to pinned host buffers with non-blocking copies on a side CUDA
    stream and returns an event to wait on; on the CPU it hands the tensors back untouched.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch

from aqsgd.errors import SpecError

__all__ = ["DEVICE_CHOICES", "HostStager", "check_backends", "check_p2p_sharing", "gpu_sharing",
           "group_backend", "ranks_sharing_a_gpu",
           "resolve_device", "resolve_dp_backend", "world_backend"]

DEVICE_CHOICES = ("auto", "cpu", "cuda")
_BACKENDS = ("gloo", "nccl")


def resolve_device(spec: str = "auto", *, distributed: bool = False) -> torch.device:
    """The device that ``spec`` (``auto``, ``cpu`` or ``cuda``) names on this machine (see the module
    docstring). ``distributed``: pick ``cuda:(LOCAL_RANK mod device_count)`` and make it current."""
    name = str(spec).strip().lower()
    if name not in DEVICE_CHOICES:
        raise SpecError(f"--device {spec}: not one of {', '.join(DEVICE_CHOICES)}")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        build = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise SpecError(f"--device cuda: torch sees no CUDA device (torch {torch.__version__}, {build}); use "
                        f"--device cpu, or auto to take a GPU only where there is one")
    if not distributed:
        return torch.device("cuda", torch.cuda.current_device())
    raw = os.environ.get("LOCAL_RANK", "0")
    try:
        local_rank = int(raw)
    except ValueError:
        raise SpecError(f"--device {name}: LOCAL_RANK={raw!r} is not an integer") from None
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def resolve_dp_backend(spec: str, device: torch.device, *, shared_gpu: str | None = None) -> str:
    """``gloo`` or ``nccl`` for the data-parallel gradient sync: ``auto`` is NCCL on a GPU, gloo elsewhere and
    where replicas of a stage share a GPU (``shared_gpu`` says which, from :func:`ranks_sharing_a_gpu`: NCCL
    cannot put two ranks of one group on one GPU); an explicit ``nccl`` there is a one-line SpecError."""
    name = str(spec).strip().lower()
    if name == "auto":
        return "nccl" if device.type == "cuda" and shared_gpu is None else "gloo"
    if name not in _BACKENDS:
        raise SpecError(f"--dp-backend {spec}: not one of auto, {', '.join(_BACKENDS)}")
    if name == "nccl" and shared_gpu is not None:
        raise SpecError(f"--dp-backend nccl: {shared_gpu}, and NCCL cannot put two ranks of one group on one "
                        "GPU; use --dp-backend gloo (or auto), or give every process a GPU of its own")
    return name


def gpu_sharing(groups: Sequence[Sequence[int]], name: Callable[[int], str], *, world_size: int,
                device_count: int | None = None) -> str | None:
    """Where two ranks of one of ``groups`` would share a GPU of this machine, said in words
    (``stage 0 replica 0 and stage 0 replica 1 would share GPU 0 (4 processes on 2 GPUs)``), or None. The
    machine holds ``LOCAL_WORLD_SIZE`` processes (all ``world_size`` when unset: the local launcher) and
    ``device_count`` GPUs (default: what torch sees)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    gpus = torch.cuda.device_count() if device_count is None else device_count
    if gpus < 1:
        return None
    pair = ranks_sharing_a_gpu(groups, local_world_size=local, device_count=gpus)
    if pair is None:
        return None
    a, b, gpu = pair
    return (f"{name(a)} and {name(b)} would share GPU {gpu} ({local} processes on {gpus} "
            f"GPU{'s' if gpus > 1 else ''})")


def check_p2p_sharing(p2p_backend: str, device: torch.device, name: Callable[[int], str], *, world_size: int,
                      device_count: int | None = None) -> None:
    """``--p2p-backend nccl`` puts every process in one NCCL group: a one-line SpecError where two would share
    a GPU (see :func:`gpu_sharing`)."""
    if p2p_backend != "nccl" or device.type != "cuda":
        return
    shared = gpu_sharing([range(world_size)], name, world_size=world_size, device_count=device_count)
    if shared is not None:
        raise SpecError(f"--p2p-backend nccl: {shared}, and NCCL cannot put two ranks of one group on one "
                        "GPU; use --p2p-backend gloo, or give every process a GPU of its own")


def ranks_sharing_a_gpu(groups: Sequence[Sequence[int]], *, local_world_size: int, device_count: int
                        ) -> tuple[int, int, int] | None:
    """Two ranks of one of ``groups`` that would compute on the same GPU, and the GPU:
    ``(rank a, rank b, gpu)``, or None. Ranks are placed on machines in blocks of ``local_world_size``
    (torchrun's order; one machine for the local launcher), and each process takes GPU
    ``LOCAL_RANK mod device_count`` (:func:`resolve_device`)."""
    for group in groups:
        seen: dict[tuple[int, int], int] = {}
        for r in group:
            key = (r // local_world_size, (r % local_world_size) % device_count)
            if key in seen:
                return seen[key], r, key[1]
            seen[key] = r
    return None


def check_backends(device: torch.device, p2p_backend: str, dp_backend: str) -> None:
    """One-line :class:`SpecError` when a backend cannot run where the stages compute (NCCL on the CPU, as
    ``--device auto`` gives on a machine without a GPU)."""
    if p2p_backend not in _BACKENDS:
        raise SpecError(f"--p2p-backend {p2p_backend}: not one of {', '.join(_BACKENDS)}")
    if device.type == "cuda":
        resolve_dp_backend(dp_backend, device)
        return
    dp = resolve_dp_backend(dp_backend, device)
    for option, value in (("--p2p-backend", p2p_backend), ("--dp-backend", dp)):
        if value == "nccl":
            raise SpecError(f"{option} nccl: NCCL runs on GPUs only, and the stages compute on {device} (no "
                            f"CUDA device here); use gloo")


def world_backend(device: torch.device, p2p_backend: str = "gloo") -> str:
    """The backend string of the world process group: ``gloo``, or ``cpu:gloo,cuda:nccl`` when the stages of
    a GPU run exchange packets over NCCL."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" and p2p_backend == "nccl" else "gloo"


def group_backend(backend: str) -> str:
    """The backend string of a group whose collectives run on ``backend``: NCCL groups also carry CPU tensors
    through gloo (``cpu:gloo,cuda:nccl``)."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


class HostStager:
    """Copies from a CUDA device to pinned host memory on a side stream, so that they overlap compute.

    :meth:`to_host` orders the copies after the work already queued on the caller's current stream, issues
    them non-blocking and returns the host tensors with an event recorded after them: wait on the event
    (``event.synchronize()``, from any thread) before reading the host tensors. CPU tensors are returned as
    they are, with no event: on the CPU staging is a no-op.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def to_host(self, tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
        """Pinned host copies of the CUDA tensors among ``tensors`` (others as they are) and the event after
        the copies (None when nothing was copied)."""
        if self.stream is None or not any(t.is_cuda for t in tensors):
            return list(tensors), None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        out = []
        with torch.cuda.stream(self.stream):
            for t in tensors:
                if not t.is_cuda:
                    out.append(t)
                    continue
                t.record_stream(self.stream)  # its memory is not reused before the copy has read it
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                out.append(host)
            done = torch.cuda.Event()
            done.record(self.stream)
        return out, done
