"""The kernel seam: the named operations codecs are built from, with one implementation per backend.

A codec never branches on hardware. It asks :func:`for_tensor` for the kernels of the tensor's device and
calls their operations; each returns its result, or None where this backend has no kernel for those arguments
(the codec then takes its general, step-by-step PyTorch path, which every backend's result equals byte for
byte).

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

The default for a device is the first of its backends that is installed: numba then eager on the CPU,
triton then eager on CUDA. A codec built with ``backend="eager"`` (``make_codec(spec, backend=...)``) uses
that one wherever it runs: benchmarks compare backends side by side that way, and tests compare their packets.

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
* TopK's selection and packing: on torch tensors ``topk_select(x2, k)`` (positions) and ``topk_payload(x2,
  k, wire, width)`` (the whole payload of a cast, and a device flag for non-finite kept values), the Triton
  backend's; on numpy arrays ``topk_rows``, ``topk_pack``, ``topk_encode``, the numba backend's
  (:mod:`aqsgd.compress.topk`);
* outlier rows (:class:`~aqsgd.compress.wrappers.OutlierCodec`): ``row_sumsq(x2)`` (equal to PyTorch's sum
  to float rounding only) and ``split_rows(x2, idx, apart)``;
* AQ-SGD's sender and receiver steps against a cache's rows (:class:`RowStore`): ``delta_max_abs``,
  ``delta``, ``delta_encode_update``, ``delta_decode_update``.

What runs where (an operation a backend lacks takes the general path): the numba backend has every
operation but stochastic rounding, ``topk_select``/``topk_payload`` and the outlier rows; the Triton backend
has every operation but the numpy TopK ones (its TopK works on torch tensors, so on the GPU); entropy stages
(``:rc``, ``:zstd``) and the means of the ``l2``/``step``/``mean`` scales stay PyTorch's (or the host's)
everywhere.

No host synchronisation: no operation reads a value to the host. The decisions a codec makes around them
that need one (is the input finite? does a scale fit its storage dtype?) are *deferred* on CUDA: the codec
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
import functools
from collections.abc import Iterator

import torch

from aqsgd.compress.kernels.base import BACKENDS, STORE_FORMATS, Kernels, RowStore, index_on, plan

__all__ = ["BACKENDS", "Kernels", "RowStore", "available", "defaulting_to", "for_device", "for_tensor",
           "index_on", "plan", "STORE_FORMATS"]

_DEFAULTS: dict[str, tuple[str, ...]] = {"cpu": ("numba", "eager"), "cuda": ("triton", "eager")}


def available(name: str, device: torch.device | str = "cpu") -> bool:
    """Whether backend ``name`` runs on ``device`` here (installed, and made for that kind of device)."""
    device = torch.device(device)
    if name == "eager":
        return True
    if name == "numba":
        from aqsgd.compress.kernels import numba as backend

        return device.type == "cpu" and backend.available()
    if name == "triton":
        from aqsgd.compress.kernels import triton as backend

        return backend.available(device)
    raise ValueError(f"unknown kernel backend {name!r}; valid: {', '.join(BACKENDS)}")


@functools.lru_cache(maxsize=None)
def _kernels(name: str, device_type: str) -> Kernels:
    device = torch.device(device_type)
    if name == "eager":
        from aqsgd.compress.kernels.eager import EagerKernels

        return EagerKernels(device)
    if name == "numba":
        from aqsgd.compress.kernels.numba import NumbaKernels

        return NumbaKernels(device)
    from aqsgd.compress.kernels.triton import TritonKernels

    return TritonKernels(device)


def for_device(device: torch.device | str, backend: str | None = None) -> Kernels:
    """The kernels for ``device``: ``backend`` where given (a ValueError where it cannot run there), else the
    device's default (module docstring)."""
    device = torch.device(device)
    if backend is not None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown kernel backend {backend!r}; valid: {', '.join(BACKENDS)}")
        if not available(backend, device):
            raise ValueError(f"the {backend} kernels do not run on {device.type} here")
        return _kernels(backend, device.type)
    for name in _DEFAULTS.get(device.type, ("eager",)):
        if available(name, device):
            return _kernels(name, device.type)
    return _kernels("eager", device.type)


@contextlib.contextmanager
def defaulting_to(backend: str, device_type: str = "cpu") -> Iterator[None]:
    """Within the block, ``device_type`` tensors take the ``backend`` kernels wherever no codec names its own:
    for tests that compare backends through code that builds its own codecs (caches, schemes). Codecs name a
    backend with :meth:`~aqsgd.compress.base.Codec.using`; nothing in the library calls this."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; valid: {', '.join(BACKENDS)}")
    saved = _DEFAULTS.get(device_type)
    _DEFAULTS[device_type] = (backend, "eager")
    try:
        yield
    finally:
        if saved is None:
            _DEFAULTS.pop(device_type, None)
        else:
            _DEFAULTS[device_type] = saved


def for_tensor(x: torch.Tensor, backend: str | None = None) -> Kernels:
    """The kernels for ``x``'s device (see :func:`for_device`)."""
    return for_device(x.device, backend)
