"""avgpipe through Lightning on 2 processes equals the one-process reference of section 10: per-step
losses (mean over replicas), the center (the model's weights), validation on the center; and a
checkpoint resumes the replicas exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_pipe.avg_emulation import AvgPipeReference
from lightning_pipe.engine import split_micro_batches
from lightning_pipe.schedules import averaging_order, build_avgpipe
from tests.launch import launch
from tests.lightning_run import TrunkModel, make_data

pytestmark = pytest.mark.multiprocess

EPOCHS, BATCH, MICRO, REPLICAS = 2, 16, 2, 2
STRATEGY = {"schedule": "avgpipe", "micro_batches": MICRO, "parallel_pipelines": REPLICAS, "advance_forward": 1}
OWNERS = (("pre.", "model.0.", "model.2.", "model.4."), ("model.6.", "model.8.", "model.10.", "head."))


def reference() -> tuple[list[float], TrunkModel, AvgPipeReference]:
    model = TrunkModel()
    half = len(model.model) // 2
    stages = [nn.Sequential(model.pre, nn.ReLU(), *model.model[:half]), nn.Sequential(*model.model[half:], model.head)]
    ref = AvgPipeReference(stages, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), REPLICAS, lambda mb: mb[0],
                           lambda out, mb: F.cross_entropy(out, mb[1]))
    order = averaging_order(build_avgpipe(2, MICRO, REPLICAS, STRATEGY["advance_forward"]))
    x, y = make_data().tensors
    losses = []
    for _ in range(EPOCHS):
        for start in range(0, len(x), BATCH):
            parts = split_micro_batches((x[start:start + BATCH], y[start:start + BATCH]), REPLICAS)
            mbs = [split_micro_batches(part, MICRO) for part in parts]
            per_replica = ref.train_round(mbs, [[1 / MICRO] * MICRO] * REPLICAS, order)
            losses.append(sum(sum(l) for l in per_replica) / (MICRO * REPLICAS))
    return losses, model, ref


def test_lightning_equals_reference(tmp_path):
    ckpt = str(tmp_path / "end.ckpt")
    code, output, records = launch({"devices": 2, "epochs": EPOCHS, "batch_size": BATCH, "evaluate": True,
                                    "ckpt_out": ckpt, "strategy": STRATEGY})
    assert code == 0, output[-3000:]
    want_losses, center, ref = reference()
    want_state = center.state_dict()
    for record in records:
        assert [m["train_loss"] for m in record["metrics"]] == pytest.approx(want_losses, rel=1e-5)
        assert record["global_step"] == len(want_losses)
    for record, prefixes in zip(records, OWNERS):
        for key, value in want_state.items():
            if key.startswith(prefixes):
                torch.testing.assert_close(record["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    x, y = make_data(40, seed=1).tensors
    with torch.no_grad():
        val_loss = float(F.cross_entropy(center(x), y))
    assert records[0]["validate"][0]["val_loss"] == pytest.approx(val_loss, rel=1e-5)  # evaluation uses the center

    # the checkpoint: model state = the center (loads in a plain process), replicas in an extra key
    saved = torch.load(ckpt, weights_only=False)
    plain = TrunkModel()
    plain.load_state_dict(saved["state_dict"])
    for key, value in want_state.items():
        torch.testing.assert_close(plain.state_dict()[key], value, rtol=1e-5, atol=1e-6, msg=key)
    replicas = saved["pipe_avgpipe_state"]
    assert len(replicas) == 2 and len(replicas[1]["weights"]) == REPLICAS
    want_head = ref.replica_state(1, 1)
    got_head = replicas[1]["weights"][1]
    torch.testing.assert_close(got_head["head.weight"], want_head[f"{len(center.model) - len(center.model) // 2}.weight"],
                               rtol=1e-5, atol=1e-6)


def test_resume_continues_like_an_uninterrupted_run(tmp_path):
    common = {"devices": 2, "batch_size": BATCH, "strategy": STRATEGY}
    code, output, whole = launch({**common, "epochs": 2})
    assert code == 0, output[-3000:]
    ckpt = str(tmp_path / "epoch1.ckpt")
    code, output, _ = launch({**common, "epochs": 1, "ckpt_out": ckpt})
    assert code == 0, output[-3000:]
    code, output, resumed = launch({**common, "epochs": 2, "ckpt_path": ckpt})
    assert code == 0, output[-3000:]
    for a, b, prefixes in zip(whole, resumed, OWNERS):
        for key, value in a["state"].items():
            if key.startswith(prefixes):
                torch.testing.assert_close(b["state"][key], value, rtol=1e-6, atol=1e-7, msg=key)
        assert [m["train_loss"] for m in b["metrics"]] == pytest.approx([m["train_loss"] for m in a["metrics"]][6:], rel=1e-6)
