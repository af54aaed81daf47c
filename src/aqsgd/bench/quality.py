"""``aqsgd bench codecs --quality``: quantizer rate-distortion on Gaussian data and real boundary tensors.

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

The same table on real boundary tensors (``--data minilm smollm2``): the activations, AQ-SGD deltas and
activation gradients of :mod:`aqsgd.bench.boundary`, one table per model and kind, each figure the mean over
the boundaries of the relative squared error. The Gaussian references stay as they are, labelled ``N(0,1)``:
they are what the same bits achieve on a Gaussian source, not optima for these tensors (the Shannon row,
``sigma^2 2^(-2b)``, is an upper bound on the distortion-rate function of any source of that variance).

A relative error of 1 is what sending zeros costs. The codec figures include nothing for the scales (one
per group, ``scale_bits`` per value more on the wire), so the comparison with the references is at equal
bits for the codes.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from aqsgd.bench.boundary import BoundaryTensors
from aqsgd.compress import make_codec

__all__ = [
    "BITS",
    "DEFAULT_VARIANTS",
    "QualityRow",
    "bench_quality",
    "boundary_quality",
    "gaussian_uniform_mse",
    "kurtosis",
    "optimal_uniform_mse",
    "reference_rows",
    "shannon_bound",
    "spec_quality",
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


@functools.cache
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
    source: str = "gaussian"  # the data: gaussian, minilm, smollm2
    tensor: str = "normal"  # normal (gaussian); activation, delta or gradient (the models' boundary tensors)
    rel_mse_by_boundary: list[list[float | None]] | None = None  # per bit width, one figure per boundary


def kurtosis(x: torch.Tensor) -> float:
    """``E[x^4] / E[x^2]^2`` over all values: 3 for a Gaussian, larger for heavier tails."""
    x2 = x.double().square()
    return float(x2.square().mean() / x2.mean().square())


def reference_rows(bits: Sequence[int] = BITS, *, source: str = "gaussian", tensor: str = "normal"
                   ) -> list[QualityRow]:
    """The best uniform quantizers (``2^b`` and ``2^b - 1`` levels) and the Shannon bound of a unit Gaussian;
    labelled ``N(0,1) ...`` next to another source's figures."""
    midrise = [optimal_uniform_mse(2**b)[0] for b in bits]
    midtread = [optimal_uniform_mse(2**b - 1 if b > 1 else 2)[0] for b in bits]
    prefix = "" if source == "gaussian" else "N(0,1) "
    return [QualityRow(prefix + REFERENCE_LABELS[key], "reference", [None] * len(bits), errs, None, source,
                       tensor)
            for key, errs in (("uniform_midrise", midrise), ("uniform_midtread", midtread),
                              ("shannon", [shannon_bound(b) for b in bits]))]


def _codec_rows(xs: Sequence[torch.Tensor], variants: Sequence[tuple[str, str]], bits: Sequence[int],
                g: torch.Generator, source: str, tensor: str) -> list[QualityRow]:
    """Every variant at every width on each tensor of ``xs`` (same shape); ``rel_mse`` is the mean over them.

    A variant that is not valid at some width (``:mean`` beyond 1 bit) gets ``None`` there.
    """
    shape = tuple(xs[0].shape)
    numel = xs[0].numel()
    refs = [(x, x.double(), float(x.double().square().sum())) for x in xs]
    rows = []
    for label, suffix in variants:
        specs: list[str | None] = []
        per_x: list[list[float | None]] = []
        scale_bits = None
        for b in bits:
            try:
                codec = make_codec(f"q{b}{suffix}")
            except ValueError:
                specs.append(None)
                per_x.append([None] * len(xs))
                continue
            specs.append(codec.spec)
            per_x.append([float((codec.roundtrip(x, generator=g).double() - xd).square().sum()) / energy
                          for x, xd, energy in refs])
            scale_bits = (codec.payload_bytes(shape) - -(-numel * b // 8)) * 8 / numel
        mean = [None if e[0] is None else sum(e) / len(e) for e in per_x]
        rows.append(QualityRow(label, "codec", specs, mean, scale_bits, source, tensor,
                               per_x if len(xs) > 1 else None))
    return rows


def bench_quality(variants: Sequence[tuple[str, str]] = DEFAULT_VARIANTS, *, bits: Sequence[int] = BITS,
                  shape: Sequence[int] = (8, 512, 768), seed: int = 0,
                  device: str | torch.device = "cpu") -> list[QualityRow]:
    """Relative squared error of every variant at every bit width on one N(0, 1) tensor, then the references.

    A variant that is not valid at some width (``:mean`` beyond 1 bit) gets ``None`` there.
    """
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tuple(shape), generator=g, device=device, dtype=torch.float32)
    return _codec_rows([x], variants, bits, g, "gaussian", "normal") + reference_rows(bits)


def boundary_quality(tensors: BoundaryTensors, source: str,
                     variants: Sequence[tuple[str, str]] = DEFAULT_VARIANTS, *, bits: Sequence[int] = BITS,
                     seed: int = 0, device: str | torch.device = "cpu") -> list[QualityRow]:
    """The table of :func:`bench_quality` for each kind of boundary tensor (activation, delta, gradient) of
    ``tensors``: every figure the mean over the boundaries (each boundary's own figures in
    ``rel_mse_by_boundary``), then the Gaussian references."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)  # stochastic rounding
    rows = []
    for kind, xs in tensors.tensors.items():
        xs = [x.to(device, torch.float32) for x in xs]
        rows += (_codec_rows(xs, variants, bits, g, source, kind)
                 + reference_rows(bits, source=source, tensor=kind))
    return rows


def spec_quality(tensors: dict[str, list[torch.Tensor]], specs: Sequence[str], source: str, *, seed: int = 0,
                 device: str | torch.device = "cpu") -> list[dict]:
    """Named codecs (any spec, fixed or data-dependent size) on each kind of tensor: per spec and kind, the
    relative squared error and the bits per value that really crossed the wire (packet bytes, header and
    scales included, over the values), each the mean over the tensors of that kind (one per boundary)."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    rows = []
    for spec in specs:
        codec = make_codec(spec)
        for kind, xs in tensors.items():
            errs, bits = [], []
            for x in xs:
                x = x.to(device, torch.float32)
                p = codec.encode(x, generator=g)
                y = codec.decode(p)
                xd = x.double()
                errs.append(float((y.double() - xd).square().sum() / xd.square().sum()))
                bits.append(8.0 * p.nbytes / x.numel())
            rows.append({"spec": codec.spec, "source": source, "tensor": kind,
                         "rel_mse": sum(errs) / len(errs), "bits_per_value": sum(bits) / len(bits),
                         "rel_mse_by_boundary": errs, "bits_per_value_by_boundary": bits})
    return rows


def write_quality_json(rows: list[QualityRow], path: str | Path, *, data: dict[str, dict],
                       bits: Sequence[int] = BITS, command: str, machine: str) -> None:
    """The rows, each with its ``source`` and ``tensor``; ``data`` describes each source by name."""
    out = {
        "benchmark": "codecs-quality",
        "command": command,
        "machine": machine,
        "data": data,
        "metric": "relative squared error ||x - C(x)||^2 / ||x||^2 (mean over the boundaries for model "
                  "tensors)",
        "bits": list(bits),
        "rows": [asdict(r) for r in rows],
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1))


def panel_title(source: str, tensor: str) -> str:
    return "N(0, 1) data" if source == "gaussian" else f"{source} {tensor}s"


def write_quality_png(rows: list[QualityRow], path: str | Path, *, bits: Sequence[int] = BITS,
                      title: str = "") -> None:
    """Rate-distortion plot: relative squared error (log scale) against bits per value, one panel per
    source and tensor kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: dict[str, dict[str, list[QualityRow]]] = {}  # a row of panels per source, one per tensor kind
    for r in rows:
        panels.setdefault(r.source, {}).setdefault(r.tensor, []).append(r)
    nrows, ncols = len(panels), max(len(kinds) for kinds in panels.values())
    single = nrows == ncols == 1
    fig, axes = plt.subplots(nrows, ncols, figsize=(8, 5.5) if single else (4.5 * ncols + 2.5, 3.8 * nrows),
                             squeeze=False)
    used = []
    styles = {"uniform_midrise": {"color": "black", "ls": "--", "lw": 1.8},
              "uniform_midtread": {"color": "black", "ls": ":", "lw": 1.8},
              "shannon": {"color": "grey", "ls": "-.", "lw": 1.8}}
    styles = {label: styles[key] for key, label in REFERENCE_LABELS.items()}
    cmap = plt.get_cmap("tab20")
    for axrow, (source, kinds) in zip(axes, panels.items()):
        for ax, (tensor, prows) in zip(axrow, kinds.items()):
            used.append(ax)
            _plot_panel(ax, prows, bits, styles, cmap, single, panel_title(source, tensor))
    for ax in axes.flat:
        ax.set_visible(ax in used)
    if single:
        axes[0, 0].set_title(title or "quantizer rate-distortion on N(0, 1) data")
        axes[0, 0].legend(fontsize=7, ncol=2)
    else:
        fig.suptitle(title or "quantizer rate-distortion; black and grey: N(0, 1) references")
        fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="center right", fontsize=7)
    fig.tight_layout(rect=None if single else (0, 0, 1 - 2.3 / fig.get_figwidth(), 1))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_panel(ax, prows: list[QualityRow], bits: Sequence[int], styles: dict, cmap, single: bool,
                title: str) -> None:
    """One panel: every row of one source and tensor kind."""
    colors = iter(cmap(i % 20) for i in range(len(prows)))
    for r in prows:
        pts = [(b, e) for b, e in zip(bits, r.rel_mse) if e is not None and e > 0]
        if not pts:
            continue
        xs, ys = zip(*pts)
        if r.kind == "reference":
            base = r.label.removeprefix("N(0,1) ")
            ax.plot(xs, ys, label=r.label if single else base, **styles.get(base, {}))
        else:
            ax.plot(xs, ys, marker="o", ms=3, lw=1, color=next(colors),
                    label=f"q<b>{':' + r.label if r.label != 'default' else ''}")
    ax.axhline(1.0, color="red", lw=0.8, alpha=0.6)
    ax.text(bits[-1], 1.1, "sending zeros", color="red", ha="right", va="bottom", fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("bits per value (codes only)")
    ax.set_ylabel("relative squared error")
    ax.grid(True, which="both", alpha=0.3)
    if not single:
        ax.set_title(title, fontsize=10)
