"""``python -m benchmarks.projection_roofline``: what the subspace codec's dense products cost next to a copy.

The subspace stage (``pca<r>``, :mod:`aqsgd.compress.subspace`) multiplies every message by its basis: the
encode's projection ``z U^T`` (``[rows, D] x [D, r]``), the decode's ``c U``, and, in training, the sender's
sum ``z^T z`` (``[D, rows] x [rows, D]``) that the next basis is estimated from. This times each, as the
codec calls it (``torch.matmul`` in fp32), beside ``x.clone()`` of the same message (the reference of
``aqsgd bench codecs``' ratios) and one large square fp32 product (what the BLAS reaches on this machine at
all), in interleaved rounds, medians after warm-up. It also times the projection with its operands in
bfloat16 (the cast included), which the codec does not do: a measure of what low-precision matrix units
(AMX here, where present) would change, not a setting.

Prints each product's median ms, GFLOP/s and its time over the clone's. ``aqsgd bench codecs`` asks an
encode of at most twice the clone's time (>= 0.5 of its rate); a product that alone takes longer than that
rules it out, whatever the rest of the codec does.
"""  # noqa: E501, RUF100 (line 1 is the --help description: __doc__.splitlines()[0])

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from aqsgd.bench.codecs import machine_description
from aqsgd.bench.timing import interleaved_medians


def measure(shape: tuple[int, ...], divisor: int, *, repeats: int, warmup: int,
            square: int = 2048) -> dict[str, dict[str, float]]:
    """Median seconds, flops and GFLOP/s of each product (module docstring) on one random message."""
    d = shape[-1]
    rows = math.prod(shape) // d
    r = -(-d // divisor)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g)
    z = x.reshape(rows, d)
    u = torch.linalg.qr(torch.randn(d, r, generator=g))[0].T.contiguous()  # [r, D], orthonormal rows
    c = z @ u.T
    ub = u.to(torch.bfloat16)
    a = torch.randn(square, square, generator=g)
    b = torch.randn(square, square, generator=g)
    calls = {
        "clone": (lambda: x.clone(), 0),
        "encode projection z U^T": (lambda: z @ u.T, 2 * rows * d * r),
        "decode c U": (lambda: c @ u, 2 * rows * r * d),
        "sender's sum z^T z": (lambda: z.T @ z, 2 * rows * d * d),
        "projection in bf16 (cast included)": (lambda: z.to(torch.bfloat16) @ ub.T, 2 * rows * d * r),
        f"square fp32 {square}^3": (lambda: a @ b, 2 * square ** 3),
    }
    t = interleaved_medians({k: f for k, (f, _) in calls.items()}, device=torch.device("cpu"),
                            warmup=warmup, repeats=repeats)
    return {k: {"ms": t[k] * 1e3, "gflops": flops / t[k] / 1e9 if flops else 0.0,
                "vs_clone": t[k] / t["clone"]} for k, (_, flops) in calls.items()}


def table(d: dict) -> list[str]:
    """A written result as the markdown table of docs/bench-codecs.md (``python -m benchmarks.render``)."""
    out = ["| product | ms | GFLOP/s | x the clone's time |", "|---|---|---|---|"]
    for name, v in d["results"].items():
        rate = f"{v['gflops']:.0f}" if v["gflops"] else ""
        out.append(f"| {name} | {v['ms']:.2f} | {rate} | {v['vs_clone']:.2f} |")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs="+", default=[8, 512, 768],
                   help="the message's shape, rows of its last dimension (default: aqsgd bench codecs')")
    p.add_argument("--divisor", type=int, default=4, help="the rank is D / divisor (default 4: pca/4)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = measure(tuple(args.shape), args.divisor, repeats=args.repeats, warmup=args.warmup)
    print(f"{tuple(args.shape)} fp32, rank D/{args.divisor}, on {machine_description(torch.device('cpu'))}; "
          f"medians of {args.repeats} interleaved rounds after {args.warmup}")
    for name, v in out.items():
        rate = f"{v['gflops']:7.1f} GFLOP/s" if v["gflops"] else " " * 15
        print(f"  {name:38s} {v['ms']:8.3f} ms  {rate}  {v['vs_clone']:5.2f}x the clone")
    if args.json:
        command = " ".join(["python -m benchmarks.projection_roofline",
                            *(sys.argv[1:] if argv is None else argv)])
        with open(args.json, "w") as f:
            json.dump({"benchmark": "projection-roofline", "command": command,
                       "machine": machine_description(torch.device("cpu")), "torch": torch.__version__,
                       "shape": list(args.shape), "divisor": args.divisor, "results": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
