"""A run that diverges: a step the engine did not apply (a NaN or infinite loss or gradient norm) stops the
run with one line saying what to change, or, with ``--skip-nonfinite N``, is skipped unless it is the
(N+1)-th such step in a row."""

from __future__ import annotations

import logging
from collections.abc import Callable

from aqsgd.errors import DivergedError
from aqsgd.train.config import OptimSection

__all__ = ["FiniteGuard"]

log = logging.getLogger(__name__)


class FiniteGuard:
    """Counts the steps not applied in a row; ``where`` says where the run can continue from."""

    def __init__(self, optim: OptimSection, where: Callable[[], str]) -> None:
        self.optim = optim
        self.where = where
        self.in_a_row = 0

    def check(self, skipped: bool, step: int, loss: float | None, grad_norm: float) -> None:
        """After step ``step``: raise :class:`DivergedError` if it was not applied (``skipped``) once too
        often in a row, else warn."""
        if not skipped:
            self.in_a_row = 0
            return
        what = ", ".join(([f"loss {loss}"] if loss is not None else []) + [f"gradient norm {grad_norm}"])
        self.in_a_row += 1
        allowed = self.optim.skip_nonfinite
        if self.in_a_row > allowed:
            if allowed:
                what += f" ({self.in_a_row} such steps in a row; --skip-nonfinite {allowed} allows {allowed})"
            raise self.diverged(step, what)
        log.warning("step %d skipped: %s (%d of at most %d in a row, --skip-nonfinite)", step, what,
                    self.in_a_row, allowed)

    def diverged(self, step: int, what: str) -> DivergedError:
        """The one-line error of a run that diverged at ``step``: what was not finite, what to change, and the
        checkpoint that continues the run."""
        o = self.optim
        fixes = [f"lower the learning rate (now --lr {o.lr:g})"]
        fixes.append("clip gradients (--max-grad-norm 1; now 0, off)" if o.max_grad_norm <= 0
                     else f"clip harder (--max-grad-norm below {o.max_grad_norm:g})")
        if not o.skip_nonfinite:
            fixes.append("or skip such steps (--skip-nonfinite N)")
        return DivergedError(f"training diverged at step {step}: {what}; the step was not applied. To go on: "
                             f"{', '.join(fixes)}; {self.where()}")
