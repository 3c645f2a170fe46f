"""The engine's cost on one GPU (issue 30): plain Lightning, accumulation and every schedule emulated.

    PYTHONPATH=. python benchmarks/gpu.py                              # the issue's GPT on one GPU
    PYTHONPATH=. python benchmarks/gpu.py --device cpu --tiny          # a dry run on the CPU
    PYTHONPATH=. python benchmarks/gpu.py --host-bound --steps 16      # the host-bound proxy on a CPU
    PYTHONPATH=. python benchmarks/gpu.py --variants accumulation 1f1b zbv --profile 1f1b zbv --profile-dir traces/
    PYTHONPATH=. python benchmarks/gpu.py --variants accumulation zbv zbv/w-main-thread pipemare pipemare/no-correction
    PYTHONPATH=. python benchmarks/gpu.py --variants accumulation pipemare pipemare/copy-weights xpipe xpipe/copy-weights

The model is a GPT (pre-LN blocks, causal attention through ``scaled_dot_product_attention``): by
default d_model 2048, 8 blocks, sequence 1024, batch 32, ``bf16-mixed``, AdamW. Every variant trains
the same batches with one optimizer step per batch of ``--batch`` samples:

* ``plain``: plain Lightning, the whole batch at once;
* ``accumulation``: plain Lightning on ``--micro-batches`` loader batches of ``batch / M`` samples with
  ``accumulate_grad_batches=M``: the same kernels as a pipeline's micro-batches, one optimizer step;
* every schedule through ``PipeStrategy(stages=P)``'s one-device emulation, with ``M`` micro-batches;
  P = ``--stages``, halved for the schedules with two chunks per device (interleaved_1f1b, zbv,
  dualpipev), so every schedule cuts the model into the same ``--stages`` virtual stages. avgpipe runs
  with ``parallel_pipelines=1``: its batch holds every replica's mini-batch (``N × B``), so with ``N``
  replicas a step would train ``N`` mini-batches of ``batch / N`` samples in ``N × M`` smaller
  micro-batches and step ``N`` times; with one replica it trains the ``batch`` in ``M`` micro-batches
  like accumulation, and its row shows what the replica's own optimizer step and the averaging with
  the center add.

A variant ``SCHEDULE/ABLATION`` (asked for by name, never in the default list) runs the schedule with one
piece of the engine changed (``ABLATIONS``): ``w-main-thread`` (every zero-bubble ``W`` on the main thread),
``w-task-per-group`` (one autograd task per weight group), ``no-correction`` (pipemare without its
discrepancy correction), ``forward-casts`` (pipemare's or xpipe's backwards read what their forwards saved),
``copy-weights`` (pipemare and xpipe copy each weight version into the parameters instead of exchanging
storages or redirecting their backwards), ``redirect-weights`` (they redirect even where this torch can
exchange). Set against the schedule in the same run, it measures what that
piece costs.

Per variant: milliseconds per optimizer step (median over ``--steps`` steps after ``--warmup``, the
device synchronised at step boundaries), the ratio accumulation / variant (above 1: faster than
accumulation), peak memory allocated on the device, and host synchronisations per step, counted over
``--sync-steps`` further steps with ``torch.cuda.set_sync_debug_mode("warn")`` (every implicit
synchronisation raises a warning; the timing's own ``torch.cuda.synchronize`` is off then), and the caching
allocator's ``cudaMalloc`` calls per timed step (the ``--json`` rows also hold its frees, retries and all-stream
synchronisations): a steady step should make none, and one that does waits on the driver. The
result is a markdown table (and ``--json`` rows); write the device, versions and date beside it
(printed above the table).

``--host-bound`` measures, on a CPU, what the emulation asks of the host: the same GPT structure (blocks,
micro-batches, stages) with d_model 32 and sequence 16 in float32, so its kernels cost little, timed by the main
thread's CPU time (``--clock cpu``). Where a GPU run is host-bound (docs/benchmarks.md: the H100 VM's was), its ratios
follow the host work; this proxy measures that work without a GPU, and, by CPU time, without the noise of
other processes on a shared machine.

``--profile VARIANT ...`` also records two steps of those variants with ``torch.profiler`` (CPU and CUDA
activities), after the timed and counted ones, every executor action labelled, and writes to
``--profile-dir`` (and prints) where the device idles: its busy share, the idle time during each executor
action, the optimizer step and the CUDA calls that wait for the device, and the idle time between steps.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any
from unittest import mock

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning_pipe  # noqa: E402
from lightning_pipe.engine import split_backward, weight_worker  # noqa: E402
from lightning_pipe.engine.policies.live import _LivePolicy  # noqa: E402
from lightning_pipe.engine.policies.saved_weights import BackwardWeights  # noqa: E402
from lightning_pipe.registry import names, spec  # noqa: E402

# ------------------------------------------------------------------------------------------ model


class Block(nn.Module):
    """A pre-LN transformer block: causal self-attention and a 4x MLP, each with a residual."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(attention)
        return x + self.mlp(self.ln2(x))


class GPT(L.LightningModule):
    """Token and position embeddings (first stage), an ``nn.Sequential`` trunk of blocks, a head (last stage)."""

    def __init__(self, vocab: int, d_model: int, blocks: int, seq: int, heads: int, lr: float = 1e-4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tokens, self.positions = nn.Embedding(vocab, d_model), nn.Embedding(seq, d_model)
        self.blocks = nn.Sequential(*[Block(d_model, heads) for _ in range(blocks)])
        self.ln, self.out = nn.LayerNorm(d_model), nn.Linear(d_model, vocab, bias=False)
        self.lr = lr

    def forward(self, idx: Tensor) -> Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.out(self.ln(self.blocks(self.tokens(idx) + self.positions(positions))))

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        logits = self(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class Tokens(Dataset):
    """``n`` random token windows of ``seq + 1`` tokens (inputs and shifted targets), fixed by the seed."""

    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.data = torch.randint(0, vocab, (n, seq + 1), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Tensor:
        return self.data[i]


# ------------------------------------------------------------------------------------------ timing


class CountOps(TorchDispatchMode):
    """Counts the aten operations dispatched inside it (on a GPU each is a kernel launch, or host-side
    bookkeeping for a view)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.count += 1
        return func(*args, **(kwargs or {}))


class CountCalls:
    """Counts the Python and builtin function calls made inside it on this thread, and among them the
    autograd engine's (``run_backward``: one per backward, per zero-bubble ``W`` group). On a GPU a zero-bubble
    ``W`` makes its calls on autograd's device thread (``split_backward.in_one_engine_task``): not counted there."""

    def __init__(self) -> None:
        self.calls = self.engine_calls = 0

    def _event(self, frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            self.calls += 1
            if event == "c_call" and getattr(arg, "__name__", "") == "run_backward":
                self.engine_calls += 1

    def __enter__(self) -> CountCalls:
        sys.setprofile(self._event)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.setprofile(None)


class StepClock(L.Callback):
    """Times optimizer steps ``warmup .. warmup + steps``, then counts host synchronisations (and where they
    come from) over ``sync_steps`` more; optionally counts the host's work (Python calls in one step, aten
    operations in the next), then profiles the two steps after those."""

    def __init__(self, cuda: bool, warmup: int, steps: int, sync_steps: int, profile_dir: str | None, label: str,
                 clock: str = "wall", count: bool = False) -> None:
        self.cuda, self.warmup, self.steps, self.sync_steps = cuda, warmup, steps, sync_steps
        self.clock = time.perf_counter if clock == "wall" else time.thread_time  # CLOCKS
        self.times: list[float] = []
        self.syncs = 0
        self.sync_sites: Counter[str] = Counter()
        self.peak = 0
        self.allocator: dict[str, float] = {}  #: the caching allocator's events per timed step (:data:`ALLOCATOR_EVENTS`)
        self._allocator_start: dict[str, int] = {}
        self._last_step = -1
        self._recorder: warnings.catch_warnings | None = None
        self._caught: list[warnings.WarningMessage] = []
        self.profile_dir, self.label = profile_dir, label
        self.count_start = warmup + steps + sync_steps if count else None
        self.profile_start = warmup + steps + sync_steps + (2 if count else 0)
        self.calls: CountCalls | None = None
        self.ops: CountOps | None = None
        self._counting: CountCalls | CountOps | None = None  # the counter on now
        self._profiler: torch.profiler.profile | None = None
        self._labels: ExitStack | None = None

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if step == self._last_step:  # inside an accumulation window: not a step boundary
            return
        self._last_step = step
        timing_end = self.warmup + self.steps
        if step <= timing_end:
            self._sync()
            self.times.append(self.clock())
            if step == self.warmup and self.cuda:
                torch.cuda.reset_peak_memory_stats()
                self._allocator_start = torch.cuda.memory_stats()
            if step == timing_end and self.cuda:
                self.peak = torch.cuda.max_memory_allocated()
                self.allocator = allocator_events(self._allocator_start, torch.cuda.memory_stats(), self.steps)
        if step == timing_end and self.cuda and self.sync_steps:  # count from here on
            self._recorder = warnings.catch_warnings(record=True)
            self._caught = self._recorder.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        elif step == timing_end + self.sync_steps and self._recorder is not None:
            self.stop_counting()
        self._count(step)
        self._profile(step)

    def _count(self, step: int) -> None:
        if self.count_start is None:
            return
        if step == self.count_start:
            self.calls = CountCalls().__enter__()
            self._counting = self.calls
        elif step == self.count_start + 1:
            self._end_count()
            self.ops = CountOps().__enter__()
            self._counting = self.ops
        elif step == self.count_start + 2:
            self._end_count()

    def _end_count(self) -> None:
        if self._counting is not None:
            self._counting.__exit__(None, None, None)
            self._counting = None

    def stop_counting(self) -> None:
        """End whatever counting is still on (at its step boundary, or when a run stops early)."""
        self._end_count()
        if self._recorder is None:
            return
        torch.cuda.set_sync_debug_mode("default")
        caught = [w for w in self._caught if "synchroniz" in str(w.message)]
        self.syncs = len(caught)
        self.sync_sites = Counter(f"{os.path.relpath(w.filename)}:{w.lineno}" for w in caught)
        self._recorder.__exit__(None, None, None)
        self._recorder = None

    def _profile(self, step: int) -> None:
        if self.profile_dir is None:
            return
        if step == self.profile_start:
            self._sync()
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._labels = ExitStack()
            self._labels.enter_context(labelled_actions())
            self._profiler = torch.profiler.profile(activities=activities, record_shapes=False)
            self._profiler.__enter__()
        elif step == self.profile_start + 2 and self._profiler is not None:
            self._sync()
            self._profiler.__exit__(None, None, None)
            self._labels.close()  # type: ignore[union-attr]
            os.makedirs(self.profile_dir, exist_ok=True)
            report = idle_report(self._profiler, self.label, self.cuda)
            with open(os.path.join(self.profile_dir, self.label.replace("/", "+") + ".txt"), "w") as f:  # an ablation's "/" is no folder
                f.write(report + "\n\n")
                f.write(self._profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
            print(report, flush=True)
            self._profiler = None

    def ms_per_step(self) -> float:
        gaps = [b - a for a, b in zip(self.times, self.times[1:])]
        return 1e3 * statistics.median(gaps) if gaps else math.nan


#: The caching allocator's counters (``torch.cuda.memory_stats``) that cost the host or the device when they move in
#: a steady step: a ``cudaMalloc`` or ``cudaFree`` (the latter synchronises the device), a retry after freeing the
#: cache, a synchronisation of every stream.
ALLOCATOR_EVENTS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def allocator_events(before: dict[str, int], after: dict[str, int], steps: int) -> dict[str, float]:
    """Each of :data:`ALLOCATOR_EVENTS` per step between two ``memory_stats()`` (0 where this torch lacks one)."""
    return {name.removeprefix("num_"): (after.get(name, 0) - before.get(name, 0)) / steps for name in ALLOCATOR_EVENTS}


@contextmanager
def labelled_actions() -> Iterator[None]:
    """Name every executor action in the profile (``pipe FORWARD`` ...), for :func:`idle_report`."""
    from lightning_pipe.engine.executor import Executor

    dispatch = Executor._dispatch

    def labelled(self: Executor, action: Any, step: Any) -> None:
        with torch.profiler.record_function(f"pipe {action.kind.name}"):
            dispatch(self, action, step)

    Executor._dispatch = labelled  # type: ignore[method-assign]
    try:
        yield
    finally:
        Executor._dispatch = dispatch  # type: ignore[method-assign]


#: CUDA runtime calls that can make the host wait for the device (a synchronize; a copy from pageable memory).
BLOCKING_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                  "cudaMemcpyAsync")


def idle_report(profiler: torch.profiler.profile, label: str, cuda: bool = True, min_gap_us: float = 20.0) -> str:
    """Where the device idles in the profiled steps: its busy share of the window, the idle time while each
    labelled host activity (an executor action, the optimizer step) ran, and the host's time inside CUDA
    calls that wait for the device. Without CUDA (a dry run) the "device" is the CPU's leaf aten ops."""
    events = profiler.events()

    def device_work(e: Any) -> bool:
        if cuda:
            return e.device_type == torch.autograd.DeviceType.CUDA
        return e.name.startswith("aten::") and not e.cpu_children

    kernels = sorted((e.time_range.start, e.time_range.end) for e in events
                     if device_work(e) and e.time_range.end > e.time_range.start)
    lines = [f"## profile of two steps of {label}"]
    if not kernels:
        return "\n".join(lines + ["no device activity recorded"])
    gaps, busy = [], 0.0
    start, end = kernels[0]
    for s, e in kernels[1:]:
        if s > end:
            if s - end >= min_gap_us:
                gaps.append((end, s))
            busy += end - start
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start
    window = kernels[-1][1] - kernels[0][0]
    idle = sum(e - s for s, e in gaps)
    lines.append(f"window {window / 1e3:.1f} ms, device busy {busy / 1e3:.1f} ms ({100 * busy / window:.1f} %), "
                 f"idle in gaps >= {min_gap_us:.0f} us: {idle / 1e3:.1f} ms in {len(gaps)} gaps")
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]

    def idle_during(ranges: list[tuple[float, float]]) -> float:
        """Device idle time inside the union of ``ranges`` (both lists sorted, a sweep)."""
        total, g = 0.0, 0
        for rs, re_ in ranges:
            while g < len(gaps) and gaps[g][1] <= rs:
                g += 1
            k = g
            while k < len(gaps) and gaps[k][0] < re_:
                total += min(re_, gaps[k][1]) - max(rs, gaps[k][0])
                k += 1
        return total

    by_label: dict[str, list[tuple[float, float]]] = {}
    for e in cpu:
        name = e.name
        if name.startswith("pipe ") or name.startswith("Optimizer.") or name.startswith("[") or name in BLOCKING_CALLS:
            by_label.setdefault(name, []).append((e.time_range.start, e.time_range.end))
    rows = []
    for name, ranges in by_label.items():
        ranges.sort()
        host = sum(e - s for s, e in ranges)
        rows.append((idle_during(ranges), host, len(ranges), name))
    rows.sort(reverse=True)
    step_ranges = sorted(r for name, ranges in by_label.items() if name.startswith("Optimizer.step") for r in ranges)
    lines.append(f"device idle outside the optimizer step (Lightning's loop between steps): "
                 f"{(idle - idle_during(step_ranges)) / 1e3:.1f} ms")
    lines.append("| host activity | calls | host ms | device idle during it, ms |")
    lines.append("|---|---|---|---|")
    lines += [f"| {name} | {n} | {host / 1e3:.1f} | {idle_ms / 1e3:.1f} |" for idle_ms, host, n, name in rows[:25]]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ runs

#: What ``--clock`` measures a step by.
CLOCKS = {
    "wall": "wall-clock time (the device synchronised at step boundaries)",
    "cpu": "the main thread's CPU time: on a CPU with a model small enough that its kernels cost little (the host-bound "
           "proxy in docs/benchmarks.md), the host work a step asks for, unmoved by other processes on a shared machine",
}


@dataclass
class Row:
    variant: str
    ms_per_step: float
    peak_gib: float | None
    syncs_per_step: float | None
    vs_accumulation: float | None = None
    sync_sites: dict[str, int] = field(default_factory=dict)  #: where the counted synchronisations were called
    python_calls: int | None = None  #: Python and builtin calls in one step (``--count``)
    engine_calls: int | None = None  #: autograd engine calls among them
    aten_ops: int | None = None  #: aten operations dispatched in one step (``--count``)
    allocator: dict[str, float] = field(default_factory=dict)  #: allocator events per timed step (:func:`allocator_events`)


@dataclass(frozen=True)
class Ablation:
    """A variant ``SCHEDULE/NAME``: the schedule with one piece of the engine changed, to measure what it costs."""

    options: dict[str, Any] = field(default_factory=dict)  #: merged into the schedule's PipeStrategy options
    patches: tuple[tuple[Any, str, Any], ...] = ()  #: ``(object, attribute, value)`` set during the run


#: Asked for by name (``--variants zbv zbv/w-main-thread``), never part of the default list.
ABLATIONS = {
    # one autograd task per weight group in W: what one task for all of them saves
    "w-task-per-group": Ablation(patches=((split_backward, "ONE_TASK_ON_DEVICES", False),)),
    # every W on the main thread: what the background worker (engine/weight_worker.py) saves
    "w-main-thread": Ablation(patches=((weight_worker, "ON_CUDA", False),)),
    # pipemare without its discrepancy correction: what the correction costs
    "no-correction": Ablation(options={"pipemare": {"correction": False}}),
    # pipemare's and xpipe's backwards read what their forwards saved (their bfloat16 casts of the weights, and
    # where storages cannot be exchanged their forwards' weights: another rule): what their saved-tensor hooks cost
    "forward-casts": Ablation(patches=((BackwardWeights, "hooks", lambda self: contextlib.nullcontext()),)),
    # pipemare and xpipe copy every weight version into the parameters: what exchanging storages (torch 2.13)
    # or redirecting the backwards (engine/policies/saved_weights.py) saves
    "copy-weights": Ablation(patches=((_LivePolicy, "moves_values", "copy"),)),
    # pipemare and xpipe redirect their backwards even where storages can be exchanged (as they do on torch 2.11):
    # what the saved-tensor hooks cost against the exchange, on a CPU with torch 2.13
    "redirect-weights": Ablation(patches=((_LivePolicy, "moves_values", "redirect"),)),
}


def variants(stages: int, chosen: list[str] | None) -> list[tuple[str, dict[str, Any] | None]]:
    """``(name, PipeStrategy options or None for plain Lightning)`` of every variant, ablations included where
    ``chosen`` names them."""
    out: list[tuple[str, dict[str, Any] | None]] = [("plain", None), ("accumulation", None)]
    for name in names():
        chunks = spec(name).fixed_chunks or (2 if spec(name).chunked else 1)
        options: dict[str, Any] = {"schedule": name, "stages": max(stages // chunks, 2)}
        if name == "interleaved_1f1b":
            options["chunks_per_stage"] = 2
        if name == "avgpipe":  # one replica: the batch's samples in M micro-batches, as accumulation (module docstring)
            options["avgpipe"] = {"parallel_pipelines": 1}
        out.append((name, options))
    base = dict(out)
    for wanted in chosen or []:
        name, _, ablation = wanted.partition("/")
        if ablation and base.get(name) is not None:
            if ablation not in ABLATIONS:
                raise SystemExit(f"unknown ablation {ablation!r} in {wanted!r}: choose from {sorted(ABLATIONS)}")
            out.append((wanted, {**base[name], **ABLATIONS[ablation].options}))
    return [v for v in out if chosen is None or v[0] in chosen]


def run_variant(name: str, options: dict[str, Any] | None, args: argparse.Namespace) -> Row:
    cuda = args.device == "cuda"
    profiling = name in (args.profile or [])
    total = args.warmup + args.steps + (args.sync_steps if cuda else 0) + (2 if args.count else 0) + (3 if profiling else 1)
    accumulate = args.micro_batches if name == "accumulation" else 1
    loader_batch = args.batch // accumulate
    data = Tokens(total * args.batch, args.seq, args.vocab)
    loader = DataLoader(data, batch_size=loader_batch, shuffle=False, drop_last=True)
    with torch.device(args.device):  # initialise on the device: minutes less for the issue's 0.4 B weights
        model = GPT(args.vocab, args.d_model, args.blocks, args.seq, args.heads)
    strategy: Any = "auto"
    if options is not None:
        strategy = lightning_pipe.PipeStrategy(micro_batches=args.micro_batches, quality_warning=False, **options)
    clock = StepClock(cuda, args.warmup, args.steps, args.sync_steps if cuda else 0,
                      args.profile_dir if profiling else None, name, args.clock, args.count)
    trainer = L.Trainer(accelerator=args.device, devices=1, strategy=strategy, precision=args.precision,
                        max_steps=total, accumulate_grad_batches=accumulate, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, callbacks=[clock])
    ablation = ABLATIONS.get(name.partition("/")[2], Ablation())
    try:
        with ExitStack() as patches:
            for target, attribute, value in ablation.patches:
                patches.enter_context(mock.patch.object(target, attribute, value))
            trainer.fit(model, loader)
    finally:
        clock.stop_counting()
    syncs = clock.syncs / args.sync_steps if cuda and args.sync_steps else None
    row = Row(name, clock.ms_per_step(), clock.peak / 2**30 if cuda else None, syncs,
              sync_sites=dict(clock.sync_sites.most_common(6)), allocator=clock.allocator)
    if clock.calls is not None and clock.ops is not None:
        row.python_calls, row.engine_calls, row.aten_ops = clock.calls.calls, clock.calls.engine_calls, clock.ops.count
    del trainer, model, strategy
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def table(rows: list[Row]) -> str:
    def cell(value: float | None, fmt: str) -> str:
        return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)

    counted = any(r.aten_ops is not None for r in rows)
    head = "| variant | ms / step | vs accumulation | peak GiB | host syncs / step | cudaMalloc / step |"
    lines = [head + (" Python calls / step | engine calls / step | aten ops / step |" if counted else ""),
             "|---" * (9 if counted else 6) + "|"]
    for r in rows:
        line = (f"| {r.variant} | {cell(r.ms_per_step, '.1f')} | {cell(r.vs_accumulation, '.2f')} | {cell(r.peak_gib, '.2f')} "
                f"| {cell(r.syncs_per_step, '.1f')} | {cell(r.allocator.get('device_alloc'), '.1f')} |")
        if counted:
            line += f" {cell(r.python_calls, ',')} | {cell(r.engine_calls, ',')} | {cell(r.aten_ops, ',')} |"
        lines.append(line)
    return "\n".join(lines)


def environment(device: str) -> str:
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine()
    return (f"{name}; torch {torch.__version__} (CUDA {torch.version.cuda}), lightning {L.__version__}, "
            f"{datetime.date.today().isoformat()}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="a model and run small enough for a CPU dry run")
    p.add_argument("--host-bound", action="store_true",
                   help="the host-bound proxy on a CPU: d_model 32, seq 16, float32, --clock cpu (module docstring)")
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--stages", type=int, default=4, help="virtual stages of the emulated pipeline")
    p.add_argument("--precision", default="bf16-mixed")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--sync-steps", type=int, default=2)
    p.add_argument("--variants", nargs="*", help="only these (plain, accumulation, schedule names)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="; ".join(f"{k}: {v}" for k, v in CLOCKS.items()))
    p.add_argument("--count", action="store_true",
                   help="also count the host's work in two steps after the timed ones: Python calls and autograd engine "
                        "calls in one, aten operations in the other (exact, unlike times on a shared machine)")
    p.add_argument("--profile", nargs="*", metavar="VARIANT",
                   help="also record two steps of these variants with torch.profiler (after the timed steps) and "
                        "report where the device idles")
    p.add_argument("--profile-dir", default="gpu_profile")
    p.add_argument("--json", metavar="PATH", help="also append the rows to this JSON-lines file")
    args = p.parse_args(argv)
    if args.tiny:
        args.d_model, args.blocks, args.heads, args.seq, args.vocab = 64, 4, 4, 32, 128
        args.batch, args.micro_batches, args.stages, args.warmup, args.steps, args.sync_steps = 8, 4, 4, 1, 3, 2
    if args.host_bound:
        args.device, args.clock, args.precision = "cpu", "cpu", "32-true"
        args.d_model, args.heads, args.seq, args.vocab = 32, 2, 16, 128
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device here; use --device cpu (with --tiny for a dry run)")
    if args.batch % args.micro_batches:
        p.error(f"--batch {args.batch} must be a multiple of --micro-batches {args.micro_batches}")
    return args


def main(argv: list[str] | None = None) -> list[Row]:
    args = parse(argv)
    print(environment(args.device), flush=True)
    print(f"GPT d_model {args.d_model}, {args.blocks} blocks, seq {args.seq}, batch {args.batch}, {args.precision}, "
          f"{args.micro_batches} micro-batches, {args.stages} virtual stages", flush=True)
    rows = []
    for name, options in variants(args.stages, args.variants):
        rows.append(run_variant(name, options, args))
        if args.json:  # row by row: a run stopped part-way keeps what it measured
            with open(args.json, "a") as f:
                f.write(json.dumps({**asdict(rows[-1]), "environment": environment(args.device), **vars(args)}) + "\n")
        sites = ", ".join(f"{site} x{n}" for site, n in rows[-1].sync_sites.items())
        print(f"{name}: {rows[-1].ms_per_step:.1f} ms/step" + (f"; syncs from {sites}" if sites else ""), flush=True)
    base = next((r.ms_per_step for r in rows if r.variant == "accumulation"), None)
    for row in rows:
        row.vs_accumulation = base / row.ms_per_step if base else None
    print(table(rows), flush=True)
    return rows


if __name__ == "__main__":
    main()
