"""The kernel seam: the named operations codecs are built from, with one implementation per backend.

A codec never branches on hardware. It asks :func:`for_tensor` for the kernels of the tensor's device and
calls their operations (or, for an operation only some backends have, :func:`for_operation`); each returns its
result, or None where this backend has no kernel for those arguments (the codec then takes its general,
step-by-step PyTorch path, which every backend's result equals byte for byte).

========== ================= ============================================================================
backend    where             what it is
========== ================= ============================================================================
``eager``  any device        PyTorch operations: the reference every kernel is tested against, and the
                             fallback (:mod:`aqsgd.compress.kernels.eager`)
``numba``  the CPU           compiled loops, one pass per operation (:mod:`aqsgd.compress.kernels.numba`)
``triton`` CUDA              Triton kernels, one read of the input and one write of the output per
                             operation (TopK: radix selection, five reads); they also run on CPU
                             tensors under Triton's interpreter
                             (``TRITON_INTERPRET=1``), which is how the tests check them without a GPU
                             (:mod:`aqsgd.compress.kernels.triton`)
========== ================= ============================================================================

A backend is one module of this package that registers itself at import (:func:`register_backend`: its name,
what makes its kernels for a device, which devices it runs on, those it is the default on); this package
imports its public modules at first use, so adding a backend is adding its file. The default for a device is
the highest-ranked installed backend registered as a default there, else ``eager``: numba then eager on the
CPU, triton then eager on CUDA. A codec built with ``backend="eager"`` (``make_codec(spec, backend=...)``)
uses that one wherever it runs: benchmarks compare backends side by side that way, and tests compare their
packets.

Operations (``x2``: a contiguous fp32 ``[R, K]`` view whose rows' codes fill whole bytes, ``K * bits % 8 ==
0`` (:func:`plan`), and whose scale groups are its columns (``by_col``) or its rows; per-group vectors are
fp32 of length ``K`` or ``R``):

* ``max_abs(x2, by_col)``: each group's max ``|x|`` (NaN where the group holds one);
* ``quantize_pack(x2, inv, by_col, offset, bits, qmax)``: the codes ``trunc(clamp(fma(x, inv, offset), 0,
  qmax))``, each row packed into ``K * bits / 8`` bytes as :func:`~aqsgd.compress.bitpack.pack_bits` packs
  (code ``j`` at bits ``[j * bits, (j + 1) * bits)`` of a little-endian stream): ``uint8 [R, K * bits / 8]``;
  with ``noise=`` (backends whose ``stochastic`` is True: triton, eager) stochastic rounding adds the noise
  the codec drew exactly as its general path draws it (same generator, shape, order) after the fma, so the
  bytes are the general path's;
* ``unpack_dequantize(packed, step, by_col, bits, mul, low)``: ``(code * mul - low) * step`` of each code,
  fp32 ``[R, K]``;
* the same two in one launch each with the scales inside, for a device where every small operation is a
  launch (the Triton backend's): ``max_scales(x2, by_col, stored, qmax, flag)`` finds each group's max
  ``|x|``, stores it as the codec stores its scales (fp16 rounded up, or fp32) into the payload's head and
  returns ``inv``, raising an int32 device ``flag`` where a scale is NaN/Inf; ``scales(s, stored, qmax,
  flag)`` does the same from given (``l2``/``step``) scales; ``unpack_scaled(packed, stored, by_col, bits,
  mul, low, divisor, flag)`` reads the stored scales itself (step: ``scale / divisor`` correctly rounded) and
  flags bad ones. An encode takes them where its checks are deferred (on a GPU: the flag is the deferred
  check), a decode wherever the backend has them;
* ``fwht(x2, signs, c, inverse)``: the Walsh-Hadamard transform of each row (:mod:`aqsgd.compress.hadamard`);
* TopK's selection and packing (:mod:`aqsgd.compress.topk`): ``topk_select(x2, k)`` (positions) and
  ``topk_payload(x2, k, wire, width)`` (the whole payload of a cast, and a device flag for non-finite kept
  values), the Triton backend's; ``topk_rows(keys, k, sampling)`` (the sampled selection of each row),
  ``topk_pack(x2, idx, wire, width)`` and ``topk_encode(x2, k, sampling, wire, width)`` (the payload in one
  pass), the numba backend's;
* the rANS coder of the ``:rc`` stage (:mod:`aqsgd.compress.rans`) on host bytes: ``rans_count``,
  ``rans_encode``, ``rans_decode``, ``rans_pack``, the numba backend's (reached with :func:`for_operation`,
  as no general path exists);
* outlier rows (:class:`~aqsgd.compress.wrappers.OutlierCodec`): ``row_sumsq(x2)`` (equal to PyTorch's sum
  to float rounding only) and ``split_rows(x2, idx, apart)``;
* AQ-SGD's sender and receiver steps against a cache's rows (:class:`RowStore`): ``delta_max_abs``,
  ``delta``, ``delta_encode_update``, ``delta_decode_update``.

What runs where (an operation a backend lacks takes the general path): the numba backend has every
operation but stochastic rounding, ``topk_select``/``topk_payload`` and the outlier rows; the Triton backend
has every operation but the numba backend's TopK ones and the rANS coder; the ``:zstd`` stage and the means
of the ``l2``/``step``/``mean`` scales stay PyTorch's (or the host's) everywhere.

No host synchronisation: no operation reads a value to the host. The decisions a codec makes around them
that need one (is the input finite? does a scale fit its storage dtype?) are *deferred* where such a read
waits for the device (:func:`host_reads_wait`: CUDA): the codec
records them as device flags that the packet carries (:class:`~aqsgd.compress.packet.DeferredCheck`,
:func:`~aqsgd.compress.base.deferring_checks`), read where the packet's bytes are synchronised anyway (the
transport's sender thread, the local runtime's hand-over), raising the same error as the immediate check. A
decode's checks of what it received (scales, indices) are *pending* on CUDA where the caller collects them
(:class:`~aqsgd.compress.packet.PendingChecks`, :func:`~aqsgd.compress.base.collecting_pending_checks`: the
pipeline runner, which reads them at the step's end). On the CPU the checks stay immediate. Still
synchronising on CUDA: the outlier rows' encode (their count sizes the payload) and entropy stages.

Single rounding where it matters: ``fma`` in every backend that can (PyTorch's ``addcmul`` rounds once on the
CPU), so that the packets of all backends on the CPU are byte-identical, and a Triton kernel on a GPU writes
the CPU's bytes. PyTorch's own ``addcmul`` on CUDA rounds twice: an ``eager`` encode on a GPU may differ from
the CPU's in about one code per million (decoding agrees everywhere).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import pkgutil
import threading
from collections.abc import Callable, Iterator

import torch

from aqsgd.compress.kernels.base import STORE_FORMATS, Kernels, RowStore, TopkSampling, index_on, plan

__all__ = ["Backend", "Kernels", "RowStore", "STORE_FORMATS", "TopkSampling", "available", "backends",
           "check_backend", "defaulting_to", "for_device", "for_operation", "for_tensor", "host_reads_wait",
           "index_on", "on_host", "plan", "register_backend", "unregister_backend"]

ANY_DEVICE = "*"  # in ``default_on``: every device type


@dataclasses.dataclass(frozen=True)
class Backend:
    """A registered kernel backend (see :func:`register_backend`)."""

    name: str
    make: Callable[[torch.device], Kernels]
    runs_on: Callable[[torch.device], bool]
    default_on: tuple[str, ...] = ()
    rank: int = 0


_REGISTRY: dict[str, Backend] = {}
_MADE: dict[tuple[str, str], Kernels] = {}  # one Kernels per backend and device type
_OVERRIDES: dict[str, str] = {}  # device type -> backend, inside defaulting_to
_FOUND = {"done": False}
_FINDING = threading.RLock()  # re-entrant: a backend module's import may ask for the registry


def register_backend(name: str, make: Callable[[torch.device], Kernels], *,
                     runs_on: Callable[[torch.device], bool], default_on: tuple[str, ...] = (),
                     rank: int = 0) -> None:
    """Make backend ``name`` known: ``make(device)`` builds its :class:`Kernels` for a device (once per device
    type), ``runs_on(device)`` says whether it runs there (installed, made for that kind of device), and on
    the device types of ``default_on`` (:data:`ANY_DEVICE`: all) it is a default candidate, the higher
    ``rank`` first. A backend module calls this at import; registering a name again replaces it."""
    _REGISTRY[name] = Backend(name, make, runs_on, tuple(default_on), rank)
    _forget(name)


def unregister_backend(name: str) -> None:
    """Forget backend ``name`` (a test's own backend, after the test); nothing where it is not registered."""
    _REGISTRY.pop(name, None)
    _forget(name)


def _forget(name: str) -> None:
    for key in [key for key in _MADE if key[0] == name]:
        del _MADE[key]


def _registry() -> dict[str, Backend]:
    """The registered backends, after importing this package's public modules once (each registers itself;
    under a lock, so that no thread sees a part of them)."""
    if not _FOUND["done"]:
        with _FINDING:
            if not _FOUND["done"]:
                for module in pkgutil.iter_modules(__path__):
                    if not module.name.startswith("_") and module.name != "base":
                        importlib.import_module(f"{__name__}.{module.name}")
                _FOUND["done"] = True
    return _REGISTRY


def backends() -> tuple[str, ...]:
    """The names of the registered backends, sorted."""
    return tuple(sorted(_registry()))


def check_backend(name: str) -> None:
    """ValueError (one line, the valid names) unless ``name`` is a registered backend."""
    if name not in _registry():
        raise ValueError(f"unknown kernel backend {name!r}; valid: {', '.join(backends())}")


def available(name: str, device: torch.device | str = "cpu") -> bool:
    """Whether backend ``name`` runs on ``device`` here (installed, and made for that kind of device)."""
    check_backend(name)
    return _REGISTRY[name].runs_on(torch.device(device))


def _kernels(name: str, device_type: str) -> Kernels:
    made = _MADE.get((name, device_type))
    if made is None:
        made = _MADE[(name, device_type)] = _REGISTRY[name].make(torch.device(device_type))
    return made


def _defaults(device: torch.device) -> list[str]:
    """The backends that may be ``device``'s default, in order of preference (``eager`` last)."""
    override = _OVERRIDES.get(device.type)
    if override is not None:
        return [override, "eager"]
    named = [b for b in _registry().values()
             if (device.type in b.default_on or ANY_DEVICE in b.default_on) and b.name != "eager"]
    return [b.name for b in sorted(named, key=lambda b: -b.rank)] + ["eager"]


def for_device(device: torch.device | str, backend: str | None = None) -> Kernels:
    """The kernels for ``device``: ``backend`` where given (a ValueError where it cannot run there), else the
    device's default (module docstring)."""
    device = torch.device(device)
    if backend is not None:
        if not available(backend, device):
            raise ValueError(f"the {backend} kernels do not run on {device.type} here")
        return _kernels(backend, device.type)
    for name in _defaults(device):
        if name in _REGISTRY and _REGISTRY[name].runs_on(device):
            return _kernels(name, device.type)
    return _kernels("eager", device.type)


def for_tensor(x: torch.Tensor, backend: str | None = None) -> Kernels:
    """The kernels for ``x``'s device (see :func:`for_device`)."""
    return for_device(x.device, backend)


def for_operation(operation: str, device: torch.device | str = "cpu") -> Kernels | None:
    """The kernels of a backend that runs on ``device`` and has ``operation`` (overrides the base class's),
    the device's default first, then the others by rank; None where none has it. For an operation with no
    general path (the rANS coder), which must run whatever backend a codec or test names."""
    device = torch.device(device)
    order = _defaults(device) + [b.name for b in sorted(_registry().values(), key=lambda b: -b.rank)]
    for name in dict.fromkeys(order):
        if name in _REGISTRY and _REGISTRY[name].runs_on(device):
            ops = _kernels(name, device.type)
            if ops.has(operation):
                return ops
    return None


@contextlib.contextmanager
def defaulting_to(backend: str, device_type: str = "cpu") -> Iterator[None]:
    """Within the block, ``device_type`` tensors take the ``backend`` kernels wherever no codec names its own:
    for tests that compare backends through code that builds its own codecs (caches, schemes). Codecs name a
    backend with :meth:`~aqsgd.compress.base.Codec.using`; nothing in the library calls this."""
    check_backend(backend)
    saved = _OVERRIDES.get(device_type)
    _OVERRIDES[device_type] = backend
    try:
        yield
    finally:
        if saved is None:
            _OVERRIDES.pop(device_type, None)
        else:
            _OVERRIDES[device_type] = saved


def on_host(device: torch.device | str) -> bool:
    """Whether a tensor on ``device`` is in host memory (numpy reads it in place, reading a value costs
    nothing): the CPU."""
    return torch.device(device).type == "cpu"


def host_reads_wait(device: torch.device | str) -> bool:
    """Whether reading a value of a tensor on ``device`` to the host waits for the device's queue (CUDA: a
    synchronisation): where codecs defer their checks by default
    (:func:`aqsgd.compress.base.deferring_checks`)."""
    return torch.device(device).type == "cuda"
