"""A user-space wire: forwards Ethernet frames between two devices with delay, jitter and loss.

Used by :mod:`aqsgd.bench.netem` where the kernel has no ``sch_netem`` (many VM and container kernels ship
``tbf`` but not ``netem``). It runs inside a link's *wire* namespace, between the two veth ends that the
kernel bridge normally joins, as ``python -m aqsgd.bench.netem_wire DEV_A DEV_B SHAPE_A_TO_B SHAPE_B_TO_A``
where each shape is JSON ``{"delay_ms": .., "jitter_ms": .., "loss_pct": ..}``.

Frames are read and written through ``AF_PACKET`` sockets with ``PACKET_VNET_HDR``: every frame carries the
kernel's virtio-net header (GSO type and size, checksum offsets), which we pass on unchanged, so TCP
segmentation offload and partial checksums survive the trip (without it the receiver would see 64 KB
frames and unfinished checksums). Consequences: loss applies to a whole GSO frame (up to 64 KB, i.e. a burst
of segments), not to single MTU-sized packets; a frame's delay is ``delay_ms`` plus a uniform draw from
``[-jitter_ms, +jitter_ms]``, and frames are sent in order of their due time, so jitter reorders them, as
netem does. One thread per direction; throughput is that of a Python loop (tens of MB/s), ample for the
fault tests it serves but not for shaping bulk transfers at Gbit/s (the benchmark uses the kernel bridge).
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import random
import select
import socket
import sys
import threading
import time

__all__ = ["Impairment", "forward", "main"]

SOL_PACKET = 263
PACKET_VNET_HDR = 15
PACKET_OUTGOING = 4
ETH_P_ALL = 0x0003
_MAX_FRAME = 10 + 65536 + 64  # virtio-net header + the largest GSO frame + headers


@dataclasses.dataclass(frozen=True)
class Impairment:
    """What one direction of the wire does to each frame."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss_pct: float = 0.0

    @classmethod
    def from_json(cls, text: str) -> Impairment:
        d = json.loads(text)
        return cls(float(d.get("delay_ms", 0)), float(d.get("jitter_ms", 0)), float(d.get("loss_pct", 0)))


def _socket(dev: str) -> socket.socket:
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    s.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
    s.bind((dev, 0))
    return s


def forward(src: socket.socket, dst: socket.socket, imp: Impairment, rng: random.Random,
            stop: threading.Event) -> None:
    """Move frames arriving on ``src`` to ``dst`` with ``imp`` until ``stop`` is set."""
    heap: list[tuple[float, int, bytes]] = []
    seq = 0
    loss = imp.loss_pct / 100.0
    src.setblocking(False)
    while not stop.is_set():
        now = time.monotonic()
        timeout = min(0.2, max(0.0, heap[0][0] - now)) if heap else 0.2
        ready, _, _ = select.select([src], [], [], timeout)
        if ready:
            while True:
                try:
                    data, addr = src.recvfrom(_MAX_FRAME)
                except BlockingIOError:
                    break
                if addr[2] == PACKET_OUTGOING:  # our own transmissions on this device
                    continue
                if loss and rng.random() < loss:
                    continue
                jitter = rng.uniform(-imp.jitter_ms, imp.jitter_ms) if imp.jitter_ms else 0.0
                due = time.monotonic() + max(0.0, imp.delay_ms + jitter) / 1e3
                heapq.heappush(heap, (due, seq, data))
                seq += 1
        now = time.monotonic()
        while heap and heap[0][0] <= now:
            _, _, data = heapq.heappop(heap)
            try:
                dst.send(data)
            except OSError:  # e.g. ENOBUFS under a burst: the frame is lost, as on a real wire
                pass


def main(argv: list[str] | None = None) -> int:
    """``python -m aqsgd.bench.netem_wire DEV_A DEV_B SHAPE_A_TO_B SHAPE_B_TO_A [SEED]``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (4, 5):
        print(main.__doc__, file=sys.stderr)
        return 2
    dev_a, dev_b = args[0], args[1]
    a_to_b, b_to_a = Impairment.from_json(args[2]), Impairment.from_json(args[3])
    seed = int(args[4]) if len(args) == 5 else 0
    a, b = _socket(dev_a), _socket(dev_b)
    stop = threading.Event()
    threads = [threading.Thread(target=forward, args=(a, b, a_to_b, random.Random(seed), stop), daemon=True),
               threading.Thread(target=forward, args=(b, a, b_to_a, random.Random(seed + 1), stop),
                                daemon=True)]
    for t in threads:
        t.start()
    print("ready", flush=True)
    try:
        while all(t.is_alive() for t in threads):
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    stop.set()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
