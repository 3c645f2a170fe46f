"""Models larger than one device (docs/large-models.md): layers built in ``configure_model`` live on the
meta device until setup, where each rank creates only its own stage, with the weights one device
would have drawn; training then equals one device."""

from __future__ import annotations

import pytest
import torch

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


# ------------------------------------------------------------------ pretrained weights per stage
@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> str:
    """A tiny Llama saved by save_pretrained in 11 shards with their index json."""
    pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    from tests.harness.hf_models import hf_model

    path = tmp_path_factory.mktemp("llama")
    hf_model("llama").save_pretrained(path, max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").exists() and len(list(path.glob("*.safetensors"))) > 4
    return str(path)


@pytest.mark.parametrize("devices,stages", [(2, None), (1, 4)])
def test_pretrained_weights_per_stage_equal_from_pretrained_on_one_device(pretrained, devices, stages, tmp_path):
    """Each stage reads its own tensors (configure_model on the meta device, then load_stage_weights in
    on_fit_start): the first step's loss and gradients, the weights after it, and the logits of the
    checkpoint in the plain model equal from_pretrained on one device."""
    from tests.distributed.test_hf_models import assert_weights_equal, logits
    from tests.harness.hf_models import token_windows

    common = {"max_steps": 1, "batch_size": 16}
    reference = train({**common, "pretrained": {"path": pretrained, "per_stage": False}})
    run = {**common, "pretrained": {"path": pretrained, "per_stage": True}, "devices": devices,
           "ckpt_out": str(tmp_path / "last.ckpt"),
           "strategy": {"schedule": "1f1b", "micro_batches": 4, **({"stages": stages} if stages else {})}}
    if devices == 1:
        records = [train(run)]
    else:
        code, output, records = launch(run)
        assert code == 0, output[-3000:]
    for record in records:
        assert record["returned"] == pytest.approx(reference["returned"], rel=1e-5)
        for name, grad in record["grads"].items():
            torch.testing.assert_close(grad, reference["grads"][name], rtol=1e-5, atol=1e-7, msg=name)
    assert set().union(*(r["grads"] for r in records)) == set(reference["grads"])
    state = torch.load(tmp_path / "last.ckpt", weights_only=False)["state_dict"]
    assert_weights_equal(state, reference["state"])
    ids = token_windows(4, seed=3).tensors[0]
    torch.testing.assert_close(logits("llama", state, ids), logits("llama", reference["state"], ids), rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------ sharded checkpoints
def test_sharded_checkpoint_resumes_under_another_split_stage_count_and_one_device(tmp_path):
    """Each rank writes only its own tensors; the directory resumes on 2 processes with another split, on 4
    emulated stages, and, consolidated into one file, on one device: all equal uninterrupted training."""
    import torch.distributed.checkpoint as dcp

    from lightning_pipe import consolidate_checkpoint

    model = {"optimizer": "adam"}
    pipe = {"schedule": "1f1b", "micro_batches": 4, "save_distributed_checkpoint": True}
    saved = tmp_path / "epoch1.ckpt"
    code, output, _ = launch({"epochs": 1, "model": model, "devices": 2, "strategy": pipe, "ckpt_out": str(saved)})
    assert code == 0, output[-3000:]
    storage = dcp.FileSystemReader(str(saved)).read_metadata().storage_data
    files = {index.fqn: info.relative_path for index, info in storage.items()}
    assert {files[f"model.model.{i}.weight"] for i in (0, 2, 4)} == {"__0_0.distcp"}  # stage 0's layers: rank 0's file
    assert {files[f"model.model.{i}.weight"] for i in (6, 8, 10)} == {"__1_0.distcp"}
    assert files["model.head.weight"] == "__1_0.distcp" and files["model.pre.weight"] == "__0_0.distcp"  # their trainers' copies
    assert files["optim.0.model.10.weight.exp_avg"] == "__1_0.distcp"
    want = train({"epochs": 2, "model": model})

    def assert_equal(state: dict) -> None:
        assert state.keys() == want["state"].keys()
        for key, value in want["state"].items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)

    resumed = tmp_path / "epoch2.ckpt"
    code, output, records = launch({"epochs": 2, "model": model, "devices": 2, "strategy": {**pipe, "balance": [4, 8]},
                                    "ckpt_path": str(saved), "ckpt_out": str(resumed)})
    assert code == 0, output[-3000:]
    steps = len(want["returned"]) // 2  # a resumed run trains the second epoch only: it did restore
    assert [len(r["returned"]) for r in records] == [steps, steps]
    consolidate_checkpoint(resumed, tmp_path / "whole2.ckpt")
    assert_equal(torch.load(tmp_path / "whole2.ckpt", weights_only=False)["state_dict"])
    for run in ({"strategy": {**pipe, "stages": 4}, "ckpt_path": str(saved)},
                {"ckpt_path": str(tmp_path / "whole1.ckpt")}):
        if "strategy" not in run:
            consolidate_checkpoint(saved, tmp_path / "whole1.ckpt")
        got = train({"epochs": 2, "model": model, **run})
        assert len(got["returned"]) == steps
        assert_equal(got["state"])


WEIGHT_POLICIES = {  # a schedule and the options that make its policy keep per-parameter state
    "pipedream": {"micro_batches": 4}, "pipedream_2bw": {"micro_batches": 4}, "pipemare": {"micro_batches": 4},
    "xpipe": {"micro_batches": 4, "xpipe": {"prediction": "sgd"}},
    "avgpipe": {"micro_batches": 2, "avgpipe": {"parallel_pipelines": 2, "advance_forward": 1}},
}


@pytest.mark.parametrize("schedule", list(WEIGHT_POLICIES))
def test_sharded_checkpoint_of_a_weight_policy_resumes_bit_exactly(schedule, tmp_path):
    """Each rank writes its own parameters' policy state (2BW's previous version, PipeMare's velocity,
    XPipe's last gradient, avgpipe's replicas and center) into its own file of the directory, and the
    run resumed from it equals the uninterrupted one bit for bit, on each stage's parameters."""
    import torch.distributed.checkpoint as dcp

    common = {"devices": 2, "batch_size": 16,
              "strategy": {"schedule": schedule, "save_distributed_checkpoint": True, **WEIGHT_POLICIES[schedule]}}
    code, output, whole = launch({**common, "epochs": 2})
    assert code == 0, output[-3000:]
    saved = tmp_path / "epoch1.ckpt"
    code, output, _ = launch({**common, "epochs": 1, "ckpt_out": str(saved)})
    assert code == 0, output[-3000:]
    code, output, resumed = launch({**common, "epochs": 2, "ckpt_path": str(saved)})
    assert code == 0, output[-3000:]
    owners = (("pre.", "model.0.", "model.2.", "model.4."), ("model.6.", "model.8.", "model.10.", "head."))
    for a, b, prefixes in zip(whole, resumed, owners):
        for key, value in a["state"].items():
            if key.startswith(prefixes):  # each stage's own parameters (the others' copies are stale by design)
                assert torch.equal(b["state"][key], value), key
        steps = len(b["metrics"])
        assert [m["train_loss"] for m in b["metrics"]] == [m["train_loss"] for m in a["metrics"]][-steps:]
    storage = dcp.FileSystemReader(str(saved)).read_metadata().storage_data
    policy = {index.fqn: info.relative_path for index, info in storage.items() if index.fqn.startswith("policy.")}
    if schedule != "pipedream":  # pipedream keeps no per-parameter state after a drain
        assert policy and all(f == ("__0_0.distcp" if any(f"/{p}" in k for p in owners[0]) else "__1_0.distcp")
                              for k, f in policy.items()), policy


# ------------------------------------------------------------------ parameters outside the trunk
@pytest.mark.parametrize("tie", [False, True])
def test_middle_stages_keep_only_stand_ins_outside_the_trunk(tie, tmp_path):
    """4 stages of a Sequential trunk built in configure_model: stages 1 and 2 only run their layers, so
    they hold one-element stand-ins for the input layer and the head; after the first step the first
    stage releases the head and the last the input layer, which the other one trains. Training equals one device
    (tie=True: the input layer's weight is used by the first and the last stage, and the middle ones take
    part in the sum of its gradient with zeros); a sharded checkpoint written without the middle
    stages' copies resumes on 4 processes, and equals uninterrupted one-device training."""
    from lightning_pipe import consolidate_checkpoint

    model = {"optimizer": "adam", "configure": True, "tie": tie}
    pipe = {"schedule": "1f1b", "micro_batches": 4, "save_distributed_checkpoint": True}
    saved = tmp_path / "epoch1.ckpt"
    reference = train({"epochs": 1, "batch_size": 16, "model": model})
    code, output, records = launch({"epochs": 1, "batch_size": 16, "model": model, "devices": 4, "strategy": pipe,
                                    "ckpt_out": str(saved)})
    assert code == 0, output[-3000:]
    outside = ["head.bias", "head.weight", "pre.bias", "pre.weight"]
    # after the first step the first stage gives back the head, the last the input layer (shared when tied)
    released = [[], ["pre.bias"]] if tie else [["head.bias", "head.weight"], ["pre.bias", "pre.weight"]]
    assert [r["absent"] for r in records] == [released[0], outside, outside, released[1]]
    assert_matches(reference, records, [0, 1, 2, 3])
    code, output, resumed = launch({"epochs": 2, "batch_size": 16, "model": model, "devices": 4, "strategy": pipe,
                                    "ckpt_path": str(saved), "ckpt_out": str(tmp_path / "epoch2.ckpt")})
    assert code == 0, output[-3000:]
    assert [r["absent"] for r in resumed] == [released[0], outside, outside, released[1]]
    consolidate_checkpoint(tmp_path / "epoch2.ckpt", tmp_path / "one.ckpt")
    state = torch.load(tmp_path / "one.ckpt", weights_only=False)["state_dict"]
    want = train({"epochs": 2, "batch_size": 16, "model": model})["state"]
    assert state.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_a_parameter_first_used_after_the_first_step_stops_training_unless_kept():
    """The last stage starts training the input layer's bias at step 2, after giving it back: training
    stops with an error naming it; with release_unused_outside=False it equals one device."""
    common = {"max_steps": STEPS, "batch_size": 16, "model": {"late_use": 2}}
    code, output, _ = launch({**common, "devices": 2, "strategy": {"schedule": "1f1b", "micro_batches": 4}})
    assert code != 0 and "stage 1 trained pre.bias in a later step but not in the first" in output, output[-3000:]
    code, output, records = launch({**common, "devices": 2, "strategy": {"schedule": "1f1b", "micro_batches": 4,
                                                                         "release_unused_outside": False}})
    assert code == 0, output[-3000:]
    assert [r["absent"] for r in records] == [[], []]
    assert_matches(train(common), records, [0, 1])


@pytest.mark.parametrize("schedule", ["pipedream_2bw", "pipemare"])
def test_asynchronous_schedules_with_stand_ins_equal_their_emulation(schedule):
    """The weight policies of the middle stages leave the stand-ins out (no snapshot, master copy or
    velocity of them): 4 processes equal the 4-stage one-device emulation, which keeps every tensor."""
    config = {"epochs": 2, "batch_size": 16, "strategy": {"schedule": schedule, "micro_batches": 4}}
    code, output, records = launch({**config, "devices": 4})
    assert code == 0, output[-3000:]
    assert [len(r["absent"]) for r in records] == [0, 4, 4, 0]
    emulated = train({**config, "strategy": {**config["strategy"], "stages": 4}})
    merged = {k: v for r in records for k, v in r["state"].items() if k.startswith("model.")}
    merged.update({k: v for k, v in records[0]["state"].items() if k.startswith("pre.")})
    merged.update({k: v for k, v in records[3]["state"].items() if k.startswith("head.")})
    for key, value in emulated["state"].items():
        assert torch.equal(merged[key], value), key
    assert [m["train_loss"] for m in records[0]["metrics"]] == [m["train_loss"] for m in emulated["metrics"]]
