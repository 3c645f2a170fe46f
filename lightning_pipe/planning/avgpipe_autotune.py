"""avgpipe's ``"auto"`` options at fit start: profile, predict, try the best on the devices, adopt.

``parallel_pipelines``, ``micro_batches`` and ``advance_forward`` may each be ``"auto"``
(docs/algorithms.md §13; the Lightning side is :mod:`lightning_pipe.lightning.auto`):

1. Rank 0 takes the first training batch, profiles every trunk layer (:mod:`.profile`) at three
   micro-batch sizes and each stage's STEP + AVG with the user's optimizer class, fits the costs and
   ranks every candidate that fits the memory limit by predicted throughput
   (:func:`rank_candidates`, :mod:`.avgpipe_tuner`).
2. Trials (``trials`` > 1): every rank runs the best predicted candidates for a few rounds
   on copies of its stage with the real executor and transport (:mod:`.avgpipe_trials`),
   and the fastest measured wins. The prediction does not see what a real round adds to every
   compute action, so its close calls are often wrong; trials settle them.
3. Every rank adopts the choice. Random states and buffers are restored and the trials train copies,
   so training runs exactly as it would with the chosen values given by hand.

A run resumed from a checkpoint adopts the values stored in it (``pipe_avgpipe_config``) instead of
tuning again: the checkpoint's replicas only fit the configuration that wrote them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_pipe.errors import PipeConfigError
from lightning_pipe.planning import auto_balance
from lightning_pipe.planning.auto_balance import preserved_random_state
from lightning_pipe.planning.avgpipe_trials import Measured, OptimizerFactory, TrialStage, fastest, measure_candidates
from lightning_pipe.planning.avgpipe_tuner import Candidate, fit_stages, tune
from lightning_pipe.planning.profile import Profile

MAX_REPLICAS = 4  #: largest N tried for parallel_pipelines="auto"
ADVANCES = (0, 1, 2)  #: advance-forward values tried for advance_forward="auto"
SHOWN = 5  #: candidates printed at setup
CHECKPOINT_KEY = "pipe_avgpipe_config"  #: where a checkpoint keeps the tuned values


@dataclass(frozen=True)
class AutoValues:
    """avgpipe's tunable options as given: a number, or ``"auto"``."""

    parallel_pipelines: int | str
    micro_batches: int | str
    advance_forward: int | str

    @property
    def any_auto(self) -> bool:
        return "auto" in (self.parallel_pipelines, self.micro_batches, self.advance_forward)


@dataclass(frozen=True)
class Prediction:
    """Rank 0's profile-based ranking, with what trials need on every rank."""

    ranked: list[Candidate]  # every feasible candidate, best predicted first
    batch: int  # the Lightning batch L
    inputs: Any  # the trunk input of the whole profiled batch (the first stage feeds it to trials)
    optimizer: tuple[type, dict[str, Any]]  # the user's optimizer class and its defaults


@dataclass(frozen=True)
class Choice:
    """The tuner's decision: the chosen candidate, the prediction's ranking and, after trials, the measurements."""

    best: Candidate
    ranked: list[Candidate]
    measured: list[Measured] | None = None

    def as_options(self) -> dict[str, int]:
        """The values to store in a checkpoint (and to adopt from one)."""
        return options_record(self.best.replicas, self.best.micro_batches, self.best.advance)


def options_record(parallel_pipelines: int, micro_batches: int, advance_forward: int) -> dict[str, int]:
    """avgpipe's values as a checkpoint stores them under :data:`CHECKPOINT_KEY` (and the strategy adopts them)."""
    return {"parallel_pipelines": parallel_pipelines, "micro_batches": micro_batches, "advance_forward": advance_forward}


def profile_sizes(batch: int) -> list[int]:
    """Three micro-batch sizes spread over ``1..batch`` (fewer when the batch is tiny)."""
    return sorted({max(1, batch // 16), max(1, batch // 4), max(1, batch // 2)})


def optimizer_spec(optimizer: torch.optim.Optimizer) -> tuple[type, dict[str, Any]]:
    """``optimizer``'s class and the defaults its constructor accepts again (torch's ``AdamW`` keeps a
    ``decoupled_weight_decay`` default that ``AdamW(...)`` itself refuses)."""
    cls, defaults = type(optimizer), dict(optimizer.defaults)
    accepted = inspect.signature(cls.__init__).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        defaults = {k: v for k, v in defaults.items() if k in accepted}
    return cls, defaults


def optimizer_factory(spec: tuple[type, dict[str, Any]]) -> OptimizerFactory:
    cls, defaults = spec
    return lambda params: cls(params, **defaults)


def rank_candidates(
    profiles: Sequence[Profile], steps: Sequence[float], counts: Sequence[int], values: AutoValues, batch: int,
    memory: list[float] | None = None,
) -> list[Candidate]:
    """Every feasible candidate, best predicted first (docs/algorithms.md §13 steps 1-4).

    Args:
        profiles: the trunk profiled at the sizes of :func:`profile_sizes`.
        steps: seconds of one STEP + AVG per stage with the user's optimizer class.
        counts: layers per stage.
        values: the options as given (``"auto"`` marks what is tuned).
        batch: the Lightning batch size.
        memory: bytes per stage (``None``: no limit).
    """
    fits = fit_stages(profiles, counts, steps)
    fixed = lambda value: None if value == "auto" else int(value)  # noqa: E731
    replicas, micro_batches, advance = fixed(values.parallel_pipelines), fixed(values.micro_batches), fixed(values.advance_forward)
    try:
        ranked = tune(
            fits, batch, max_replicas=replicas or MAX_REPLICAS,
            micro_batch_choices=None if micro_batches is None else (micro_batches,),
            advances=ADVANCES if advance is None else (advance,), memory=memory,
        )
    except ValueError as error:
        raise PipeConfigError(str(error)) from None
    if replicas is not None:
        ranked = [c for c in ranked if c.replicas == replicas]
    if not ranked:
        raise PipeConfigError(
            f"no avgpipe candidate with parallel_pipelines={values.parallel_pipelines} and micro_batches="
            f"{values.micro_batches} fits a batch of {batch}; let both be 'auto' or change the batch size."
        )
    return ranked


def agreed(is_rank_zero: bool, world_size: int, work: Callable[[], Any]) -> Any:
    """``work()`` on rank 0, broadcast to every rank (its error too)."""
    return auto_balance.agreed(is_rank_zero, world_size, work, what="the avgpipe tuner")


def decide(
    prediction: Prediction, trials: int, trial_stage: Callable[[Prediction], TrialStage] | None,
    is_rank_zero: bool, world_size: int, progress: Callable[[str], None] | None = None,
) -> Choice:
    """Every rank: the best predicted candidate, or with ``trials > 1`` the fastest of the best
    ``trials`` predicted ones measured on the devices (rank 0's measurements decide for all)."""
    top = prediction.ranked[:max(trials, 1)]
    if trials <= 1 or len(top) == 1 or trial_stage is None:
        return Choice(prediction.ranked[0], prediction.ranked[:SHOWN])
    with preserved_random_state():
        times = measure_candidates(trial_stage(prediction), top, progress=progress if is_rank_zero else None)
    times = agreed(is_rank_zero, world_size, lambda: times)  # one decision, rank 0's clock
    measured = fastest(top, times, prediction.batch)
    return Choice(measured[0].candidate, prediction.ranked[:SHOWN], measured)


def describe(choice: Choice) -> str:
    """The tuner's table: predicted candidates, measured ones after trials, the choice (rank 0 prints it)."""
    measured = {m.candidate: m for m in choice.measured or []}
    lines = ["avgpipe tuner (predicted from profiles" + (", then measured on the devices" if measured else "")
             + "; best predicted first):",
             "  N  M  a   b  predicted ms/round  predicted samples/s" + ("  measured ms/round  measured samples/s" if measured else "")]
    for c in choice.ranked:
        row = f"  {c.replicas}  {c.micro_batches}  {c.advance}  {c.micro_batch_size:>2}  {c.round_time * 1e3:>18.2f}  {c.throughput:>19.0f}"
        if c in measured:
            m = measured[c]
            row += f"  {m.round_time * 1e3:>17.2f}  {m.throughput:>18.0f}"
        lines.append(row + ("   <- chosen" if c == choice.best else ""))
    return "\n".join(lines)
