"""What hooks that run on every stage log, merged over the stages of a pipeline.

Two kinds of hooks run on every rank, each with its own stage's state, where one device runs them once:

* ``on_after_backward``, ``on_before_optimizer_step`` (and ``configure_gradient_clipping``), after the backward,
  with the stage's own parameters and gradients. Lightning's recipe for tracking gradients, ``self.log_dict(grad_norm(self,
  norm_type=2))`` there, would log on each rank the norms of its own stage only, and the loggers (rank 0, the
  first stage) would show the first stage's parameters and a "total" over that stage alone.
* the module's epoch-end hooks (``on_validation_epoch_end``, ...), where values the steps collected exist on the
  last stage only (the step's code after the trunk runs there): what that stage logs there reached no logger.

So what these hooks log is captured on every stage, gathered over the pipeline, and replayed on every rank as one
set (docs/faq.md):

* a name logged by one stage, with its value (each parameter's gradient norm);
* a name logged by several stages with one value (a learning rate), with that value;
* Lightning's ``grad_{p}_norm_total``, as the p-norm of the stages' totals: the whole model's;
* any other name whose values differ (a statistic of the stage's own parameters), as the last stage's value,
  with a warning that says how to keep the stages apart.

Calls to the loggers in these hooks are gathered too, and global rank 0, where the loggers write, makes them
(:mod:`.logger_calls`): every stage's around the optimizer step (a histogram of each parameter's gradient), the
last stage's at an epoch's end (a figure of the predictions the steps collected there).

The hooks run on every rank of the pipeline alike, so the gather happens at every call, and only for hooks the
LightningModule (or, before the optimizer step, a callback) overrides.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_pipe.lightning.log_replay import LogCapture, LoggedValue, combine, replay
from lightning_pipe.lightning.logger_calls import LoggerCall, LoggerCalls, make_calls

#: What each stage contributes: its ``self.log`` records and its calls to the loggers.
StageLogs = tuple[list[LoggedValue], list[LoggerCall]]

#: The hooks that run just before the optimizer's update, on every rank (Lightning's ``_after_closure``).
BEFORE_OPTIMIZER_STEP = ("on_before_optimizer_step", "configure_gradient_clipping")
#: The hook that runs after every backward (a precision plugin's ``post_backward``), stepping or accumulating.
AFTER_BACKWARD = "on_after_backward"
#: The module's epoch-end hooks, where what the steps collected on the last stage is used.
EPOCH_END_HOOKS = ("on_train_epoch_end", "on_validation_epoch_end", "on_test_epoch_end", "on_predict_epoch_end")
#: Lightning's ``grad_norm`` names the norm of all the norms it returns ``grad_{p}_norm_total`` (p as a float, or ``inf``).
_GRAD_NORM_TOTAL = re.compile(r"grad_(?P<order>inf|\d+(\.\d*)?)_norm_total")


def overrides(hooks: Sequence[str], module: LightningModule, callbacks: Sequence[Callback]) -> bool:
    """Whether the module or a callback overrides one of ``hooks`` (a callback has no ``configure_gradient_clipping``)."""
    return (any(is_overridden(hook, module, LightningModule) for hook in hooks)
            or any(hasattr(Callback, hook) and is_overridden(hook, callback, Callback) for callback in callbacks for hook in hooks))


class StageHookLogs:
    """Capture ``self.log`` and the logger calls in hooks that run on every stage; replay the stages' merged logs.

    Args:
        module: the LightningModule (its ``log`` is captured).
        every_stage: a collective over the pipeline: this device's logs in, every device's out, in stage order.
        device: this rank's position in its pipeline.
        last_device: the position of the device holding the last virtual stage (whose value a name keeps when the
            stages' differ, as the step's logged values are the last stage's).
        one_pipeline: the job is one pipeline (see :func:`~.log_replay.replay`).
    """

    def __init__(self, module: LightningModule, every_stage: Callable[[StageLogs], list[StageLogs]],
                 device: int, last_device: int, one_pipeline: bool) -> None:
        self.module = module
        self.every_stage = every_stage
        self.device, self.last_device = device, last_device
        self.one_pipeline = one_pipeline
        self._warned: set[str] = set()
        self._wrapped: list[str] = []

    def step(self, optimizer_step: Callable[[Callable[[], Any]], Any], closure: Callable[[], Any],
             batch_size: Callable[[], int]) -> Any:
        """Run ``optimizer_step`` with a closure that starts capturing once the training step and backward are
        done, so that only the hooks between them and the update are captured; then merge and replay."""
        capture, calls = LogCapture(self.module), LoggerCalls(self.module)
        capturing = False

        def closure_then_capture() -> Any:
            nonlocal capturing
            result = closure()
            if not capturing:  # an optimizer may evaluate the closure more than once
                capture.batch_size = batch_size()  # known once the training step has run
                capture.__enter__()
                calls.__enter__()
                capturing = True
            return result

        try:
            result = optimizer_step(closure_then_capture)
        finally:
            if capturing:
                calls.__exit__(None, None, None)
                capture.__exit__(None, None, None)
        self._replay(capture, calls, "on_before_optimizer_step", every_stage_calls=True)  # each its own parameters
        return result

    def around(self, hook: str, run: Callable[[], Any], batch_size: int = 1, every_stage_calls: bool = True) -> Any:
        """``run()`` (what calls ``hook`` on every stage: the backward's end, which calls ``on_after_backward`` at every
        batch, stepping or accumulating; an epoch-end hook), with what it logs merged and replayed; ``every_stage_calls``:
        rank 0 makes every stage's logger calls, else the last stage's."""
        with LogCapture(self.module) as capture, LoggerCalls(self.module) as calls:
            capture.batch_size = batch_size
            result = run()
        self._replay(capture, calls, hook, every_stage_calls)
        return result

    def wrap_epoch_ends(self) -> list[str]:
        """Make the module's overridden epoch-end hooks merge what they log (an attribute of the instance, removed by
        :meth:`unwrap`); return their names."""
        module = self.module
        for hook in EPOCH_END_HOOKS:
            if hook not in self._wrapped and is_overridden(hook, module, LightningModule):
                current = getattr(module, hook)
                original = getattr(current, "merges_over_stages", current)  # an earlier call's wrapper: wrap what it wrapped
                module.__dict__[hook] = self._merging(hook, original)
                self._wrapped.append(hook)
        return list(self._wrapped)

    def unwrap(self) -> None:
        for hook in self._wrapped:
            self.module.__dict__.pop(hook, None)
        self._wrapped = []

    def _merging(self, name: str, hook: Callable[..., Any]) -> Callable[..., Any]:
        def merged(*args: Any, **kwargs: Any) -> Any:  # the values the steps collected are on the last stage
            return self.around(name, lambda: hook(*args, **kwargs), every_stage_calls=False)

        merged.merges_over_stages = hook  # type: ignore[attr-defined]
        return merged

    def _replay(self, capture: LogCapture, calls: LoggerCalls, hook: str, every_stage_calls: bool) -> None:
        stages = self.every_stage((combine(capture.records, self.module), calls.calls))
        for device, record in self.merge([records for records, _ in stages], hook):
            replay(self.module, [record], owner=device == self.device, one_pipeline=self.one_pipeline)
        trainer = self.module.trainer
        if trainer.is_global_zero:
            made = [c for _, stage_calls in stages for c in stage_calls] if every_stage_calls else stages[self.last_device][1]
            make_calls(made, trainer.loggers)

    def merge(self, stages: Sequence[Sequence[LoggedValue]], hook: str = "on_before_optimizer_step") -> list[tuple[int, LoggedValue]]:
        """One record per name, with the device it comes from, from every device's records (module docstring)."""
        by_name: dict[str, dict[int, LoggedValue]] = {}
        for device, records in enumerate(stages):
            for record in records:
                by_name.setdefault(record.name, {})[device] = record
        merged = []
        for name, logged in by_name.items():
            device = self.last_device if self.last_device in logged else max(logged)
            values = [record.value for record in logged.values()]
            total = _GRAD_NORM_TOTAL.fullmatch(name)
            if total is not None and len(values) > 1 and None not in values:
                order = float(total["order"])
                norm = max(values) if order == float("inf") else sum(v ** order for v in values) ** (1 / order)
                merged.append((device, replace(logged[device], value=norm)))
                continue
            if any(value != values[0] for value in values[1:]):
                self._warn_differs(name, hook)
            merged.append((device, logged[device]))
        return merged

    def _warn_differs(self, name: str, hook: str) -> None:
        if name not in self._warned:
            self._warned.add(name)
            rank_zero_warn(
                f"self.log({name!r}) in {hook} got a different value on each pipeline stage (each stage holds only its "
                "own parameters and gradients, and only the last stage the values its steps collected); the last "
                f"stage's is logged. Log one name per stage (f'{name}/stage{{self.trainer.strategy.topology.stage}}') "
                "to keep them all; Lightning's grad_norm(self, p) gives every parameter's norm and their total over the "
                "whole model."
            )
