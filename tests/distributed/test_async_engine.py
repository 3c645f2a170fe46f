"""Asynchronous schedules on gloo processes equal the literal one-process reference, step by step.

One spawn per pipeline depth runs every (schedule, M, optimizer) case, to keep process start-ups few.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
from torch import nn

from lightning_pipe.engine import Executor, RunOptions, SequentialStage, Transport, Watchdog, split_micro_batches
from lightning_pipe.engine.policies import AsyncOptions, DoubleBufferOptions, PipeDreamOptions, PipeMareOptions, XPipeOptions
from lightning_pipe.partition import resolve_balance, stage_bounds
from lightning_pipe.registry import SCHEDULES, names
from lightning_pipe.schedules import async_schedule
from tests.harness.distributed import run_workers, values
from tests.harness.lightning_run import muon_with_adam
from tests.reference.async_reference import AsyncEmulator

SEGMENTS = (3, 2)  # windows per segment: a drain after 3 Lightning steps, then 2 more and a drain
OPTIONS = AsyncOptions(PipeMareOptions(lr_warmup_steps=4))  # T1 still rescheduling during the test


#: a case's option variant: the papers' rules, 2BW's look-ahead, xpipe's exact distances and SpecTrain's
#: direction, pipemare's single decay for every stage, pipedream's vertical sync, the delay-scaled warm-up
VARIANTS = {
    "paper": {"pipedream_2bw": DoubleBufferOptions(lookahead=0.0)},
    "lookahead": {"pipedream_2bw": DoubleBufferOptions(lookahead=1.0)},
    "exact": {"pipedream_2bw": DoubleBufferOptions(lookahead=0.0), "xpipe": XPipeOptions(distances="exact")},
    "spectrain": {"pipedream_2bw": DoubleBufferOptions(lookahead=0.0), "xpipe": XPipeOptions(momentum_direction="spectrain")},
    "vertical_sync": {"pipedream_2bw": DoubleBufferOptions(lookahead=0.0), "pipedream": PipeDreamOptions(vertical_sync=True)},
    "fixed_decay": {"pipedream_2bw": DoubleBufferOptions(lookahead=0.0),
                    "pipemare": replace(OPTIONS.pipemare, correction_decay_rule="fixed")},
    "delay_warmup": {"pipedream_2bw": DoubleBufferOptions(lookahead=0.0), "delay_warmup_steps": 2},
}


def options(variant: str) -> AsyncOptions:
    return replace(OPTIONS, **VARIANTS[variant])


def make_trunk(stages: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(2 * stages) for m in (nn.Linear(6, 6), nn.Tanh())])


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "muon":
        return muon_with_adam(params)
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.02)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def batches(micro_batches: int) -> list:
    g = torch.Generator().manual_seed(micro_batches)
    return [(torch.randn(2 * micro_batches, 6, generator=g), torch.randn(2 * micro_batches, 6, generator=g))
            for _ in range(sum(SEGMENTS))]


def loss_fn(output, micro_batch):
    return nn.functional.mse_loss(output, micro_batch[1])


def stage_modules(trunk: nn.Sequential, stages: int) -> list[nn.Sequential]:
    return [trunk[a:b] for a, b in stage_bounds(resolve_balance("uniform", trunk, stages))]


#: (schedule, M, optimizer, option variant)
CASES = [(*c, "paper") for c in itertools.product(names("asynchronous"), (1, 2, 4), ("sgd", "adam", "muon"))]
CASES += [("pipedream_2bw", 4, kind, "lookahead") for kind in ("adam", "muon")]
CASES += [("xpipe", 4, kind, "exact") for kind in ("sgd", "adam")] + [("xpipe", 2, "sgd", "spectrain")]
CASES += [("pipemare", 1, "adam", "fixed_decay")]  # M = 1: stage 0 of 4 is 3 STEPs stale
CASES += [("pipedream", m, "adam", "vertical_sync") for m in (1, 2)]
CASES += [("pipedream", 1, "adam", "delay_warmup"), ("pipedream_2bw", 4, "sgd", "delay_warmup")]


def distributed(rank: int, world: int) -> dict:
    """Every case on this rank: losses of the last stage and final weights of this stage."""
    out = {}
    for name, micro_batches, optimizer_kind, variant in CASES:
        if name == "pipedream_2bw" and micro_batches < world:
            continue
        module = stage_modules(make_trunk(world), world)[rank]
        optimizer = make_optimizer(optimizer_kind, module.parameters())
        policy = SCHEDULES[name].policy(module, optimizer, rank, world, micro_batches, options(variant))
        stage = SequentialStage(module, input_fn=(lambda mb: mb[0]) if rank == 0 else None,
                                loss_fn=loss_fn if rank == world - 1 else None)
        executor = Executor(rank, list(range(world)), [stage], Transport(torch.device("cpu")),
                            Watchdog.from_process_group(60.0), policy=policy)
        losses, data, t = [], batches(micro_batches), 0
        for windows in SEGMENTS:
            for window in range(windows):
                mbs = split_micro_batches(data[t], micro_batches)
                t += 1
                got = executor.run(async_schedule(name, world, micro_batches, window), mbs,
                                   RunOptions(first_micro_batch=window * micro_batches, carry_over=True))
                losses += [float(x) for x in got]
            executor.run(async_schedule(name, world, micro_batches, None, windows), [], RunOptions(carry_over=True))
            executor.finish()
            policy.end_segment(windows)
        out[(name, micro_batches, optimizer_kind, variant)] = {
            "losses": losses, "state": {k: v.clone() for k, v in module.state_dict().items()},
            "steps": policy.steps, "copies": policy.max_copies,
        }
    return out


def reference(world: int, name: str, micro_batches: int, optimizer_kind: str,
              variant: str) -> tuple[list[float], list[dict], AsyncEmulator]:
    modules = stage_modules(make_trunk(world), world)
    optimizers = [make_optimizer(optimizer_kind, m.parameters()) for m in modules]
    emulator = AsyncEmulator(name, modules, optimizers, micro_batches, lambda mb: mb[0], loss_fn, options(variant))
    losses, data, t = [], batches(micro_batches), 0
    for windows in SEGMENTS:
        for _ in range(windows):
            losses += emulator.train_window(split_micro_batches(data[t], micro_batches))
            t += 1
        emulator.drain()
    return losses, [m.state_dict() for m in modules], emulator


@pytest.mark.parametrize("world", [2, 4])
def test_distributed_equals_reference(world):
    ranks = values(run_workers(distributed, world, timeout=300))
    checked = 0
    for case in CASES:
        name, micro_batches, optimizer_kind, variant = case
        if case not in ranks[0]:
            continue
        want_losses, want_states, emulator = reference(world, name, micro_batches, optimizer_kind, variant)
        got = ranks[-1][case]
        assert got["losses"] == pytest.approx(want_losses, rel=1e-5, abs=1e-7), case
        for rank in range(world):
            for key, value in want_states[rank].items():
                torch.testing.assert_close(ranks[rank][case]["state"][key], value, rtol=1e-5, atol=1e-6,
                                           msg=f"{case} stage {rank} {key}")
            assert ranks[rank][case]["steps"] == sum(SEGMENTS) == emulator.step_counts[rank]
            bound = copy_bound(name, rank, world, micro_batches) + (variant == "lookahead")  # the last update
            if variant == "vertical_sync":  # the versions between stage 0's and its own, and one STEP's new one
                bound += -(-rank // micro_batches) + 1
            assert ranks[rank][case]["copies"] <= bound, (case, rank)
        checked += 1
    assert checked == sum(case in ranks[0] for case in CASES) > 0


def copy_bound(name: str, stage: int, stages: int, micro_batches: int) -> int:
    """Weight copies beyond the module's parameters, docs/algorithms.md §11."""
    warmup = stages - 1 - stage
    return {
        "pipedream": -(-warmup // micro_batches) + 1,  # tau_bar + 1 stashed versions
        "pipedream_2bw": 2,
        "pipemare": 1 + OPTIONS.pipemare.correction,  # masters (+ velocity)
        "xpipe": 3,  # masters + forward and backward predictions
    }[name]
