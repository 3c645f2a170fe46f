"""Training throughput (samples/s) of lightning_pipe's engine vs ``torch.distributed.pipelining``.

    python benchmarks/throughput.py --workloads W1 W2 --windows 5 --steps-per-window 5

Two stages in two processes on CPU (gloo), one thread per process. Every training step is a full
mini-batch: the forwards and backwards of all micro-batches, then one SGD step (momentum 0.9).
For each workload and micro-batch count ``M`` one pair of worker processes builds every variant
from the same seed and measures them window by window, in rotating order, so machine noise hits
all variants alike:

* ``torch gpipe`` / ``torch 1f1b``: ``torch.distributed.pipelining``'s ``ScheduleGPipe`` /
  ``Schedule1F1B`` on a ``PipelineStage`` per process (``loss_fn`` given to the schedule);
  ``torch zbv`` / ``torch dualpipev`` (``--torch-schedules``): its zero-bubble V schedules
  ``ScheduleZBVZeroBubble`` / ``ScheduleDualPipeV``, two ``PipelineStage`` per process (virtual stages
  ``r`` and ``3 - r``, cut as ``Workload.v_split``);
* ``ours gpipe`` / ``ours 1f1b`` / ``ours zb_h1`` / ``ours zbv`` / ``ours dualpipev``: ``lightning_pipe.engine.Executor``
  running ``build_schedule`` with ``SequentialStage`` chunks, exactly what
  ``tests/distributed/test_engine.py`` does (``zbv``, ``dualpipev``: the same two chunks per process as torch's);
* ``single thread``: rank 0 alone runs the whole model on the same ``M`` micro-batches
  (accumulating gradients, one SGD step) while rank 1 idles. The ideal 2-stage pipeline then does
  ``2 × single thread × M / (M + 1)`` samples/s: each stage does half the work, and the
  ``P - 1 = 1`` bubble slot costs ``1 / (M + 1)`` of the step (measured at the micro-batch size, so
  small micro-batches' lower single-thread speed is in the ideal). The single thread is timed per
  stage, which gives the *balance bound* (the ideal for the actual, unequal stage times);
* ``stages at once, no communication``: both ranks compute their stage for all micro-batches at
  the same time with fixed inputs and gradients; its per-rank times give the *machine bound* (the
  balance bound at the speed two busy processes actually get on this machine).

Then the same schedule through Lightning (``L.Trainer(strategy=PipeStrategy(...))``) runs as its
own script invocation (Lightning's launcher re-executes ``sys.argv`` for rank 1); a callback times
windows of training steps and, between them, windows of the bare engine in the same processes,
which gives the strategy's overhead.

A window is ``--steps-per-window`` training steps between two barriers; samples/s of a window is
``steps × batch / seconds`` on rank 0. The table shows the median over windows with min-max, and
ratios as the median over windows of the per-window ratio (adjacent windows, so slow phases of the
machine cancel out). Every window also records the CPU time other processes used (``/proc/stat``
minus both ranks' own CPU time); rounds in which that exceeds ``--max-other-load`` cores are left
out of the medians.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import pickle
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

try:
    import lightning_pipe.engine  # noqa: F401
except ModuleNotFoundError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_pipe.engine import Executor, RunOptions, SequentialStage, Transport, Watchdog, split_micro_batches
from lightning_pipe.engine.shm import SharedMemoryTransport
from lightning_pipe.registry import build_schedule

STAGES = 2
LR = 0.01
MOMENTUM = 0.9
SEED = 0


# ---------------------------------------------------------------------------------------- workloads
class TokenEmbedding(nn.Module):
    """Token plus learned position embedding."""

    def __init__(self, vocab: int, d_model: int, seq_len: int) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab, d_model)
        self.position = nn.Parameter(torch.randn(seq_len, d_model) * 0.02)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.token(tokens) + self.position[: tokens.shape[1]]


class DecoderBlock(nn.Module):
    """Pre-norm GPT block: causal multi-head self-attention and a 4x GELU MLP."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def w1_model() -> nn.Sequential:
    """8 × (Linear(1024, 1024) + ReLU): 16 layers."""
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    return nn.Sequential(*layers)


def w1_batch(batch: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(SEED + 1)
    return torch.randn(batch, 1024, generator=g), torch.randn(batch, 1024, generator=g)


def w1_loss(output: Tensor, target: Tensor) -> Tensor:
    return F.mse_loss(output, target)


W2_VOCAB, W2_D_MODEL, W2_HEADS, W2_SEQ, W2_BLOCKS = 1024, 256, 4, 128, 4


def w2_model() -> nn.Sequential:
    """Embedding, 4 decoder blocks, final LayerNorm, LM head: 7 layers."""
    return nn.Sequential(
        TokenEmbedding(W2_VOCAB, W2_D_MODEL, W2_SEQ),
        *(DecoderBlock(W2_D_MODEL, W2_HEADS) for _ in range(W2_BLOCKS)),
        nn.LayerNorm(W2_D_MODEL),
        nn.Linear(W2_D_MODEL, W2_VOCAB),
    )


def w2_batch(batch: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(SEED + 1)
    tokens = torch.randint(0, W2_VOCAB, (batch, W2_SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def w2_loss(output: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(output.flatten(0, 1), target.flatten())


@dataclass(frozen=True)
class Workload:
    """A model (one ``nn.Sequential``), where it is cut, its data and its loss."""

    name: str
    description: str
    batch: int
    build: Callable[[], nn.Sequential]
    split: int  # layers of stage 0
    v_split: tuple[int, int, int, int]  # layers of virtual stages 0-3 (V schedules: 0 and 3 on rank 0)
    make_batch: Callable[[int], tuple[Tensor, Tensor]]
    loss: Callable[[Tensor, Tensor], Tensor]
    default_micro_batches: tuple[int, ...]

    def model(self) -> nn.Sequential:
        torch.manual_seed(SEED)
        return self.build()

    def balance(self) -> str | list[int]:
        """``balance`` for PipeStrategy that gives the same cut as :attr:`split`."""
        layers = len(self.build())
        return "uniform" if 2 * self.split == layers else [self.split, layers - self.split]


WORKLOADS = {
    "W1": Workload("W1", "8 × (Linear(1024,1024)+ReLU), MSE", 256, w1_model, 8, (4, 4, 4, 4), w1_batch, w1_loss, (4, 8)),
    "W2": Workload(
        "W2", "GPT decoder: 4 blocks, d_model 256, 4 heads, seq 128, vocab 1024", 32, w2_model, 3, (2, 1, 1, 3),
        w2_batch, w2_loss, (4, 8),
    ),
}


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


# ---------------------------------------------------------------------------------------- variants
class Variant:
    """One way of running a training step; ``step()`` is called on both ranks."""

    name: str
    samples_per_step: int

    def step(self) -> Tensor | None:
        """One training step; returns the mini-batch loss on the rank that computes it."""
        raise NotImplementedError

    def counters(self) -> dict[str, float]:
        """Extra numbers of the last window (and reset them)."""
        return {}


class SingleThread(Variant):
    """The whole model on rank 0 while rank 1 idles: ``M`` micro-batches accumulated, one SGD step.

    The model runs as its two stages with the boundary activation detached in between (the same
    arithmetic as one autograd graph), so each stage's compute time is measured too.
    """

    name = "single thread"

    def __init__(self, workload: Workload, micro_batches: int, rank: int) -> None:
        self.active = rank == 0
        self.samples_per_step = workload.batch
        model = workload.model()
        self.stages = (model[: workload.split], model[workload.split :])
        self.optimizers = tuple(sgd(stage.parameters()) for stage in self.stages)
        self.loss = workload.loss
        self.parts = split_micro_batches(workload.make_batch(workload.batch), micro_batches)
        self.stage_seconds = [0.0, 0.0]

    def step(self) -> Tensor | None:
        if not self.active:
            return None
        clock, spent = time.perf_counter, self.stage_seconds
        total = torch.zeros(())
        for x, y in self.parts:
            t0 = clock()
            hidden = self.stages[0](x)
            t1 = clock()
            received = hidden.detach().requires_grad_()
            loss = self.loss(self.stages[1](received), y) / len(self.parts)
            loss.backward()
            total += loss.detach()
            t2 = clock()
            hidden.backward(received.grad)
            t3 = clock()
            spent[0] += (t1 - t0) + (t3 - t2)
            spent[1] += t2 - t1
        for s, optimizer in enumerate(self.optimizers):
            t0 = clock()
            optimizer.step()
            optimizer.zero_grad()
            spent[s] += clock() - t0
        return total

    def counters(self) -> dict[str, float]:
        out = {"stage0_seconds": self.stage_seconds[0], "stage1_seconds": self.stage_seconds[1]}
        self.stage_seconds = [0.0, 0.0]
        return out


def stage_layers(workload: Workload, rank: int) -> nn.Sequential:
    model = workload.model()
    return model[: workload.split] if rank == 0 else model[workload.split :]


V_SCHEDULES = ("zbv", "dualpipev")  # two chunks per process, placed as a V


def v_chunks(workload: Workload, rank: int) -> tuple[nn.Sequential, nn.Sequential]:
    """Rank ``rank``'s two virtual stages of a V placement: ``rank`` and ``3 - rank``."""
    model, bounds = workload.model(), [0]
    for count in workload.v_split:
        bounds.append(bounds[-1] + count)
    parts = [model[bounds[k]: bounds[k + 1]] for k in range(4)]
    return parts[rank], parts[2 * STAGES - 1 - rank]


class StagesAtOnce(Variant):
    """Each rank computes its stage for all ``M`` micro-batches at the same time, without communication.

    Rank 0 back-propagates a fixed output gradient, rank 1 starts from a fixed activation; both take
    their SGD step. This is the pipeline's compute without the bubble and without any transfer, at
    the speed two busy processes get on this machine (they slow each other down: shared core
    resources, memory bandwidth, clock boost).
    """

    name = "stages at once, no communication"

    def __init__(self, workload: Workload, micro_batches: int, rank: int) -> None:
        self.rank = rank
        self.samples_per_step = workload.batch
        self.layers = stage_layers(workload, rank)
        self.optimizer = sgd(self.layers.parameters())
        self.loss = workload.loss
        parts = split_micro_batches(workload.make_batch(workload.batch), micro_batches)
        g = torch.Generator().manual_seed(SEED + 2)
        with torch.no_grad():
            boundary = [workload.model()[: workload.split](x) for x, _ in parts]
        if rank == 0:
            self.work = [(x, torch.randn(b.shape, generator=g)) for (x, _), b in zip(parts, boundary)]
        else:
            self.work = [(b, y) for b, (_, y) in zip(boundary, parts)]
        self.compute_seconds = 0.0

    def step(self) -> None:  # no meaningful loss: fixed inputs
        start = time.perf_counter()
        for inputs, other in self.work:
            if self.rank == 0:
                self.layers(inputs).backward(other)
            else:
                received = inputs.detach().requires_grad_()  # the pipeline's last stage computes this gradient too
                (self.loss(self.layers(received), other) / len(self.work)).backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.compute_seconds += time.perf_counter() - start

    def counters(self) -> dict[str, float]:
        out = {"compute_seconds": self.compute_seconds}
        self.compute_seconds = 0.0
        return out


class Engine(Variant):
    """lightning_pipe's executor with ``SequentialStage`` chunks (as in ``tests/distributed/test_engine.py``)."""

    def __init__(self, schedule: str, workload: Workload, micro_batches: int, rank: int, group: Any,
                 shape_headers: str = "on_change", shared_memory: bool = True) -> None:
        self.name = (f"ours {schedule}" + (" (headers always)" if shape_headers == "always" else "")
                     + ("" if shared_memory else " (gloo)"))
        self.samples_per_step = workload.batch
        loss = workload.loss
        read_input, to_loss = (lambda mb: mb[0]), (lambda output, mb: loss(output, mb[1]))
        if schedule in V_SCHEDULES:  # chunk 0 is virtual stage `rank` (rank 0: the first), chunk 1 is 3 - rank (rank 0: the last)
            layers = v_chunks(workload, rank)
            chunks = [SequentialStage(layers[0], input_fn=read_input if rank == 0 else None),
                      SequentialStage(layers[1], loss_fn=to_loss if rank == 0 else None)]
            self.layers = nn.ModuleList(layers)
        else:
            self.layers = stage_layers(workload, rank)
            chunks = [SequentialStage(self.layers, input_fn=read_input if rank == 0 else None,
                                      loss_fn=to_loss if rank == STAGES - 1 else None)]
        self.optimizer = sgd(self.layers.parameters())
        self.schedule = build_schedule(schedule, STAGES, micro_batches, len(chunks))
        self.micro_batches = micro_batches
        cpu = torch.device("cpu")  # PipeStrategy's default on one CPU host is shared memory (transport="auto")
        transport = SharedMemoryTransport.create(cpu) if shared_memory else Transport(cpu, group=group)
        self.executor = Executor(rank, list(range(STAGES)), chunks, transport, Watchdog(timeout=300.0), shape_headers=shape_headers)
        self.batch = workload.make_batch(workload.batch)

    def _optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad()

    def step(self) -> Tensor | None:
        parts = split_micro_batches(self.batch, self.micro_batches)
        losses = self.executor.run(self.schedule, parts, RunOptions(step=self._optimizer_step))
        return torch.stack(losses).mean() if losses else None


class TorchPipelining(Variant):
    """``torch.distributed.pipelining``: a ``PipelineStage`` per rank and ``ScheduleGPipe``/``Schedule1F1B``, or
    two per rank (virtual stages ``rank`` and ``3 - rank``) and ``ScheduleZBVZeroBubble``/``ScheduleDualPipeV``."""

    def __init__(self, schedule: str, workload: Workload, micro_batches: int, rank: int, group: Any) -> None:
        from torch.distributed import pipelining

        self.name = f"torch {schedule}"
        self.samples_per_step = workload.batch
        self.rank = rank
        cpu = torch.device("cpu")
        if schedule in V_SCHEDULES:
            layers = v_chunks(workload, rank)
            self.layers = nn.ModuleList(layers)
            stages = [pipelining.PipelineStage(layers[0], rank, 2 * STAGES, cpu, group=group),
                      pipelining.PipelineStage(layers[1], 2 * STAGES - 1 - rank, 2 * STAGES, cpu, group=group)]
            cls = {"zbv": pipelining.ScheduleZBVZeroBubble, "dualpipev": pipelining.ScheduleDualPipeV}[schedule]
            self.schedule = cls(stages, micro_batches, loss_fn=workload.loss)
            self.holds = (rank == 0, rank == 0)  # (first virtual stage, last virtual stage): both on rank 0
        else:
            self.layers = stage_layers(workload, rank)
            stage = pipelining.PipelineStage(self.layers, rank, STAGES, cpu, group=group)
            cls = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B}[schedule]
            self.schedule = cls(stage, micro_batches, loss_fn=workload.loss)
            self.holds = (rank == 0, rank == STAGES - 1)
        self.optimizer = sgd(self.layers.parameters())
        self.x, self.y = workload.make_batch(workload.batch)

    def step(self) -> Tensor | None:
        losses: list[Tensor] = []
        first, last = self.holds
        self.schedule.step(*((self.x,) if first else ()), **({"target": self.y, "losses": losses} if last else {}),
                           return_outputs=False)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return torch.stack(losses).mean().detach() if losses else None


def machine_busy_seconds() -> float:
    """CPU seconds every process of the machine has used so far (``/proc/stat``; steal time counts)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return math.nan
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class WindowClock:
    """Measures one window: wall seconds, this process's CPU seconds and the machine's busy CPU seconds.

    Call :meth:`start` and :meth:`stop` right after a barrier. Once every rank's own CPU time is
    known, the machine's busy time minus theirs is the load of other processes (noise).
    """

    def __init__(self) -> None:
        self.windows: list[dict[str, float]] = []

    def start(self) -> None:
        self._start = (time.perf_counter(), time.process_time(), machine_busy_seconds())

    def stop(self, **extra: float) -> None:
        wall, cpu, busy = self._start
        self.windows.append({
            "seconds": time.perf_counter() - wall,
            "own_cpu": time.process_time() - cpu,
            "busy": machine_busy_seconds() - busy,
            **extra,
        })


def other_load(windows_per_rank: Sequence[Sequence[dict[str, float]]]) -> list[float]:
    """Cores used by other processes in each window (rank 0's machine view minus every rank's CPU)."""
    out = []
    for per_rank in zip(*windows_per_rank):
        own = sum(w["own_cpu"] for w in per_rank)
        out.append(max(0.0, (per_rank[0]["busy"] - own) / per_rank[0]["seconds"]))
    return out


def timed_windows(
    variants: Sequence[Variant],
    windows: int,
    steps: int,
    warmup: int,
    barrier: Callable[[], None],
    first_losses: dict[str, float],
) -> dict[str, WindowClock]:
    """Time every variant; windows interleave the variants in rotating order.

    Returns a clock per variant; ``first_losses`` gets the loss of every variant's first step from
    the shared initial weights (where this rank computes it), which must agree across variants.
    """
    for variant in variants:
        loss = variant.step()
        if loss is not None:
            first_losses[variant.name] = loss.item()
        for _ in range(warmup - 1):
            variant.step()
        variant.counters()
        barrier()
    clocks = {v.name: WindowClock() for v in variants}
    for window in range(windows):
        shift = window % len(variants)
        for variant in list(variants[shift:]) + list(variants[:shift]):
            gc.collect()
            barrier()
            clocks[variant.name].start()
            for _ in range(steps):
                variant.step()
            barrier()
            clocks[variant.name].stop(samples=steps * variant.samples_per_step, **variant.counters())
    return clocks


def gather_windows(clocks: dict[str, WindowClock]) -> dict[str, list[dict[str, float]]]:
    """Rank 0's windows with ``other_load`` (cores) filled in from every rank's CPU time."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {name: clock.windows for name, clock in clocks.items()})
    out = {}
    for name in clocks:
        per_rank = [rank[name] for rank in everyone]
        load = other_load(per_rank)
        out[name] = [dict(w, other_load=l, ranks=list(r)) for w, l, r in zip(everyone[0][name], load, zip(*per_rank))]
    return out


def compare_worker(rank: int, workload_name: str, micro_batches: int, args: dict[str, Any]) -> dict[str, Any]:
    """Body of one rank of the comparison job."""
    workload = WORKLOADS[workload_name]
    variants: list[Variant] = [SingleThread(workload, micro_batches, rank), StagesAtOnce(workload, micro_batches, rank)]
    for schedule in args["torch_schedules"]:  # every pipelined variant talks on its own process group
        variants.append(TorchPipelining(schedule, workload, micro_batches, rank, dist.new_group(backend="gloo")))
    for schedule in args["schedules"]:
        variants.append(Engine(schedule, workload, micro_batches, rank, dist.new_group(backend="gloo")))
        if args.get("headers_always"):
            variants.append(Engine(schedule, workload, micro_batches, rank, dist.new_group(backend="gloo"), "always"))
        if args.get("gloo"):
            variants.append(Engine(schedule, workload, micro_batches, rank, dist.new_group(backend="gloo"), shared_memory=False))
    first_losses: dict[str, float] = {}
    clocks = timed_windows(
        variants, args["windows"], args["steps_per_window"], max(1, args["warmup_steps"]), dist.barrier, first_losses
    )
    every_rank: list[Any] = [None] * STAGES
    dist.all_gather_object(every_rank, first_losses)
    losses = {name: loss for rank in every_rank for name, loss in rank.items()}
    return {"windows": gather_windows(clocks), "threads": torch.get_num_threads(), "first_losses": losses}


# ---------------------------------------------------------------------------------------- processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _process_main(fn: Callable[..., Any], rank: int, port: int, out_dir: str, args: tuple) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=STAGES, timeout=timedelta(seconds=300))
        result: tuple[str, Any] = ("ok", fn(rank, *args))
    except BaseException as error:  # report everything to the parent
        result = ("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}")
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    os._exit(0)  # skip gloo teardown, which can block on a failed peer


def run_job(fn: Callable[..., Any], *args: Any, timeout: float) -> Any:
    """Run ``fn(rank, *args)`` on two spawned gloo processes; return rank 0's value.

    Processes still alive after ``timeout`` seconds are killed (a hung gloo rank ignores SIGTERM).
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [ctx.Process(target=_process_main, args=(fn, r, port, out_dir, args)) for r in range(STAGES)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        errors = []
        for rank, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join()
                errors.append(f"rank {rank}: killed after the {timeout:.0f} s timeout")
                continue
            path = os.path.join(out_dir, f"{rank}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {rank}: exited with code {p.exitcode} without a result")
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                errors.append(f"rank {rank}: {value}")
            elif rank == 0:
                result = value
        if errors:
            raise RuntimeError("benchmark job failed:\n" + "\n".join(errors))
        return result


# ---------------------------------------------------------------------------------------- Lightning
def lightning_available() -> str | None:
    """``None`` if ``lightning_pipe.PipeStrategy`` can be imported, else why not."""
    try:
        from lightning_pipe import PipeStrategy  # noqa: F401
    except Exception as error:  # noqa: BLE001 - any failure means the variant cannot run
        return f"{type(error).__name__}: {error}"
    return None


def lightning_worker(args: argparse.Namespace) -> None:
    """One invocation = one Lightning job (both ranks run this; Lightning starts rank 1)."""
    import lightning as L
    from torch.utils.data import DataLoader, Dataset

    from lightning_pipe import PipeStrategy

    torch.set_num_threads(1)
    workload = WORKLOADS[args.workload]
    micro_batches, schedule = args.micro_batches[0], args.schedules[0]
    steps, windows, warmup = args.steps_per_window, args.windows, args.warmup_steps

    class BenchModule(L.LightningModule):
        """An ordinary LightningModule: the trunk is one ``nn.Sequential``, the loss is computed in the step."""

        def __init__(self) -> None:
            super().__init__()
            self.model = workload.model()

        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            x, y = batch
            return workload.loss(self.model(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return sgd(self.parameters())

    class SameBatch(Dataset):
        """The same ready-made batch every step (``batch_size=None``: no collation cost)."""

        def __init__(self, length: int) -> None:
            self.batch = workload.make_batch(workload.batch)
            self.length = length

        def __len__(self) -> int:
            return self.length

        def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
            return self.batch

    class WindowTimer(L.Callback):
        """Times windows of Lightning steps and, alternately before and after each, a window of the bare engine."""

        def __init__(self) -> None:
            self.clocks = {"lightning": WindowClock(), "bare": WindowClock()}
            self.windows: dict[str, list[dict[str, float]]] = {}

        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            torch.set_num_threads(1)
            self.engine = Engine(schedule, workload, micro_batches, trainer.global_rank, dist.new_group(backend="gloo"))
            for _ in range(warmup):
                self.engine.step()

        def _bare_window(self) -> None:
            gc.collect()
            dist.barrier()
            self.clocks["bare"].start()
            for _ in range(steps):
                self.engine.step()
            dist.barrier()
            self.clocks["bare"].stop(samples=steps * workload.batch)

        def _window(self, batch_idx: int) -> int | None:
            k = batch_idx - warmup
            return k // steps if k >= 0 else None

        def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
            window = self._window(batch_idx)
            if window is None or (batch_idx - warmup) % steps:
                return
            if window % 2:
                self._bare_window()
            gc.collect()
            dist.barrier()
            self.clocks["lightning"].start()

        def on_train_batch_end(
            self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            window = self._window(batch_idx)
            if window is None or (batch_idx - warmup) % steps != steps - 1:
                return
            dist.barrier()
            self.clocks["lightning"].stop(samples=steps * workload.batch)
            if window % 2 == 0:
                self._bare_window()

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.windows = gather_windows(self.clocks)

    total = warmup + windows * steps
    timer = WindowTimer()
    strategy = PipeStrategy(schedule=schedule, micro_batches=micro_batches, balance=workload.balance())
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=STAGES,
        max_steps=total,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(BenchModule(), DataLoader(SameBatch(total), batch_size=None))
    if trainer.global_rank == 0:
        with open(args.out, "w") as f:
            json.dump({"windows": timer.windows, "threads": torch.get_num_threads()}, f)


def run_lightning_job(workload: str, micro_batches: int, schedule: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run this script with ``--lightning-worker`` in its own session; kill the session on timeout."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [
            sys.executable, os.path.abspath(__file__), "--lightning-worker", "--workloads", workload,
            "--micro-batches", str(micro_batches), "--schedules", schedule, "--windows", str(args.windows),
            "--steps-per-window", str(args.steps_per_window), "--warmup-steps", str(args.warmup_steps), "--out", out,
        ]
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "RANK", "WORLD_SIZE")}
        env["OMP_NUM_THREADS"] = "1"
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            log, _ = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the session holds rank 0 and the rank 1 it started
            proc.communicate()
            raise RuntimeError(f"the Lightning job was killed after the {args.timeout:.0f} s timeout")
        if proc.returncode != 0 or not os.path.exists(out):
            tail = "\n".join(log.splitlines()[-30:])
            raise RuntimeError(f"the Lightning job failed (exit code {proc.returncode}):\n{tail}")
        with open(out) as f:
            return json.load(f)


# ---------------------------------------------------------------------------------------- report
def wait_until_quiet(max_wait: float, threshold: float = 0.15, sample: float = 2.0) -> float:
    """Wait up to ``max_wait`` s until other processes use less than ``threshold`` cores; return the last load."""
    deadline = time.monotonic() + max_wait
    while True:
        busy, start = machine_busy_seconds(), time.monotonic()
        time.sleep(sample)
        load = (machine_busy_seconds() - busy) / (time.monotonic() - start)
        if not load >= threshold or time.monotonic() >= deadline:  # nan (no /proc/stat) counts as quiet
            return load


def samples_per_s(job: dict[str, Any], variant: str) -> list[float]:
    return [w["samples"] / w["seconds"] for w in job["windows"][variant]]


def drop_noisy_rounds(job: dict[str, Any], max_load: float, min_rounds: int = 3) -> dict[str, Any]:
    """Keep the rounds (window ``w`` of every variant) in which other processes used at most ``max_load`` cores.

    With fewer than ``min_rounds`` such rounds, every round is kept and ``job["rounds"]`` says so.
    """
    windows = job["windows"]
    total = len(next(iter(windows.values())))
    quiet = [w for w in range(total) if all(v[w]["other_load"] <= max_load for v in windows.values())]
    note = f"{len(quiet)}/{total}"
    if len(quiet) < min_rounds:
        quiet, note = list(range(total)), f"all {total} (only {len(quiet)} quiet)"
    return {**job, "windows": {name: [v[w] for w in quiet] for name, v in windows.items()}, "rounds": note}


def median_load(job: dict[str, Any], variant: str) -> float:
    return statistics.median(w["other_load"] for w in job["windows"][variant])


def references(job: dict[str, Any]) -> dict[str, Any]:
    """Per-window references of a comparison job.

    * ``ideal`` (the issue's definition): ``2 × single × M/(M+1)``, single thread at the micro-batch size;
    * ``machine``: the balance bound below with the stage times measured while both stages compute
      at once (``stages at once, no communication``): the speed two busy processes get on this machine;
    * ``balance``: with the single thread's per-step stage compute times ``T0, T1``, a 2-stage gpipe or
      1f1b step takes at least ``max(T0, T1) + min(T0, T1)/M`` (the slower stage never idles after
      its first micro-batch, the faster one adds one micro-batch at an end); equals the ideal when
      the stages are balanced. ``share`` is the median share of stage 1 in the compute.
    """
    m = job["micro_batches"]
    bubble = m / (m + STAGES - 1)
    single = samples_per_s(job, "single thread")

    def bound(samples: float, t0: float, t1: float) -> float:
        return samples / (max(t0, t1) + min(t0, t1) / m)

    out: dict[str, Any] = {
        "ideal": [STAGES * x * bubble for x in single],
        "machine": [
            bound(w["samples"], *(r["compute_seconds"] for r in w["ranks"]))
            for w in job["windows"]["stages at once, no communication"]
        ],
        "balance": [bound(w["samples"], w["stage0_seconds"], w["stage1_seconds"]) for w in job["windows"]["single thread"]],
    }
    shares = [w["stage1_seconds"] / (w["stage0_seconds"] + w["stage1_seconds"]) for w in job["windows"]["single thread"]]
    out["share"] = statistics.median(shares)
    return out


def loss_spread(job: dict[str, Any]) -> float:
    """Largest relative difference between the variants' first-step losses (same data, same initial weights)."""
    losses = list(job["first_losses"].values())
    return (max(losses) - min(losses)) / abs(statistics.median(losses))


def summary(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """Median over windows of ``a[w] / b[w]`` (adjacent windows, so slow phases cancel out)."""
    return statistics.median(x / y for x, y in zip(a, b))


def zero_bubble_summary(jobs: list[dict[str, Any]]) -> str:
    """Issue 16's ratios: our best zero-bubble schedule against torch's best schedule and our 1f1b (per window)."""
    lines = []
    for job in jobs:
        windows = job["windows"]
        ours = [name for name in windows if name in ("ours zb_h1", "ours zbv", "ours dualpipev")]
        theirs = [name for name in windows if name.startswith("torch ")]
        if not ours:
            continue

        def best(names: list[str]) -> str:
            return max(names, key=lambda name: statistics.median(samples_per_s(job, name)))

        mine = best(ours)
        parts = [f"{job['workload']} M={job['micro_batches']}: best zero-bubble {mine}"]
        if theirs:
            top = best(theirs)
            parts.append(f"vs {top} (torch's best) {paired_ratio(samples_per_s(job, mine), samples_per_s(job, top)):.2f}")
        if "ours 1f1b" in windows:
            parts.append(f"vs ours 1f1b {paired_ratio(samples_per_s(job, mine), samples_per_s(job, 'ours 1f1b')):.2f}")
        lines.append("- " + ", ".join(parts))
    return "\n\nZero-bubble (per-window ratios):\n\n" + "\n".join(lines) if lines else ""


def report(jobs: list[dict[str, Any]], lightning: list[dict[str, Any]], skipped: str | None) -> str:
    lines = [
        "| workload | M | variant | samples/s median (min-max) | vs torch.distributed.pipelining | vs ideal | other load |",
        "|---|---|---|---|---|---|---|",
    ]
    for job in jobs:
        wl, m = job["workload"], job["micro_batches"]
        ref = references(job)

        def row(name: str, values: Sequence[float], vs_torch: str = "", load: str = "", vs_ideal: bool = True) -> None:
            ratio = f"{paired_ratio(values, ref['ideal']):.2f}" if vs_ideal else ""
            lines.append(f"| {wl} | {m} | {name} | {summary(values)} | {vs_torch} | {ratio} | {load} |")

        def load(name: str) -> str:
            return f"{median_load(job, name):.2f}"

        row("**ideal**: 2 × single thread × M/(M+1)", ref["ideal"])
        row(f"balance bound: single-thread stage times (stage 1 does {ref['share']:.0%})", ref["balance"])
        row("machine bound: stage times with both stages computing at once", ref["machine"])
        row(f"single thread, 1 process, micro-batch {WORKLOADS[wl].batch // m}", samples_per_s(job, "single thread"),
            load=load("single thread"), vs_ideal=False)
        row("stages at once, no communication (no bubble)", samples_per_s(job, "stages at once, no communication"),
            load=load("stages at once, no communication"), vs_ideal=False)
        torch_names = [name for name in job["windows"] if name.startswith("torch ")]
        for name in torch_names:
            row(f"**{name}**", samples_per_s(job, name), "1.00", load(name))
        for schedule in job["schedules"]:
            same = f"torch {schedule}" if f"torch {schedule}" in job["windows"] else None
            torch_tp = samples_per_s(job, same) if same else []
            for name in (f"ours {schedule}", f"ours {schedule} (headers always)", f"ours {schedule} (gloo)"):
                if name not in job["windows"]:
                    continue
                values = samples_per_s(job, name)
                row(f"**{name}**", values, f"{paired_ratio(values, torch_tp):.2f}" if same else "", load(name))
            for lj in lightning:
                if (lj["workload"], lj["micro_batches"], lj["schedule"]) == (wl, m, schedule):
                    light = samples_per_s(lj, "lightning")
                    med = statistics.median(light)
                    lines.append(
                        f"| {wl} | {m} | ours {schedule} through Lightning (PipeStrategy)¹ | {summary(light)} "
                        f"| {med / statistics.median(torch_tp) if torch_tp else math.nan:.2f} "
                        f"| {med / statistics.median(ref['ideal']):.2f} "
                        f"| {median_load(lj, 'lightning'):.2f} |"
                    )
    out = "\n".join(lines) + zero_bubble_summary(jobs)
    out += (
        "\n\nRatios are medians of per-window ratios against the reference's window of the same round. "
        "other load: cores used by other processes during the variant's windows (median). Rounds kept: "
        + ", ".join(f"{j['workload']} M={j['micro_batches']}: {j['rounds']}" for j in jobs)
        + ". All variants compute the same thing: their first-step losses (same data, same initial weights) "
        + "differ by at most "
        + ", ".join(f"{loss_spread(j):.0e} ({j['workload']} M={j['micro_batches']})" for j in jobs)
        + " relative."
    )
    if lightning:
        out += (
            "\n\n¹ separate job right after the comparison job; its ratios are ratios of medians across the two jobs.\n\n"
            "Strategy overhead (Lightning windows and bare-engine windows alternate in the same two processes):\n\n"
            "| workload | M | schedule | bare engine | through Lightning | Lightning / bare | other load | rounds kept |\n"
            "|---|---|---|---|---|---|---|---|\n"
        )
        out += "\n".join(
            f"| {lj['workload']} | {lj['micro_batches']} | {lj['schedule']} | {summary(samples_per_s(lj, 'bare'))} "
            f"| {summary(samples_per_s(lj, 'lightning'))} "
            f"| {paired_ratio(samples_per_s(lj, 'lightning'), samples_per_s(lj, 'bare')):.2f} "
            f"| {median_load(lj, 'lightning'):.2f} | {lj['rounds']} |"
            for lj in lightning
        )
    if skipped:
        out += f"\n\nThrough Lightning: skipped ({skipped})."
    return out


# ---------------------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=["W1", "W2"])
    parser.add_argument("--micro-batches", nargs="+", type=int, default=None, help="default: 4 and 8")
    parser.add_argument("--schedules", nargs="+", choices=["gpipe", "1f1b", "zb_h1", "zbv", "dualpipev"], default=["gpipe", "1f1b"],
                        help="our schedules")
    parser.add_argument("--torch-schedules", nargs="+", choices=["gpipe", "1f1b", "zbv", "dualpipev"], default=None,
                        help="torch.distributed.pipelining's schedules (default: those of --schedules it has)")
    parser.add_argument("--windows", type=int, default=5, help="timed windows per variant")
    parser.add_argument("--headers-always", action="store_true",
                        help="also time our engine with a shape header on every activation (shape_headers='always')")
    parser.add_argument("--gloo", action="store_true",
                        help="also time our engine over gloo (transport='process_group'); 'ours' uses shared memory, "
                             "PipeStrategy's default between CPU processes of one host")
    parser.add_argument("--steps-per-window", type=int, default=5, help="training steps per window")
    parser.add_argument("--warmup-steps", type=int, default=3, help="untimed steps per variant first")
    parser.add_argument("--lightning", choices=["1f1b", "gpipe", "both", "none"], default="1f1b",
                        help="schedules to also run through Lightning (PipeStrategy)")
    parser.add_argument("--quiet-wait", type=float, default=120.0,
                        help="before each job wait up to this many seconds for other processes to go idle")
    parser.add_argument("--max-other-load", type=float, default=0.25,
                        help="drop rounds in which other processes used more cores than this (kept if < 3 rounds remain)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before a job is killed")
    parser.add_argument("--json", type=Path, default=None, help="also write every window's raw numbers here")
    parser.add_argument("--lightning-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.lightning_worker:
        args.workload = args.workloads[0]
    return args


def _announce(what: str, args: argparse.Namespace) -> None:
    if args.quiet_wait > 0:
        what += f" (other load before start: {wait_until_quiet(args.quiet_wait):.2f} cores)"
    print(f"{what} ...", flush=True)


def _done(job: dict[str, Any], start: float) -> None:
    medians = ", ".join(f"{name} {statistics.median(samples_per_s(job, name)):.0f}" for name in job["windows"])
    load = max(w["other_load"] for windows in job["windows"].values() for w in windows)
    print(f"  {time.monotonic() - start:.0f} s; samples/s: {medians}; other load up to {load:.2f} cores", flush=True)
    if "first_losses" in job:
        losses = ", ".join(f"{name} {loss:.6f}" for name, loss in job["first_losses"].items())
        print(f"  first-step losses: {losses}", flush=True)
        if loss_spread(job) > 1e-4:
            raise RuntimeError("the variants do not compute the same thing: their first-step losses differ")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.lightning_worker:
        lightning_worker(args)
        return
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {STAGES} processes × 1 thread, gloo", flush=True)
    light_schedules = {"none": [], "both": list(args.schedules), "1f1b": ["1f1b"], "gpipe": ["gpipe"]}[args.lightning]
    skipped = lightning_available() if light_schedules else None
    if skipped:
        print(f"through Lightning: skipped, lightning_pipe.PipeStrategy is not importable ({skipped})", flush=True)
        light_schedules = []
    if args.torch_schedules is None:
        args.torch_schedules = [s for s in args.schedules if s in ("gpipe", "1f1b", "zbv", "dualpipev")]
    job_args = {k: getattr(args, k) for k in ("schedules", "torch_schedules", "windows", "steps_per_window", "warmup_steps",
                                              "headers_always", "gloo")}
    jobs, lightning = [], []
    for wl in args.workloads:
        for m in args.micro_batches or WORKLOADS[wl].default_micro_batches:
            base = {"workload": wl, "micro_batches": m, "steps_per_window": args.steps_per_window}
            _announce(f"{wl}, M={m}: comparison job", args)
            start = time.monotonic()
            out = run_job(compare_worker, wl, m, job_args, timeout=args.timeout)
            jobs.append({**base, "schedules": args.schedules, **out})
            _done(jobs[-1], start)
            for schedule in light_schedules:
                _announce(f"{wl}, M={m}: Lightning job ({schedule})", args)
                start = time.monotonic()
                try:
                    out = run_lightning_job(wl, m, schedule, args)
                except RuntimeError as error:
                    print(f"  failed: {error}", flush=True)
                    skipped = str(error).splitlines()[0]
                    continue
                lightning.append({**base, "schedule": schedule, **out})
                _done(lightning[-1], start)
    if args.json:
        args.json.write_text(json.dumps({"argv": sys.argv, "jobs": jobs, "lightning": lightning}, indent=1))
        print(f"raw windows: {args.json}")
    print()
    quiet = [drop_noisy_rounds(job, args.max_other_load) for job in jobs]
    print(report(quiet, [drop_noisy_rounds(job, args.max_other_load) for job in lightning], skipped))


if __name__ == "__main__":
    main()
