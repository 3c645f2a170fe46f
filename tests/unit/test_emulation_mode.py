"""One-device emulation (``Trainer(devices=1, strategy=PipeStrategy(stages=P))``) equals the literal
reference of each asynchronous update rule, the distributed run, and (sync schedules) one device."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from lightning_pipe.engine import split_micro_batches
from lightning_pipe.engine.policies import AsyncOptions, DoubleBufferOptions, live
from tests.harness.lightning_run import TrunkModel, make_data, muon_with_adam, train
from tests.reference.async_cases import (
    BATCH,
    EPOCHS,
    emulated,
    emulator_for,
    reference,
    reference_from_checkpoint,
    reference_stages,
    run_epochs,
    stage_optimizers,
)

CASES = [
    (schedule, stages, micro)
    for schedule in ("pipedream", "pipedream_2bw", "pipemare", "xpipe")
    for stages in (2, 4)
    for micro in (1, 2)
    if not (schedule == "pipedream_2bw" and micro < stages)
]


@pytest.mark.parametrize("schedule,stages,micro", CASES)
def test_emulation_equals_reference(schedule, stages, micro):
    """Losses per step and final weights; clipping per stage and per-stage lr schedulers (step interval
    for pipedream/pipemare, Lightning's epoch interval for the others) in the stages=2 cases."""
    clip, interval = (0.5, "step" if schedule in ("pipedream", "pipemare") else "epoch") if stages == 2 else (None, None)
    trainer = {"gradient_clip_val": clip} if clip else {}
    got = emulated(schedule, stages, micro, model={"scheduler": interval or False}, trainer=trainer)
    want_losses, want_state = reference(schedule, stages, micro, clip, interval)
    assert [m["train_loss"] for m in got["metrics"]] == pytest.approx(want_losses, rel=1e-5)
    assert got["global_step"] == len(want_losses)
    for key, value in want_state.items():
        torch.testing.assert_close(got["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    last = got["metrics"][-1]
    assert all(f"pipe/stage{s}/weight_copies" in last for s in range(stages))
    assert last["pipe/stage0/staleness"] > 0
    if schedule == "pipedream_2bw":  # every stage's gradient is one step stale (0 only for the first mini-batch)
        assert 0.9 < last[f"pipe/stage{stages - 1}/staleness"] < 1.0
    else:
        assert last[f"pipe/stage{stages - 1}/staleness"] == 0.0


@pytest.mark.parametrize("schedule,stages,moves", [("pipedream", 4, "exchange"), ("pipedream_2bw", 2, "exchange"),
                                                  ("pipemare", 4, "exchange"), ("pipemare", 4, "redirect"),
                                                  ("xpipe", 4, "redirect"), ("pipemare", 4, "copy"), ("xpipe", 4, "copy")])
def test_bf16_mixed_equals_reference(schedule, stages, moves, monkeypatch):
    """Under autocast a forward's graph keeps the bfloat16 cast of each weight it used; pipemare's and xpipe's
    backwards must still read the weights the policy gives them when they run (the current or corrected
    ones, the backward prediction), cast as the forward cast them: as the reference, whose backward reads
    low-precision copies of its live storage written before each B. pipedream's and 2BW's read their stash.
    The final weights are the reference's bit for bit, whether the policies exchange storages (pipemare where
    this torch can), redirect the backwards (xpipe; pipemare on torch 2.11) or copy.
    An epoch of one batch is a segment of one mini-batch: the next one's first backward reads the same token of
    weights (xpipe's ``("B", 0)``) but other values."""
    if moves != "exchange":
        monkeypatch.setattr(live, "exchanges_storage", lambda: False)
    monkeypatch.setattr(live._LivePolicy, "moves_values", "copy" if moves == "copy" else "auto")
    for samples in (96, 16):
        got = emulated(schedule, stages, 2, trainer={"precision": "bf16-mixed"}, samples=samples)
        want_losses, want_state = reference(schedule, stages, 2, None, None, samples, autocast=torch.bfloat16)
        assert [m["train_loss"] for m in got["metrics"]] == pytest.approx(want_losses, rel=1e-5)
        for key, value in want_state.items():
            assert torch.equal(got["state"][key], value), (samples, key)


@pytest.mark.parametrize("schedule", ["pipedream", "pipedream_2bw", "pipemare", "xpipe"])
def test_a_short_last_batch_is_a_short_mini_batch(schedule):
    """90 samples in batches of 16 leave a last batch of 10 samples (4 micro-batches of 2 or 3) and,
    with 82 samples, one of 2 samples: fewer than the 4 micro-batches, so 2 micro-batches of one
    sample make a short mini-batch that steps in the drain ending the epoch (docs/async-semantics.md).
    No drop_last needed; every step equals the reference's rule."""
    for samples in (90, 82):
        got = emulated(schedule, 2, 4, samples=samples)
        want_losses, want_state = reference(schedule, 2, 4, None, None, samples)
        assert got["global_step"] == len(want_losses) == EPOCHS * 6
        assert [m["train_loss"] for m in got["metrics"]] == pytest.approx(want_losses, rel=1e-5)
        for key, value in want_state.items():
            torch.testing.assert_close(got["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("schedule,extra", [("gpipe", {}), ("1f1b", {}), ("interleaved_1f1b", {"micro_batches": 4}),
                                            ("zb_h1", {"micro_batches": 4}), ("zbv", {"micro_batches": 4}),
                                            ("dualpipev", {"micro_batches": 4})])
def test_sync_emulation_equals_one_device(schedule, extra):
    """Training, then validate / test / predict through the emulated forward-only pipeline."""
    one = train({"epochs": 1, "batch_size": BATCH, "evaluate": True})
    got = train({"epochs": 1, "batch_size": BATCH, "evaluate": True,
                 "strategy": {"schedule": schedule, "stages": 2, "micro_batches": 2, **extra}})
    assert [m["train_loss"] for m in got["metrics"]] == pytest.approx([m["train_loss"] for m in one["metrics"]], rel=1e-5)
    for key in ("validate", "test"):
        assert got[key][0] == pytest.approx(one[key][0], rel=1e-5), key
    torch.testing.assert_close(torch.cat(got["predict"]), torch.cat(one["predict"]), rtol=1e-5, atol=1e-6)
    for key, value in one["state"].items():
        torch.testing.assert_close(got["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_split_backwards_under_bf16_mixed_equal_1f1b_bit_for_bit():
    """Under autocast a weight reaches its boundary node through a cast (``ToCopyBackward0``): the zero-bubble
    schedules' split backward still finds it, and every synchronous schedule computes 1f1b's bits."""
    def run(schedule: str, stages: int) -> dict:
        return train({"epochs": 1, "batch_size": BATCH, "trainer": {"precision": "bf16-mixed"},
                      "strategy": {"schedule": schedule, "stages": stages, "micro_batches": 4}})

    want = run("1f1b", 4)
    for schedule, stages in (("zb_h1", 4), ("zbv", 2), ("dualpipev", 2), ("interleaved_1f1b", 2)):
        got = run(schedule, stages)  # 4 virtual stages each, so the same cuts
        assert [m["train_loss"] for m in got["metrics"]] == [m["train_loss"] for m in want["metrics"]], schedule
        for key, value in want["state"].items():
            assert torch.equal(got["state"][key], value), (schedule, key)


def test_sync_warmup_then_asynchronous():
    """Epoch 0 is one-device training (1f1b); epoch 1 is the reference started from its weights and
    momentum (each stage's optimizer takes the state of its parameters)."""
    got = emulated("xpipe", 2, 2, strategy={"sync_warmup_epochs": 1})
    one = train({"epochs": 1, "batch_size": BATCH})
    losses = [m["train_loss"] for m in got["metrics"]]
    assert losses[:6] == pytest.approx([m["train_loss"] for m in one["metrics"]], rel=1e-5)

    model = TrunkModel()  # replay epoch 0 by hand, then hand the stages to the reference
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = make_data().tensors
    for start in range(0, len(x), BATCH):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x[start:start + BATCH]), y[start:start + BATCH]).backward()
        optimizer.step()
    emulator, _ = emulator_for(model, "xpipe", 2, 2, None, None, stage_optimizers(model, optimizer, 2))
    assert losses[6:] == pytest.approx(run_epochs(emulator, [], None, 2, 1), rel=1e-5)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(got["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert got["metrics"][5]["pipe/stage0/staleness"] == 0.0 and got["metrics"][-1]["pipe/stage0/prediction_norm"] > 0


@pytest.mark.parametrize("schedule", ["pipedream_2bw", "xpipe"])
def test_sync_warmup_counted_in_steps_switches_within_an_epoch(schedule):
    """``sync_warmup_steps=4`` of an epoch of 6 batches: 4 one-device steps, then the reference's rule
    from batch 5 on, started from those weights and momentum, through the epoch's drain and the next."""
    warmup, micro = 4, 2
    got = emulated(schedule, 2, micro, strategy={"sync_warmup_steps": warmup})
    losses = [m["train_loss"] for m in got["metrics"]]

    model = TrunkModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = make_data().tensors
    batches = [(x[start:start + BATCH], y[start:start + BATCH]) for start in range(0, len(x), BATCH)]
    want = []
    for batch in batches[:warmup]:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(batch[0]), batch[1])
        loss.backward()
        optimizer.step()
        want.append(loss.item())
    emulator, _ = emulator_for(model, schedule, 2, micro, None, None, stage_optimizers(model, optimizer, 2))
    for epoch_batches in (batches[warmup:], batches):
        for batch in epoch_batches:
            want.append(sum(emulator.train_window(split_micro_batches(batch, micro))) / micro)
        emulator.drain()
    assert losses == pytest.approx(want, rel=1e-5)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(got["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("schedule,options", [("pipedream_2bw", {"pipedream_2bw": {"lookahead": 0.0}}), ("pipemare", {}),
                                              ("pipedream_2bw", {})])
def test_resume_continues_like_an_uninterrupted_run(schedule, options, tmp_path):
    """The checkpoint holds every stage's policy state (2BW's look-ahead: the last update too) and
    optimizer share in one-device format."""
    whole = emulated(schedule, 2, 2, model={"scheduler": "step"}, strategy=options)
    ckpt = str(tmp_path / "epoch1.ckpt")
    emulated(schedule, 2, 2, model={"scheduler": "step"}, epochs=1, ckpt_out=ckpt, strategy=options)
    resumed = emulated(schedule, 2, 2, model={"scheduler": "step"}, ckpt_path=ckpt, strategy=options)
    for key, value in whole["state"].items():
        torch.testing.assert_close(resumed["state"][key], value, rtol=1e-6, atol=1e-7, msg=key)
    assert [m["train_loss"] for m in resumed["metrics"]] == pytest.approx([m["train_loss"] for m in whole["metrics"]][6:], rel=1e-6)
    saved = torch.load(ckpt, weights_only=False)
    state = saved["pipe_async_state"]  # every stage's state in one, keyed by parameter name
    per_parameter = state["previous" if schedule == "pipedream_2bw" else "delta"]
    assert set(per_parameter) == {n for n, _ in TrunkModel().named_parameters()} and state["steps"] == 6
    assert (state.get("last_update") is not None) == (schedule == "pipedream_2bw" and not options)  # the default look-ahead
    fresh = TrunkModel()  # the file is an ordinary one-device checkpoint
    fresh.load_state_dict(saved["state_dict"])
    plain = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    plain.load_state_dict({k: v for k, v in saved["optimizer_states"][0].items() if k != "pipe_param_names"})


@pytest.mark.parametrize("schedule", ["pipemare", "avgpipe"])
def test_a_checkpoint_saved_just_after_an_epoch_scheduler_changed_the_lr_resumes_exactly(schedule, tmp_path):
    """Lightning's epoch-interval StepLR halves the lr at the end of epoch 2; the stages' optimizers take it at the next
    window, so the checkpoint saved in between held the old lr (resumed at 0.1 where the uninterrupted run had 0.05)."""
    whole = emulated(schedule, 2, 2, model={"scheduler": True}, epochs=3)
    ckpt = str(tmp_path / "epoch2.ckpt")
    emulated(schedule, 2, 2, model={"scheduler": True}, epochs=2, ckpt_out=ckpt)
    assert [g["lr"] for g in torch.load(ckpt, weights_only=False)["optimizer_states"][0]["param_groups"]] == [0.05]
    resumed = emulated(schedule, 2, 2, model={"scheduler": True}, epochs=3, ckpt_path=ckpt)
    for key, value in whole["state"].items():
        assert torch.equal(resumed["state"][key], value), key


@pytest.mark.parametrize("schedule", ["pipedream", "pipedream_2bw", "pipemare", "xpipe"])
def test_a_stage_with_nothing_to_train_equals_the_reference(schedule):
    """Fine-tuning with the first stage frozen (its input layer and trunk layers): that stage's policy has no weights
    to stash, predict or correct, and every step is the reference's rule for the rest."""
    got = emulated(schedule, 2, 2, model={"frozen": 6})
    want_losses, want_state = reference(schedule, 2, 2, None, None, frozen=6)
    assert [m["train_loss"] for m in got["metrics"]] == pytest.approx(want_losses, rel=1e-5)
    for key, value in want_state.items():
        torch.testing.assert_close(got["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert torch.equal(got["state"]["model.0.weight"], TrunkModel().state_dict()["model.0.weight"])  # frozen


@pytest.mark.parametrize("optimizer", ["adam_foreach", "muon"])
def test_a_stage_with_nothing_to_train_gets_an_empty_share_of_any_optimizer(optimizer):
    """The frozen stage's share of a CombinedOptimizer (Muon with Adam) or a fused Adam holds no parameter; the other
    stage trains."""
    got = emulated("pipemare", 2, 2, model={"frozen": 6, "optimizer": optimizer})
    start = TrunkModel().state_dict()
    assert torch.equal(got["state"]["model.0.weight"], start["model.0.weight"])
    assert not torch.equal(got["state"]["model.6.weight"], start["model.6.weight"])


@pytest.mark.parametrize("schedule", ["pipemare", "avgpipe"])
def test_a_run_with_a_frozen_stage_resumes_like_an_uninterrupted_one(schedule, tmp_path):
    """The checkpoint's optimizer keeps the frozen parameters, as one device's does: the emulation resumes from it,
    and a plain optimizer over the whole module loads it."""
    config = {"model": {"frozen": 6},
              "strategy": {"avgpipe": {"parallel_pipelines": 2, "advance_forward": 1}} if schedule == "avgpipe" else {}}
    whole = emulated(schedule, 2, 2, **copy.deepcopy(config))
    ckpt = str(tmp_path / "epoch1.ckpt")
    emulated(schedule, 2, 2, epochs=1, ckpt_out=ckpt, **copy.deepcopy(config))
    resumed = emulated(schedule, 2, 2, ckpt_path=ckpt, **copy.deepcopy(config))
    for key, value in whole["state"].items():
        torch.testing.assert_close(resumed["state"][key], value, rtol=1e-6, atol=1e-7, msg=key)
    saved = torch.load(ckpt, weights_only=False)
    fresh = TrunkModel(frozen=6)
    fresh.load_state_dict(saved["state_dict"])
    plain = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    plain.load_state_dict({k: v for k, v in saved["optimizer_states"][0].items() if k != "pipe_param_names"})


def test_emulation_rejects_parameters_shared_across_stages():
    with pytest.raises(Exception, match="parameters pre.weight are used on several stages"):
        emulated("pipedream", 2, 2, model={"tie": True})


@pytest.mark.parametrize("schedule", ["pipemare", "xpipe"])
def test_a_checkpoint_resumes_under_another_split(schedule, tmp_path):
    """The policy state is keyed by parameter name: a 2-stage checkpoint resumes as 4 stages and
    continues exactly as the reference started from the checkpoint says; another balance resumes too."""
    ckpt = str(tmp_path / "two-stages.ckpt")
    emulated(schedule, 2, 2, epochs=1, ckpt_out=ckpt)
    resumed = emulated(schedule, 4, 2, ckpt_path=ckpt)
    reference, model = reference_from_checkpoint(schedule, 4, ckpt)
    losses = run_epochs(reference, [], None, 2, 1)
    assert [m["train_loss"] for m in resumed["metrics"]] == pytest.approx(losses, rel=1e-5)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(resumed["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    other = emulated(schedule, 2, 2, ckpt_path=ckpt, strategy={"balance": [3, 9]})
    assert other["global_step"] == 12


@pytest.mark.parametrize("schedule", ["pipedream", "pipedream_2bw"])
def test_activation_recomputation_changes_nothing(schedule):
    """checkpoint_activations recomputes a stage's forward inside its backward: on the stashed
    version that forward saw, so the run equals the one that kept its activations."""
    kept = emulated(schedule, 2, 2)
    recomputed = emulated(schedule, 2, 2, strategy={"checkpoint_activations": True})
    assert [m["train_loss"] for m in recomputed["metrics"]] == pytest.approx([m["train_loss"] for m in kept["metrics"]], rel=1e-6)
    for key, value in kept["state"].items():
        torch.testing.assert_close(recomputed["state"][key], value, rtol=1e-6, atol=1e-7, msg=key)


def test_activation_recomputation_changes_nothing_under_avgpipe():
    """avgpipe's replicas: recomputation runs on the replica whose forward it repeats (one process)."""
    import warnings

    config = {"devices": 1, "epochs": 1, "batch_size": BATCH, "trainer": {"log_every_n_steps": 1},
              "strategy": {"schedule": "avgpipe", "micro_batches": 2, "avgpipe": {"parallel_pipelines": 2}}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*one-stage pipeline.*")
        kept = train(config)
        recomputed = train({**config, "strategy": {**config["strategy"], "checkpoint_activations": True}})
    for key, value in kept["state"].items():
        torch.testing.assert_close(recomputed["state"][key], value, rtol=1e-6, atol=1e-7, msg=key)




@pytest.mark.parametrize("schedule", ["pipedream", "pipedream_2bw", "pipemare", "xpipe"])
def test_muon_in_every_weight_policy_equals_reference(schedule):
    """torch.optim.Muon for the matrices and Adam for the rest, as one CombinedOptimizer (Lightning takes
    one optimizer): every policy steps it like the reference; xpipe predicts a matrix along Muon's
    orthogonalised momentum and a bias along Adam's moments."""
    got = emulated(schedule, 2, 2, model={"optimizer": "muon"})
    model = TrunkModel()
    optimizers = [muon_with_adam(module.parameters()) for module in reference_stages(model, 2)]
    emulator, schedulers = emulator_for(model, schedule, 2, 2, None, None, optimizers)
    want_losses = run_epochs(emulator, schedulers, None, 2, EPOCHS)
    assert [m["train_loss"] for m in got["metrics"]] == pytest.approx(want_losses, rel=1e-5)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(got["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("stages,micro,clip", [(2, 2, 0.5), (4, 4, None)])
def test_2bw_lookahead_equals_reference(stages, micro, clip):
    """pipedream_2bw with look-ahead 1: every F and B of mini-batch K on W(K-1) + (W(K-1) - W(K-2)),
    across the epoch's drain, per stage (with stage-local clipping at P = 2)."""
    trainer = {"gradient_clip_val": clip} if clip else {}
    got = emulated("pipedream_2bw", stages, micro, strategy={"pipedream_2bw": {"lookahead": 1.0}}, trainer=trainer)
    model = TrunkModel()
    emulator, schedulers = emulator_for(model, "pipedream_2bw", stages, micro, clip, None,
                                        options=AsyncOptions(pipedream_2bw=DoubleBufferOptions(lookahead=1.0)))
    want_losses = run_epochs(emulator, schedulers, None, micro, EPOCHS)
    assert [m["train_loss"] for m in got["metrics"]] == pytest.approx(want_losses, rel=1e-5)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(got["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    paper = emulated("pipedream_2bw", stages, micro, strategy={"pipedream_2bw": {"lookahead": 0.0}}, trainer=trainer)
    assert got["metrics"][-1]["pipe/stage0/weight_copies"] == paper["metrics"][-1]["pipe/stage0/weight_copies"] + 1  # W(v-1)


@pytest.mark.parametrize("prediction,optimizer", [("adam", "sgd"), ("muon", "sgd"), ("momentum", "adam")])
def test_an_explicit_xpipe_prediction_must_fit_the_optimizer(prediction, optimizer):
    """A direction read from state the optimizer does not keep would silently predict nothing."""
    owner = "SGD" if optimizer == "sgd" else "Adam"
    with pytest.raises(ValueError, match=rf"xpipe prediction='{prediction}' does not fit stage 0's {owner} param group; "
                                         r"use xpipe=XPipeOptions\(prediction='auto'\)"):
        emulated("xpipe", 2, 4, model={"optimizer": optimizer}, strategy={"xpipe": {"prediction": prediction}})


@pytest.mark.parametrize("prediction", ["auto", "adam"])
def test_xpipe_does_not_predict_for_basis_rotation(prediction):
    """BasisRotationAdam's second moment lives in the rotated basis: Adam's rule would read it as if it did not."""
    with pytest.raises(ValueError, match="BasisRotationAdam"):
        emulated("xpipe", 2, 4, model={"optimizer": "basis_rotation"}, strategy={"xpipe": {"prediction": prediction}})


def test_a_short_last_batch_keeps_dualpipev_at_two_micro_batches_per_stage():
    """A short last batch splits into as many micro-batches as its samples allow while the schedule can run
    them (dualpipev: at least 2 × stages): 37 samples in batches of 16 end with 5, run as 5 micro-batches
    instead of 8; exactly one device's training."""
    config = {"epochs": 1, "batch_size": 16, "samples": 37}
    one = train(config)
    got = train({**config, "strategy": {"schedule": "dualpipev", "stages": 2, "micro_batches": 8}})
    assert [m["train_loss"] for m in got["metrics"]] == pytest.approx([m["train_loss"] for m in one["metrics"]], rel=1e-5)
    for key, value in one["state"].items():
        torch.testing.assert_close(got["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_vertical_sync_makes_the_last_stage_as_stale_as_the_first():
    """``pipedream.vertical_sync``: the last stage runs each micro-batch on the version stage 0 used, so
    its ``staleness`` metric (STEPs between that version and the weights the gradient updates) is no
    longer 0, and at most stage 0's; without it the last stage's gradients are always fresh."""
    plain = emulated("pipedream", 4, 1)["metrics"][-1]
    synced = emulated("pipedream", 4, 1, strategy={"pipedream": {"vertical_sync": True}})["metrics"][-1]
    assert plain["pipe/stage3/staleness"] == 0.0 and plain["pipe/stage0/staleness"] > 0
    assert 0 < synced["pipe/stage3/staleness"] <= synced["pipe/stage0/staleness"]


def test_the_lr_scale_metric_shows_the_delay_scaled_warm_up():
    """With ``delay_warmup_steps`` each stage logs the factor its last STEP applied: at M = 1 the 4 stages
    are 3, 2, 1 and 0 STEPs stale, so they ramp over 300, 200 and 100 STEPs and the last stage keeps 1;
    without the option pipedream logs no ``lr_scale`` (pipemare does: its T1 scales the rate)."""
    last = emulated("pipedream", 4, 1, strategy={"delay_warmup_steps": 100})["metrics"][-1]
    scales = [last[f"pipe/stage{s}/lr_scale"] for s in range(4)]
    assert 0 < scales[0] < scales[1] < scales[2] < scales[3] == 1.0
    assert "pipe/stage0/lr_scale" not in emulated("pipedream", 4, 1)["metrics"][-1]
    pipemare = emulated("pipemare", 4, 1, strategy={"pipemare": {"lr_warmup_steps": 100}})["metrics"][-1]
    assert pipemare["pipe/stage0/lr_scale"] < 1.0


UNEVEN_BATCH_SIZES = (7, 10, 16)


def evaluate_emulated(schedule: str | None, micro_batches: int = 3) -> dict[int, tuple[dict, torch.Tensor]]:
    """``trainer.validate`` and ``trainer.predict`` of an untrained model at each of ``UNEVEN_BATCH_SIZES``, on
    one device or through the 2-stage emulation (3 micro-batches are uneven at every one of those sizes)."""
    import lightning as L
    from torch.utils.data import DataLoader

    import lightning_pipe

    strategy = "auto" if schedule is None else lightning_pipe.PipeStrategy(schedule=schedule, stages=2, micro_batches=micro_batches)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    model = TrunkModel()
    results = {}
    for size in UNEVEN_BATCH_SIZES:
        loader = DataLoader(make_data(40, seed=1), batch_size=size)
        results[size] = trainer.validate(model, loader, verbose=False)[0], torch.cat(trainer.predict(model, loader))
    return results


@functools.cache
def one_device_evaluation() -> dict[int, tuple[dict, torch.Tensor]]:
    return evaluate_emulated(None)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev", "pipedream",
                                      "pipedream_2bw", "pipemare", "xpipe", "avgpipe"])
def test_emulated_evaluation_takes_uneven_micro_batches(schedule):
    """Every schedule validates and predicts like one device when micro_batches does not divide the batch
    (avgpipe on the center; on processes: tests/distributed/test_uneven_evaluation.py). Interleaved
    1F1B and DualPipeV train with a multiple of the stages: 4 micro-batches, uneven at 7 and 10 samples."""
    want = one_device_evaluation()
    got = evaluate_emulated(schedule, 4 if schedule in ("interleaved_1f1b", "dualpipev") else 3)
    for size in UNEVEN_BATCH_SIZES:
        assert got[size][0] == pytest.approx(want[size][0], rel=1e-5, abs=1e-6), size
        torch.testing.assert_close(got[size][1], want[size][1], rtol=1e-5, atol=1e-6)
