"""The weight-policy interface, and how a forward is bound to a chosen set of weights.

A policy governs every trainable parameter of one rank (its trunk layers and the parameters outside
the trunk it holds), tells the executor which weights each forward and backward sees, and performs
the stage's STEP. Two bindings exist (docs/algorithms.md §1.1): *bound* policies
(:mod:`.stash`, :mod:`.averaging`) run a forward with the module's parameters temporarily replaced
by other tensors (:class:`Binding`), whose graph the backward then reuses; *live* policies
(:mod:`.live`) change the values in the parameters' own storage between actions.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, ContextManager

import torch
from torch import Tensor, nn

from lightning_pipe.engine.descent import descent_ratio
from lightning_pipe.engine.policies.options import AsyncOptions
from lightning_pipe.engine.stand_ins import is_absent

Clip = Callable[[Sequence[Tensor]], None]


def norm_of(tensors: Iterable[Tensor], scale: float = 1.0) -> Tensor | float:
    """``scale * ||tensors||`` as a 0-d tensor on their device (no host synchronisation: a
    diagnostic is read back only when it is logged, :meth:`WeightPolicy.diagnostics`)."""
    tensors = [t.detach() for t in tensors]
    if not tensors:
        return 0.0
    norms = torch._foreach_norm(tensors)  # no temporary the size of the tensors
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms])) * scale


#: On a CPU, fused passes run over chunks of a stage's tensors of at most this many bytes, so that a
#: tensor's consecutive passes find it in cache (one pass over a whole stage would stream it from memory
#: once per pass: xpipe's prediction took 1.6 x as long at width 2048, one thread).
CPU_FUSED_CHUNK_BYTES = 2 << 20

#: On an accelerator, the launches are what costs, so chunks are as large as this: it bounds the
#: temporaries a fused pass makes (xpipe's directions) to this many bytes, not a whole stage's weights.
ACCELERATOR_FUSED_CHUNK_BYTES = 1 << 30


def fused_chunks(tensors: list[Tensor]) -> list[slice]:
    """Consecutive slices of ``tensors`` that one fused (``torch._foreach_*``) sequence of passes treats at once:
    at most :data:`CPU_FUSED_CHUNK_BYTES` or :data:`ACCELERATOR_FUSED_CHUNK_BYTES` each (a larger tensor alone)."""
    if not tensors:
        return []
    limit = CPU_FUSED_CHUNK_BYTES if tensors[0].device.type == "cpu" else ACCELERATOR_FUSED_CHUNK_BYTES
    chunks, start, size = [], 0, 0
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        if i > start and size + nbytes > limit:
            chunks.append(slice(start, i))
            start, size = i, 0
        size += nbytes
    chunks.append(slice(start, len(tensors)))
    return chunks


def relative_distance(applied: Iterable[Tensor], used: Iterable[Tensor]) -> Tensor:
    """``||applied - used|| / ||applied||`` over tensor lists, as a 0-d tensor (no host synchronisation).

    Per tensor, so no temporary larger than one parameter is made."""
    applied = [t.detach() for t in applied]
    distances = [torch.dist(a, u.detach()).float() for a, u in zip(applied, used)]
    if not distances:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack(distances)) / norm_of(applied).clamp_min(torch.finfo(torch.float32).tiny)


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
        self.params = {  # a stand-in (lightning_pipe.engine.stand_ins) has no values to step or copy
            name: p for name, p in root.named_parameters()
            if p.requires_grad and not is_absent(p) and (names is None or name in names)
        }
        self.steps = 0  # global STEPs of this stage
        self.batches_before_segment = 0  # mini-batches trained in earlier segments
        self.max_copies = 0
        self._tau: dict[int, int] = {}
        self._steps_at_forward: dict[int, int] = {}
        self.staleness_sum = 0
        self.backwards = 0
        self.used_names: set[str] = set()  # parameters that received a gradient
        self.lr_scale = 1.0  # the factor the last STEP applied to the learning rate
        self.tracking_lag = False  # measure weight_lag in the coming backwards (on logged steps)
        self._lag_sum: Tensor | float = 0.0
        self._lag_count = 0
        self.cosine_requested = False  # measure grad_cosine on the next forward's micro-batch
        self.grad_cosine: Tensor | None = None  # the latest measurement (0-d, read back only when logged)
        self.descent_ratio: Tensor | None = None  # the same micro-batch's descent_ratio (lightning_pipe.engine.descent)

    #: whether the weights a forward ran on are still there at its backward (stashed, or unchanged in between), so
    #: activation recomputation inside the backward repeats the forward; the live policies keep no such copy
    keeps_forward_weights = True
    #: measure ``weight_lag`` on logged steps (``False``: never; the throughput benchmark measures the difference)
    measure_weight_lag = True
    #: with ``grad_cosine``, also measure ``descent_ratio`` (:mod:`lightning_pipe.engine.descent`): an experiment's
    #: switch, off for users, as the 3-seed comparison in docs/metrics.md found it does not separate the optimizers
    #: that keep quality (two trial optimizer steps per measurement); ``benchmarks/lm_quality.py --descent-ratio``
    measure_descent = False

    @property
    def warmup(self) -> int:
        return self.stages - 1 - self.stage

    @property
    def delay_steps(self) -> int:
        """How many STEPs this stage's gradients lag the weights they update, at most: ``ceil(w_s / M)``
        (0 on the last stage); the delay-scaled warm-up stretches over this many times its length."""
        return math.ceil(self.warmup / self.micro_batches)

    def begin(self, steps_done: int) -> None:
        """Start after ``steps_done`` steps taken elsewhere (a synchronous warm-up, or before a resume
        whose state :meth:`load_state_dict` then restores)."""
        self.steps = self.batches_before_segment = steps_done

    # -- hooks the executor calls --------------------------------------------------------------
    def select(self, replica: int) -> None:
        """Called before every compute, STEP and AVG with the action's replica (only avgpipe has several)."""

    def forward(self, g: int) -> ContextManager[Any]:
        self._steps_at_forward[g] = self.steps
        return nullcontext()

    def backward(self, g: int) -> ContextManager[Any]:
        tau = self.steps - self._steps_at_forward.pop(g)
        self._tau[g] = tau
        self.staleness_sum += self._delay(g, tau)
        self.backwards += 1
        return nullcontext()

    def track_lag(self, on: bool) -> None:
        """Measure ``weight_lag`` in the backwards until the next call (``on``: a step Lightning logs) and
        forget the values measured before."""
        self.tracking_lag = on and self.measure_weight_lag
        self._lag_sum, self._lag_count = 0.0, 0

    def _record_lag(self, lag: Tensor | float) -> None:
        """Add one backward's ``||W_applied - W_used|| / ||W_applied||`` (a 0-d tensor: read back only when logged)."""
        self._lag_sum = self._lag_sum + lag
        self._lag_count += 1

    # -- grad_cosine (lightning_pipe.engine.grad_cosine; docs/metrics.md) -------------------------
    def request_cosine(self, on: bool) -> None:
        """Measure ``grad_cosine`` on the micro-batch of this stage's next forward (``on``: a step whose index
        is a multiple of ``AsyncOptions.grad_cosine_every``); ``False`` withdraws a request not taken yet."""
        self.cosine_requested = on

    def take_cosine_request(self) -> bool:
        """Whether the forward about to run is the measured one (a request is taken once)."""
        taken, self.cosine_requested = self.cosine_requested, False
        return taken

    def used_tensors(self, g: int) -> list[Tensor]:
        """The tensors ``B(g)``'s graph takes its weight gradients in, in the order of :attr:`params`
        (called within :meth:`backward`'s context): the parameters themselves by default."""
        return list(self.params.values())

    def applied_tensors(self) -> list[Tensor]:
        """The weights this stage's next STEP updates, in the order of :attr:`params` (what ``weight_lag``
        compares with as ``W_applied``): the parameters by default."""
        return list(self.params.values())

    def bind_applied(self) -> ContextManager[Any]:
        """Within the block a forward of the module runs on :meth:`applied_tensors` (called outside any
        forward's or backward's context): the parameters hold them by default."""
        return nullcontext()

    def record_cosine(self, value: Tensor | None) -> None:
        """Keep one ``grad_cosine`` measurement (the metrics log the latest)."""
        if value is not None:
            self.grad_cosine = value.detach()

    def record_descent(self, stale: Sequence[Tensor | None], fresh: Sequence[Tensor | None]) -> None:
        """Keep the measured micro-batch's ``descent_ratio``: how much of the descent of its fresh gradient
        ``fresh`` this stage's optimizer keeps when it updates from the stale one, ``stale`` (both in the order
        of :attr:`params`; the step's ``M`` micro-batches sum to about ``M`` times one). Only with
        :attr:`measure_descent`."""
        if not self.measure_descent:
            return
        value = descent_ratio(self.optimizer, self._stepped_tensors(), stale, fresh, scale=self.micro_batches)
        if value is not None:
            self.descent_ratio = value.detach()

    def _delay(self, g: int, tau: int) -> int:
        """How many STEPs older than the weights it updates the gradient of ``B(g)`` is (the
        ``staleness`` metric): the STEPs between its forward and its backward, ``tau``, by default."""
        return tau

    def finished(self, g: int) -> None:
        self._tau.pop(g, None)

    def step(self) -> None:
        tensors = self._stepped_tensors()
        self._prepare_step()
        self.used_names |= {n for n, t in zip(self.params, tensors) if t.grad is not None}
        if self.clip is not None:
            self.clip([t for t in tensors if t.grad is not None])
        scale = self.lr_scale = self._lr_scale()
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

    def diagnostics(self) -> dict[str, float]:
        """What the per-stage metrics log for this stage (docs/metrics.md): the mean staleness of its
        backwards, the most weight-sized copies it held, the factor its last STEP applied to the learning
        rate (when the policy scales it), and what a subclass adds."""
        values = {"staleness": self.staleness_sum / max(self.backwards, 1), "weight_copies": float(self.max_copies)}
        if self._scales_lr:
            values["lr_scale"] = self.lr_scale
        if self._lag_count:
            values["weight_lag"] = float(self._lag_sum) / self._lag_count
        if self.grad_cosine is not None:
            values["grad_cosine"] = float(self.grad_cosine)
        if self.descent_ratio is not None:
            values["descent_ratio"] = float(self.descent_ratio)
        return values

    @property
    def _scales_lr(self) -> bool:
        """Whether :meth:`_lr_scale` can differ from 1 (then the metrics show its last value)."""
        return self.options.delay_warmup_steps > 0

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs beyond weights and optimizer state (saved at drain points).

        Per-parameter values are keyed by parameter name, so the states of every stage merge into one
        (:func:`merge_states`) and any split, stage count or emulation of the same model resumes from it."""
        return {"policy": type(self).__name__, "steps": self.steps, "batches_before_segment": self.batches_before_segment}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a (merged) state: this stage takes its own parameters' values from it."""
        if not self.applies(state):
            return
        self.steps = state["steps"]
        self.batches_before_segment = state["batches_before_segment"]
        self._load(state)

    def _load(self, state: dict[str, Any]) -> None:
        """What a subclass restores beyond the step counts (called when the state applies)."""

    def applies(self, state: dict[str, Any]) -> bool:
        """Whether ``state`` was saved by this kind of policy (say so once when it was not: then this
        policy keeps its fresh state; a checkpoint of another schedule resumes its weights only)."""
        saved = state.get("policy", type(self).__name__)
        if saved != type(self).__name__:
            warnings.warn(f"lightning_pipe: stage {self.stage}: the checkpoint holds {saved}'s state, which "
                          f"{type(self).__name__} cannot use; it starts its own fresh.", UserWarning, stacklevel=3)
            return False
        return True

    def _own(self, tensors: dict[str, Tensor], what: str) -> dict[str, Tensor]:
        """This stage's entries of a name-keyed map of a merged state, on their parameters' devices;
        one warning if some of its parameters have none (they start fresh)."""
        missing = [n for n in self.params if n not in tensors]
        if missing:
            warnings.warn(f"lightning_pipe: stage {self.stage}: the checkpoint's {what} has no entry for "
                          f"{len(missing)} of {len(self.params)} parameters (e.g. {missing[0]}); those start fresh.",
                          UserWarning, stacklevel=3)
        return {n: tensors[n].to(p.device) for n, p in self.params.items() if n in tensors}

    def _restore(self, into: dict[str, Tensor], saved: dict[str, Tensor] | None, what: str) -> None:
        """Copy this stage's entries of the name-keyed ``saved`` into the buffers ``into``; a buffer
        without a saved entry keeps its value (zeros: it starts fresh)."""
        if saved is None:
            return
        own = self._own(saved, what)
        for name, buffer in into.items():
            if name in own:
                buffer.copy_(own[name])

    # -- what subclasses change ------------------------------------------------------------------
    def _stepped_tensors(self) -> list[Tensor]:
        return list(self.params.values())

    def _prepare_step(self) -> None: ...

    def _before_update(self) -> None: ...

    def _after_update(self) -> None: ...

    def _lr_scale(self) -> float:
        """The delay-scaled warm-up's factor (``AsyncOptions.delay_warmup_steps``) for the coming STEP."""
        length = self.options.delay_warmup_steps * self.delay_steps
        return min(1.0, (self.steps + 1) / length) if length > 0 else 1.0

    def copies(self) -> int:
        """Weight-sized copies held beyond the module's own parameters."""
        return 0

    def _track_copies(self) -> None:
        self.max_copies = max(self.max_copies, self.copies())


class PolicyStates:
    """The weight policies of the stages this process runs (``policies``), and a checkpoint's policy
    state that waits for them: what the asynchronous segments and avgpipe's rounds share.

    The state is every stage's, merged by parameter name (:func:`merge_states`): each policy takes its
    own parameters' entries, so any split of the same model resumes.
    """

    policies: Sequence[WeightPolicy]
    _restore: dict[str, Any] | None

    def restore(self, state: dict[str, Any]) -> None:
        """Resume from a checkpoint's policy state: now if the policies exist, else when they are made."""
        self._restore = state
        if self.policies:
            self.load_restored()

    def load_restored(self) -> None:
        """Load what :meth:`restore` was given into the policies just made."""
        if self._restore is not None:
            for policy in self.policies:
                policy.load_state_dict(self._restore)
            self._restore = None

    def state_dict(self) -> dict[str, Any] | None:
        """The policies of this process, merged (``None`` before they exist)."""
        return merge_states(policy.state_dict() for policy in self.policies)


def make_clip(value: float | None, algorithm: str | None) -> Clip | None:
    """Stage-local clipping before each STEP (``None``: no clipping)."""
    if not value:
        return None
    if algorithm == "value":
        return lambda tensors: torch.nn.utils.clip_grad_value_(tensors, value)
    return lambda tensors: torch.nn.utils.clip_grad_norm_(tensors, value)


class Binding:
    """Temporarily replaces parameters of ``module`` by other ``nn.Parameter`` objects.

    Within :meth:`bound`, a forward's graph references the given tensors instead of the module's own
    parameters, so its backward sees them too, whatever happens to the real parameters meanwhile.
    Every alias of a tied parameter is replaced together. The replacement writes the owner's
    ``_parameters`` entry, where ``setattr`` ends: the asynchronous policies bind every parameter for
    every forward and backward, and ``nn.Module.__setattr__``'s checks took 22 ms per step on a CPU
    core for pipedream_2bw's GPT (8 blocks, 8 micro-batches, 4 stages).

    Args:
        module: the module whose parameters are replaced.
        names: the parameter names (as ``module.named_parameters()`` gives them) that may be bound.
    """

    def __init__(self, module: nn.Module, names: Iterable[str]) -> None:
        aliases: dict[int, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        # each alias as its owner's ``_parameters`` dict and key (named_parameters lists registered ones only)
        self._slots: dict[str, list[tuple[dict[str, Any], str]]] = {}
        for name in names:
            slots = []
            for alias in aliases[id(module.get_parameter(name))]:
                owner, _, leaf = alias.rpartition(".")
                slots.append((module.get_submodule(owner)._parameters, leaf))
            self._slots[name] = slots

    @contextmanager
    def bound(self, values: Mapping[str, nn.Parameter]) -> Iterator[None]:
        """Within the block, parameter ``name`` of the module is ``values[name]``."""
        originals: list[tuple[dict[str, Any], str, Any]] = []
        try:
            for name, value in values.items():
                for registered, leaf in self._slots[name]:
                    originals.append((registered, leaf, registered[leaf]))
                    registered[leaf] = value
            yield
        finally:
            for registered, leaf, original in reversed(originals):
                registered[leaf] = original


def detached_copy(tensor: Tensor) -> nn.Parameter:
    """A new leaf parameter holding a copy of ``tensor``'s values (what :class:`Binding` binds)."""
    return nn.Parameter(tensor.detach().clone())


def merge_states(states: Iterable[Any], owner: Mapping[str, int] | None = None) -> Any:
    """One policy state out of several stages' (indexed by stage; ``None`` for none).

    Name-keyed maps are united (every stage holds other parameters), lists are merged element-wise
    (avgpipe's replicas), and any other value is taken from the first state (step counts agree after
    a drain). A parameter held by several stages (outside the trunk) takes the entry of the stage
    ``owner`` names for it: the other stages' replicas of it are not trained there, so stale.
    """
    return _merge([(stage, state) for stage, state in enumerate(states)], owner or {}, None)


def _merge(items: list[tuple[int, Any]], owner: Mapping[str, int], key: str | None) -> Any:
    items = [(stage, value) for stage, value in items if value is not None]
    if not items:
        return None
    if key in owner:
        items = [item for item in items if item[0] == owner[key]] or items
    values = [value for _, value in items]
    if all(isinstance(v, dict) for v in values):
        keys = list(dict.fromkeys(k for v in values for k in v))
        return {k: _merge([(s, v[k]) for s, v in items if k in v], owner, k) for k in keys}
    if all(isinstance(v, list) for v in values) and len({len(v) for v in values}) == 1:
        return [_merge([(s, v[i]) for s, v in items], owner, key) for i in range(len(values[0]))]
    return values[0]
