"""Merging the stages' policy states into the one a checkpoint holds (any split resumes from it)."""

from __future__ import annotations

import pytest
import torch

from lightning_pipe.engine.policies import merge_states


def test_name_keyed_maps_unite_and_a_shared_parameter_comes_from_its_owner():
    stage0 = {"policy": "P", "steps": 3, "previous": {"pre.w": torch.tensor(1.0), "head.w": torch.tensor(-1.0)},
              "replicas": [{"pre.w": torch.tensor(10.0)}, {"pre.w": torch.tensor(11.0)}]}
    stage1 = {"policy": "P", "steps": 3, "previous": {"mid.w": torch.tensor(2.0), "head.w": torch.tensor(5.0)},
              "replicas": [{"mid.w": torch.tensor(20.0)}, {"mid.w": torch.tensor(21.0)}]}
    merged = merge_states([stage0, stage1], owner={"head.w": 1, "pre.w": 0})
    assert merged["steps"] == 3 and merged["policy"] == "P"
    assert {k: float(v) for k, v in merged["previous"].items()} == {"pre.w": 1.0, "head.w": 5.0, "mid.w": 2.0}
    assert [{k: float(v) for k, v in r.items()} for r in merged["replicas"]] == [
        {"pre.w": 10.0, "mid.w": 20.0}, {"pre.w": 11.0, "mid.w": 21.0}]
    # without an owner, the first stage that holds it (the 0.1 behaviour, kept for checkpoints without one)
    assert float(merge_states([stage0, stage1])["previous"]["head.w"]) == -1.0


def test_stages_without_state_are_skipped():
    assert merge_states([None, {"steps": 1}, None]) == {"steps": 1}
    assert merge_states([]) is None


def test_a_snapshot_reuses_the_storage_of_the_one_released_before_it():
    """pipedream and 2BW fill a new weight version into the released one's tensors (no allocation per
    STEP), and a checkpoint's copy of a version does not share that storage."""
    from torch import nn

    from lightning_pipe.engine.policies import AsyncOptions
    from lightning_pipe.engine.policies.options import DoubleBufferOptions
    from lightning_pipe.engine.policies.stash import DoubleBufferPolicy

    layers = nn.Linear(3, 3)
    policy = DoubleBufferPolicy(layers, torch.optim.SGD(layers.parameters(), lr=0.1), 0, 2, 2,
                                AsyncOptions(pipedream_2bw=DoubleBufferOptions(lookahead=0.0)))
    with policy.forward(0):  # the first forward snapshots version 0
        pass
    old = policy.snapshots[0]
    policy.steps = 3  # three STEPs later, version 0 is older than steps - 1
    policy.finished(0)  # its last user is done: version 0 is released
    assert policy.snapshots == {}
    with torch.no_grad():
        layers.weight.add_(1.0)
    with policy.forward(8):  # micro-batch 8 (mini-batch 4) runs on version 3: snapshot into version 0's tensors
        pass
    new = policy.snapshots[3]
    assert new["weight"] is old["weight"] and torch.equal(new["weight"], layers.weight)
    policy.snapshots = {2: new}
    saved = policy.state_dict()["previous"]["weight"]
    assert saved.data_ptr() != new["weight"].data_ptr()


def test_delay_compensation_corrects_the_gradient_and_its_average_survives_a_resume():
    """2BW's delay compensation: ``g + lambda_0 * g * g * (W - W_used) / (sqrt(MS) + 1e-12)`` before the
    STEP, by hand on one layer; a policy resumed from the state continues with the same ``MS``."""
    from torch import nn

    from lightning_pipe.engine.policies import AsyncOptions
    from lightning_pipe.engine.policies.options import DoubleBufferOptions
    from lightning_pipe.engine.policies.stash import DoubleBufferPolicy

    options = AsyncOptions(pipedream_2bw=DoubleBufferOptions(lookahead=0.0, delay_compensation=3.0,
                                                             delay_compensation_decay=0.5))

    def policy_for(layer: nn.Linear) -> DoubleBufferPolicy:
        return DoubleBufferPolicy(layer, torch.optim.SGD(layer.parameters(), lr=1.0), 0, 2, 2, options)

    torch.manual_seed(0)
    layer = nn.Linear(3, 3)
    policy = policy_for(layer)
    used = {n: p.detach() - 0.25 for n, p in policy.params.items()}  # the version the gradient was taken at
    current = {n: nn.Parameter(p.detach().clone(), requires_grad=False) for n, p in policy.params.items()}
    policy.snapshots, policy.steps = {0: used, 1: current}, 1
    grads = {n: torch.randn_like(p) for n, p in policy.params.items()}
    before = {n: p.detach().clone() for n, p in policy.params.items()}
    for n, p in policy.params.items():
        p.grad = grads[n].clone()
    policy.step()
    for n, p in policy.params.items():
        g, ms = grads[n], 0.5 * grads[n] * grads[n]
        want = g + 3.0 * g * g * 0.25 / (ms.sqrt() + 1e-12)  # W - W_used = 0.25 everywhere
        torch.testing.assert_close(before[n] - p.detach(), want)  # SGD, lr 1: the update is the gradient
        torch.testing.assert_close(policy.mean_square[n], ms)
    resumed = policy_for(nn.Linear(3, 3))
    resumed.load_state_dict(policy.state_dict())
    for n in policy.params:
        torch.testing.assert_close(resumed.mean_square[n], policy.mean_square[n])


@pytest.mark.parametrize("moves", ["redirect", "copy"])
def test_an_xpipe_prediction_is_written_into_the_storage_the_last_one_released(moves, monkeypatch):
    """xpipe allocates weight-sized tensors for its first prediction only: the next one is written over the one
    the last forwards used (fresh large tensors page-fault on every STEP). Redirecting, the parameters point at
    it; copying, they keep their own storage."""
    from torch import nn

    from lightning_pipe.engine.policies import live

    layer = nn.Linear(4, 4)
    monkeypatch.setattr(live.XPipePolicy, "moves_values", "auto" if moves == "redirect" else moves)
    policy = live.XPipePolicy(layer, torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9), 0, 2, 2)
    assert policy.moves == moves
    allocated: list[tuple[int, ...]] = []
    empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t, *a, **k: allocated.append(tuple(t.shape)) or empty_like(t, *a, **k))
    first = layer.weight.data_ptr()
    with policy.forward(0):  # mini-batch 0: a new prediction, which the parameters point at (or copy)
        second = layer.weight.data_ptr()
    assert (second != first if moves == "redirect" else second == first) and allocated == [(4, 4), (4,)]
    for g in (2, 4):  # mini-batches 1 and 2: written over mini-batch 0's
        with policy.forward(g):
            assert layer.weight.data_ptr() == second
    assert len(allocated) == 2  # nothing allocated after the first prediction
    torch.testing.assert_close(layer.weight.detach(), policy.masters["weight"].detach())  # no state yet: W itself
