"""``python -m benchmarks.boundary_errors``: how well each codec spec represents what crosses the stage
boundaries of a pretrained causal LM, measured on real tensors rather than inferred from training runs.

At the boundaries of an even split of the decoder layers (4 stages: after layers 7, 15 and 22 of SmolLM2's 30)
it records, for one micro-batch of the Wikipedia task:

- the activation ``a`` (what direct quantization sends),
- the activation's change ``a1 - a0`` after ``--steps`` AdamW steps on other samples (what AQ-SGD sends for a
  sample on its next visit: ``--steps`` is one epoch of the reduced convergence study by default),
- the activation gradient ``g`` (what the backward direction sends),

and for every spec the relative error ``|C(x) - x| / |x|`` over the whole tensor, over position 0 of every
sequence and over the other positions, with the wire bytes of one packet. Position 0 is reported apart
because Llama-family models give the first position of a sequence activations about 100x larger than the
others (an "attention sink"); a scale shared with it over a channel leaves the other positions in the zero
bin.

Writes ``benchmarks/results/boundary-errors-<model>.json`` and prints a table. Runs on CPU in about a minute.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

FORWARD_SPECS = ("q2", "q2:l2", "q2:l2:midrise", "q2:token", "q2:token:l2", "q2:token:l2:midrise",
                 "q2:block64:l2", "q3:l2", "q3:l2:midrise", "q4")
BACKWARD_SPECS = ("q4", "q4:l2", "q4:l2:midrise", "q4:token", "q4:token:l2", "q4:token:l2:midrise",
                  "q4:block64", "q6", "q8")


def relative_errors(spec: str, x: torch.Tensor) -> dict[str, float]:
    """Relative L2 error of ``spec``'s round trip on ``x`` (batch, seq, hidden): overall, position 0, the
    rest."""
    from aqsgd.compress.registry import make_codec

    codec = make_codec(spec)
    packet = codec.encode(x)
    err = codec.decode(packet) - x

    def rel(e: torch.Tensor, ref: torch.Tensor) -> float:
        return (e.norm() / ref.norm()).item()

    return {"all": rel(err, x), "position0": rel(err[:, 0], x[:, 0]),
            "other_positions": rel(err[:, 1:], x[:, 1:]), "wire_bytes": len(packet.to_bytes())}


def measure(args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    from aqsgd.bench.boundary import collect_boundary_tensors
    from aqsgd.bench.codecs import machine_description
    from aqsgd.data.datasets import collate, load_task
    from aqsgd.data.sources import require

    torch.manual_seed(args.seed)
    folder = require(args.model) if args.model == "smollm2" else Path(args.model)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ds = load_task(args.task, "train", seq_len=args.seq_len, max_samples=args.samples)
    keys = ("input_ids", "attention_mask", "labels")
    probe = collate([ds[i] for i in range(args.micro_batch)])
    order = torch.randperm(len(ds) - args.micro_batch) + args.micro_batch  # never the probe's samples
    batches = (collate([ds[int(i)] for i in order[step * args.batch: (step + 1) * args.batch]])
               for step in range(args.steps))
    bt = collect_boundary_tensors(model, {k: probe[k] for k in keys},
                                  ({k: b[k] for k in keys} for b in batches), stages=args.stages, lr=args.lr)
    boundaries = bt.boundaries

    rows = []
    for i, a, d, g in zip(boundaries, *(bt.tensors[k] for k in ("activation", "delta", "gradient"))):
        token_norm = a.norm(dim=-1)
        info = {"after_layer": i, "shape": list(a.shape),
                "position0_norm_over_median": (token_norm[:, 0].mean() / token_norm[:, 1:].median()).item(),
                "delta_norm_over_activation_norm": (d.norm() / a.norm()).item()}
        for what, x, specs in (("activation", a, FORWARD_SPECS), ("delta", d, FORWARD_SPECS),
                               ("gradient", g, BACKWARD_SPECS)):
            for spec in specs:
                rows.append({**info, "tensor": what, "spec": spec, **relative_errors(spec, x)})
    return {"benchmark": "boundary_errors", "model": args.model, "task": args.task, "stages": args.stages,
            "seq_len": args.seq_len, "micro_batch": args.micro_batch, "steps": args.steps,
            "batch": args.batch, "lr": args.lr, "seed": args.seed, "boundaries": boundaries, "rows": rows,
            "machine": machine_description(torch.device("cpu")),
            "command": "python -m benchmarks.boundary_errors " + " ".join(sys.argv[1:])}


def markdown_table(result: dict) -> list[str]:
    out = ["| tensor | spec | wire bytes | error, all | error, position 0 | error, other positions |",
           "|---|---|---|---|---|---|"]
    by_key: dict[tuple[str, str], list[dict]] = {}
    for r in result["rows"]:
        by_key.setdefault((r["tensor"], r["spec"]), []).append(r)

    def span(rows: list[dict], key: str) -> str:
        lo, hi = f"{min(r[key] for r in rows):.2f}", f"{max(r[key] for r in rows):.2f}"
        return lo if lo == hi else f"{lo}–{hi}"

    for (tensor, spec), rows in by_key.items():
        out.append(f"| {tensor} | `{spec}` | {rows[0]['wire_bytes']:,} | {span(rows, 'all')} | "
                   f"{span(rows, 'position0')} | {span(rows, 'other_positions')} |")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.boundary_errors",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2",
                   help="smollm2 (offline package) or a local transformers folder")
    p.add_argument("--task", default="wiki", help="causal-LM task of aqsgd.data (default: wiki)")
    p.add_argument("--stages", type=int, default=4, help="even split of the decoder layers (default: 4)")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sample (default: 32, as in the study)")
    p.add_argument("--micro-batch", type=int, default=4,
                   help="samples in the probed micro-batch (default: 4)")
    p.add_argument("--samples", type=int, default=512,
                   help="training samples to draw steps from (default: 512)")
    p.add_argument("--steps", type=int, default=32,
                   help="AdamW steps between the two activations (default: 32)")
    p.add_argument("--batch", type=int, default=8, help="samples per AdamW step (default: 8)")
    p.add_argument("--lr", type=float, default=5e-5,
                   help="AdamW learning rate (default: 5e-5, as in the study)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None,
                   help="JSON path (default: benchmarks/results/boundary-errors-MODEL.json)")
    args = p.parse_args(argv)
    if args.steps * args.batch > args.samples - args.micro_batch:
        p.error(f"--steps x --batch ({args.steps * args.batch}) needs more than --samples - --micro-batch "
                "samples")
    result = measure(args)
    out = Path(args.out or f"benchmarks/results/boundary-errors-{Path(args.model).name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"boundaries after decoder layers {result['boundaries']}; ranges are over the boundaries")
    print("\n".join(markdown_table(result)))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
