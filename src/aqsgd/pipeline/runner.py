"""The stage runner: one pipeline stage executing its schedule, with every boundary compressed.

A :class:`StageRunner` owns one stage module, the boundary schemes on its sides (created lazily, when
the first tensor fixes their row shape) and a transport. It runs the plan of a schedule
(:mod:`aqsgd.pipeline.schedule`) action by action:

* ``RECV_F``: wait for the packets of the previous stage, decode them with the forward receiver scheme
  (AQ-SGD returns the message ``m``), and make the result a fresh leaf that collects its gradient;
* ``FORWARD``: run the stage (the last stage returns the micro-batch loss);
* ``SEND_F``: encode the output with the forward sender scheme and send it, asynchronously;
* ``RECV_B`` / ``BACKWARD`` / ``SEND_B``: the same for activation gradients, backwards.

The same runner serves the distributed runtime (one process per stage, a torch.distributed transport)
and the local runtime (:class:`LocalPipeline`: all stages in one process, an in-memory transport), so
both compute the same numbers. Receives are posted at the start of a step, so a distributed transport
can receive while the stage computes.

Every action runs inside ``torch.profiler.record_function(f"stage{i} {KIND} mb{m}")`` (``KIND`` one of
``FORWARD``, ``BACKWARD``, ``SEND_F``, ``RECV_F``, ``SEND_B``, ``RECV_B``), with the waits, decodes and
encodes within it labelled ``stage{i} wait F mb{m}``, ``stage{i} decode B mb{m}``,
``stage{i} encode F mb{m}``, the wait for a step's outstanding sends ``stage{i} wait sends``, and the error
probes of auto links (:meth:`StageRunner.run`) ``stage{i} probe``: a :class:`torch.profiler.profile` around
training shows the schedule of every stage (``export_chrome_trace`` writes it for chrome://tracing or
Perfetto). Outside a profiler no label is made (each costs a dispatcher call on entry and exit, tens of
microseconds per action when the caches are cold).

Checks of what a stage receives: on a GPU a decode does not read the received scales or indices to the host
to check them (a synchronisation per packet). The receives and sends of a step run inside
:func:`~aqsgd.compress.base.collecting_pending_checks`: the checks of decoded data (a receive's, and a
sender's of its own packet in AQ-SGD and error feedback, with the low-bit cache's rounding of what they
decoded) stay on the device as flags, and :meth:`StageRunner.end_step` reads them all at once, after waiting
for the step's sends and before the step's loss is returned (so before any optimizer step), raising the error
a check at once would have raised: the first failed check of a receive, else of a send. A stage's own refusal
to send (its codec met NaN/Inf, perhaps computed from a corrupt packet it received) reads the receives'
checks first, so a corrupt packet is reported as such; the checks of a refused send itself are dropped (its
own decode fails because its input was not finite: the refusal says so). On the CPU decodes check at once,
as everywhere outside a runner.

State (checkpoints): :meth:`StageRunner.state_dict` returns the boundary schemes with what each was built for,
:meth:`StageRunner.load_state_dict` builds them and restores their state from the folders their ``save``
wrote.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch.profiler import record_function

from aqsgd.compress import Packet
from aqsgd.compress.base import collecting_pending_checks
from aqsgd.compress.packet import PendingChecks
from aqsgd.errors import NonFiniteError, PeerFailure
from aqsgd.pipeline.compression import BACKWARD_CHANNEL, FORWARD_CHANNEL, CompressionConfig, DirectionSpec
from aqsgd.pipeline.schedule import (
    BACKWARD,
    FORWARD,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    ActionKind,
    get_schedule,
)
from aqsgd.models.stage import Batch
from aqsgd.schemes import BoundaryScheme, DeltaScheme, Phase

_UNLABELLED = contextlib.nullcontext()
# Whether a profiler records now (then every action gets its label). torch keeps this check private: where a
# build lacks it, every action is labelled, as if a profiler were always on.
_profiling = getattr(getattr(torch._C, "_autograd", None), "_profiler_enabled", lambda: True)


__all__ = ["StageRunner", "StepStats", "Transport", "Handle", "forward_plan", "SchemeKey"]

SchemeKey = tuple[int, int, str]
"""``(boundary, channel, side)`` of one boundary scheme: boundary ``b`` joins stages ``b`` and ``b + 1``, the
channel is :data:`~aqsgd.pipeline.compression.FORWARD_CHANNEL` or ``BACKWARD_CHANNEL``, the side ``"sender"``
or ``"receiver"``."""


class Handle(Protocol):
    def wait(self, timeout: float | None = None) -> Any: ...


class Transport(Protocol):
    """What a runner needs from a transport (see :mod:`aqsgd.comm` for the torch.distributed one)."""

    def isend(self, packets: Sequence[Packet], dst: int, channel: int) -> Handle: ...

    def irecv(self, src: int, channel: int) -> Handle: ...


def _ready(handle: Handle) -> bool:
    """Whether a receive's message is there (a handle that cannot tell, as the local runtime's, is)."""
    done = getattr(handle, "done", None)
    return done is None or done()


@dataclasses.dataclass
class StepStats:
    """What one stage did in one step: bytes sent per channel and where the time went."""

    bytes_sent: dict[str, int] = dataclasses.field(default_factory=lambda: {"forward": 0, "backward": 0})
    packets_sent: dict[str, int] = dataclasses.field(default_factory=lambda: {"forward": 0, "backward": 0})
    raw_bytes: dict[str, int] = dataclasses.field(default_factory=lambda: {"forward": 0, "backward": 0})
    # token positions sent (text), and how many of them were padding
    tokens_sent: dict[str, int] = dataclasses.field(default_factory=lambda: {"forward": 0, "backward": 0})
    pad_tokens_sent: dict[str, int] = dataclasses.field(default_factory=lambda: {"forward": 0, "backward": 0})
    compute_s: float = 0.0
    encode_s: float = 0.0
    decode_s: float = 0.0
    wait_s: float = 0.0

    def add(self, other: StepStats) -> None:
        for k in self.bytes_sent:
            self.bytes_sent[k] += other.bytes_sent[k]
            self.packets_sent[k] += other.packets_sent[k]
            self.raw_bytes[k] += other.raw_bytes[k]
            self.tokens_sent[k] += other.tokens_sent[k]
            self.pad_tokens_sent[k] += other.pad_tokens_sent[k]
        self.compute_s += other.compute_s
        self.encode_s += other.encode_s
        self.decode_s += other.decode_s
        self.wait_s += other.wait_s


def _real_rows(grid: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The rows of a ``[rows, length, ...]`` stage output at the flat ``positions`` of the micro-batch's real
    tokens: ``[real tokens, ...]``, what crosses the boundary (differentiable: the backward scatters the
    received gradient into the grid, zeros at the pad positions, whose outputs reach no loss)."""
    return grid.reshape(-1, *grid.shape[2:]).index_select(0, positions)


def _into_grid(rows: torch.Tensor, positions: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The received real-token rows put back at their ``positions`` of a ``[rows, length, ...]`` grid of zeros
    (``shape``: the micro-batch's ``input_ids`` shape); the inverse of :func:`_real_rows`, and
    differentiable, so that the gradient sent back is again one row per real token."""
    flat = rows.new_zeros((shape[0] * shape[1], *rows.shape[1:]))
    return flat.index_copy(0, positions, rows).view(shape[0], shape[1], *rows.shape[1:])


def forward_plan(stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
    """Forward-only plan (evaluation): receive, compute, send, per micro-batch."""
    plan = []
    for mb in range(num_microbatches):
        if stage > 0:
            plan.append(Action(RECV_F, mb))
        plan.append(Action(FORWARD, mb))
        if stage < num_stages - 1:
            plan.append(Action(SEND_F, mb))
    return plan


class StageRunner:
    """One stage of a compressed pipeline; see the module docstring."""

    def __init__(
        self,
        module: nn.Module,
        stage_index: int,
        num_stages: int,
        compression: CompressionConfig,
        transport: Transport,
        *,
        schedule: str = "1f1b",
        device: torch.device | str = "cpu",
        rank_of_stage: Sequence[int] | None = None,
        autocast: torch.dtype | None = None,
        replica: int = 0,
    ) -> None:
        self.module = module
        self.replica = replica  # data-parallel replica: its schemes draw their own random numbers
        self.autocast = autocast
        self.stage = stage_index
        self.num_stages = num_stages
        self.compression = compression
        self.transport = transport
        self.schedule = get_schedule(schedule)
        self.schedule_name = schedule
        self.device = torch.device(device)
        self.ranks = list(rank_of_stage) if rank_of_stage is not None else list(range(num_stages))
        self.schemes: dict[SchemeKey, BoundaryScheme] = {}
        self._built_for: dict[SchemeKey, dict[str, Any]] = {}  # the shape and dtype each scheme was built for
        # what set_link gave each (boundary, channel): its codec (the config's otherwise), the codecs its
        # sender probes, and whether its warm-up is sent with its codec
        self.codecs: dict[tuple[int, int], DirectionSpec] = {}
        self.probes: dict[tuple[int, int], list[str]] = {}
        self.warmup_codec: set[tuple[int, int]] = set()
        self.probing = True  # whether this step's probes run (probe_now)
        self.stats = StepStats()
        self.kept_logits: dict[int, torch.Tensor] = {}
        self.pending_checks = PendingChecks()  # the checks of this step's receives left on the device
        self._unprobed: list[tuple[BoundaryScheme, int, int]] = []  # see begin_step
        self._sent_checks: list[PendingChecks] = []  # those of the pending sends (of their own decodes)
        # an emulated slower stage (benchmarks and tests, --emulate-slow-stage): after each forward and
        # backward it sleeps (slowdown - 1) times what the computation took
        self.slowdown = 1.0
        # wait for the device at the end of each forward and backward, so that compute_s is the device's time
        # (a GPU computes asynchronously; profiling sets it)
        self.synchronize = False

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    # -- schemes -------------------------------------------------------------------------------------
    def scheme_key(self, channel: int, side: str) -> SchemeKey:
        """The key of this stage's ``side`` of a direction: a stage sends forward and receives backward on
        boundary ``stage``, and receives forward and sends backward on boundary ``stage - 1``."""
        if channel == FORWARD_CHANNEL:
            b = self.stage if side == "sender" else self.stage - 1
        else:
            b = self.stage - 1 if side == "sender" else self.stage
        return (b, channel, side)

    def scheme(self, channel: int, side: str, like: torch.Size | tuple[int, ...],
               dtype: torch.dtype) -> BoundaryScheme:
        """The scheme for this stage's side of a direction, built on first use for tensors like ``like``."""
        return self._scheme(self.scheme_key(channel, side), tuple(like), dtype)

    def set_link(self, b: int, channel: int, *, codec: DirectionSpec | None = None,
                 probe: Sequence[str] | None = None, compress_warmup: bool = False) -> None:
        """One direction of boundary ``b`` from the next step on, where given: sent with ``codec`` (the same
        scheme, another codec: the schemes already built switch, those built later take it); its sender
        probes each of ``probe``'s error once per probed step
        (:meth:`~aqsgd.schemes.base.BoundaryScheme.set_probe`); ``compress_warmup``: both sides send the
        warm-up (and AQ-SGD's first visits) with their codec instead of in full
        (:meth:`~aqsgd.schemes.base.BoundaryScheme.compress_warmup`). The run's
        :class:`~aqsgd.pipeline.compression.CompressionConfig` is left as it is (it may be shared)."""
        key = (b, channel)
        if codec is not None:
            if self.compression.direction(b, channel).scheme != codec.scheme:
                raise ValueError(f"boundary {b}: {codec.scheme}:{codec.codec} changes the scheme; only the "
                                 "codec may change")
            self.codecs[key] = codec
        if probe is not None:
            self.probes[key] = list(probe)
        if compress_warmup:
            self.warmup_codec.add(key)
        for (kb, kc, side), scheme in self.schemes.items():
            if (kb, kc) == key:
                self._configure(scheme, key, side, codec=codec is not None, probe=probe is not None,
                                warmup=compress_warmup)

    def _configure(self, scheme: BoundaryScheme, key: tuple[int, int], side: str, *, codec: bool, probe: bool,
                   warmup: bool) -> None:
        """Give a scheme what :meth:`set_link` set for its direction (the parts flagged)."""
        if codec:
            scheme.set_codec(self.codecs[key].codec)
        if probe and side == "sender":
            scheme.set_probe(self.probes[key])
            scheme.probe_now(self.probing)
        if warmup:
            scheme.compress_warmup()

    def probe_now(self, on: bool) -> None:
        """Whether the senders given probes (:meth:`set_link`) probe this step's message."""
        self.probing = on
        for b, channel in self.probes:
            scheme = self.schemes.get((b, channel, "sender"))
            if scheme is not None:
                scheme.probe_now(on)

    def _scheme(self, key: SchemeKey, shape: tuple[int, ...], dtype: torch.dtype) -> BoundaryScheme:
        if key not in self.schemes:
            b, channel, side = key
            self.schemes[key] = self.compression.make(b, channel, side, row_shape=tuple(shape[1:]),
                                                      dtype=dtype, device=self.device, replica=self.replica,
                                                      spec=self.codecs.get((b, channel)))
            self._configure(self.schemes[key], (b, channel), side, codec=False,
                            probe=(b, channel) in self.probes, warmup=(b, channel) in self.warmup_codec)
            self._built_for[key] = {"shape": list(shape), "dtype": str(dtype).removeprefix("torch.")}
        return self.schemes[key]

    def boundary_schemes(self) -> dict[SchemeKey, BoundaryScheme]:
        return dict(self.schemes)

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[SchemeKey, dict[str, Any]]:
        """The schemes built so far, by key: ``shape`` (a list of ints) and ``dtype`` (a name such as
        ``"float32"``) of the first tensor, which sized the scheme, and ``scheme``, the scheme object itself:
        its state is written into a folder with ``scheme.save(folder)`` (caches may be large)."""
        return {key: {**self._built_for[key], "scheme": scheme} for key, scheme in self.schemes.items()}

    def load_state_dict(self, state: Mapping[SchemeKey, Mapping[str, Any]]) -> None:
        """Build the schemes ``state`` names (as :meth:`state_dict` describes them, a scheme already built is
        kept) and restore each from ``entry["scheme"]``: the folder that the saved scheme's ``save`` wrote.
        Schemes not named are left as they are."""
        for key, entry in state.items():
            b, channel, side = key
            if (channel not in (FORWARD_CHANNEL, BACKWARD_CHANNEL) or side not in ("sender", "receiver")
                    or self.scheme_key(channel, side) != (b, channel, side)
                    or not 0 <= b < self.num_stages - 1):
                raise ValueError(f"stage {self.stage} of {self.num_stages} has no scheme {key}")
            dtype = getattr(torch, str(entry["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"unknown dtype {entry['dtype']!r}")
            self._scheme((b, channel, side), tuple(int(n) for n in entry["shape"]),
                         dtype).load(entry["scheme"])

    # -- one step ------------------------------------------------------------------------------------
    def begin_step(self, microbatches: Sequence[Batch], phase: Phase, plan: list[Action] | None = None, *,
                   loss_scale: float = 1.0, keep_logits: bool = False) -> None:
        """Set up a step: the plan, and every receive of the step posted early. The gradients are those of
        ``loss_scale`` times the mean micro-batch loss (``1 / k`` when k passes accumulate into one update).
        With ``keep_logits`` the last stage keeps each micro-batch's logits in :attr:`kept_logits`."""
        self.microbatches = microbatches
        self.loss_scale = loss_scale
        self.keep_logits = keep_logits
        self.phase = Phase(phase)
        m = len(microbatches)
        if plan is None:
            plan = self.schedule(self.stage, self.num_stages, m)
        self.plan = plan
        self.inputs: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.out_grads: dict[int, torch.Tensor] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.kept_logits = {}
        self.stats = StepStats()
        self.pending_checks = PendingChecks()
        self.pending_sends: list[Handle] = []
        self._sent: list[tuple[int, int, str]] = []  # (channel, micro-batch, name) of each pending send
        self._sent_checks = []
        self.recvs: dict[tuple[ActionKind, int], Handle] = {}
        self._prefetched: set[int] = set()  # micro-batches whose cache rows were prefetched this step
        # senders with a message recorded for the error probe, not run yet (their channel and micro-batch)
        self._unprobed: list[tuple[BoundaryScheme, int, int]] = []
        for a in plan:
            if a.kind is RECV_F:
                self.recvs[(RECV_F, a.microbatch)] = self.transport.irecv(self.ranks[self.stage - 1],
                                                                          FORWARD_CHANNEL)
            elif a.kind is RECV_B:
                self.recvs[(RECV_B, a.microbatch)] = self.transport.irecv(self.ranks[self.stage + 1],
                                                                          BACKWARD_CHANNEL)
        self._prefetch(0)

    def _prefetch(self, mb: int) -> None:
        # Micro-batch mb + 1 is prefetched when micro-batch mb's forward starts: at its RECV_F, or at its
        # FORWARD on stage 0 (which receives no forward); each micro-batch at most once per step.
        # evaluation never reads the caches, and its sample ids are not the training set's (they may be
        # beyond the caches' capacity)
        if self.phase not in (Phase.TRAIN, Phase.WARMUP):
            return
        if (mb >= len(self.microbatches) or "sample_ids" not in self.microbatches[mb]
                or mb in self._prefetched):
            return
        self._prefetched.add(mb)
        for s in self.schemes.values():
            if isinstance(s, DeltaScheme):
                s.prefetch(self._ids(mb))

    def _ids(self, mb: int) -> torch.Tensor | None:
        """The ids of what micro-batch ``mb`` sends across a boundary: its real tokens' (examples of their own
        lengths, see :func:`_real_rows`), else its samples'."""
        batch = self.microbatches[mb]
        ids = batch.get("token_ids")
        return ids if ids is not None else batch.get("sample_ids")

    def _label(self, what: str, mb: int | None = None) -> record_function | contextlib.nullcontext:
        """The profiler label ``stage{i} {what} mb{mb}`` (``stage{i} {what}`` without a micro-batch), made
        (and its name formatted) only while a profiler records."""
        if not _profiling():
            return _UNLABELLED
        return record_function(f"stage{self.stage} {what}" if mb is None
                               else f"stage{self.stage} {what} mb{mb}")

    def run(self, action: Action) -> None:
        """Run one action of the plan. Before a receive whose message has not arrived, the error probes this
        step's sends recorded run first (:meth:`_run_probes`): the stage would only wait there. On the first
        micro-batch's path, where they ran before, they held up the pipeline's fill at every boundary."""
        if self._unprobed and action.kind in (RECV_F, RECV_B) and not _ready(
                self.recvs[(action.kind, action.microbatch)]):
            self._run_probes()  # the stage would wait for the message: the error probes fill the wait
        with self._label(action.kind.name, action.microbatch):
            self._run(action)

    def _run_probes(self) -> None:
        """Measure the messages this step's senders recorded for their error probes
        (:meth:`~aqsgd.schemes.base.BoundaryScheme.run_probe`), counted as encoding time; their checks of
        what they decoded are the step's, as a send's."""
        t0 = time.perf_counter()
        unprobed, self._unprobed = self._unprobed, []
        with self._label("probe"), collecting_pending_checks(self.pending_checks):
            for scheme, channel, mb in unprobed:
                try:
                    scheme.run_probe()
                except NonFiniteError as e:  # a message its own codec does not check (fp32 in the warm-up)
                    self._raise_pending()
                    raise self._refused(str(e), self.stage, channel, mb) from None
        self.stats.encode_s += time.perf_counter() - t0

    def _run(self, action: Action) -> None:
        mb, kind = action.microbatch, action.kind
        batch = self.microbatches[mb]
        t0 = time.perf_counter()
        if kind is RECV_F:
            with self._label("wait F", mb):
                packets = self._received(self.recvs.pop((RECV_F, mb)), FORWARD_CHANNEL, mb)
            t1 = time.perf_counter()
            self.stats.wait_s += t1 - t0
            with self._label("decode F", mb), collecting_pending_checks(self.pending_checks):
                x = self.scheme(FORWARD_CHANNEL, "receiver", packets[0].shape, packets[0].dtype).recv(
                    packets, self._ids(mb), phase=self.phase, slot=mb)
            self.stats.decode_s += time.perf_counter() - t1
            self.inputs[mb] = x.detach().requires_grad_(self.phase in (Phase.TRAIN, Phase.WARMUP))
            self._prefetch(mb + 1)
            return
        if kind is FORWARD:
            # stage 0 has no RECV_F to start the next micro-batch's read (a no-op elsewhere)
            self._prefetch(mb + 1)
            grad = self.phase in (Phase.TRAIN, Phase.WARMUP)
            keep = self.is_last and self.keep_logits
            with torch.set_grad_enabled(grad), torch.autocast(self.device.type,
                                                              dtype=self.autocast or torch.bfloat16,
                                                              enabled=self.autocast is not None):
                if keep:
                    # the stage's hook: it keeps its latest logits in last_logits
                    self.module.keep_logits = True
                positions = batch.get("token_positions")
                hidden = self.inputs.get(mb)
                if positions is not None and hidden is not None:  # the real tokens back into their grid
                    hidden = _into_grid(hidden, positions, batch["input_ids"].shape)
                try:
                    out = self.module(hidden, batch)
                finally:
                    if keep:
                        self.module.keep_logits = False
                if positions is not None and not self.is_last:  # only the real tokens cross
                    out = _real_rows(out, positions)
            if self.is_last:
                self.losses[mb] = out.detach()
                if keep:
                    self.kept_logits[mb] = self.module.last_logits
            if grad or not self.is_last:
                self.outputs[mb] = out
            self._computed(t0)
            return
        if kind is SEND_F:
            out = self.outputs[mb] if self.phase in (Phase.TRAIN, Phase.WARMUP) else self.outputs.pop(mb)
            self._send(out.detach(), FORWARD_CHANNEL, self.ranks[self.stage + 1], mb, "forward", t0)
            return
        if kind is RECV_B:
            with self._label("wait B", mb):
                packets = self._received(self.recvs.pop((RECV_B, mb)), BACKWARD_CHANNEL, mb)
            t1 = time.perf_counter()
            self.stats.wait_s += t1 - t0
            with self._label("decode B", mb), collecting_pending_checks(self.pending_checks):
                self.out_grads[mb] = self.scheme(BACKWARD_CHANNEL, "receiver", packets[0].shape,
                                                 packets[0].dtype).recv(packets, self._ids(mb),
                                                                        phase=self.phase, slot=mb)
            self.stats.decode_s += time.perf_counter() - t1
            return
        if kind is BACKWARD:
            out = self.outputs.pop(mb)
            if self.is_last:
                weight = batch.get("loss_weight", 1.0)  # the micro-batch's share of the pass's loss tokens
                grad = torch.full_like(out, self.loss_scale * weight / len(self.microbatches))
            else:
                grad = self.out_grads.pop(mb).to(out.dtype)
            torch.autograd.backward(out, grad_tensors=grad)
            self._computed(t0)
            return
        if kind is SEND_B:
            x = self.inputs.pop(mb)
            if x.grad is None:
                raise RuntimeError(f"stage {self.stage} produced no gradient for its input of micro-batch "
                                   f"{mb}")
            self._send(x.grad, BACKWARD_CHANNEL, self.ranks[self.stage - 1], mb, "backward", t0)
            return
        raise ValueError(f"unknown action {action}")

    def _computed(self, t0: float) -> None:
        """A forward or backward that started at ``t0`` ended: count its time (stretched by the emulated
        :attr:`slowdown`, with a sleep that leaves the cores to the other stages)."""
        if self.synchronize and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.slowdown > 1.0:
            time.sleep((self.slowdown - 1.0) * (time.perf_counter() - t0))
        self.stats.compute_s += time.perf_counter() - t0

    def _refused(self, message: str, sender: int, channel: int, mb: int) -> NonFiniteError:
        """The one-line error of a codec of stage ``sender`` that refused to encode what it sends on
        ``channel`` for micro-batch ``mb`` (``message``: the codec's NonFiniteError), as both ends report
        it."""
        b = sender if channel == FORWARD_CHANNEL else sender - 1
        what, name = (("activations", "forward") if channel == FORWARD_CHANNEL
                      else ("activation gradients", "backward"))
        spec = message.split(": ", 1)[0]
        return NonFiniteError(f"the {what} that stage {sender} sends across boundary {b} ({name}) hold NaN "
                              f"or Inf (micro-batch {mb}, codec {spec})")

    def _wait_sends(self) -> None:
        """Wait for the pending sends; a send whose codec's deferred check failed (the transport refused to
        send it, see :mod:`aqsgd.comm.wire`) raises the same error as an immediate check in :meth:`_send`."""
        for h, (channel, mb, _) in zip(self.pending_sends, self._sent):
            try:
                h.wait()
            except NonFiniteError as e:
                self._raise_pending()
                raise self._refused(str(e), self.stage, channel, mb) from None

    def _raise_pending(self) -> None:
        """Raise the error of this step's first failed check of received data (see the module docstring);
        the checks read are forgotten."""
        error = self.pending_checks.failure()
        if error is not None:
            raise error from None

    def _received(self, handle: Handle, channel: int, mb: int) -> list:
        """The packets of a receive. A refusal (the sender's codec refused the tensor) raises the error the
        sender raises; a failed link first looks for a refusal among this stage's own sends, the likelier
        cause (the peer stopped on receiving it)."""
        try:
            return handle.wait()
        except NonFiniteError as e:
            sender = self.stage - 1 if channel == FORWARD_CHANNEL else self.stage + 1
            raise self._refused(getattr(e, "sender_message", str(e)), sender, channel, mb) from None
        except PeerFailure:
            for h, (c, m, _) in zip(self.pending_sends, self._sent):
                if h.done():
                    try:
                        h.wait(0)
                    except NonFiniteError as e:
                        raise self._refused(str(e), self.stage, c, m) from None
                    except Exception:  # noqa: BLE001 - the receive's own failure is raised below
                        pass
            raise

    def _send(self, x: torch.Tensor, channel: int, dst: int, mb: int, name: str, t0: float) -> None:
        own = PendingChecks()  # of the sender's decode of its own packet (AQ-SGD, error feedback)
        with self._label(f"encode {name[0].upper()}", mb), collecting_pending_checks(own):
            try:
                scheme = self.scheme(channel, "sender", x.shape, x.dtype)
                packets = scheme.send(x, self._ids(mb), phase=self.phase, slot=mb)
                if not getattr(self.transport, "reads_deferred_checks", False):
                    for p in packets:  # checks a codec deferred (on a GPU): read at the hand-over
                        p.raise_deferred()
            except NonFiniteError as e:  # say where: the boundary, the direction, the micro-batch
                self._raise_pending()  # a corrupt packet received before, which made the NaN, comes first
                raise self._refused(str(e), self.stage, channel, mb) from None
        self.stats.encode_s += time.perf_counter() - t0
        self.pending_sends.append(self.transport.isend(packets, dst, channel))
        if scheme.probe_pending:
            self._unprobed.append((scheme, channel, mb))
        self._sent.append((channel, mb, name))
        if own:
            self._sent_checks.append(own)
        self.stats.bytes_sent[name] += sum(p.nbytes for p in packets)
        self.stats.packets_sent[name] += len(packets)
        self.stats.raw_bytes[name] += x.numel() * x.element_size()
        real = self.microbatches[mb].get("real_tokens")
        if real is not None and x.dim() >= 2:  # text: the token positions sent, and how many were padding
            sent = x.numel() // x.shape[-1]
            self.stats.tokens_sent[name] += sent
            self.stats.pad_tokens_sent[name] += sent - int(real)

    def end_step(self) -> torch.Tensor | None:
        """Finish a step: wait for outstanding sends, then raise the error of a failed check of received data
        left on the device (on a GPU one host read, where the loss and gradient norm are read next anyway);
        the last stage returns the mean micro-batch loss."""
        if self._unprobed:  # no receive waited for them: while the sends go
            self._run_probes()
        t0 = time.perf_counter()
        with self._label("wait sends"):
            self._wait_sends()
        for own in self._sent_checks:  # every send went: its checks after the receives'
            self.pending_checks.extend(own)
        self.pending_sends = []
        self._sent = []
        self._sent_checks = []
        self.stats.wait_s += time.perf_counter() - t0
        self._raise_pending()
        if self.is_last and self.losses:
            losses = torch.stack([self.losses[mb] for mb in sorted(self.losses)])
            if "loss_weight" in self.microbatches[0]:  # weighed by loss tokens: the pass's mean per token
                weights = [float(self.microbatches[mb]["loss_weight"]) for mb in sorted(self.losses)]
                return (losses * losses.new_tensor(weights)).mean()
            return losses.mean()
        return None

    def step(self, microbatches: Sequence[Batch], phase: Phase | str = Phase.TRAIN, *,
             loss_scale: float = 1.0, keep_logits: bool = False) -> torch.Tensor | None:
        """One training step (``TRAIN``/``WARMUP``) or evaluation pass (``EVAL``/``EVAL_RAW``); with
        ``keep_logits`` the last stage keeps each micro-batch's logits in :attr:`kept_logits`."""
        phase = Phase(phase)
        plan = None if phase in (Phase.TRAIN, Phase.WARMUP) else forward_plan(
            self.stage, self.num_stages, len(microbatches))
        self.begin_step(microbatches, phase, plan, loss_scale=loss_scale, keep_logits=keep_logits)
        for action in self.plan:
            self.run(action)
        return self.end_step()
