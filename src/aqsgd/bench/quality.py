"""``aqsgd bench codecs --quality``: rate-distortion of the quantizer on Gaussian data.

For every scale / grid / granularity variant of ``q<b>`` and ``b = 1..8`` it measures the relative squared
error ``||x - C(x)||^2 / ||x||^2`` on one standard-normal tensor (fixed seed), next to two references for a
unit Gaussian source:

- the best *uniform* scalar quantizer with a given number of levels, computed here: levels spaced by a step
  ``d`` symmetric about zero, each value sent to its nearest level (the outer cells extend to infinity), and
  ``d`` chosen to minimize the expected squared error. ``2^b`` levels is the mid-rise quantizer of Max (1960)
  (0.363, 0.119, 0.037, 0.0115 at 1..4 bits); ``2^b - 1`` levels (zero exact) is what the default mid-tread
  grid can reach (at 1 bit that grid is the 2 levels +-scale, so both references coincide there);
- the Shannon bound ``2^(-2b)``, the distortion-rate function of a Gaussian at ``b`` bits per value, which no
  scalar quantizer reaches.

A relative error of 1 is what sending zeros costs. The codec figures include nothing for the scales (one
per group, ``scale_bits`` per value more on the wire), so the comparison with the references is at equal
bits for the codes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from aqsgd.compress import make_codec

__all__ = [
    "BITS",
    "DEFAULT_VARIANTS",
    "QualityRow",
    "bench_quality",
    "gaussian_uniform_mse",
    "optimal_uniform_mse",
    "reference_rows",
    "shannon_bound",
    "write_quality_json",
    "write_quality_png",
]

BITS = tuple(range(1, 9))
# (label, spec options after q<b>); the empty suffix is the default q<b>
DEFAULT_VARIANTS: tuple[tuple[str, str], ...] = (
    ("default", ""),
    ("max", ":max"),
    ("l2", ":l2"),
    ("midrise", ":midrise"),
    ("l2:midrise", ":l2:midrise"),
    ("token", ":token"),
    ("token:l2", ":token:l2"),
    ("block64", ":block64"),
    ("block64:l2", ":block64:l2"),
    ("tensor", ":tensor"),
    ("tensor:l2", ":tensor:l2"),
    ("tensor:midrise", ":tensor:midrise"),
    ("stochastic", ":stochastic"),
    ("scale32", ":scale32"),
)
REFERENCE_LABELS = {
    "uniform_midrise": "best uniform, 2^b levels",
    "uniform_midtread": "best uniform, 2^b - 1 levels",
    "shannon": "Shannon bound 2^-2b",
}


def _phi(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi) if math.isfinite(x) else 0.0


def _cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def gaussian_uniform_mse(levels: int, step: float) -> float:
    """Expected squared error of a unit Gaussian sent to the nearest of ``levels`` uniform levels.

    The levels are ``(k - (levels - 1) / 2) * step`` for ``k = 0 .. levels - 1`` (symmetric; zero is a level
    when ``levels`` is odd); cell boundaries are the midpoints, the outer cells unbounded. Exact, from
    ``int_a^b (x - c)^2 phi(x) dx``
    ``= (1 + c^2) (Phi(b) - Phi(a)) + a phi(a) - b phi(b) - 2c (phi(a) - phi(b))``.
    """
    if levels < 1:
        raise ValueError(f"levels must be >= 1, got {levels}")
    if levels == 1:
        return 1.0
    centers = [(k - (levels - 1) / 2.0) * step for k in range(levels)]
    total = 0.0
    for k, c in enumerate(centers):
        a = -math.inf if k == 0 else (centers[k - 1] + c) / 2.0
        b = math.inf if k == levels - 1 else (c + centers[k + 1]) / 2.0
        pa, pb = _phi(a), _phi(b)
        apa = 0.0 if math.isinf(a) else a * pa
        bpb = 0.0 if math.isinf(b) else b * pb
        total += (1.0 + c * c) * (_cdf(b) - _cdf(a)) + apa - bpb - 2.0 * c * (pa - pb)
    return total


def optimal_uniform_mse(levels: int) -> tuple[float, float]:
    """``(minimum expected squared error, its step)`` of a uniform ``levels``-level quantizer of N(0, 1).

    Golden-section search over the step; the error is unimodal in the step for a Gaussian source.
    """
    if levels == 1:
        return 1.0, 0.0
    lo, hi = 1e-6, 12.0 / (levels - 1)  # the outermost level is never beyond 6 sigma
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    c, d = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fc, fd = gaussian_uniform_mse(levels, c), gaussian_uniform_mse(levels, d)
    for _ in range(120):
        if fc < fd:
            hi, d, fd = d, c, fc
            c = hi - ratio * (hi - lo)
            fc = gaussian_uniform_mse(levels, c)
        else:
            lo, c, fc = c, d, fd
            d = lo + ratio * (hi - lo)
            fd = gaussian_uniform_mse(levels, d)
    step = (lo + hi) / 2.0
    return gaussian_uniform_mse(levels, step), step


def shannon_bound(bits: int) -> float:
    """Distortion-rate function of a unit Gaussian at ``bits`` bits per value: ``2^(-2 bits)``."""
    return 2.0 ** (-2 * bits)


@dataclass
class QualityRow:
    """One row of the table: a quantizer variant (or a reference) at every bit width."""

    label: str
    kind: str  # "codec" or "reference"
    specs: list[str | None] = field(default_factory=list)  # canonical spec per bit width (codecs only)
    rel_mse: list[float | None] = field(default_factory=list)
    scale_bits: float | None = None  # wire bits per value spent on scales (codecs only)


def reference_rows(bits: Sequence[int] = BITS) -> list[QualityRow]:
    """The best uniform quantizers (``2^b`` and ``2^b - 1`` levels) and the Shannon bound."""
    midrise = [optimal_uniform_mse(2**b)[0] for b in bits]
    midtread = [optimal_uniform_mse(2**b - 1 if b > 1 else 2)[0] for b in bits]
    return [
        QualityRow(REFERENCE_LABELS["uniform_midrise"], "reference", [None] * len(bits), midrise),
        QualityRow(REFERENCE_LABELS["uniform_midtread"], "reference", [None] * len(bits), midtread),
        QualityRow(REFERENCE_LABELS["shannon"], "reference", [None] * len(bits),
                   [shannon_bound(b) for b in bits]),
    ]


def bench_quality(variants: Sequence[tuple[str, str]] = DEFAULT_VARIANTS, *, bits: Sequence[int] = BITS,
                  shape: Sequence[int] = (8, 512, 768), seed: int = 0,
                  device: str | torch.device = "cpu") -> list[QualityRow]:
    """Relative squared error of every variant at every bit width on one N(0, 1) tensor, then the references.

    A variant that is not valid at some width (``:mean`` beyond 1 bit) gets ``None`` there.
    """
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tuple(shape), generator=g, device=device, dtype=torch.float32)
    xd = x.double()
    energy = float(xd.square().sum())
    numel = x.numel()
    rows = []
    for label, suffix in variants:
        specs: list[str | None] = []
        errs: list[float | None] = []
        scale_bits = None
        for b in bits:
            try:
                codec = make_codec(f"q{b}{suffix}")
            except ValueError:
                specs.append(None)
                errs.append(None)
                continue
            y = codec.roundtrip(x, generator=g)
            specs.append(codec.spec)
            errs.append(float((y.double() - xd).square().sum()) / energy)
            code_bytes = -(-numel * b // 8)
            scale_bits = (codec.payload_bytes(tuple(shape)) - code_bytes) * 8 / numel
        rows.append(QualityRow(label, "codec", specs, errs, scale_bits))
    return rows + reference_rows(bits)


def write_quality_json(rows: list[QualityRow], path: str | Path, *, shape: Sequence[int], seed: int,
                       bits: Sequence[int] = BITS, command: str, machine: str) -> None:
    out = {
        "benchmark": "codecs-quality",
        "command": command,
        "machine": machine,
        "data": {"distribution": "normal(0, 1)", "shape": list(shape), "seed": seed, "dtype": "float32"},
        "metric": "relative squared error ||x - C(x)||^2 / ||x||^2",
        "bits": list(bits),
        "rows": [asdict(r) for r in rows],
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1))


def write_quality_png(rows: list[QualityRow], path: str | Path, *, bits: Sequence[int] = BITS,
                      title: str = "") -> None:
    """Rate-distortion plot: relative squared error (log scale) against bits per value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    styles = {REFERENCE_LABELS["uniform_midrise"]: {"color": "black", "ls": "--", "lw": 1.8},
              REFERENCE_LABELS["uniform_midtread"]: {"color": "black", "ls": ":", "lw": 1.8},
              REFERENCE_LABELS["shannon"]: {"color": "grey", "ls": "-.", "lw": 1.8}}
    ncodec = sum(r.kind == "codec" for r in rows)
    colors = iter(plt.get_cmap("tab20")(i % 20) for i in range(ncodec))
    for r in rows:
        pts = [(b, e) for b, e in zip(bits, r.rel_mse) if e is not None and e > 0]
        if not pts:
            continue
        xs, ys = zip(*pts)
        if r.kind == "reference":
            ax.plot(xs, ys, label=r.label, **styles.get(r.label, {}))
        else:
            ax.plot(xs, ys, marker="o", ms=3, lw=1, color=next(colors),
                    label=f"q<b>{':' + r.label if r.label != 'default' else ''}")
    ax.axhline(1.0, color="red", lw=0.8, alpha=0.6)
    ax.text(bits[-1], 1.1, "sending zeros", color="red", ha="right", va="bottom", fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("bits per value (codes only)")
    ax.set_ylabel("relative squared error")
    ax.set_title(title or "quantizer rate-distortion on N(0, 1) data")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
