"""Sharded checkpoints of the asynchronous schedules (one process, emulated stages): the weight
policy's state is written by parameter name and resumes exactly; a policy state this run cannot
continue from stops the load with CheckpointMismatchError naming the file."""

from __future__ import annotations

import pytest
import torch

from lightning_pipe import CheckpointMismatchError, consolidate_checkpoint
from lightning_pipe.lightning import sharded_policy
from tests.reference.async_cases import emulated, reference_from_checkpoint, run_epochs

NAMES = {"a.weight", "a.bias", "b.weight"}


def test_split_and_join_keep_the_skeleton_and_each_owned_entry():
    state = {"policy": "P", "steps": 3, "previous": {n: torch.full((2,), float(i)) for i, n in enumerate(sorted(NAMES))},
             "last_update": None, "states": [{"a.weight": {"step": torch.tensor(2.0), "exp_avg": torch.ones(2)}}, {}]}
    skeleton, entries = sharded_policy.split(state, NAMES, lambda n: n != "b.weight")
    assert skeleton["previous"] == {sharded_policy.BY_NAME: 1} and skeleton["states"][0] == {sharded_policy.BY_NAME: 2}
    assert set(entries) == {"previous/a.bias", "previous/a.weight", "states/0/a.weight/step", "states/0/a.weight/exp_avg"}
    merged = sharded_policy.merge_skeletons([skeleton, {**skeleton, "states": [{}, {sharded_policy.BY_NAME: 2}]}])
    assert merged["states"][1] == {sharded_policy.BY_NAME: 2}  # a map empty on one stage is a map on another
    back = sharded_policy.join(merged, entries)
    assert back["steps"] == 3 and back["last_update"] is None and set(back["previous"]) == {"a.weight", "a.bias"}
    assert torch.equal(back["states"][0]["a.weight"]["exp_avg"], torch.ones(2)) and back["states"][1] == {}
    wanted = sharded_policy.request(merged, {**entries, "previous/c.weight": None}, {"a.weight"}, lambda m: "x")
    assert set(wanted) == {"previous/a.weight", "states/0/a.weight/step", "states/0/a.weight/exp_avg"}


@pytest.mark.parametrize("schedule", ["pipedream", "pipedream_2bw", "pipemare", "xpipe"])
def test_a_sharded_checkpoint_resumes_bit_exactly(schedule, tmp_path):
    """Epoch 1 saved as a directory, epoch 2 resumed from it: the weights and losses equal the
    uninterrupted run's bit for bit; consolidated, it holds the single-file format's policy state."""
    sharded = {"save_distributed_checkpoint": True, "xpipe": {"prediction": "sgd"}} if schedule == "xpipe" else \
        {"save_distributed_checkpoint": True}
    whole = emulated(schedule, 2, 2, model={"scheduler": "step"}, strategy=sharded)
    ckpt = tmp_path / "epoch1.ckpt"
    emulated(schedule, 2, 2, model={"scheduler": "step"}, epochs=1, ckpt_out=str(ckpt), strategy=sharded)
    assert ckpt.is_dir()
    resumed = emulated(schedule, 2, 2, model={"scheduler": "step"}, ckpt_path=str(ckpt), strategy=sharded)
    for key, value in whole["state"].items():
        assert torch.equal(resumed["state"][key], value), key
    assert [m["train_loss"] for m in resumed["metrics"]] == [m["train_loss"] for m in whole["metrics"]][6:]
    consolidate_checkpoint(ckpt, tmp_path / "one.ckpt")
    state = torch.load(tmp_path / "one.ckpt", weights_only=False)["pipe_async_state"]
    assert state["steps"] == 6
    per_parameter = {"pipedream_2bw": "previous", "pipemare": "delta", "xpipe": "last_grad"}.get(schedule)
    if per_parameter is not None:
        assert set(state[per_parameter]) == set(whole["state"]) - {k for k in whole["state"] if "running" in k}


@pytest.mark.parametrize("schedule", ["pipemare", "xpipe"])
def test_a_sharded_checkpoint_resumes_under_another_stage_count_and_split(schedule, tmp_path):
    """Written by 2 stages, resumed by 4 (and by another split): each stage reads its own parameters'
    entries, and the run continues exactly as the literal reference started from the checkpoint."""
    sharded = {"save_distributed_checkpoint": True}
    ckpt = tmp_path / "two-stages.ckpt"
    emulated(schedule, 2, 2, epochs=1, ckpt_out=str(ckpt), strategy=sharded)
    resumed = emulated(schedule, 4, 2, ckpt_path=str(ckpt), strategy=sharded)
    consolidate_checkpoint(ckpt, tmp_path / "one.ckpt")
    reference, model = reference_from_checkpoint(schedule, 4, str(tmp_path / "one.ckpt"))
    assert [m["train_loss"] for m in resumed["metrics"]] == pytest.approx(run_epochs(reference, [], None, 2, 1), rel=1e-5)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(resumed["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    other = emulated(schedule, 2, 2, ckpt_path=str(ckpt), strategy={**sharded, "balance": [3, 9]})
    assert other["global_step"] == 12


def test_another_schedules_policy_state_is_refused_at_load(tmp_path):
    for sharded in (False, True):
        ckpt = tmp_path / f"2bw-{sharded}.ckpt"
        emulated("pipedream_2bw", 2, 2, epochs=1, ckpt_out=str(ckpt), strategy={"save_distributed_checkpoint": sharded})
        with pytest.raises(CheckpointMismatchError, match=rf"{ckpt}: the checkpoint holds schedule='pipedream_2bw''s "
                                                          r"weight-policy state \(DoubleBufferPolicy\), which schedule='pipemare'"):
            emulated("pipemare", 2, 2, ckpt_path=str(ckpt), strategy={"save_distributed_checkpoint": sharded})


AVGPIPE = {"schedule": "avgpipe", "micro_batches": 2, "avgpipe": {"parallel_pipelines": 2}}


def avgpipe(replicas: int = 2, **config) -> dict:
    import warnings

    from tests.harness.lightning_run import train

    strategy = {**AVGPIPE, "avgpipe": {"parallel_pipelines": replicas}, **config.pop("strategy", {})}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*one-stage pipeline.*")
        return train({"devices": 1, "epochs": 2, "batch_size": 16, "strategy": strategy, **config})


def test_an_avgpipe_sharded_checkpoint_resumes_bit_exactly_and_refuses_another_replica_count(tmp_path):
    """The replicas, their optimizer states and the center are written by name; resumed, the run equals
    the uninterrupted one bit for bit. Another parallel_pipelines cannot take them over: refused at
    load, in both formats, naming the file and the count to use."""
    sharded = {"save_distributed_checkpoint": True}
    whole = avgpipe(strategy=sharded)
    ckpt = tmp_path / "epoch1.ckpt"
    avgpipe(epochs=1, ckpt_out=str(ckpt), strategy=sharded)
    resumed = avgpipe(ckpt_path=str(ckpt), strategy=sharded)
    for key, value in whole["state"].items():
        assert torch.equal(resumed["state"][key], value), key
    consolidate_checkpoint(ckpt, tmp_path / "one.ckpt")
    state = torch.load(tmp_path / "one.ckpt", weights_only=False)["pipe_avgpipe_state"]
    assert len(state["weights"]) == 2 and set(state["states"][1]) == set(state["center"])
    for path, options, end in ((ckpt, sharded, r"\.$"), (tmp_path / "one.ckpt", {}, r" \(or 'auto', which adopts")):
        message = (rf"{path}: the checkpoint holds 2 avgpipe replicas but this run has parallel_pipelines=3; "
                   rf"resume with avgpipe=\{{'parallel_pipelines': 2\}}{end}")
        with pytest.raises(CheckpointMismatchError, match=message):
            avgpipe(3, ckpt_path=str(path), strategy=options)
