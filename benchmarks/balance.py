"""Measured training throughput of ``balance="auto"`` vs ``balance="uniform"`` on an unbalanced model.

    python benchmarks/balance.py                     # 5 rounds, 20 steps each, 2 processes
    python benchmarks/balance.py --rounds 1 --steps 10

The trunk of :class:`UnbalancedMLP` has 12 layers of very different widths: three wide Linear
layers (1024 features) then narrow ones (64), so an equal layer count per stage puts nearly all the
work on stage 0. Each variant is a 2-process Lightning run (gloo on CPU, one thread per process,
``schedule="1f1b"``, 8 micro-batches of 32 samples) started as its own script invocation (Lightning's
launcher re-executes ``sys.argv``); the variants alternate round by round so machine noise hits both.
Rank 0 times the training steps after a warm-up and reports samples/s and the cores other processes
used meanwhile (``/proc/stat`` minus both ranks' CPU time); before each run the script waits up to
``--quiet-wait`` seconds for the machine to go idle. The table shows every round; medians and ratios
use the rounds whose other load stayed below ``--max-other-load`` cores (all rounds if none did), and the split
``balance="auto"`` chose with its predicted per-stage times (it profiles rank 0's device at setup, cached in a
temporary file, so only the first auto round profiles).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

try:
    import lightning_pipe
except ModuleNotFoundError:  # a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import lightning_pipe

WIDTHS = (64, 1024, 1024, 1024, 64, 64, 64)  # Linear i maps WIDTHS[i] -> WIDTHS[i + 1]


class UnbalancedMLP(L.LightningModule):
    """Regression MLP whose trunk layers differ in width by 16x (12 layers: 6 Linear + 6 ReLU).

    Args:
        widths: feature sizes; Linear ``i`` maps ``widths[i]`` to ``widths[i + 1]``, each followed by ReLU.
        lr: SGD learning rate.
    """

    def __init__(self, widths: tuple[int, ...] = WIDTHS, lr: float = 0.01) -> None:
        super().__init__()
        self.lr = lr
        layers: list[nn.Module] = []
        for a, b in zip(widths, widths[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.trunk = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.trunk(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def machine_busy_seconds() -> float:
    """CPU seconds every process of the machine has used so far (``/proc/stat``; nan elsewhere)."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in f.readline().split()[1:9])
    except (OSError, ValueError):
        return math.nan
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class StepClock(L.Callback):
    """Times the steps after the warm-up on every rank: wall seconds, own CPU seconds and the machine's
    busy CPU seconds, so rank 0 can tell how many cores other processes used meanwhile."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start = (0.0, 0.0, 0.0)
        self.end = (0.0, 0.0, 0.0)
        self.timed = 0
        self.other_load = math.nan

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):  # noqa: ANN001
        now = (time.perf_counter(), time.process_time(), machine_busy_seconds())
        if batch_idx + 1 == self.warmup:
            self.start = now
        elif batch_idx + 1 > self.warmup:
            self.end, self.timed = now, self.timed + 1

    def on_train_end(self, trainer, module):  # noqa: ANN001
        own = [0.0] * trainer.world_size
        torch.distributed.all_gather_object(own, self.end[1] - self.start[1])
        seconds = self.end[0] - self.start[0]
        self.other_load = max(0.0, (self.end[2] - self.start[2] - sum(own)) / seconds)


def wait_until_quiet(max_wait: float, threshold: float) -> float:
    """Wait (up to ``max_wait`` s) until other processes use less than ``threshold`` cores over 2 s."""
    deadline = time.monotonic() + max_wait
    while True:
        before = machine_busy_seconds()
        time.sleep(2.0)
        load = (machine_busy_seconds() - before) / 2.0
        if not load >= threshold or time.monotonic() >= deadline:
            return load


def worker(args: argparse.Namespace) -> None:
    """One Lightning run (both ranks execute this); rank 0 writes its measurement to ``args.out``."""
    torch.manual_seed(0)
    batch = args.micro_batches * args.micro_batch_size
    samples = batch * (args.steps + args.warmup)
    x = torch.randn(samples, WIDTHS[0])
    data = TensorDataset(x, torch.randn(samples, WIDTHS[-1]))
    strategy = lightning_pipe.PipeStrategy(
        schedule="1f1b", micro_batches=args.micro_batches, balance=args.balance, profile_cache=args.cache,
        auto_balance_refine=args.refine,
    )
    clock = StepClock(args.warmup)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[clock],
    )
    trainer.fit(UnbalancedMLP(), DataLoader(data, batch_size=batch))
    if trainer.is_global_zero:
        plan = strategy.plan
        result = {
            "balance": args.balance,
            "counts": strategy.layer_counts,
            "samples_per_s": clock.timed * batch / (clock.end[0] - clock.start[0]),
            "other_load": clock.other_load,
            "predicted_stage_ms": [s.time * 1e3 for s in plan.stages] if plan else None,
            "measured_stage_ms": [t * 1e3 for t in strategy._measured] if strategy._measured else None,
            "predicted_step_ms": plan.step_time * 1e3 if plan else None,
            "predicted_uniform_step_ms": predicted_uniform_ms(args, strategy) if plan else None,
        }
        Path(args.out).write_text(json.dumps(result))


def predicted_uniform_ms(args: argparse.Namespace, strategy: lightning_pipe.PipeStrategy) -> float:
    """The planner's prediction for balance="uniform" from the profile balance="auto" cached."""
    from lightning_pipe.partition import resolve_balance
    from lightning_pipe.planning.planner import evaluate
    from lightning_pipe.planning.profile import Profile

    (entry,) = json.loads(Path(args.cache).read_text()).values()
    counts = resolve_balance("uniform", UnbalancedMLP().trunk, 2)
    return evaluate(Profile.from_json(entry), "1f1b", 2, args.micro_batches, counts).step_time * 1e3


def run_variant(args: argparse.Namespace, balance: str, cache: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        command = [sys.executable, os.path.abspath(__file__), "--worker", "--balance", balance, "--out", out,
                   "--cache", cache, "--steps", str(args.steps), "--warmup", str(args.warmup), "--refine", str(args.refine),
                   "--micro-batches", str(args.micro_batches), "--micro-batch-size", str(args.micro_batch_size)]
        with socket.socket() as probe:  # our own rendezvous port: Lightning's pick races with other jobs
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # hung gloo ranks ignore SIGTERM
            raise SystemExit(f"balance={balance!r} run timed out after {args.timeout} s")
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.returncode != 0 or not os.path.exists(out):
            raise SystemExit(f"balance={balance!r} run failed:\n{output[-3000:]}")
        return json.loads(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds; each runs both variants")
    parser.add_argument("--steps", type=int, default=20, help="timed training steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--refine", type=int, default=2,
                        help="balance='auto' refinement moves from measured stage times (auto_balance_refine; 0: none)")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run before it is killed")
    parser.add_argument("--quiet-wait", type=float, default=60.0,
                        help="before each run wait up to this many seconds for other processes to go idle")
    parser.add_argument("--max-other-load", type=float, default=0.3,
                        help="rounds in which other processes used more cores than this are left out of the medians")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--balance", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    results: dict[str, list[dict]] = {"uniform": [], "auto": []}
    with tempfile.TemporaryDirectory() as tmp:
        cache = os.path.join(tmp, "profiles.json")
        for round_ in range(args.rounds):
            order = ("uniform", "auto") if round_ % 2 == 0 else ("auto", "uniform")
            for balance in order:
                if args.quiet_wait > 0:
                    wait_until_quiet(args.quiet_wait, 0.15)
                results[balance].append(run_variant(args, balance, cache))
    batch = args.micro_batches * args.micro_batch_size
    print(f"UnbalancedMLP widths {WIDTHS}, 2 stages x 2 processes (gloo, 1 thread each), 1f1b, "
          f"{args.micro_batches} micro-batches x {args.micro_batch_size} = batch {batch}, {args.steps} timed steps per run\n")
    rounds = list(zip(results["uniform"], results["auto"]))
    quiet = [i for i, pair in enumerate(rounds) if all(r["other_load"] <= args.max_other_load for r in pair)]
    used, note = (quiet, f"{len(quiet)} of {len(rounds)} rounds with other load <= {args.max_other_load} cores")
    if not quiet:
        used, note = list(range(len(rounds))), f"all {len(rounds)} rounds (none was quiet)"
    print("| round | uniform samples/s | auto samples/s | auto / uniform | auto split (measured ms per micro-batch) | "
          "other load (cores) uniform / auto |")
    print("|---|---|---|---|---|---|")
    for i, (u, a) in enumerate(rounds):
        mark = "" if i in used else " (left out)"
        measured = f" ({', '.join(f'{t:.2f}' for t in a['measured_stage_ms'])})" if a["measured_stage_ms"] else ""
        print(f"| {i + 1}{mark} | {u['samples_per_s']:.0f} | {a['samples_per_s']:.0f} | "
              f"{a['samples_per_s'] / u['samples_per_s']:.2f} | {a['counts']}{measured} | "
              f"{u['other_load']:.2f} / {a['other_load']:.2f} |")
    medians = {name: statistics.median(results[name][i]["samples_per_s"] for i in used) for name in results}
    ratios = [rounds[i][1]["samples_per_s"] / rounds[i][0]["samples_per_s"] for i in used]
    print(f"\nsplits: uniform {results['uniform'][0]['counts']}, auto (planned, then refined {args.refine} moves at most) "
          f"{sorted({str(r['counts']) for r in results['auto']})}")
    print(f"medians over {note}: uniform {medians['uniform']:.0f}, auto {medians['auto']:.0f} samples/s; "
          f"auto / uniform: median of per-round ratios {statistics.median(ratios):.2f}x, "
          f"ratio of medians {medians['auto'] / medians['uniform']:.2f}x")
    auto = results["auto"][0]
    predicted = [round(t, 3) for t in auto["predicted_stage_ms"]]
    print(f"auto's predicted stage times of the first round's split (ms per micro-batch): {predicted}; "
          f"predicted step {auto['predicted_step_ms']:.1f} ms vs {auto['predicted_uniform_step_ms']:.1f} ms for uniform "
          f"(predicted auto / uniform {auto['predicted_uniform_step_ms'] / auto['predicted_step_ms']:.2f}x, both from rank 0's "
          "profile taken at the first auto run's setup)")


if __name__ == "__main__":
    main()
