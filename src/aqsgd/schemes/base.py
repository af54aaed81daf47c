"""Boundary schemes: the stateful layer between a tensor crossing a stage boundary and its codec.

One scheme object serves one boundary, one direction (activations forward or gradients backward) and one
side: the sender calls :meth:`BoundaryScheme.send`, the receiver :meth:`BoundaryScheme.recv`. Both sides
of a boundary are built from the same settings and called with the same ``sample_ids``, ``phase`` and
``slot`` in the same order; stateful schemes then hold bit-identical state on both sides.

The :class:`Phase` of every call is an explicit argument (never a global switch):

* ``WARMUP``: full precision (the lossless ``none`` codec); schemes with state initialize it from the
  value (AQ-SGD fills its cache, EF21 sets its estimate).
* ``TRAIN``: compressed, state updated.
* ``EVAL``: compressed with the scheme's codec applied directly, ``C(x)``, and no state read or written
  (evaluation samples have no cache rows; this is "compression on at inference").
* ``EVAL_RAW``: uncompressed, no state ("compression off at inference").

Every packet carries a tag (CRC-32 of the micro-batch's sample ids and the slot) and a kind, so a receiver
that is out of step with its sender (other samples, other phase, other codec, other shape) raises
:class:`~aqsgd.errors.PacketMismatchError` instead of computing with the wrong data.
"""

from __future__ import annotations

import abc
import enum
import json
import logging
import os
import zlib
from pathlib import Path
from typing import Any, ClassVar, Sequence

import torch
from safetensors.torch import load_file, save_file

from aqsgd.compress import Codec, Packet, make_codec
from aqsgd.compress.cast import RawCodec
from aqsgd.compress.subspace import Subspace, SubspaceCodec
from aqsgd.errors import PacketMismatchError, SchemeError

__all__ = ["Phase", "Kind", "Side", "BoundaryScheme", "ids_tag"]

log = logging.getLogger(__name__)
# a subspace's files in a scheme's folder: the basis both sides hold, the sender's estimate in progress
_BASIS_FILE, _ESTIMATE_FILE = "basis.safetensors", "basis-estimate.safetensors"
# Bytes of a generator's state by device type: a CPU generator (Mersenne Twister) holds 5056, a CUDA one
# (Philox) its seed and offset, 16. A state of the other type was saved on another kind of device.
_GENERATOR_STATE_BYTES = {"cpu": torch.Generator().get_state().numel(), "cuda": 16}


class Phase(str, enum.Enum):
    WARMUP = "warmup"
    TRAIN = "train"
    EVAL = "eval"
    EVAL_RAW = "eval_raw"


class Kind(enum.IntEnum):
    """What a packet's payload means to the scheme (the header's kind byte)."""

    RAW = 1  # the value itself, full precision
    DIRECT = 2  # C(x)
    DELTA = 3  # C(x - m): AQ-SGD
    EF = 4  # C(x + e)
    EF21 = 5  # C(x - g)
    BASIS = 6  # a new basis of the boundary's subspace (8-bit codes), ahead of the message it encodes


class Side(str, enum.Enum):
    SENDER = "sender"
    RECEIVER = "receiver"


def ids_tag(sample_ids: torch.Tensor | None, slot: int = 0) -> int:
    """CRC-32 of the sample ids (as int64) and the slot: identifies a micro-batch on both sides."""
    crc = zlib.crc32(int(slot).to_bytes(8, "little", signed=True))
    if sample_ids is not None:
        ids = sample_ids.detach().to("cpu", torch.int64).contiguous()
        crc = zlib.crc32(memoryview(ids.numpy()), crc) if ids.numel() else crc
    return crc


def as_ids(sample_ids: torch.Tensor | Sequence[int] | None, n: int, required: bool,
           who: str) -> torch.Tensor | None:
    if sample_ids is None:
        if required:
            raise SchemeError(f"{who} needs the sample ids of every micro-batch")
        return None
    ids = torch.as_tensor(sample_ids)
    if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise SchemeError(f"{who}: sample_ids must be a 1-D integer tensor, got {ids.dtype} "
                          f"{tuple(ids.shape)}")
    if ids.numel() != n:
        raise SchemeError(f"{who}: {ids.numel()} sample ids for a micro-batch of {n} rows")
    return ids.to(torch.int64)


def _load_tensors(file: Path) -> dict[str, torch.Tensor]:
    """A safetensors file of scheme state; :class:`SchemeError` naming it if it is missing or unreadable."""
    try:
        return load_file(str(file))
    except FileNotFoundError:
        raise SchemeError(f"{file} is missing") from None
    except Exception as exc:  # safetensors raises its own error types for damaged files
        raise SchemeError(f"{file}: unreadable ({' '.join(str(exc).split())})") from None


class BoundaryScheme(abc.ABC):
    """Base class: side checks, tagging, full-precision and direct paths shared by every scheme."""

    name: ClassVar[str]
    needs_ids: ClassVar[bool] = False

    def __init__(self, codec: Codec | str, side: Side | str, *, label: str = "boundary", seed: int = 0,
                 device: torch.device | str = "cpu") -> None:
        self.subspace: Subspace | None = None  # the basis of a pca<r> codec (see set_codec)
        self.codec = self._bind(make_codec(codec) if isinstance(codec, str) else codec)
        self.raw = RawCodec()
        try:
            self.side = Side(side)
        except ValueError:
            raise SchemeError(f"side must be 'sender' or 'receiver', got {side!r}") from None
        self.label = label
        self.device = torch.device(device)
        self.seed = seed
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self._probe: list[Codec] = []  # see set_probe
        self._probe_on = True  # see probe_now
        self._probe_sums: torch.Tensor | None = None
        self._probe_pending: tuple[torch.Tensor, torch.Tensor] | None = None  # see _measure
        self.warmup_compressed = False  # see compress_warmup
        self.warmup_codec: Codec | None = None

    # -- what the warm-up sends --------------------------------------------------------------------
    warmup_codec_allowed: ClassVar[bool] = False  # whether compress_warmup may be turned on

    def compress_warmup(self, on: bool = True, *, codec: Codec | str | None = None) -> None:
        """Send compressed what is otherwise sent in full: the warm-up (and, for AQ-SGD, the first visit of a
        sample, whose decoded rows both sides cache). ``codec``: what it is sent with (a fixed setting's
        ``--warmup-codec``, e.g. q8 where the scheme's own codec is a 2-bit delta's); None: the scheme's own
        codec, whichever it is at the time (the bits chosen per link, :mod:`aqsgd.train.adaptive`, turn this
        on for every auto link, whose codec the error budget and the link's time choose in the warm-up as
        after it). Both sides of a link must agree. Schemes whose state is built from the warm-up's exact
        values (EF, EF21) do not take it: :class:`SchemeError`."""
        if on and not self.warmup_codec_allowed:
            raise SchemeError(f"{self.label}: a {self.name} scheme sends its warm-up in full; only direct "
                              "and delta can compress it")
        self.warmup_compressed = on
        self.warmup_codec = make_codec(codec) if isinstance(codec, str) else codec

    def _first(self) -> tuple[Kind, Codec]:
        """The kind and codec of what goes in full unless :meth:`compress_warmup` is on."""
        if not self.warmup_compressed:
            return Kind.RAW, self.raw
        return Kind.DIRECT, self.warmup_codec or self.codec

    # -- error probe ---------------------------------------------------------------------------------
    def set_probe(self, codecs: Sequence[Codec | str] | None) -> None:
        """Measure, on every sender message of slot 0 (one per step), the relative error each of ``codecs``
        would make on what this scheme sends, sample by sample: ``||x_s - x_hat_s||^2 / ||x_s||^2`` summed
        over the samples ``s`` (rows) with a nonzero ``x_s``, and their number, summed on the device until
        :meth:`take_probe` (the bits chosen per link read it once per step, :mod:`aqsgd.train.adaptive`).
        ``x_hat`` is what the receiver would compute with: ``C(x)`` (``direct``), ``m + C(x - m)`` (AQ-SGD).
        Per sample, because one sample's large values can set the scales that zero another's: an error
        relative to the whole tensor's norm would hide that. None or empty: no probe.

        The message is only recorded when it is sent; its encodes and decodes run at :meth:`run_probe`
        (the pipeline runner calls it where the stage would wait anyway: before a receive whose message has
        not arrived, else at the step's end) or at :meth:`take_probe`. Off the message's path: on the first
        micro-batch they held up the pipeline's fill at every boundary. The tensor sent must not be changed
        in place until then (the runner's activations and gradients are not)."""
        self._probe = [make_codec(c) if isinstance(c, str) else c for c in codecs or ()]
        self._probe_sums = None
        self._probe_pending = None

    def probe_now(self, on: bool) -> None:
        """Whether this step's slot-0 message is probed (where :meth:`set_probe` gave codecs): the probe
        encodes and decodes the message once per rung, so the trainer probes only every few steps."""
        self._probe_on = on

    @property
    def probe_pending(self) -> bool:
        """Whether a message was recorded for the probe and not yet measured (:meth:`run_probe`)."""
        return self._probe_pending is not None

    def run_probe(self) -> bool:
        """Measure the recorded message with each probe codec now (see :meth:`set_probe`); False where none
        was pending."""
        pending, self._probe_pending = self._probe_pending, None
        if pending is None:
            return False
        d, x = pending
        with torch.no_grad():
            rows = x.shape[0] if x.dim() else 1
            norm2 = x.float().reshape(rows, -1).square().sum(dim=1)
            live = norm2 > 0
            inv = torch.where(live, 1.0 / torch.where(live, norm2, 1.0), 0.0)
            d32 = d.float()
            parts = [((d32 - c.decode(c.encode(d)).float()).reshape(rows, -1).square().sum(dim=1) * inv).sum()
                     for c in self._probe]
            parts.append(live.sum().float())
            sums = torch.stack(parts).to(torch.float64)
        self._probe_sums = sums if self._probe_sums is None else self._probe_sums + sums
        return True

    def take_probe(self) -> tuple[list[float], float] | None:
        """The probe's sums since the last call (each codec's summed squared relative error, and the number of
        samples), or None if nothing was probed; resets them (a pending probe is run first)."""
        self.run_probe()
        sums, self._probe_sums = self._probe_sums, None
        if sums is None:
            return None
        values = sums.tolist()  # the one host read, at the step's end
        return values[:-1], values[-1]

    def _probing(self, slot: int) -> bool:
        return bool(self._probe) and slot == 0 and self._probe_on

    def _measure(self, d: torch.Tensor, x: torch.Tensor) -> None:
        """Record a message for the probe (run later, :meth:`run_probe`): each probe codec's per-sample
        ``||d_s - C(d)_s||^2 / ||x_s||^2`` and the number of samples, ``d`` what the codec encodes, ``x``
        the tensor the receiver reconstructs (``x - x_hat = d - C(d)``, for AQ-SGD's delta as for
        ``direct``). No host synchronisation."""
        self.run_probe()  # one not run yet (a step that stopped before its end) is measured, not dropped
        self._probe_pending = (d, x)

    # -- public API ----------------------------------------------------------------------------------
    def send(self, x: torch.Tensor, sample_ids: torch.Tensor | Sequence[int] | None = None, *,
             phase: Phase | str = Phase.TRAIN, slot: int = 0) -> list[Packet]:
        """Encode ``x`` (rows = samples of the micro-batch) into the packets to transmit."""
        phase = self._check(Side.SENDER, phase)
        x = x.detach()
        ids = as_ids(sample_ids, x.shape[0] if x.dim() else 1, self.needs_ids and phase in
                     (Phase.WARMUP, Phase.TRAIN), f"{self.label} ({self.name})")
        tag = ids_tag(ids, slot)
        if self.subspace is not None:
            self.subspace.learning = phase == Phase.TRAIN
            if phase == Phase.WARMUP:  # what crosses in full: the first basis is estimated from it
                self.subspace.observe(x)
        if phase == Phase.EVAL_RAW:
            packets = [self._tagged(self.raw.encode(x), tag, Kind.RAW)]
        elif phase == Phase.EVAL:
            packets = [self._tagged(self.codec.encode(x, generator=self.generator), tag, Kind.DIRECT)]
        else:
            packets = [p.with_tag(tag, p.kind) for p in self._send(x, ids, phase, slot)]
        if self.subspace is not None:
            basis = self.subspace.take_unsent()
            if basis is not None:  # ahead of the message it encodes
                packets.insert(0, self._tagged(basis, tag, Kind.BASIS))
        return packets

    def recv(self, packets: Packet | Sequence[Packet], sample_ids: torch.Tensor | Sequence[int] | None = None,
             *, phase: Phase | str = Phase.TRAIN, slot: int = 0) -> torch.Tensor:
        """Decode the packets of one micro-batch into the tensor the next stage computes with."""
        phase = self._check(Side.RECEIVER, phase)
        packets = [packets] if isinstance(packets, Packet) else list(packets)
        basis = packets.pop(0) if packets and packets[0].kind == Kind.BASIS else None
        if not packets:
            raise PacketMismatchError(f"{self.label}: no packets received")
        rows = packets[0].shape[0] if packets[0].shape else 1
        if len(packets) > 1:
            rows = sum(p.shape[0] for p in packets if p.shape)
        ids = as_ids(sample_ids, rows, self.needs_ids and phase in (Phase.WARMUP, Phase.TRAIN),
                     f"{self.label} ({self.name})")
        tag = ids_tag(ids, slot)
        for p in packets if basis is None else [basis, *packets]:
            p.expect(tag=tag, what=self.label)
        if basis is not None:
            self._install_basis(basis)
        if phase in (Phase.EVAL_RAW, Phase.EVAL):
            kind, codec = (Kind.RAW, self.raw) if phase == Phase.EVAL_RAW else (Kind.DIRECT, self.codec)
            self._expect_kinds(packets, [kind], phase)
            return codec.decode(packets[0])
        return self._recv(packets, ids, phase, slot)

    def _install_basis(self, packet: Packet) -> None:
        if self.subspace is None:
            raise PacketMismatchError(f"{self.label}: received a basis, but this receiver's codec "
                                      f"{self.codec.spec!r} has no subspace stage")
        self.subspace.install(packet)

    def _bind(self, codec: Codec) -> Codec:
        """``codec`` computing with this scheme's basis, where it has a subspace stage (:mod:`aqsgd.compress
        .subspace`): one basis per scheme, kept when the codec changes to another of the same rank."""
        if not isinstance(codec, SubspaceCodec):
            return codec
        held = self.subspace
        if held is None or held.key != codec.key:
            self.subspace = codec.new_state()
        return codec.bound(self.subspace)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors of the scheme's small state (the generator; subclasses add theirs). A cache is not part of
        it: the complete state, caches included, is what :meth:`save` writes into a folder."""
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        saved = state["generator"]
        here = self.device.type
        other = [t for t, n in _GENERATOR_STATE_BYTES.items() if n == saved.numel() and t != here]
        if here in _GENERATOR_STATE_BYTES and saved.numel() != _GENERATOR_STATE_BYTES[here] and other:
            # CPU and CUDA generators draw different streams: a state cannot move between them. The random
            # numbers (stochastic rounding only) restart from the scheme's seed; everything else continues.
            log.warning("%s: the saved random generator state is a %s one, this scheme runs on %s; its "
                        "stochastic rounding restarts from seed %d", self.label, other[0], self.device,
                        self.seed)
            self.generator.manual_seed(self.seed)
            return
        self.generator.set_state(saved)

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write the scheme's complete state (safetensors + JSON, no pickle) into ``directory``; the form in
        which :meth:`~aqsgd.pipeline.runner.StageRunner.state_dict` hands schemes to checkpoints."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self._saved_state().items()}, str(d / "state.safetensors"))
        if self.subspace is not None:
            save_file({k: v.contiguous() for k, v in self.subspace.mirrored().items()},
                      str(d / _BASIS_FILE))
            save_file({k: v.contiguous() for k, v in self.subspace.own().items()}, str(d / _ESTIMATE_FILE))
        (d / "scheme.json").write_text(json.dumps(self.describe(), indent=1))

    def load(self, directory: str | os.PathLike[str]) -> None:
        """Restore what :meth:`save` wrote; :class:`SchemeError` naming the file if it is missing, unreadable
        or written by another scheme."""
        d = Path(directory)
        file = d / "scheme.json"
        try:
            meta = json.loads(file.read_bytes().decode("utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SchemeError(f"{file}: unreadable ({type(exc).__name__}: "
                              f"{' '.join(str(exc).split())})") from None
        if meta != self.describe():
            raise SchemeError(f"{self.label}: saved scheme {meta} does not match this one {self.describe()}")
        self.load_state_dict(_load_tensors(d / "state.safetensors"))
        if self.subspace is not None:
            self.subspace.load(_load_tensors(d / _BASIS_FILE), _load_tensors(d / _ESTIMATE_FILE), self.device)

    def mirrored_state(self) -> tuple[str, ...]:
        """Paths inside :meth:`save`'s folder that the other side of the boundary saves byte for byte
        identically (a trailing ``/``: every file below). Checkpoints compare the two sides' checksums of
        these on load; stateless sides and state that only one side holds (EF's error, generators) are not
        listed. A subspace's basis is mirrored (the sender's estimate in progress is its own)."""
        return (_BASIS_FILE,) if self.subspace is not None else ()

    def _saved_state(self) -> dict[str, torch.Tensor]:
        """The tensors :meth:`save` writes to ``state.safetensors``."""
        return self.state_dict()

    def set_codec(self, codec: Codec | str) -> None:
        """Encode (sender) or decode (receiver) with ``codec`` from now on. Both sides of a link must switch
        between the same two packets (at a step boundary); a scheme's state (AQ-SGD's cache of activations)
        does not depend on the codec, so it stays valid."""
        self.codec = self._bind(make_codec(codec) if isinstance(codec, str) else codec)

    def describe(self) -> dict[str, Any]:
        """Settings that both sides (and a checkpoint) must agree on."""
        return {"scheme": self.name, "codec": self.codec.spec, "side": self.side.value}

    @property
    def state_nbytes(self) -> int:
        """Bytes held as state (caches, error buffers)."""
        return 0

    # -- for subclasses ------------------------------------------------------------------------------
    @abc.abstractmethod
    def _send(self, x: torch.Tensor, ids: torch.Tensor | None, phase: Phase, slot: int) -> list[Packet]: ...

    @abc.abstractmethod
    def _recv(self, packets: list[Packet], ids: torch.Tensor | None, phase: Phase,
              slot: int) -> torch.Tensor: ...

    def _check(self, side: Side, phase: Phase | str) -> Phase:
        if self.side != side:
            verb = "send" if side == Side.SENDER else "recv"
            raise SchemeError(f"{self.label}: a {self.side.value}-side {self.name} scheme cannot {verb}()")
        try:
            return Phase(phase)
        except ValueError:
            raise SchemeError(f"unknown phase {phase!r}; valid: {[p.value for p in Phase]}") from None

    @staticmethod
    def _tagged(packet: Packet, tag: int, kind: Kind) -> Packet:
        return packet.with_tag(tag, int(kind))

    def _expect_kinds(self, packets: list[Packet], kinds: list[Kind], phase: Phase) -> None:
        got = [p.kind for p in packets]
        if got != [int(k) for k in kinds]:
            names = [Kind(k).name if k in Kind._value2member_map_ else str(k) for k in got]
            raise PacketMismatchError(
                f"{self.label}: received packets of kinds {names} in phase {phase.value!r}, expected "
                f"{[k.name for k in kinds]} (are sender and receiver in the same phase and scheme?)"
            )
