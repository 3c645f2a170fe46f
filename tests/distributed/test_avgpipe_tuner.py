"""The avgpipe tuner on synthetic profiles: fits, memory check, simulated prediction, tie rules."""

from __future__ import annotations

import torch
from torch import nn

from lightning_pipe.engine import Transport, Watchdog
from lightning_pipe.planning.avgpipe_trials import TrialStage, measure_candidates
from tests.harness.distributed import run_workers, values
from tests.unit.test_avgpipe_tuner import _candidate


def _trial_worker(rank: int, world_size: int) -> tuple[list[list[float]], bool]:
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
    layers = trunk[:2] if rank == 0 else trunk[2:]
    before = [p.detach().clone() for p in layers.parameters()]
    trial = TrialStage(layers, rank, 2, [0, 1], Transport(torch.device("cpu")), Watchdog.from_process_group(60.0),
                       lambda ps: torch.optim.Adam(ps, lr=0.1), torch.randn(8, 8) if rank == 0 else None,
                       torch.device("cpu"))
    times = measure_candidates(trial, [_candidate(1, 2), _candidate(2, 2, advance=1)], windows=2, rounds=1, warmup=1)
    return times, all(torch.equal(a, b) for a, b in zip(before, layers.parameters()))


def test_trials_run_candidates_on_two_processes_without_touching_the_stage():
    """Trials: each candidate runs real rounds (executor, transport, avgpipe policy, the optimizer
    class) on copies of the stage in every window; the stage itself is unchanged."""
    for times, unchanged in values(run_workers(_trial_worker, 2, timeout=120)):
        assert len(times) == 2 and all(len(t) == 2 and all(x > 0 for x in t) for t in times)
        assert unchanged

