"""Per-rank memory of parameters, gradients and optimizer state, and step time: ``data_parallel="ddp"``
against ``"fsdp"`` (``fsdp_reshard`` and ``fsdp_unit`` values, ``--configs``) at 2 stages × 2 pipelines on CPU processes (gloo), 1f1b,
Adam (issue 33).

    python benchmarks/fsdp_memory.py [--width 512] [--depth 8] [--batch 64] [--steps 12] [--rounds 1] [--configs ...]

Each configuration is one Lightning job of 4 processes (this script again, with ``--run``). Every rank
counts, at its last optimizer step, the bytes of the storages behind its parameters, their gradients and
the optimizer's state (a sharded tensor: this rank's shard; a stand-in: its one element), each storage
once. Step time is rank 0's wall time per training step after the first two steps (and the CPU time all ranks
spend per step, every thread counted: on a machine with fewer cores than processes, shared with other jobs,
it varies far less than the wall time); with ``--rounds R`` the
configurations run in turn R times and the median is shown (a shared machine's load drifts). What the table does
not count: FSDP2's buffers within a step (the layers gathered whole: one at a time with
``fsdp_reshard="micro_batch"``, the whole stage with ``"step"``; and the unsharded gradients it sums the
micro-batches into until the step's reduce-scatter: the stage's, as ``"ddp"`` holds them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

STAGES, PIPELINES = 2, 2


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor: its local shard)."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        if isinstance(tensor, DTensor):
            tensor = tensor.to_local()
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


CONFIGS = {"ddp": {"data_parallel": "ddp"}, "fsdp step": {"data_parallel": "fsdp", "fsdp_reshard": "step"},
           "fsdp micro_batch": {"data_parallel": "fsdp", "fsdp_reshard": "micro_batch"},
           "fsdp stage": {"data_parallel": "fsdp", "fsdp_reshard": "step", "fsdp_unit": "stage"},
           "fsdp stage micro_batch": {"data_parallel": "fsdp", "fsdp_reshard": "micro_batch", "fsdp_unit": "stage"},
           # the same without starting the step's all-gathers at its start (ShardedLayers.prefetch): each unit
           # gathers at its first forward
           "fsdp step no-prefetch": {"data_parallel": "fsdp", "fsdp_reshard": "step"},
           "fsdp stage no-prefetch": {"data_parallel": "fsdp", "fsdp_reshard": "step", "fsdp_unit": "stage"},
           # the same with FSDP2's hooks on every forward (ShardedLayers.early_forward off)
           "fsdp step hooked": {"data_parallel": "fsdp", "fsdp_reshard": "step"},
           "fsdp stage hooked": {"data_parallel": "fsdp", "fsdp_reshard": "step", "fsdp_unit": "stage"}}
DEFAULT_CONFIGS = ("ddp", "fsdp step", "fsdp micro_batch", "fsdp stage")


def run(config: str, width: int, depth: int, batch: int, steps: int, out: str) -> None:
    """One job: train and write every rank's numbers to ``out/rank{r}.json``."""
    import lightning as L
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from lightning_pipe import PipeStrategy

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.pre = nn.Linear(32, width)
            self.trunk = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.Tanh())])
            self.head = nn.Linear(width, 4)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.head(self.trunk(torch.relu(self.pre(x)))), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    class Measure(L.Callback):
        def __init__(self) -> None:
            self.record: dict[str, float] = {}
            self.times: list[float] = []
            self.cpu: list[float] = []

        def on_train_start(self, trainer, module):
            if config.endswith("no-prefetch"):
                trainer.strategy.sharding.prefetching = False
            if config.endswith("hooked"):
                trainer.strategy.sharding.quiet_early_forwards = False

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.started, self.started_cpu = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.times.append(time.perf_counter() - self.started)
            self.cpu.append(time.process_time() - self.started_cpu)
            optimizer = trainer.optimizers[0]
            self.record["optimizer"] = storage_bytes(
                t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor))

        def on_before_optimizer_step(self, trainer, module, optimizer):
            params = list(module.parameters())
            self.record["parameters"] = storage_bytes(params)
            self.record["gradients"] = storage_bytes(p.grad for p in params)

    x = torch.randn(batch * PIPELINES * steps, 32, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(x, (x[:, 0] > 0).long())
    measure = Measure()
    strategy = PipeStrategy(schedule="1f1b", micro_batches=4, pipelines=PIPELINES, **CONFIGS[config])
    trainer = L.Trainer(accelerator="cpu", devices=STAGES * PIPELINES, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, callbacks=[measure])
    sampler = DistributedSampler(data, num_replicas=PIPELINES, rank=trainer.global_rank // STAGES, shuffle=False)
    trainer.fit(Model(), DataLoader(data, batch_size=batch, sampler=sampler))
    step_time = sum(measure.times[2:]) / max(len(measure.times) - 2, 1)
    cpu_time = sum(measure.cpu[2:]) / max(len(measure.cpu) - 2, 1)
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump({**measure.record, "step_time": step_time, "cpu_time": cpu_time}, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64, help="samples per pipeline per step (4 micro-batches)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=1, help="run the configurations in turn this many times")
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                        help=f"comma-separated, from {', '.join(CONFIGS)} (ddp always runs; default: %(default)s)")
    parser.add_argument("--run", choices=tuple(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        run(args.run, args.width, args.depth, args.batch, args.steps, args.out)
        return
    configs = ["ddp"] + [c for c in args.configs.split(",") if c and c != "ddp"]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"--configs: {', '.join(unknown)} not known; choose from {', '.join(CONFIGS)}")
    results: dict[str, list[dict]] = {}
    step_times: dict[str, list[float]] = {config: [] for config in configs}
    cpu_times: dict[str, list[float]] = {config: [] for config in configs}  # all ranks' CPU time per step
    for _ in range(args.rounds):
        for config in configs:
            with tempfile.TemporaryDirectory() as out:
                command = [sys.executable, os.path.abspath(__file__), "--width", str(args.width), "--depth", str(args.depth),
                           "--batch", str(args.batch), "--steps", str(args.steps), "--run", config, "--out", out]
                subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)
                results[config] = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(STAGES * PIPELINES)]
                step_times[config].append(results[config][0]["step_time"])
                cpu_times[config].append(sum(r["cpu_time"] for r in results[config]))
                print(f"round {len(step_times[config])}: {config} {step_times[config][-1] * 1e3:.1f} ms per step, "
                      f"all ranks' CPU time {cpu_times[config][-1] * 1e3:.1f} ms per step", flush=True)
    mib = 2**20
    print(f"2 stages x 2 pipelines, 1f1b, M=4, Adam, trunk {args.depth} x Linear({args.width}, {args.width}), "
          f"{args.batch} samples per pipeline per step, CPU (gloo)")
    print("parameters + gradients + optimizer state per rank at its optimizer step, MiB (ratio to ddp)")
    print(f"{'rank':>4} {'stage':>5}" + "".join(f"  {config:>22}" for config in configs))
    for rank in range(STAGES * PIPELINES):
        total = {c: sum(results[c][rank][k] for k in ("parameters", "gradients", "optimizer")) for c in configs}
        cells = [f"{total[c] / mib:8.2f} ({total[c] / total['ddp']:.3f})" for c in configs]
        print(f"{rank:>4} {rank % STAGES:>5}" + "".join(f"  {cell:>22}" for cell in cells))
    times = {c: statistics.median(step_times[c]) for c in configs}
    print(f"step time, rank 0, after 2 warm-up steps, median of {args.rounds} round(s): " + ", ".join(
        f"{c} {times[c] * 1e3:.1f} ms ({times['ddp'] / times[c]:.2f}x ddp's throughput)" for c in configs))
    cpu = {c: statistics.median(cpu_times[c]) for c in configs}
    print(f"CPU time per step, all 4 ranks together (every thread: compute, FSDP2's hooks, gloo), median of {args.rounds} "
          "round(s): " + ", ".join(f"{c} {cpu[c] * 1e3:.1f} ms ({cpu[c] / cpu['ddp']:.2f}x ddp)" for c in configs))


if __name__ == "__main__":
    main()
