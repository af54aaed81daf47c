"""What the subspace stage's bases capture at each boundary (:mod:`aqsgd.compress.subspace`), read from a
run's newest checkpoint, and drawn.

Each sender saves, beside the basis both sides hold, its own estimate: the eigenvalues of the sum of
``z^T z`` over the warm-up's rows (the first basis's estimate: activations forward, activation gradients
backward) and, at every refresh, the share of the energy of the rows it encoded since the last one that the
basis in use held (the deltas AQ-SGD sends forward, the gradients plus the carried error backward): what the
subspace kept of what crossed. :func:`boundary_energy` reads them; :func:`plot_energy` draws the warm-up's
cumulative energy by rank, with the rank the basis keeps marked, and the share held by each basis."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from safetensors.torch import load_file

__all__ = ["boundary_energy", "plot_energy"]


def boundary_energy(run_dir: str | Path) -> dict[str, dict[str, Any]]:
    """Per boundary direction (``b0-forward``, ...): the row width, the rank kept, the bases sent, the
    warm-up's cumulative energy share by rank (index ``k``: ranks ``1..k+1``) and the share of the energy
    each refresh's basis captured. Empty where the run has no checkpoint or no subspace stage."""
    checkpoints = sorted(Path(run_dir, "checkpoints").glob("step-*"))
    out: dict[str, dict[str, Any]] = {}
    if not checkpoints:
        return out
    for f in sorted(checkpoints[-1].glob("stage*/schemes/*-sender/basis-estimate.safetensors")):
        own = load_file(str(f))
        held = load_file(str(f.parent / "basis.safetensors"))
        if "basis" not in held:
            continue
        entry: dict[str, Any] = {"width": int(held["basis"].shape[1]), "rank": int(held["basis"].shape[0]),
                                 "bases": int(held["version"][0])}
        spectrum = own.get("spectrum")
        if spectrum is not None and float(spectrum.sum()) > 0:
            entry["warmup_energy_by_rank"] = (spectrum.double().cumsum(0) / spectrum.double().sum()).tolist()
        if "captured" in own:
            entry["captured"] = own["captured"].tolist()
        if "held" in own:
            entry["held"] = own["held"].tolist()
        out[f.parent.name.removesuffix("-sender")] = entry
    return out


def plot_energy(energy: dict[str, dict[str, Any]], png: str | Path, title: str = "") -> Path:
    """Two panels: the warm-up's cumulative energy by rank per boundary direction (the kept rank marked), and
    the share of the energy each refresh's basis captured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, e in sorted(energy.items()):
        style = "-" if "forward" in name else "--"
        if "warmup_energy_by_rank" in e:
            cum = e["warmup_energy_by_rank"]
            (line,) = left.plot(range(1, len(cum) + 1), cum, style, label=f"{name} (r={e['rank']} of "
                                f"{e['width']})")
            left.plot([e["rank"]], [cum[e["rank"] - 1]], "o", color=line.get_color())
        if e.get("held"):
            right.plot(range(1, len(e["held"]) + 1), e["held"], style, marker=".", label=name)
    left.set_xscale("log")
    left.set_xlabel("rank")
    left.set_ylabel("share of the warm-up's energy")
    left.set_title("what the first basis can hold (warm-up rows)")
    if left.lines:
        left.legend(fontsize=7)
    right.set_xlabel("basis (1: the warm-up's, then one per refresh)")
    right.set_ylabel("share of the energy sent through it")
    right.set_title("what each basis held of the rows it encoded")
    right.set_ylim(0, 1.02)
    if right.lines:
        right.legend(fontsize=7)
    else:
        right.text(0.5, 0.5, "no refresh yet", ha="center", transform=right.transAxes)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return Path(png)
