"""Bad configurations fail early with one sentence that says what to change."""

from __future__ import annotations

import lightning as L
import pytest
from torch import nn

import lightning_pipe
from lightning_pipe import PipeConfigError, PipeStrategy
from tests.launch import launch
from tests.lightning_run import TrunkModel


def connect(model: L.LightningModule, devices: int = 2, **options) -> None:
    """Run the strategy's pre-launch checks without launching processes."""
    trainer = L.Trainer(strategy=PipeStrategy(**options), accelerator="cpu", devices=devices, logger=False)
    trainer.strategy.connect(model)


class TwoTrunks(TrunkModel):
    def __init__(self):
        super().__init__()
        self.other = nn.Sequential(nn.Linear(4, 4))


class NoTrunk(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 4)


class Manual(TrunkModel):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


def test_strategy_names_are_registered():
    from lightning.pytorch.strategies import StrategyRegistry

    for name in ("gpipe", "1f1b", "interleaved_1f1b"):
        assert name in StrategyRegistry
        trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
        assert isinstance(trainer.strategy, PipeStrategy) and trainer.strategy.schedule == name
    import importlib

    importlib.reload(lightning_pipe)  # a second import must not raise "already registered"


@pytest.mark.parametrize(
    "make,kwargs,match",
    [
        (TrunkModel, {"devices": 3, "stages": 2}, r"stages=2 × pipelines=1 needs 2 processes .* set devices=2"),
        (TrunkModel, {"devices": 3, "pipelines": 2}, r"3 processes .* cannot form 2 pipelines"),
        (lambda: TrunkModel(depth=1), {"devices": 2, "schedule": "interleaved_1f1b", "chunks_per_stage": 2},
         r"trunk has 2 layers but the pipeline needs 4 stages"),
        (TrunkModel, {"balance": [5, 5]}, r"sums to 10 but the trunk has 12 layers"),
        (TrunkModel, {"balance": [12]}, r"balance has 1 entries but the pipeline has 2 stages"),
        (TrunkModel, {"schedule": "interleaved_1f1b", "micro_batches": 3}, r"multiple of stages; .* micro_batches=4"),
        (Manual, {}, r"manual optimization"),
        (NoTrunk, {}, r"no nn.Sequential attribute"),
        (TwoTrunks, {}, r"several nn.Sequential attributes \(model, other\).*PipeStrategy\(module=\.\.\.\)"),
        (TrunkModel, {"module": "head"}, r"head is a Linear, not an nn.Sequential"),
    ],
)
def test_bad_configuration(make, kwargs, match):
    devices = kwargs.pop("devices", 2)
    with pytest.raises(PipeConfigError, match=match):
        connect(make(), devices=devices, **kwargs)


@pytest.mark.parametrize(
    "options,match",
    [
        ({"schedule": "pipemagic"}, "schedule='pipemagic' is not available"),
        ({"micro_batches": 0}, "micro_batches=0 must be at least 1"),
        ({"schedule": "1f1b", "chunks_per_stage": 2}, "only applies to schedule='interleaved_1f1b'"),
        ({"balance": "foo"}, "balance='foo' is not known; use 'uniform', 'parameters', 'auto'"),
        ({"micro_batch": 4}, r"PipeStrategy has no option 'micro_batch'; did you mean micro_batches=\?"),
        ({"timeout": 0}, "timeout=0.0 must be a positive number of seconds"),
        ({"checkpoint_timeout": -1}, "checkpoint_timeout=-1.0 must be a positive number of seconds"),
    ],
)
def test_bad_options(options, match):
    with pytest.raises(PipeConfigError, match=match):
        PipeStrategy(**options)


@pytest.mark.parametrize("schedule", ["pipemare", "1f1b"])
def test_a_one_stage_pipeline_is_not_silent(schedule):
    """Trainer(strategy=name) on CPU without devices runs one process: say so, and what to set."""
    import warnings

    with pytest.warns(UserWarning, match=r"one-stage pipeline .* Trainer\(devices=N\) .* PipeStrategy\(stages=N\)"):
        connect(TrunkModel(), devices=1, schedule=schedule)
    with warnings.catch_warnings():  # two processes, or an emulated pipeline: no warning
        warnings.filterwarnings("error", message=".*one-stage pipeline.*")
        connect(TrunkModel(), devices=2, schedule=schedule)
        connect(TrunkModel(), devices=1, schedule=schedule, stages=2)


def test_named_trunk_is_used():
    connect(TwoTrunks(), module="model")  # no error: the name resolves the ambiguity


@pytest.mark.multiprocess
def test_micro_batches_larger_than_batch_fails_before_launching():
    # fresh processes (as for every job below that must fail): how a real job ends is the point
    code, output, _ = launch({"devices": 2, "max_steps": 2, "batch_size": 4, "strategy": {"micro_batches": 8}}, fresh=True)
    assert code != 0
    assert "micro_batches=8 is larger than the batch size 4; use micro_batches <= 4" in output
    assert "Initializing distributed" not in output and output.count("Traceback") == 1


@pytest.mark.multiprocess
def test_a_model_error_fails_before_any_other_rank_starts():
    """A trunk that is not an nn.Sequential: one error from the launching process, no rank started."""
    code, output, _ = launch({"devices": 2, "max_steps": 2, "strategy": {"module": "head"}}, fresh=True)
    assert code != 0 and "head is a Linear, not an nn.Sequential" in output
    assert "Initializing distributed" not in output and output.count("Traceback") == 1


@pytest.mark.multiprocess
@pytest.mark.parametrize("fail_rank", [0, 1])
def test_a_rank_failing_in_a_hook_ends_every_rank_with_peer_failure(fail_rank):
    """A user hook (on_train_start) raising on one rank: the other ends with PeerFailure naming it."""
    code, output, _ = launch({"devices": 2, "max_steps": 4, "strategy": {"schedule": "1f1b", "timeout": 60},
                              "model": {"fail_hook": "on_train_start", "fail_rank": fail_rank}}, fresh=True)
    assert code != 0
    assert "ZeroDivisionError: deliberate failure in on_train_start" in output
    assert f"PeerFailure: " in output and f"rank {fail_rank} raised ZeroDivisionError" in output
    assert "Connection closed by peer" not in output.split("PeerFailure")[0][-2000:]


@pytest.mark.multiprocess
def test_devices_mismatch_fails_before_launching():
    code, output, _ = launch({"devices": 3, "max_steps": 2, "strategy": {"stages": 2}}, fresh=True)
    assert code != 0
    assert "set devices=2 or change stages/pipelines" in output
    assert "Initializing distributed" not in output


@pytest.mark.multiprocess
@pytest.mark.parametrize("fail_rank", [0, 1])
def test_a_failing_stage_ends_every_rank_with_its_error(fail_rank):
    code, output, records = launch(
        {"devices": 2, "max_steps": 5, "model": {"fail_at": 2, "fail_rank": fail_rank}, "strategy": {"timeout": 60}},
        timeout=120, fresh=True,
    )
    assert code not in (0, -9), "the job must fail, and well before the test's own timeout"
    assert records == []
    assert "ZeroDivisionError: deliberate failure at batch 2" in output
    if fail_rank == 1:  # rank 0 (the launcher) learns the peer's error instead of 'connection closed'
        assert "PeerFailure: rank 0 stopped waiting for" in output and "rank 1 raised ZeroDivisionError" in output


@pytest.mark.parametrize("schedule", ["pipedream", "pipedream_2bw", "pipemare", "xpipe"])
def test_asynchronous_schedules_refuse_data_parallel_pipelines(schedule):
    """Each pipeline's stages would step on their own gradients, so the replicas would diverge."""
    with pytest.raises(PipeConfigError, match=rf"schedule='{schedule}' steps each stage inside the pipeline"):
        connect(TrunkModel(), devices=4, schedule=schedule, stages=2, pipelines=2)
    connect(TrunkModel(), devices=4, schedule="avgpipe", stages=2, pipelines=2)  # its replicas average gradients
