"""PipeStrategy through Lightning equals one-device training (the heart of the suite)."""

from __future__ import annotations

import pytest
import torch

from lightning_pipe.engine import shm
from tests.harness.launch import launch
from tests.harness.lightning_run import train

STEPS = 4


def merged_state(records, last_device=-1):
    """Whole-model weights from the ranks of pipeline 0: trunk layers from their owners,
    layers before the trunk from stage 0, layers after it from the device holding the last virtual
    stage (the last device; device 0 under zbv's V)."""
    first, last = records[0], records[last_device]
    state = {}
    for record in records:
        state.update({k: v for k, v in record["state"].items() if k.startswith("model.")})
    state.update({k: v for k, v in first["state"].items() if k.startswith("pre.")})
    state.update({k: v for k, v in last["state"].items() if k.startswith("head.")})
    return state


def assert_matches(reference, records, pipeline_ranks, last_device=-1):
    ranks = [records[r] for r in pipeline_ranks]
    state = merged_state(ranks, last_device)
    assert state.keys() == reference["state"].keys()
    for key, value in reference["state"].items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)
    for record in records:  # every rank logged the same as one device, step by step
        assert len(record["metrics"]) == len(reference["metrics"])
        for got, want in zip(record["metrics"], reference["metrics"]):
            for name in ("train_loss", "train_acc", "seen"):
                assert got[name] == pytest.approx(want[name], rel=1e-5, abs=1e-6), name
        assert record["returned"] == pytest.approx(reference["returned"], rel=1e-5)
    grads = {}
    for record in ranks:
        grads.update({k: v for k, v in record["grads"].items() if k.startswith("model.")})
    grads.update({k: v for k, v in ranks[0]["grads"].items() if k.startswith("pre.")})
    grads.update({k: v for k, v in ranks[last_device]["grads"].items() if k.startswith("head.")})
    for key, value in reference["grads"].items():
        torch.testing.assert_close(grads[key], value, rtol=1e-5, atol=1e-7, msg=key)


@pytest.mark.parametrize(
    "schedule,micro_batches,extra",
    [("gpipe", 4, {}), ("1f1b", 4, {"checkpoint_activations": True}), ("interleaved_1f1b", 4, {"chunks_per_stage": 2}),
     ("zb_h1", 4, {}), ("zbv", 4, {}), ("dualpipev", 4, {}), ("1f1b", 4, {"transport": "process_group"})],
)
def test_two_stages_equal_one_device(schedule, micro_batches, extra):
    """Training, mid-epoch validation (torchmetrics objects too), validate, test and predict; over shared
    memory (the default between CPU processes of one host) and over gloo."""
    common = {"max_steps": STEPS, "batch_size": 16, "model": {"optimizer": "adam"}, "evaluate": True,
              "trainer": {"val_check_interval": 2}}
    reference = train(common)
    code, output, records = launch({
        **common, "devices": 2, "strategy": {"schedule": schedule, "micro_batches": micro_batches, **extra},
    })
    assert code == 0, output[-3000:]
    gloo = extra.get("transport") == "process_group" or shm.available() is not None
    assert sorted(r["transport"] for r in records) == ([("Transport", [])] * 2 if gloo else
                                                       [("SharedMemoryTransport", [0]), ("SharedMemoryTransport", [1])])
    assert_matches(reference, records, [0, 1], last_device=0 if schedule in ("zbv", "dualpipev") else -1)
    # after the first step each end gave back what the other trains (under the V, device 0 runs both ends
    # and device 1 only middle stages, which never held them): evaluation below still equals one device
    outside = ["head.bias", "head.weight", "pre.bias", "pre.weight"]
    released = [[], outside] if schedule in ("zbv", "dualpipev") else [outside[:2], outside[2:]]
    assert [r["absent"] for r in records] == released
    assert len(reference["val_metrics"]) == 3  # two mid-epoch checks + trainer.validate
    for record in records:
        assert_close_dicts(record["val_metrics"], reference["val_metrics"])
        assert_close_dicts(record["validate"], reference["validate"])
        assert_close_dicts(record["test"], reference["test"])
        torch.testing.assert_close(torch.cat(record["predict"]), torch.cat(reference["predict"]), rtol=1e-5, atol=1e-6)


def assert_close_dicts(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for key in w:
            assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-6), key


def test_four_stages_short_last_batch_equal_one_device():
    """4 stages, 1f1b, SGD momentum, a batch size that leaves a short last batch (96 = 5 × 18 + 6)."""
    reference = train({"epochs": 1, "batch_size": 18})
    code, output, records = launch({
        "devices": 4, "epochs": 1, "batch_size": 18, "strategy": {"schedule": "1f1b", "micro_batches": 6, "balance": [3, 3, 3, 3]},
    }, timeout=240)
    assert code == 0, output[-3000:]
    assert reference["global_step"] == records[0]["global_step"] == 6
    assert_matches(reference, records, [0, 1, 2, 3])


@pytest.mark.parametrize("schedule,accumulate", [("1f1b", 1), ("1f1b", 2), ("dualpipev", 1)])
def test_two_pipelines_equal_one_device_at_double_batch(schedule, accumulate):
    """Without accumulation the pipelines average while the last backward runs (GradientReducer; a split
    backward's last W); with it, the window's last batch adds to earlier gradients and the sum is averaged
    afterwards."""
    trainer = {"accumulate_grad_batches": accumulate}
    reference = train({"max_steps": STEPS, "batch_size": 16, "trainer": trainer})
    code, output, records = launch({
        "devices": 4, "max_steps": STEPS, "batch_size": 8, "stages": 2, "pipelines_in_sampler": 2,
        "strategy": {"schedule": schedule, "micro_batches": 4, "pipelines": 2}, "trainer": trainer,
    }, timeout=240)
    assert code == 0, output[-3000:]
    for pipeline in ([0, 1], [2, 3]):
        ranks = [records[r] for r in pipeline]
        state = merged_state(ranks, last_device=0 if schedule == "dualpipev" else -1)
        for key, value in reference["state"].items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_callbacks_and_loggers_behave_as_on_one_device(tmp_path):
    """ModelCheckpoint (monitor, top-k, last, every n steps), EarlyStopping, LearningRateMonitor, CSV and
    TensorBoard loggers (rank 0 writes what one device writes), and the model's own calls to the loggers
    (``self.logger.log_metrics``, ``self.loggers[1].experiment.add_scalar``) reach them: made on the last stage in the
    step, on every stage, each with its own parameters' gradients, in ``on_before_optimizer_step``, and on the last
    stage in ``on_validation_epoch_end`` from the outputs its steps collected (Lightning's recipe)."""
    import csv
    import os

    common = {"epochs": 6, "batch_size": 16, "evaluate": False, "model": {"scheduler": True, "logger_calls": True},
              "trainer": {"val_check_interval": 1.0, "log_every_n_steps": 1}}

    def run(root, pipeline):
        config = {**common, "full_callbacks": str(root)}
        if not pipeline:
            return train(config)
        code, output, records = launch({**config, "devices": 2, "strategy": {"schedule": "1f1b", "micro_batches": 4}},
                                       timeout=240)
        assert code == 0, output[-3000:]
        return records[0]

    reference = run(tmp_path / "one", False)
    piped = run(tmp_path / "pipe", True)
    assert piped["checkpointing"]["best_k"] == reference["checkpointing"]["best_k"]
    assert piped["checkpointing"]["stopped_epoch"] == reference["checkpointing"]["stopped_epoch"] < 5
    assert piped["checkpointing"]["best_score"] == pytest.approx(reference["checkpointing"]["best_score"], rel=1e-5)
    for sub in ("best", "every"):
        assert sorted(os.listdir(tmp_path / "pipe" / sub)) == sorted(os.listdir(tmp_path / "one" / sub))

    def rows(root):
        with open(root / "csv" / "version_0" / "metrics.csv") as f:
            return list(csv.DictReader(f))

    got, want = rows(tmp_path / "pipe"), rows(tmp_path / "one")
    # the pipeline adds its per-stage columns (stage_metrics=True, docs/metrics.md); the rest is as on one device
    extra = {key for key in got[0] if key.startswith("pipe/")}
    assert {"pipe/stage0/bubble", "pipe/stage1/compute_ms"} <= extra
    got = [{k: v for k, v in row.items() if k not in extra} for row in got]
    assert len(got) == len(want) and got[0].keys() == want[0].keys() and {"first_logit", "val_max_logit", "val_rows"} <= want[0].keys()
    for g, w in zip(got, want):
        for key in w:
            if w[key] == "":
                assert g[key] == ""
            else:
                assert float(g[key]) == pytest.approx(float(w[key]), rel=1e-5, abs=1e-6), key
    tb_got, tb_want = tensorboard_scalars(tmp_path / "pipe"), tensorboard_scalars(tmp_path / "one")
    assert {k for k in tb_got if not k.startswith("pipe/")} == tb_want.keys()
    assert {"train_loss", "first_logit_tb", "grad_sum/pre.weight", "grad_sum/head.bias"} <= tb_got.keys()
    for tag, points in tb_want.items():
        assert [s for s, _ in tb_got[tag]] == [s for s, _ in points], tag
        assert [v for _, v in tb_got[tag]] == pytest.approx([v for _, v in points], rel=1e-5, abs=1e-6), tag


@pytest.mark.parametrize("schedule, model", [
    ("1f1b", {"stop_at_step": 4}),
    ("zbv", {"stop_at_step": 4}),  # the step's end runs on device 0 (the V's last stage)
    ("1f1b", {"stop_in_validation": True}),
])
def test_should_stop_set_in_a_step_stops_every_stage_where_one_device_stops(schedule, model):
    """``self.trainer.should_stop = True`` in the step's code after the trunk (after a number of steps, or
    at a loss threshold), which only the last stage runs: every stage stops at the same step (a stage that
    missed it would start the next step alone and hang), as one device does."""
    config = {"epochs": 3, "evaluate": True, "model": model}
    reference = train(config)
    assert reference["global_step"] == (5 if "stop_at_step" in model else 6)
    code, output, records = launch({**config, "devices": 2, "strategy": {"schedule": schedule, "micro_batches": 4}},
                                   timeout=120)
    assert code == 0, output[-3000:]
    assert [r["global_step"] for r in records] == [reference["global_step"]] * 2


def test_should_stop_set_by_the_first_stage_alone_is_named_not_a_hang():
    """Set in code before the trunk on rank 0 only, it used to stop that rank alone while the last stage went on to
    the next step: both waited for each other until process_group_timeout (an hour). The last stage's value decides,
    as the docs say, and the first stage says why its request did not stop the run."""
    config = {"epochs": 1, "model": {"stop_at_step": 2, "stop_rank": 0}}
    reference = train({"epochs": 1})
    code, output, records = launch({**config, "devices": 2, "strategy": {"schedule": "1f1b", "micro_batches": 4, "timeout": 60}},
                                   timeout=120)
    assert code == 0, output[-3000:]
    assert [r["global_step"] for r in records] == [reference["global_step"]] * 2
    assert "stage 0 set trainer.should_stop = True in code the last stage does not run" in output


@pytest.mark.parametrize("devices, pipelines", [(2, 1), (4, 2)])
def test_all_gather_in_a_step_gathers_over_the_pipelines(devices, pipelines):
    """``self.all_gather`` in ``validation_step`` runs on the last stages only: it gathers over the pipelines
    (the data-parallel replicas), and with one pipeline returns the tensor as one device does. It used to wait
    for the first stage, which never calls it, until ``timeout``."""
    config = {"epochs": 1, "evaluate": True, "model": {"gather": True}}
    reference = train(config)
    code, output, records = launch({**config, "devices": devices, "stages": 2,
                                    "strategy": {"schedule": "1f1b", "micro_batches": 4, "pipelines": pipelines}},
                                   timeout=120)
    assert code == 0, output[-3000:]
    for record in records:
        for got, want in zip(record["val_metrics"], reference["val_metrics"], strict=True):
            assert got["val_gathered_size"] == pipelines * want["val_gathered_size"] == pipelines
            assert got["val_gathered_mean"] == pytest.approx(want["val_gathered_mean"], rel=1e-5)
            assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-5)


def tensorboard_scalars(root) -> dict[str, list[tuple[int, float]]]:
    """Scalars of rank 0's TensorBoard event files (TFRecord framing: length, crc, event, crc)."""
    import struct

    from tensorboardX.proto import event_pb2

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted((root / "tb" / "version_0").glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


@pytest.mark.parametrize("schedule, hook, trainer", [
    ("1f1b", True, {}), ("zbv", True, {}),  # zbv: the last stage is device 0
    ("1f1b", "after_backward", {"accumulate_grad_batches": 2}),  # on_after_backward runs at every batch, stepping or not
])
def test_grad_norm_logged_before_the_optimizer_step_covers_every_stage(schedule, hook, trainer):
    """Lightning's ``self.log_dict(grad_norm(self, 2))`` in ``on_before_optimizer_step`` (or ``on_after_backward``)
    runs on every rank with its own stage's gradients: every rank (and so rank 0's loggers) now sees every
    parameter's norm and the whole model's total, as one device logs them. Before, each rank logged its own
    stage's, with a total over it alone."""
    config = {"epochs": 1, "model": {"log_grad_norms": hook}, "trainer": trainer}
    reference = train(config)
    norms = [{k: v for k, v in step.items() if k.startswith("grad_")} for step in reference["metrics"]]
    assert "grad_2.0_norm_total" in norms[0] and "grad_2.0_norm/head.weight" in norms[0]
    code, output, records = launch({**config, "devices": 2, "strategy": {"schedule": schedule, "micro_batches": 4}},
                                   timeout=120)
    assert code == 0, output[-3000:]
    for record in records:
        got = [{k: v for k, v in step.items() if k.startswith("grad_")} for step in record["metrics"]]
        assert [sorted(step) for step in got] == [sorted(step) for step in norms]
        for got_step, want_step in zip(got, norms, strict=True):
            assert got_step == pytest.approx(want_step, rel=1e-5)


def test_every_stage_of_a_pipeline_draws_the_same_random_numbers_in_its_dataloader_workers():
    """Under ``seed_everything(..., workers=True)`` Lightning seeds each DataLoader worker from the global rank, so a random
    masking in the collate (a masked language model's) gave each stage other labels than the inputs the first stage
    used. Workers are now seeded by pipeline: the stages of one pipeline see the same batches."""
    code, output, records = launch({"epochs": 2, "masking_workers": True, "devices": 2,
                                    "strategy": {"schedule": "1f1b", "micro_batches": 4}}, timeout=120)
    assert code == 0, output[-3000:]
    first, last = (record["labels"] for record in records)
    assert len(first) == 12 and first == last
    assert any(0 in labels for labels in first)


def test_stages_that_loaded_different_batches_stop_with_the_way_to_shard():
    """A dataset that shards itself by global rank (each stage its own half, of one size) trained the last stage's labels
    against another batch's inputs, silently; the end of the first step now compares the stages' batches."""
    code, output, _ = launch({"epochs": 1, "shard_by_rank": True, "devices": 2,
                              "strategy": {"schedule": "1f1b", "micro_batches": 4}}, timeout=120)
    assert code != 0
    assert "stage 0 loaded another batch than the last stage" in output
    assert "rank=trainer.global_rank // trainer.strategy.num_stages" in output


def test_every_stage_of_a_pipeline_draws_the_same_mixup_in_the_step_and_the_same_masking_between_steps():
    """Mixup draws its weight and permutation in the step, before the trunk: the first stage mixes the inputs with them,
    the last stage the labels. The stages' generators drift apart (the first stage's dropout draws masks the last does
    not), so the labels were mixed with other draws than the inputs from the second micro-batch on; each micro-batch's
    step now starts from one seed on every stage. A random masking of the labels in the main process's collate
    (num_workers=0), which stopped the run at the first step's batch check, draws alike too: after a step every stage's
    generators start from the step's seed. The one-process emulation draws the same numbers and trains the same weights."""
    config = {"epochs": 1, "model": {"mixup": True}, "masking_main": True, "strategy": {"schedule": "1f1b", "micro_batches": 4}}
    code, output, records = launch({**config, "devices": 2}, timeout=120)
    assert code == 0, output[-3000:]
    first, last = records
    emulated = train({**config, "strategy": {**config["strategy"], "stages": 2}})  # one process: the same seeds
    assert {key: draws[:1] for key, draws in emulated["mixup_draws"].items()} == first["mixup_draws"]  # (it runs the step twice)
    for record in records:
        for key, value in record["state"].items():
            if key not in record["absent"]:
                torch.testing.assert_close(value, emulated["state"][key], rtol=1e-5, atol=1e-6, msg=key)
    assert len(first["mixup_draws"]) == 24 and first["mixup_draws"] == last["mixup_draws"]  # 6 batches of 4 micro-batches
    assert len({draws[0][0] for draws in first["mixup_draws"].values()}) == 24
    assert len(first["labels"]) == 6 and first["labels"] == last["labels"]
    assert any(0 in labels for labels in first["labels"])


def test_a_rank_whose_dataloader_ends_first_stops_every_rank_at_once_with_the_reason():
    """A rank whose DataLoader ran out first went on to the epoch's end while the others waited in the next batch's
    collectives, until process_group_timeout (an hour by default) ended the job with no word of why. The step boundary's
    all-reduce now also compares whether the batch ends the epoch."""
    code, output, _ = launch({"epochs": 1, "short_rank": 0, "devices": 2, "strategy": {"schedule": "1f1b", "micro_batches": 4}},
                             timeout=120)
    assert code != 0
    assert "the train DataLoader of rank(s) 0 ends its epoch with this batch, that of rank(s) 1 does not" in output


def test_predict_with_two_pipelines_takes_the_uneven_shares_lightning_gives_them():
    """Lightning shares the samples out to predict without repeating any (9 samples: 5 and 4), so one pipeline ran a
    batch more than the other, whose ranks had left: the step boundary's all-reduce over every rank failed. During
    predict each pipeline now agrees within itself."""
    code, output, records = launch({"devices": 4, "epochs": 1, "evaluate": True, "eval_samples": 9, "eval_batch_size": 4,
                                    "trainer": {"use_distributed_sampler": True},
                                    "strategy": {"schedule": "1f1b", "micro_batches": 2, "pipelines": 2}}, timeout=180)
    assert code == 0, output[-3000:]
    rows = {record["rank"]: [len(p) for p in record["predict"]] for record in records}
    assert rows == {0: [4, 1], 1: [4, 1], 2: [4], 3: [4]}
