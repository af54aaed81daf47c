"""``delta``: AQ-SGD (Wang et al., NeurIPS 2022) activation compression with a per-sample message cache.

For every sample id ``i`` both sides keep ``m(i)`` in an :class:`~aqsgd.schemes.cache.ActivationCache`.

* First visit of ``i`` (not yet in the cache): the row goes at full precision and both sides store it.
* Later visits: the sender sends ``C(x - m)``; both sides compute ``m <- m + decode(C(x - m))`` from the
  same packet with the same arithmetic, store it, and continue with what the cache returns, so their caches
  stay bit-identical (the cache's ``put`` returns the stored representation). The receiver's output is the
  new ``m``.
* A micro-batch that mixes seen and unseen samples travels as two packets: the deltas of the seen rows
  (kind DELTA) and then the unseen rows in full (kind RAW). The receiver splits the ids the same way from
  its own cache, so nothing but the packets crosses the wire.
* ``WARMUP`` sends everything in full and (re)writes every row: the reference implementation's
  uncompressed first epoch, which also fills the cache.
* With :meth:`~aqsgd.schemes.base.BoundaryScheme.compress_warmup` (every ``--forward auto`` link), what
  goes in full above goes as ``C(x)`` (kind DIRECT) instead, and both sides cache ``decode(C(x))``: the
  first visit's error is the first delta's to correct (``x - m`` is sent at the next visit), which AQ-SGD's
  update does whatever ``m`` starts from.

Outputs have the cache's compute dtype (``cache.dtype``) in ``TRAIN``; choose it equal to the activations'.
"""

from __future__ import annotations

import torch

from aqsgd.compress import Codec, Packet
from aqsgd.compress.kernels import index_on
from aqsgd.errors import PacketMismatchError
from aqsgd.schemes.base import BoundaryScheme, Kind, Phase, Side
from aqsgd.schemes.cache import ActivationCache

__all__ = ["DeltaScheme"]


class DeltaScheme(BoundaryScheme):
    name = "delta"
    needs_ids = True
    warmup_codec_allowed = True

    def __init__(self, codec: Codec | str, side: Side | str, *, cache: ActivationCache,
                 label: str = "boundary", seed: int = 0, device: torch.device | str = "cpu") -> None:
        super().__init__(codec, side, label=label, seed=seed, device=device)
        self.cache = cache

    def prefetch(self, sample_ids: torch.Tensor) -> None:
        """Hint that the rows of these samples are needed soon (disk caches read them in the background)."""
        ids = torch.as_tensor(sample_ids, dtype=torch.int64)
        seen = self.cache.visited(ids)
        if bool(seen.any()):
            self.cache.prefetch(ids[seen.to(ids.device)])

    def _split(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seen = self.cache.visited(ids).to("cpu")
        return seen.nonzero().squeeze(1), (~seen).nonzero().squeeze(1)

    def _send(self, x: torch.Tensor, ids: torch.Tensor | None, phase: Phase, slot: int) -> list[Packet]:
        assert ids is not None
        if phase == Phase.WARMUP:
            if self._probing(slot):  # no row is cached yet: the delta against an empty cache, x itself
                self._measure(x, x)
            return [self._send_first(x, ids)]
        seen, new = self._split(ids)
        packets = []
        # seen and new are ascending positions: when one of them covers the whole micro-batch it is
        # 0..n-1, and x and ids serve as they are (no copy of the activation)
        if seen.numel():
            whole = seen.numel() == ids.numel()
            sid = ids if whole else ids[seen]
            xs = x if whole else x[index_on(seen, x.device)]
            packet = self._send_delta(xs, sid, probe=self._probing(slot))
            packets.append(self._tagged(packet, 0, Kind.DELTA))
        if new.numel():
            whole = new.numel() == ids.numel()
            rows = x if whole else x[index_on(new, x.device)]
            if self._probing(slot):  # a first visit's error is its own C(x)'s, as in the warm-up (summed
                self._measure(rows, rows)  # with the seen rows' deltas': the probe is per sample)
            packets.append(self._send_first(rows, ids if whole else ids[new]))
        return packets

    def _send_first(self, x: torch.Tensor, ids: torch.Tensor) -> Packet:
        """The rows of a first visit (or of the warm-up): in full, cached as they are; or, with
        :meth:`compress_warmup`, ``C(x)``, cached as the receiver decodes it."""
        kind, codec = self._first()
        packet = codec.encode(x, generator=self.generator)
        self.cache.put(ids, codec.decode(packet) if self.warmup_compressed else x)
        return self._tagged(packet, 0, kind)

    def _recv_first(self, packet: Packet, ids: torch.Tensor) -> torch.Tensor:
        rows = self._first()[1].decode(packet)
        self.cache.put(ids, rows)
        return rows

    def _recv(self, packets: list[Packet], ids: torch.Tensor | None, phase: Phase, slot: int) -> torch.Tensor:
        assert ids is not None
        first = self._first()[0]
        if phase == Phase.WARMUP:
            self._expect_kinds(packets, [first], phase)
            return self._recv_first(packets[0], ids)
        seen, new = self._split(ids)
        kinds = ([Kind.DELTA] if seen.numel() else []) + ([first] if new.numel() else [])
        self._expect_kinds(packets, kinds, phase)
        parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        for packet, idx in zip(packets, [i for i in (seen, new) if i.numel()]):
            if packet.shape[:1] != (idx.numel(),):
                raise PacketMismatchError(
                    f"{self.label}: packet for {packet.shape[0] if packet.shape else 0} rows, receiver's "
                    f"cache expects {idx.numel()} (sender and receiver caches disagree on which samples "
                    "were seen)"
                )
            if packet.kind == Kind.DELTA:
                parts.append((idx, self._recv_delta(packet, ids[idx])))
            else:
                parts.append((idx, self._recv_first(packet, ids[idx])))
        head = parts[0][1]
        if kinds == [Kind.DELTA]:  # every row seen: positions 0..n-1, and the new rows are a fresh tensor
            return head.to(self.cache.dtype)
        out = torch.empty((ids.numel(), *head.shape[1:]), dtype=self.cache.dtype, device=head.device)
        for idx, rows in parts:
            out[index_on(idx, out.device)] = rows.to(out.dtype)
        return out

    def _send_delta(self, x: torch.Tensor, ids: torch.Tensor, *, probe: bool = False) -> Packet:
        """``C(x - m)``, and ``m <- m + decode(C(x - m))``: in one fused pass over the cache's rows where the
        codec and the cache allow it (an in-memory cache on the CPU, a ``q<b>`` codec), else step by step.
        Both give the same packet and the same rows, bit for bit. ``probe``: measure the probe codecs on
        ``x - m`` first (:meth:`set_probe`)."""
        m = self.cache.get(ids) if probe else None  # read once: a disk cache's prefetch serves one read
        if m is not None:
            self._measure(x.to(m.dtype) - m, x)
        store = self.cache.row_store(ids)
        if store is not None:
            packet = self.codec.encode_delta(x, store)
            if packet is not None:
                return packet
        if m is None:
            m = self.cache.get(ids)
        packet = self.codec.encode(x.to(m.dtype) - m, generator=self.generator)
        self.cache.put(ids, m + self.codec.decode(packet))
        return packet

    def _recv_delta(self, packet: Packet, ids: torch.Tensor) -> torch.Tensor:
        """``m <- m + decode(packet)``, returned as stored (fused where :meth:`_send_delta` is)."""
        store = self.cache.row_store(ids)
        if store is not None:
            out = self.codec.decode_delta(packet, store)
            if out is not None:
                return out
        m = self.cache.get(ids)
        return self.cache.put(ids, m + self.codec.decode(packet))

    def describe(self) -> dict:
        d = super().describe()
        d["cache"] = type(self.cache).__name__
        d["capacity"] = self.cache.capacity
        return d

    @property
    def state_nbytes(self) -> int:
        return self.cache.nbytes

    def save(self, directory) -> None:  # type: ignore[override]
        super().save(directory)
        self.cache.save(f"{directory}/cache")

    def load(self, directory) -> None:  # type: ignore[override]
        super().load(directory)
        self.cache.load(f"{directory}/cache")

    def mirrored_state(self) -> tuple[str, ...]:
        return ("cache/", *super().mirrored_state())  # both sides' caches are bit-identical by construction
