"""``python -m benchmarks.handover_split``: how much of the transport's hand-over latency is the receiving side.

Two processes on this machine (gloo on loopback, one thread each), the same 1 ms idle before every message
as ``aqsgd bench vs-torch``'s latency test, and three systems timed in turn, in interleaved rounds:

- ``torch``: ``dist.send`` of the fp32 tensor into a receive posted in advance (``dist.irecv``), as
  ``torch.distributed.pipelining`` moves a stage's activations;
- ``receiver``: the same bytes as aqsgd's transport sends them (the preamble and the packet of the ``none``
  codec, built beforehand by the transport's own sender code, one message per sequence number), sent with
  a bare gloo send into an aqsgd ``Transport.irecv``: aqsgd's receiving side alone, with nothing of its
  sending side on the path;
- ``aqsgd``: ``Transport.isend(...).wait()`` into ``Transport.irecv``: both sides.

Hand-over is the time from the sender's clock before it sends to the receiver's clock when its wait returns
(one machine, one clock); every received tensor is checked against the one sent. Prints the medians in ms
and each ratio to torch's of the same run. ``receiver`` minus ``torch`` is what aqsgd's receiving side adds
(its thread, the checks, the hand-off to the waiting caller); ``aqsgd`` minus ``receiver`` is what its
sending side adds. The receiving side is fed through the transport's internals: this measures, it is not
an API.
"""  # noqa: E501, RUF100 (line 1 is the --help description: __doc__.splitlines()[0])

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

SYSTEMS = ("torch", "receiver", "aqsgd")


def _entry(size: int, repeats: int, rounds: int) -> dict[str, list[float]]:
    from aqsgd.comm import transport as T
    from aqsgd.comm.wire import _TAG_BASE
    from aqsgd.comm.workers import _SendItem
    from aqsgd.compress import make_codec

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    bare = T.Transport(timeout_s=60.0)  # its receiver takes the prebuilt messages (its sender builds them)
    full = T.Transport(timeout_s=60.0)
    x = torch.randn(max(1, size // 4), generator=torch.Generator().manual_seed(0))  # the same on both ranks
    codec = make_codec("none")
    packets = [codec.encode(x)]
    buf = torch.empty_like(x)
    group = dist.group.WORLD
    prebuilt: list[list[torch.Tensor]] = []
    # every message of the receiver system, sequence numbers 0, 1, ..., as the transport sends them
    if rank == 0:
        sender = bare._sender(1, T.FORWARD)
        for _ in range((rounds + 1) * repeats):
            item = _SendItem(tuple(packets), T.SendHandle(bare, 1, T.FORWARD, sender.stats_key), None, True,
                               time.monotonic())
            messages, _ = sender._messages(item)
            prebuilt.append([m.clone() for m in messages])
            sender._give_back(item)
    out: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    sent = 0
    try:
        for rnd in range(rounds + 1):  # round 0: warm-up
            for name in SYSTEMS:
                for _ in range(repeats):
                    if rank == 1:
                        posted: Any = (dist.irecv(buf, 0) if name == "torch"
                                       else (bare if name == "receiver" else full).irecv(0, T.FORWARD))
                    dist.barrier()
                    if rank == 0:
                        time.sleep(0.001)
                        t = time.time()
                        if name == "torch":
                            dist.send(x, 1)
                        elif name == "receiver":
                            for m in prebuilt[sent]:
                                group.send([m], 1, _TAG_BASE + T.FORWARD).wait()
                            sent += 1
                        else:
                            full.isend(packets, 1, T.FORWARD).wait()
                    else:
                        got = posted.wait()
                        t = time.time()
                        received = buf if name == "torch" else codec.decode(got[0])
                        if not torch.equal(received, x):
                            raise AssertionError(f"{name}: the received tensor differs from the one sent")
                    if rnd:
                        out[name].append(t)
        dist.barrier()
    finally:
        bare.close()
        full.close()
    return out


def measure(size: int, repeats: int = 150, rounds: int = 3) -> dict[str, float]:
    """Median hand-over in ms of each system for ``size``-byte payloads."""
    from aqsgd.comm.launch import launch_local

    sender, receiver = launch_local(_entry, 2, size, repeats, rounds, run_id="aqsgd-handover-split")
    return {name: 1e3 * statistics.median(b - a for a, b in zip(sender[name], receiver[name]))
            for name in SYSTEMS}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4,524288", help="payload bytes, comma-separated (default: 4,524288)")
    ap.add_argument("--repeats", type=int, default=150, help="messages per system and round (default: 150)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds after a warm-up round (default: 3)")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        ms = measure(size, args.repeats, args.rounds)
        rows.append({"payload_bytes": size, **{f"{k}_ms": v for k, v in ms.items()}})
        print(f"{size:>9,} B  " + "  ".join(f"{k} {v:.3f} ms ({v / ms['torch']:.2f}x)"
                                            for k, v in ms.items()),
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
