"""Argument types shared by subcommands; each raises argparse errors that name the bad value."""

from __future__ import annotations

import argparse


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape must be comma-separated integers, got {text!r}") from None
    if not shape or any(d < 1 for d in shape):
        raise argparse.ArgumentTypeError(f"shape dims must be positive, got {text!r}")
    return shape


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v
