"""Weight copies and activations in flight per stage, for every schedule (docs/algorithms.md §11).

    python benchmarks/memory.py --stages 2 4 --micro-batches 4 8

Activations in flight are counted on the action lists the executor runs (a forward not yet matched
by its backward holds its activations); for the asynchronous schedules a whole segment (several
windows and the drain) is counted. Weight copies (weight-sized tensors beyond the module's own
parameters) are those the engine's weight policies report while a small model trains for several
windows in the one-device emulation (every stage's policy in this process, as in a real run). Bytes are for
workload W1 (8 x Linear(1024, 1024), micro-batch = 256 / M samples, fp32).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from lightning_pipe.engine import SequentialStage
from lightning_pipe.engine.emulated import EmulatedAsyncSegments
from lightning_pipe.engine.local import LocalPipeline
from lightning_pipe.engine.policies import AsyncOptions
from lightning_pipe.registry import SCHEDULES, build_schedule, names
from lightning_pipe.schedules import validate_async

ASYNC_SCHEDULES = names("asynchronous")

SYNC = ("gpipe", "1f1b", "interleaved_1f1b")


def in_flight(actions) -> int:
    """Most micro-batches forwarded and not yet backwarded at any point of one device's list."""
    live, most = set(), 0
    for action in actions:
        key = (action.chunk, action.micro_batch)
        if action.kind.value == "F":
            live.add(key)
            most = max(most, len(live))
        elif action.kind.value == "B":
            live.discard(key)
    return most


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
    print("| stages | M | schedule | stage | weight copies | activations in flight | W1 MiB: copies + activations |")
    print("|---|---|---|---|---|---|---|")
    for stages in args.stages:
        stage_weights = layer_bytes * 8 / stages
        for m in args.micro_batches:
            activation = (256 // m) * 1024 * 4 * 2 * (8 // stages)  # Linear output + ReLU output per layer pair
            for schedule in (*SYNC, *ASYNC_SCHEDULES):
                if schedule == "pipedream_2bw" and m < stages:
                    continue
                if schedule in SYNC:
                    chunks = 2 if schedule == "interleaved_1f1b" else 1
                    lists = build_schedule(schedule, stages, m, chunks).actions
                    copies = [0] * stages
                else:
                    lists = validate_async(schedule, stages, m, windows=3 * stages).actions
                    copies = weight_copies(schedule, stages, m)
                for stage in range(stages):
                    flights = in_flight(lists[stage])
                    chunk_scale = 0.5 if schedule == "interleaved_1f1b" else 1.0  # an activation of half a stage
                    mib = (copies[stage] * stage_weights + flights * activation * chunk_scale) / 2**20
                    print(f"| {stages} | {m} | {schedule} | {stage} | {copies[stage]} | {flights} | {mib:.1f} |")


if __name__ == "__main__":
    main()
