"""What a link's handles and background threads use of the transport that owns them.

:class:`~aqsgd.comm.transport.Transport` starts the threads (:mod:`aqsgd.comm.workers`) and hands out the
handles (:mod:`aqsgd.comm.handles`), so those modules cannot import it back; they are written against this
protocol instead, which the transport satisfies as it is (no registration, no base class). It names the state
they read (settings, routing, the closing flag) and the counters they feed, and nothing of the public API.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from aqsgd.comm.device import HostStager
    from aqsgd.comm.stats import StatsKey
    from aqsgd.compress.packet import Packet

__all__ = ["TransportCore"]


class TransportCore(Protocol):
    """The transport as its handles and per-link threads see it."""

    timeout_s: float  # default timeout of a handle's wait()
    peer_labels: dict[int, str]  # names of peers for error messages
    checksum: bool  # CPU payloads carry a CRC-32
    device: torch.device  # where received packets are placed
    group: dist.ProcessGroup | None
    _cuda: bool  # ``device`` is a GPU
    _nccl: bool  # packets go GPU to GPU over NCCL sub-groups
    _stager: HostStager | None  # gloo from a GPU: the device-to-host copies of outgoing payloads
    _wire_device: torch.device  # where the bytes on the wire live
    _closing: threading.Event  # set by close(): threads stop, queued requests fail

    def describe_peer(self, rank: int) -> str: ...

    def channel_name(self, channel: int) -> str: ...

    def _route(self, peer: int, channel: int, direction: str) -> tuple[dist.ProcessGroup | None, int]: ...

    def _account(self, key: StatsKey, packets: Sequence[Packet], busy_s: float = 0.0) -> None: ...

    def _count(self, key: StatsKey, packets: int, payload_bytes: int, busy_s: float = 0.0,
               backlog_s: float = 0.0) -> None: ...

    def _add_wait(self, key: StatsKey, seconds: float) -> None: ...
