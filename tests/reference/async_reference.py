"""One-process reference implementation of the asynchronous pipeline schedules.

This module runs ``pipedream``, ``pipedream_2bw``, ``pipemare`` and ``xpipe`` exactly as
docs/async-semantics.md defines them, on one device, with plain torch. It has two uses:

1. It is the oracle the distributed engine is tested against, step by step.
2. It is an emulation mode: you can study an asynchronous schedule's statistical efficiency
   (stale weights, predictions, corrections) without a cluster.

It does not use the engine, the executor or the schedule IR of this package on purpose: the two
implementations only share the written contract.

How it works, in short:

- Every stage ``s`` has an action list (the "async 1F1B core"): ``F(0..w_s-1)``, then for
  ``n = 0, 1, ...``: ``F(n + w_s)``, ``B(n)``, and ``STEP`` if ``n % M == M - 1``. One call of
  :meth:`AsyncEmulator.train_window` runs the actions of window ``t`` (the ``M`` forwards of
  mini-batch ``t`` and the backwards and STEPs interleaved with them) on every stage;
  :meth:`AsyncEmulator.drain` runs the remaining backwards and STEPs.
- Stages talk only through two mailboxes: activations (stage ``s`` to ``s + 1``) and output
  gradients (``s + 1`` to ``s``). A loop runs every stage's next action as soon as its input is
  there. A stage's state changes only through its own actions, so the order in which the loop visits
  the stages does not change any number.
- ``stages[s]``'s parameters are the master weights ``W_s``; only STEP (``optimizer.step()``)
  changes them. Forwards never run on the master tensors: each forward runs the stage with
  :func:`torch.func.functional_call` on a dict of other tensors, and the schedule decides which:

  ============== ===================================== =========================================
  schedule       F(g) runs on                          B(g) runs on
  ============== ===================================== =========================================
  pipedream      snapshot of W_s at F time (bound)     the same snapshot
  pipedream_2bw  snapshot of version max(K(t)-1, 0)    the same snapshot
  pipemare       live storage holding W_s              live storage holding W_s at B time, or
                                                       W_s - tau * delta_s (correction)
  xpipe          live storage holding Pred(W_s, s_f)   live storage holding Pred(W_s, s_b)
  ============== ===================================== =========================================

  pipedream with ``vertical_sync``: F(g) on every stage binds the version stage 0 ran F(g) on.
  xpipe with ``distances="exact"``: ``s_f`` and ``s_b`` become ``K(t) - k_s``, the STEPs between
  the weights at the bellwether and the version mini-batch ``t``'s STEP updates.

  "Bound": the graph of F(g) references tensors nobody writes to, so B(g) sees F's values.
  "Live": one storage per stage; before every F and B the wanted values are written into it through
  ``.data`` (autograd's version counters do not move), and a backward reads whatever the storage
  holds when it runs, together with the activations its forward saved.
- Mixed precision (``autocast=torch.bfloat16``, as Lightning's ``"bf16-mixed"``): every F and its loss
  run under autocast on the stages' device. A live schedule hands F(g) low-precision leaves, written
  from the live storage before F(g) and again before B(g), so the backward reads B(g)'s weights in
  that precision (what the live storage means in float32); their gradients reach the float32 masters
  as autocast's cast would bring them.
- Every backward adds its parameter gradients to the master's ``.grad``; STEP clips (optionally),
  calls ``optimizer.step()``, ``optimizer.zero_grad(set_to_none=True)`` and the scheduler.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.optim._muon import _zeropower_via_newtonschulz

from lightning_pipe.engine.policies import AsyncOptions
from lightning_pipe.registry import names

ASYNC_SCHEDULES = names("asynchronous")

__all__ = [
    "Action",
    "AsyncEmulator",
    "drain_actions",
    "max_staleness",
    "pipemare_lr_factor",
    "round_half_up",
    "staleness",
    "window_actions",
    "xpipe_distances",
]

Weights = dict[str, Tensor]
"""One version of a stage's weights: parameter name -> tensor."""


# --------------------------------------------------------------------------------------------
# Formulas of the contract (pure functions of P, M and indices)
# --------------------------------------------------------------------------------------------


def staleness(g: int, warmup: int, micro_batches: int) -> int:
    """``tau_s(g)``: STEPs stage ``s`` runs between ``F(g)`` and ``B(g)`` (``warmup = w_s``).

    ``tau_s(g) = #{n in [max(0, g - w_s), g - 1] : n % M == M - 1}``, ``g`` segment-local.
    """
    M = micro_batches
    return sum(1 for n in range(max(0, g - warmup), g) if n % M == M - 1)


def max_staleness(warmup: int, micro_batches: int) -> int:
    """``tau_bar_s = ceil(w_s / M)``: the largest ``tau_s(g)`` over a long segment."""
    return math.ceil(warmup / micro_batches)


def round_half_up(numerator: int, denominator: int) -> int:
    """``floor(numerator / denominator + 1/2)`` for integers, computed exactly (no float)."""
    return (2 * numerator + denominator) // (2 * denominator)


def xpipe_distances(stage: int, num_stages: int, micro_batches: int) -> tuple[int, int]:
    """XPipe's version distances ``(s_f, s_b)`` of stage ``k`` with ``K = P`` stages, ``T = M``.

    ``s_f(k) = round_half_up((K + T - 2 - ceil(k/2)) / T)``, ``s_b(k) = round_half_up((T - 1 + floor(k/2)) / T)``.
    """
    K, T, k = num_stages, micro_batches, stage
    s_f = round_half_up(K + T - 2 - math.ceil(k / 2), T)
    s_b = round_half_up(T - 1 + k // 2, T)
    return s_f, s_b


def pipemare_lr_factor(step: int, warmup: int, micro_batches: int, warmup_steps: int) -> float:
    """PipeMare T1: the lr multiplier ``tau_hat_s ** -(1 - min(k / K, 1))`` at global STEP ``k`` (0-based).

    ``tau_hat_s = max(1, ceil(w_s / M))``; ``K = warmup_steps``. ``K <= 0`` means "no warm-up"
    (factor 1 from the first STEP on).
    """
    tau_hat = max(1, math.ceil(warmup / micro_batches))
    progress = 1.0 if warmup_steps <= 0 else min(step / warmup_steps, 1.0)
    return float(tau_hat) ** -(1.0 - progress)


def delay_warmup_factor(step: int, delay: int, warmup_steps: int) -> float:
    """The delay-scaled warm-up's lr multiplier ``min(1, (k + 1) / (K * tau_s))`` at global STEP ``k``
    (0-based) of a stage whose gradients are ``tau_s = delay`` STEPs stale; 1 when ``K * tau_s = 0``."""
    length = warmup_steps * delay
    return 1.0 if length == 0 else min(1.0, (step + 1) / length)


# --------------------------------------------------------------------------------------------
# Action lists (the async 1F1B core)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Action:
    """One action of a stage: ``F(g)``, ``B(g)`` or ``STEP`` (``micro_batch`` = the B that completed the mini-batch)."""

    kind: str  # "F", "B" or "STEP"
    micro_batch: int

    def __repr__(self) -> str:
        return "STEP" if self.kind == "STEP" else f"{self.kind}({self.micro_batch})"


def window_actions(stage: int, num_stages: int, micro_batches: int, t: int, size: int | None = None) -> list[Action]:
    """Actions of stage ``s`` in window ``t``.

    For ``i = 0..size-1``: ``F(tM+i)``, then, if ``n = tM+i-w_s >= 0``, ``B(n)`` and ``STEP`` if ``n % M == M-1``.
    A short window (``size < M``, only the last of a segment) is a mini-batch of ``size`` micro-batches:
    ``STEP`` also after its last micro-batch ``tM+size-1``.
    """
    M, w = micro_batches, num_stages - 1 - stage
    size = M if size is None else size
    end = t * M + size - 1
    actions: list[Action] = []
    for i in range(size):
        g = t * M + i
        actions.append(Action("F", g))
        n = g - w
        if n >= 0:
            actions.append(Action("B", n))
            if n % M == M - 1 or n == end:
                actions.append(Action("STEP", n))
    return actions


def drain_actions(stage: int, num_stages: int, micro_batches: int, windows: int, last_size: int | None = None) -> list[Action]:
    """Actions of stage ``s`` when a segment of ``T = windows`` mini-batches ends (the last one of
    ``last_size`` micro-batches, default ``M``).

    ``B(n)`` (and ``STEP`` if ``n % M == M-1`` or ``n`` is the segment's last micro-batch) for the
    segment's last ``w_s`` micro-batches.
    """
    M, w = micro_batches, num_stages - 1 - stage
    G = (windows - 1) * M + (M if last_size is None else last_size) if windows else 0
    actions: list[Action] = []
    for n in range(max(0, G - w), G):
        actions.append(Action("B", n))
        if n % M == M - 1 or n == G - 1:
            actions.append(Action("STEP", n))
    return actions


# --------------------------------------------------------------------------------------------
# Per-stage state
# --------------------------------------------------------------------------------------------


@dataclass
class _InFlight:
    """What ``F(g)`` leaves behind for ``B(g)`` on one stage."""

    input: Tensor | None  # the received activation (a leaf that requires grad); None on stage 0
    output: Tensor  # the stage output, or the weighted loss on the last stage
    weights: Weights  # the tensors the graph was built on (a snapshot, the live storage, or low-precision leaves)
    steps_at_forward: int  # k_s when F(g) ran
    version: int | None  # the snapshot's version (pipedream, 2bw), else None


@dataclass
class _Stage:
    """Everything one stage owns. Only the stage's own actions modify it."""

    index: int
    warmup: int  # w_s = P - 1 - s
    module: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any | None
    steps: int = 0  # k_s: global STEPs since the emulator was built
    forwards: int = 0  # F's run in the current segment
    in_flight: dict[int, _InFlight] = field(default_factory=dict)
    # pipedream / 2bw: stashed weight versions and how many in-flight micro-batches use each
    snapshots: dict[int, Weights] = field(default_factory=dict)
    snapshot_users: dict[int, int] = field(default_factory=dict)
    # pipemare / xpipe: the one live parameter storage
    live: Weights | None = None
    # pipemare T2: the velocity delta_s
    delta: Weights | None = None
    # xpipe: Pred(W, s_f) per mini-batch (forward cache) and Pred(W, s_b) (backward cache)
    forward_cache: dict[int, Weights] = field(default_factory=dict)
    backward_cache: dict[int, Weights] = field(default_factory=dict)
    prediction: dict[str, str] = field(default_factory=dict)  # xpipe: parameter name -> "adam", "muon", "momentum" or "sgd"
    last_grad: Weights = field(default_factory=dict)  # xpipe "sgd": the last applied gradient
    history: dict[int, Weights] = field(default_factory=dict)  # 2bw look-ahead: W(v) of every past version v
    mean_square: Weights = field(default_factory=dict)  # 2bw delay compensation: the average of g * g
    versions: dict[int, Weights] = field(default_factory=dict)  # 2bw delay compensation, pipedream vertical sync: every version
    # statistics
    tau_sum: int = 0
    backwards: int = 0
    max_copies: int = 0

    def masters(self) -> dict[str, nn.Parameter]:
        """The master weights ``W_s``: the module's own parameters, updated only by STEP."""
        return dict(self.module.named_parameters())

    def copies(self) -> int:
        """Extra weight-sized tensors held right now (stashes, live storage, velocity, caches)."""
        return (
            len(self.snapshots)
            + (self.live is not None)
            + (self.delta is not None)
            + len(self.forward_cache)
            + len(self.backward_cache)
        )

    def note_copies(self) -> None:
        """Record the current number of copies in the running maximum (call after every allocation)."""
        self.max_copies = max(self.max_copies, self.copies())


def _copy_weights(weights: Mapping[str, Tensor]) -> Weights:
    """Detached copies of ``weights`` that can be bound into a graph (leaves, same ``requires_grad``)."""
    return {name: w.detach().clone().requires_grad_(w.requires_grad) for name, w in weights.items()}


def _write_live(storage: Weights, values: Mapping[str, Tensor]) -> None:
    """Write ``values`` into the live storage through ``.data``, so autograd's version counters stay put."""
    for name, tensor in storage.items():
        tensor.data.copy_(values[name].detach())


@contextmanager
def _lr_scaled(optimizer: torch.optim.Optimizer, factor: float) -> Iterator[None]:
    """Multiply every param group's lr by ``factor`` inside the block, then restore the original values."""
    if factor == 1.0:
        yield
        return
    saved = [group["lr"] for group in optimizer.param_groups]
    for group, lr in zip(optimizer.param_groups, saved):
        group["lr"] = lr * factor
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved):
            group["lr"] = lr


def _resolve_predictions(mode: str, st: _Stage) -> dict[str, str]:
    """XPipe's update direction per parameter of one stage: each member of a combined optimizer
    (lightning_pipe.optim.CombinedOptimizer) resolves its own."""
    name_of = {id(p): name for name, p in st.masters().items()}
    rules = {}
    for member in getattr(st.optimizer, "optimizers", [st.optimizer]):
        rule = _resolve_prediction(mode, member, st.index)
        rules.update({name_of[id(p)]: rule for group in member.param_groups for p in group["params"]})
    return rules


def _resolve_prediction(mode: str, optimizer: torch.optim.Optimizer, stage: int) -> str:
    """XPipe's update direction for one stage's optimizer: ``auto`` -> adam / momentum / sgd by type."""
    groups = optimizer.param_groups
    if mode == "auto":
        if isinstance(optimizer, torch.optim.Muon):
            return "muon"
        if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam)):
            return "adam"
        if isinstance(optimizer, torch.optim.SGD):
            momenta = {group.get("momentum", 0) > 0 for group in groups}
            if momenta == {True}:
                return "momentum"
            if momenta == {False}:
                return "sgd"
            raise ValueError(
                f"xpipe: stage {stage}'s SGD mixes param groups with and without momentum; "
                "set AsyncOptions(xpipe=XPipeOptions(prediction=...)) explicitly."
            )
        raise ValueError(
            f"xpipe: cannot infer the prediction direction for stage {stage}'s optimizer "
            f"{type(optimizer).__name__}; set AsyncOptions(xpipe=XPipeOptions(prediction='adam'|'momentum'|'sgd'))."
        )
    if mode == "adam" and not all("betas" in group and "eps" in group for group in groups):
        raise ValueError(
            f"xpipe_prediction='adam' needs an Adam-like optimizer (betas, eps); "
            f"stage {stage} has {type(optimizer).__name__}."
        )
    if mode == "momentum" and not all(group.get("momentum", 0) > 0 for group in groups):
        raise ValueError(
            f"xpipe_prediction='momentum' needs SGD with momentum > 0 in every param group (stage {stage})."
        )
    if mode == "muon" and not isinstance(optimizer, torch.optim.Muon):
        raise ValueError(f"xpipe_prediction='muon' needs torch.optim.Muon; stage {stage} has {type(optimizer).__name__}.")
    if mode not in ("adam", "muon", "momentum", "sgd"):
        raise ValueError(f"unknown xpipe_prediction {mode!r}; expected 'auto', 'adam', 'momentum' or 'sgd'.")
    return mode


# --------------------------------------------------------------------------------------------
# The emulator
# --------------------------------------------------------------------------------------------


class AsyncEmulator:
    """Runs an asynchronous pipeline schedule literally, stage by stage, in one process.

    Args:
        schedule: ``"pipedream"``, ``"pipedream_2bw"``, ``"pipemare"`` or ``"xpipe"``.
        stages: ``stages[s](x)`` computes stage ``s``; one tensor in, one tensor out. Their parameters
            are the master weights.
        optimizers: ``optimizers[s]`` was built over ``stages[s].parameters()``.
        micro_batches: ``M``, micro-batches per mini-batch (per window).
        input_fn: ``input_fn(micro_batch)`` is stage 0's input.
        loss_fn: ``loss_fn(last_stage_output, micro_batch)`` is the micro-batch's (unweighted) loss.
        options: the schedules' knobs (PipeMare T1/T2, XPipe's prediction direction).
        schedulers: optional step-interval lr scheduler per stage, stepped after each of its STEPs.
        clip_val: gradient clipping threshold applied per stage at every STEP (``None``: off).
        clip_algorithm: ``"norm"`` (stage-local norm) or ``"value"``.
        autocast: run every forward and loss under autocast (on the input's device) to this dtype (``None``: float32).
    """

    def __init__(
        self,
        schedule: str,
        stages: Sequence[nn.Module],
        optimizers: Sequence[torch.optim.Optimizer],
        micro_batches: int,
        input_fn: Callable[[Any], Any],
        loss_fn: Callable[[Any, Any], Tensor],
        options: AsyncOptions = AsyncOptions(),
        schedulers: Sequence[Any | None] | None = None,
        clip_val: float | None = None,
        clip_algorithm: str = "norm",
        autocast: torch.dtype | None = None,
    ) -> None:
        if schedule not in ASYNC_SCHEDULES:
            raise ValueError(f"unknown asynchronous schedule {schedule!r}; expected one of {ASYNC_SCHEDULES}.")
        P, M = len(stages), micro_batches
        if P < 1 or len(optimizers) != P:
            raise ValueError(
                f"need at least one stage and one optimizer per stage (got {P} stages, {len(optimizers)} optimizers)."
            )
        if M < 1:
            raise ValueError(f"micro_batches must be >= 1, got {M}.")
        if schedulers is not None and len(schedulers) != P:
            raise ValueError(f"need one scheduler (or None) per stage: got {len(schedulers)} for {P} stages.")
        if clip_algorithm not in ("norm", "value"):
            raise ValueError(f"clip_algorithm must be 'norm' or 'value', got {clip_algorithm!r}.")
        if schedule == "pipedream_2bw" and M < P:
            raise ValueError(
                f"pipedream_2bw needs at least as many micro-batches per mini-batch as stages (M >= P), "
                f"got M={M} and P={P}: with fewer, a stage would need a weight version it has not "
                f"computed yet or more than two weight versions at once."
            )
        if not 0.0 <= options.pipemare.correction_decay <= 1.0:
            raise ValueError(f"pipemare correction_decay must lie in [0, 1], got {options.pipemare.correction_decay}.")

        self.schedule = schedule
        self.num_stages = P
        self.micro_batches = M
        self.input_fn = input_fn
        self.loss_fn = loss_fn
        self.options = options
        self.clip_val = clip_val
        self.clip_algorithm = clip_algorithm
        self.autocast = autocast

        self._stages = [
            _Stage(
                index=s,
                warmup=P - 1 - s,
                module=stages[s],
                optimizer=optimizers[s],
                scheduler=None if schedulers is None else schedulers[s],
            )
            for s in range(P)
        ]
        for st in self._stages:
            if schedule in ("pipemare", "xpipe"):
                st.live = _copy_weights(st.masters())
            if schedule == "pipemare" and options.pipemare.correction:
                st.delta = {name: torch.zeros_like(p, requires_grad=False) for name, p in st.masters().items()}
            if schedule == "xpipe":
                st.prediction = _resolve_predictions(options.xpipe.prediction, st)
            st.note_copies()

        self._windows_before_segment = 0  # mini-batches trained in earlier segments (global K offset)
        self._windows_in_segment = 0  # T so far in the current segment
        self._input_versions: dict[int, int] = {}  # pipedream's vertical sync: the version stage 0 ran F(g) on
        self._short: int | None = None  # micro-batches of a short last window (it ends the segment)
        self._short_end: int | None = None  # its last micro-batch
        # Mailboxes, keyed by (receiving stage, micro-batch).
        self._activations: dict[tuple[int, int], Tensor] = {}
        self._output_grads: dict[tuple[int, int], Tensor] = {}
        # The current window's data, keyed by micro-batch (needed by stage 0's and the last stage's F).
        self._data: dict[int, Any] = {}
        self._loss_weights: dict[int, float] = {}
        self._losses: dict[int, float] = {}
        # The order in which the event loop visits stages; any order gives the same numbers.
        self._stage_order: list[int] = list(range(P))

    # ---------------------------------------------------------------------------- public API

    def train_window(self, micro_batches: Sequence[Any], weights: Sequence[float] | None = None) -> list[float]:
        """One Lightning step: the M micro-batches of the current mini-batch enter the stream (window t).

        Returns the per-micro-batch losses (unweighted floats) of this mini-batch, computed on the
        last stage in this window. Each loss is multiplied by ``weights[i]`` (default ``1/M``) before
        its backward.
        """
        M, size = self.micro_batches, len(micro_batches)
        if self._short is not None:
            raise ValueError("a short window ends its segment; call drain() first.")
        if not 0 < size <= M:
            raise ValueError(f"train_window expects 1 to M={M} micro-batches, got {size}.")
        weights = [1.0 / size] * size if weights is None else list(weights)
        if len(weights) != size:
            raise ValueError(f"train_window expects one weight per micro-batch ({size}), got {len(weights)}.")

        t = self._windows_in_segment
        for i in range(size):
            self._data[t * M + i] = micro_batches[i]
            self._loss_weights[t * M + i] = float(weights[i])
        if size < M:
            self._short, self._short_end = size, t * M + size - 1
        self._run([window_actions(s, self.num_stages, M, t, size) for s in range(self.num_stages)])
        self._windows_in_segment += 1

        losses = [self._losses.pop(t * M + i) for i in range(size)]
        self._data.clear()  # every forward of window t has run
        self._loss_weights.clear()
        return losses

    def drain(self) -> None:
        """End the segment: run every outstanding backward and STEP (all stages end with the same number of STEPs)."""
        T = self._windows_in_segment
        self._run([drain_actions(s, self.num_stages, self.micro_batches, T, self._short) for s in range(self.num_stages)])
        self._short = self._short_end = None
        self._windows_before_segment += T
        self._windows_in_segment = 0
        self._input_versions.clear()
        for st in self._stages:
            st.forwards = 0
            assert not st.in_flight and not st.forward_cache and not st.backward_cache, "drain left work behind"
            if self.schedule == "pipedream":
                assert not st.snapshots, "pipedream stash not empty after drain"
        assert not self._activations and not self._output_grads, "drain left messages behind"
        steps = {st.steps for st in self._stages}
        assert len(steps) == 1, f"stages disagree on the step count after a drain: {self.step_counts}"

    @property
    def step_counts(self) -> list[int]:
        """Global STEPs per stage (``k_s``)."""
        return [st.steps for st in self._stages]

    @property
    def weight_copies(self) -> list[int]:
        """Per stage: the maximum number of extra weight copies held at any time so far.

        Counted: pipedream / 2bw stashed versions (the master is not counted), the live storage of
        pipemare / xpipe, pipemare's velocity ``delta_s`` (its corrected backward weights are written
        straight into the live storage, which also serves as ``W_old`` at STEP), and xpipe's forward
        and backward prediction caches.
        """
        return [st.max_copies for st in self._stages]

    def staleness(self) -> list[float]:
        """Per stage: mean ``tau_s(g)`` (STEPs between F and B) over the micro-batches backwarded so far.

        0.0 for a stage that has not run a backward yet.
        """
        return [st.tau_sum / st.backwards if st.backwards else 0.0 for st in self._stages]

    # ---------------------------------------------------------------------------- event loop

    def _run(self, action_lists: list[list[Action]]) -> None:
        """Run every stage's actions in order, each as soon as its input (activation or gradient) is there."""
        queues = [deque(actions) for actions in action_lists]
        with torch.enable_grad():
            while any(queues):
                progressed = False
                for s in self._stage_order:
                    while queues[s] and self._ready(s, queues[s][0]):
                        self._execute(self._stages[s], queues[s].popleft())
                        progressed = True
                if not progressed:
                    heads = {s: q[0] for s, q in enumerate(queues) if q}
                    raise RuntimeError(f"emulated pipeline deadlocked; next actions per stage: {heads}")

    def _ready(self, s: int, action: Action) -> bool:
        """Whether stage ``s`` can run ``action`` now (its activation / output gradient has arrived)."""
        if action.kind == "F":
            return s == 0 or (s, action.micro_batch) in self._activations
        if action.kind == "B":
            return s == self.num_stages - 1 or (s, action.micro_batch) in self._output_grads
        return True

    def _execute(self, st: _Stage, action: Action) -> None:
        if action.kind == "F":
            self._forward(st, action.micro_batch)
        elif action.kind == "B":
            self._backward(st, action.micro_batch)
        else:
            self._step(st)

    # ---------------------------------------------------------------------------- F, B, STEP

    def _forward(self, st: _Stage, g: int) -> None:
        """F(g): run the stage on the weights the schedule picks, send the output on (or compute the loss)."""
        last = st.index == self.num_stages - 1
        x = self.input_fn(self._data[g]) if st.index == 0 else self._activations.pop((st.index, g))
        weights, version = self._forward_weights(st, g)
        if self.autocast is not None and weights is st.live:  # low-precision leaves B(g) writes again
            weights = {name: w.detach().to(self.autocast).requires_grad_(w.requires_grad) for name, w in weights.items()}
        with torch.autocast(x.device.type, dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None, cache_enabled=False):
            out = functional_call(st.module, weights, (x,))
            if not isinstance(out, Tensor):
                raise TypeError(
                    f"stage {st.index} returned {type(out).__name__}; the emulator passes one tensor between stages."
                )
            if last:
                loss = self.loss_fn(out, self._data[g])
        if last:
            self._losses[g] = float(loss.detach())
            out = loss * self._loss_weights[g]
        else:
            self._activations[(st.index + 1, g)] = out.detach().requires_grad_(True)
        st.in_flight[g] = _InFlight(
            input=x if st.index > 0 else None,
            output=out,
            weights=weights,
            steps_at_forward=st.steps,
            version=version,
        )
        st.forwards += 1
        if self.schedule == "xpipe" and self._ends_minibatch(g):
            del st.forward_cache[g // self.micro_batches]  # last F of this mini-batch on this stage

    def _ends_minibatch(self, g: int) -> bool:
        """Whether micro-batch ``g`` is the last of its mini-batch (the ``M``-th, or a short one's last)."""
        return g % self.micro_batches == self.micro_batches - 1 or g == self._short_end

    def _backward(self, st: _Stage, g: int) -> None:
        """B(g): backward through F(g)'s graph; parameter gradients go to the master's ``.grad``."""
        f = st.in_flight.pop(g)
        tau = st.steps - f.steps_at_forward
        expected = staleness(g, st.warmup, self.micro_batches)
        if tau != expected:
            raise RuntimeError(f"stage {st.index}: B({g}) after {tau} STEPs since F({g}), the contract says {expected}")

        corrected = self._prepare_backward_weights(st, g, tau)
        if st.live is not None and f.weights is not st.live:  # mixed precision: B(g)'s weights, in F's precision
            for name, w in f.weights.items():
                w.data.copy_(st.live[name])

        names = [name for name, w in f.weights.items() if w.requires_grad]
        inputs = [f.weights[name] for name in names] + ([f.input] if f.input is not None else [])
        grad_output = None if st.index == self.num_stages - 1 else [self._output_grads.pop((st.index, g))]
        if inputs:
            grads = torch.autograd.grad([f.output], inputs, grad_outputs=grad_output, allow_unused=True)
        else:
            grads = ()
        masters = st.masters()
        for name, grad in zip(names, grads):
            if grad is None:
                continue
            param = masters[name]
            if param.grad is None:
                param.grad = grad.detach().to(param.dtype, copy=True)
            else:
                param.grad.add_(grad)
        if f.input is not None:
            input_grad = grads[-1] if grads[-1] is not None else torch.zeros_like(f.input)
            self._output_grads[(st.index - 1, g)] = input_grad.detach()

        if corrected:  # pipemare T2: put W_s back into the live storage
            _write_live(st.live, masters)
        if self.schedule == "xpipe" and self._ends_minibatch(g):
            del st.backward_cache[g // self.micro_batches]  # last B of this mini-batch on this stage
        if f.version is not None:
            st.snapshot_users[f.version] -= 1
            self._free_unused_snapshots(st)
        st.tau_sum += tau
        st.backwards += 1

    def _step(self, st: _Stage) -> None:
        """STEP: clip, ``optimizer.step()``, zero the accumulator, ``k_s += 1``, scheduler."""
        masters = st.masters()
        if self.schedule == "pipedream_2bw":
            self._compensate_delay(st)
            self._keep_version_for_later_forwards(st)
        params = [p for p in masters.values() if p.grad is not None]
        if self.clip_val is not None and params:
            if self.clip_algorithm == "norm":
                torch.nn.utils.clip_grad_norm_(params, self.clip_val)
            else:
                torch.nn.utils.clip_grad_value_(params, self.clip_val)
        if self.schedule == "xpipe" and self._keeps_last_grad(st):
            st.last_grad.update({name: p.grad.detach().clone() for name, p in masters.items() if p.grad is not None})
        correcting = self.schedule == "pipemare" and st.delta is not None
        if correcting:
            _write_live(st.live, masters)  # W_old, kept in the live storage (free between actions)

        lr_factor = 1.0
        if self.schedule == "pipemare" and self.options.pipemare.lr_reschedule:
            warmup_steps = self.options.pipemare.lr_warmup_steps
            lr_factor = pipemare_lr_factor(st.steps, st.warmup, self.micro_batches, warmup_steps)
        lr_factor *= delay_warmup_factor(st.steps, self._gradient_delay(st), self.options.delay_warmup_steps)
        if self.schedule == "pipedream_2bw" and self.options.pipedream_2bw.lookahead:
            st.history[st.steps] = {n: p.detach().clone() for n, p in masters.items()}  # W(k_s), for look-ahead
        with _lr_scaled(st.optimizer, lr_factor):
            st.optimizer.step()
        st.optimizer.zero_grad(set_to_none=True)
        st.steps += 1
        if self.schedule == "pipedream" and self.options.pipedream.vertical_sync:
            st.versions[st.steps] = _copy_weights(masters)  # every version, for later forwards of older micro-batches

        if correcting:
            gamma = self.options.pipemare.correction_decay
            if self.options.pipemare.correction_decay_rule == "per_stage":  # gamma_s = D ** (1 / tau_hat_s)
                gamma = gamma ** (1 / max(1, math.ceil(st.warmup / self.micro_batches)))
            with torch.no_grad():
                for name, p in masters.items():
                    w_new, w_old = p.detach(), st.live[name].detach()
                    st.delta[name].mul_(gamma).add_(w_new - w_old, alpha=1.0 - gamma)
        if st.scheduler is not None:
            st.scheduler.step()
        if self.schedule == "pipedream_2bw":
            self._free_unused_snapshots(st)

    def _gradient_delay(self, st: _Stage) -> int:
        """``tau_s``, the STEPs by which the stage's gradients lag the weights they update, at most: one on
        every stage of 2BW; with vertical sync stage 0's on every stage; else ``ceil(w_s / M)``."""
        if self.schedule == "pipedream_2bw":
            return 1
        if self.schedule == "pipedream" and self.options.pipedream.vertical_sync:
            return max_staleness(self.num_stages - 1, self.micro_batches)
        return max_staleness(st.warmup, self.micro_batches)

    def _compensate_delay(self, st: _Stage) -> None:
        """2bw's DC-ASGD-a: ``g <- g + lambda_0 * g * g * (W - W_used) / sqrt(MS)``, ``MS <- d MS + (1 - d) g * g``,
        ``W_used`` the snapshot mini-batch ``K = k_s`` ran on (version ``max(K - 1, 0)``)."""
        lambda_0 = self.options.pipedream_2bw.delay_compensation
        if not lambda_0:
            return
        decay = self.options.pipedream_2bw.delay_compensation_decay
        used = st.versions[max(st.steps - 1, 0)]
        with torch.no_grad():
            for name, p in st.masters().items():
                if p.grad is None:
                    continue
                g = p.grad
                ms = st.mean_square.setdefault(name, torch.zeros_like(p))
                ms.mul_(decay).addcmul_(g, g, value=1 - decay)
                g.add_(g * g * (p.detach() - used[name]) / (ms.sqrt() + 1e-12) * lambda_0)

    # ---------------------------------------------------------------------------- weight policies

    def _forward_weights(self, st: _Stage, g: int) -> tuple[Weights, int | None]:
        """The tensors F(g) runs on, and the snapshot version it holds (pipedream / 2bw)."""
        if self.schedule == "pipedream" and self.options.pipedream.vertical_sync:
            if st.index == 0:
                self._input_versions[g] = st.steps
            version = self._input_versions[g]  # the version stage 0 ran F(g) on
            if version not in st.snapshots and version != st.steps:  # an older version this stage kept from its STEP
                st.snapshots[version], st.snapshot_users[version] = st.versions[version], 0
            return self._bind_snapshot(st, version), version
        if self.schedule == "pipedream":
            return self._bind_snapshot(st, st.steps), st.steps
        if self.schedule == "pipedream_2bw":
            version = max(self._global_minibatch(g) - 1, 0)
            return self._bind_snapshot(st, version), version
        if self.schedule == "pipemare":
            _write_live(st.live, st.masters())
            return st.live, None
        # xpipe: the bellwether (first F of the mini-batch on this stage) computes Pred(W, s_f)
        t = g // self.micro_batches
        if t not in st.forward_cache:
            st.forward_cache[t] = self._predict(st, self._xpipe_distance(st, g, "F"))
            st.note_copies()
        _write_live(st.live, st.forward_cache[t])
        return st.live, None

    def _prepare_backward_weights(self, st: _Stage, g: int, tau: int) -> bool:
        """Load the live storage with B(g)'s weights (pipemare, xpipe). Returns True if pipemare corrected them."""
        if self.schedule == "pipemare":
            masters = st.masters()
            if st.delta is not None and tau > 0:
                for name, p in masters.items():
                    st.live[name].data.copy_(p.detach() - tau * st.delta[name])  # W_s - tau_s(g) * delta_s
                return True
            _write_live(st.live, masters)  # W_s as it is when B(g) runs
            return False
        if self.schedule == "xpipe":
            t = g // self.micro_batches
            if t not in st.backward_cache:  # first B of the mini-batch on this stage
                st.backward_cache[t] = self._predict(st, self._xpipe_distance(st, g, "B"))
                st.note_copies()
            _write_live(st.live, st.backward_cache[t])
        return False  # pipedream / 2bw: the graph is bound to its snapshot

    def _xpipe_distance(self, st: _Stage, g: int, which: str) -> int:
        """STEPs ahead of ``W_s`` the bellwether ``which`` (``"F"`` or ``"B"``) of ``g``'s mini-batch predicts:
        XPipe's ``s_f`` / ``s_b``, or with ``distances="exact"`` up to ``V_K(t)``, the version its STEP updates."""
        if self.options.xpipe.distances == "exact":
            distance = self._global_minibatch(g) - st.steps
            if distance < 0 or (which == "B" and distance != 0):  # a backward runs after the previous mini-batch's STEP
                raise RuntimeError(f"stage {st.index}: {which} of mini-batch {g // self.micro_batches} "
                                   f"is {distance} STEPs from its version")
            return distance
        s_f, s_b = xpipe_distances(st.index, self.num_stages, self.micro_batches)
        return s_f if which == "F" else s_b

    def _global_minibatch(self, g: int) -> int:
        """``K(t)``: mini-batches trained before ``g``'s mini-batch since training start."""
        return self._windows_before_segment + g // self.micro_batches

    def _bind_snapshot(self, st: _Stage, version: int) -> Weights:
        """The stashed copy of ``version``, taken from the master now if it is the current one; one more user."""
        if version not in st.snapshots:
            if version != st.steps:
                raise RuntimeError(
                    f"stage {st.index} needs weight version {version} but holds only the current one "
                    f"({st.steps}) and stashed {sorted(st.snapshots)}"
                )
            st.snapshots[version] = st.versions[version] = self._version_weights(st)
            st.snapshot_users[version] = 0
            self._check_snapshot_count(st)
            st.note_copies()
        st.snapshot_users[version] += 1
        return st.snapshots[version]

    def _oldest_version_for_later_forwards(self, st: _Stage) -> int | None:
        """2bw: the version the stage's next forward will use (later forwards use newer ones); None for pipedream."""
        if self.schedule != "pipedream_2bw":
            return None  # pipedream forwards always take the then-current master
        next_minibatch = self._windows_before_segment + st.forwards // self.micro_batches
        return max(next_minibatch - 1, 0)

    def _keep_version_for_later_forwards(self, st: _Stage) -> None:
        """2bw, before a STEP: stash the current version if a later forward still needs it."""
        oldest = self._oldest_version_for_later_forwards(st)
        if oldest is not None and oldest <= st.steps and st.steps not in st.snapshots:
            st.snapshots[st.steps] = st.versions[st.steps] = self._version_weights(st)
            st.snapshot_users[st.steps] = 0
            self._check_snapshot_count(st)
            st.note_copies()

    def _version_weights(self, st: _Stage) -> Weights:
        """What a snapshot of the current version ``v = k_s`` holds: ``W(v)``, or for 2bw with look-ahead
        ``a``: ``W(v) + a * (W(v) - W(v-1))`` (``W(-1) = W(0)``), from the stage's history of versions."""
        lookahead = self.options.pipedream_2bw.lookahead if self.schedule == "pipedream_2bw" else 0.0
        current = st.masters()
        if not lookahead or st.steps - 1 not in st.history:
            return _copy_weights(current)
        previous = st.history[st.steps - 1]
        return {n: (w.detach() + lookahead * (w.detach() - previous[n])).requires_grad_(w.requires_grad) for n, w in current.items()}

    def _free_unused_snapshots(self, st: _Stage) -> None:
        """Drop stashed versions no in-flight micro-batch uses and no later forward will need."""
        oldest = self._oldest_version_for_later_forwards(st)
        for version in list(st.snapshots):
            needed_later = oldest is not None and version >= oldest
            if st.snapshot_users[version] == 0 and not needed_later:
                del st.snapshots[version]
                del st.snapshot_users[version]

    def _check_snapshot_count(self, st: _Stage) -> None:
        """2bw's claim: with M >= P a stage never needs more than two weight versions."""
        if self.schedule == "pipedream_2bw" and len(st.snapshots) > 2:
            raise RuntimeError(
                f"pipedream_2bw stage {st.index} holds versions {sorted(st.snapshots)}; at most 2 expected"
            )

    # ---------------------------------------------------------------------------- xpipe prediction

    def _predict(self, st: _Stage, distance: int) -> Weights:
        """``Pred(W, s) = W - lr * s * Delta`` per parameter, ``lr`` its param group's current lr."""
        lrs = {id(p): group["lr"] for group in st.optimizer.param_groups for p in group["params"]}
        predicted: Weights = {}
        with torch.no_grad():
            for name, p in st.masters().items():
                direction = self._update_direction(st, name, p)
                lr = float(lrs.get(id(p), 0.0))
                if direction is None:
                    predicted[name] = p.detach().clone()
                else:
                    predicted[name] = torch.add(p.detach(), direction, alpha=-(lr * distance))
        return predicted

    def _update_direction(self, st: _Stage, name: str, p: Tensor) -> Tensor | None:
        """XPipe's ``Delta`` from the optimizer state; None (meaning 0) before the parameter's first STEP."""
        state = st.optimizer.state.get(p, {})
        rule = st.prediction[name]
        if rule == "muon":  # Muon's next update direction: Newton-Schulz of the momentum, shape-scaled
            if "momentum_buffer" not in state:
                return None
            group = next(group for group in st.optimizer.param_groups if any(q is p for q in group["params"]))
            rows, cols = p.shape[:2]
            scale = {None: math.sqrt(max(1.0, rows / cols)), "original": math.sqrt(max(1.0, rows / cols)),
                     "match_rms_adamw": 0.2 * math.sqrt(max(rows, cols))}.get(group["adjust_lr_fn"], 1.0)
            ortho = _zeropower_via_newtonschulz(state["momentum_buffer"], group["ns_coefficients"], group["ns_steps"], group["eps"])
            return ortho.to(p.dtype) * scale
        if rule == "adam":
            if "exp_avg" not in state:
                return None
            group = next(group for group in st.optimizer.param_groups if any(q is p for q in group["params"]))
            beta1, beta2 = group["betas"]
            c = float(state["step"])
            # m_hat / (sqrt(v_hat) + eps), in the order torch's Adam computes it
            return state["exp_avg"] / (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2**c) + group["eps"]) / (1 - beta1**c)
        if rule == "momentum":
            buffer, grad = state.get("momentum_buffer"), st.last_grad.get(name)
            if self.options.xpipe.momentum_direction == "buffer" or buffer is None or grad is None:
                return buffer
            group = next(group for group in st.optimizer.param_groups if any(q is p for q in group["params"]))
            return group["momentum"] * buffer + (1 - group["dampening"]) * grad  # SpecTrain's direction
        return st.last_grad.get(name)  # "sgd"

    def _keeps_last_grad(self, st: _Stage) -> bool:
        """xpipe: whether a prediction reads the last applied gradient ("sgd", or SpecTrain's momentum direction)."""
        rules = set(st.prediction.values())
        return "sgd" in rules or ("momentum" in rules and self.options.xpipe.momentum_direction == "spectrain")
