"""Process groups are made once per process (issue 30, hazard 9): fit makes them, validate / test /
predict after it in the same process take them back."""

from __future__ import annotations

from tests.harness.launch import launch


def test_validate_test_and_predict_after_fit_make_no_new_group():
    code, output, records = launch({"devices": 2, "max_steps": 2, "batch_size": 16, "evaluate": True, "count_groups": True,
                                    "strategy": {"schedule": "1f1b", "micro_batches": 2}}, fresh=True)
    assert code == 0, output[-3000:]
    assert len(records) == 2
    for record in records:
        assert record["groups_made_by_fit"] > 0  # a fresh process: fit made the gloo object group at least
        assert record["groups_made_after_fit"] == 0
