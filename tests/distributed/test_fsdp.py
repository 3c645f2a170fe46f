"""``PipeStrategy(pipelines=N, data_parallel="fsdp")``: each stage's trunk layers sharded across the N copies
of the stage (FSDP2) still equal one device at N × the batch size (issue 33)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_strategy import assert_close_dicts, merged_state
from tests.harness.launch import launch
from tests.harness.lightning_run import train

STEPS = 4
TRUNK = [f"model.{2 * i}.{kind}" for i in range(6) for kind in ("weight", "bias")]  # TrunkModel's Linear layers
OUTSIDE = {0: ["pre.weight", "pre.bias"], 1: ["head.weight", "head.bias"]}  # by stage: the layer only it trains


def assert_state_equal(reference: dict, records: list, pipelines: list[list[int]]) -> None:
    for pipeline in pipelines:
        state = merged_state([records[r] for r in pipeline])
        assert state.keys() == reference["state"].keys()
        for key, value in reference["state"].items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("schedule,extra", [
    ("gpipe", {}), ("1f1b", {}), ("interleaved_1f1b", {"chunks_per_stage": 2}),
    ("1f1b", {"fsdp_reshard": "micro_batch"}), ("interleaved_1f1b", {"chunks_per_stage": 2, "fsdp_reshard": "micro_batch"}),
    ("1f1b", {"fsdp_unit": "stage"}),
    ("interleaved_1f1b", {"chunks_per_stage": 2, "fsdp_unit": "stage", "fsdp_reshard": "micro_batch"}),
])
def test_two_sharded_pipelines_equal_one_device_at_double_batch(schedule, extra):
    """2 stages × 2 pipelines, Adam (its state sharded too; its multi-tensor update, CUDA's default, which the
    strategy turns per-tensor where a group mixes shards and whole parameters): after 4 steps every weight,
    gathered whole, equals one device trained at twice the batch; the trunk's parameters are DTensors, the rest
    stays whole."""
    model = {"optimizer": "adam_foreach"}
    reference = train({"max_steps": STEPS, "batch_size": 16, "model": model})
    code, output, records = launch({
        "devices": 4, "max_steps": STEPS, "batch_size": 8, "stages": 2, "pipelines_in_sampler": 2, "model": model,
        "strategy": {"schedule": schedule, "micro_batches": 4, "pipelines": 2, "data_parallel": "fsdp", **extra},
    }, timeout=300)
    assert code == 0, output[-3000:]
    assert_state_equal(reference, records, [[0, 1], [2, 3]])
    for rank, record in enumerate(records):  # each rank's own trunk layers, and from the second step on the layer
        sharded = set(record["sharded"])     # outside the trunk that its stage alone trains
        assert sharded & set(TRUNK) and sharded - set(TRUNK) == set(OUTSIDE[rank % 2])
    assert sorted(set(records[0]["sharded"] + records[1]["sharded"]) & set(TRUNK)) == sorted(TRUNK)


def test_a_tied_weight_stays_whole_and_training_equals_one_device():
    """tie=True: the input layer's weight is read directly after the trunk on the last stage (an LM head tied to
    its embedding). Both stages train it, so neither shards the input layer, and the head, which no stage trains,
    stays whole too; training still equals one device at twice the batch."""
    model = {"optimizer": "adam", "tie": True}
    reference = train({"max_steps": STEPS, "batch_size": 16, "model": model})
    code, output, records = launch({
        "devices": 4, "max_steps": STEPS, "batch_size": 8, "stages": 2, "pipelines_in_sampler": 2, "model": model,
        "strategy": {"schedule": "1f1b", "micro_batches": 4, "pipelines": 2, "data_parallel": "fsdp"},
    }, timeout=300)
    assert code == 0, output[-3000:]
    assert_state_equal(reference, records, [[0, 1], [2, 3]])
    for record in records:
        assert record["sharded"] and set(record["sharded"]) <= set(TRUNK)


def test_one_shard_equals_ddp():
    """pipelines=1: a one-rank mesh per stage; 1f1b with "fsdp" trains exactly as with "ddp" (and one device), and
    evaluates alike: mid-epoch validation, then validate, test and predict (forward-only steps gather each layer)."""
    common = {"devices": 2, "max_steps": STEPS, "batch_size": 16, "model": {"optimizer": "adam"}, "evaluate": True,
              "trainer": {"val_check_interval": 2}}
    runs = {}
    for data_parallel in ("ddp", "fsdp"):
        code, output, records = launch({**common, "strategy": {"schedule": "1f1b", "micro_batches": 4,
                                                                "data_parallel": data_parallel}}, timeout=240)
        assert code == 0, output[-3000:]
        runs[data_parallel] = records
    assert runs["fsdp"][0]["sharded"] and not runs["ddp"][0]["sharded"]
    ddp, fsdp = merged_state(runs["ddp"]), merged_state(runs["fsdp"])
    for key, value in ddp.items():
        torch.testing.assert_close(fsdp[key], value, rtol=1e-5, atol=1e-6, msg=key)
    for got, want in zip(runs["fsdp"], runs["ddp"]):
        assert len(want["val_metrics"]) == 3  # two mid-epoch checks + trainer.validate
        for name in ("val_metrics", "validate", "test"):
            assert_close_dicts(got[name], want[name])
        torch.testing.assert_close(torch.cat(got["predict"]), torch.cat(want["predict"]), rtol=1e-5, atol=1e-6)
    reference = train({"max_steps": STEPS, "batch_size": 16, "model": {"optimizer": "adam"}})
    assert_state_equal(reference, runs["fsdp"], [[0, 1]])


@pytest.mark.parametrize("unit", ["layer", "stage"])
def test_accumulation_clipping_and_recomputation_equal_one_device(unit):
    """accumulate_grad_batches=2 (each batch reduce-scatters, the shards add up), gradient_clip_val (the global norm
    counts every shard once) and checkpoint_activations (the recomputed forward runs inside FSDP2's hooks: of each
    layer, or of the stage as one unit), SGD with momentum: equal to one device at twice the batch."""
    trainer = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}
    reference = train({"max_steps": STEPS, "batch_size": 16, "trainer": trainer})
    unclipped = train({"max_steps": STEPS, "batch_size": 16, "trainer": {"accumulate_grad_batches": 2}})
    assert not torch.allclose(unclipped["state"]["model.0.weight"], reference["state"]["model.0.weight"])  # it clips
    code, output, records = launch({
        "devices": 4, "max_steps": STEPS, "batch_size": 8, "stages": 2, "pipelines_in_sampler": 2, "trainer": trainer,
        "strategy": {"schedule": "1f1b", "micro_batches": 4, "pipelines": 2, "data_parallel": "fsdp",
                     "checkpoint_activations": True, "fsdp_unit": unit},
    }, timeout=300)
    assert code == 0, output[-3000:]
    assert_state_equal(reference, records, [[0, 1], [2, 3]])


def test_bf16_mixed_equals_ddp():
    """Lightning's precision plugin composes with sharded stages: "bf16-mixed" (autocast around each stage's step;
    FSDP2 gathers the fp32 parameters, no MixedPrecisionPolicy) trains the stage-unit "fsdp" pipelines exactly as
    "ddp" does at the same precision."""
    runs = {}
    for extra in ({"data_parallel": "ddp"}, {"data_parallel": "fsdp", "fsdp_unit": "stage"}):
        code, output, records = launch({
            "devices": 4, "max_steps": 3, "batch_size": 8, "stages": 2, "pipelines_in_sampler": 2,
            "model": {"optimizer": "adam"}, "trainer": {"precision": "bf16-mixed"},
            "strategy": {"schedule": "1f1b", "micro_batches": 4, "pipelines": 2, **extra},
        }, timeout=300)
        assert code == 0, output[-3000:]
        runs[extra["data_parallel"]] = merged_state(records[:2])
    for key, value in runs["ddp"].items():
        torch.testing.assert_close(runs["fsdp"][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_sharded_checkpoint_resumes(tmp_path):
    """A sharded (DCP) checkpoint of 2 sharded pipelines after one epoch (trunk weights and Adam state written as
    DTensor shards) resumes: the second epoch ends equal to one device trained two epochs at twice the batch, in
    the run itself and in its checkpoint consolidated into one file."""
    from lightning_pipe import consolidate_checkpoint

    common = {"batch_size": 8, "devices": 4, "stages": 2, "pipelines_in_sampler": 2, "model": {"optimizer": "adam"}}
    pipe = {"schedule": "1f1b", "micro_batches": 4, "pipelines": 2, "data_parallel": "fsdp", "save_distributed_checkpoint": True}
    saved, resumed = tmp_path / "epoch1.ckpt", tmp_path / "epoch2.ckpt"
    code, output, _ = launch({**common, "epochs": 1, "strategy": pipe, "ckpt_out": str(saved)}, timeout=300)
    assert code == 0, output[-3000:]
    code, output, records = launch({**common, "epochs": 2, "strategy": pipe, "ckpt_path": str(saved),
                                    "ckpt_out": str(resumed)}, timeout=300)
    assert code == 0, output[-3000:]
    reference = train({"epochs": 2, "batch_size": 16, "model": {"optimizer": "adam"}})
    steps = len(reference["returned"]) // 2
    assert [len(r["returned"]) for r in records] == [steps] * 4  # the second epoch only: it did restore
    assert_state_equal(reference, records, [[0, 1], [2, 3]])
    consolidate_checkpoint(resumed, tmp_path / "one.ckpt")
    state = torch.load(tmp_path / "one.ckpt", weights_only=False)["state_dict"]
    assert state.keys() == reference["state"].keys()
    for key, value in reference["state"].items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)



@pytest.mark.parametrize("first,second", [("ddp", "fsdp"), ("fsdp", "ddp")])
def test_a_checkpoint_resumes_under_the_other_data_parallel(tmp_path, first, second):
    """A sharded (DCP) checkpoint written after one epoch with one data_parallel resumes under the other (whole
    tensors read into DTensor shards, or shards into whole tensors, the Adam state too): the second epoch ends
    equal to one device trained two epochs at twice the batch, as an uninterrupted run does."""
    common = {"batch_size": 8, "devices": 4, "stages": 2, "pipelines_in_sampler": 2, "model": {"optimizer": "adam"}}
    pipe = {"schedule": "1f1b", "micro_batches": 4, "pipelines": 2, "save_distributed_checkpoint": True}
    saved = tmp_path / "epoch1.ckpt"
    code, output, _ = launch({**common, "epochs": 1, "strategy": {**pipe, "data_parallel": first}, "ckpt_out": str(saved)},
                             timeout=300)
    assert code == 0, output[-3000:]
    code, output, records = launch({**common, "epochs": 2, "strategy": {**pipe, "data_parallel": second},
                                    "ckpt_path": str(saved)}, timeout=300)
    assert code == 0, output[-3000:]
    reference = train({"epochs": 2, "batch_size": 16, "model": {"optimizer": "adam"}})
    assert [len(r["returned"]) for r in records] == [len(reference["returned"]) // 2] * 4  # it did restore
    assert_state_equal(reference, records, [[0, 1], [2, 3]])



def test_a_checkpoint_resumes_under_another_mesh_shape(tmp_path):
    """A sharded checkpoint of a (2 pipelines × 2 stages) mesh, written after one epoch, resumes on a (1 × 2) one:
    DCP reads each pair of shards into one rank's whole stage (its units sharded over a one-rank mesh), and the
    second epoch at the same global batch ends equal to one device trained two epochs."""
    model = {"optimizer": "adam"}
    pipe = {"schedule": "1f1b", "micro_batches": 4, "data_parallel": "fsdp", "save_distributed_checkpoint": True}
    saved = tmp_path / "epoch1.ckpt"
    code, output, _ = launch({"devices": 4, "stages": 2, "pipelines_in_sampler": 2, "batch_size": 8, "epochs": 1,
                              "model": model, "strategy": {**pipe, "pipelines": 2}, "ckpt_out": str(saved)}, timeout=300)
    assert code == 0, output[-3000:]
    code, output, records = launch({"devices": 2, "batch_size": 16, "epochs": 2, "model": model, "strategy": pipe,
                                    "ckpt_path": str(saved)}, timeout=300)
    assert code == 0, output[-3000:]
    reference = train({"epochs": 2, "batch_size": 16, "model": model})
    assert [len(r["returned"]) for r in records] == [len(reference["returned"]) // 2] * 2  # it did restore
    assert_state_equal(reference, records, [[0, 1]])


def _interleaved_sharded_step(rank: int, world: int, reshard: str, unit: str, quiet: bool = False) -> dict:
    """One device holding two chunks (interleaved_1f1b, 1 stage × 2 chunks, 4 micro-batches), its four Linear
    layers sharded over ``world`` data-parallel copies (each layer a unit, or each chunk): how many
    reduce-scatters one step makes, and the gradients they leave (gathered whole)."""
    import torch.distributed as dist
    from torch import nn

    from lightning_pipe.engine import Executor, RunOptions, SequentialStage, split_micro_batches
    from lightning_pipe.engine.sharding import ShardedLayers
    from lightning_pipe.registry import build_schedule

    torch.manual_seed(0)
    layers = [nn.Linear(4, 4) for _ in range(4)]
    containers = [nn.Sequential(*layers[:2]), nn.Sequential(*layers[2:])]
    sharded = ShardedLayers(layers, dist.group.WORLD, torch.device("cpu"), reshard, unit, containers)
    chunks = [SequentialStage(containers[0], input_fn=lambda mb: mb),
              SequentialStage(containers[1], loss_fn=lambda out, mb: out.pow(2).sum())]
    executor = Executor(0, [rank], chunks)
    batch = torch.randn(world, 8, 4, generator=torch.Generator().manual_seed(1))
    calls = {"reduce_scatter_single": 0, "all_gather_single": 0}  # FSDP2's collectives (_fsdp_collectives.py)
    originals = {name: getattr(dist, name) for name in calls}

    def counting(name):
        def call(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)
        return call

    for name in calls:
        setattr(dist, name, counting(name))
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    pre_forward = FSDPParamGroup.pre_forward  # FSDP2's per-unit forward hook work
    calls["pre_forward"] = 0

    def counted_pre_forward(self, *args, **kwargs):
        calls["pre_forward"] += 1
        return pre_forward(self, *args, **kwargs)

    FSDPParamGroup.pre_forward = counted_pre_forward
    try:
        wrappers = RunOptions(chunk_last_backward=sharded.reducing, chunk_early_forward=sharded.early_forward if quiet else None)
        executor.run(build_schedule("interleaved_1f1b", 1, 4, 2), split_micro_batches(batch[rank], 4), wrappers)
    finally:
        FSDPParamGroup.pre_forward = pre_forward
        for name, original in originals.items():
            setattr(dist, name, original)
    return {**calls, "batch": batch, "grads": [p.grad.full_tensor() for layer in layers for p in layer.parameters()]}


@pytest.mark.parametrize("reshard,unit,quiet,units,gathers,hooked", [
    ("step", "layer", False, 4, 4, 4 * 4), ("micro_batch", "layer", False, 4, 4 * 4 * 2, 4 * 4),
    ("step", "stage", False, 2, 2, 2 * 4),
    # forwards whose backward is not their chunk's last run without FSDP2's hooks: one hooked forward per unit
    ("step", "layer", True, 4, 4, 4), ("step", "stage", True, 2, 2, 2),
    ("micro_batch", "layer", True, 4, 4 * 4 * 2, 4 * 4),  # every forward gathers: no quiet forwards
])
def test_each_unit_reduce_scatters_once_per_step(reshard, unit, quiet, units, gathers, hooked):
    """interleaved_1f1b on one device with 2 chunks, 4 micro-batches, 2 copies of 4 sharded layers: one
    reduce-scatter per unit (a layer, or a chunk of two) in the step (in its chunk's last backward); one
    all-gather per unit per step (reshard="step") or one per forward and per backward ("micro_batch"); FSDP2's
    forward hooks on every forward, or (``early_forward``) on the one whose backward reduce-scatters; the
    gradients equal the mean over both copies' micro-batches."""
    from torch import nn

    from lightning_pipe.engine import sharding
    from tests.harness.distributed import run_workers, values

    assert sharding._QUIET is not None, "this PyTorch's FSDP2 has no quiet forward path: every forward runs the hooks"
    results = values(run_workers(_interleaved_sharded_step, 2, reshard, unit, quiet, timeout=120))
    assert [r["reduce_scatter_single"] for r in results] == [units, units]
    assert [r["all_gather_single"] for r in results] == [gathers, gathers]
    assert [r["pre_forward"] for r in results] == [hooked, hooked]
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    batch = results[0]["batch"]
    (layers(batch.reshape(-1, 4)).pow(2).sum() / (4 * 2)).backward()  # 4 micro-batches, 2 copies: their mean
    for got, want in zip(results[0]["grads"], [p.grad for p in layers.parameters()]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _pipeline_mesh(rank: int, world: int) -> dict:
    """The ("dp", "pp") mesh made from a 2 × 2 topology's groups, beside the one ``init_device_mesh`` makes."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_pipe.engine.sharding import pipeline_mesh
    from lightning_pipe.engine.topology import Topology

    topology = Topology(2, 2, rank)
    topology.create_groups()
    cpu = torch.device("cpu")
    mesh = pipeline_mesh(topology.stage_group, topology.pipeline_group, 2, 2, rank, cpu)
    reference = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    try:
        pipeline_mesh(topology.pipeline_group, topology.stage_group, 2, 2, rank, cpu)  # the groups swapped
        error = None
    except RuntimeError as e:
        error = str(e)
    ranks = {name: (dist.get_process_group_ranks(mesh[name].get_group()),
                    dist.get_process_group_ranks(reference[name].get_group())) for name in ("dp", "pp")}
    return {"layout": (mesh.mesh.tolist(), reference.mesh.tolist()), "ranks": ranks, "error": error,
            "reuses": mesh["dp"].get_group() is topology.stage_group and mesh["pp"].get_group() is topology.pipeline_group}


def test_the_mesh_is_init_device_meshs_made_from_the_topology_groups():
    """2 stages × 2 pipelines on gloo: the mesh "fsdp" shards over has init_device_mesh's layout and dimensions,
    its "dp" and "pp" are the topology's stage and pipeline groups (no new group), and groups that do not match
    the layout are refused naming both."""
    from tests.harness.distributed import run_workers, values

    for rank, result in enumerate(values(run_workers(_pipeline_mesh, 4, timeout=120))):
        assert result["layout"] == ([[0, 1], [2, 3]], [[0, 1], [2, 3]])
        for mine, reference in result["ranks"].values():
            assert mine == reference
        assert result["reuses"]
        assert "the topology and the mesh number ranks differently" in result["error"], result["error"]


@pytest.mark.parametrize("unit", ["layer", "stage"])
def test_configure_model_on_the_meta_device_equals_one_device(unit):
    """Layers built in configure_model (meta device): each rank materializes its stage a unit at a time, sharding
    each as soon as it is initialised, and training equals one device at twice the batch."""
    model = {"optimizer": "adam", "configure": True}
    reference = train({"max_steps": STEPS, "batch_size": 16, "model": model})
    code, output, records = launch({
        "devices": 4, "max_steps": STEPS, "batch_size": 8, "stages": 2, "pipelines_in_sampler": 2, "model": model,
        "strategy": {"schedule": "1f1b", "micro_batches": 4, "pipelines": 2, "data_parallel": "fsdp", "fsdp_unit": unit},
    }, timeout=300)
    assert code == 0, output[-3000:]
    assert_state_equal(reference, records, [[0, 1], [2, 3]])


def _materialized_a_layer_at_a_time(rank: int, world: int) -> dict:
    """Four Linear layers built on the meta device, materialized with a deferred ShardedLayers: how many whole
    (unsharded) parameters exist each time a layer is sharded, and the layers' values gathered whole."""
    import torch.distributed as dist
    from torch import nn

    from lightning_pipe.engine.sharding import ShardedLayers, is_sharded
    from lightning_pipe.partition.materialize import MetaConstruction, materialize

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layers = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])

    with MetaConstruction() as construction:
        stage = Stage()
    layers = list(stage.layers)
    sharding = ShardedLayers(layers, dist.group.WORLD, torch.device("cpu"), deferred=True)
    whole_when_initialised = []  # whole layer weights alive as each module is done, before it is sharded

    def initialised(module):
        import gc

        gc.collect()
        whole_when_initialised.append(sum(1 for obj in gc.get_objects() if isinstance(obj, nn.Parameter)
                                          and obj.shape == (8, 8) and not obj.is_meta and not is_sharded(obj)))
        return sharding.shard_initialised(module)

    materialize(stage, construction, None, initialised)
    sharding.shard_pending()
    return {"whole": whole_when_initialised, "pending": len(sharding.pending), "units": len(sharding.units),
            "weights": [layer.weight.full_tensor() for layer in layers]}


def test_a_meta_stage_is_sharded_a_layer_at_a_time():
    """No rank holds more than one layer whole while its stage is materialized (not the whole stage), and the
    shards hold exactly the weights building the layers on one CPU gives."""
    from torch import nn

    from tests.harness.distributed import run_workers, values

    results = values(run_workers(_materialized_a_layer_at_a_time, 2, timeout=120))
    torch.manual_seed(0)
    reference = [nn.Linear(8, 8) for _ in range(4)]
    for result in results:
        assert result["units"] == 4 and result["pending"] == 0
        # as each Linear is done, its own weight is the only whole one: the layers before it were sharded and
        # their whole weights freed
        assert result["whole"] == [1, 1, 1, 1]
        for got, want in zip(result["weights"], reference):
            torch.testing.assert_close(got, want.weight, rtol=0, atol=0)
