"""A packet whose deferred check failed (a codec on a GPU refusing NaN input; forced on the CPU here) goes as
a refusal: the sender's wait raises the codec's NonFiniteError, the receiver's a NonFiniteError naming the
sender, and the link carries the next message as usual."""

from __future__ import annotations

import torch

from aqsgd.comm import Transport
from aqsgd.comm.testing import run_processes
from aqsgd.comm.transport import BACKWARD, FORWARD
from aqsgd.compress import make_codec
from aqsgd.compress.base import deferring_checks
from aqsgd.errors import NonFiniteError


def _x(nan: bool) -> torch.Tensor:
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    if nan:
        x[1, 2] = float("nan")
    return x


def _refusal_rank(rank: int, world_size: int) -> dict:
    codec = make_codec("q4")
    out: dict = {}
    with Transport(timeout_s=20, peer_labels={0: "stage 0", 1: "stage 1"}) as t:
        if rank == 0:
            with deferring_checks():
                good, bad = codec.encode(_x(False)), codec.encode(_x(True))
            out["encoded"] = True  # the NaN did not raise inside encode
            hs = [t.isend([good], 1, FORWARD), t.isend([bad, good], 1, FORWARD), t.isend([good], 1, FORWARD)]
            out["outcomes"] = []
            for h in hs:
                try:
                    h.wait()
                    out["outcomes"].append(None)
                except NonFiniteError as e:
                    out["outcomes"].append(str(e))
            t.recv(1, BACKWARD)  # the receiver is done
        else:
            hs = [t.irecv(0, FORWARD) for _ in range(3)]
            out["outcomes"] = []
            for h in hs:
                try:
                    out["outcomes"].append([p.to_bytes() for p in h.wait()])
                except NonFiniteError as e:
                    out["outcomes"].append((str(e), getattr(e, "sender_message", None)))
            t.send([], 0, BACKWARD)
        out["failed"] = t.failed_peers()
        out["stats"] = {tuple(k): v.messages for k, v in t.stats.items()}
    return out


def test_a_refused_packet_fails_both_waits_and_keeps_the_link():
    sender, receiver = run_processes(_refusal_rank, 2, timeout_s=60)
    immediate = ""
    try:
        make_codec("q4").encode(_x(True))
    except NonFiniteError as e:
        immediate = str(e)
    assert immediate and sender["encoded"]
    assert sender["outcomes"] == [None, immediate, None]
    good = make_codec("q4").encode(_x(False)).to_bytes()
    first, refused, third = receiver["outcomes"]
    assert first == [good] and third == [good]
    text, sent = refused
    assert sent == immediate
    assert text == f"stage 0 (rank 0) sent no forward activations, its codec refused them: {immediate}", text
    assert sender["failed"] == [] and receiver["failed"] == []
    assert sender["stats"][(1, FORWARD, "send")] == 3 and receiver["stats"][(0, FORWARD, "recv")] == 3
