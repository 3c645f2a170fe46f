"""One-process reference of avgpipe (docs/algorithms.md §10), written from the update rule alone.

No engine, no schedule IR, no weight swapping: N replicas are N deep copies of the stage modules,
each with an optimizer of its own, plus a center copy. One round:

1. every replica ``n`` trains one mini-batch: for each of its micro-batches, run the stages in order,
   multiply the loss by its weight and backward (gradients accumulate), then (optionally clip each
   stage's gradients) step its optimizer and zero its gradients;
2. if the round is an averaging round (``round % period == period - 1``), on every stage ``s``:
   asynchronous form, for ``n`` in ``order[s]``: ``D = alpha (W_s^n - C_s); W_s^n -= D; C_s += D``;
   synchronous form: ``C_s += alpha sum_n (W_s^n - C_s)`` and ``W_s^n -= alpha (W_s^n - C_s)`` with the
   pre-round ``C_s``.

Inside a round a replica's forwards and backwards only see its own weights, and a replica's weights
only change at its own STEP and AVG, so the interleaving of replicas on a device does not change any
number except through the order of the asynchronous AVGs on a stage, which is an input (the engine's
merged schedule decides it, :func:`lightning_pipe.schedules.averaging_order`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn


class AvgPipeReference:
    """N replicas of a pipeline of ``stages`` joined by elastic averaging, in one process.

    Args:
        stages: the stage modules (their parameters are the initial weights; they become the center).
        make_optimizer: builds one replica's optimizer from its parameters.
        replicas: ``N``.
        input_fn: turns a micro-batch into the first stage's input.
        loss_fn: ``loss_fn(last_stage_output, micro_batch)`` is the micro-batch loss.
        alpha: averaging rate (``None``: ``0.9 / N``); ``period``: rounds between averagings.
        averaging: ``"async"`` or ``"sync"``.
        clip_val: stage-local gradient-norm clipping before each STEP (``None``: off).
    """

    def __init__(
        self, stages: Sequence[nn.Module], make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        replicas: int, input_fn: Callable[[Any], Any], loss_fn: Callable[[Any, Any], Tensor],
        alpha: float | None = None, period: int = 1, averaging: Literal["async", "sync"] = "async",
        clip_val: float | None = None,
    ) -> None:
        self.center = list(stages)
        self.replicas = [[copy.deepcopy(s) for s in stages] for _ in range(replicas)]
        self.optimizers = [make_optimizer([p for s in r for p in s.parameters()]) for r in self.replicas]
        self.input_fn, self.loss_fn = input_fn, loss_fn
        self.alpha = 0.9 / replicas if alpha is None else alpha
        self.period, self.averaging, self.clip_val = period, averaging, clip_val
        self.rounds = 0

    def train_round(
        self, micro_batches: Sequence[Sequence[Any]], weights: Sequence[Sequence[float]],
        order: Sequence[Sequence[int]] | None = None,
    ) -> list[list[float]]:
        """One round: ``micro_batches[n]`` (with loss ``weights[n]``) train replica ``n``; returns the
        unweighted losses per replica and micro-batch. ``order[s]``: replicas in the order of their
        asynchronous AVG on stage ``s`` (default ``0..N-1``)."""
        losses = []
        for replica, optimizer, mbs, ws in zip(self.replicas, self.optimizers, micro_batches, weights):
            own = []
            for mb, w in zip(mbs, ws):
                x = self.input_fn(mb)
                for stage in replica:
                    x = stage(x)
                loss = self.loss_fn(x, mb)
                (loss * w).backward()
                own.append(float(loss.detach()))
            if self.clip_val:
                for stage in replica:
                    torch.nn.utils.clip_grad_norm_([p for p in stage.parameters() if p.grad is not None], self.clip_val)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(own)
        if self.rounds % self.period == self.period - 1:
            self._average(order or [list(range(len(self.replicas)))] * len(self.center))
        self.rounds += 1
        return losses

    @torch.no_grad()
    def _average(self, order: Sequence[Sequence[int]]) -> None:
        for s, center in enumerate(self.center):
            c = dict(center.named_parameters())
            ws = [dict(r[s].named_parameters()) for r in self.replicas]
            if self.averaging == "async":
                for n in order[s]:
                    for name, cp in c.items():
                        d = self.alpha * (ws[n][name] - cp)
                        ws[n][name] -= d
                        cp += d
            else:
                for name, cp in c.items():
                    old = cp.clone()
                    cp += self.alpha * sum(w[name] - old for w in ws)
                    for w in ws:
                        w[name] -= self.alpha * (w[name] - old)

    def replica_state(self, replica: int, stage: int) -> dict[str, Tensor]:
        """A copy of replica ``replica``'s weights on ``stage``."""
        return {k: v.clone() for k, v in self.replicas[replica][stage].state_dict().items()}

    def center_state(self, stage: int) -> dict[str, Tensor]:
        """A copy of the center's weights on ``stage``."""
        return {k: v.clone() for k, v in self.center[stage].state_dict().items()}
