"""Weight policies: which weights a stage's forwards and backwards see (docs/async-semantics.md).

A policy governs every trainable parameter of one rank (its trunk layers and the parameters outside
the trunk it holds) and performs the stage's STEP. Two bindings exist (ALGORITHMS.md 1.1):

* bound (pipedream, pipedream_2bw): a forward runs with the module reparametrised by a detached
  snapshot of a version; its graph keeps referencing the snapshot, so the backward sees the same
  values while STEP updates the real parameters in place. Snapshot gradients are moved into the real
  parameters' ``.grad`` after each backward.
* live (pipemare, xpipe): the module's parameters are a storage that holds the wanted values before
  each forward and backward (autograd does not see the change) and a backward reads whatever it
  holds when it runs; the optimizer steps separate master copies. Values get into the storage
  without copying where possible, by exchanging the data pointers of two equally laid-out storages
  (graphs keep referencing the parameter's storage, so they see the exchange): xpipe's forward and
  backward predictions take turns in it, and pipemare's parameters share the masters' storage, so
  they follow every STEP and only a corrected backward exchanges in ``W - tau * delta``. Where a
  pointer exchange is impossible (a parameter that is a view) the values are copied instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, ContextManager

import torch
from torch import Tensor, nn
from torch.nn.utils.stateless import _reparametrize_module

from lightning_pipe.async_options import AsyncOptions

Clip = Callable[[Sequence[Tensor]], None]


class WeightPolicy:
    """Base: one optimizer STEP per ``micro_batches`` backwards, stage-local clipping.

    Args:
        root: the module owning the parameters (the stage, or the whole local LightningModule).
        optimizer: built over ``root``'s parameters.
        stage: this stage's index; ``stages``: stages in the pipeline.
        micro_batches: micro-batches per mini-batch ``M``.
        options: the schedules' knobs.
        scheduler: a step-interval LR scheduler, stepped after each STEP.
        clip: called on the gradients (of the tensors the optimizer updates) before each STEP.
        names: the parameters of ``root`` this stage owns (default: all); one-device emulation gives
            each stage's policy its own share of one module.
    """

    def __init__(
        self, root: nn.Module, optimizer: torch.optim.Optimizer, stage: int, stages: int, micro_batches: int,
        options: AsyncOptions = AsyncOptions(), scheduler: Any | None = None, clip: Clip | None = None,
        names: Collection[str] | None = None,
    ) -> None:
        self.root = root
        self.optimizer = optimizer
        self.stage, self.stages, self.micro_batches = stage, stages, micro_batches
        self.options = options
        self.scheduler = scheduler
        self.clip = clip
        self.params = {
            name: p for name, p in root.named_parameters() if p.requires_grad and (names is None or name in names)
        }
        self.steps = 0  # global STEPs of this stage
        self.batches_before_segment = 0  # mini-batches trained in earlier segments
        self.max_copies = 0
        self._tau: dict[int, int] = {}
        self._steps_at_forward: dict[int, int] = {}
        self.staleness_sum = 0
        self.backwards = 0
        self.used_names: set[str] = set()  # parameters that received a gradient

    @property
    def warmup(self) -> int:
        return self.stages - 1 - self.stage

    # -- hooks the executor calls --------------------------------------------------------------
    def select(self, replica: int) -> None:
        """Called before every compute, STEP and AVG with the action's replica (only avgpipe has several)."""

    def forward(self, g: int) -> ContextManager[Any]:
        self._steps_at_forward[g] = self.steps
        return nullcontext()

    def backward(self, g: int) -> ContextManager[Any]:
        tau = self.steps - self._steps_at_forward.pop(g)
        self._tau[g] = tau
        self.staleness_sum += tau
        self.backwards += 1
        return nullcontext()

    def finished(self, g: int) -> None:
        self._tau.pop(g, None)

    def step(self) -> None:
        tensors = self._stepped_tensors()
        self._prepare_step()
        self.used_names |= {n for n, t in zip(self.params, tensors) if t.grad is not None}
        if self.clip is not None:
            self.clip([t for t in tensors if t.grad is not None])
        scale = self._lr_scale()
        saved = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = group["lr"] * scale
        self._before_update()
        self.optimizer.step()
        self.steps += 1
        self._after_update()
        for group, lr in zip(self.optimizer.param_groups, saved):
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        self._track_copies()

    def end_segment(self, mini_batches: int) -> None:
        """Called after a drain: ``mini_batches`` were trained in the segment."""
        self.batches_before_segment += mini_batches
        self._steps_at_forward.clear()

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs beyond weights and optimizer state (saved at drain points)."""
        return {"steps": self.steps, "batches_before_segment": self.batches_before_segment}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = state["steps"]
        self.batches_before_segment = state["batches_before_segment"]

    def _to_device(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        return {n: t.to(self.params[n].device) for n, t in tensors.items()}

    # -- what subclasses change ------------------------------------------------------------------
    def _stepped_tensors(self) -> list[Tensor]:
        return list(self.params.values())

    def _prepare_step(self) -> None: ...

    def _before_update(self) -> None: ...

    def _after_update(self) -> None: ...

    def _lr_scale(self) -> float:
        return 1.0

    def copies(self) -> int:
        """Weight-sized copies held beyond the module's own parameters."""
        return 0

    def _track_copies(self) -> None:
        self.max_copies = max(self.max_copies, self.copies())


# ------------------------------------------------------------------ bound
class _SnapshotPolicy(WeightPolicy):
    """Forwards bind to detached snapshots of versions; backwards reuse the forward's binding."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.snapshots: dict[int, dict[str, Tensor]] = {}
        self.users: dict[int, int] = {}
        self.version_of: dict[int, int] = {}

    def _snapshot(self) -> dict[str, Tensor]:
        return {n: p.detach().clone().requires_grad_() for n, p in self.params.items()}

    def _version(self, g: int) -> int:
        raise NotImplementedError

    def forward(self, g: int) -> ContextManager[Any]:
        super().forward(g)
        version = self._version(g)
        if version not in self.snapshots:
            if version != self.steps:
                raise RuntimeError(f"stage {self.stage}: version {version} is gone (now at {self.steps}).")
            self.snapshots[version] = self._snapshot()
            self._track_copies()
        self.users[version] = self.users.get(version, 0) + 1
        self.version_of[g] = version
        return _reparametrize_module(self.root, self.snapshots[version])

    def backward(self, g: int) -> ContextManager[Any]:
        context = super().backward(g)
        # autograd accumulates in place into an existing .grad: point the snapshot's at the real
        # parameter's accumulator, so no gradient is copied or added a second time
        version = self.version_of[g]
        for name, snap in self.snapshots[version].items() if version is not None else ():
            snap.grad = self.params[name].grad
        return context

    def finished(self, g: int) -> None:
        super().finished(g)
        version = self.version_of.pop(g)
        if version is None:  # the forward ran on the parameters themselves
            return
        for name, snap in self.snapshots[version].items():
            self.params[name].grad, snap.grad = snap.grad, None
        self.users[version] -= 1
        self._release()

    def _keep(self, version: int) -> bool:
        return self.users.get(version, 0) > 0 or version == self.steps

    def _release(self) -> None:
        for version in [v for v in self.snapshots if not self._keep(v)]:
            del self.snapshots[version]
            self.users.pop(version, None)

    def _after_update(self) -> None:
        self._release()

    def end_segment(self, mini_batches: int) -> None:
        super().end_segment(mini_batches)
        self._release()

    def copies(self) -> int:
        return len(self.snapshots)


class StashPolicy(_SnapshotPolicy):
    """pipedream: F uses the newest weights and stashes them for its B.

    A forward whose backward comes before the stage's next STEP (``tau_s(g) = 0``: always on the
    last stage) needs no stash: it runs on the parameters themselves, which cannot change before
    its backward.
    """

    def _version(self, g: int) -> int:
        return self.steps

    def _steps_before_backward(self, g: int) -> bool:
        M = self.micro_batches
        return any(n % M == M - 1 for n in range(max(0, g - self.warmup), g))

    def forward(self, g: int) -> ContextManager[Any]:
        if self._steps_before_backward(g):
            return super().forward(g)
        WeightPolicy.forward(self, g)
        self.version_of[g] = None
        return nullcontext()


class DoubleBufferPolicy(_SnapshotPolicy):
    """pipedream_2bw: every F and B of mini-batch ``K`` (global) uses the version after ``K-1`` STEPs."""

    def _version(self, g: int) -> int:
        return max(self.batches_before_segment + g // self.micro_batches - 1, 0)

    def _keep(self, version: int) -> bool:
        # the pre-STEP version is needed by the next mini-batch, whose forwards may start after the STEP
        return super()._keep(version) or version >= self.steps - 1

    def _prepare_step(self) -> None:
        if self.steps not in self.snapshots:
            self.snapshots[self.steps] = self._snapshot()
            self._track_copies()

    def state_dict(self) -> dict[str, Any]:
        previous = self.snapshots.get(self.steps - 1)  # the next mini-batch's forwards need it
        return {**super().state_dict(), "previous": None if previous is None else {n: t.detach().cpu() for n, t in previous.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if state.get("previous") is not None:
            self.snapshots[self.steps - 1] = {n: t.requires_grad_() for n, t in self._to_device(state["previous"]).items()}


# ------------------------------------------------------------------ live
def _exchangeable(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` each own their whole storage with the same layout, so their data
    pointers can be exchanged."""
    return (
        hasattr(torch.UntypedStorage, "_swap_data_ptr_")
        and a.dtype == b.dtype and a.device == b.device and a.shape == b.shape and a.stride() == b.stride()
        and a.storage_offset() == 0 and b.storage_offset() == 0
        and a.untyped_storage().nbytes() == b.untyped_storage().nbytes() == a.numel() * a.element_size()
    )


def _exchange(a: Tensor, b: Tensor) -> None:
    """Exchange the values of ``a`` and ``b`` (and of every view of their storages) without copying."""
    a.untyped_storage()._swap_data_ptr_(b.untyped_storage())


class _LivePolicy(WeightPolicy):
    """The module's parameters are a storage; the optimizer steps master copies."""

    #: load values by exchanging storage data pointers where possible (``False``: always copy; the
    #: throughput benchmark measures the difference)
    exchange_values = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.masters = {n: nn.Parameter(p.detach().clone()) for n, p in self.params.items()}
        master_of = {id(p): self.masters[n] for n, p in self.params.items()}
        for group in self.optimizer.param_groups:  # the optimizer now updates the masters
            group["params"] = [master_of.get(id(p), p) for p in group["params"]]
        for p in list(self.optimizer.state):
            if id(p) in master_of:
                self.optimizer.state[master_of[id(p)]] = self.optimizer.state.pop(p)
        self._holding: tuple[Any, ...] | None = ("masters", 0)

    def load(self, values: dict[str, Tensor], token: tuple[Any, ...]) -> None:
        """Copy ``values`` into the live storage unless it already holds what ``token`` names."""
        if self._holding == token:
            return
        with torch.no_grad():
            for name, p in self.params.items():
                p.data.copy_(values[name])
        self._holding = token

    def load_masters(self) -> None:
        self.load(self.masters, ("masters", self.steps))

    def _stepped_tensors(self) -> list[Tensor]:
        return list(self.masters.values())

    def _prepare_step(self) -> None:
        for name, p in self.params.items():
            self.masters[name].grad, p.grad = p.grad, None

    def end_segment(self, mini_batches: int) -> None:
        super().end_segment(mini_batches)
        self.load_masters()

    def copies(self) -> int:
        return 1


class PipeMarePolicy(_LivePolicy):
    """pipemare: F and B see the current weights (B optionally corrected by ``-tau * delta``),
    with T1 learning-rate rescheduling."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.delta = {n: torch.zeros_like(m) for n, m in self.masters.items()} if self.options.pipemare_correction else None
        self.correction_norm = 0.0
        # the parameters share the masters' storage: they hold W_s at all times, with no copies
        self.aliased = self.exchange_values and all(_exchangeable(m, torch.empty_like(m)) for m in self.masters.values())
        if self.aliased:
            for name, p in self.params.items():
                p.data = self.masters[name].detach()

    def load_masters(self) -> None:
        if not self.aliased:
            super().load_masters()

    def forward(self, g: int) -> ContextManager[Any]:
        context = super().forward(g)
        self.load_masters()
        return context

    def backward(self, g: int) -> ContextManager[Any]:
        context = super().backward(g)
        tau = self._tau[g]
        if self.delta is None or tau == 0:
            self.load_masters()
            return context
        if self.aliased:
            self.correction_norm = tau * math.sqrt(sum(float(d.pow(2).sum()) for d in self.delta.values()))
            return self._corrected(tau)
        with torch.no_grad():
            for name, p in self.params.items():
                p.data.copy_(self.masters[name]).sub_(self.delta[name], alpha=tau)
        self._holding = None
        self.correction_norm = tau * math.sqrt(sum(float(d.pow(2).sum()) for d in self.delta.values()))
        return context

    @contextmanager
    def _corrected(self, tau: int) -> Iterator[None]:
        """During the backward the masters' storage (so the parameters') holds ``W_s - tau * delta_s``."""
        with torch.no_grad():
            corrected = {n: torch.sub(m.detach(), self.delta[n], alpha=tau) for n, m in self.masters.items()}
        for name, m in self.masters.items():
            _exchange(m, corrected[name])
        try:
            yield
        finally:
            for name, m in self.masters.items():
                _exchange(m, corrected[name])

    def _lr_scale(self) -> float:
        if not self.options.pipemare_lr_reschedule:
            return 1.0
        tau_hat = max(1, math.ceil(self.warmup / self.micro_batches))
        progress = min(self.steps / max(self.options.pipemare_lr_warmup_steps, 1), 1.0)
        return tau_hat ** -(1.0 - progress)

    def _before_update(self) -> None:
        if self.delta is not None:  # delta <- gamma delta + (1 - gamma)(W_new - W_old), without a copy of W_old
            gamma = self.options.pipemare_correction_decay
            for name, d in self.delta.items():
                d.mul_(gamma).sub_(self.masters[name].detach(), alpha=1 - gamma)

    def _after_update(self) -> None:
        if self.delta is not None:
            gamma = self.options.pipemare_correction_decay
            for name, d in self.delta.items():
                d.add_(self.masters[name].detach(), alpha=1 - gamma)

    def copies(self) -> int:
        return 1 + (self.delta is not None)

    def state_dict(self) -> dict[str, Any]:
        delta = None if self.delta is None else {n: d.cpu() for n, d in self.delta.items()}
        return {**super().state_dict(), "delta": delta}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.delta is not None and state.get("delta") is not None:
            self.delta = self._to_device(state["delta"])


def round_half_up(x: float) -> int:
    return math.floor(x + 0.5)


class XPipePolicy(_LivePolicy):
    """xpipe: forwards and backwards of a mini-batch see weights predicted ``s_f`` / ``s_b`` steps ahead."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        k, K, T = self.stage, self.stages, self.micro_batches
        self.s_forward = round_half_up((K + T - 2 - math.ceil(k / 2)) / T)
        self.s_backward = round_half_up((T - 1 + k // 2) / T)
        self.rule = self._rule(self.options.xpipe_prediction)
        self._last_grad: dict[str, Tensor] = {}
        self._cache: dict[str, tuple[int, dict[str, Tensor]] | None] = {"F": None, "B": None}
        self.prediction_norm = 0.0
        # which tensors hold each cached prediction's values (an exchange moves the values around)
        self._slots: dict[tuple[Any, ...], dict[str, Tensor]] = {}

    def _rule(self, rule: str) -> str:
        if rule != "auto":
            return rule
        if isinstance(self.optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            return "adam"
        if isinstance(self.optimizer, torch.optim.SGD):
            return "momentum" if self.optimizer.param_groups[0].get("momentum", 0) else "sgd"
        raise ValueError(
            f"xpipe cannot derive a prediction rule from {type(self.optimizer).__name__}; set xpipe_prediction "
            "to 'adam', 'momentum' or 'sgd'."
        )

    def _direction(self, master: Tensor, group: dict[str, Any], name: str) -> Tensor | None:
        state = self.optimizer.state.get(master, {})
        if self.rule == "adam":
            if "exp_avg" not in state:
                return None
            c = float(state["step"])
            beta1, beta2 = group["betas"]
            m_hat = state["exp_avg"] / (1 - beta1**c)
            v_hat = state["exp_avg_sq"] / (1 - beta2**c)
            return m_hat / (v_hat.sqrt() + group["eps"])
        if self.rule == "momentum":
            return state.get("momentum_buffer")
        return self._last_grad.get(name)

    def predict(self, distance: int) -> dict[str, Tensor]:
        name_of = {id(m): n for n, m in self.masters.items()}
        predicted, squares = {}, 0.0
        with torch.no_grad():
            for group in self.optimizer.param_groups:
                for master in group["params"]:
                    name = name_of.get(id(master))
                    if name is None:
                        continue
                    direction = self._direction(master, group, name)
                    if direction is None or distance == 0:
                        predicted[name] = master.detach().clone()  # frozen at the bellwether, like a prediction
                        continue
                    step = direction * (group["lr"] * distance)
                    squares += float(step.pow(2).sum())
                    predicted[name] = master.detach() - step
        self.prediction_norm = math.sqrt(squares)
        return predicted

    def _use(self, which: str, g: int, distance: int) -> None:
        batch = g // self.micro_batches
        cached = self._cache[which]
        if cached is None or cached[0] != batch:  # the bellwether of a new mini-batch predicts
            if cached is not None:
                self._slots.pop((which, cached[0]), None)
            cached = (batch, self.predict(distance))
            self._cache[which] = cached
            self._slots[(which, batch)] = cached[1]
            self._track_copies()
        self._show((which, batch))

    def _show(self, token: tuple[Any, ...]) -> None:
        """Make the parameters hold the prediction ``token`` names, by exchange when possible."""
        if self._holding == token:
            return
        values = self._slots.pop(token)
        if not (self.exchange_values and all(_exchangeable(p, values[n]) for n, p in self.params.items())):
            self._slots[token] = values
            self.load(values, token)
            return
        for name, p in self.params.items():
            _exchange(p, values[name])
        held = self._holding
        if held is not None and any(c is not None and (kind, c[0]) == held for kind, c in self._cache.items()):
            self._slots[held] = values  # now holds what the parameters held
        self._holding = token

    def forward(self, g: int) -> ContextManager[Any]:
        context = super().forward(g)
        self._use("F", g, self.s_forward)
        return context

    def backward(self, g: int) -> ContextManager[Any]:
        context = super().backward(g)
        self._use("B", g, self.s_backward)
        return context

    def _before_update(self) -> None:
        if self.rule == "sgd":  # the gradient this STEP applies (after clipping)
            self._last_grad = {n: m.grad.detach().clone() for n, m in self.masters.items() if m.grad is not None}

    def end_segment(self, mini_batches: int) -> None:
        super().end_segment(mini_batches)
        self._cache = {"F": None, "B": None}
        self._slots.clear()

    def copies(self) -> int:
        return 1 + sum(c is not None for c in self._cache.values())

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "last_grad": {n: g.cpu() for n, g in self._last_grad.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._last_grad = self._to_device(state.get("last_grad", {}))


POLICIES: dict[str, type[WeightPolicy]] = {
    "pipedream": StashPolicy,
    "pipedream_2bw": DoubleBufferPolicy,
    "pipemare": PipeMarePolicy,
    "xpipe": XPipePolicy,
}
