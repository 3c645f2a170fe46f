"""One-device emulation of a multi-stage pipeline (``Trainer(devices=1, strategy=PipeStrategy(stages=P))``).

The trunk is cut into ``P`` stages that all live in this process and run through
:class:`~lightning_pipe.engine.local.LocalPipeline`: the distributed run's executors, schedules and
weight policies, connected by in-process queues. For an asynchronous schedule each stage gets what a
separate process would have (docs/emulation.md):

* its own share of the parameters: its trunk layers, plus the parameters outside the trunk that its
  part of the step uses (found once, by :func:`stage_parameter_names`);
* its own optimizer over that share (same class, param groups and state as Lightning's), its own
  copy of a step-interval lr scheduler, and its own weight policy, which STEPs it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipe.async_options import AsyncOptions
from lightning_pipe.async_runtime import AsyncRuntime
from lightning_pipe.engine.local import LocalPipeline
from lightning_pipe.engine.weights import POLICIES, WeightPolicy
from lightning_pipe.outside_params import reject_shared
from lightning_pipe.schedules import validate_async


class SharedParameterError(ValueError):
    """A parameter outside the trunk is used by several stages (an asynchronous pipeline cannot step it)."""


def _differentiable(value: Any) -> list[Tensor]:
    tensors = value if isinstance(value, tuple) else (value,)
    return [t for t in tensors if isinstance(t, Tensor) and t.requires_grad]


def _detached(value: Any) -> Any:
    if isinstance(value, tuple):
        return tuple(_detached(t) for t in value)
    if value.dtype.is_floating_point or value.dtype.is_complex:
        return value.detach().requires_grad_(value.requires_grad)
    return value.detach()


def stage_parameter_names(
    module: nn.Module, bounds: Sequence[tuple[int, int]], trunk: nn.Sequential,
    chunks: Sequence[Callable[[Any, Any], Any]], micro_batch: Any,
) -> list[set[str]]:
    """The parameter names each stage owns.

    Trunk layers belong to the stage holding them. A parameter outside the trunk belongs to the
    stage whose part of the step gives it a gradient, found by running every stage once on
    ``micro_batch`` (with the random number generators, the module's buffers and torchmetrics
    states restored afterwards); unused ones go to stage 0, as in the distributed run's checkpoints.

    Raises:
        SharedParameterError: a parameter outside the trunk is used on several stages.
    """
    stage_of: dict[int, int] = {}
    for vs, (start, end) in enumerate(bounds):
        for index in range(start, end):
            for p in trunk[index].parameters():
                stage_of[id(p)] = vs
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    outside = [(n, p) for n, p in named if id(p) not in stage_of]
    users: dict[str, list[int]] = {}
    if outside:
        buffers = {n: b.detach().clone() for n, b in module.named_buffers()}
        metrics = _metric_states(module)
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            value: Any = None
            for vs, chunk in enumerate(chunks):
                value = chunk(None if vs == 0 else _detached(value), micro_batch)
                outputs = _differentiable(value)
                if not outputs:
                    continue
                grads = torch.autograd.grad(
                    outputs, [p for _, p in outside], [torch.ones_like(t) for t in outputs], allow_unused=True
                )
                for (name, _), grad in zip(outside, grads):
                    if grad is not None:
                        users.setdefault(name, []).append(vs)
        with torch.no_grad():
            for name, b in module.named_buffers():
                b.copy_(buffers[name])
        _restore_metric_states(metrics)
    reject_shared(users, "which step at different times under an asynchronous schedule", SharedParameterError)
    names: list[set[str]] = [set() for _ in bounds]
    for name, p in named:
        names[stage_of.get(id(p), users.get(name, [0])[0])].add(name)
    return names


def _metric_states(module: nn.Module) -> list[tuple[Any, dict[str, Any]]]:
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - a dependency of lightning
        return []
    saved = []
    for metric in module.modules():
        if isinstance(metric, Metric):
            state = {attr: copy.deepcopy(getattr(metric, attr)) for attr in metric._defaults}
            state.update(_update_count=metric._update_count, _computed=metric._computed)
            saved.append((metric, state))
    return saved


def _restore_metric_states(saved: list[tuple[Any, dict[str, Any]]]) -> None:
    for metric, state in saved:
        for attr, value in state.items():
            setattr(metric, attr, value)


def stage_optimizer(optimizer: torch.optim.Optimizer, names: set[str], name_of: dict[int, str]) -> torch.optim.Optimizer:
    """An optimizer of the same class over the parameters in ``names``: the same param groups (empty
    ones kept, so group indices and schedulers line up), hyperparameters and per-parameter state."""
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [p for p in group["params"] if name_of.get(id(p)) in names]}
        for group in optimizer.param_groups
    ]
    try:
        stage = type(optimizer)(groups, **optimizer.defaults)
    except TypeError:  # an optimizer whose defaults are not all constructor arguments
        stage = type(optimizer)(groups)
    for group in groups:
        for p in group["params"]:
            if p in optimizer.state:
                stage.state[p] = optimizer.state[p]
    return stage


def stage_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer, stage_optimizer_: torch.optim.Optimizer) -> Any:
    """A copy of ``scheduler`` (its state included) that drives ``stage_optimizer_`` instead of ``optimizer``."""
    copied = copy.deepcopy(scheduler, {id(optimizer): stage_optimizer_})
    if getattr(copied, "_step_count", 0) == 1:
        copied._step_count = 2  # torch's "scheduler stepped before optimizer" check concerns the original
    return copied


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:  # values without a plain truth value count as changed
        return False


class EmulatedAsyncRuntime(AsyncRuntime):
    """:class:`AsyncRuntime` for every stage of one pipeline in this process.

    Args:
        name: the asynchronous schedule.
        pipeline: the in-process pipeline (its executors get one policy each).
        stages: stages emulated; ``micro_batches``: per window.
    """

    def __init__(self, name: str, pipeline: LocalPipeline, stages: int, micro_batches: int) -> None:
        super().__init__(name, pipeline, 0, stages, micro_batches)
        self.optimizers: list[torch.optim.Optimizer] = []
        self.schedulers: list[Any | None] = []
        self.stage_names: list[set[str]] = []

    def start_stages(
        self, root: nn.Module, optimizer: torch.optim.Optimizer, options: AsyncOptions, scheduler: Any | None,
        clip: Callable[[Sequence[Tensor]], None] | None, steps_done: int, stage_names: list[set[str]],
    ) -> list[WeightPolicy]:
        """Split ``optimizer`` (and ``scheduler``) by stage and create every stage's policy."""
        validate_async(self.name, self.stages, self.micro_batches)
        name_of = {id(p): n for n, p in root.named_parameters()}
        self.stage_names = stage_names
        self.optimizers = [stage_optimizer(optimizer, names, name_of) for names in stage_names]
        self.schedulers = [None if scheduler is None else stage_scheduler(scheduler, optimizer, o) for o in self.optimizers]
        self.policies = []
        for s, (names, stage_opt, stage_sched) in enumerate(zip(stage_names, self.optimizers, self.schedulers)):
            policy = POLICIES[self.name](root, stage_opt, s, self.stages, self.micro_batches, options, stage_sched, clip, names=names)
            policy.steps = policy.batches_before_segment = steps_done
            self.executor.executors[s].policy = policy
            self.policies.append(policy)
        self.policy = self.policies[0]
        self.load_restored()
        self._original = optimizer
        # the stages step their shares from now on; torch's "scheduler stepped before optimizer"
        # warning for an epoch-interval scheduler of this optimizer would be misleading
        optimizer._opt_called = True
        self._seen = [_hyperparameters(group) for group in optimizer.param_groups]
        return self.policies

    def _follow_original(self) -> None:
        """Hyperparameters Lightning changed in its optimizer since the last look (an epoch-interval
        lr scheduler stepped it) go to every stage's optimizer, as each process's scheduler would."""
        for g, group in enumerate(self._original.param_groups):
            now = _hyperparameters(group)
            changed = {k: v for k, v in now.items() if k not in self._seen[g] or not _same(v, self._seen[g][k])}
            for optimizer in self.optimizers:
                optimizer.param_groups[g].update(changed)
            self._seen[g] = now

    def run_window(self, micro_batches: Sequence[Any], weights: Sequence[float], scale_loss: Any = None) -> list[Any]:
        self._follow_original()
        return super().run_window(micro_batches, weights, scale_loss)

    def drain(self) -> None:
        if self.window:
            self._follow_original()
        super().drain()

    def param_names(self, stage: int) -> list[list[str]]:
        """Parameter names of every param group of ``stage``'s optimizer (masters named like their parameter)."""
        policy, optimizer = self.policies[stage], self.optimizers[stage]
        names = {id(p): n for n, p in policy.params.items()}
        names.update({id(m): n for n, m in getattr(policy, "masters", {}).items()})
        return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
