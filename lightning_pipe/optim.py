"""One optimizer made of several, so that ``configure_optimizers`` can return Muon and AdamW together.

Lightning's automatic optimization takes exactly one optimizer, and so does every schedule that steps
inside the pipeline. ``torch.optim.Muon`` only updates 2-D matrices; a transformer's embeddings,
head, norms and biases need another optimizer (usually AdamW). :class:`CombinedOptimizer` is that
pair as one ``torch.optim.Optimizer``: its ``param_groups`` are the members' own group dicts and all
members share its ``state``, so everything that reads or rewrites an optimizer's groups and state
(the weight policies, learning-rate schedulers, checkpoints, ``LearningRateMonitor``) sees all of
them.

    def configure_optimizers(self):
        matrices = [p for n, p in self.blocks.named_parameters() if p.ndim == 2]
        others = [p for p in self.parameters() if all(p is not m for m in matrices)]
        return CombinedOptimizer(torch.optim.Muon(matrices, lr=0.02, weight_decay=0.0),
                                 torch.optim.AdamW(others, lr=2e-3))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class CombinedOptimizer(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters, stepped together as one.

    Args:
        optimizers: the members, each already built over its own parameters (no parameter in two).

    ``step()`` steps every member in order; ``state_dict()`` / ``load_state_dict()`` hold all of them
    (groups in member order), so a checkpoint resumes into a ``CombinedOptimizer`` built the same way.
    """

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        if not optimizers:
            raise ValueError("CombinedOptimizer needs at least one optimizer.")
        seen: set[int] = set()
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if id(p) in seen:
                        raise ValueError(f"a parameter of shape {tuple(p.shape)} is in two of the combined optimizers; "
                                         "give each parameter to one of them.")
                    seen.add(id(p))
        self.optimizers = list(optimizers)
        params = [p for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]]
        super().__init__(params, {})
        self._share()

    def _share(self) -> None:
        """Make ``param_groups`` the members' group dicts and ``state`` the one dict they all use."""
        state = self.state
        for optimizer in self.optimizers:
            for p, value in optimizer.state.items():
                state[p] = value
            optimizer.state = state
        self.param_groups = [group for optimizer in self.optimizers for group in optimizer.param_groups]

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Evaluate ``closure`` once (with gradients enabled), then step every member."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for optimizer in self.optimizers:
            optimizer.step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by a ``CombinedOptimizer`` of the same members (the groups in order)."""
        super().load_state_dict(state_dict)
        groups = iter(self.param_groups)  # super() rebuilt them: hand each member its share again
        for optimizer in self.optimizers:
            optimizer.param_groups = [next(groups) for _ in optimizer.param_groups]
            optimizer.state = self.state

    def __repr__(self) -> str:
        return f"CombinedOptimizer({', '.join(type(o).__name__ for o in self.optimizers)})"
