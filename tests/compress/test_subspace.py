"""The subspace stage (``<codec>:pca<r>``): exact bytes, what a basis captures, sender and receiver in step,
the basis on the wire and in checkpoints, error feedback and AQ-SGD carrying what a basis leaves out, and
bytes equal across kernel backends."""

from __future__ import annotations

import pytest
import torch

from aqsgd.compress import HEADER_BYTES, make_codec
from aqsgd.compress.subspace import Subspace, SubspaceCodec
from aqsgd.errors import CodecError, NonFiniteError, PacketMismatchError, SpecError
from aqsgd.schemes import make_scheme
from aqsgd.schemes.base import Kind

D = 64


def _low_rank(n: int, rank: int, seed: int = 0, noise: float = 0.0) -> torch.Tensor:
    """``n`` rows of ``D`` values in a fixed ``rank``-dimensional subspace (the same for every seed), plus
    isotropic ``noise``."""
    basis = torch.linalg.qr(torch.randn(D, D, generator=torch.Generator().manual_seed(99)))[0][:, :rank]
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, rank, generator=g) @ basis.T + noise * torch.randn(n, D, generator=g)


def _pair(scheme: str, codec: str, **kw):
    kw = {"num_samples": 32, "row_shape": (4, D), **kw} if scheme == "delta" else kw
    return make_scheme(scheme, codec, "sender", **kw), make_scheme(scheme, codec, "receiver", **kw)


# -- the spec --------------------------------------------------------------------------------------------
def test_spec_is_canonical_and_pca_outermost():
    assert make_codec("pca16:q4").spec == "q4:pca16"
    assert make_codec("q4:pca16:refresh8:rot64:rc").spec == "q4:rot64:rc:pca16:refresh8"
    assert make_codec("q4:pca16:refresh32").spec == "q4:pca16"  # the default refresh is not spelled
    c = make_codec("q4:rot64:rc:pca16")
    assert isinstance(c, SubspaceCodec) and c.inner.spec == "q4:rot64:rc"
    assert make_codec("q4:pca/4").spec == "q4:pca/4"


def test_a_relative_rank_is_a_share_of_the_row_rounded_up():
    codec = make_codec("q4:pca/4")
    assert codec.rank_for(64) == 16 and codec.rank_for(576) == 144 and codec.rank_for(30) == 8
    assert codec.payload_bytes((10, 576)) == make_codec("q4").payload_bytes((10, 144))
    send, recv = _pair("direct", "q4:pca/4")
    recv.recv(send.send(_low_rank(64, 16), phase="warmup"), phase="warmup")
    recv.recv(send.send(_low_rank(8, 16)))
    assert send.subspace.basis.shape == recv.subspace.basis.shape == (16, D)


@pytest.mark.parametrize("spec,why", [
    ("pca16", "needs a codec for the coefficients"), ("q4:refresh8", "give pca<r> too"),
    ("q4:pca0", "positive integer"), ("q4:pca4:pca8", "'pca' given twice"),
    ("q4:pca4:refresh1:refresh2", "'refresh' given twice"), ("q4:pca/0", "divisor of pca/<k>"),
    ("q4:tile16:refresh8", "give pca<r> too"), ("q4:pca4:tile8:tile16", "'tile' given twice"),
    ("q4:pca4:tile0", "tile of pca<r>:tile<T> must be a positive integer"),
    ("q4:pca16:tile8", "rank 16 above the 8 values"),
])
def test_bad_specs_are_one_line(spec, why):
    with pytest.raises(SpecError, match=why) as e:
        make_codec(spec)
    assert "\n" not in str(e.value) and repr(spec) in str(e.value)


# -- tiles -----------------------------------------------------------------------------------------------
def _tiled(n: int, tile: int, rank: int, seed: int = 0) -> torch.Tensor:
    """``n`` rows of ``D`` values whose every tile of ``tile`` values lies in a ``rank``-dimensional subspace
    of its own (fixed for every seed)."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    for k in range(D // tile):
        basis = torch.linalg.qr(torch.randn(tile, tile, generator=torch.Generator().manual_seed(50 + k)))[0]
        parts.append(torch.randn(n, rank, generator=g) @ basis[:, :rank].T)
    return torch.cat(parts, dim=1)


def test_tiles_spec_rank_and_payload():
    assert make_codec("q4:tile16:pca/4").spec == "q4:pca/4:tile16"
    assert make_codec("tah6:tile64").spec == "tah6:tile64"  # without pca, TAH-Quant's own tiles
    assert make_codec("tah6:tile64:pca16").inner.spec == "tah6:tile64"  # and with TAH inside, too
    assert make_codec("q4:pca2:refresh8:tile16").spec == "q4:pca2:tile16:refresh8"
    codec = make_codec("q4:pca/4:tile16")
    assert codec.rank_for(64) == 16 and codec.rank_for(576) == 144 and codec.rank_for(48) == 12
    assert make_codec("q4:pca3:tile16").rank_for(64) == 12  # pca<r>: r vectors a tile
    assert codec.payload_bytes((10, 64)) == make_codec("q4").payload_bytes((10, 16))
    with pytest.raises(CodecError, match="pca/4:tile16: rows of 60 values are not a whole number of tiles"):
        codec.rank_for(60)
    send, _ = _pair("direct", "q4:pca/4:tile16")
    send.send(_tiled(64, 16, 4), phase="warmup")
    *basis, packet = send.send(_tiled(8, 16, 4))
    # the basis crosses as 16 vectors of one tile's 16 values (4 tiles x 4), 8-bit codes with a scale each
    assert basis[0].shape == (16, 16) and basis[0].nbytes == HEADER_BYTES + 16 * (16 + 2)
    assert packet.nbytes == HEADER_BYTES + make_codec("q4").payload_bytes((8, 16))


def test_a_tiled_basis_is_block_diagonal_and_holds_each_tiles_directions():
    send, recv = _pair("direct", "none:pca/4:tile16")  # lossless coefficients
    x = _tiled(256, 16, 4)
    recv.recv(send.send(x, phase="warmup"), phase="warmup")
    y = recv.recv(send.send(x[:16]))
    state = send.subspace
    assert state.captured[0] > 0.999 and state.spectrum.shape == (D,)
    assert torch.all(state.spectrum[:-1] >= state.spectrum[1:])
    assert (y - x[:16]).norm() / x[:16].norm() < 2e-2  # the 8-bit basis codes' rounding
    # the same as the dense block-diagonal basis: each tile's 4 vectors on its own 16 values
    u = state.basis.view(4, 4, 16)
    dense = torch.block_diag(*u)  # [16, 64]
    assert torch.allclose(dense @ dense.T, torch.eye(16), atol=2e-2)
    z = torch.randn(16, D)
    assert torch.allclose(recv.recv(send.send(z)), (z @ dense.T) @ dense, atol=1e-5)
    assert recv.subspace.basis.shape == (16, 16) and torch.equal(recv.subspace.basis, state.basis)


def test_a_tiled_basis_is_refreshed_tile_by_tile():
    # the rows move to other directions within each tile: subspace iteration follows them
    send, recv = _pair("direct", "none:pca/4:tile16:refresh2")
    recv.recv(send.send(_tiled(128, 16, 4), phase="warmup"), phase="warmup")
    moved = _tiled(64, 16, 8)[:, :]  # 8 directions a tile now, of which the basis holds 4
    for _ in range(8):
        recv.recv(send.send(moved))
    assert send.subspace.version >= 4 and send.subspace.held[0] < send.subspace.captured[-1]
    assert torch.equal(send.subspace.basis, recv.subspace.basis)


def test_error_feedback_through_tiles_carries_what_they_left_out():
    send, recv = _pair("ef", "q8:pca2:tile16:refresh2")
    recv.recv(send.send(_tiled(64, 16, 2), phase="warmup"), phase="warmup")
    sent, got = torch.zeros(16, D), torch.zeros(16, D)
    for step in range(8):
        noise = torch.randn(16, D, generator=torch.Generator().manual_seed(step))
        x = _tiled(16, 16, 2, seed=step) + 0.3 * noise
        sent += x
        got += recv.recv(send.send(x))
    assert torch.allclose(sent - got, send.state.read(None, 0, x), atol=1e-4)


# -- exact bytes -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("inner", ["q4", "q2:token", "q8:rot64", "fp16", "none"])
def test_payload_is_the_inner_codecs_for_the_coefficients(inner):
    codec = make_codec(f"{inner}:pca16")
    inner_codec = make_codec(inner)
    for shape in [(8, D), (3, 5, D), (0, D)]:
        rows = shape[0] * (shape[1] if len(shape) == 3 else 1)
        assert codec.payload_bytes(shape) == inner_codec.payload_bytes((rows, 16))
        send, _ = _pair("direct", f"{inner}:pca16")
        send.send(_low_rank(200, 16), phase="warmup")
        *basis, packet = send.send(torch.randn(shape), phase="eval")
        assert [p.kind for p in basis] == [Kind.BASIS] and basis[0].nbytes == HEADER_BYTES + 16 * (D + 2)
        assert packet.nbytes == HEADER_BYTES + codec.payload_bytes(shape)


def test_a_row_in_the_basis_comes_back_to_the_inner_codecs_error():
    send, recv = _pair("direct", "none:pca8")  # lossless coefficients: only the projection's rounding
    x = _low_rank(256, 8)
    send.send(x, phase="warmup")  # the warm-up: the receiver's side of it is not needed here
    recv.recv(send.send(x[:16], phase="warmup"), phase="warmup")
    y = recv.recv(send.send(x[:16]))
    # the basis crossed as 8-bit codes: reconstruction within their rounding of an orthonormal basis
    assert (y - x[:16]).norm() / x[:16].norm() < 2e-2
    z = torch.randn(16, D)  # mostly outside: only its part in the basis comes back
    basis = send.subspace.basis
    assert torch.allclose(recv.recv(send.send(z)), (z @ basis.T) @ basis, atol=1e-5)


def test_the_first_basis_holds_the_warmups_principal_directions():
    state = Subspace(4)
    x = _low_rank(500, 4, noise=0.01)
    state.observe(x)
    state.renew()
    assert state.captured[0] > 0.99
    assert state.spectrum is not None and state.spectrum.shape == (D,)
    assert torch.all(state.spectrum[:-1] >= state.spectrum[1:])
    u = state.basis
    assert torch.allclose(u @ u.T, torch.eye(4), atol=2e-2)  # orthonormal to the 8-bit codes' rounding


# -- sender and receiver ---------------------------------------------------------------------------------
def test_a_new_basis_crosses_once_ahead_of_its_first_message_and_is_counted():
    send, recv = _pair("direct", "q4:pca8:refresh3")
    x = _low_rank(64, 8, noise=0.1)
    packets = send.send(x, phase="warmup")
    assert [p.kind for p in packets] == [Kind.RAW]
    recv.recv(packets, phase="warmup")
    kinds = []
    for step in range(7):
        packets = send.send(x + step * 0.01)
        kinds.append([Kind(p.kind).name for p in packets])
        recv.recv(packets)
        assert torch.equal(send.subspace.basis, recv.subspace.basis)
        assert send.subspace.version == recv.subspace.version
    # a basis at the first compressed message, then after every 3 messages
    assert kinds == [["BASIS", "DIRECT"], ["DIRECT"], ["DIRECT"], ["BASIS", "DIRECT"], ["DIRECT"], ["DIRECT"],
                     ["BASIS", "DIRECT"]]
    basis_packet = send.send(x)  # the basis is 8 x 64 fp16 values
    assert all(p.kind != Kind.BASIS for p in basis_packet)
    assert send.subspace.version == 3


def test_no_refresh_keeps_the_first_basis():
    send, recv = _pair("direct", "q4:pca8:refresh0")
    recv.recv(send.send(_low_rank(64, 8), phase="warmup"), phase="warmup")
    for step in range(5):
        recv.recv(send.send(_low_rank(16, 8, seed=step + 1)))
    assert send.subspace.version == recv.subspace.version == 1


def test_a_receiver_with_another_basis_refuses_the_packet():
    send, recv = _pair("direct", "q4:pca8")
    recv.recv(send.send(_low_rank(64, 8), phase="warmup"), phase="warmup")
    packets = send.send(_low_rank(16, 8))
    with pytest.raises(PacketMismatchError, match="another basis"):
        recv.recv(packets[1:])  # the basis packet lost: the receiver has none (version 0)
    other = make_scheme("direct", "q4:pca8", "receiver")
    other.recv(packets)
    with pytest.raises(PacketMismatchError, match="another basis"):
        recv.recv(send.send(_low_rank(16, 8)))  # still on no basis, the sender on its first


def test_a_basis_to_a_receiver_without_a_subspace_is_refused():
    send = make_scheme("direct", "q4:pca8", "sender")
    recv = make_scheme("direct", "q4", "receiver")
    send.send(_low_rank(64, 8), phase="warmup")
    with pytest.raises(PacketMismatchError, match="has no subspace stage"):
        recv.recv(send.send(_low_rank(16, 8)))


def test_without_a_warmup_the_first_message_estimates_its_own_basis():
    send, recv = _pair("direct", "none:pca8")
    x = _low_rank(32, 8)
    y = recv.recv(send.send(x))
    assert (y - x).norm() / x.norm() < 2e-2


def test_a_codec_outside_a_scheme_says_it_needs_one():
    with pytest.raises(CodecError, match="with the basis its scheme holds"):
        make_codec("q4:pca8").encode(torch.randn(4, D))


def test_rank_above_the_row_width_is_one_line():
    send = make_scheme("direct", "q4:pca80", "sender")
    send.send(torch.randn(8, D), phase="warmup")
    with pytest.raises(CodecError, match="rank 80 above the 64 values of a row"):
        send.send(torch.randn(8, D))


def test_non_finite_input_is_refused_and_leaves_the_estimate_clean():
    send = make_scheme("direct", "q4:pca8:refresh2", "sender")
    send.send(_low_rank(64, 8), phase="warmup")
    send.send(_low_rank(8, 8))
    bad = _low_rank(8, 8)
    bad[0, 0] = float("nan")
    with pytest.raises(NonFiniteError):
        send.send(bad)
    assert torch.isfinite(send.subspace._sum).all()


# -- what a basis leaves out -----------------------------------------------------------------------------
def test_aqsgd_delta_carries_what_the_basis_left_out_until_a_refresh_sends_it():
    """Every row moves along one direction outside the warm-up's basis. The receiver's cache lags at first
    (the basis drops the move); the deltas then hold it, the refreshed basis (estimated from the deltas)
    takes it in, and the cache converges to the activations."""
    send, recv = _pair("delta", "none:pca8:refresh2")
    ids = torch.arange(8)
    x0 = _low_rank(32, 8).view(8, 4, D)
    drift = torch.zeros(D)
    drift[0] = 1.0
    recv.recv(send.send(x0, ids, phase="warmup"), ids, phase="warmup")
    errors = []
    for step in range(1, 9):
        x = x0 + 0.5 * drift
        y = recv.recv(send.send(x, ids), ids)
        errors.append(float((y - x).norm() / (0.5 * drift.norm() * 32 ** 0.5)))
        assert torch.equal(send.cache.get(ids), recv.cache.get(ids))
    assert errors[0] > 0.3  # the first basis (the warm-up's) missed most of the move
    assert errors[-1] < 0.01, errors  # a refreshed basis took it in; the cache caught up


def test_error_feedback_carries_what_the_basis_left_out():
    """The sum of what the receiver got follows the sum of what was sent, outside the first basis too."""
    send, recv = _pair("ef", "q8:pca8:refresh2")
    recv.recv(send.send(_low_rank(64, 8), phase="warmup"), phase="warmup")
    sent = torch.zeros(16, D)
    got = torch.zeros(16, D)
    for step in range(12):
        noise = torch.randn(16, D, generator=torch.Generator().manual_seed(step))
        x = _low_rank(16, 8, seed=step) + 0.3 * noise
        sent += x
        got += recv.recv(send.send(x))
    residual = send.state.read(None, 0, x)
    assert torch.allclose(sent - got, residual, atol=1e-4)  # everything not delivered is in the error
    assert (sent - got).norm() / sent.norm() < 0.5


# -- checkpoints and backends ----------------------------------------------------------------------------
@pytest.mark.parametrize("scheme,codec", [
    *((s, "q4:rot64:step1:rc:pca8:refresh3") for s in ("delta", "ef", "ef21")),
    ("delta", "q4:rot64:step1:rc:pca2:tile16:refresh3"),
])
def test_save_and_load_continue_bit_for_bit(tmp_path, scheme, codec):
    ids = torch.arange(8)

    def x_at(step):
        return _low_rank(32, 8, seed=step, noise=0.05).view(8, 4, D)

    def run(pair, steps, start=0):
        send, recv = pair
        out = []
        for step in range(start, steps):
            phase = "warmup" if step == 0 else "train"
            packets = send.send(x_at(step), ids, phase=phase)
            out.append(b"".join(p.to_bytes() for p in packets))
            recv.recv(packets, ids, phase=phase)
        return out

    whole = run(_pair(scheme, codec), 9)
    first = _pair(scheme, codec)
    head = run(first, 5)
    for side, name in zip(first, ("send", "recv")):
        side.save(tmp_path / name)
    again = _pair(scheme, codec)
    for side, name in zip(again, ("send", "recv")):
        side.load(tmp_path / name)
        assert "basis.safetensors" in side.mirrored_state()
    assert (tmp_path / "send" / "basis.safetensors").read_bytes() == (
        tmp_path / "recv" / "basis.safetensors").read_bytes()
    assert head + run(again, 9, start=5) == whole


@pytest.mark.parametrize("spec", ["q4:pca16", "q2:token:pca16", "q3:rot64:l2:pca24",
                                  "q4:rot64:step1:rc:pca16", "topk0.25:pca16", "q2:l2:outlier4:zstd:pca16",
                                  "q4:rot64:step1:rc:pca/4:tile16"])
def test_bytes_equal_on_every_cpu_backend(spec):
    packets = {}
    for backend in ("eager", "numba"):
        send = make_scheme("direct", make_codec(spec, backend=backend), "sender")
        out = [send.send(_low_rank(96, 24, noise=0.1), phase="warmup")]
        out += [send.send(_low_rank(40, 24, seed=s, noise=0.1)) for s in range(1, 4)]
        packets[backend] = [p.to_bytes() for ps in out for p in ps]
    assert packets["eager"] == packets["numba"]
