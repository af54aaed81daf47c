"""A kernel that does next to nothing, for ``aqsgd bench codecs``'s launch costs (:func:`aqsgd.bench.codecs.
launch_costs`): imported at first use, so that ``TRITON_INTERPRET`` set before then takes effect and importing
aqsgd does not import Triton. No ``from __future__ import annotations``: Triton reads ``tl.constexpr``
annotations as objects."""

import triton
import triton.language as tl


@triton.jit
def touch(x_ptr, n, BLOCK: tl.constexpr):
    """Adds 1 to the first ``n`` values (``n`` <= BLOCK): one program, one load and one store."""
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n, other=0.0) + 1.0, mask=i < n)
