"""``PipeStrategy``'s options: grouped, checked, and the flat names of 0.1 mapped onto the groups.

Every check here needs neither the Trainer nor the module, so it runs in ``PipeStrategy(...)``,
before anything launches; :mod:`.checks` holds those that need them. Each failure is one
:class:`~lightning_pipe.errors.PipeConfigError` sentence that says what to change.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeVar, get_args

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_pipe.engine.policies import (
    AsyncOptions,
    AvgPipeOptions,
    DoubleBufferOptions,
    PipeDreamOptions,
    PipeMareOptions,
    XPipeOptions,
)
from lightning_pipe.engine.policies.options import DecayRule, Prediction
from lightning_pipe.errors import PipeConfigError
from lightning_pipe.planning.auto_balance import AutoBalanceOptions
from lightning_pipe.registry import DEFAULT, SCHEDULES, ScheduleSpec, names, spec

Group = TypeVar("Group", PipeMareOptions, XPipeOptions, DoubleBufferOptions, PipeDreamOptions, AvgPipeOptions, AutoBalanceOptions)

#: The flat option names of lightning_pipe 0.1: ``name -> (group, field)``. They still work in 0.2,
#: with a FutureWarning that names the group to use; 0.3 removes them.
DEPRECATED: dict[str, tuple[str, str]] = {
    "pipemare_lr_reschedule": ("pipemare", "lr_reschedule"),
    "pipemare_lr_warmup_steps": ("pipemare", "lr_warmup_steps"),
    "pipemare_correction": ("pipemare", "correction"),
    "pipemare_correction_decay": ("pipemare", "correction_decay"),
    "xpipe_prediction": ("xpipe", "prediction"),
    "parallel_pipelines": ("avgpipe", "parallel_pipelines"),
    "avgpipe_alpha": ("avgpipe", "alpha"),
    "avgpipe_period": ("avgpipe", "period"),
    "avgpipe_averaging": ("avgpipe", "averaging"),
    "advance_forward": ("avgpipe", "advance_forward"),
    "avgpipe_trials": ("avgpipe", "trials"),
    "auto_balance_memory": ("auto_balance", "memory_gib"),
    "auto_balance_speeds": ("auto_balance", "speeds"),
    "profile_cache": ("auto_balance", "profile_cache"),
    "auto_balance_refine": ("auto_balance", "refine"),
}
_GROUPS = {"pipemare": PipeMareOptions, "xpipe": XPipeOptions, "avgpipe": AvgPipeOptions, "auto_balance": AutoBalanceOptions,
           "pipedream_2bw": DoubleBufferOptions, "pipedream": PipeDreamOptions}
_CLASS_NAMES = {group: cls.__name__ for group, cls in _GROUPS.items()}


@dataclass(frozen=True)
class PipeOptions:
    """Everything ``PipeStrategy`` was given, checked (see its arguments for the meaning of each)."""

    schedule: str = DEFAULT
    micro_batches: int | Literal["auto"] = 4
    stages: int | None = None
    pipelines: int = 1
    balance: str | list[int] = "uniform"
    module: str | None = None
    chunks_per_stage: int = 1
    checkpoint_activations: bool = False
    timeout: float = 1800.0
    startup_timeout: float = 1800.0
    checkpoint_timeout: float = 3600.0
    sync_warmup_epochs: int = 0
    pipemare: PipeMareOptions = field(default_factory=PipeMareOptions)
    xpipe: XPipeOptions = field(default_factory=XPipeOptions)
    avgpipe: AvgPipeOptions = field(default_factory=AvgPipeOptions)
    auto_balance: AutoBalanceOptions = field(default_factory=AutoBalanceOptions)
    trace_dir: str | None = None
    trace_steps: int = 3
    stage_metrics: bool = True
    sync_warmup_steps: int = 0
    pipedream_2bw: DoubleBufferOptions = field(default_factory=DoubleBufferOptions)
    pipedream: PipeDreamOptions = field(default_factory=PipeDreamOptions)
    shape_headers: Literal["on_change", "always"] = "on_change"
    transport: Literal["auto", "shared_memory", "process_group"] = "auto"
    delay_warmup_steps: int = 0
    quality_warning: bool = True
    save_distributed_checkpoint: bool = False
    grad_cosine_every: int = 0
    release_unused_outside: bool = True
    data_parallel: Literal["ddp", "fsdp"] = "ddp"
    fsdp_reshard: Literal["step", "micro_batch"] = "step"
    fsdp_unit: Literal["layer", "stage"] = "layer"

    @property
    def spec(self) -> ScheduleSpec:
        """The schedule's row of the registry."""
        return spec(self.schedule)

    @property
    def process_group_timeout(self) -> float:
        """The process group's timeout: long enough for start-up and checkpoint I/O (the pipeline's own
        waits are bounded by ``timeout`` apart)."""
        return max(self.timeout, self.startup_timeout, self.checkpoint_timeout)

    @property
    def asynchronous(self) -> AsyncOptions:
        """What the asynchronous weight policies read."""
        return AsyncOptions(self.pipemare, self.xpipe, self.pipedream_2bw, self.pipedream, self.delay_warmup_steps,
                            self.grad_cosine_every)

    @property
    def tuned(self) -> bool:
        """Whether avgpipe's tuner chooses any value at fit start."""
        return self.micro_batches == "auto" or (self.spec.family == "averaging" and self.avgpipe.tuned)


def as_group(value: Group | Mapping[str, Any] | None, cls: type[Group], name: str) -> Group:
    """``value`` as the option group ``cls`` (a dict of its fields is accepted; ``None``: the defaults)."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise PipeConfigError(f"{name}= has no option {', '.join(unknown)}; {cls.__name__} takes {', '.join(sorted(known))}.")
        return cls(**value)
    raise PipeConfigError(f"{name}= takes a {cls.__name__} or a dict of its fields, got {type(value).__name__}.")


def apply_deprecated(groups: dict[str, Any], flat: Mapping[str, Any]) -> dict[str, Any]:
    """Fold the 0.1 flat option names given (not ``None``) into their groups, with a FutureWarning each."""
    for name, value in flat.items():
        if value is None:
            continue
        group, field_name = DEPRECATED[name]
        warnings.warn(
            f"PipeStrategy({name}=...) is deprecated and will be removed in lightning_pipe 0.3; use "
            f"{group}={_CLASS_NAMES[group]}({field_name}=...) (in YAML: `{group}: {{{field_name}: ...}}`).",
            FutureWarning, stacklevel=4,
        )
        groups[group] = replace(groups[group], **{field_name: value})
    return groups


#: The names of :class:`PipeOptions`' fields: the ``PipeStrategy`` arguments :func:`resolve` takes.
FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(PipeOptions))


def resolve(given: Mapping[str, Any], deprecated: Mapping[str, Any] | None = None) -> PipeOptions:
    """Check the arguments of ``PipeStrategy`` and return them as :class:`PipeOptions`.

    Args:
        given: ``PipeStrategy``'s arguments by name, any of :data:`FIELDS` (those left out keep their
            defaults); an option group may be its dataclass, a dict of its fields or ``None``, and
            ``chunks_per_stage=None`` takes the schedule's default.
        deprecated: the 0.1 flat names (:data:`DEPRECATED`) by name; ``None`` values were not given.
    """
    unknown = sorted(set(given) - set(FIELDS))
    if unknown:  # PipeStrategy's signature and PipeOptions' fields must name the same options
        raise TypeError(f"PipeOptions has no field {', '.join(unknown)}")
    values = {name: value for name, value in given.items() if name not in _GROUPS}
    groups = {name: as_group(given.get(name), cls, name) for name, cls in _GROUPS.items()}
    groups = apply_deprecated(groups, deprecated or {})
    if values.get("chunks_per_stage") is None:
        values["chunks_per_stage"] = spec(values.get("schedule", DEFAULT)).default_chunks
    if "balance" in values and not isinstance(values["balance"], str):
        values["balance"] = list(values["balance"])
    for name in ("timeout", "startup_timeout", "checkpoint_timeout"):
        if name in values:
            values[name] = float(values[name])
    for name in ("save_distributed_checkpoint", "release_unused_outside"):
        if name in values:
            values[name] = bool(values[name])
    options = PipeOptions(**values, **groups)
    check(options)
    warn_unused_groups(options)
    return options


def warn_unused_groups(options: PipeOptions) -> None:
    """Warn (rank 0) about each option group set away from its defaults that the run will not read: most
    likely a schedule changed without its group, or a group meant for another schedule."""
    for name, cls in _GROUPS.items():
        if getattr(options, name) == cls():
            continue
        if name == "auto_balance" and options.balance != "auto":
            rank_zero_warn(f"lightning_pipe: auto_balance=... is ignored, since balance={options.balance!r}; use "
                           "balance='auto' to profile and plan the split, or remove auto_balance.")
        elif name != "auto_balance" and name != options.schedule:
            rank_zero_warn(f"lightning_pipe: {name}=... is ignored, since schedule={options.schedule!r} does not read it; "
                           f"use schedule={name!r}, or remove {name}.")


def check(options: PipeOptions) -> None:
    """The checks that need neither the Trainer nor the module."""
    o, row = options, options.spec
    if o.micro_batches == "auto":
        if row.family != "averaging":
            raise PipeConfigError(f"micro_batches='auto' needs schedule='avgpipe' (its tuner); give a number for {o.schedule!r}.")
    elif not isinstance(o.micro_batches, int) or o.micro_batches < 1:
        raise PipeConfigError(f"micro_batches={o.micro_batches!r} must be at least 1.")
    if o.stages is not None and o.stages < 1:
        raise PipeConfigError(f"stages={o.stages} must be at least 1.")
    if o.pipelines < 1:
        raise PipeConfigError(f"pipelines={o.pipelines} must be at least 1.")
    if o.chunks_per_stage < 1:
        raise PipeConfigError(f"chunks_per_stage={o.chunks_per_stage} must be at least 1.")
    if not row.chunked and o.chunks_per_stage != 1:
        chunked = " or ".join(f"schedule={name!r}" for name, other in SCHEDULES.items() if other.chunked)
        raise PipeConfigError(f"chunks_per_stage={o.chunks_per_stage} only applies to {chunked}; leave it at 1 for {o.schedule!r}.")
    if row.fixed_chunks is not None and o.chunks_per_stage != row.fixed_chunks:
        raise PipeConfigError(f"schedule={o.schedule!r} places exactly {row.fixed_chunks} chunks per device; "
                              f"leave chunks_per_stage unset (got {o.chunks_per_stage}).")
    if o.checkpoint_activations and not row.recomputes_activations:  # the rule `lightning-pipe plan` follows too
        if row.split_backward:
            # torch.utils.checkpoint recomputes the forward in every autograd pass that reaches it, and a split
            # backward makes one pass for I and one per group of weights for W
            raise PipeConfigError(f"schedule={o.schedule!r} splits each backward into several autograd passes, and "
                                  "checkpoint_activations=True would recompute the forward in every one of them; use "
                                  "checkpoint_activations=False, or schedule='1f1b' to recompute activations.")
        raise PipeConfigError(f"schedule={o.schedule!r} keeps no copy of the weights a forward ran on, so "
                              "checkpoint_activations=True would recompute each forward on its backward's weights: another "
                              "rule than the schedule's. Use checkpoint_activations=False, or schedule='pipedream' or "
                              "'pipedream_2bw', which recompute on their stashed weights.")
    for name in ("timeout", "startup_timeout", "checkpoint_timeout"):
        if not getattr(o, name) > 0:
            raise PipeConfigError(f"{name}={getattr(o, name)} must be a positive number of seconds.")
    if isinstance(o.balance, str) and o.balance not in ("uniform", "parameters", "auto"):
        raise PipeConfigError(f"balance={o.balance!r} is not known; use 'uniform', 'parameters', 'auto' (profile and plan "
                              "at setup) or a list of layer counts.")
    for name in ("sync_warmup_epochs", "sync_warmup_steps", "delay_warmup_steps", "grad_cosine_every"):
        if not isinstance(getattr(o, name), int) or getattr(o, name) < 0:
            raise PipeConfigError(f"{name}={getattr(o, name)!r} must be a whole number, at least 0.")
    if o.delay_warmup_steps and row.family != "asynchronous":
        stale = ", ".join(map(repr, names("asynchronous")))
        raise PipeConfigError(f"delay_warmup_steps={o.delay_warmup_steps} warms up stages whose gradients are stale, which "
                              f"only the schedules {stale} have; leave it at 0 for {o.schedule!r}.")
    if o.grad_cosine_every and row.family != "asynchronous":
        stale = ", ".join(map(repr, names("asynchronous")))
        raise PipeConfigError(f"grad_cosine_every={o.grad_cosine_every} measures how stale gradients turn, which only the "
                              f"schedules {stale} have; leave it at 0 for {o.schedule!r}.")
    if not isinstance(o.quality_warning, bool):
        raise PipeConfigError(f"quality_warning={o.quality_warning!r} must be True or False.")
    _check_policy_groups(o)
    _check_data_parallel(o)
    _check_avgpipe(o)
    _check_trace(o.trace_dir, o.trace_steps)
    if o.shape_headers not in ("on_change", "always"):
        raise PipeConfigError(f"shape_headers={o.shape_headers!r} is not known; use 'on_change' (send an activation's "
                              "shapes only when its micro-batch's differ from the previous one's) or 'always'.")
    if o.transport not in ("auto", "shared_memory", "process_group"):
        raise PipeConfigError(f"transport={o.transport!r} is not known; use 'auto' (shared memory between CPU processes "
                              "of one host where it works), 'shared_memory' or 'process_group' (torch.distributed).")


def _check_policy_groups(o: PipeOptions) -> None:
    """The asynchronous schedules' option groups: each value's type and range, so a typo fails here, not at the
    first step (or never: ``correction="no"`` is truthy)."""
    _check_flag("pipemare lr_reschedule", o.pipemare.lr_reschedule)
    _check_flag("pipemare correction", o.pipemare.correction)
    warmup = o.pipemare.lr_warmup_steps
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 1:
        raise PipeConfigError(f"pipemare lr_warmup_steps={warmup!r} must be a whole number of optimizer steps, at least 1; "
                              "to start every stage at the full learning rate, set lr_reschedule=False.")
    gamma = o.pipemare.correction_decay
    if not (isinstance(gamma, (int, float)) and not isinstance(gamma, bool) and 0 <= gamma < 1):
        raise PipeConfigError(f"pipemare correction_decay={gamma!r} must be in [0, 1) (the average of recent updates keeps "
                              "that share each STEP; 0.9, the default); to turn the correction off, set correction=False.")
    if o.pipemare.correction_decay_rule not in get_args(DecayRule):
        raise PipeConfigError(f"pipemare correction_decay_rule={o.pipemare.correction_decay_rule!r} is not known; use 'fixed' "
                              "(every stage decays by correction_decay) or 'per_stage' (correction_decay ** (1 / delay)).")
    lookahead = o.pipedream_2bw.lookahead
    if not (isinstance(lookahead, (int, float)) and math.isfinite(lookahead) and lookahead >= 0):
        raise PipeConfigError(f"pipedream_2bw lookahead={lookahead!r} must be a number >= 0 (0: the paper's rule, "
                              "2, the default: extrapolate the stale version by twice the last update).")
    compensation, decay = o.pipedream_2bw.delay_compensation, o.pipedream_2bw.delay_compensation_decay
    if not (isinstance(compensation, (int, float)) and math.isfinite(compensation) and compensation >= 0):
        raise PipeConfigError(f"pipedream_2bw delay_compensation={compensation!r} must be a number >= 0 (0, the default: "
                              "off; docs/lm-quality.md measured 2000 on a language model).")
    if not (isinstance(decay, (int, float)) and 0 <= decay < 1):
        raise PipeConfigError(f"pipedream_2bw delay_compensation_decay={decay!r} must be in [0, 1) (DC-ASGD's 0.95).")
    if o.xpipe.distances not in ("paper", "exact"):
        raise PipeConfigError(f"xpipe distances={o.xpipe.distances!r} is not known; use 'paper' (XPipe's formulas) or "
                              "'exact' (predict the version each mini-batch's STEP updates).")
    _check_flag("pipedream vertical_sync", o.pipedream.vertical_sync)
    if o.xpipe.momentum_direction not in ("buffer", "spectrain"):
        raise PipeConfigError(f"xpipe momentum_direction={o.xpipe.momentum_direction!r} is not known; use 'buffer' (SGD's "
                              "momentum buffer) or 'spectrain' (momentum * buffer + the last gradient).")
    if o.xpipe.prediction not in get_args(Prediction):
        raise PipeConfigError(f"xpipe prediction={o.xpipe.prediction!r} is not known; use one of "
                              f"{', '.join(map(repr, get_args(Prediction)))} ('auto': by the optimizer's type).")


def _check_flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise PipeConfigError(f"{name}={value!r} must be True or False.")


#: The schedules ``data_parallel="fsdp"`` runs (issue 33): synchronous ones whose backward is one autograd
#: pass per micro-batch, which FSDP2's per-layer hooks follow.
FSDP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def _check_data_parallel(o: PipeOptions) -> None:
    if o.data_parallel not in ("ddp", "fsdp"):
        raise PipeConfigError(f"data_parallel={o.data_parallel!r} is not known; use 'ddp' (every pipeline holds its whole "
                              "stage, gradients all-reduced) or 'fsdp' (each stage sharded across the pipelines).")
    if o.fsdp_reshard not in ("step", "micro_batch"):
        raise PipeConfigError(f"fsdp_reshard={o.fsdp_reshard!r} is not known; use 'step' (gather each sharded layer once "
                              "per step) or 'micro_batch' (gather it for every forward and backward, least memory).")
    if o.fsdp_unit not in ("layer", "stage"):
        raise PipeConfigError(f"fsdp_unit={o.fsdp_unit!r} is not known; use 'layer' (each trunk layer its own FSDP2 "
                              "unit) or 'stage' (each chunk of a stage one unit: fewer, larger collectives).")
    if o.data_parallel != "fsdp":
        if o.fsdp_reshard != "step":
            raise PipeConfigError(f"fsdp_reshard={o.fsdp_reshard!r} applies to sharded stages; set data_parallel='fsdp', "
                                  "or leave fsdp_reshard at 'step'.")
        if o.fsdp_unit != "layer":
            raise PipeConfigError(f"fsdp_unit={o.fsdp_unit!r} applies to sharded stages; set data_parallel='fsdp', "
                                  "or leave fsdp_unit at 'layer'.")
        return
    works = ", ".join(map(repr, FSDP_SCHEDULES))
    if not o.spec.synchronous:
        raise PipeConfigError(f"data_parallel='fsdp' shards each stage across pipelines that step together, which "
                              f"schedule={o.schedule!r} does not do (its stages step on their own); use one of {works}, or "
                              "data_parallel='ddp'.")
    if o.schedule not in FSDP_SCHEDULES:
        raise PipeConfigError(f"data_parallel='fsdp' does not follow schedule={o.schedule!r}'s backward split into input "
                              f"and weight gradients; use one of {works}, or data_parallel='ddp'.")


def _check_avgpipe(o: PipeOptions) -> None:
    a = o.avgpipe
    for name, value in (("parallel_pipelines", a.parallel_pipelines), ("advance_forward", a.advance_forward),
                        ("period", a.period), ("trials", a.trials)):
        whole = isinstance(value, int) and not isinstance(value, bool)
        if not whole and not (value == "auto" and name in ("parallel_pipelines", "advance_forward")):
            tuned = " or 'auto'" if name in ("parallel_pipelines", "advance_forward") else ""
            raise PipeConfigError(f"avgpipe {name}={value!r} must be a whole number{tuned}.")
        if value == "auto" and o.spec.family != "averaging":
            raise PipeConfigError(f"avgpipe {name}='auto' needs schedule='avgpipe' (its tuner); {o.schedule!r} does not use it.")
    if a.parallel_pipelines != "auto" and a.parallel_pipelines < 1:
        raise PipeConfigError(f"avgpipe parallel_pipelines={a.parallel_pipelines} must be at least 1 (or 'auto').")
    if a.alpha is not None and not 0.0 <= a.alpha <= 1.0:
        raise PipeConfigError(f"avgpipe alpha={a.alpha} must lie in [0, 1] (None picks 0.9 / parallel_pipelines).")
    if a.period < 1:
        raise PipeConfigError(f"avgpipe period={a.period} must be at least 1 (average every that many rounds).")
    if a.averaging not in ("async", "sync"):
        raise PipeConfigError(f"avgpipe averaging={a.averaging!r} must be 'async' or 'sync'.")
    if a.advance_forward != "auto" and a.advance_forward < 0:
        raise PipeConfigError(f"avgpipe advance_forward={a.advance_forward} must be at least 0 (or 'auto').")
    if a.trials < 0:
        raise PipeConfigError(f"avgpipe trials={a.trials} must be at least 0 (0 or 1: trust the tuner's prediction).")
    if o.tuned and o.balance == "auto":
        raise PipeConfigError("balance='auto' needs a fixed micro_batches; give layer counts or fix the avgpipe options.")


def _check_trace(trace_dir: str | None, trace_steps: int) -> None:
    """Fail at ``PipeStrategy(...)`` rather than at the end of a long fit."""
    if trace_dir is None:
        return
    if trace_steps < 1:
        raise PipeConfigError(f"trace_steps={trace_steps} must be at least 1 to record anything into trace_dir.")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError("trace_dir draws a timeline with matplotlib; pip install matplotlib (or lightning-pipe[plot]).") from None


def adopt_tuned(options: PipeOptions, values: Mapping[str, int]) -> PipeOptions:
    """``options`` with avgpipe's tuned (or a checkpoint's) ``parallel_pipelines``, ``micro_batches`` and
    ``advance_forward``."""
    avgpipe = replace(options.avgpipe, parallel_pipelines=int(values["parallel_pipelines"]),
                      advance_forward=int(values["advance_forward"]))
    return replace(options, micro_batches=int(values["micro_batches"]), avgpipe=avgpipe)
