"""Single-process reference executor for a pipeline schedule.

Runs all stages in one process, following the schedule's per-stage action lists in an order that
respects blocking point-to-point semantics (:func:`aqsgd.pipeline.schedule.execution_order`).  It
treats each stage boundary exactly as a distributed pipeline does: the receiver turns the activation
into a fresh leaf with ``.detach().requires_grad_()``, and a stage's backward is
``torch.autograd.backward(output, grad_from_next_stage)``.

All traffic between stages goes through a :class:`Boundary` object (identity by default), the one
place where a compressing runtime hooks in.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from aqsgd.pipeline.schedule import (
    BACKWARD,
    FORWARD,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    ScheduleFn,
    build_plans,
    execution_order,
)
from aqsgd.pipeline.stage import Batch


class Boundary:
    """What happens to tensors crossing a stage boundary; the default passes them through unchanged.

    Subclasses can compress / quantise (possibly with per-micro-batch state keyed by ``sample_ids``
    from the batch, as AQ-SGD needs).
    """

    def activation(self, stage: int, microbatch: int, tensor: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Activation sent from ``stage`` to ``stage + 1`` for ``microbatch``."""
        return tensor

    def gradient(self, stage: int, microbatch: int, tensor: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Gradient sent from ``stage`` back to ``stage - 1`` for ``microbatch``."""
        return tensor


def _send_forward(
    boundary: Boundary, stage: int, microbatch: int, output: torch.Tensor, batch: Batch
) -> torch.Tensor:
    """Message carrying ``stage``'s output activation to the next stage."""
    return boundary.activation(stage, microbatch, output.detach(), batch)


def _recv_forward(message: torch.Tensor) -> torch.Tensor:
    """The next stage's input: a fresh leaf that collects the gradient to send back."""
    return message.detach().requires_grad_()


def _send_backward(
    boundary: Boundary, stage: int, microbatch: int, stage_input: torch.Tensor, batch: Batch
) -> torch.Tensor:
    """Message carrying the gradient w.r.t. ``stage``'s input back to the previous stage."""
    if stage_input.grad is None:
        raise RuntimeError(f"stage {stage} produced no gradient for the input of micro-batch {microbatch}")
    return boundary.gradient(stage, microbatch, stage_input.grad, batch)


def run_pipeline_locally(
    stages: Sequence[nn.Module],
    schedule: str | ScheduleFn,
    microbatches: Sequence[Batch],
    *,
    boundary: Boundary | None = None,
) -> torch.Tensor:
    """Run one training step (forward and backward of every micro-batch) of a pipeline in-process.

    Each micro-batch's loss is scaled by ``1 / len(microbatches)``, so the gradients accumulated in
    the parameters are those of the mean loss over micro-batches.  No optimizer step is taken and
    gradients are not zeroed.

    Args:
        stages: the stage modules in pipeline order (``forward(hidden, batch)``).
        schedule: a schedule name (``"gpipe"``, ``"1f1b"``) or schedule function.
        microbatches: the micro-batch dicts, in order.
        boundary: hand-off of boundary tensors (identity when ``None``).

    Returns:
        The mean of the micro-batch losses (detached).
    """
    num_stages, num_mb = len(stages), len(microbatches)
    if num_stages < 1 or num_mb < 1:
        raise ValueError(f"need at least one stage and one micro-batch, got {num_stages} and {num_mb}")
    boundary = boundary or Boundary()
    last = num_stages - 1
    loss_grad_scale = 1.0 / num_mb

    inputs: list[dict[int, torch.Tensor]] = [{} for _ in stages]
    outputs: list[dict[int, torch.Tensor]] = [{} for _ in stages]
    out_grads: list[dict[int, torch.Tensor]] = [{} for _ in stages]
    forward_box: dict[tuple[int, int], torch.Tensor] = {}  # (destination stage, mb) -> activation
    backward_box: dict[tuple[int, int], torch.Tensor] = {}  # (destination stage, mb) -> gradient
    losses: dict[int, torch.Tensor] = {}

    for s, action in execution_order(build_plans(schedule, num_stages, num_mb)):
        mb, batch = action.microbatch, microbatches[action.microbatch]
        if action.kind is RECV_F:
            inputs[s][mb] = _recv_forward(forward_box.pop((s, mb)))
        elif action.kind is FORWARD:
            out = stages[s](inputs[s].get(mb), batch)
            outputs[s][mb] = out
            if s == last:
                losses[mb] = out.detach()
        elif action.kind is SEND_F:
            forward_box[(s + 1, mb)] = _send_forward(boundary, s, mb, outputs[s][mb], batch)
        elif action.kind is RECV_B:
            out_grads[s][mb] = backward_box.pop((s, mb))
        elif action.kind is BACKWARD:
            out = outputs[s].pop(mb)
            grad = torch.full_like(out, loss_grad_scale) if s == last else out_grads[s].pop(mb)
            torch.autograd.backward(out, grad_tensors=grad)
        elif action.kind is SEND_B:
            backward_box[(s - 1, mb)] = _send_backward(boundary, s, mb, inputs[s].pop(mb), batch)
    return torch.stack([losses[mb] for mb in range(num_mb)]).mean()
