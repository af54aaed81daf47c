"""``aqsgd bench codecs``: encode / decode / round-trip throughput of each codec against ``x.clone()``.

Throughput is bytes of the fp32 input per second. ``clone`` (a plain copy of the same tensor, measured in
the same run, interleaved with the codecs) is the memory-bandwidth reference; ``encode_vs_clone`` is
``encode_gbps / clone_gbps``. Medians over repeats after warm-up. A clone, a decode and most encodes allocate
their result; on a CPU ``aqsgd bench codecs`` times them with the allocator held warm
(:func:`~aqsgd.bench.timing.warm_allocator`), since whether glibc maps fresh pages for a 12.6 MB result
depends on the process's history (the same clone was timed at 0.5 ms and at 3.8 ms, the first touch of
3,072 pages timed as the copy); each row records the page faults per timed call. The clone is timed anew
beside every codec: where its rate varies more than :data:`CLONE_SPREAD_LIMIT` times between codecs, other
work shared the machine (or the allocator was not held warm), and the ratios read too low for some codecs and
not others; :func:`clone_spread_warning` says so, as a logged warning and under ``warnings`` in the JSON.

Where the device's kernels are compiled ones (:mod:`aqsgd.compress.kernels`: numba on the CPU, Triton on
CUDA), every codec is also timed with the ``eager`` backend, in the same interleaved rounds
(``eager_encode_gbps``, ``eager_decode_gbps``), so the kernels' gain is a ratio measured side by side; a codec
that never takes a kernel shows ~1.0x there.

A subspace codec (``pca<r>``) encodes here as at evaluation, its basis fixed. Training's sender also adds
each message's rows to the next basis's estimate and refreshes the basis every N messages:
``learning_encode_gbps`` is its encode with both (the rows' sum timed in the same rounds, a refresh's median
over copies of the state divided by N).

On CUDA each codec's encode and decode are also profiled once after the timing (``torch.profiler``): how many
device operations (kernels, copies, fills) one call launches and their summed device time in microseconds
(``encode_kernels``, ``encode_kernel_us``, ``decode_kernels``, ``decode_kernel_us``). Against the call's wall
time this says whether the device or the host's launching sets the rate; the slowest three by name with their
microseconds (``encode_slowest``, ``decode_slowest``) say which kernel to look at. Also on CUDA: each call's
rate when 20 calls are queued back to back before one synchronisation (``encode_queued_gbps``,
``decode_queued_gbps``: what a training step sees, where the host runs ahead of the device), and what one
launch costs (:func:`launch_costs`: a synchronisation, a one-value PyTorch operation, a one-value Triton
kernel, each alone and queued).
"""

from __future__ import annotations

import json
import logging
import platform
import statistics
import time
from copy import deepcopy
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch

from aqsgd.bench.timing import interleaved_medians, minor_faults, sync
from aqsgd.compress import Codec, kernels, make_codec
from aqsgd.compress.subspace import Subspace, SubspaceCodec

__all__ = ["CLONE_SPREAD_LIMIT", "DEFAULT_CODECS", "CodecRow", "bench_codecs", "clone_spread_warning",
           "codec_for", "launch_costs", "machine_description", "queued_seconds", "refresh_seconds"]

log = logging.getLogger(__name__)

# how much the clone rate may vary between the codecs of one run (max / min of their clone medians) before
# the ratios against it are said to be unreliable: on an idle machine it varies by a few percent
CLONE_SPREAD_LIMIT = 2.0

DEFAULT_CODECS = (
    "fp16", "bf16", "q8", "q4", "q3", "q2", "q1", "q2:token", "q4:block64", "q2:stochastic", "q4:l2",
    "topk0.1", "topk0.1+q8",
)


@dataclass
class CodecRow:
    codec: str
    device: str
    shape: list[int]
    dtype: str
    encode_gbps: float
    decode_gbps: float
    roundtrip_gbps: float
    clone_gbps: float
    encode_vs_clone: float
    decode_vs_clone: float
    wire_bytes: int
    ratio: float
    max_abs_err: float
    rel_err: float
    eager_encode_gbps: float | None = None  # the same codec with the fused kernels off (None: they were off)
    eager_decode_gbps: float | None = None
    encode_queued_gbps: float | None = None  # 20 calls queued before one synchronisation (CUDA only)
    decode_queued_gbps: float | None = None
    encode_kernels: int | None = None  # device operations per call and their device time (CUDA only)
    encode_kernel_us: float | None = None
    decode_kernels: int | None = None
    decode_kernel_us: float | None = None
    encode_slowest: list | None = None  # a call's longest device operations: [[name, us, calls], ...]
    decode_slowest: list | None = None
    minor_faults_per_call: float | None = None  # pages first touched per timed call (the allocator's cost)
    # a subspace codec's encode as training's sender runs it (None: other codecs): the encode, adding the
    # rows to the next basis's estimate (``Subspace.observe``) and a refresh every N messages, amortized
    learning_encode_gbps: float | None = None


def versions() -> dict[str, str | None]:
    """torch's, Triton's and numba's versions here (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {"torch": torch.__version__}
    for name in ("triton", "numba"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def machine_description(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def bench_codecs(specs: Sequence[str] = DEFAULT_CODECS, *, shape: Sequence[int] = (8, 512, 768),
                 device: str | torch.device = "cpu", repeats: int = 15, warmup: int = 3,
                 seed: int = 0) -> list[CodecRow]:
    """Measure every codec on one activation-like tensor (Gaussian with a few large outlier channels); on a
    CPU with the fused kernels on, each codec with them off too (module docstring). Each row also says how
    many pages the timed calls touched first (``minor_faults_per_call``): run inside
    :func:`~aqsgd.bench.timing.warm_allocator` (``aqsgd bench codecs`` does), it is about zero, and the
    rates are the copies' and kernels', not the page faults of fresh allocations."""
    device = torch.device(device)
    compare_eager = kernels.for_device(device).name != "eager"
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tuple(shape), generator=g, device=device)
    x[..., :: max(1, shape[-1] // 8)] *= 8.0  # a few outlier channels, as transformer activations have
    nbytes = x.numel() * x.element_size()
    rows = []
    for spec in specs:
        codec = codec_for(spec, x)
        packet = codec.encode(x, generator=g)
        calls = {
            "clone": lambda: x.clone(),
            "encode": lambda: codec.encode(x, generator=g),
            "decode": lambda: codec.decode(packet),
        }
        if compare_eager:
            eager = codec_for(spec, x, backend="eager", like=codec)
            calls["eager_encode"] = lambda: eager.encode(x, generator=g)
            calls["eager_decode"] = lambda: eager.decode(packet)
        state = codec.state if isinstance(codec, SubspaceCodec) else None
        if state is not None:  # training's sender adds every message's rows to the next basis's estimate
            calls["observe"] = lambda: state.observe(x)
        faults = minor_faults()
        t = interleaved_medians(calls, device=device, warmup=warmup, repeats=repeats)
        faults = (minor_faults() - faults) / (len(calls) * (warmup + repeats))
        learning = None
        if state is not None:
            learning = nbytes / (t["encode"] + t["observe"] + refresh_seconds(state, device)) / 1e9
        queued = ({k: nbytes / queued_seconds(calls[k], device) / 1e9 for k in ("encode", "decode")}
                  if device.type == "cuda" else {"encode": None, "decode": None})
        enc_ops = device_operations(calls["encode"], device) or (None, None, None)
        dec_ops = device_operations(calls["decode"], device) or (None, None, None)
        y = codec.decode(packet)
        clone = nbytes / t["clone"] / 1e9
        enc, dec = nbytes / t["encode"] / 1e9, nbytes / t["decode"] / 1e9
        rows.append(CodecRow(
            codec=codec.spec, device=str(device), shape=list(shape), dtype=str(x.dtype).replace("torch.", ""),
            encode_gbps=enc, decode_gbps=dec, roundtrip_gbps=nbytes / (t["encode"] + t["decode"]) / 1e9,
            clone_gbps=clone, encode_vs_clone=enc / clone, decode_vs_clone=dec / clone,
            wire_bytes=packet.nbytes, ratio=nbytes / packet.nbytes,
            max_abs_err=float((y - x).abs().max()), rel_err=float((y - x).norm() / x.norm()),
            eager_encode_gbps=nbytes / t["eager_encode"] / 1e9 if compare_eager else None,
            eager_decode_gbps=nbytes / t["eager_decode"] / 1e9 if compare_eager else None,
            encode_queued_gbps=queued["encode"], decode_queued_gbps=queued["decode"],
            encode_kernels=enc_ops[0], encode_kernel_us=enc_ops[1],
            decode_kernels=dec_ops[0], decode_kernel_us=dec_ops[1],
            encode_slowest=enc_ops[2], decode_slowest=dec_ops[2], minor_faults_per_call=faults,
            learning_encode_gbps=learning,
        ))
    warning = clone_spread_warning(rows)
    if warning:
        log.warning(warning)
    return rows


def refresh_seconds(state: Subspace, device: torch.device, repeats: int = 3) -> float:
    """A refresh of ``state``'s basis (:meth:`~aqsgd.compress.subspace.Subspace.renew`, from the rows
    observed), per compressed message: the median of ``repeats`` refreshes of copies of the state, over its
    ``refresh`` messages between two (0 where it never refreshes)."""
    if state.refresh <= 0:
        return 0.0
    times = []
    for _ in range(repeats):
        copy = deepcopy(state)
        sync(device)
        t0 = time.perf_counter()
        copy.renew()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / state.refresh


def codec_for(spec: str, x: torch.Tensor, *, backend: str | None = None, like: Codec | None = None) -> Codec:
    """The codec of ``spec``; one with a subspace stage (``pca<r>``) bound to a basis estimated from ``x``
    itself (as a boundary's warm-up would; ``like``: share that codec's basis), since it encodes only with
    a basis. Its state does not learn in the encodes timed (``learning`` off, as at evaluation): what
    training's sender adds to each message, the rows' sum and the refreshes, is timed beside them
    (``CodecRow.learning_encode_gbps``)."""
    codec = make_codec(spec, backend=backend)
    if not isinstance(codec, SubspaceCodec):
        return codec
    if isinstance(like, SubspaceCodec) and like.state is not None:
        return codec.bound(like.state)
    state = codec.new_state()
    state.observe(x)
    state.renew()
    return codec.bound(state)


def clone_spread_warning(rows: Sequence[CodecRow], limit: float = CLONE_SPREAD_LIMIT) -> str | None:
    """A one-line warning where the clone rate measured beside the codecs varied more than ``limit`` times
    between them (the largest of the rows' clone medians over the smallest), else None. Each codec's ratios
    are against the clone of its own rounds, so a machine busy with other work during some codecs' rounds
    makes their ratios read low, and the table's comparison between codecs unreliable."""
    if len(rows) < 2:
        return None
    slow = min(rows, key=lambda r: r.clone_gbps)
    fast = max(rows, key=lambda r: r.clone_gbps)
    spread = fast.clone_gbps / slow.clone_gbps if slow.clone_gbps > 0 else float("inf")
    if spread <= limit:
        return None
    return (f"the clone rate varied {spread:.1f}x between codecs ({slow.clone_gbps:.2f} GB/s beside "
            f"{slow.codec}, {fast.clone_gbps:.2f} GB/s beside {fast.codec}): the machine was busy; the "
            "ratios are unreliable")


def queued_seconds(fn, device: torch.device, *, calls: int = 20, rounds: int = 5) -> float:
    """Seconds per call of ``fn`` with ``calls`` calls queued before one synchronisation, the median of
    ``rounds`` rounds: where the host's launching is slower than the device's work, the host's time."""
    samples = []
    for _ in range(rounds):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(device)
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples)


def launch_costs(device: torch.device, *, repeats: int = 200) -> dict[str, float] | None:
    """Microseconds per call, medians of ``repeats``: a synchronisation alone (``sync``); a one-value PyTorch
    ``add_``, a one-value allocation and a launch of a one-value Triton kernel (``touch``), each between two
    synchronisations and (``*_queued``) 20 queued before one; the Triton launch also as the codecs launch
    (``enable_fp_fusion=False``). None where the Triton kernels do not run on ``device``."""
    from aqsgd.compress.kernels import triton as triton_kernels

    if not triton_kernels.available(device):
        return None
    from aqsgd.bench._launch_jit import touch

    x = torch.zeros(16, device=device)
    calls = {
        "sync": lambda: None,
        "torch_add": lambda: x.add_(1.0),
        "torch_empty": lambda: torch.empty(1, device=device),
        "triton": lambda: touch[(1,)](x, 1, BLOCK=16),
        "triton_unfused": lambda: touch[(1,)](x, 1, BLOCK=16, enable_fp_fusion=False),
    }
    medians = interleaved_medians(calls, device=device, warmup=5, repeats=repeats)
    out = {k: 1e6 * v for k, v in medians.items()}
    for name in ("torch_add", "triton", "triton_unfused"):
        out[f"{name}_queued"] = 1e6 * queued_seconds(calls[name], device, rounds=max(3, repeats // 20))
    return out


def device_operations(fn, device: torch.device) -> tuple[int, float, list] | None:
    """``(operations, microseconds, slowest)``: the device operations one call of ``fn`` launches on a CUDA
    device, their summed device time, and the :func:`slowest` of them by name, from ``torch.profiler``; None
    elsewhere."""
    if device.type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    ops = [(e.name, float(getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0)))
           for e in prof.events() if e.device_type == DeviceType.CUDA]
    return len(ops), sum(us for _, us in ops), slowest(ops)


def slowest(ops: Sequence[tuple[str, float]], n: int = 3) -> list[list]:
    """The ``n`` names with the most device time, ``[[name, microseconds, calls], ...]``, longest first: the
    operations of one name (a kernel launched once per pass) summed."""
    total: dict[str, list] = {}
    for name, us in ops:
        entry = total.setdefault(name, [name, 0.0, 0])
        entry[1] += us
        entry[2] += 1
    return sorted(total.values(), key=lambda e: -e[1])[:n]


def write_json(rows: list[CodecRow], path: str | Path, *, device: torch.device, command: str,
               launch_us: dict[str, float] | None = None, warm_allocator: bool | None = None) -> None:
    out = {
        "benchmark": "codecs",
        "command": command,
        "machine": machine_description(device),
        "versions": versions(),
        # whether glibc kept the timed calls' allocations on pages already mapped (timing.warm_allocator)
        "warm_allocator": warm_allocator,
        "rows": [asdict(r) for r in rows],
        "warnings": [w for w in (clone_spread_warning(rows),) if w],  # (empty: none)
        **({"launch_us": launch_us} if launch_us else {}),
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1))
