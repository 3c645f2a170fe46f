"""The workloads the avgpipe tests share, so the one-process (emulated) tests and the multi-process ones
check the same computation against :class:`~tests.reference.avgpipe_reference.AvgPipeReference`:

* the engine's: a tanh MLP trunk, its optimizers and loss, and the tolerance weights are compared at;
* Lightning's: the suite's :class:`~tests.harness.lightning_run.TrunkModel` on 2 stages, 2 replicas of
  2 micro-batches, and :func:`lightning_reference`, the reference's run of it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_pipe.engine import split_micro_batches
from lightning_pipe.schedules import averaging_order, build_avgpipe
from tests.harness.lightning_run import TrunkModel, make_data
from tests.reference.avgpipe_reference import AvgPipeReference

# --- the engine's workload -------------------------------------------------------------------------------


def make_trunk() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(6, 6), nn.Tanh())])


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.02)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def loss_fn(output, micro_batch):
    return nn.functional.mse_loss(output, micro_batch[1])


def close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], msg: str) -> None:
    assert set(got) == set(want), msg
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=f"{msg} {key}")


# --- Lightning's workload --------------------------------------------------------------------------------

EPOCHS, BATCH, MICRO, REPLICAS = 2, 16, 2, 2
STRATEGY = {"schedule": "avgpipe", "micro_batches": MICRO, "avgpipe": {"parallel_pipelines": REPLICAS, "advance_forward": 1}}


def lightning_reference() -> tuple[list[float], TrunkModel, AvgPipeReference]:
    """The per-step losses (mean over replicas), the model (its weights stay the initial ones) and the
    reference after ``EPOCHS`` epochs of :data:`STRATEGY` on 2 stages."""
    model = TrunkModel()
    half = len(model.model) // 2
    stages = [nn.Sequential(model.pre, nn.ReLU(), *model.model[:half]), nn.Sequential(*model.model[half:], model.head)]
    ref = AvgPipeReference(stages, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), REPLICAS, lambda mb: mb[0],
                           lambda out, mb: F.cross_entropy(out, mb[1]))
    order = averaging_order(build_avgpipe(2, MICRO, REPLICAS, STRATEGY["avgpipe"]["advance_forward"]))
    x, y = make_data().tensors
    losses = []
    for _ in range(EPOCHS):
        for start in range(0, len(x), BATCH):
            parts = split_micro_batches((x[start:start + BATCH], y[start:start + BATCH]), REPLICAS)
            mbs = [split_micro_batches(part, MICRO) for part in parts]
            per_replica = ref.train_round(mbs, [[1 / MICRO] * MICRO] * REPLICAS, order)
            losses.append(sum(sum(l) for l in per_replica) / (MICRO * REPLICAS))
    return losses, model, ref
