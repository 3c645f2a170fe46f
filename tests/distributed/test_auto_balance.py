"""balance="auto" through Lightning on 2 processes: both ranks cut identically, training equals one device."""

from __future__ import annotations

import json

from tests.distributed.test_strategy import assert_matches
from tests.harness.launch import launch
from tests.harness.lightning_run import train


def test_auto_balance_cuts_identically_and_equals_one_device(tmp_path):
    cache = tmp_path / "profiles.json"
    common = {"max_steps": 3, "batch_size": 16, "model": {"optimizer": "adam"}}
    reference = train(common)
    code, output, records = launch({
        **common, "devices": 2,
        # max_spread: a noisy profile (a loaded machine) is rightly not cached; this test is about the cache
        "strategy": {"schedule": "1f1b", "micro_batches": 4, "balance": "auto",
                     "auto_balance": {"profile_cache": str(cache), "max_spread": 100.0}},
    })
    assert code == 0, output[-3000:]
    counts = [r["counts"] for r in records]
    assert counts[0] == counts[1] and sum(counts[0]) == 12 and len(counts[0]) == 2
    assert_matches(reference, records, [0, 1])
    assert "balance='auto'" in output and "predicted peak memory" in output and "ms/micro-batch" in output
    # refinement (on by default) measured the plan on both processes, and training still equals one device
    assert "balance='auto' refinement: [" in output and "measured time" in output
    assert len(json.loads(cache.read_text())) == 1  # rank 0 profiled once and cached it

