"""avgpipe emulated in one process (``LocalPipeline`` + ``EmulatedAvgPipeRounds``) equals the literal
one-process reference of docs/algorithms.md §10, round by round: losses, every replica's weights and the
center; the engine-level twin of tests/distributed/test_avgpipe_engine.py, under NCCL's rules (the
in-process transport is untagged and its sends rendezvous)."""

from __future__ import annotations

import pytest
import torch

from lightning_pipe.engine import SequentialStage, split_micro_batches
from lightning_pipe.engine.emulated_avgpipe import EmulatedAvgPipeRounds
from lightning_pipe.engine.local import LocalPipeline
from lightning_pipe.engine.policies import AvgPipeOptions
from lightning_pipe.partition import resolve_balance, stage_bounds
from lightning_pipe.schedules import averaging_order, build_avgpipe, validate
from tests.reference.avgpipe_cases import close, loss_fn, make_optimizer, make_trunk
from tests.reference.avgpipe_reference import AvgPipeReference

ROUNDS = 3
# (stages P, replicas N, micro-batches M, optimizer, averaging, advance a, period tau, alpha)
CASES = [
    (2, 2, 1, "sgd", "async", 0, 1, None),
    (2, 2, 2, "sgd", "sync", 1, 1, None),
    (2, 2, 2, "adam", "async", 2, 2, None),
    (2, 3, 2, "sgd", "async", 1, 1, None),
    (3, 3, 1, "adam", "sync", 1, 2, 0.3),
    (3, 2, 2, "sgd", "async", 1, 1, None),
]


def data(replicas: int, micro_batches: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``data[t][n]``: the mini-batch of replica ``n`` in round ``t`` (sizes differ between micro-batches at M=2)."""
    g = torch.Generator().manual_seed(micro_batches * 10 + replicas)
    return [[(torch.randn(2 * micro_batches + 1, 6, generator=g), torch.randn(2 * micro_batches + 1, 6, generator=g))
             for _ in range(replicas)] for _ in range(ROUNDS)]


def emulated(case: tuple) -> tuple[list[dict], EmulatedAvgPipeRounds]:
    P, N, M, opt, form, advance, period, alpha = case
    trunk = make_trunk()
    bounds = stage_bounds(resolve_balance("uniform", trunk, P))
    pipeline = LocalPipeline(P)
    pipeline.chunks = [SequentialStage(trunk[a:b], input_fn=(lambda mb: mb[0]) if s == 0 else None,
                                       loss_fn=loss_fn if s == P - 1 else None) for s, (a, b) in enumerate(bounds)]
    rounds = EmulatedAvgPipeRounds(pipeline, P, AvgPipeOptions(N, alpha, period, form, advance))
    names = [{f"{i}.{n}" for i in range(a, b) for n, _ in trunk[i].named_parameters()} for a, b in bounds]
    rounds.start_stages(trunk, make_optimizer(opt, trunk.parameters()), M, None, names)
    out = []
    for batches in data(N, M):
        batch = tuple(torch.cat(parts) for parts in zip(*batches))  # the Lightning batch holds every replica's
        micro_batches, count = rounds.split(batch, M, first=True)
        sizes = [len(mb[0]) for mb in micro_batches]
        losses = rounds.run_round(micro_batches, rounds.loss_weights(sizes, count), count)
        pipeline.finish()
        out.append({
            "losses": [float(x) for x in losses],
            "replicas": [[{k: w.detach().clone() for k, w in policy.weights[n].items()} for policy in rounds.policies]
                         for n in range(N)],
            "center": {k: v.clone() for k, v in trunk.state_dict().items()},
        })
    return out, rounds


def reference(case: tuple) -> list[dict]:
    P, N, M, opt, form, advance, period, alpha = case
    trunk = make_trunk()
    bounds = stage_bounds(resolve_balance("uniform", trunk, P))
    ref = AvgPipeReference([trunk[a:b] for a, b in bounds], lambda ps: make_optimizer(opt, ps), N, lambda mb: mb[0],
                           loss_fn, alpha, period, form)
    order = averaging_order(build_avgpipe(P, M, N, advance))
    out = []
    for batches in data(N, M):
        micro_batches = [split_micro_batches(batch, M) for batch in batches]
        weights = [[len(mb[0]) / len(batch[0]) for mb in mbs] for batch, mbs in zip(batches, micro_batches)]
        losses = ref.train_round(micro_batches, weights, order)
        out.append({
            "losses": [loss for replica in losses for loss in replica],
            # a slice of an nn.Sequential keeps the trunk's keys
            "replicas": [[ref.replica_state(n, s) for s in range(P)] for n in range(N)],
            "center": {k: v for s in range(P) for k, v in ref.center_state(s).items()},
        })
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: "P{}-N{}-M{}-{}-{}-a{}-tau{}-alpha{}".format(*c))
def test_emulation_equals_reference_round_by_round(case):
    P, N, M, *_ = case
    got, rounds = emulated(case)
    want = reference(case)
    for t, (g, w) in enumerate(zip(got, want)):
        where = f"{case} round {t}"
        assert g["losses"] == pytest.approx(w["losses"], rel=1e-5), where
        close(g["center"], w["center"], f"{where} center")
        for n in range(N):
            for s in range(P):
                close(g["replicas"][n][s], w["replicas"][n][s], f"{where} replica {n} stage {s}")
    # every stage stepped its own optimizer share; the module points at the center, the optimizers at replica 0's state
    assert [p.steps for p in rounds.policies] == [ROUNDS * N] * P
    state = rounds.state_dict()
    assert state["rounds"] == ROUNDS and len(state["weights"]) == N
    assert set(state["center"]) == {n for n, _ in make_trunk().named_parameters()}


def test_the_merged_order_is_one_an_untagged_backend_can_run():
    """The in-process queues are untagged: the rounds check the merged schedule as NCCL would run it."""
    for case in CASES:
        P, N, M, *_, advance, _, _ = case
        validate(build_avgpipe(P, M, N, advance), replica_channels=False)


def test_start_needs_every_stages_share():
    pipeline = LocalPipeline(2)
    rounds = EmulatedAvgPipeRounds(pipeline, 2, AvgPipeOptions(2))
    trunk = make_trunk()
    with pytest.raises(TypeError, match="start_stages"):
        rounds.start(trunk, torch.optim.SGD(trunk.parameters(), lr=0.1), 2, None, None, 1)
    with pytest.raises(ValueError, match="2 stages, got 1"):
        rounds.start_stages(trunk, torch.optim.SGD(trunk.parameters(), lr=0.1), 2, None, [set()])
