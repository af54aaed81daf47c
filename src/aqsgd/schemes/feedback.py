"""Error feedback schemes from the follow-up study (Rudakov et al., 2023), around any codec ``C``.

``ef`` (error feedback): the sender keeps an error ``e``, sends ``C(x + e)`` and sets
``e <- x + e - decode(C(x + e))``; the receiver just decodes.

``ef21`` (Richtarik et al., 2021): both sides keep an estimate ``g``; the sender sends ``C(x - g)``, both set
``g <- g + decode(C(x - g))`` and the receiver outputs ``g``. ``WARMUP`` sends ``x`` in full and sets
``g = x``.

State is keyed either per micro-batch **slot** (the index of the micro-batch within the step; the
default) or per **sample** id. The slot key is the default because its memory is one micro-batch per slot
whatever the dataset size, which is what the follow-up study's buffers do; the sample key gives each sample
its own memory (the AQ-SGD-like analysis) at the cost of a dataset-sized store (an ActivationCache). A
shorter last micro-batch uses (and updates) the first rows of its slot's buffer.

State and outputs use ``state_dtype`` (fp32 by default): error terms are small and would lose most of their
bits in fp16.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from aqsgd.compress import Codec, Packet
from aqsgd.compress.kernels import index_on
from aqsgd.errors import SchemeError
from aqsgd.schemes.base import BoundaryScheme, Kind, Phase, Side, _load_tensors
from aqsgd.schemes.cache import ActivationCache

__all__ = ["EFScheme", "EF21Scheme", "SlotState", "SampleState"]

_SLOTS_FILE = "slots.safetensors"


class SlotState:
    """One buffer per micro-batch slot, grown to the largest micro-batch seen."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype
        self.buffers: dict[int, torch.Tensor] = {}

    def read(self, ids: torch.Tensor | None, slot: int, like: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(slot)
        n = like.shape[0]
        if buf is None:
            return torch.zeros(like.shape, dtype=self.dtype, device=like.device)
        if buf.shape[1:] != like.shape[1:]:
            raise SchemeError(f"slot {slot}: rows of shape {tuple(like.shape[1:])}, state holds "
                              f"{tuple(buf.shape[1:])}")
        if buf.shape[0] >= n:
            return buf[:n].clone()
        return torch.cat([buf, buf.new_zeros((n - buf.shape[0], *buf.shape[1:]))])

    def write(self, ids: torch.Tensor | None, slot: int, values: torch.Tensor) -> torch.Tensor:
        values = values.to(self.dtype)
        buf = self.buffers.get(slot)
        n = values.shape[0]
        if buf is None or buf.shape[0] < n:
            grown = values.new_zeros((n, *values.shape[1:]))
            if buf is not None:
                grown[: buf.shape[0]] = buf
            self.buffers[slot] = buf = grown
        buf[:n] = values
        return buf[:n].clone()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"slot.{k}": v for k, v in self.buffers.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor],
                        device: torch.device | str | None = None) -> None:
        """Restore copies of the buffers, on ``device`` (None: where the given tensors are)."""
        self.buffers = {int(k.split(".", 1)[1]): v.to(device, copy=True) for k, v in state.items()
                        if k.startswith("slot.")}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


class SampleState:
    """Per-sample state in an ActivationCache; never-written samples read as zeros."""

    def __init__(self, cache: ActivationCache) -> None:
        self.cache = cache
        self.dtype = cache.dtype

    def read(self, ids: torch.Tensor | None, slot: int, like: torch.Tensor) -> torch.Tensor:
        if ids is None:
            raise SchemeError("per-sample error feedback needs sample ids")
        out = torch.zeros(like.shape, dtype=self.dtype, device=like.device)
        seen = self.cache.visited(ids).to("cpu")
        if bool(seen.any()):
            idx = seen.nonzero().squeeze(1)
            out[index_on(idx, out.device)] = self.cache.get(ids[idx]).to(out.device)
        return out

    def write(self, ids: torch.Tensor | None, slot: int, values: torch.Tensor) -> torch.Tensor:
        assert ids is not None
        return self.cache.put(ids, values)

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes


class _FeedbackScheme(BoundaryScheme):
    two_sided = False  # whether both sides hold the (then bit-identical) state

    def __init__(self, codec: Codec | str, side: Side | str, *, state: SlotState | SampleState | None = None,
                 label: str = "boundary", seed: int = 0, device: torch.device | str = "cpu") -> None:
        super().__init__(codec, side, label=label, seed=seed, device=device)
        self.state = state if state is not None else SlotState()
        self.needs_ids = isinstance(self.state, SampleState)  # type: ignore[misc]

    @property
    def key(self) -> str:
        return "sample" if isinstance(self.state, SampleState) else "slot"

    def describe(self) -> dict:
        return {**super().describe(), "key": self.key}

    @property
    def state_nbytes(self) -> int:
        return self.state.nbytes

    def state_dict(self) -> dict[str, torch.Tensor]:
        d = super().state_dict()
        if isinstance(self.state, SlotState):
            d.update(self.state.state_dict())
        return d

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        super().load_state_dict(state)
        if isinstance(self.state, SlotState):
            self.state.load_state_dict(state, self.device)

    # Files: ``state.safetensors`` (the generator), ``scheme.json``, and the error/estimate state in
    # ``slots.safetensors`` (slot key) or ``cache/`` (sample key), kept apart from the generator so that
    # EF21's two sides save identical bytes for their identical estimates (see mirrored_state). Folders
    # written before the split hold the slot buffers in ``state.safetensors``; they still load.
    def _saved_state(self) -> dict[str, torch.Tensor]:
        return BoundaryScheme.state_dict(self)

    def save(self, directory) -> None:  # type: ignore[override]
        super().save(directory)
        if isinstance(self.state, SampleState):
            self.state.cache.save(f"{directory}/cache")
        else:
            save_file({k: v.contiguous() for k, v in self.state.state_dict().items()},
                      str(Path(directory) / _SLOTS_FILE))

    def load(self, directory) -> None:  # type: ignore[override]
        super().load(directory)
        if isinstance(self.state, SampleState):
            self.state.cache.load(f"{directory}/cache")
        elif (Path(directory) / _SLOTS_FILE).exists():
            self.state.load_state_dict(_load_tensors(Path(directory) / _SLOTS_FILE), self.device)

    def mirrored_state(self) -> tuple[str, ...]:
        if not self.two_sided:
            return super().mirrored_state()
        own = ("cache/",) if isinstance(self.state, SampleState) else (_SLOTS_FILE,)
        return own + super().mirrored_state()

    def _raw(self, x: torch.Tensor) -> list[Packet]:
        return [self._tagged(self.raw.encode(x), 0, Kind.RAW)]


class EFScheme(_FeedbackScheme):
    """Error feedback: send ``C(x + e)``, keep ``e <- x + e - decode``. Only the sender has state. The
    warm-up goes in full, or with :meth:`~aqsgd.schemes.base.BoundaryScheme.compress_warmup` as ``C_w(x)``
    (kind DIRECT): the error starts at zero after it either way, as it holds nothing of the warm-up."""

    name = "ef"
    warmup_codec_allowed = True

    def _send(self, x: torch.Tensor, ids: torch.Tensor | None, phase: Phase, slot: int) -> list[Packet]:
        if phase == Phase.WARMUP:
            kind, codec = self._first()
            return [self._tagged(codec.encode(x, generator=self.generator), 0, kind)]
        v = x.to(self.state.dtype) + self.state.read(ids, slot, x)
        packet = self.codec.encode(v, generator=self.generator)
        self.state.write(ids, slot, v - self.codec.decode(packet))
        return [self._tagged(packet, 0, Kind.EF)]

    def _recv(self, packets: list[Packet], ids: torch.Tensor | None, phase: Phase, slot: int) -> torch.Tensor:
        if phase == Phase.WARMUP:
            kind, codec = self._first()
            self._expect_kinds(packets, [kind], phase)
            return codec.decode(packets[0])
        self._expect_kinds(packets, [Kind.EF], phase)
        return self.codec.decode(packets[0])


class EF21Scheme(_FeedbackScheme):
    """EF21: send ``C(x - g)``; both sides ``g <- g + decode``; the receiver outputs ``g``."""

    name = "ef21"
    two_sided = True

    def _send(self, x: torch.Tensor, ids: torch.Tensor | None, phase: Phase, slot: int) -> list[Packet]:
        if phase == Phase.WARMUP:
            self.state.write(ids, slot, x)
            return self._raw(x)
        g = self.state.read(ids, slot, x)
        packet = self.codec.encode(x.to(g.dtype) - g, generator=self.generator)
        self.state.write(ids, slot, g + self.codec.decode(packet))
        return [self._tagged(packet, 0, Kind.EF21)]

    def _recv(self, packets: list[Packet], ids: torch.Tensor | None, phase: Phase, slot: int) -> torch.Tensor:
        if phase == Phase.WARMUP:
            self._expect_kinds(packets, [Kind.RAW], phase)
            x = self.raw.decode(packets[0])
            self.state.write(ids, slot, x)
            return x
        self._expect_kinds(packets, [Kind.EF21], phase)
        delta = self.codec.decode(packets[0])
        return self.state.write(ids, slot, self.state.read(ids, slot, delta) + delta)
