"""avgpipe on gloo processes equals the literal one-process reference (tests/reference/avgpipe_reference.py),
round by round: losses, every replica's weights and the center.

One spawn runs every case, to keep process start-ups few: two stages on two processes, then one
stage on each process as two data-parallel pipelines (``pipelines=2``).
"""

from __future__ import annotations

import pytest
import torch

from lightning_pipe.engine import Executor, SequentialStage, Transport, Watchdog, split_micro_batches
from lightning_pipe.engine.policies import ElasticAveraging
from lightning_pipe.partition import resolve_balance, stage_bounds
from lightning_pipe.schedules import averaging_order, build_avgpipe
from tests.harness.distributed import run_workers, values
from tests.reference.avgpipe_cases import close, loss_fn, make_optimizer, make_trunk
from tests.reference.avgpipe_reference import AvgPipeReference

ROUNDS = 3
# (replicas N, micro-batches M, optimizer, averaging, advance a, period tau, alpha)
CASES = [
    (2, 1, "sgd", "async", 0, 1, None),
    (2, 2, "sgd", "sync", 1, 1, None),
    (2, 2, "adam", "async", 2, 2, None),
    (2, 1, "adam", "sync", 0, 1, 0.3),
    (3, 2, "sgd", "async", 1, 1, None),
    (1, 2, "sgd", "async", 0, 1, 0.0),  # N=1, alpha=0: plain 1f1b
]


def data(pipelines: int, replicas: int, micro_batches: int) -> list:
    """``data[t][p][n]``: the mini-batch of replica ``n`` of data-parallel pipeline ``p`` in round ``t``."""
    g = torch.Generator().manual_seed(micro_batches * 10 + replicas)
    return [[[(torch.randn(2 * micro_batches, 6, generator=g), torch.randn(2 * micro_batches, 6, generator=g))
              for _ in range(replicas)] for _ in range(pipelines)] for _ in range(ROUNDS)]


def run_engine(rank: int, world: int, stages: int, case: tuple) -> dict:
    replicas, M, opt, form, advance, period, alpha = case
    pipelines = world // stages
    stage, pipeline = rank % stages, rank // stages
    trunk = make_trunk()
    module = trunk[slice(*stage_bounds(resolve_balance("uniform", trunk, stages))[stage])]
    optimizer = make_optimizer(opt, module.parameters())
    policy = ElasticAveraging(module, optimizer, stage, stages, M, replicas, alpha, period, form,
                              gradient_group=None, gradient_world=pipelines)
    chunk = SequentialStage(module, input_fn=(lambda mb: mb[0]) if stage == 0 else None,
                            loss_fn=loss_fn if stage == stages - 1 else None)
    ranks = [pipeline * stages + s for s in range(stages)]
    transport = Transport(torch.device("cpu")) if stages > 1 else None
    executor = Executor(stage, ranks, [chunk], transport, Watchdog.from_process_group(60.0), policy=policy)
    schedule = build_avgpipe(stages, M, replicas, advance)
    rounds = []
    for batches in data(pipelines, replicas, M):
        mbs = [mb for batch in batches[pipeline] for mb in split_micro_batches(batch, M)]
        losses = executor.run(schedule, mbs)
        rounds.append({
            "losses": [float(x) for x in losses],
            "replicas": [{k: v.detach().clone() for k, v in w.items()} for w in policy.weights],
            "center": {k: v.clone() for k, v in module.state_dict().items()},
        })
    return {"rounds": rounds, "order": averaging_order(schedule)[stage]}


def distributed(rank: int, world: int) -> dict:
    out = {}
    for case in CASES:
        out[("pipeline", case)] = run_engine(rank, world, world, case)
    for case in CASES[:3]:
        out[("data-parallel", case)] = run_engine(rank, world, 1, case)
    return out


def reference(stages: int, pipelines: int, case: tuple, order: list[list[int]]) -> list[dict]:
    replicas, M, opt, form, advance, period, alpha = case
    trunk = make_trunk()
    modules = [trunk[a:b] for a, b in stage_bounds(resolve_balance("uniform", trunk, stages))]
    ref = AvgPipeReference(modules, lambda ps: make_optimizer(opt, ps), replicas, lambda mb: mb[0], loss_fn,
                           alpha, period, form)
    out = []
    for batches in data(pipelines, replicas, M):
        # data-parallel pipelines average each replica's gradient: one replica sees all their micro-batches
        mbs = [[mb for p in range(pipelines) for mb in split_micro_batches(batches[p][n], M)] for n in range(replicas)]
        weights = [[1.0 / (M * pipelines)] * (M * pipelines) for _ in range(replicas)]
        losses = ref.train_round(mbs, weights, order)
        out.append({
            "losses": losses,
            "replicas": [[ref.replica_state(n, s) for s in range(stages)] for n in range(replicas)],
            "center": [ref.center_state(s) for s in range(stages)],
        })
    return out


def one_device(case: tuple) -> list[float]:
    """Plain training of the whole trunk on one device (what N=1, alpha=0 must equal)."""
    _, M, opt, *_ = case
    trunk = make_trunk()
    optimizer = make_optimizer(opt, trunk.parameters())
    losses = []
    for batches in data(1, 1, M):
        x, y = batches[0][0]
        loss = loss_fn(trunk(x), (x, y))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, trunk.state_dict()


def test_engine_equals_reference():
    ranks = values(run_workers(distributed, 2, timeout=240))
    for (kind, case) in ranks[0]:
        stages, pipelines = (2, 1) if kind == "pipeline" else (1, 2)
        replicas, M = case[0], case[1]
        order = [ranks[s][(kind, case)]["order"] for s in range(stages)]
        want = reference(stages, pipelines, case, order)
        for t, expected in enumerate(want):
            for rank in range(2):
                stage, pipeline = rank % stages, rank // stages
                got = ranks[rank][(kind, case)]["rounds"][t]
                where = f"{kind} {case} round {t} rank {rank}"
                if stage == stages - 1:
                    mine = [loss for n in range(replicas) for loss in expected["losses"][n][pipeline * M:(pipeline + 1) * M]]
                    assert got["losses"] == pytest.approx(mine, rel=1e-5), where
                close(got["center"], expected["center"][stage], f"{where} center")
                for n in range(replicas):
                    close(got["replicas"][n], expected["replicas"][n][stage], f"{where} replica {n}")
    # N=1, alpha=0 is plain 1f1b: equal to one-device training
    case = CASES[-1]
    losses, state = one_device(case)
    got = [ranks[1][("pipeline", case)]["rounds"][t]["losses"] for t in range(ROUNDS)]
    assert [sum(l) / len(l) for l in got] == pytest.approx(losses, rel=1e-5)
    for rank in range(2):  # the replica is the trained model (alpha=0 keeps the center at W_0); slices keep keys
        replica = ranks[rank][("pipeline", case)]["rounds"][-1]["replicas"][0]
        close(replica, {k: state[k] for k in replica}, f"N=1 alpha=0 vs one device, stage {rank}")
