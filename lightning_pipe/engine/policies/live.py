"""Live policies: pipemare and xpipe (docs/algorithms.md §8, §9).

The module's parameters are a storage that holds the wanted values before each forward and backward
(autograd does not see the change), and a backward reads whatever it holds when it runs; the
optimizer steps separate master copies. Values reach a forward or backward without copying in one of two
ways (:func:`how_values_move`):

- ``"exchange"`` (pipemare, where this torch can: 2.13): the data pointers of two equally laid-out storages are
  exchanged (graphs keep referencing the parameter's storage, so they see the exchange): a corrected pipemare
  backward exchanges ``W - tau * delta`` into the masters' storage, which the parameters share, for its duration;
- ``"redirect"`` (xpipe; pipemare on a torch without the exchange, such as 2.11): the forward's graph keeps its
  parameters, their views and casts as references (:mod:`.saved_weights`), and a backward reads the tensors
  the policy names when it runs; xpipe's parameters are re-pointed at each mini-batch's forward prediction
  (``.data``), and its forward and backward predictions made from the same state at the same distance are one.

pipemare's parameters share the masters' storage, so they follow every STEP with no copies. Where neither
works (a parameter that is a view of a larger buffer) the values are copied in instead (``"copy"``).

Under autocast a forward's graph keeps the low-precision cast of each weight it used, not the weight: a
backward would read the forward's weights. The policies' forwards therefore save such a cast as the
parameter it came from, and the backward casts what it is given to read then (:mod:`.saved_weights`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ContextManager

import torch
from torch import Tensor, nn
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from lightning_pipe.engine.policies.base import Binding, WeightPolicy, fused_chunks, norm_of, relative_distance
from lightning_pipe.engine.policies.saved_weights import BackwardWeights
from lightning_pipe.optim import BasisRotationAdam


def exchanges_storage() -> bool:
    """Whether this torch can exchange two storages' data in place (``UntypedStorage._swap_data_ptr_``:
    torch 2.13 has it, 2.11 does not). Without it pipemare redirects its backwards instead, as xpipe always does."""
    return hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def _owns_storage(t: Tensor) -> bool:
    """Whether ``t`` is the whole of its storage, laid out as ``empty_like`` lays it out (not a view of a larger
    buffer), so that its data can be exchanged with, or viewed like, a tensor ``empty_like`` made."""
    return (t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
            and torch.empty_like(t, device="meta").stride() == t.stride())


def how_values_move(tensors: Mapping[str, Tensor], wanted: str = "auto", exchange: bool = True) -> str:
    """How a live policy gives a forward or backward the weight version it wants in ``tensors`` (the ones it
    re-points or exchanges): ``"exchange"`` where the policy ``exchange``-s, this torch can and ``wanted`` is
    ``"auto"``, else ``"redirect"`` (no copy either way; see the module's docstring), or ``"copy"`` where
    ``wanted`` says so or a tensor does not own its storage."""
    if wanted not in ("auto", "redirect", "copy"):
        raise ValueError(f"moves_values={wanted!r}: choose 'auto', 'redirect' or 'copy'")
    if wanted == "copy" or not all(_owns_storage(t) for t in tensors.values()):
        return "copy"
    return "exchange" if exchange and wanted == "auto" and exchanges_storage() else "redirect"


def _host_floats(scalars: list[Tensor | float]) -> list[float]:
    """Optimizer step counters as Python numbers: one read for all (a read per tensor is an operation each,
    and a synchronisation each where a counter lives on a GPU)."""
    if scalars and all(isinstance(s, Tensor) for s in scalars):
        return torch.stack(scalars).tolist()
    return [float(s) for s in scalars]


def _exchange(a: Tensor, b: Tensor) -> None:
    """Exchange the values of ``a`` and ``b`` (and of every view of their storages) without copying."""
    a.untyped_storage()._swap_data_ptr_(b.untyped_storage())


#: xpipe computes Adam's and SpecTrain's directions with fused passes (``_directions``) on a CPU too, not
#: per tensor into the prediction's storage (``_directions_into``): the two compute the same bits, which the
#: tests check on a CPU (on an accelerator the fused passes are the only path).
FUSED_DIRECTIONS_ON_CPU = False


class _LivePolicy(WeightPolicy):
    """The module's parameters are a storage; the optimizer steps master copies."""

    #: how weight versions reach the passes (:func:`how_values_move`): ``"auto"`` (exchange where this torch
    #: can, else redirect), ``"redirect"`` or ``"copy"``; the benchmarks compare them
    moves_values = "auto"
    #: exchange storages where this torch can (``how_values_move``), rather than redirect
    exchanges = True
    #: the storage holds the backward's weights when a backward recomputes its forward
    keeps_forward_weights = False

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
        self._binding: Binding | None = None  # binds the masters for grad_cosine's recompute (made when first needed)
        #: ``"exchange"``, ``"redirect"`` or ``"copy"`` (:func:`how_values_move`)
        self.moves = how_values_move(self._moved_tensors(), self.moves_values, self.exchanges)
        self._weights = BackwardWeights(self.params, self.stage, self._held, redirect=self.moves == "redirect")

    def _moved_tensors(self) -> Mapping[str, Tensor]:
        """The tensors whose data the policy exchanges or re-points (their layout decides :attr:`moves`)."""
        return self.params

    def _held(self) -> Any:
        """A token of the values the parameters hold now (what ``load`` and the exchanges record)."""
        return self._holding

    def forward(self, g: int) -> ContextManager[Any]:
        super().forward(g)
        return self._weights.hooks()  # the backward reads the weights it is given when it runs

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._weights.forget()

    def applied_tensors(self) -> list[Tensor]:
        return list(self.masters.values())

    def bind_applied(self) -> ContextManager[Any]:
        # the parameters hold whatever the last forward or backward wanted; the masters are what STEP updates
        if self._binding is None:
            self._binding = Binding(self.root, self.params)
        return self._binding.bound(self.masters)

    def load(self, values: dict[str, Tensor], token: tuple[Any, ...]) -> None:
        """Copy ``values`` into the live storage unless it already holds what ``token`` names."""
        if self._holding == token or not self.params:
            return
        with torch.no_grad():  # one fused copy: a copy per parameter is a launch each (where storages cannot be exchanged)
            torch._foreach_copy_([p.data for p in self.params.values()], [values[name] for name in self.params])
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
        self._weights.forget()

    def copies(self) -> int:
        return 1


class PipeMarePolicy(_LivePolicy):
    """pipemare: F and B see the current weights (B optionally corrected by ``-tau * delta``),
    with T1 learning-rate rescheduling."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.delta = {n: torch.zeros_like(m) for n, m in self.masters.items()} if self.options.pipemare.correction else None
        self.correction_norm: Tensor | float = 0.0
        self._delta_norm: Tensor | float = 0.0  # ||delta||, which changes only at a STEP
        self._corrected_storage: dict[str, Tensor] | None = None
        # (STEPs, tau) of the corrected weights the corrected storage holds: W_s - tau * delta_s changes only at a
        # STEP, so the backwards between two STEPs with the same tau (all of a stage's, mostly) write it once
        self._corrected_for: tuple[int, int] | None = None
        self._corrected_tau: int | None = None  # the delay whose corrected weights the running backward reads
        # the parameters share the masters' storage: they hold W_s at all times, with no copies
        self.aliased = self.moves != "copy"
        if self.aliased:
            for name, p in self.params.items():
                p.data = self.masters[name].detach()
        # only a corrected backward reads other weights than the parameters hold, and none is corrected on the last
        # stage, whose backwards follow their forwards with no STEP between: no hooks there in float32
        self._weights.redirect = self.moves == "redirect" and self.delta is not None and self.warmup > 0

    def _moved_tensors(self) -> Mapping[str, Tensor]:
        return self.masters  # the parameters alias them, and a corrected backward exchanges or redirects them

    def load_masters(self) -> None:
        if not self.aliased:
            super().load_masters()

    def _held(self) -> Any:
        if not self.aliased:
            return super()._held()
        tau = self._corrected_tau  # the parameters share the masters' storage, which every STEP changes
        return ("masters", self.steps) if tau is None else ("corrected", self.steps, tau)

    def forward(self, g: int) -> ContextManager[Any]:
        context = super().forward(g)
        self.load_masters()
        return context

    def backward(self, g: int) -> ContextManager[Any]:
        context = super().backward(g)
        tau = self._tau[g]
        if not self.delta or tau == 0:  # (empty on a stage with nothing to train)
            if self.tracking_lag and self.delta is not None:  # no STEP since the forward (or no weights): no lag
                self._record_lag(0.0)
            self.load_masters()
            return context
        self.correction_norm = self._delta_norm * tau
        if self.tracking_lag:  # the corrected weights W - tau * delta against W: ||tau * delta|| / ||W||
            self._record_lag(self.correction_norm / norm_of(self.masters.values()).clamp_min(torch.finfo(torch.float32).tiny))
        if self.aliased:
            return self._corrected(tau)
        token = ("corrected", self.steps, tau)  # consecutive backwards (a cool-down) write it once
        if self._holding != token:
            self._write_corrected([p.data for p in self.params.values()], list(self.params), tau)
            self._holding = token
        return context

    def _write_corrected(self, outs: list[Tensor], names: list[str], tau: int) -> None:
        """``outs[i] = W - tau * delta`` of parameter ``names[i]``, fused (one launch per pass, not per parameter)."""
        masters, deltas = [self.masters[n].detach() for n in names], [self.delta[n] for n in names]
        with torch.no_grad():
            for c in fused_chunks(outs):
                torch._foreach_copy_(outs[c], masters[c])
                torch._foreach_sub_(outs[c], deltas[c], alpha=tau)

    @contextmanager
    def _corrected(self, tau: int) -> Iterator[None]:
        """During the backward it reads ``W_s - tau * delta_s``: the masters' storage (so the parameters') holds
        it by exchange, or the backward is redirected to it."""
        if self._corrected_storage is None:  # kept: a weight-sized allocation per backward costs page faults
            self._corrected_storage = {n: torch.empty_like(m, requires_grad=False) for n, m in self.masters.items()}
        corrected = self._corrected_storage
        if self._corrected_for != (self.steps, tau):
            self._write_corrected([corrected[n] for n in self.masters], list(self.masters), tau)
            self._corrected_for = (self.steps, tau)
        self._corrected_tau = tau
        self._show_corrected(corrected, True)
        try:
            yield
        finally:
            self._show_corrected(corrected, False)
            self._corrected_tau = None

    def _show_corrected(self, corrected: dict[str, Tensor], on: bool) -> None:
        """Point the backward at ``corrected`` (``on``) or back at the masters: by redirecting it, or by
        exchanging the two storages (a second exchange undoes the first)."""
        if self.moves == "redirect":
            if not self._weights.redirect:  # the forward kept its parameters as they are: it would read W_s
                raise RuntimeError(f"lightning_pipe: a pipemare backward on stage {self.stage}, the last, is "
                                   f"{self._corrected_tau} STEPs late; please report this")
            self._weights.values = corrected if on else self.params
            return
        for name, m in self.masters.items():
            _exchange(m, corrected[name])

    @property
    def _tau_hat(self) -> int:
        """This stage's delay in STEPs as T1 and T2 count it, ``max(1, ceil(w_s / M))``."""
        return max(1, self.delay_steps)

    @property
    def _gamma(self) -> float:
        """T2's decay: ``correction_decay``, or ``correction_decay ** (1 / tau_hat_s)`` per stage."""
        decay = self.options.pipemare.correction_decay
        return decay ** (1 / self._tau_hat) if self.options.pipemare.correction_decay_rule == "per_stage" else decay

    def _lr_scale(self) -> float:
        """T1's factor (when on) times the delay-scaled warm-up's."""
        if not self.options.pipemare.lr_reschedule:
            return super()._lr_scale()
        progress = min(self.steps / max(self.options.pipemare.lr_warmup_steps, 1), 1.0)
        return self._tau_hat ** -(1.0 - progress) * super()._lr_scale()

    @property
    def _scales_lr(self) -> bool:
        return self.options.pipemare.lr_reschedule or super()._scales_lr

    def _before_update(self) -> None:
        if self.delta is not None:  # delta <- gamma delta + (1 - gamma)(W_new - W_old), without a copy of W_old
            gamma = self._gamma
            deltas, masters = list(self.delta.values()), [self.masters[n].detach() for n in self.delta]
            for c in fused_chunks(deltas):
                torch._foreach_mul_(deltas[c], gamma)
                torch._foreach_sub_(deltas[c], masters[c], alpha=1 - gamma)

    def _after_update(self) -> None:
        if self.delta:
            gamma = self._gamma
            torch._foreach_add_(list(self.delta.values()), [self.masters[n].detach() for n in self.delta], alpha=1 - gamma)
            self._delta_norm = norm_of(self.delta.values())

    def copies(self) -> int:
        # beyond the module's own: the masters (sharing the parameters' storage when aliased, then the
        # corrected backward's weights take their place) and the velocity
        return 1 + (self.delta is not None)

    def diagnostics(self) -> dict[str, float]:
        values = super().diagnostics()
        if self.delta is not None:
            values["correction_norm"] = float(self.correction_norm)
        return values

    def state_dict(self) -> dict[str, Any]:
        delta = None if self.delta is None else {n: d.cpu() for n, d in self.delta.items()}
        return {**super().state_dict(), "delta": delta}

    def _load(self, state: dict[str, Any]) -> None:
        if self.delta is not None:
            self._restore(self.delta, state.get("delta"), "correction velocity")
            self._delta_norm = norm_of(self.delta.values())
            self._forget_corrected()

    def end_segment(self, mini_batches: int) -> None:
        super().end_segment(mini_batches)
        self._forget_corrected()

    def _forget_corrected(self) -> None:
        """The corrected weights are to be written again (delta or the STEP count may have changed without a STEP)."""
        self._corrected_for = None
        if self._holding is not None and self._holding[0] == "corrected":
            self._holding = None


def round_half_up(x: float) -> int:
    return math.floor(x + 0.5)


@dataclass
class _Fused:
    """Parameters of one param group that one fused prediction pass treats alike: their prediction
    tensors (``outs``), masters and names, and their directions where they have one."""

    outs: list[Tensor] = field(default_factory=list)
    masters: list[Tensor] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    directions: list[Tensor] = field(default_factory=list)  # empty, or one per tensor

    def add(self, out: Tensor, master: Tensor, name: str) -> None:
        self.outs.append(out)
        self.masters.append(master.detach())
        self.names.append(name)

    def chunks(self) -> list[_Fused]:
        """This batch cut by :func:`fused_chunks`."""
        return [_Fused(self.outs[c], self.masters[c], self.names[c], self.directions[c]) for c in fused_chunks(self.outs)]


def _step_along(part: _Fused, directions: list[Tensor], scale: float) -> list[Tensor]:
    """``part.outs = W - scale * direction``, fused; returns each step's norm ``scale * ||direction||``."""
    norms = torch._foreach_mul(torch._foreach_norm(directions), scale)
    torch._foreach_copy_(part.outs, part.masters)
    torch._foreach_add_(part.outs, directions, alpha=-scale)
    return list(norms)


class XPipePolicy(_LivePolicy):
    """xpipe: forwards and backwards of a mini-batch see weights predicted ``s_f`` / ``s_b`` steps ahead
    (XPipe's formulas, or with ``distances="exact"`` up to the version the mini-batch's STEP updates)."""

    #: redirected, a forward and a backward prediction made from the same state at the same distance are one set
    #: of tensors (an exchange moves a prediction's values into the parameters): half the predictions, mostly
    exchanges = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        k, K, T = self.stage, self.stages, self.micro_batches
        self.s_forward = round_half_up((K + T - 2 - math.ceil(k / 2)) / T)
        self.s_backward = round_half_up((T - 1 + k // 2) / T)
        self.rules = self._rules(self.options.xpipe.prediction)
        # the plain-SGD prediction and SpecTrain's momentum direction read the last applied gradient
        self._keeps_last_grad = "sgd" in self.rules or (
            "momentum" in self.rules and self.options.xpipe.momentum_direction == "spectrain")
        self._last_grad: dict[str, Tensor] = {}
        # per direction: (mini-batch, its prediction, (STEPs, distance) it was made at)
        self._cache: dict[str, tuple[int, dict[str, Tensor], tuple[int, int]] | None] = {"F": None, "B": None}
        self.prediction_norm: Tensor | float = 0.0
        self._spare: dict[str, Tensor] | None = None  # a released prediction's tensors, for the next one
        self._reading: tuple[Any, ...] | None = None  # (when redirecting) the prediction the backwards read
        self._shared = False  # the forward and backward predictions are one set of tensors

    def _rules(self, rule: str) -> list[str]:
        """The prediction rule of each param group: ``rule``, or by the optimizer that owns the group
        when ``"auto"`` (a :class:`~lightning_pipe.optim.CombinedOptimizer` has groups of several kinds).
        An explicit rule must fit every group's optimizer: a direction read from state the optimizer
        does not keep would silently predict nothing."""
        if rule == "auto":
            return [self._auto_rule(group) for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            self._check_rule(rule, group)
        return [rule] * len(self.optimizer.param_groups)

    def _owner(self, group: dict[str, Any]) -> type:
        return next((type(member) for member in getattr(self.optimizer, "optimizers", ())
                     if any(group is g for g in member.param_groups)), type(self.optimizer))

    def _check_rule(self, rule: str, group: dict[str, Any]) -> None:
        owner = self._owner(group)
        fits = {
            # Adam-like state (exp_avg, exp_avg_sq); BasisRotationAdam's second moment lives in a rotated basis
            "adam": "betas" in group and "eps" in group and not issubclass(owner, BasisRotationAdam),
            "momentum": group.get("momentum", 0) > 0 and not issubclass(owner, torch.optim.Muon),
            "muon": issubclass(owner, torch.optim.Muon),
            "sgd": True,  # the last gradient exists under any optimizer
        }[rule]
        if not fits:
            raise ValueError(
                f"xpipe prediction={rule!r} does not fit stage {self.stage}'s {owner.__name__} param group; use "
                "xpipe=XPipeOptions(prediction='auto') (each group's rule from its optimizer) or the rule of that optimizer."
            )

    def _auto_rule(self, group: dict[str, Any]) -> str:
        owner = self._owner(group)
        if issubclass(owner, BasisRotationAdam):
            raise ValueError("xpipe has no prediction for BasisRotationAdam (its moments live in a rotated basis); "
                             "use it with pipedream or pipedream_2bw, or set xpipe=XPipeOptions(prediction='sgd').")
        if issubclass(owner, torch.optim.Muon):
            return "muon"
        if issubclass(owner, (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam)):
            # NAdam keeps Adam's moments; its own step also weighs in the newest gradient, which a
            # prediction of future steps cannot know, so the bias-corrected momentum direction is used
            return "adam"
        if issubclass(owner, torch.optim.SGD):
            return "momentum" if group.get("momentum", 0) else "sgd"
        raise ValueError(
            f"xpipe cannot derive a prediction rule from {owner.__name__}; set "
            "xpipe=XPipeOptions(prediction='adam', 'muon', 'momentum' or 'sgd')."
        )

    def _direction(self, master: Tensor, group: dict[str, Any], rule: str, name: str) -> Tensor | bool | None:
        """The update one STEP would apply to ``master`` per unit of learning rate, from the optimizer's
        current state: the direction itself, ``None`` before the state exists, or ``True`` where
        :meth:`_directions` computes it with the group's others (``adam``'s bias-corrected
        ``m / (sqrt(v_hat) + eps)``, SpecTrain's momentum step)."""
        state = self.optimizer.state.get(master, {})
        if rule == "adam":
            return True if "exp_avg" in state else None
        if rule == "muon":  # the orthogonalised momentum (bf16) in the weights' precision, at Muon's shape-adjusted lr
            if "momentum_buffer" not in state:
                return None
            update = _zeropower_via_newtonschulz(state["momentum_buffer"], group["ns_coefficients"], group["ns_steps"], group["eps"])
            return update.to(master.dtype).mul_(_adjust_lr(group["lr"], group["adjust_lr_fn"], master.shape) / group["lr"])
        if rule == "momentum":
            buffer, grad = state.get("momentum_buffer"), self._last_grad.get(name)
            if self.options.xpipe.momentum_direction == "buffer" or buffer is None or grad is None:
                return buffer
            return True
        return self._last_grad.get(name)

    def _directions(self, part: _Fused, group: dict[str, Any], rule: str) -> list[Tensor]:
        """The directions :meth:`_direction` left to be computed together (``adam``'s bias-corrected
        ``m / (sqrt(v_hat) + eps)``, SpecTrain's momentum step), in the per-parameter formulas' order, bit for
        bit, fused: a launch per pass, none per parameter (on an accelerator). ``part.outs`` serves as scratch;
        the directions are new tensors, one chunk's worth (:func:`~.base.fused_chunks`)."""
        states = [self.optimizer.state[self.masters[name]] for name in part.names]
        if rule == "adam":  # m_hat / (sqrt(v_hat) + eps) = m / (sqrt(v) / sqrt(1 - beta2^c) + eps) / (1 - beta1^c), Adam's order
            beta1, beta2 = group["betas"]
            steps = _host_floats([state["step"] for state in states])
            denominators = part.outs
            torch._foreach_copy_(denominators, [state["exp_avg_sq"] for state in states])
            torch._foreach_sqrt_(denominators)
            torch._foreach_div_(denominators, [math.sqrt(1 - beta2**c) for c in steps])
            torch._foreach_add_(denominators, group["eps"])
            directions = torch._foreach_div([state["exp_avg"] for state in states], denominators)
            torch._foreach_div_(directions, [1 - beta1**c for c in steps])
            return list(directions)
        # SpecTrain: momentum * buf + (1 - dampening) * g, the step Nesterov's SGD would take
        directions = torch._foreach_mul([state["momentum_buffer"] for state in states], group["momentum"])
        torch._foreach_add_(directions, [self._last_grad[name] for name in part.names], alpha=1 - group["dampening"])
        return list(directions)

    def _directions_into(self, part: _Fused, group: dict[str, Any], rule: str) -> None:
        """The directions :meth:`_direction` left to be computed together, into ``part.outs`` (no
        weight-sized temporaries: on a CPU each would page-fault), in the per-parameter formulas' order,
        bit for bit. Fused per group, except Adam's square root and division (no fused op writes elsewhere
        or divides into its divisor)."""
        states = [self.optimizer.state[self.masters[name]] for name in part.names]
        outs = part.outs
        if rule == "adam":  # m_hat / (sqrt(v_hat) + eps) = m / (sqrt(v) / sqrt(1 - beta2^c) + eps) / (1 - beta1^c), Adam's order
            beta1, beta2 = group["betas"]
            steps = _host_floats([state["step"] for state in states])
            for out, state in zip(outs, states):  # straight into out: a fused copy first would add a pass over memory
                torch.sqrt(state["exp_avg_sq"], out=out)
            torch._foreach_div_(outs, [math.sqrt(1 - beta2**c) for c in steps])
            torch._foreach_add_(outs, group["eps"])
            for out, state in zip(outs, states):
                torch.div(state["exp_avg"], out, out=out)
            torch._foreach_div_(outs, [1 - beta1**c for c in steps])
            return
        # SpecTrain: momentum * buf + (1 - dampening) * g, the step Nesterov's SGD would take
        torch._foreach_copy_(outs, [state["momentum_buffer"] for state in states])
        torch._foreach_mul_(outs, group["momentum"])
        torch._foreach_add_(outs, [self._last_grad[name] for name in part.names], alpha=1 - group["dampening"])

    def predict(self, distance: int) -> dict[str, Tensor]:
        """The masters ``distance`` STEPs ahead: ``W - lr * distance * direction`` per parameter.

        Fused across a param group (``torch._foreach_*``): on an accelerator a handful of launches per group
        and chunk, none per parameter (the launches are what costs there: docs/benchmarks.md); on a CPU Adam's
        square root and division and the last subtraction run per tensor, into the prediction's storage.
        """
        name_of = {id(m): n for n, m in self.masters.items()}
        storage = self._storage()
        unseen = dict(self.masters)  # a master in no param group never moves: frozen too
        frozen = _Fused()  # no direction yet, or distance 0: frozen at the bellwether, like a prediction
        norms: list[Tensor] = []
        with torch.no_grad():
            for group, rule in zip(self.optimizer.param_groups, self.rules):
                moving, fused = _Fused(), _Fused()
                for master in group["params"]:
                    name = name_of.get(id(master))
                    if name is None:
                        continue
                    del unseen[name]
                    direction = None if distance == 0 else self._direction(master, group, rule, name)
                    if direction is None:
                        frozen.add(storage[name], master, name)
                    elif direction is True:
                        fused.add(storage[name], master, name)
                    else:
                        moving.add(storage[name], master, name)
                        moving.directions.append(direction)
                scale = group["lr"] * distance
                for part in moving.chunks():
                    norms.extend(_step_along(part, part.directions, scale))
                for part in fused.chunks():
                    if part.outs[0].device.type != "cpu" or FUSED_DIRECTIONS_ON_CPU:
                        norms.extend(_step_along(part, self._directions(part, group, rule), scale))
                        continue
                    # on a CPU a fused op is a loop over the per-tensor ones: fewer passes over memory and no
                    # temporaries instead (the direction into out, then out = W - lr * distance * out)
                    self._directions_into(part, group, rule)
                    norms.extend(torch._foreach_mul(torch._foreach_norm(part.outs), scale))
                    for out, master in zip(part.outs, part.masters):
                        torch.add(master, out, alpha=-scale, out=out)
            for name, master in unseen.items():
                frozen.add(storage[name], master, name)
            if frozen.outs:
                torch._foreach_copy_(frozen.outs, frozen.masters)
            self.prediction_norm = torch.linalg.vector_norm(torch.stack(norms).float()) if norms else 0.0
        return storage

    def _storage(self) -> dict[str, Tensor]:
        """Tensors for a new prediction: the spare ones a released prediction left, else new ones (a
        weight-sized allocation per prediction costs page faults: the allocator returns large blocks to
        the system)."""
        if self._spare is not None:
            storage, self._spare = self._spare, None
            return storage
        return {n: torch.empty_like(m, requires_grad=False) for n, m in self.masters.items()}

    def _distance(self, which: str, batch: int) -> int:
        """How many STEPs ahead the ``which`` (``"F"``/``"B"``) prediction of segment-local mini-batch
        ``batch`` looks (``XPipeOptions.distances``)."""
        if self.options.xpipe.distances == "exact":  # to the version this mini-batch's STEP updates
            return self.batches_before_segment + batch - self.steps
        return self.s_forward if which == "F" else self.s_backward

    def _use(self, which: str, g: int) -> None:
        batch = g // self.micro_batches
        cached, other = self._cache[which], self._cache["B" if which == "F" else "F"]
        if cached is None or cached[0] != batch:  # the bellwether of a new mini-batch predicts
            if cached is not None and not self._shared:  # (a shared prediction stays the other direction's)
                self._spare = cached[1]
            distance = self._distance(which, batch)
            made = (self.steps, distance)
            # the other direction's prediction from the same state and distance holds the same weights: with the
            # formulas' distances, mostly (all of them at 4 stages and 8 micro-batches), half the predictions
            self._shared = other is not None and other[2] == made
            cached = (batch, other[1] if self._shared else self.predict(distance), made)
            self._cache[which] = cached
            self._track_copies()
        self._show((which, batch), cached[1])

    def _show(self, token: tuple[str, int], values: dict[str, Tensor]) -> None:
        """Give the passes ``token`` names (``("F" or "B", mini-batch)``) the prediction ``values``: a forward's
        parameters are re-pointed at it and a backward reads it through the saved-tensor hooks, or (``"copy"``)
        the parameters hold a copy."""
        if self.moves == "copy":
            self.load(values, token)
        elif token[0] == "B":
            self._weights.values, self._reading = values, token
        elif self._holding != token:  # once per mini-batch: its first forward
            for name, p in self.params.items():
                p.data = values[name]
            self._holding = token

    def _held(self) -> Any:
        return self._reading if self.moves == "redirect" else super()._held()  # what the backwards read

    def forward(self, g: int) -> ContextManager[Any]:
        context = super().forward(g)
        self._use("F", g)
        return context

    def backward(self, g: int) -> ContextManager[Any]:
        context = super().backward(g)
        self._use("B", g)
        if self.tracking_lag:  # the backward's prediction against the masters
            self._record_lag(relative_distance(self.masters.values(), self._weights.values.values()))
        return context

    def _before_update(self) -> None:
        if self._keeps_last_grad:  # the gradient this STEP applies (after clipping), into last STEP's storage
            kept = self._last_grad
            names = [n for n, m in self.masters.items() if m.grad is not None]
            reused = [n for n in names if n in kept]
            if reused:
                torch._foreach_copy_([kept[n] for n in reused], [self.masters[n].grad for n in reused])
            self._last_grad = {n: kept[n] if n in kept else self.masters[n].grad.detach().clone() for n in names}

    def end_segment(self, mini_batches: int) -> None:
        super().end_segment(mini_batches)
        self._cache = {"F": None, "B": None}
        self._shared = False
        self._weights.values, self._reading = self.params, None  # (when redirecting) drop the last backward's prediction

    def copies(self) -> int:
        return 1 + sum(c is not None for c in self._cache.values()) - self._shared

    def diagnostics(self) -> dict[str, float]:
        return {**super().diagnostics(), "prediction_norm": float(self.prediction_norm)}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "last_grad": {n: g.cpu() for n, g in self._last_grad.items()}}

    def _load(self, state: dict[str, Any]) -> None:
        if self._keeps_last_grad:  # only the plain-SGD prediction and SpecTrain's direction read it
            self._last_grad = self._own(state.get("last_grad", {}), "last gradient")
