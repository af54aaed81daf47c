"""Gradient synchronization inside one stage's data-parallel group, optionally compressed.

One interface, :class:`GradSync`: ``sync(params, compress=...)`` replaces every parameter's ``.grad`` with the
average over the group's replicas (exactly, or as a compressed estimate) and returns the bytes this rank
sent. Three implementations, chosen by a spec string (:func:`make_grad_sync`):

``allreduce``
    fp32 all-reduce (sum, then divide by ``D``): the baseline.

``q<b>[:block<N>]`` (e.g. ``q8``, ``q4:block256``; b = 1..8, default block 64)
    Quantized all-reduce with error feedback in both phases, on ``torch.distributed`` collectives; nothing
    is ever exchanged in full precision. Per bucket of ``n`` values (zero-padded to ``D`` equal chunks of
    ``c`` values, ``c`` a multiple of the block so no scale group straddles two chunks):

    1. *compressed reduce-scatter*: ``v = g + e1``; every chunk of ``v`` is quantized (one fp16 scale per
       block, bit-packed codes); ``e1 = v - Q(v)``; one ``all_to_all_single`` of uint8 payloads sends chunk
       ``j`` to group rank ``j``, so rank ``r`` receives every replica's quantized chunk ``r``;
    2. rank ``r`` decodes them, sums in replica order and divides by ``D``: ``s = mean_j Q(v_j)[r]``;
       ``w = s + e2``; ``e2 = w - Q(w)`` (a second error-feedback buffer, one chunk long);
    3. *compressed all-gather*: ``all_gather_single`` of the uint8 payloads ``Q(w)``; every rank decodes
       all ``D`` chunks from the same bytes, so all replicas end with bit-identical gradients.

    gloo in torch 2.13 implements ``all_to_all_single`` and ``all_gather_single`` (checked by running
    them; ``reduce_scatter`` exists too but only reduces by value, which would need the decoded fp32 data),
    so phase 1 is a true all-to-all of compressed bytes, not an all-gather of everything.

``powersgd[:rank<R>]`` (default rank 1)
    PyTorch's own ``powerSGD_hook`` (with ``PowerSGDState``: error feedback and warm start on), driven
    without DistributedDataParallel: the hook only calls ``buffer()``, ``index()``, ``is_last()`` and
    ``gradients()`` on its bucket (and ``parameters()`` is there for completeness), so
    :class:`HookBucket` provides them over our own flat bucket. ``dist.GradBucket`` itself has no Python
    constructor. Warm-up is decided here, not by the state's iteration counter (see below).

``topk<P>%[:q<b>][:block<N>]`` (default q8, block 64; e.g. ``topk3%:q2``)
    Each rank sends the P % of its bucket largest in magnitude, after adding its error buffer: int32 indices
    and the values quantized (:class:`TopKSync`), in one all-gather; the rest stays in the error buffer.
    Meant for DiLoCo's pseudo-gradients (``diloco:50:topk3%:q2``, SparseLoCo's recipe), usable every step.

``diloco:<H>[:...]``
    Not a gradient sync: outer steps every H steps (:mod:`aqsgd.parallel.outer`), whose pseudo-gradients are
    averaged by one of the above; ``fragments<N>``, ``delay<T>`` and ``mix<F>`` stream them (Streaming
    DiLoCo: the stage's parameters synced in N fragments in turn, overlapped with T steps of compute).

Warm-up and phases
    ``sync(..., compress=False)`` runs the fp32 all-reduce for every method and leaves the error-feedback
    state untouched (the caller passes it from the training phase; no global flag).

Buckets
    Parameters are grouped, in the order given, into buckets of about ``bucket_mb`` MB of fp32 gradients
    (a parameter never splits; one larger than the limit has a bucket of its own); each bucket's gradients
    are flattened into one fp32 buffer. The plan is rebuilt if the parameter list changes.

Overlap
    Every bucket's first collective is launched asynchronously before any is waited for, so the
    communication of bucket ``i`` overlaps the encoding of bucket ``i+1`` (and, for ``q<b>``, the
    all-gather of bucket ``i`` overlaps the decode/re-encode of bucket ``i+1``). PowerSGD is the exception:
    its buckets run one after another (see :meth:`PowerSGDSync._sync`). Synchronization starts after
    the stage's last backward (the engine calls it then); it does *not* overlap the backward pass itself.
    In a 1F1B pipeline a stage's parameters receive gradient contributions from every micro-batch up to
    its last backward, so per-bucket early launch would only hide the last micro-batch's backward.

Byte accounting (``last_bytes``, the return value of ``sync``)
    Bytes this rank puts on the wire under the bandwidth-optimal algorithm of each collective: an
    all-reduce of ``B`` bytes costs ``2 (D-1) B / D`` (ring: reduce-scatter + all-gather; rounded up);
    ``all_to_all`` of equal chunks and ``all_gather`` cost ``(D-1)`` chunk payloads each. The quantized
    counts are exact payload bytes (codes + fp16 scales); gloo's own framing is not counted.
    ``last_raw_bytes`` is what the fp32 all-reduce of the same buckets would have cost.

Link emulation
    With ``link`` given, ``sync`` does not return before ``link.tx_time(last_bytes) + k * latency`` seconds
    after it started (``k`` = sequential collective rounds: 1 for all-reduce, 2 for ``q<b>``, 3 for
    PowerSGD): one full-duplex link of that bandwidth per rank, transfers starting when ``sync`` starts.

Devices
    ``device`` is where the flat buckets, the codec work and the error-feedback state live: the GPU when the
    group runs NCCL, the CPU for gloo (gloo collectives other than all-reduce and broadcast take CPU tensors
    only). Gradients on another device are copied into the buckets and the averages copied back, so a GPU
    stage may sync over gloo (through host memory) and every method works on either backend.

Checkpoints
    ``state_dict()`` holds only tensors (error buffers, PowerSGD's P/Q memories and iteration counter), the
    live ones, not copies (as ``nn.Module.state_dict`` does); ``load_state_dict`` restores copies of them on
    ``device``, wherever they were saved.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import logging
import math
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from aqsgd.comm.link import LinkSpec
from aqsgd.compress.bitpack import packed_nbytes
from aqsgd.compress.packet import Packet
from aqsgd.compress.quant import QuantCodec
from aqsgd.errors import SpecError

__all__ = [
    "GRAD_SYNC_HELP",
    "AllReduceSync",
    "GradSync",
    "GradSyncSpec",
    "HookBucket",
    "PowerSGDSync",
    "QuantizedSync",
    "TopKSync",
    "allreduce_bytes",
    "make_grad_sync",
    "parse_grad_sync",
]

log = logging.getLogger(__name__)

GRAD_SYNC_HELP = ("grad sync spec: allreduce | q<bits 1-8>[:block<N>] | powersgd[:rank<R>] | "
                  "topk<P>%[:q<bits>][:block<N>] | diloco:<H>[:lr<F>][:momentum<F>][:fragments<N>]"
                  "[:delay<T>][:mix<F>][:<one of those but powersgd>] (e.g. q8, q4:block256, powersgd:rank4, "
                  "topk3%:q2, diloco:50:q8, diloco:50:topk3%:q2, diloco:50:fragments2:delay5:q8)")
DEFAULT_BUCKET_MB = 25.0
DEFAULT_BLOCK = 64


def allreduce_bytes(nbytes: int, world: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``nbytes``: ``2 (D-1) nbytes / D``, rounded up."""
    return -(-2 * (world - 1) * nbytes // world) if world > 1 else 0


# -- spec -------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GradSyncSpec:
    """A parsed grad-sync spec: ``kind`` is ``allreduce``, ``quant`` or ``powersgd``."""

    kind: str
    bits: int = 0
    fraction: float = 0.0  # topk: the share of each bucket's values sent
    block: int = DEFAULT_BLOCK
    rank: int = 1
    # diloco: the outer step every ``every`` steps, its SGD's lr and (Nesterov) momentum, and the spec of the
    # pseudo-gradients' averaging (allreduce or quant)
    every: int = 0
    outer_lr: float = 0.7
    momentum: float = 0.9
    average: str = "allreduce"
    # streaming (diloco): the stage's parameters in ``fragments`` synced in turn, each result applied
    # ``delay`` steps after its sync began (0: at once), mixed with the weights trained meanwhile as
    # ``mix * local + (1 - mix) * outer``
    fragments: int = 1
    delay: int = 0
    mix: float = 0.5


def _spec_error(spec: str, why: str) -> SpecError:
    return SpecError(f"invalid grad sync spec {spec!r}: {why}. Valid: {GRAD_SYNC_HELP}")


def parse_grad_sync(spec: str) -> GradSyncSpec:
    """Parse and validate a spec string (no process group needed); raises :class:`SpecError`."""
    if not isinstance(spec, str) or not spec.strip():
        raise _spec_error(str(spec), "empty")
    head, *opts = spec.strip().split(":")
    if head in ("allreduce", "none", "fp32"):
        if opts:
            raise _spec_error(spec, f"{head} takes no options")
        return GradSyncSpec("allreduce")
    if m := re.fullmatch(r"q(\d+)", head):
        bits = int(m.group(1))
        if not 1 <= bits <= 8:
            raise _spec_error(spec, f"bits must be 1..8, got {bits}")
        block = DEFAULT_BLOCK
        if len(opts) > 1:
            raise _spec_error(spec, "at most one option (block<N>)")
        for opt in opts:
            if not (b := re.fullmatch(r"block(\d+)", opt)) or int(b.group(1)) < 1:
                raise _spec_error(spec, f"unknown option {opt!r} (quantized gradients take block<N>, N >= 1)")
            block = int(b.group(1))
        return GradSyncSpec("quant", bits=bits, block=block)
    if head == "diloco":
        return _parse_diloco(spec, opts)
    if m := re.fullmatch(r"topk(\d+(?:\.\d+)?)%", head):
        percent = float(m.group(1))
        if not 0 < percent <= 100:
            raise _spec_error(spec, f"the share kept must be in (0, 100] %, got {m.group(1)}%")
        bits, block = 8, DEFAULT_BLOCK
        for opt in opts:
            if q := re.fullmatch(r"q(\d+)", opt):
                bits = int(q.group(1))
                if not 1 <= bits <= 8:
                    raise _spec_error(spec, f"bits must be 1..8, got {bits}")
            elif (b := re.fullmatch(r"block(\d+)", opt)) and int(b.group(1)) >= 1:
                block = int(b.group(1))
            else:
                raise _spec_error(spec, f"unknown option {opt!r} (top-k takes q<bits> and block<N>)")
        return GradSyncSpec("topk", bits=bits, block=block, fraction=percent / 100)
    if head == "powersgd":
        rank = 1
        if len(opts) > 1:
            raise _spec_error(spec, "at most one option (rank<R>)")
        for opt in opts:
            if not (r := re.fullmatch(r"rank(\d+)", opt)) or int(r.group(1)) < 1:
                raise _spec_error(spec, f"unknown option {opt!r} (powersgd takes rank<R>, R >= 1)")
            rank = int(r.group(1))
        return GradSyncSpec("powersgd", rank=rank)
    raise _spec_error(spec, f"unknown method {head!r}")


def _parse_diloco(spec: str, opts: list[str]) -> GradSyncSpec:
    """``diloco:<H>[:lr<F>][:momentum<F>][:fragments<N>][:delay<T>][:mix<F>][:<averaging>]``: H first, then
    the outer step's options in any order, then how the pseudo-gradients are averaged (allreduce, the default,
    q<b>[:block<N>] or topk<P>%[:q<b>])."""
    if not opts or not re.fullmatch(r"-?\d+", opts[0]):
        raise _spec_error(spec, "diloco needs the outer step's interval H in steps first (diloco:50)")
    every = int(opts[0])
    if every < 1:
        raise _spec_error(spec, f"the outer step's interval H must be at least 1 step, got {every}")
    values: dict[str, float] = {}
    rest = opts[1:]
    while rest and (m := re.fullmatch(r"(lr|momentum|fragments|delay|mix)(.*)", rest[0])):
        name, text = m.groups()
        try:
            value = int(text) if name in ("fragments", "delay") else float(text)
        except ValueError:
            kind = "a whole number" if name in ("fragments", "delay") else "a number"
            raise _spec_error(spec, f"{rest[0]!r}: {name} takes {kind}") from None
        if name in values:
            raise _spec_error(spec, f"{name} given twice")
        values[name] = value
        rest = rest[1:]
    lr = values.get("lr", GradSyncSpec.outer_lr)
    momentum = values.get("momentum", GradSyncSpec.momentum)
    fragments, delay = int(values.get("fragments", 1)), int(values.get("delay", 0))
    mix = values.get("mix", GradSyncSpec.mix)
    if not (lr > 0 and lr < float("inf")):
        raise _spec_error(spec, f"the outer learning rate must be positive, got {lr:g}")
    if not 0 <= momentum < 1:
        raise _spec_error(spec, f"the outer momentum must be in [0, 1), got {momentum:g}")
    if not 1 <= fragments <= every:
        raise _spec_error(spec, f"fragments must be 1..H ({every}), got {fragments}")
    if not 0 <= delay < every // fragments:
        raise _spec_error(spec, f"the delay must be 0..{every // fragments - 1} steps (under H / fragments: "
                                f"a fragment's result lands before the next fragment's sync), got {delay}")
    if "mix" in values and delay == 0:
        raise _spec_error(spec, "mix weighs the steps taken during a delayed sync: it needs delay<T>, T >= 1")
    if not 0 <= mix < 1:
        raise _spec_error(spec, f"mix (the local weights' share) must be in [0, 1), got {mix:g}")
    average = ":".join(rest) or "allreduce"
    try:
        inner = parse_grad_sync(average)
    except SpecError:
        inner = None
    if inner is None or inner.kind not in ("allreduce", "quant", "topk"):
        raise _spec_error(spec, f"diloco averages its pseudo-gradients with allreduce, q<bits>[:block<N>] or "
                                f"topk<P>%[:q<bits>], got {average!r}")
    return GradSyncSpec("diloco", every=every, outer_lr=lr, momentum=momentum, average=average,
                        fragments=fragments, delay=delay, mix=mix)


# -- buckets ----------------------------------------------------------------------------------------------
class _Bucket:
    """A group of parameters whose gradients travel as one flat fp32 buffer."""

    def __init__(self, index: int, params: list[nn.Parameter]) -> None:
        self.index = index
        self.params = params
        self.sizes = [p.numel() for p in params]
        self.numel = sum(self.sizes)

    def flatten(self, device: torch.device | str = "cpu") -> torch.Tensor:
        flat = torch.empty(self.numel, dtype=torch.float32, device=device)
        offset = 0
        for p, n in zip(self.params, self.sizes):
            if p.grad is None:
                flat[offset : offset + n].zero_()
            else:
                flat[offset : offset + n].copy_(p.grad.reshape(-1))
            offset += n
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        out, offset = [], 0
        for p, n in zip(self.params, self.sizes):
            out.append(flat[offset : offset + n].view(p.shape))
            offset += n
        return out

    def unflatten(self, flat: torch.Tensor) -> None:
        for p, v in zip(self.params, self.views(flat)):
            if p.grad is None:
                p.grad = v.to(device=p.device, dtype=p.dtype, copy=True)
            else:
                p.grad.copy_(v)


def _plan(params: Sequence[nn.Parameter], bucket_bytes: int) -> list[_Bucket]:
    buckets: list[_Bucket] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in params:
        nbytes = p.numel() * 4
        if current and size + nbytes > bucket_bytes:
            buckets.append(_Bucket(len(buckets), current))
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(_Bucket(len(buckets), current))
    return buckets


# -- interface --------------------------------------------------------------------------------------------
class GradSync(abc.ABC):
    """Average the gradients of a stage's parameters over its data-parallel group (module docstring)."""

    #: sequential collective rounds per compressed sync (for link emulation)
    rounds = 1

    def __init__(self, group: Any = None, *, bucket_mb: float = DEFAULT_BUCKET_MB,
                 link: LinkSpec | None = None, device: torch.device | str = "cpu") -> None:
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        self.group = group
        self.device = torch.device(device)
        self.world = dist.get_world_size(group)
        self.group_rank = dist.get_rank(group)
        #: how many of the group's ranks contribute (None: all): the sum is divided by it. A replica that has
        #: just joined takes part in the collectives with a zero contribution (:mod:`aqsgd.parallel.elastic`)
        self.contributors: int | None = None
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.link = link
        self.last_bytes = 0
        self.last_raw_bytes = 0
        self.last_compressed = False
        self._buckets: list[_Bucket] = []
        self._key: tuple[int, ...] = ()

    @property
    def divisor(self) -> int:
        """What the sum over the group is divided by: the contributing ranks (default: all)."""
        return self.contributors or self.world

    def regroup(self, group: Any, *, world: int, rank: int) -> None:
        """Run the next syncs over another group (a new membership: :mod:`aqsgd.parallel.elastic`) of
        ``world`` ranks, this one ``rank``; error-feedback state that depends on the group's size or this
        rank's place in it is adapted (:meth:`_regrouped`)."""
        if not 0 <= rank < world:
            raise ValueError(f"group rank {rank} outside a group of {world}")
        old, old_rank = self.world, self.group_rank
        self.group, self.world, self.group_rank = group, world, rank
        if world != old or rank != old_rank:
            self._regrouped(old)

    def _regrouped(self, old_world: int) -> None:
        """The group's size changed from ``old_world``, or this rank's place in it: adapt the state (nothing
        to adapt by default)."""

    @property
    def bucket_numels(self) -> list[int]:
        """Values per bucket of the current plan (empty before the first ``sync``)."""
        return [b.numel for b in self._buckets]

    def buckets(self, params: Sequence[nn.Parameter]) -> list[_Bucket]:
        key = tuple(id(p) for p in params)
        if key != self._key:
            self._buckets, self._key = _plan(params, self.bucket_bytes), key
            log.debug("grad sync: %d parameters in %d buckets", len(params), len(self._buckets))
        return self._buckets

    def sync(self, params: Sequence[nn.Parameter], *, compress: bool = True) -> int:
        """Replace every ``p.grad`` with the group average (a missing grad counts as zeros); returns the bytes
        this rank sent. ``compress=False`` (warm-up) is the fp32 all-reduce whatever the method."""
        t0 = time.monotonic()
        buckets = self.buckets([p for p in params if p.requires_grad])
        self.last_raw_bytes = sum(allreduce_bytes(4 * b.numel, self.world) for b in buckets)
        if self.world == 1:
            self.last_bytes, self.last_compressed = 0, compress
            return 0
        if compress:
            nbytes, rounds = self._sync(buckets), self.rounds
        else:
            nbytes, rounds = _allreduce(buckets, self.group, self.world, self.device, self.divisor), 1
        self.last_bytes, self.last_compressed = nbytes, compress
        if self.link is not None and not self.link.unlimited:
            remaining = t0 + self.link.tx_time(nbytes) + rounds * self.link.latency_s - time.monotonic()
            if remaining > 0:
                time.sleep(remaining)
        return nbytes

    @abc.abstractmethod
    def _sync(self, buckets: list[_Bucket]) -> int:
        """The compressed synchronization of every bucket; returns the bytes sent."""

    # -- for the methods with a codec and error feedback (q<b>, topk) ------------------------------------
    def _packet(self, payload: torch.Tensor, shape: tuple[int, ...]) -> Packet:
        """A packet of ``self.codec``'s payload bytes, for its decode."""
        codec = self.codec  # type: ignore[attr-defined]
        return Packet(codec.family, torch.float32, shape, codec.fingerprint, payload.contiguous())

    def _buffer(self, store: dict[int, torch.Tensor], index: int, numel: int) -> torch.Tensor:
        """Bucket ``index``'s error-feedback buffer in ``store``: zeros at first, refused at another size."""
        buf = store.get(index)
        if buf is None:
            buf = store[index] = torch.zeros(numel, dtype=torch.float32, device=self.device)
        elif buf.numel() != numel:
            raise ValueError(f"error-feedback buffer of bucket {index} has {buf.numel()} values, expected "
                             f"{numel} (state from another model, bucket size or group size?)")
        return buf

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        if state:
            raise KeyError(f"{type(self).__name__} has no state, got keys {sorted(state)}")


def _allreduce(buckets: list[_Bucket], group: Any, world: int, device: torch.device,
               divisor: int | None = None) -> int:
    flats = [b.flatten(device) for b in buckets]
    works = [dist.all_reduce(f, op=dist.ReduceOp.SUM, group=group, async_op=True) for f in flats]
    for b, f, w in zip(buckets, flats, works):
        w.wait()
        b.unflatten(f.div_(divisor or world))
    return sum(allreduce_bytes(4 * b.numel, world) for b in buckets)


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group: Any) -> Any:
    """Async all-gather into one flat tensor (``all_gather_single``, named ``all_gather_into_tensor``
    before)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=True)


class AllReduceSync(GradSync):
    """Uncompressed fp32 all-reduce (the baseline)."""

    def _sync(self, buckets: list[_Bucket]) -> int:
        return _allreduce(buckets, self.group, self.world, self.device, self.divisor)


# -- quantized, error feedback in both phases -------------------------------------------------------------
class QuantizedSync(GradSync):
    """``q<b>[:block<N>]``: compressed reduce-scatter (all-to-all) + compressed all-gather, two EF buffers."""

    rounds = 2

    def __init__(self, group: Any = None, *, bits: int = 8, block: int = DEFAULT_BLOCK,
                 bucket_mb: float = DEFAULT_BUCKET_MB, link: LinkSpec | None = None,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(group, bucket_mb=bucket_mb, link=link, device=device)
        self.codec = QuantCodec(bits, granularity="block", block=block)
        self.bits, self.block = bits, block
        self.ef1: dict[int, torch.Tensor] = {}  # per bucket, padded length D * c: before the all-to-all
        # per bucket, length c: this rank's chunk before the all-gather
        self.ef2: dict[int, torch.Tensor] = {}

    def chunk_numel(self, numel: int) -> int:
        """Values per chunk: ``ceil(numel / D)`` rounded up to a whole number of blocks."""
        per = -(-numel // self.world)
        return -(-per // self.block) * self.block

    def payload_bytes(self, chunk: int) -> int:
        """Exact bytes of one quantized chunk: fp16 scales, then bit-packed codes."""
        return (chunk // self.block) * 2 + packed_nbytes(chunk, self.bits)

    def expected_bytes(self, numel: int) -> int:
        """Bytes one rank sends for a bucket of ``numel`` values: ``(D-1)`` payloads in each phase."""
        return 2 * (self.world - 1) * self.payload_bytes(self.chunk_numel(numel))

    def _encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize ``x`` ([k, c]) row by row: ``(uint8 payloads [k, L], dequantized [k, c])``, each row's
        payload its blocks' fp16 scales, then its bit-packed codes. Through the codec's encode and decode, so
        the device's kernels (:mod:`aqsgd.compress.kernels`) do the work: one encode and one decode of all
        ``k`` rows where a row's codes fill whole bytes (a codec payload is all the scales, then all the
        codes: the rows' parts are taken apart), a packet per row otherwise."""
        k, c = x.shape
        if not self._whole_bytes(c):
            packets = [self.codec.encode(x[i]) for i in range(k)]
            return (torch.stack([p.payload for p in packets]),
                    torch.stack([self.codec.decode(p).float() for p in packets]))
        packet = self.codec.encode(x.reshape(-1))
        deq = self.codec.decode(packet).float().view(k, c)
        nsb = 2 * (c // self.block)
        p = packet.payload
        return torch.cat([p[: k * nsb].view(k, nsb), p[k * nsb :].view(k, -1)], dim=1), deq

    def _decode(self, payloads: torch.Tensor, c: int) -> torch.Tensor:
        """Inverse of the payload part of :meth:`_encode`: [k, L] uint8 -> [k, c] float32."""
        k = payloads.shape[0]
        if not self._whole_bytes(c):
            return torch.stack([self.codec.decode(self._packet(row, (c,))).float() for row in payloads])
        nsb = 2 * (c // self.block)
        payload = torch.cat([payloads[:, :nsb].reshape(-1), payloads[:, nsb:].reshape(-1)])
        return self.codec.decode(self._packet(payload, (k * c,))).float().view(k, c)

    def _whole_bytes(self, c: int) -> bool:
        return c * self.bits % 8 == 0


    def _sync(self, buckets: list[_Bucket]) -> int:
        d = self.world
        # phase 1: encode every bucket and launch its all-to-all before waiting for any
        launched = []
        for b in buckets:
            c = self.chunk_numel(b.numel)
            e1 = self._buffer(self.ef1, b.index, d * c)
            v = e1.clone()
            v[: b.numel].add_(b.flatten(self.device))
            payload, deq = self._encode(v.view(d, c))
            torch.sub(v, deq.view(-1), out=e1)
            recv = torch.empty_like(payload)
            work = dist.all_to_all_single(recv, payload, group=self.group, async_op=True)
            launched.append((b, c, recv, work))
        # phase 2: reduce my chunk, re-encode with the second error buffer, launch the all-gather
        gathers = []
        for b, c, recv, work in launched:
            work.wait()
            # summed in replica order: the same on every run
            s = self._decode(recv, c).sum(dim=0).div_(self.divisor)
            e2 = self._buffer(self.ef2, b.index, c)
            w = s.add_(e2)
            payload, deq = self._encode(w.view(1, c))
            torch.sub(w, deq.view(-1), out=e2)
            out = torch.empty(d * payload.shape[1], dtype=torch.uint8, device=self.device)
            gathers.append((b, c, out, _all_gather(out, payload.view(-1), self.group)))
        # phase 3: everyone decodes every chunk from the same bytes
        nbytes = 0
        for b, c, out, work in gathers:
            work.wait()
            avg = self._decode(out.view(d, -1), c).view(-1)
            b.unflatten(avg[: b.numel])
            nbytes += self.expected_bytes(b.numel)
        return nbytes

    def _regrouped(self, old_world: int) -> None:
        """The first buffer holds this rank's residual per value of its bucket (then zeros up to ``D * c``):
        kept, padded to the new ``D * c``. The second is the residual of the chunk this rank reduced, which
        another rank reduces in the new group: dropped (its error is lost once, at the change)."""
        for b in self._buckets:
            if b.index in self.ef1:
                old = self.ef1[b.index]
                new = torch.zeros(self.world * self.chunk_numel(b.numel), dtype=old.dtype, device=old.device)
                new[: b.numel] = old[: b.numel]
                self.ef1[b.index] = new
        self.ef2 = {}

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {f"ef1.{i}": t for i, t in self.ef1.items()}
        out.update({f"ef2.{i}": t for i, t in self.ef2.items()})
        return out

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        ef1, ef2 = {}, {}
        for key, value in state.items():
            m = re.fullmatch(r"(ef1|ef2)\.(\d+)", key)
            if m is None:
                raise KeyError(f"unexpected key {key!r} in a quantized grad sync state (ef1.<i>, ef2.<i>)")
            (ef1 if m.group(1) == "ef1" else ef2)[int(m.group(2))] = value.detach().to(
                device=self.device, dtype=torch.float32, copy=True)
        self.ef1, self.ef2 = ef1, ef2


# -- PowerSGD through PyTorch's hook ----------------------------------------------------------------------
# -- top-k with error feedback ------------------------------------------------------------------------------
class TopKSync(GradSync):
    """``topk<P>%[:q<b>][:block<N>]``: each rank sends the P % of its bucket's values largest in magnitude
    (after adding its error buffer) as their indices (int32) and their values quantized to b bits (one fp16
    scale per block of N), in one all-gather; everything it did not send, and the quantization error of what
    it did, stays in its error buffer for the next sync (SparseLoCo's pseudo-gradient compression: top-k,
    low-bit values, error feedback). Every rank decodes the same D payloads and adds them in replica order
    (a rank's indices are distinct: no two writes to one value in one ``index_add_``): the averages are
    bit-identical on every rank."""

    rounds = 1

    def __init__(self, group: Any = None, *, fraction: float = 0.03, bits: int = 8,
                 block: int = DEFAULT_BLOCK, bucket_mb: float = DEFAULT_BUCKET_MB,
                 link: LinkSpec | None = None, device: torch.device | str = "cpu") -> None:
        super().__init__(group, bucket_mb=bucket_mb, link=link, device=device)
        if not 0 < fraction <= 1:
            raise ValueError(f"the share kept must be in (0, 1], got {fraction}")
        self.fraction, self.bits, self.block = fraction, bits, block
        self.codec = QuantCodec(bits, granularity="block", block=block)
        self.ef: dict[int, torch.Tensor] = {}

    def kept(self, numel: int) -> int:
        """Values a rank sends of a bucket of ``numel``: ``ceil(P % of numel)``, at least 1."""
        return min(numel, max(1, math.ceil(self.fraction * numel)))

    def payload_bytes(self, numel: int) -> int:
        """Exact bytes of one rank's payload for a bucket: 4 per index, then the quantized values (fp16
        scales, bit-packed codes)."""
        k = self.kept(numel)
        return 4 * k + 2 * -(-k // self.block) + packed_nbytes(k, self.bits)

    def expected_bytes(self, numel: int) -> int:
        """Bytes one rank sends for a bucket: its payload to each of the ``D - 1`` others (all-gather)."""
        return (self.world - 1) * self.payload_bytes(numel)

    def _sync(self, buckets: list[_Bucket]) -> int:
        d = self.world
        launched = []
        for b in buckets:
            e = self._buffer(self.ef, b.index, b.numel)
            e.add_(b.flatten(self.device))  # e is now v = g + e
            k = self.kept(b.numel)
            idx = e.abs().topk(k, sorted=False).indices.to(torch.int32)
            packet = self.codec.encode(e[idx])
            e.index_add_(0, idx, self.codec.decode(packet).float(), alpha=-1.0)  # what was not sent stays
            payload = torch.cat([idx.view(torch.uint8), packet.payload])
            out = torch.empty(d * payload.numel(), dtype=torch.uint8, device=self.device)
            launched.append((b, k, out, _all_gather(out, payload, self.group)))
        nbytes = 0
        for b, k, out, work in launched:
            work.wait()
            avg = torch.zeros(b.numel, dtype=torch.float32, device=self.device)
            for row in out.view(d, -1):  # in replica order: the same sums on every rank
                idx = row[: 4 * k].clone().view(torch.int32).long()
                avg.index_add_(0, idx, self.codec.decode(self._packet(row[4 * k :], (k,))).float())
            b.unflatten(avg.div_(self.divisor))
            nbytes += self.expected_bytes(b.numel)
        return nbytes

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"ef.{i}": t for i, t in self.ef.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        ef = {}
        for key, value in state.items():
            m = re.fullmatch(r"ef\.(\d+)", key)
            if m is None:
                raise KeyError(f"unexpected key {key!r} in a top-k grad sync state (ef.<i>)")
            ef[int(m.group(1))] = value.detach().to(self.device, torch.float32, copy=True)
        self.ef = ef


class HookBucket:
    """What a DDP communication hook reads from ``dist.GradBucket``, over a flat buffer of our own.

    ``gradients()`` are views of ``buffer()`` shaped like the parameters: the hook writes its
    decompressed low-rank products into them, and so into the buffer it returns.
    """

    def __init__(self, index: int, buffer: torch.Tensor, gradients: list[torch.Tensor],
                 parameters: list[torch.Tensor], is_last: bool) -> None:
        self._index, self._buffer, self._gradients = index, buffer, gradients
        self._parameters, self._is_last = parameters, is_last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._gradients

    def parameters(self) -> list[torch.Tensor]:
        return self._parameters

    def is_last(self) -> bool:
        return self._is_last


@contextlib.contextmanager
def _host_buckets_need_no_gpu_sync(device: torch.device) -> Iterator[None]:
    """While PyTorch's ``powerSGD_hook`` runs on a bucket in host memory on a machine with a GPU (gloo sync).

    The hook ends with ``torch.cuda.synchronize(bucket.device)`` whenever CUDA is available, to wait for the
    GPU work it queued; a host bucket queued none, and ``synchronize`` of a host device raises ("Expected a
    cuda device"). Within this block ``torch.cuda.synchronize`` skips host devices and does what it always
    does for GPU ones."""
    if device.type == "cuda" or not torch.cuda.is_available():
        yield
        return
    real = torch.cuda.synchronize

    def synchronize(device: Any = None) -> None:
        if device is not None and torch.device(device).type != "cuda":
            return
        real(device)

    torch.cuda.synchronize = synchronize
    try:
        yield
    finally:
        torch.cuda.synchronize = real


class PowerSGDSync(GradSync):
    """``powersgd[:rank<R>]``: ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`` per bucket.

    Error feedback and warm start are on; matrices whose rank-R factors would not save at least 2x
    (``min_compression_rate``; biases and norms) are all-reduced in fp32 by the hook itself, as in DDP.
    """

    rounds = 3  # fp32 remainder, P, Q: three dependent all-reduces

    def __init__(self, group: Any = None, *, rank: int = 1, bucket_mb: float = DEFAULT_BUCKET_MB,
                 link: LinkSpec | None = None, seed: int = 0, min_compression_rate: float = 2.0,
                 device: torch.device | str = "cpu") -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

        super().__init__(group, bucket_mb=bucket_mb, link=link, device=device)
        self.rank = rank
        # start_powerSGD_iter only has to satisfy the state's own check (> 1 with error feedback): sync()
        # decides warm-up through ``compress`` and moves the counter past it before calling the hook.
        self.state = PowerSGDState(process_group=group, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                                   min_compression_rate=min_compression_rate, use_error_feedback=True,
                                   warm_start=True, orthogonalization_epsilon=0.0, random_seed=seed,
                                   batch_tensors_with_same_shape=False)

    def _bucket_bytes(self, b: _Bucket) -> int:
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

        plain = ps = qs = 0
        for p in b.params:
            n = p.shape[0] if p.dim() else 1
            m = p.numel() // n if n else 0
            r = min(n, m, self.rank)
            if _should_compress(n, m, r, self.state.min_compression_rate)[0]:
                ps, qs = ps + n * r, qs + m * r
            else:
                plain += p.numel()
        return sum(allreduce_bytes(4 * k, self.world) for k in (plain, ps, qs))

    def _sync(self, buckets: list[_Bucket]) -> int:
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

        self.state.iter = max(self.state.iter, self.state.start_powerSGD_iter)
        # One bucket at a time: the hook issues its P and Q all-reduces from future callbacks, which run on
        # whichever thread completes the previous collective, so with several buckets in flight the order of
        # collectives on the group differs between ranks (gloo then fails with a size mismatch; observed).
        for b in buckets:
            flat = b.flatten(self.device)
            hb = HookBucket(b.index, flat, b.views(flat), list(b.params), b.index == len(buckets) - 1)
            with _host_buckets_need_no_gpu_sync(flat.device):
                b.unflatten(powerSGD_hook(self.state, hb).wait())  # type: ignore[arg-type]
        return sum(self._bucket_bytes(b) for b in buckets)

    def state_dict(self) -> dict[str, torch.Tensor]:
        s = self.state
        out = {"iter": torch.tensor(s.iter, dtype=torch.long)}
        for name, store in (("error", s.error_dict), ("p", s.p_memory_dict), ("q", s.q_memory_dict)):
            out.update({f"{name}.{i}": t.detach() for i, t in store.items()})
        return out

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        stores: dict[str, dict[int, torch.Tensor]] = {"error": {}, "p": {}, "q": {}}
        it = self.state.iter
        for key, value in state.items():
            if key == "iter":
                it = int(value)
                continue
            m = re.fullmatch(r"(error|p|q)\.(\d+)", key)
            if m is None:
                raise KeyError(f"unexpected key {key!r} in a PowerSGD grad sync state (iter, error.<i>, "
                               "p.<i>, q.<i>)")
            stores[m.group(1)][int(m.group(2))] = value.detach().to(self.device, copy=True)
        self.state.iter = it
        self.state.error_dict = stores["error"]
        self.state.p_memory_dict = stores["p"]
        self.state.q_memory_dict = stores["q"]


def make_grad_sync(spec: str, group: Any = None, *, bucket_mb: float = DEFAULT_BUCKET_MB,
                   link: LinkSpec | None = None, seed: int = 0,
                   device: torch.device | str = "cpu") -> GradSync:
    """The :class:`GradSync` for a spec (``allreduce``, ``q8``, ``q4:block256``, ``powersgd:rank4``) over
    ``group`` (None: the default group), its buffers and state on ``device`` (the GPU for an NCCL group)."""
    parsed = parse_grad_sync(spec)
    if parsed.kind == "diloco":
        raise ValueError(f"{spec!r} synchronizes parameters, not gradients: build it with "
                         "aqsgd.parallel.outer.make_outer_sync")
    if parsed.kind == "allreduce":
        return AllReduceSync(group, bucket_mb=bucket_mb, link=link, device=device)
    if parsed.kind == "quant":
        return QuantizedSync(group, bits=parsed.bits, block=parsed.block, bucket_mb=bucket_mb, link=link,
                             device=device)
    if parsed.kind == "topk":
        return TopKSync(group, fraction=parsed.fraction, bits=parsed.bits, block=parsed.block,
                        bucket_mb=bucket_mb, link=link, device=device)
    return PowerSGDSync(group, rank=parsed.rank, bucket_mb=bucket_mb, link=link, seed=seed, device=device)

