"""Moving packets between pipeline stages: a transport over ``torch.distributed`` with link emulation,
byte accounting and failure detection, and the local launcher (:mod:`aqsgd.comm.launch`). Test helpers that
run N local processes live apart, in :mod:`aqsgd.comm.testing`; no production module imports them.
"""

from aqsgd.comm.link import LinkSpec, Pacer, Transmission, parse_bandwidth, parse_latency
from aqsgd.comm.transport import (
    BACKWARD,
    FORWARD,
    MAX_CHANNEL,
    MAX_PACKETS,
    PREAMBLE_BYTES,
    LinkStats,
    RecvHandle,
    SendHandle,
    StatsKey,
    Transport,
)
from aqsgd.errors import PeerFailure, PeerTimeout, TransportError

__all__ = [
    "BACKWARD",
    "FORWARD",
    "MAX_CHANNEL",
    "MAX_PACKETS",
    "PREAMBLE_BYTES",
    "LinkSpec",
    "LinkStats",
    "Pacer",
    "PeerFailure",
    "PeerTimeout",
    "RecvHandle",
    "SendHandle",
    "StatsKey",
    "Transmission",
    "Transport",
    "TransportError",
    "parse_bandwidth",
    "parse_latency",
]
