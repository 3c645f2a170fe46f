"""Models larger than one device (docs/large-models.md): layers built in ``configure_model`` live on the
meta device until setup, where each rank creates only its own stage, with the weights one device
would have drawn; training then equals one device."""

from __future__ import annotations

import pytest

from tests.distributed.test_strategy import assert_matches
from tests.harness.launch import launch
from tests.harness.lightning_run import train

STEPS = 4


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_configure_model_on_two_processes_equals_one_device(schedule):
    common = {"max_steps": STEPS, "batch_size": 16, "model": {"optimizer": "adam", "configure": True}}
    reference = train(common)
    assert reference["state"].keys() == train({**common, "model": {"optimizer": "adam"}})["state"].keys()
    code, output, records = launch({**common, "devices": 2, "strategy": {"schedule": schedule, "micro_batches": 4}})
    assert code == 0, output[-3000:]
    assert_matches(reference, records, [0, 1])
    for rank, record in enumerate(records):  # each rank holds only its own trunk layers
        trunk = sorted({int(k.split(".")[1]) for k in record["state"] if k.startswith("model.")})
        assert trunk == ([0, 2, 4] if rank == 0 else [6, 8, 10])
