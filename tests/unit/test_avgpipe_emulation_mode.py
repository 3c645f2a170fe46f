"""avgpipe through Lightning's one-device emulation (``Trainer(devices=1, strategy=PipeStrategy(schedule="avgpipe",
stages=2))``) computes what the 2-process run of tests/distributed/test_avgpipe_lightning.py computes: both equal
the same literal reference (per-step losses, the center, validation on the center), the checkpoint has the same
format, and a resume continues exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_pipe.engine import split_micro_batches
from lightning_pipe.errors import PipeConfigError
from lightning_pipe.schedules import averaging_order, build_avgpipe
from tests.harness.lightning_run import TrunkModel, make_data, train
from tests.reference.avgpipe_cases import BATCH, EPOCHS, STRATEGY, lightning_reference
from tests.reference.avgpipe_reference import AvgPipeReference

EMULATED = {**STRATEGY, "stages": 2}


def run(**config) -> dict:
    return train({"devices": 1, "epochs": EPOCHS, "batch_size": BATCH, "strategy": EMULATED, **config})


def test_emulation_equals_reference_and_resumes_exactly(tmp_path):
    """Epoch 1 in one run, epoch 2 resumed from its checkpoint: both equal the reference's uninterrupted run;
    evaluation sees the center; the checkpoint is an ordinary one (the center, replica 0's optimizer state)
    plus every stage's replicas under ``pipe_avgpipe_state``, keyed by parameter name as a distributed run writes it."""
    first, last = str(tmp_path / "epoch1.ckpt"), str(tmp_path / "end.ckpt")
    part1 = run(epochs=1, ckpt_out=first)
    part2 = run(ckpt_path=first, evaluate=True, ckpt_out=last, trainer={"log_every_n_steps": 1})
    want_losses, center, ref = lightning_reference()
    per_epoch = len(want_losses) // EPOCHS
    assert [m["train_loss"] for m in part1["metrics"]] == pytest.approx(want_losses[:per_epoch], rel=1e-5)
    assert [m["train_loss"] for m in part2["metrics"]] == pytest.approx(want_losses[per_epoch:], rel=1e-5)
    assert part2["global_step"] == len(want_losses)
    want_state = center.state_dict()
    for key, value in want_state.items():
        torch.testing.assert_close(part2["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    x, y = make_data(40, seed=1).tensors
    with torch.no_grad():
        assert part2["validate"][0]["val_loss"] == pytest.approx(float(F.cross_entropy(center(x), y)), rel=1e-5)
    assert all(f"pipe/stage{s}/replica_distance" in part2["metrics"][-1] for s in range(2))

    saved = torch.load(last, weights_only=False)
    plain = TrunkModel()
    plain.load_state_dict(saved["state_dict"])  # loads in a plain process
    torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9).load_state_dict(saved["optimizer_states"][0])
    state = saved["pipe_avgpipe_state"]
    assert set(state) == {"policy", "rounds", "steps", "center", "weights", "states"} and state["rounds"] == len(want_losses)
    assert len(state["weights"]) == 2 and set(state["weights"][1]) == set(want_state) == set(state["states"][1])
    head = f"{len(center.model) - len(center.model) // 2}.weight"  # the head's index in the reference's stage 1
    torch.testing.assert_close(state["weights"][1]["head.weight"], ref.replica_state(1, 1)[head], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state["weights"][1]["pre.weight"], ref.replica_state(1, 0)["0.weight"], rtol=1e-5, atol=1e-6)
    momentum = ref.optimizers[0].state[next(iter(ref.replicas[0][1][-1].parameters()))]["momentum_buffer"]
    torch.testing.assert_close(state["states"][0]["head.weight"]["momentum_buffer"], momentum, rtol=1e-5, atol=1e-6)


def test_sync_averaging_three_replicas_adam_clipping_and_a_step_scheduler_equal_reference():
    """Each stage clips its own replica's gradients and steps its own optimizer share; the lr Lightning's
    step-interval scheduler sets on the user's optimizer reaches every stage's share at the next round."""
    replicas, micro, clip = 3, 2, 0.5
    options = {"parallel_pipelines": replicas, "averaging": "sync", "advance_forward": 1}
    got = run(epochs=1, model={"optimizer": "adam", "scheduler": "step"}, trainer={"gradient_clip_val": clip},
              strategy={"schedule": "avgpipe", "stages": 2, "micro_batches": micro, "avgpipe": options})
    model = TrunkModel()
    half = len(model.model) // 2
    stages = [nn.Sequential(model.pre, nn.ReLU(), *model.model[:half]), nn.Sequential(*model.model[half:], model.head)]
    ref = AvgPipeReference(stages, lambda ps: torch.optim.Adam(ps, lr=1e-2), replicas, lambda mb: mb[0],
                           lambda out, mb: F.cross_entropy(out, mb[1]), averaging="sync", clip_val=clip)
    order = averaging_order(build_avgpipe(2, micro, replicas, 1))
    x, y = make_data().tensors
    losses = []
    for t, start in enumerate(range(0, len(x), BATCH)):
        for optimizer in ref.optimizers:  # StepLR(step_size=2, gamma=0.5), stepped after every round
            optimizer.param_groups[0]["lr"] = 1e-2 * 0.5 ** (t // 2)
        parts = split_micro_batches((x[start:start + BATCH], y[start:start + BATCH]), replicas)
        mbs = [split_micro_batches(part, micro) for part in parts]
        weights = [[len(mb[1]) / len(part[1]) for mb in m] for part, m in zip(parts, mbs)]
        per_replica = ref.train_round(mbs, weights, order)
        losses.append(sum(l * len(mb[1]) for ls, m in zip(per_replica, mbs) for l, mb in zip(ls, m)) / BATCH)
    assert [m["train_loss"] for m in got["metrics"]] == pytest.approx(losses, rel=1e-5)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(got["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_one_replica_without_averaging_is_one_device_training(tmp_path):
    """N=1, alpha=0: the replica trains as 1f1b, i.e. one device; the center keeps the initial weights."""
    path = str(tmp_path / "one.ckpt")
    got = run(epochs=1, ckpt_out=path, strategy={"schedule": "avgpipe", "stages": 2, "micro_batches": 2,
                                                "avgpipe": {"parallel_pipelines": 1, "alpha": 0.0}})
    one = train({"epochs": 1, "batch_size": BATCH})
    assert [m["train_loss"] for m in got["metrics"]] == pytest.approx([m["train_loss"] for m in one["metrics"]], rel=1e-5)
    replica = torch.load(path, weights_only=False)["pipe_avgpipe_state"]["weights"][0]
    initial = TrunkModel().state_dict()
    for key, value in one["state"].items():
        torch.testing.assert_close(replica[key], value, rtol=1e-5, atol=1e-6, msg=key)
        torch.testing.assert_close(got["state"][key], initial[key], msg=key)


def test_the_tuner_cannot_time_an_emulated_pipeline():
    """avgpipe's "auto" values time rounds on one process per stage: the error names the values to give."""
    with pytest.raises(PipeConfigError, match=r"avgpipe's 'auto' values \(parallel_pipelines, advance_forward\) .* "
                                              r"give numbers, e.g. micro_batches=4, avgpipe=\{'parallel_pipelines': 2"):
        run(epochs=1, strategy={"schedule": "avgpipe", "stages": 2, "micro_batches": 2,
                                "avgpipe": {"parallel_pipelines": "auto", "advance_forward": "auto"}})


def test_balance_auto_splits_an_emulated_avgpipe_by_its_profile():
    """balance="auto" only profiles in one process (nothing to refine on), so it works emulated."""
    got = run(epochs=1, strategy={**EMULATED, "balance": "auto"})
    assert got["global_step"] == 6 and sum(got["counts"]) == len(TrunkModel().model)


def test_parameters_shared_across_stages_are_refused_at_the_first_round():
    """Each stage's replicas step on their own, as in the distributed run (which refuses them after its first round)."""
    with pytest.raises(Exception, match="parameters pre.weight are used on several stages, .*schedule='avgpipe'"):
        run(epochs=1, model={"tie": True})
