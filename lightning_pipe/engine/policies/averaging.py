"""avgpipe's weights on one device: N replicas with their own optimizer state, and the center copy.

docs/algorithms.md §10. Every replica ``n`` of this stage has its own weights ``W^(n)`` (leaf
tensors, one dict per replica) and its own optimizer state; ``C`` is the center copy.

* Forwards of replica ``n`` run the module bound to ``W^(n)`` (:class:`~.base.Binding`,
  docs/algorithms.md §1.1), so the graph references ``W^(n)`` and backwards accumulate into
  ``W^(n)[name].grad`` whatever other replicas do in between.
* STEP of replica ``n`` swaps its storages into the module's own Parameter objects by pointer
  (``p.data``, ``p.grad``, ``optimizer.state[p]``) and calls the *user's* optimizer, so one optimizer
  (and its lr schedulers and param-group options) serves every replica. Afterwards the parameters
  point at the center again, so evaluation, ``state_dict()`` and checkpoints see ``C``, and
  ``optimizer.state`` holds replica 0's state (what a plain, non-avgpipe resume would use).
* AVG, every ``period`` rounds: asynchronous form right after the replica's STEP,
  ``D = alpha (W^(n) - C); W^(n) -= D; C += D``; synchronous form once all N replicas stepped,
  ``C <- C + alpha sum_n (W^(n) - C)`` and ``W^(n) <- W^(n) - alpha (W^(n) - C)`` with the pre-round ``C``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any, ContextManager

import torch
from torch import Tensor, nn

from lightning_pipe.engine.collectives import GradientReducer
from lightning_pipe.engine.policies.base import Binding, WeightPolicy, detached_copy, fused_chunks
from lightning_pipe.engine.policies.options import Averaging


class ElasticAveraging(WeightPolicy):
    """The weight policy of avgpipe for one device (see the module docstring).

    Args:
        root: the module owning the parameters (a stage, or the rank's whole LightningModule).
        optimizer: the user's optimizer over ``root``'s parameters.
        stage: this stage's index; ``stages``: stages per pipeline.
        micro_batches: micro-batches per replica mini-batch.
        replicas: parallel pipelines ``N`` on this device.
        alpha: elastic averaging rate; ``None``: ``0.9 / N`` (EASGD guidance).
        period: average every ``period`` rounds (``tau``).
        averaging: ``"async"`` (after each replica's STEP) or ``"sync"`` (after all N STEPs).
        clip: called on the replica's gradients before its STEP (stage-local clipping).
        gradient_group: data-parallel pipelines' stage group; each replica's gradient is averaged
            over its ``gradient_world`` members before the STEP (``None``: one pipeline).
        gradient_world: how many pipelines ``gradient_group`` spans.
        names: the parameters of ``root`` this stage owns (default: all); the one-process emulation
            gives each stage's policy its own share of one module.
    """

    def __init__(
        self, root: nn.Module, optimizer: torch.optim.Optimizer, stage: int, stages: int, micro_batches: int,
        replicas: int, alpha: float | None = None, period: int = 1, averaging: Averaging = "async",
        clip: Callable[[Sequence[Tensor]], None] | None = None, gradient_group: Any = None, gradient_world: int = 1,
        names: Collection[str] | None = None,
    ) -> None:
        super().__init__(root, optimizer, stage, stages, micro_batches, clip=clip, names=names)
        if replicas < 1 or period < 1 or averaging not in ("async", "sync"):
            raise ValueError(f"replicas={replicas} and period={period} must be >= 1 and averaging 'async' or 'sync'.")
        self.replicas = replicas
        self.alpha = 0.9 / replicas if alpha is None else float(alpha)
        self.period = period
        self.averaging = averaging
        self.gradient_group, self.gradient_world = gradient_group, gradient_world
        with torch.no_grad():
            self.center = {n: p.detach().clone() for n, p in self.params.items()}
            self.weights = [{n: detached_copy(p) for n, p in self.params.items()} for _ in range(replicas)]
        self._binding = Binding(self.root, self.params)
        # a state the optimizer already has (e.g. a plain checkpoint) starts every replica
        initial = {n: self.optimizer.state.get(p) for n, p in self.params.items()}
        self.states: list[dict[str, dict[str, Any]]] = [
            {n: _clone_state(s) for n, s in initial.items() if s} for _ in range(replicas)
        ]
        self.rounds = 0  # rounds finished (every replica averaged)
        self.current = 0
        self._averaged: list[int] = []  # replicas whose AVG ran in this round
        self._show_center()

    # -- hooks the executor calls --------------------------------------------------------------
    def select(self, replica: int) -> None:
        self.current = replica

    def forward(self, g: int) -> ContextManager[Any]:
        return self._binding.bound(self.weights[self.current])

    def backward(self, g: int) -> ContextManager[Any]:
        # the forward's graph references W^(current); a checkpointed stage recomputes it here, bound again
        return self._binding.bound(self.weights[self.current])

    def finished(self, g: int) -> None: ...

    def step(self) -> None:
        """STEP of the current replica with the user's optimizer, on the replica's own state."""
        replica, weights = self.current, self.weights[self.current]
        grads = {n: w.grad for n, w in weights.items()}
        self.used_names |= {n for n, g in grads.items() if g is not None}
        if self.gradient_world > 1:  # every pipeline's replica reduces the same tensors, used here or not
            GradientReducer(list(weights.values()), self.gradient_group, self.gradient_world).finish()
            grads = {n: w.grad for n, w in weights.items()}
        state = self.optimizer.state
        for name, p in self.params.items():
            p.data, p.grad = weights[name].data, grads[name]
            if name in self.states[replica]:
                state[p] = self.states[replica][name]
            else:
                state.pop(p, None)
        if self.clip is not None:
            self.clip([p for p in self.params.values() if p.grad is not None])
        self.optimizer.step()  # updates W^(replica) in place: p shares its storage
        for name, p in self.params.items():
            if p in state and state[p]:
                self.states[replica][name] = state[p]
            p.grad = weights[name].grad = None
        self.steps += 1
        self._show_center()

    def average(self) -> None:
        """AVG of the current replica (a no-op outside averaging rounds)."""
        replica = self.current
        if self.rounds % self.period == self.period - 1:
            with torch.no_grad():
                if self.averaging == "async":  # d = alpha * (W - C); W -= d; C += d, fused: four launches, not four per tensor
                    centers = list(self.center.values())
                    weights = [self.weights[replica][name] for name in self.center]
                    for c in fused_chunks(centers):
                        pulls = torch._foreach_sub(weights[c], centers[c])
                        torch._foreach_mul_(pulls, self.alpha)
                        torch._foreach_sub_(weights[c], pulls)
                        torch._foreach_add_(centers[c], pulls)
                elif len(self._averaged) == self.replicas - 1:  # the round's last replica: all have stepped
                    for name, c in self.center.items():
                        ws = [self.weights[n][name] for n in range(self.replicas)]
                        pull = torch.stack([w - c for w in ws]).sum(0).mul_(self.alpha)
                        for w in ws:
                            w.sub_((w - c).mul_(self.alpha))
                        c.add_(pull)
        self._averaged.append(replica)
        if len(self._averaged) == self.replicas:
            self._averaged = []
            self.rounds += 1

    # -- helpers -------------------------------------------------------------------------------
    def _show_center(self) -> None:
        """Point the module's parameters at the center and the optimizer at replica 0's state."""
        for name, p in self.params.items():
            p.data = self.center[name]
            if name in self.states[0]:
                self.optimizer.state[p] = self.states[0][name]
            else:
                self.optimizer.state.pop(p, None)

    def copies(self) -> int:
        return self.replicas + 1

    def distance(self) -> float:
        """Root mean square over replicas of ``||W^(n) - C||``: how far the replicas drifted from the center."""
        total = 0.0
        for weights in self.weights:
            total += sum(float((w.detach() - self.center[n]).pow(2).sum()) for n, w in weights.items())
        return (total / self.replicas) ** 0.5

    def state_dict(self) -> dict[str, Any]:
        """Everything an exact resume needs beyond the center (which is the model's state); keyed by
        parameter name, so stages' states merge (:func:`~.base.merge_states`) and any split resumes."""
        cpu = lambda t: t.detach().cpu() if isinstance(t, Tensor) else t  # noqa: E731
        return {
            "policy": type(self).__name__,
            "rounds": self.rounds,
            "steps": self.steps,
            "center": {n: cpu(c) for n, c in self.center.items()},
            "weights": [{n: cpu(w) for n, w in ws.items()} for ws in self.weights],
            "states": [{n: {k: cpu(v) for k, v in s.items()} for n, s in states.items()} for states in self.states],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["weights"]) != self.replicas:
            raise ValueError(
                f"the checkpoint holds {len(state['weights'])} avgpipe replicas but parallel_pipelines={self.replicas}; "
                "resume with the same number of parallel pipelines."
            )
        self.rounds, self.steps = state["rounds"], state["steps"]
        center = self._own(state["center"], "avgpipe center")
        with torch.no_grad():
            for name, c in self.center.items():
                if name in center:
                    c.copy_(center[name])
            for ws, saved in zip(self.weights, state["weights"]):
                for name, w in ws.items():  # a replica without saved weights starts from the center
                    w.copy_(saved[name] if name in saved else self.center[name])
        self.states = [
            {n: {k: v.to(self.params[n].device) if isinstance(v, Tensor) and v.dim() else v for k, v in s.items()}
             for n, s in states.items() if n in self.params}
            for states in state["states"]
        ]
        self._show_center()


def _clone_state(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, Tensor) else v for k, v in state.items()}
