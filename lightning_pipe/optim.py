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
from torch import Tensor


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
        super().__init__([{"params": params}], {})  # one group, so members without parameters (a frozen stage's) work
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


class BasisRotationAdam(torch.optim.Optimizer):
    """Adam in a rotated basis: the basis rotation of Jung, Shin and Lee (arXiv 2602.03515, Algorithm 1),
    for asynchronous pipelines whose stale gradients make coordinate-wise Adam oscillate.

    Adam divides each coordinate by its own second moment, which suits a loss whose curvature is
    aligned with the coordinate axes; a weight matrix's is not, and a gradient evaluated at older
    weights then pushes along directions that Adam scales badly. Each matrix ``W`` (``m × n``) keeps
    exponential averages of ``G Gᵀ`` and ``Gᵀ G`` (Shampoo's factors), whose eigenvectors ``U`` and ``V``
    approximate the curvature's eigenbasis; Adam runs on ``Uᵀ G V`` and its step is rotated back,
    ``U (m̂ / (√v̂ + ε)) Vᵀ``. The bases come from an eigendecomposition at the first step and are then
    refreshed every ``precondition_frequency`` steps by one warm-started power iteration and a QR
    decomposition, the second moments permuted to follow the new order of the eigenvalues (as SOAP
    does). docs/lm-quality.md measures it under the asynchronous schedules.

    Only 2-D parameters: combine it with AdamW for embeddings, norms and biases through
    :class:`CombinedOptimizer`, as with ``torch.optim.Muon``.

    Args:
        params: the matrices to optimise.
        lr: learning rate.
        betas: Adam's averaging coefficients of the gradient and of its square (the paper's default
            ``(0.95, 0.95)``).
        shampoo_beta: averaging coefficient of the covariances ``G Gᵀ`` and ``Gᵀ G``; ``None``: ``betas[1]``.
        eps: added to the root of the second moment.
        weight_decay: decoupled weight decay (as AdamW's).
        precondition_frequency: steps between refreshes of the bases (``T_freq`` in the paper).
    """

    def __init__(
        self, params: Any, lr: float = 3e-3, betas: tuple[float, float] = (0.95, 0.95), shampoo_beta: float | None = None,
        eps: float = 1e-8, weight_decay: float = 0.01, precondition_frequency: int = 10,
    ) -> None:
        if precondition_frequency < 1:
            raise ValueError(f"precondition_frequency={precondition_frequency} must be at least 1.")
        defaults = {"lr": lr, "betas": betas, "shampoo_beta": shampoo_beta, "eps": eps, "weight_decay": weight_decay,
                    "precondition_frequency": precondition_frequency}
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"BasisRotationAdam takes 2-D weight matrices; a parameter has shape {tuple(p.shape)}. "
                                     "Give embeddings, norms and biases to AdamW and combine both with CombinedOptimizer.")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            beta_s = beta2 if group["shampoo_beta"] is None else group["shampoo_beta"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, state = p.grad, self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(g)
                    state["exp_avg_sq"] = torch.zeros_like(g)  # in the rotated basis
                    state["cov_left"] = torch.zeros(g.shape[0], g.shape[0], dtype=g.dtype, device=g.device)
                    state["cov_right"] = torch.zeros(g.shape[1], g.shape[1], dtype=g.dtype, device=g.device)
                state["step"] += 1
                state["cov_left"].lerp_(g @ g.T, 1 - beta_s)
                state["cov_right"].lerp_(g.T @ g, 1 - beta_s)
                if "left" not in state:
                    state["left"], state["right"] = _eigenbasis(state["cov_left"]), _eigenbasis(state["cov_right"])
                elif state["step"] % group["precondition_frequency"] == 0:
                    state["left"] = _refresh(state["cov_left"], state["left"], state["exp_avg_sq"], 0)
                    state["right"] = _refresh(state["cov_right"], state["right"], state["exp_avg_sq"], 1)
                left, right = state["left"], state["right"]
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.lerp_(g, 1 - beta1)
                rotated = left.T @ g @ right
                exp_avg_sq.mul_(beta2).addcmul_(rotated, rotated, value=1 - beta2)
                step = state["step"]
                step_size = group["lr"] * (1 - beta2**step) ** 0.5 / (1 - beta1**step)
                update = left @ ((left.T @ exp_avg @ right) / exp_avg_sq.sqrt().add_(group["eps"])) @ right.T
                if group["weight_decay"]:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-step_size)
        return loss


def _eigenbasis(covariance: Tensor) -> Tensor:
    """Eigenvectors of a symmetric matrix, largest eigenvalue first (computed in float32 at least)."""
    _, vectors = torch.linalg.eigh(covariance.to(torch.promote_types(covariance.dtype, torch.float32)))
    return vectors.flip(1).to(covariance.dtype)


def _refresh(covariance: Tensor, basis: Tensor, exp_avg_sq: Tensor, dim: int) -> Tensor:
    """One warm-started power iteration: order the basis by its current eigenvalue estimates (moving
    the second moments along ``dim`` with it, in place), multiply by the covariance, orthonormalise."""
    estimates = torch.diagonal(basis.T @ covariance @ basis)
    order = torch.argsort(estimates, descending=True)
    exp_avg_sq.copy_(exp_avg_sq.index_select(dim, order))
    q, _ = torch.linalg.qr(covariance @ basis[:, order])
    return q
