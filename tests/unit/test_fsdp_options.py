"""``data_parallel="fsdp"``'s checks (issue 33): each refusal is one sentence that says what to change."""

from __future__ import annotations

import pytest

from lightning_pipe import PipeStrategy
from lightning_pipe.errors import PipeConfigError
from lightning_pipe.lightning import checks
from lightning_pipe.lightning.options import FSDP_SCHEDULES, resolve


@pytest.mark.parametrize("schedule", ["pipedream", "pipedream_2bw", "pipemare", "xpipe", "avgpipe"])
def test_a_schedule_whose_stages_step_alone_is_refused(schedule):
    with pytest.raises(PipeConfigError, match="use one of 'gpipe', '1f1b', 'interleaved_1f1b', or data_parallel='ddp'"):
        PipeStrategy(schedule=schedule, data_parallel="fsdp")


@pytest.mark.parametrize("schedule", ["zb_h1", "zbv", "dualpipev"])
def test_a_split_backward_is_refused_naming_the_schedules_that_work(schedule):
    with pytest.raises(PipeConfigError, match=f"schedule='{schedule}'.*use one of 'gpipe', '1f1b', 'interleaved_1f1b'"):
        PipeStrategy(schedule=schedule, data_parallel="fsdp")


@pytest.mark.parametrize("schedule", FSDP_SCHEDULES)
def test_the_synchronous_schedules_are_accepted(schedule):
    assert PipeStrategy(schedule=schedule, pipelines=2, data_parallel="fsdp").options.data_parallel == "fsdp"
    assert PipeStrategy(schedule=schedule).options.data_parallel == "ddp"  # the default


def test_an_unknown_value_is_refused():
    with pytest.raises(PipeConfigError, match="data_parallel='zero' is not known; use 'ddp'"):
        resolve({"data_parallel": "zero"})


def test_one_process_has_nothing_to_shard_across():
    options = resolve({"data_parallel": "fsdp", "stages": 2})
    with pytest.raises(PipeConfigError, match="set devices to stages × pipelines, or use data_parallel='ddp'"):
        checks.check_data_parallel(options, 1)
    checks.check_data_parallel(options, 4)


def test_a_single_file_checkpoint_is_refused():
    options = resolve({"data_parallel": "fsdp"})
    with pytest.raises(PipeConfigError, match="set save_distributed_checkpoint=True"):
        checks.check_sharded_checkpoints(options, True)
    checks.check_sharded_checkpoints(options, False)  # no checkpoint callback: nothing to refuse
    checks.check_sharded_checkpoints(resolve({"data_parallel": "fsdp", "save_distributed_checkpoint": True}), True)
    checks.check_sharded_checkpoints(resolve({}), True)


def test_fsdp_reshard_is_checked():
    assert resolve({"data_parallel": "fsdp", "fsdp_reshard": "micro_batch"}).fsdp_reshard == "micro_batch"
    assert resolve({"data_parallel": "fsdp"}).fsdp_reshard == "step"  # the default
    with pytest.raises(PipeConfigError, match="fsdp_reshard='layer' is not known; use 'step'"):
        resolve({"data_parallel": "fsdp", "fsdp_reshard": "layer"})
    with pytest.raises(PipeConfigError, match="applies to sharded stages; set data_parallel='fsdp'"):
        resolve({"fsdp_reshard": "micro_batch"})


def test_fsdp_unit_is_checked():
    assert resolve({"data_parallel": "fsdp", "fsdp_unit": "stage"}).fsdp_unit == "stage"
    assert resolve({"data_parallel": "fsdp"}).fsdp_unit == "layer"  # the default
    assert PipeStrategy(pipelines=2, data_parallel="fsdp", fsdp_unit="stage").options.fsdp_unit == "stage"
    with pytest.raises(PipeConfigError, match="fsdp_unit='chunk' is not known; use 'layer'.*or 'stage'"):
        resolve({"data_parallel": "fsdp", "fsdp_unit": "chunk"})
    with pytest.raises(PipeConfigError, match="fsdp_unit='stage' applies to sharded stages; set data_parallel='fsdp'"):
        resolve({"fsdp_unit": "stage"})
