"""Per-sample activation caches for AQ-SGD.

AQ-SGD keeps, at every pipeline boundary, a message cache ``m(xi)``: one row per training sample id
``xi`` in ``[0, capacity)``, every row of the same shape (for example ``[seq, hidden]``). The sender
transmits the compressed *difference* between the new activation and ``m(xi)``; both sides then
update ``m(xi)``. Training is only correct if the sender's and the receiver's caches stay
**bit-identical**, which this module guarantees through one contract:

    ``put(ids, rows)`` returns exactly the tensor a later ``get(ids)`` returns
    (same values bit for bit, same dtype, same device).

The stored representation may be coarser than the rows handed in (fp16 storage, low-bit codes), so
schemes must continue with the *return value of* ``put`` rather than with their own ``rows``. Every
backend is deterministic: two caches given the same sequence of puts return bit-identical gets, on
CPU and on CUDA.

Backends
--------
:class:`MemoryCache`
    One preallocated tensor ``[capacity, *row_shape]`` in the storage dtype (fp16 by default, as in
    the AQ-SGD reference implementation; bf16 and fp32 are supported) on ``device``, plus a bool
    visited mask. Allocated at construction, or at the first ``put`` when ``row_shape`` is ``None``.
:class:`DiskCache`
    Rows live in a ``numpy.memmap`` file (created sparse; bf16 is stored as its uint16 bit
    patterns), so RAM stays bounded whatever the capacity; the visited mask is in RAM.
    ``prefetch(ids)`` reads rows on one background thread; ``get`` with the same ids uses that
    result. Consistency rule: ``put`` writes synchronously in the caller's thread and first drops
    every held prefetch whose ids overlap the put, so a ``get`` always sees the latest ``put``.
:class:`LowBitCache`
    The cache itself stored quantized (the reference's "delta-lowbits" idea): each flattened row is
    split into blocks of ``block`` consecutive values with one fp16 scale per block and bit-packed
    ``bits``-bit codes (:func:`aqsgd.compress.quant.quantize_groups`).

Common rules
------------
* ``ids`` is a 1-D integer tensor of unique ids in ``[0, capacity)``; anything else raises
  :class:`CacheError` (ids are never wrapped around). Calls are validated before anything is
  written, so a rejected ``put`` changes nothing. Empty ``ids`` are allowed.
* ``rows`` must have shape ``[len(ids), *row_shape]``.
* ``get`` of an id that was never put (or was forgotten by ``reset``) raises :class:`CacheError`.
* Rows (or codes and scales) live on ``device``; the visited mask of every backend stays in host
  memory (sample ids are host data: no device round trip to tell seen from unseen rows).
* ``save(directory)`` / ``load(directory)`` write and read safetensors files plus a ``meta.json``
  (no pickle), always as host tensors: a cache saved on one device loads on another. ``load``
  restores into an existing cache of the same backend, capacity, row shape and storage format, and
  raises :class:`CacheError` otherwise.
"""

from aqsgd.errors import CacheError
from aqsgd.schemes.cache.base import ActivationCache
from aqsgd.schemes.cache.disk import DiskCache
from aqsgd.schemes.cache.lowbit import LowBitCache
from aqsgd.schemes.cache.memory import MemoryCache

__all__ = [
    "ActivationCache",
    "CacheError",
    "DiskCache",
    "LowBitCache",
    "MemoryCache",
]
