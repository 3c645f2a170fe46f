"""Where ``data_parallel="fsdp"``'s step time goes on CPU processes (gloo), in two parts (issue 33).

**Collectives** (4 processes: 2 stages × 2 pipelines): each stage group (the same stage of both pipelines)
moves its trunk's gradients or shards the way ``data_parallel="ddp"`` and ``"fsdp"`` do, and nothing else:

- ``ddp``: one all-reduce of the stage's flat gradients (the bucketed all-reduce of ``GradientReducer``);
- ``fsdp per layer``: per layer, an all-gather of its parameters and a reduce-scatter of its gradient
  (``fsdp_reshard="step"``: FSDP2 with each layer its own unit);
- ``fsdp per stage``: one all-gather and one reduce-scatter of the whole stage (the stage as one unit).

It times nothing but the messages, so set against ``benchmarks/fsdp_memory.py``'s step times it says how
much of ``"fsdp"``'s extra step time the communication explains.

**FSDP2's work** (2 processes): one stage's forward and backward over the micro-batches, plain and under
``fully_shard`` (each layer a unit, the stage one unit), with the main thread's CPU time beside the wall time:
FSDP2's own host work is the CPU time it adds; the rest of the wall time it adds is waiting (for its
messages, and for the partner process to be scheduled on a shared machine). Run::

    python benchmarks/fsdp_costs.py --layers 4 --width 512 --repeats 30
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(rank: int, world: int, port: int, layers: int, width: int, repeats: int, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    stage_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # the same stage of both pipelines
    group = stage_groups[rank % 2]
    numel = width * width
    whole = [torch.randn(numel) for _ in range(layers)]
    shards = [t[: numel // 2].clone() for t in whole]
    flat_whole, flat_shard = torch.cat(whole), torch.cat(shards)

    def ddp() -> None:
        dist.all_reduce(flat_whole, group=group)

    def per_layer() -> None:
        for shard, full in zip(shards, whole):
            dist.all_gather_single(full, shard, group=group)
        for shard, full in zip(shards, whole):
            dist.reduce_scatter_single(shard, full, group=group)

    def per_stage() -> None:
        dist.all_gather_single(flat_whole, flat_shard, group=group)
        dist.reduce_scatter_single(flat_shard, flat_whole, group=group)

    medians: dict[str, list[float]] = {}
    for name, step in (("ddp", ddp), ("fsdp per layer", per_layer), ("fsdp per stage", per_stage)) * 2:  # interleaved
        dist.barrier()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        medians.setdefault(name, []).append(statistics.median(times) * 1e3)
    if rank == 0:
        results.put({name: min(values) for name, values in medians.items()})
    dist.barrier()
    dist.destroy_process_group()


def _run_fsdp2(rank: int, world: int, port: int, layers: int, width: int, repeats: int, micro_batches: int,
               results: Any) -> None:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh_dim_names=("dp",))

    def stage() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())])

    def shard(how: str) -> tuple[nn.Module, list[Any]]:
        model = stage()
        linears = [m for m in model if isinstance(m, nn.Linear)]
        if how == "per layer":  # data_parallel="fsdp", fsdp_unit="layer": each layer its own unit
            return model, [fully_shard(m, mesh=mesh, reshard_after_forward=False) for m in linears]
        if how == "per stage":  # fsdp_unit="stage": the stage (an nn.Sequential chunk) one unit
            return model, [fully_shard(model, mesh=mesh, reshard_after_forward=False)]
        return model, []

    timings: dict[str, tuple[float, float, float]] = {}
    for name in ("plain", "per layer", "per stage"):
        model, units = shard(name)
        optimizer = torch.optim.Adam(model.parameters(), foreach=False)
        passes, steps, cpu = [], [], []
        for i in range(repeats + 5):
            x = torch.randn(16, width)
            start, start_cpu = time.perf_counter(), time.thread_time()
            for mb in range(micro_batches):
                last = mb == micro_batches - 1
                for unit in units:
                    unit.set_requires_gradient_sync(last)
                    unit.set_reshard_after_backward(last)
                model(x).sum().backward()
            middle, middle_cpu = time.perf_counter(), time.thread_time()
            optimizer.step()
            optimizer.zero_grad()
            if i >= 5:  # warm-up
                passes.append(middle - start)
                cpu.append(middle_cpu - start_cpu)
                steps.append(time.perf_counter() - middle)
        name = "plain" if name == "plain" else f"fully_shard {name}"
        timings[name] = (statistics.median(passes) * 1e3, statistics.median(cpu) * 1e3, statistics.median(steps) * 1e3)
    if rank == 0:
        results.put(timings)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="Linear layers per stage (default 4)")
    parser.add_argument("--width", type=int, default=512, help="each layer's weight is width × width fp32 (default 512)")
    parser.add_argument("--repeats", type=int, default=30, help="steps timed per configuration and round (default 30)")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step of the FSDP2 part (default 4)")
    args = parser.parse_args()
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_run, args=(4, _free_port(), args.layers, args.width, args.repeats, results), nprocs=4,
                       start_method="spawn")
    medians = results.get()
    print(f"2 stages x 2 pipelines, gloo, {args.layers} x {args.width}x{args.width} fp32 per stage; "
          f"ms per step (rank 0, the better of 2 interleaved rounds' medians of {args.repeats})")
    for name, ms in medians.items():
        print(f"  {name:<15} {ms:7.2f} ms  ({ms / medians['ddp']:.2f}x ddp)")
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_run_fsdp2, args=(2, _free_port(), args.layers, args.width, args.repeats, args.micro_batches, results),
                       nprocs=2, start_method="spawn")
    print(f"one stage on 2 processes, {args.micro_batches} micro-batches of 16, Adam (foreach=False); ms per step (rank 0, "
          f"median of {args.repeats})")
    for name, (passes, cpu, step) in results.get().items():
        print(f"  {name:<28} forward+backward {passes:7.2f} ms (main thread's CPU time {cpu:6.2f} ms)   "
              f"optimizer step {step:6.2f} ms")


if __name__ == "__main__":
    main()
