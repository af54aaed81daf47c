"""``aqsgd export``: a trained run as a Hugging Face model folder.

The newest complete checkpoint of RUN (or ``--checkpoint N``'s) is written to ``--out DIR`` in the
``save_pretrained`` layout with the tokenizer the data were tokenized with; a classifier keeps its label
names.
Load it with ``AutoModelForCausalLM.from_pretrained(DIR)`` (or ``AutoModelForSequenceClassification``). A
LoRA run is merged into the weights, or written as a PEFT adapter with ``--lora-export adapter``.
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a trained run as a Hugging Face model folder",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", metavar="RUN", help="the run directory (runs/NAME)")
    p.add_argument("--out", required=True, metavar="DIR", help="the folder to write (new or empty)")
    p.add_argument("--checkpoint", type=int, metavar="STEP",
                   help="the checkpoint of this step (default: the newest complete one)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"),
                   help="the weights' dtype in the folder (default: fp32, as trained)")
    p.add_argument("--lora-export", choices=("merged", "adapter"),
                   help="a LoRA run: adapters merged into the weights, or a PEFT adapter folder "
                        "(default: merged; refused for a full fine-tuning)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier export in --out (only a folder an export wrote, holding nothing "
                        "else; the new one is swapped in once complete)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from aqsgd.train.export import export_run

    out = export_run(args.run, args.out, checkpoint=args.checkpoint, dtype=args.dtype, lora=args.lora_export,
                     overwrite=args.overwrite)
    print(f"exported {args.run} to {out}")
    return 0
