"""fp16 loss scaling across a pipeline (issue 30, hazard 1).

Lightning's ``MixedPrecision`` plugin drives a ``GradScaler`` per process: after the closure it calls
``scaler.unscale_(optimizer)`` (which records a found-inf flag per device), then ``scaler.step``
(which skips the step when any flag is set) and ``scaler.update`` (which halves the scale after a
skip, else grows it). Each rank of a pipeline holds only its stage's gradients, so each would decide
alone: one stage skips while another steps, the scales diverge, and the gradients stage 0 receives
are scaled by the last stage's factor (the loss is scaled on the last stage only).

:func:`agree_on_overflow` makes the decision global: right after ``unscale_`` the flag is
all-reduced (MAX) over the world (every stage of every pipeline), so every rank skips or steps
together and every scaler updates from the same flag; the scales stay equal.

Asynchronous schedules and avgpipe step inside the pipeline, each stage at its own time, through a
weight policy that never unscales: :func:`check_loss_scaling` refuses them with a scaler at setup.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_pipe.errors import PipeConfigError

_AGREES = "_lightning_pipe_agrees"  #: set on a scaler whose ``unscale_`` already agrees (setup runs per Trainer call)


def scaler_of(precision_plugin: Any) -> Any | None:
    """The ``GradScaler`` of Lightning's precision plugin (``16-mixed``), or ``None`` (bf16, 32)."""
    return getattr(precision_plugin, "scaler", None)


def check_loss_scaling(schedule: str, steps_inside: bool, scaler: Any | None) -> None:
    """Refuse a schedule that steps inside the pipeline (asynchronous ones, avgpipe) with fp16 loss scaling.

    Their weight policies step per mini-batch, each stage at a different time, with gradients that
    are still scaled: no unscale, clipping of scaled gradients, no skip on an overflow."""
    if scaler is not None and steps_inside:
        raise PipeConfigError(
            f"schedule={schedule!r} steps the optimizer inside the pipeline, where fp16 loss scaling cannot skip an "
            "overflowed step on every stage together; use precision='bf16-mixed' (no loss scaling) or 32, or a "
            "synchronous schedule (gpipe, 1f1b, interleaved_1f1b, zbv, dualpipev) with 16-mixed."
        )


def agree_on_overflow(scaler: Any, group: Any = None) -> None:
    """Make ``scaler.unscale_`` all-reduce its found-inf flag (MAX) over ``group`` (default: the world).

    Idempotent. Nothing to do in one process (an emulated pipeline holds every stage's gradients in
    one optimizer, so its one scaler sees them all)."""
    if getattr(scaler, _AGREES, False) or not dist.is_available() or not dist.is_initialized():
        return
    if dist.get_world_size(group) == 1:
        return
    unscale, check = scaler.unscale_, scaler._check_inf_per_device

    def agree(optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        """Replace the flags this rank just recorded for ``optimizer`` by the world's agreed one."""
        state = scaler._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = agreed_flags(state["found_inf_per_device"], scaler, group)
        return state["found_inf_per_device"]

    def unscale_and_agree(optimizer: torch.optim.Optimizer) -> None:
        unscale(optimizer)
        agree(optimizer)

    def check_and_agree(optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        # a fused optimizer unscales inside its step: scaler.step looks for infs here instead of in unscale_
        check(optimizer)
        return agree(optimizer)

    scaler.unscale_, scaler._check_inf_per_device = unscale_and_agree, check_and_agree
    setattr(scaler, _AGREES, True)


def agreed_flags(found: dict[torch.device, torch.Tensor], scaler: Any, group: Any = None) -> dict[torch.device, torch.Tensor]:
    """One flag, the MAX over ``group`` of this rank's flags (1.0 where any rank's gradients overflowed).

    A rank whose optimizer has no gradient (found empty) still takes part, with 0, so the collective
    matches on every rank. ``scaler.step`` sums the flags' ``.item()``s and ``scaler.update`` sums
    them on the scale's device: a dict of one entry serves both."""
    if found:
        flag = torch.stack([f.to(next(iter(found.values())).device, torch.float32) for f in found.values()]).amax()
    else:
        flag = torch.zeros((), dtype=torch.float32, device=scaler._scale.device if scaler._scale is not None else "cpu")
    flag = flag.reshape(()).clone()  # GradScaler's own flags are 0-d float32
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)  # no host sync: scaler.step's .item() is the one
    return {flag.device: flag}
