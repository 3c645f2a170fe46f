"""Weight copies and activations in flight per stage, for every schedule (docs/algorithms.md §11).

    python benchmarks/memory.py --stages 2 4 --micro-batches 4 8

Activations in flight are counted on the action lists the executor runs (a forward not yet matched
by its backward holds its activations); for the asynchronous schedules a whole segment (several
windows and the drain) is counted. Weight copies (weight-sized tensors beyond the module's own
parameters) are those the engine's weight policies report while a small model trains for several
windows in the one-device emulation (every stage's policy in this process, as in a real run). Bytes are for
workload W1 (8 x Linear(1024, 1024), micro-batch = 256 / M samples, fp32).

For the synchronous schedules the activations are also *measured*: one training step of W1 runs in the
one-device emulation (every stage's executor in this process, the engine's own code) while
``torch.autograd.graph.saved_tensors_hooks`` tracks the storages autograd keeps for backward, each counted
once, on the stage whose forward saved it, until it is freed. The column is each stage's peak of those
bytes: the activation memory, measured (a split backward keeps a micro-batch's graph from its ``I`` to its
``W``, and this counts it).
"""

from __future__ import annotations

import argparse
import weakref

import torch
from torch import nn

from lightning_pipe.engine import SequentialStage
from lightning_pipe.engine.emulated import EmulatedAsyncSegments
from lightning_pipe.engine.local import LocalPipeline
from lightning_pipe.engine.policies import AsyncOptions
from lightning_pipe.registry import SCHEDULES, build_schedule, names
from lightning_pipe.schedules import Kind, validate_async

ASYNC_SCHEDULES = names("asynchronous")

SYNC = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev")


def in_flight(actions) -> int:
    """Most micro-batches forwarded and not yet backwarded (a split backward: not yet through its W) at any
    point of one device's list."""
    live, most = set(), 0
    for action in actions:
        key = (action.chunk, action.micro_batch)
        if action.kind is Kind.FORWARD:
            live.add(key)
            most = max(most, len(live))
        elif action.kind in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT):
            live.discard(key)
    return most


class SavedBytes:
    """Live bytes of the storages autograd saves for backward, per stage, and each stage's peak."""

    def __init__(self, stages: int, weights: list[torch.Tensor]) -> None:
        self.live = [0] * stages
        self.peak = [0] * stages
        self.stage = 0  # the stage whose forward runs now
        self._storages: dict[int, int] = {}  # data pointer -> stage, for storages counted and alive
        self._weights = {w.untyped_storage().data_ptr() for w in weights}  # saved weights are not activations

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key and key not in self._storages and key not in self._weights:
            stage, size = self.stage, storage.nbytes()
            self._storages[key] = stage
            self.live[stage] += size
            self.peak[stage] = max(self.peak[stage], self.live[stage])
            weakref.finalize(storage, self._freed, key, stage, size)
        return tensor.detach()  # the tensor itself would tie an output to its own node: a cycle nothing frees

    def _freed(self, key: int, stage: int, size: int) -> None:
        self._storages.pop(key, None)
        self.live[stage] -= size


def measured_activations(schedule: str, stages: int, micro_batches: int) -> list[float]:
    """Each stage's peak of saved-for-backward bytes (MiB) in one training step of W1 (module docstring)."""
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(1024, 1024), nn.ReLU()) for _ in range(8)]
    row = SCHEDULES[schedule]
    chunks = row.default_chunks
    plan = build_schedule(schedule, stages, micro_batches, chunks)
    per_chunk = 8 // (stages * chunks)
    tracker = SavedBytes(stages, [p for layer in layers for p in layer.parameters()])

    def chunk_of(vs: int) -> SequentialStage:
        stage = SequentialStage(nn.Sequential(*layers[vs * per_chunk:(vs + 1) * per_chunk]),
                                input_fn=(lambda mb: mb[0]) if vs == 0 else None,
                                loss_fn=(lambda out, mb: nn.functional.mse_loss(out, mb[1])) if vs == stages * chunks - 1 else None)
        device = plan.locate(vs)[0]

        def run(inputs, micro_batch):
            tracker.stage = device
            return stage(inputs, micro_batch)
        return run

    pipeline = LocalPipeline(stages, chunks, placement=row.placement)
    pipeline.chunks = [chunk_of(vs) for vs in range(stages * chunks)]
    batch = 256 // micro_batches
    parts = [(torch.randn(batch, 1024), torch.randn(batch, 1024)) for _ in range(micro_batches)]
    with torch.autograd.graph.saved_tensors_hooks(tracker.pack, lambda saved: saved):
        pipeline.run(plan, parts)
    return [peak / 2**20 for peak in tracker.peak]


def weight_copies(schedule: str, stages: int, micro_batches: int) -> list[int]:
    """The most weight copies each stage's policy held while a small model trained ``3 * stages`` windows."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(stages)])
    pipeline = LocalPipeline(stages)
    pipeline.chunks = [
        SequentialStage(model[s], input_fn=(lambda mb: mb[0]) if s == 0 else None,
                        loss_fn=(lambda out, mb: nn.functional.mse_loss(out, mb[1])) if s == stages - 1 else None)
        for s in range(stages)
    ]
    segments = EmulatedAsyncSegments(schedule, SCHEDULES[schedule].policy, pipeline, stages, micro_batches)
    owned = [{n for n, _ in model.named_parameters() if n.startswith(f"{s}.")} for s in range(stages)]
    segments.start_stages(model, torch.optim.Adam(model.parameters(), lr=1e-3), AsyncOptions(), None, None, 0, owned)
    for _ in range(3 * stages):
        segments.run_window([(torch.randn(2, 4), torch.randn(2, 4)) for _ in range(micro_batches)], [1 / micro_batches] * micro_batches)
    segments.drain()
    return [policy.max_copies for policy in segments.policies]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8])
    args = parser.parse_args()
    layer_bytes = 1024 * 1024 * 4 + 1024 * 4
    print("| stages | M | schedule | stage | weight copies | activations in flight | W1 MiB: copies + activations "
          "| measured saved activations MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for stages in args.stages:
        stage_weights = layer_bytes * 8 / stages
        for m in args.micro_batches:
            activation = (256 // m) * 1024 * 4 * 2 * (8 // stages)  # Linear output + ReLU output per layer pair
            for schedule in (*SYNC, *ASYNC_SCHEDULES):
                if schedule == "pipedream_2bw" and m < stages:
                    continue
                if schedule in SYNC:
                    chunks = SCHEDULES[schedule].default_chunks
                    if SCHEDULES[schedule].requirement(stages, m) is not None:
                        continue
                    lists = build_schedule(schedule, stages, m, chunks).actions
                    copies = [0] * stages
                    measured = measured_activations(schedule, stages, m)
                else:
                    lists = validate_async(schedule, stages, m, windows=3 * stages).actions
                    copies = weight_copies(schedule, stages, m)
                    measured = None
                for stage in range(stages):
                    flights = in_flight(lists[stage])
                    chunk_scale = 1.0 / SCHEDULES[schedule].default_chunks  # a chunk's activation: a part of a stage's
                    mib = (copies[stage] * stage_weights + flights * activation * chunk_scale) / 2**20
                    seen = f"{measured[stage]:.1f}" if measured else "-"
                    print(f"| {stages} | {m} | {schedule} | {stage} | {copies[stage]} | {flights} | {mib:.1f} | {seen} |")


if __name__ == "__main__":
    main()
