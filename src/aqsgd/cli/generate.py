"""``aqsgd generate``: a trained model answering prompts.

SOURCE is a run directory (its newest complete checkpoint, or ``--checkpoint STEP``'s; a LoRA run's
adapters merged into the weights) or a model folder in the ``save_pretrained`` layout (what ``aqsgd export``
writes, merged or as a PEFT adapter). Prompts come from ``--prompt TEXT`` (repeatable) and ``--prompts FILE``:
one prompt a line, or, in a ``.jsonl`` file, one JSON object a line with a ``prompt`` (text) or a
``messages`` field (a conversation: a list of ``{"role": ..., "content": ...}``).

A chat template is applied (with ``add_generation_prompt``) where there is one: ``--chat-template FILE``,
else the template the run was trained with, else the tokenizer's own; without one (or with
``--no-chat-template``) prompts go to the model as raw text, which the output says once. Every generation
setting left out keeps the model's generation config, and transformers' defaults where that sets none: this
command sets none of its own.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="answer prompts with a run's or an exported model",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", metavar="SOURCE",
                   help="a run directory (runs/NAME) or a model folder (an export)")
    p.add_argument("--checkpoint", type=int, metavar="STEP",
                   help="a run's checkpoint of this step (default: the newest complete one)")
    p.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt (repeatable)")
    p.add_argument("--prompts", metavar="FILE",
                   help="prompts, one a line; a .jsonl file: one JSON object a line with a \"prompt\" or a "
                        "\"messages\" field (after any --prompt)")
    template = p.add_mutually_exclusive_group()
    template.add_argument("--chat-template", metavar="FILE",
                          help="a Jinja chat template to apply (default: the run's, else the tokenizer's)")
    template.add_argument("--no-chat-template", action="store_true",
                          help="give text prompts to the model raw, even where there is a chat template")
    given = "default: the model's generation config, else transformers'"
    p.add_argument("--max-new-tokens", type=int, metavar="N", help=f"tokens to generate at most ({given})")
    p.add_argument("--do-sample", action=argparse.BooleanOptionalAction,
                   help=f"sample (--do-sample) or take the likeliest token (--no-do-sample) ({given})")
    p.add_argument("--temperature", type=float, metavar="T", help=f"sampling temperature ({given})")
    p.add_argument("--top-k", type=int, metavar="K", help=f"sample among the K likeliest tokens ({given})")
    p.add_argument("--top-p", type=float, metavar="P", help=f"nucleus sampling mass ({given})")
    p.add_argument("--seed", type=int, metavar="N",
                   help="each prompt's sampling starts from torch.manual_seed(N) (default: not seeded)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where to generate (default: auto, a GPU where there is one)")
    p.add_argument("--json", action="store_true", help="print the prompts and answers as one JSON document")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from aqsgd.errors import SpecError
    from aqsgd.train.generate import Sampling, load, read_prompts

    # the prompts and the settings before the model, whose loading may take long
    prompts: list[Any] = list(args.prompt or []) + (read_prompts(args.prompts) if args.prompts else [])
    if not prompts:
        raise SpecError("give --prompt TEXT or --prompts FILE: there is nothing to answer")
    sampling = Sampling(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
                        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    generator = load(args.source, checkpoint=args.checkpoint, chat_template=args.chat_template,
                     device=args.device)
    use_template = not args.no_chat_template
    answers = generator.answer(prompts, sampling=sampling, seed=args.seed, use_template=use_template)
    template = generator.template_from if use_template else None
    if args.json:
        settings = {**sampling.given(), **({"seed": args.seed} if args.seed is not None else {})}
        print(json.dumps({"source": generator.source, "chat_template": template, "settings": settings,
                          "results": [{"prompt": p, "answer": a} for p, a in zip(prompts, answers)]},
                         indent=1, ensure_ascii=False))
        return 0
    print(f"{generator.source}: {_template_note(generator.template_from, use_template)}")
    for i, (prompt, answer) in enumerate(zip(prompts, answers), 1):
        print(f"\n=== prompt {i}\n{_shown(prompt)}\n=== answer {i}\n{answer}")
    return 0


def _template_note(template_from: str | None, use_template: bool) -> str:
    """The output's one statement of how the prompts reached the model."""
    if not use_template:
        return "prompts given as raw text (--no-chat-template)"
    if template_from is None:
        return "prompts given as raw text (the tokenizer has no chat template; --chat-template FILE gives " \
               "one)"
    return f"prompts given through {template_from}, with the generation prompt added"


def _shown(prompt: Any) -> str:
    """A prompt as the output shows it: its text, or a conversation's turns as ``role: content``."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)
