"""avgpipe through Lightning on 2 processes equals the one-process reference of section 10: per-step
losses (mean over replicas), the center (the model's weights), validation on the center; and a
checkpoint resumes the replicas exactly."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from tests.harness.launch import launch
from tests.harness.lightning_run import TrunkModel, make_data
from tests.reference.avgpipe_cases import BATCH, EPOCHS, REPLICAS, STRATEGY, lightning_reference

OWNERS = (("pre.", "model.0.", "model.2.", "model.4."), ("model.6.", "model.8.", "model.10.", "head."))


def test_lightning_equals_reference_and_resumes_exactly(tmp_path):
    """Epoch 1 in one run, epoch 2 resumed from its checkpoint in another: both equal the reference's
    uninterrupted run (so the resume is exact), evaluation sees the center, and the checkpoint is an
    ordinary one (the center) plus the replicas."""
    first = str(tmp_path / "epoch1.ckpt")
    last = str(tmp_path / "end.ckpt")
    common = {"devices": 2, "batch_size": BATCH, "strategy": STRATEGY}
    code, output, part1 = launch({**common, "epochs": 1, "ckpt_out": first})
    assert code == 0, output[-3000:]
    code, output, part2 = launch({**common, "epochs": EPOCHS, "ckpt_path": first, "evaluate": True, "ckpt_out": last})
    assert code == 0, output[-3000:]
    want_losses, center, ref = lightning_reference()
    want_state = center.state_dict()
    per_epoch = len(want_losses) // EPOCHS
    for a, b in zip(part1, part2):
        assert [m["train_loss"] for m in a["metrics"]] == pytest.approx(want_losses[:per_epoch], rel=1e-5)
        assert [m["train_loss"] for m in b["metrics"]] == pytest.approx(want_losses[per_epoch:], rel=1e-5)
        assert b["global_step"] == len(want_losses)
    for record, prefixes in zip(part2, OWNERS):
        for key, value in want_state.items():
            if key.startswith(prefixes):
                torch.testing.assert_close(record["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    x, y = make_data(40, seed=1).tensors
    with torch.no_grad():
        val_loss = float(F.cross_entropy(center(x), y))
    assert part2[0]["validate"][0]["val_loss"] == pytest.approx(val_loss, rel=1e-5)  # evaluation uses the center

    # the checkpoint: model state = the center (loads in a plain process), replicas in an extra key
    saved = torch.load(last, weights_only=False)
    plain = TrunkModel()
    plain.load_state_dict(saved["state_dict"])
    for key, value in want_state.items():
        torch.testing.assert_close(plain.state_dict()[key], value, rtol=1e-5, atol=1e-6, msg=key)
    state = saved["pipe_avgpipe_state"]  # every stage's replicas, merged and keyed by parameter name
    assert len(state["weights"]) == REPLICAS and set(state["weights"][1]) == set(want_state)
    head = f"{len(center.model) - len(center.model) // 2}.weight"  # the head's index in the reference's stage 1
    torch.testing.assert_close(state["weights"][1]["head.weight"], ref.replica_state(1, 1)[head], rtol=1e-5, atol=1e-6)
    # a parameter held by both stages (pre, used on stage 0 only) is saved as its owner trained it
    torch.testing.assert_close(state["weights"][1]["pre.weight"], ref.replica_state(1, 0)["0.weight"], rtol=1e-5, atol=1e-6)


def test_auto_options_are_tried_on_both_processes_and_agreed():
    """All avgpipe options "auto" on 2 processes: rank 0 predicts, both ranks run the trials of the
    best three over the real transport, and both adopt the fastest and train with it."""
    auto = {"schedule": "avgpipe", "micro_batches": "auto", "avgpipe": {"parallel_pipelines": "auto", "advance_forward": "auto"}}
    code, output, records = launch({"devices": 2, "batch_size": BATCH, "strategy": auto, "epochs": 1,
                                    "trainer": {"enable_model_summary": True}})
    assert code == 0, output[-3000:]
    # Lightning's ModelSummary counts the whole module, not rank 0's stage (which holds 960 of 1844)
    whole = sum(p.numel() for p in TrunkModel().parameters())
    # the plain table, or the rich one when rich is installed (transformers brings it)
    assert whole == 1844 and re.search(r"1\.8 K\s+Total params|Total params: 1\.8 K", output), output[-3000:]
    assert "measured ms/round" in output and output.count("<- chosen") == 1 and "avgpipe trial 6/6" in output
    (n, m, a), other = records[0]["avgpipe"], records[1]["avgpipe"]
    assert other == (n, m, a) and BATCH % n == 0 and (BATCH // n) % m == 0 and 0 <= a <= 2
    assert records[0]["global_step"] == records[1]["global_step"] == len(make_data()) // BATCH
    assert [r["train_loss"] for r in records[0]["metrics"]] == [r["train_loss"] for r in records[1]["metrics"]]
