"""``lightning-pipe plan``: profile a LightningModule's trunk and predict every schedule before launching.

    lightning-pipe plan --model demo.MLPClassifier --model.num_features 784 --model.num_classes 10 \\
        --batch_shape [256,784] --stages 2 --memory_gib 1.0 --timeline plan.png

It builds the module from its class path and init arguments, captures the trunk input by running the
module's own code on one micro-batch (its ``forward`` on a random tensor of ``batch_shape``, or its
``training_step`` on the first batch of ``datamodule``), profiles every trunk layer at the smallest and
the largest candidate micro-batch size, and for every schedule and candidate micro-batch count runs the
exact min-max split (docs/algorithms.md §12). Named among the schedules, ``avgpipe`` is tuned as
``parallel_pipelines="auto"`` tunes it (docs/algorithms.md §13: ``N``, ``M`` and advance-forward on the
split 1F1B would use; prediction only, the strategy's trials on the devices need a run). It prints
schedules × predicted throughput and memory, the chosen plan's partition, the same schedule with
``balance="uniform"`` for comparison, and writes a timeline PNG of the chosen plan. Class paths also
resolve from the current directory.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from lightning.pytorch import LightningDataModule, LightningModule

from lightning_pipe import registry
from lightning_pipe.cli.plan_quality import quality_text
from lightning_pipe.cli.progress import ProfileProgress
from lightning_pipe.engine import batch_size as batch_size_of
from lightning_pipe.engine import split_micro_batches
from lightning_pipe.errors import PlanError
from lightning_pipe.lightning._compat import module_optimizers
from lightning_pipe.lightning.log_replay import LogCapture
from lightning_pipe.partition import find_trunk, resolve_balance, stage_bounds
from lightning_pipe.planning import avgpipe_tuner as avg_tuner
from lightning_pipe.planning.auto_balance import preserved_random_state
from lightning_pipe.planning.avgpipe_autotune import ADVANCES, MAX_REPLICAS, optimizer_factory, optimizer_spec
from lightning_pipe.planning.noise import MAX_SPREAD, MIN_GAIN
from lightning_pipe.planning.planner import (
    GIB,
    Machine,
    Plan,
    StagePlan,
    best_of,
    candidate_micro_batches,
    evaluate,
    explore,
    format_bytes,
    no_fit_error,
    planned_schedules,
    smallest_need,
)
from lightning_pipe.planning.profile import Profile, capture_trunk_input, interpolate, profile_trunk
from lightning_pipe.registry import SCHEDULES, build_schedule
from lightning_pipe.sim import Costs, simulate, simulate_async, timeline_png


def _averaging(schedule: str) -> bool:
    """avgpipe's family: tuned by its own tuner, not by the planner's split search."""
    return SCHEDULES[schedule].family == "averaging"


@dataclass
class PlanReport:
    """What ``lightning-pipe plan`` computed (the printed text is :attr:`text`)."""

    profiles: list[Profile]
    plans: dict[str, Plan | None]
    best: Plan | None
    uniform: Plan | None
    layer_names: list[str]
    text: str
    timeline: str | None = None
    simulated: Any = None  # lightning_pipe.sim.simulate.Simulation of the chosen plan
    avgpipe: AvgPipePlan | None = None  # when avgpipe was explored
    no_fit: str = ""  # why nothing fits, naming the smallest need (empty when a plan was found)
    repeats: int = 9  # timed rounds per batch (the spread is judged on the latest batch)
    max_spread: float | None = MAX_SPREAD  # the bound on that spread

    @property
    def noisy(self) -> bool:
        """A profile's timed rounds still spread more than ``max_spread``: the predictions are noise."""
        return any(p.noisy for p in self.profiles)


@dataclass
class AvgPipePlan:
    """avgpipe's tuned values next to the planner's terms.

    Args:
        schedule: the averaging schedule's name.
        candidate: the tuner's best candidate (``replicas`` = ``parallel_pipelines``, ``advance`` =
            ``advance_forward``).
        balance: trunk layers per stage (the split 1F1B would use).
        fits: the per-stage fitted costs it was predicted with.
        uniform: the same ``N``, ``M`` and advance on ``balance="uniform"``.
        step_note: why the STEP + AVG time is missing from the prediction (empty when it is in).
    """

    schedule: str
    candidate: avg_tuner.Candidate
    balance: list[int]
    fits: list[avg_tuner.StageFit]
    uniform: Plan | None
    step_note: str = ""


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain fixed-width table (Markdown-compatible pipes)."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |"

    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def _sample_input(
    model: LightningModule, trunk: torch.nn.Module, micro_batch: int, batch_shape: Sequence[int] | None,
    batch_dtype: str, batch: Any,
) -> Any:
    """The trunk input for one micro-batch of ``micro_batch`` samples, from the module's own code."""
    if batch is not None:
        total = batch_size_of(batch)
        part = split_micro_batches(batch, max(1, total // micro_batch))[0]
        with LogCapture(model):
            return capture_trunk_input(model, trunk, lambda: model.training_step(part, 0), "training_step")
    dtype = getattr(torch, batch_dtype)
    shape = (micro_batch, *batch_shape[1:])
    x = torch.randn(shape, dtype=dtype) if dtype.is_floating_point else torch.zeros(shape, dtype=dtype)
    return capture_trunk_input(model, trunk, lambda: model(x), "forward")


def plan(
    model: LightningModule,
    stages: int,
    batch_shape: list[int] | None = None,
    batch_dtype: str = "float32",
    datamodule: LightningDataModule | None = None,
    memory_gib: float | list[float] | None = None,
    speeds: list[float] | None = None,
    schedules: list[str] | None = None,
    micro_batches: list[int] | None = None,
    min_micro_batches: int = 1,
    max_micro_batches: int | None = None,
    chunks: int = 2,
    bandwidth_gbps: float | None = None,
    latency_us: float = 0.0,
    kappa: float = 4.0,
    checkpoint_activations: bool = False,
    module: str | None = None,
    device: str = "cpu",
    cache: str | None = None,
    timeline: str | None = "plan.png",
    overwrite: bool = False,
    repeats: int = 9,
    max_spread: float | None = MAX_SPREAD,
    max_repeats: int | None = None,
    progress: bool = True,
    min_gain: float = MIN_GAIN,
    threads: int | None = None,
    max_parallel_pipelines: int = MAX_REPLICAS,
    advance_forward: list[int] | None = None,
) -> PlanReport:
    """Profile ``model``'s trunk, predict every schedule × micro-batch count, print the best plan.

    Args:
        model: the LightningModule (class path and init arguments).
        stages: pipeline stages (processes per pipeline).
        batch_shape: shape of one mini-batch as the module's ``forward`` takes it, e.g. ``[256, 784]``
            (dim 0 is the batch size ``B``); the forward runs on a random tensor (zeros for integer dtypes).
        batch_dtype: torch dtype name of that tensor (``float32``, ``int64``...).
        datamodule: instead of ``batch_shape``: a LightningDataModule whose first training batch (its
            size is ``B``) goes through the module's ``training_step``.
        memory_gib: memory limit per device in GiB (one value or one per stage); default: none.
        speeds: relative speed of each stage's device; default: all equal to the profiling device.
        schedules: schedules to explore; default: the synchronous ones (``gpipe``, ``1f1b``,
            ``interleaved_1f1b``, ``zb_h1``, ``zbv``, ``dualpipev``); asynchronous ones and ``avgpipe``
            change the training semantics, name them to include them.
        micro_batches: candidate micro-batch counts ``M``; default: the divisors of ``B`` within
            ``min_micro_batches`` .. ``max_micro_batches``.
        min_micro_batches: smallest candidate ``M``.
        max_micro_batches: largest candidate ``M`` (default ``B``).
        chunks: chunks per device for ``interleaved_1f1b``.
        bandwidth_gbps: link bandwidth between neighbouring stages in GB/s; default: transfers cost nothing.
        latency_us: link latency per transfer in microseconds.
        kappa: bytes of weights + gradient + optimizer state per parameter byte (4 for fp32 Adam).
        checkpoint_activations: predict with activation recomputation (less memory, one more forward); the
            schedules that refuse it (the zero-bubble ones, pipemare, xpipe) are left out.
        module: dotted path of the trunk (``nn.Sequential`` or ``nn.ModuleList``; default: as the strategy finds it).
        device: where to profile (``cpu``, ``cuda:0``...).
        cache: JSON file caching the profiles.
        timeline: PNG path for the chosen plan's simulated timeline; ``None`` to skip.
        overwrite: replace an existing ``timeline`` file (otherwise an existing file is an error).
        repeats: timed rounds in a batch (every layer once per round; each layer's fastest run is kept), after a
            warm-up that lasts until the timings settle.
        max_spread: bound on the spread of the latest ``repeats`` timed rounds (interquartile range of the
            per-round totals over their median, e.g. ``0.25`` = 25 %): above it ``repeats`` more rounds are timed,
            up to ``max_repeats``; a profile still above it is reported as noise, with no speed-up claimed (and
            is not cached). ``null``: time ``repeats`` rounds and trust them.
        max_repeats: most timed rounds per profile (default ``4 * repeats``).
        progress: show the profiling's progress on stderr (warm-up and timed rounds).
        min_gain: keep the uniform split unless another is predicted this much faster (``0.05`` = 5 %); smaller
            predicted gains are noise or the cost model's own approximation.
        threads: torch CPU threads while profiling; match what each stage process will get (Lightning's
            launcher gives each of ``n`` processes ``cores / n`` threads); default: torch's default.
        max_parallel_pipelines: largest number ``N`` of parallel pipelines avgpipe is tried with.
        advance_forward: advance-forward values avgpipe is tried with (default ``[0, 1, 2]``).
    """
    if timeline and os.path.exists(timeline) and not overwrite:
        raise PlanError(f"{timeline} exists; pass --overwrite true to replace it, another --timeline, or --timeline null.")
    _check_counts(stages=stages, chunks=chunks, min_micro_batches=min_micro_batches, repeats=repeats,
                  max_parallel_pipelines=max_parallel_pipelines)
    if micro_batches is not None and min(micro_batches, default=1) < 1:
        raise PlanError(f"--micro_batches {micro_batches} must hold counts of at least 1.")
    if advance_forward is not None and min(advance_forward, default=0) < 0:
        raise PlanError(f"--advance_forward {advance_forward} must hold counts of at least 0.")
    for name, value in (("memory_gib", memory_gib), ("bandwidth_gbps", bandwidth_gbps)):
        if value is not None and min(value if isinstance(value, list) else [value], default=0) <= 0:
            raise PlanError(f"--{name} {value} must be positive; leave it out for no limit.")
    machine = Machine(
        memory=None if memory_gib is None else (
            [m * GIB for m in memory_gib] if isinstance(memory_gib, list) else memory_gib * GIB),
        speeds=speeds,
        bandwidth=None if bandwidth_gbps is None else bandwidth_gbps * 1e9,
        latency=latency_us * 1e-6,
        kappa=kappa,
        recompute=checkpoint_activations,
    )
    machine.check(stages)  # before minutes of profiling
    chosen = list(schedules) if schedules else list(registry.names("synchronous"))
    unknown = [s for s in chosen if s not in registry.SCHEDULES]  # avgpipe goes through its tuner
    if unknown:
        raise PlanError(f"schedule {unknown[0]!r} is not known; choose among {', '.join(registry.SCHEDULES)}.")
    if threads is not None:
        torch.set_num_threads(threads)
    name, trunk = find_trunk(model, module)
    names = [type(layer).__name__ for layer in trunk]
    batch = None
    if datamodule is not None:
        with preserved_random_state():
            datamodule.prepare_data()
            datamodule.setup("fit")
            batch = next(iter(datamodule.train_dataloader()))
        total = batch_size_of(batch)
    elif batch_shape:
        total = int(batch_shape[0])
    else:
        raise PlanError("give batch_shape (e.g. --batch_shape [256,784]) or a datamodule to take a batch from.")
    if total < 1:
        raise PlanError(f"the batch has {total} samples; give a batch of at least one (--batch_shape's first entry).")
    if micro_batches and max(micro_batches) > total:
        raise PlanError(f"--micro_batches {micro_batches} asks for more micro-batches than the batch's {total} samples; "
                        f"give counts up to {total}.")
    candidates = list(micro_batches) if micro_batches else candidate_micro_batches(total, min_micro_batches, max_micro_batches)
    if not candidates:
        raise PlanError(f"no micro-batch count between {min_micro_batches} and {max_micro_batches or total} divides the "
                        f"batch of {total}; give --micro_batches, or other --min_micro_batches / --max_micro_batches.")
    sizes = sorted({total // max(candidates), total // min(candidates)})
    model.train()
    profiles = []
    for size in sizes:
        sample = _sample_input(model, trunk, size, batch_shape, batch_dtype, batch)
        with ProfileProgress(f"profiling {len(trunk)} layers at micro-batch size {size}", progress) as shown:
            profiles.append(profile_trunk(trunk, sample, device, repeats=repeats, cache=cache, module=model,
                                          max_spread=max_spread, max_repeats=max_repeats, progress=shown))
    if checkpoint_activations:  # PipeStrategy refuses these with it (docs/options.md)
        refused = [s for s in chosen if not SCHEDULES[s].recomputes_activations]
        if schedules and refused:
            raise PlanError(f"{', '.join(refused)} cannot recompute activations; leave them out of --schedules or drop "
                            "--checkpoint_activations.")
        chosen = [s for s in chosen if s not in refused]
    plans = explore(profiles, total, stages, [s for s in chosen if s in planned_schedules()], candidates, machine, chunks,
                    min_gain)
    avgpipe = None
    if any(_averaging(s) for s in chosen):
        averaging = next(s for s in chosen if _averaging(s))
        avgpipe = plan_avgpipe(averaging, model, trunk, profiles, total, stages, candidates, machine,
                               max_parallel_pipelines, advance_forward if advance_forward is not None else ADVANCES, min_gain)
        plans = {s: (avgpipe_as_plan(avgpipe) if avgpipe else None) if _averaging(s) else plans[s] for s in chosen}
    best = best_of(plans.values())
    no_fit = ""
    if best is None:
        searched = [s for s in chosen if s in planned_schedules()]
        smallest = smallest_need(profiles, total, stages, searched, candidates, machine, chunks) if searched else None
        if smallest is not None:
            no_fit = str(no_fit_error(len(trunk), stages, machine, smallest))
        elif searched:
            no_fit = (f"none of {', '.join(searched)} can run {len(trunk)} layers on {stages} stages with micro_batches in "
                      f"{candidates}; use fewer stages, other micro-batch counts or other schedules.")
        else:
            no_fit = "avgpipe does not fit with two or more parallel pipelines; raise the memory limit or use more stages."
    uniform = None
    if best is not None and _averaging(best.schedule):
        uniform = avgpipe.uniform
    elif best is not None:
        v = chunks if SCHEDULES[best.schedule].chunked else 1
        counts = resolve_balance("uniform", trunk, stages * v)
        uniform = evaluate(interpolate(profiles, best.micro_batch_size), best.schedule, stages, best.micro_batches,
                           counts, machine, chunks, total)
    report = PlanReport(profiles, plans, best, uniform, names, "", avgpipe=avgpipe, no_fit=no_fit, repeats=repeats,
                        max_spread=max_spread)
    if best is not None and _averaging(best.schedule) and timeline:
        report.simulated = write_avgpipe_timeline(avgpipe, total, machine, stages, timeline)
        report.timeline = timeline
    elif best is not None and timeline:
        report.simulated = write_timeline(best, profiles, machine, stages, chunks, timeline)
        report.timeline = timeline
    report.text = render(report, type(model).__name__, name, total, stages, machine) + quality_text(model, chosen, stages)
    return report


def _check_counts(**counts: int) -> None:
    """Each of ``counts`` (``--name``: value) must be at least 1."""
    for name, value in counts.items():
        if value < 1:
            raise PlanError(f"--{name} {value} must be at least 1.")


def render(report: PlanReport, model_name: str, trunk_name: str, total: int, stages: int, machine: Machine) -> str:
    """The printed report."""
    layers = len(report.layer_names)
    limit = "no memory limit" if machine.memory is None else f"memory limit {format_bytes(machine.cap(0))}" + (
        " per device" if not isinstance(machine.memory, Sequence) else " (stage 0; per stage: "
        + ", ".join(format_bytes(machine.cap(d)) for d in range(stages)) + ")")
    sizes = " and ".join(str(p.micro_batch) for p in report.profiles)
    lines = [
        f"{model_name}: trunk {trunk_name} with {layers} layers, batch {total}, {stages} stages, {limit}",
        f"profiled on {report.profiles[0].device} at micro-batch sizes {sizes}: "
        + "; ".join(_measured(p, report.repeats) for p in report.profiles),
        *_identical(report.profiles[0], report.layer_names, trunk_name),
        *_noise_warning(report),
        "",
    ]
    rows = []
    for schedule, found in report.plans.items():
        kind = {"asynchronous": "async", "averaging": "elastic", "synchronous": "sync"}[SCHEDULES[schedule].family]
        if found is None:
            rows.append([schedule, kind, "-", "-", "-", "-", "-", "does not fit / not allowed"])
            continue
        m = str(found.micro_batches)
        if _averaging(schedule):
            m += f" (N={report.avgpipe.candidate.replicas}, a={report.avgpipe.candidate.advance})"
        rows.append([
            schedule, kind, m, str(found.balance), f"{found.step_time * 1e3:.2f}",
            f"{found.throughput:.0f}", format_bytes(max(found.memory)), str(found.weight_copies),
        ])
    lines.append(table(["schedule", "kind", "M", "balance", "step ms", "samples/s", "peak memory", "weight copies"], rows))
    if report.avgpipe is not None:
        lines.append("avgpipe: M per pipeline, N pipelines, advance a; its time is a simulated round of N pipelines' "
                     "batches including their optimizer steps and averaging (the other rows leave the optimizer step out)")
    best = report.best
    if best is None:
        lines.append(f"\nno schedule fits: {report.no_fit}")
        return "\n".join(lines)
    lines += [
        "",
        f"chosen: {best.schedule}, M={best.micro_batches} micro-batches of {best.micro_batch_size:g} samples, "
        f"balance={best.balance}: {best.step_time * 1e3:.2f} ms per batch, {best.throughput:.0f} samples/s (predicted)",
        "",
    ]
    if _averaging(best.schedule):
        c = report.avgpipe.candidate
        lines[-1:-1] = [f"  avgpipe: parallel_pipelines={c.replicas}, micro_batches={c.micro_batches} per pipeline, "
                        f"advance_forward={c.advance}" + (f"; {report.avgpipe.step_note}" if report.avgpipe.step_note else "")]
    elif report.avgpipe is not None and report.avgpipe.step_note:
        lines[-1:-1] = [f"  avgpipe: {report.avgpipe.step_note}"]
    rows = []
    for k, stage in enumerate(best.stages):
        where = f"{stage.device}" + (f" chunk {stage.chunk}" if SCHEDULES[best.schedule].chunked else "")
        rows.append([where, f"{trunk_name}[{stage.start}:{stage.end}]", ", ".join(report.layer_names[stage.start:stage.end]),
                     format_bytes(stage.params), f"{stage.time * 1e3:.3f}", format_bytes(stage.memory)])
    lines.append(table(["stage", "layers", "modules", "parameters", "ms per micro-batch", "peak memory"], rows))
    if report.uniform is not None:
        uniform = report.uniform
        gain = ("none claimed: the timings are noise (see the warning above)" if report.noisy
                else f"{uniform.step_time / best.step_time:.2f}x")
        lines += [
            "",
            f"balance='uniform' {uniform.balance} with the same schedule and M: {uniform.step_time * 1e3:.2f} ms per batch, "
            f"{uniform.throughput:.0f} samples/s, bottleneck {uniform.bottleneck * 1e3:.3f} ms "
            f"(chosen: {best.bottleneck * 1e3:.3f} ms); predicted speed-up of the chosen split: {gain}",
        ]
    if report.timeline:
        sim = report.simulated
        lines.append(f"\ntimeline of the chosen plan: {report.timeline} (simulated from the same costs: "
                     f"{sim.step_time * 1e3:.2f} ms per batch, bubble {sim.bubble_fraction:.0%})")
    return "\n".join(lines)


def _measured(profile: Profile, repeats: int) -> str:
    """How a profile was measured, for the report's second line."""
    if not profile.warmup_rounds:
        return "from the cache"
    last = min(repeats, profile.timed_rounds) if profile.timed_rounds else repeats
    return (f"{profile.warmup_rounds} warm-up rounds until settled, {profile.timed_rounds} timed rounds, the last {last} "
            f"within {profile.spread:.0%} (interquartile range / median)")


def _identical(profile: Profile, names: Sequence[str], trunk_name: str) -> list[str]:
    """The groups of structurally identical layers, which share one cost."""
    if not profile.groups:
        return []
    described = []
    for group in profile.groups:
        contiguous = list(group) == list(range(group[0], group[-1] + 1))
        where = f"{trunk_name}[{group[0]}:{group[-1] + 1}]" if contiguous else f"{trunk_name}{list(group)}"
        described.append(f"{len(group)} × {names[group[0]]} ({where})")
    return ["structurally identical layers share one cost, the median of their fastest runs: " + "; ".join(described)]


def _noise_warning(report: PlanReport) -> list[str]:
    """A warning when a profile's timed rounds still spread more than the bound."""
    noisy = [p for p in report.profiles if p.noisy]
    if not noisy:
        return []
    worst = max(noisy, key=lambda p: p.spread)
    bound = f"{report.max_spread:.0%}" if report.max_spread is not None else "the bound"
    return [
        f"warning: the timed rounds at micro-batch size {worst.micro_batch} still spread {worst.spread:.0%} after "
        f"{worst.timed_rounds} rounds (bound {bound}, --max_spread): the machine is too busy to tell the layers' costs "
        "apart, so the predictions below are noise and no speed-up is claimed; plan again on a quieter machine, or "
        "raise --max_repeats."
    ]


def plan_avgpipe(
    schedule: str, model: LightningModule, trunk: torch.nn.Module, profiles: Sequence[Profile], total: int, stages: int,
    micro_batches: Sequence[int], machine: Machine, max_replicas: int, advances: Sequence[int], min_gain: float = 0.0,
) -> AvgPipePlan | None:
    """avgpipe's best predicted ``N`` (at least 2: one pipeline is 1F1B with an idle center copy),
    ``M`` and advance on the split 1F1B would use, as ``parallel_pipelines="auto"`` predicts it
    (docs/algorithms.md §13); ``None`` when nothing fits."""
    flushed = SCHEDULES[schedule].flushed
    one_replica = explore(profiles, total, stages, [flushed], micro_batches, machine, min_gain=min_gain)[flushed]
    if one_replica is None:
        return None
    steps, note = _step_times(model, trunk, one_replica.balance)
    fits = _at_speeds(avg_tuner.fit_stages(profiles, one_replica.balance, steps), machine)
    memory = None if machine.memory is None else [machine.cap(d) for d in range(stages)]
    options = dict(bandwidth=machine.bandwidth, latency=machine.latency, kappa=machine.kappa)
    try:
        ranked = avg_tuner.tune(fits, total, max_replicas, micro_batches, advances, memory, **options)
    except ValueError:  # nothing fits the memory limits
        return None
    ranked = [c for c in ranked if c.replicas >= 2]
    if not ranked:
        return None
    best = ranked[0]
    counts = resolve_balance("uniform", trunk, stages)
    steps, _ = _step_times(model, trunk, counts)
    uniform_fits = _at_speeds(avg_tuner.fit_stages(profiles, counts, steps), machine)
    uniform = avg_tuner.predict(uniform_fits, total, best.replicas, best.micro_batches, best.advance, **options)
    return AvgPipePlan(schedule, best, list(one_replica.balance), fits, _candidate_plan(schedule, uniform, uniform_fits, counts), note)


def avgpipe_as_plan(avgpipe: AvgPipePlan) -> Plan:
    """The tuned avgpipe candidate as a :class:`Plan` (time per round of ``N`` pipelines' batches)."""
    return _candidate_plan(avgpipe.schedule, avgpipe.candidate, avgpipe.fits, avgpipe.balance)


def _candidate_plan(schedule: str, candidate: avg_tuner.Candidate, fits: Sequence[avg_tuner.StageFit], counts: Sequence[int]) -> Plan:
    b, stages, start = candidate.micro_batch_size, [], 0
    for d, (fit, count) in enumerate(zip(fits, counts)):
        stages.append(StagePlan(d, 0, start, start + count, fit.params, fit.forward(b) + fit.backward(b), candidate.memory[d]))
        start += count
    return Plan(schedule, candidate.micro_batches, b, list(counts), stages, candidate.round_time, candidate.throughput,
                candidate.replicas + 1, list(candidate.memory))


def _step_times(model: LightningModule, trunk: torch.nn.Module, counts: Sequence[int]) -> tuple[list[float] | None, str]:
    """Each stage's STEP + AVG seconds with the module's own optimizer, or ``None`` and why not."""
    try:
        optimizers = module_optimizers(model)
        factory = optimizer_factory(optimizer_spec(optimizers[0]))
    except Exception as error:  # configure_optimizers may need a Trainer
        return None, (f"its optimizer steps are left out: configure_optimizers failed outside a Trainer "
                      f"({type(error).__name__}: {error})")
    return [avg_tuner.profile_step(trunk[start:end], factory) for start, end in stage_bounds(list(counts))], ""


def _at_speeds(fits: list[avg_tuner.StageFit], machine: Machine) -> list[avg_tuner.StageFit]:
    """``fits`` on devices ``machine.speed(d)`` times as fast as the profiling one."""
    def scaled(line: avg_tuner.Line, speed: float) -> avg_tuner.Line:
        return avg_tuner.Line(line.c0 / speed, line.c1 / speed)

    return [replace(f, forward=scaled(f.forward, machine.speed(d)), backward=scaled(f.backward, machine.speed(d)),
                    step=f.step / machine.speed(d)) for d, f in enumerate(fits)]


def write_avgpipe_timeline(avgpipe: AvgPipePlan, total: int, machine: Machine, stages: int, path: str) -> Any:
    """Simulate one round of the tuned avgpipe candidate, draw it at ``path``, return the simulation."""
    c = avgpipe.candidate
    simulation = avg_tuner.simulate_round(avgpipe.fits, total, c.replicas, c.micro_batches, c.advance,
                                          machine.bandwidth, machine.latency)
    title = (f"avgpipe, {stages} stages, N={c.replicas} pipelines × M={c.micro_batches}, advance {c.advance}, "
             f"balance={avgpipe.balance} (predicted)")
    timeline_png(simulation.events, path, title=title)
    return simulation


def write_timeline(best: Plan, profiles: Sequence[Profile], machine: Machine, stages: int, chunks: int, path: str) -> Any:
    """Simulate the chosen plan with its predicted per-stage costs (``lightning_pipe.sim.simulate``), draw
    the timeline PNG at ``path`` and return the simulation."""
    profile = interpolate(profiles, best.micro_batch_size)
    forward, backward, transfer = [], [], []
    for stage in best.stages:
        layers = profile.layers[stage.start:stage.end]
        speed = machine.speed(stage.device)
        forward.append(sum(l.forward for l in layers) / speed)
        backward.append(sum(l.backward for l in layers) / speed)
        out = layers[-1].output
        transfer.append(0.0 if machine.bandwidth is None else machine.latency + out / machine.bandwidth)
    costs = Costs(forward=forward, backward=backward, transfer=transfer, step=0.0)
    title = f"{best.schedule}, {stages} stages, M={best.micro_batches}, balance={best.balance} (predicted)"
    if SCHEDULES[best.schedule].family == "asynchronous":
        simulation = simulate_async(best.schedule, stages, best.micro_batches, costs, windows=4)
    else:
        v = chunks if SCHEDULES[best.schedule].chunked else 1
        simulation = simulate(build_schedule(best.schedule, stages, best.micro_batches, v), costs)
    timeline_png(simulation.events, path, title=title)
    return simulation


__all__ = ["AvgPipePlan", "PlanReport", "plan", "plan_avgpipe", "render", "table"]
