"""The asynchronous workloads the emulation tests share, so the one-process tests (tests/unit), the
multi-process ones (tests/distributed) and the one-GPU ones (tests/gpu) check the same computation against
:class:`~tests.reference.async_reference.AsyncEmulator`:

* :func:`emulated`: the suite's :class:`~tests.harness.lightning_run.TrunkModel` trained by the strategy's
  one-device emulation;
* :func:`reference`: the reference's run of the same model, cut the same way, on the same batches.

Nothing here imports jsonargparse or hypothesis (the GPU machine lacks them).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_pipe.engine import split_micro_batches
from lightning_pipe.engine.policies import AsyncOptions, PipeMareOptions
from lightning_pipe.partition import resolve_balance, stage_bounds
from tests.harness.lightning_run import TrunkModel, make_data, train
from tests.reference.async_reference import AsyncEmulator

EPOCHS, BATCH = 2, 16
OPTIONS = {"pipemare": {"lr_warmup_steps": 5}}


def reference_stages(model: TrunkModel, stages: int) -> list[nn.Module]:
    """The module cut like the strategy cuts it: code before the trunk on stage 0, the head on the last."""
    bounds = stage_bounds(resolve_balance("uniform", model.model, stages))
    parts = [list(model.model[a:b]) for a, b in bounds]
    parts[0] = [model.pre, nn.ReLU(), *parts[0]]
    parts[-1] = [*parts[-1], model.head]
    return [nn.Sequential(*p) for p in parts]


def stage_optimizers(model: TrunkModel, optimizer: torch.optim.SGD, stages: int) -> list[torch.optim.SGD]:
    """Each reference stage's optimizer, continuing from the state ``optimizer`` (over the whole model)
    holds for that stage's parameters: how the strategy hands over after a synchronous warm-up."""
    optimizers = []
    for module in reference_stages(model, stages):
        stage = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
        for p in module.parameters():
            stage.state[p] = optimizer.state[p]
        optimizers.append(stage)
    return optimizers


def emulator_for(model: TrunkModel, schedule: str, stages: int, micro: int, clip: float | None, interval: str | None,
                 optimizers: list | None = None, options: AsyncOptions | None = None, autocast: torch.dtype | None = None):
    """The reference of ``model`` cut into ``stages``, SGD with momentum per stage unless ``optimizers``, and
    StepLR schedulers when ``interval`` names one (handed to the reference for ``"step"``)."""
    modules = reference_stages(model, stages)
    optimizers = optimizers or [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in modules]
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in optimizers] if interval else []
    emulator = AsyncEmulator(schedule, modules, optimizers, micro, lambda mb: mb[0],
                             lambda out, mb: nn.functional.cross_entropy(out, mb[1]),
                             options or AsyncOptions(PipeMareOptions(**OPTIONS["pipemare"])),
                             schedulers if interval == "step" else None, clip_val=clip, autocast=autocast)
    return emulator, schedulers


def run_epochs(emulator, schedulers, interval, micro: int, epochs: int, samples: int = 96,
               device: str = "cpu") -> list[float]:
    """The reference's losses over ``epochs`` of :func:`~tests.harness.lightning_run.make_data`, in batches of
    ``BATCH`` (a short last batch as the strategy splits it), stepping epoch-interval schedulers."""
    x, y = (t.to(device) for t in make_data(samples).tensors)
    losses = []
    for _ in range(epochs):
        for start in range(0, len(x), BATCH):
            batch = (x[start:start + BATCH], y[start:start + BATCH])
            n = len(batch[1])
            parts = split_micro_batches(batch, min(micro, n))  # a short last batch: one sample per micro-batch
            losses.append(sum(loss * len(p[1]) / n for loss, p in zip(emulator.train_window(parts, [len(p[1]) / n for p in parts]), parts)))
        emulator.drain()
        if interval == "epoch":
            for scheduler in schedulers:
                scheduler.step()
    return losses


def reference(schedule: str, stages: int, micro: int, clip: float | None, interval: str | None,
              samples: int = 96, autocast: torch.dtype | None = None, device: str = "cpu",
              **model_options: Any) -> tuple[list[float], dict]:
    """The reference's losses per step and final state over ``EPOCHS`` of the suite's model (``TrunkModel(**model_options)``),
    on ``device``."""
    model = TrunkModel(scheduler=interval or False, **model_options).to(device)
    emulator, schedulers = emulator_for(model, schedule, stages, micro, clip, interval, autocast=autocast)
    return run_epochs(emulator, schedulers, interval, micro, EPOCHS, samples, device), model.state_dict()


def emulated(schedule: str, stages: int, micro: int, **config) -> dict:
    """The strategy's one-device emulation of ``stages`` stages, trained by the harness (``config`` as
    :func:`~tests.harness.lightning_run.train` reads it, ``accelerator`` included)."""
    groups = {name: value for name, value in OPTIONS.items() if name == schedule}  # a group the schedule reads
    strategy = {"schedule": schedule, "micro_batches": micro, "stages": stages, **groups, **config.pop("strategy", {})}
    return train({"devices": 1, "epochs": EPOCHS, "batch_size": BATCH, "strategy": strategy,
                  "trainer": {"log_every_n_steps": 1, **config.pop("trainer", {})}, **config})


def reference_from_checkpoint(schedule: str, stages: int, ckpt: str) -> tuple[AsyncEmulator, TrunkModel]:
    """The literal reference of a ``stages``-stage pipeline that starts where the checkpoint ends: its
    weights, optimizer state (by parameter name), step counts and policy state (pipemare's velocity).
    Its stages are the returned model's own layers, so the model holds the reference's weights."""
    saved = torch.load(ckpt, weights_only=False)
    model = TrunkModel()
    model.load_state_dict(saved["state_dict"])
    modules = reference_stages(model, stages)
    full_name = {id(p): n for n, p in model.named_parameters()}
    optimizer_state = saved["optimizer_states"][0]
    index_of = {n: i for i, n in enumerate(optimizer_state["pipe_param_names"])}
    optimizers = []
    for module in modules:
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
        for p in module.parameters():
            optimizer.state[p] = {k: v.clone() for k, v in optimizer_state["state"][index_of[full_name[id(p)]]].items()}
        optimizers.append(optimizer)
    emulator, _ = emulator_for(model, schedule, stages, 2, None, None, optimizers=optimizers)
    state = saved["pipe_async_state"]
    emulator._windows_before_segment = state["batches_before_segment"]
    for st in emulator._stages:
        st.steps = state["steps"]
        if st.delta is not None:
            st.delta = {name: state["delta"][full_name[id(p)]].clone() for name, p in st.module.named_parameters()}
    return emulator, model
