"""The transport's handles and threads are written against :class:`~aqsgd.comm.core.TransportCore`, not
against :class:`~aqsgd.comm.Transport` (which imports them): a real transport must have every member the
protocol names, or a rename would surface only on a background thread at run time."""

from __future__ import annotations

import torch.distributed as dist

from aqsgd.comm import Transport
from aqsgd.comm.core import TransportCore


def _protocol_members() -> set[str]:
    methods = {n for n, v in vars(TransportCore).items() if callable(v) and not n.startswith("__")}
    return set(TransportCore.__annotations__) | methods


def test_a_transport_has_every_member_its_handles_and_threads_use():
    members = _protocol_members()
    assert {"timeout_s", "_closing", "describe_peer", "_account", "_add_wait"} <= members
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        transport = Transport(timeout_s=5.0)
        try:
            missing = sorted(m for m in members if not hasattr(transport, m))
        finally:
            transport.close()
    finally:
        dist.destroy_process_group()
    assert missing == []
