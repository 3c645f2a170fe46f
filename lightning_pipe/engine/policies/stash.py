"""Bound policies that stash weight versions: pipedream and pipedream_2bw (docs/algorithms.md §6, §7).

A forward runs with the module bound (:class:`~.base.Binding`) to a detached snapshot of a weight
version; its graph keeps referencing the snapshot, so the backward sees the same values while STEP
updates the real parameters in place. Snapshot gradients land in the real parameters' ``.grad``.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any, ContextManager

import torch
from torch import Tensor, nn

from lightning_pipe.engine.policies.base import Binding, WeightPolicy, detached_copy, fused_chunks, norm_of, relative_distance


class _SnapshotPolicy(WeightPolicy):
    """Forwards bind to detached snapshots of versions; backwards reuse the forward's binding."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._binding = Binding(self.root, self.params)
        self.snapshots: dict[int, dict[str, nn.Parameter]] = {}
        self.users: dict[int, int] = {}
        self.version_of: dict[int, int] = {}
        # a released snapshot's storage, filled by the next one: a weight-sized allocation per STEP
        # costs page faults on every step (the allocator returns large blocks to the system)
        self._spare: dict[str, nn.Parameter] | None = None

    def _buffers(self) -> dict[str, nn.Parameter]:
        """Storage for a new snapshot: the spare one if there is one, else newly allocated."""
        if self._spare is not None:
            buffers, self._spare = self._spare, None
            return buffers
        return {n: nn.Parameter(torch.empty_like(p, requires_grad=False)) for n, p in self.params.items()}

    def _snapshot(self) -> dict[str, nn.Parameter]:
        buffers = self._buffers()
        if buffers:  # (a stage with nothing to train has none)
            with torch.no_grad():
                torch._foreach_copy_(list(buffers.values()), [p.detach() for p in self.params.values()])
        return buffers

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
        return self._binding.bound(self.snapshots[version])

    def backward(self, g: int) -> ContextManager[Any]:
        context = super().backward(g)
        # autograd accumulates in place into an existing .grad: point the snapshot's at the real
        # parameter's accumulator, so no gradient is copied or added a second time
        version = self.version_of[g]
        if version is None:  # the forward ran on the parameters, which no STEP changed since: no lag
            if self.tracking_lag:
                self._record_lag(0.0)
            return context
        if self.tracking_lag:  # the stashed (2BW: extrapolated) version against the weights the STEP updates
            self._record_lag(relative_distance(self.params.values(), self.snapshots[version].values()))
        for name, snap in self.snapshots[version].items():
            snap.grad = self.params[name].grad
        # bound again: a checkpointed stage recomputes its forward inside this backward, on the version F saw
        return self._binding.bound(self.snapshots[version])

    def used_tensors(self, g: int) -> list[Tensor]:
        version = self.version_of[g]  # None: the forward ran on the parameters themselves
        return super().used_tensors(g) if version is None else list(self.snapshots[version].values())

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
            released = self.snapshots.pop(version)
            self.users.pop(version, None)
            if self._spare is None:
                self._spare = released

    def _after_update(self) -> None:
        self._release()

    def end_segment(self, mini_batches: int) -> None:
        super().end_segment(mini_batches)
        self._release()

    def copies(self) -> int:
        # the spare is held only after a release, so counting it never raises the peak
        return len(self.snapshots) + (self._spare is not None)


class StashPolicy(_SnapshotPolicy):
    """pipedream: F uses the newest weights and stashes them for its B.

    A forward whose backward comes before the stage's next STEP (``tau_s(g) = 0``: always on the
    last stage) needs no stash: it runs on the parameters themselves, which cannot change before
    its backward.

    With ``pipedream.vertical_sync`` F(g) uses the version stage 0 used for micro-batch ``g``
    instead, known without messages because every stage follows the same order: the stage
    snapshots each version at its STEP and keeps it until no later forward needs it.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.vertical_sync = self.options.pipedream.vertical_sync
        self._next_forward = 0  # segment-local index of the stage's next forward

    def _input_version(self, g: int) -> int:
        """The version stage 0 runs F(g) on: its STEPs before F(g), one per mini-batch whose last
        backward came before it (stage 0 runs ``P - 1`` forwards ahead of its backwards)."""
        return self.batches_before_segment + max(0, g - (self.stages - 1)) // self.micro_batches

    def _version(self, g: int) -> int:
        return self._input_version(g) if self.vertical_sync else self.steps

    def _steps_before_backward(self, g: int) -> bool:
        M = self.micro_batches
        return any(n % M == M - 1 for n in range(max(0, g - self.warmup), g))

    def forward(self, g: int) -> ContextManager[Any]:
        self._next_forward = g + 1
        if self.vertical_sync or self._steps_before_backward(g):
            return super().forward(g)
        WeightPolicy.forward(self, g)
        self.version_of[g] = None
        return nullcontext()

    def _delay(self, g: int, tau: int) -> int:
        version = self.version_of[g]
        return tau if version is None else self.steps - version  # vertical sync: older than F's own STEP count

    @property
    def delay_steps(self) -> int:
        # vertical sync: every stage's gradients are as stale as stage 0's
        return math.ceil((self.stages - 1) / self.micro_batches) if self.vertical_sync else super().delay_steps

    def _keep(self, version: int) -> bool:
        return super()._keep(version) or (self.vertical_sync and version >= self._input_version(self._next_forward))

    def _after_update(self) -> None:
        if self.vertical_sync and self.steps not in self.snapshots:  # a later forward will run on this version
            self.snapshots[self.steps] = self._snapshot()
            self._track_copies()
        super()._after_update()

    def end_segment(self, mini_batches: int) -> None:
        self._next_forward = 0
        super().end_segment(mini_batches)


class DoubleBufferPolicy(_SnapshotPolicy):
    """pipedream_2bw: every F and B of mini-batch ``K`` (global) uses the version after ``K-1`` STEPs,
    optionally extrapolated along the last update (``lookahead``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lookahead = self.options.pipedream_2bw.lookahead
        # W(v-1) while the parameters hold W(v), what a snapshot extrapolates from; None until the
        # first update (or a resumed last update): extrapolate by 0
        self.previous: dict[str, Tensor] | None = None
        self.compensation = self.options.pipedream_2bw.delay_compensation
        # delay compensation's average of g * g (created at the first compensated STEP)
        self.mean_square: dict[str, Tensor] | None = None

    def _delay(self, g: int, tau: int) -> int:
        # F and B both run on version K-1 (the same values: tau does not matter), and the gradient
        # updates the current weights: one STEP stale on every stage, the last one included
        return self.steps - self.version_of[g]

    @property
    def delay_steps(self) -> int:
        return 1

    def _snapshot(self) -> dict[str, nn.Parameter]:
        if self.previous is None:
            return super()._snapshot()
        buffers = self._buffers()
        outs = [b.data for b in buffers.values()]
        previous, current = [self.previous[n] for n in self.params], [p.detach() for p in self.params.values()]
        with torch.no_grad():  # W(v) + lookahead * (W(v) - W(v-1)) into reused storage, fused (launches, not passes, cost on a GPU)
            for c in fused_chunks(outs):
                torch._foreach_copy_(outs[c], previous[c])
                torch._foreach_lerp_(outs[c], current[c], 1.0 + self.lookahead)
        return buffers

    def _before_update(self) -> None:
        if not self.lookahead or not self.params:
            return
        with torch.no_grad():
            if self.previous is None:
                self.previous = {n: torch.empty_like(p, requires_grad=False) for n, p in self.params.items()}
            torch._foreach_copy_(list(self.previous.values()), [p.detach() for p in self.params.values()])

    def last_update(self) -> dict[str, Tensor] | None:
        """``W(v) - W(v-1)``, what the look-ahead extrapolates along (``None`` before the first update
        or without look-ahead). Computed when asked: only checkpoints and logged steps need it."""
        if self.previous is None:
            return None
        return {n: p.detach() - self.previous[n] for n, p in self.params.items()}

    def copies(self) -> int:
        return super().copies() + (self.previous is not None) + (self.mean_square is not None)

    def diagnostics(self) -> dict[str, float]:
        values = super().diagnostics()
        if self.lookahead:
            update = self.last_update()
            values["lookahead_norm"] = float(norm_of(update.values(), self.lookahead)) if update else 0.0
        return values

    def _version(self, g: int) -> int:
        return self._version_of_minibatch(self.batches_before_segment + g // self.micro_batches)

    @staticmethod
    def _version_of_minibatch(minibatch: int) -> int:
        """The version every F and B of global mini-batch ``K`` runs on: ``V_{max(K-1, 0)}``."""
        return max(minibatch - 1, 0)

    def begin(self, steps_done: int) -> None:
        # the first mini-batch after steps taken elsewhere has no older version: it uses the current
        # weights, as the first mini-batch of a run does (a resume then restores the saved one)
        super().begin(steps_done)
        if steps_done > 0:
            self.snapshots[steps_done - 1] = self._snapshot()
            self._track_copies()

    def _keep(self, version: int) -> bool:
        # the pre-STEP version is needed by the next mini-batch, whose forwards may start after the STEP
        return super()._keep(version) or version >= self.steps - 1

    def _prepare_step(self) -> None:
        if self.compensation:
            self._compensate()
        if self.steps not in self.snapshots:
            self.snapshots[self.steps] = self._snapshot()
            self._track_copies()

    def _compensate(self) -> None:
        """DC-ASGD-a: ``g += lambda_0 * g * g * (W - W_used) / sqrt(MS)``, ``W_used`` the version this
        mini-batch's forwards and backwards ran on."""
        used = self.snapshots[self._version_of_minibatch(self.steps)]  # this STEP's mini-batch is K = steps
        decay = self.options.pipedream_2bw.delay_compensation_decay
        with torch.no_grad():
            if self.mean_square is None:
                self.mean_square = {n: torch.zeros_like(p, requires_grad=False) for n, p in self.params.items()}
            for name, p in self.params.items():
                g = p.grad
                if g is None:
                    continue
                mean_square = self.mean_square[name].mul_(decay).addcmul_(g, g, value=1 - decay)
                g.add_(g * g * (p.detach() - used[name]) / (mean_square.sqrt() + 1e-12) * self.compensation)

    def state_dict(self) -> dict[str, Any]:
        previous = self.snapshots.get(self.steps - 1)  # the next mini-batch's forwards need it
        update = self.last_update()
        last_update = None if update is None else {n: u.cpu() for n, u in update.items()}
        if previous is not None:  # copied even on CPU: a snapshot's storage is reused by a later one
            previous = {n: t.detach().to("cpu", copy=True) for n, t in previous.items()}
        mean_square = None if self.mean_square is None else {n: t.cpu() for n, t in self.mean_square.items()}
        return {**super().state_dict(), "previous": previous, "last_update": last_update,
                "delay_compensation_mean_square": mean_square}

    def _load(self, state: dict[str, Any]) -> None:
        if self.compensation and state.get("delay_compensation_mean_square") is not None:
            saved = self._own(state["delay_compensation_mean_square"], "delay compensation's mean square")
            with torch.no_grad():  # a parameter without a saved average starts from 0
                self.mean_square = {n: saved[n].clone() if n in saved else torch.zeros_like(p)
                                    for n, p in self.params.items()}
        if self.lookahead and state.get("last_update") is not None:  # the weights are restored by now
            update = self._own(state["last_update"], "last update")
            with torch.no_grad():  # a parameter without a saved update extrapolates by 0
                self.previous = {n: p.detach() - update[n] if n in update else p.detach().clone()
                                 for n, p in self.params.items()}
        if state.get("previous") is None or self.steps == 0:
            return
        previous = self._own(state["previous"], "previous weight version")
        # a parameter without a saved previous version takes its current one (as at the first STEP)
        self.snapshots[self.steps - 1] = {n: nn.Parameter(previous[n]) if n in previous else detached_copy(p)
                                          for n, p in self.params.items()}
