"""Measured training throughput of ``balance="auto"`` vs ``balance="uniform"`` on an unbalanced model.

    python benchmarks/balance.py                     # 5 rounds, 20 steps each, 2 processes
    python benchmarks/balance.py --rounds 1 --steps 10

The trunk of :class:`UnbalancedMLP` has 12 layers of very different widths: three wide Linear
layers (1024 features) then narrow ones (64), so an equal layer count per stage puts nearly all the
work on stage 0. Each variant is a 2-process Lightning run (gloo on CPU, one thread per process,
``schedule="1f1b"``, 8 micro-batches of 32 samples) started as its own script invocation (Lightning's
launcher re-executes ``sys.argv``); the variants alternate round by round so machine noise hits both.
Rank 0 times the training steps after a warm-up and reports samples/s; the table shows every round,
the median per variant, the per-round ratios and their median, and the split ``balance="auto"`` chose with its predicted
per-stage times (it profiles rank 0's device at setup, cached in a temporary file, so only the
first auto round profiles).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
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


class StepClock(L.Callback):
    """Rank 0: seconds from the end of the warm-up steps to the end of the last step."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start = 0.0
        self.end = 0.0
        self.timed = 0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):  # noqa: ANN001
        now = time.perf_counter()
        if batch_idx + 1 == self.warmup:
            self.start = now
        elif batch_idx + 1 > self.warmup:
            self.end, self.timed = now, self.timed + 1


def worker(args: argparse.Namespace) -> None:
    """One Lightning run (both ranks execute this); rank 0 writes its measurement to ``args.out``."""
    torch.manual_seed(0)
    batch = args.micro_batches * args.micro_batch_size
    samples = batch * (args.steps + args.warmup)
    x = torch.randn(samples, WIDTHS[0])
    data = TensorDataset(x, torch.randn(samples, WIDTHS[-1]))
    strategy = lightning_pipe.PipeStrategy(
        schedule="1f1b", micro_batches=args.micro_batches, balance=args.balance, profile_cache=args.cache,
    )
    clock = StepClock(args.warmup)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[clock],
    )
    trainer.fit(UnbalancedMLP(), DataLoader(data, batch_size=batch))
    if trainer.is_global_zero:
        plan = strategy._plan
        result = {
            "balance": args.balance,
            "counts": strategy._counts,
            "samples_per_s": clock.timed * batch / (clock.end - clock.start),
            "predicted_stage_ms": [s.time * 1e3 for s in plan.stages] if plan else None,
            "predicted_step_ms": plan.step_time * 1e3 if plan else None,
        }
        Path(args.out).write_text(json.dumps(result))


def run_variant(args: argparse.Namespace, balance: str, cache: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        command = [sys.executable, os.path.abspath(__file__), "--worker", "--balance", balance, "--out", out,
                   "--cache", cache, "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--micro-batches", str(args.micro_batches), "--micro-batch-size", str(args.micro_batch_size)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
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
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run before it is killed")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--balance", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    load_before = os.getloadavg()[0]
    results: dict[str, list[dict]] = {"uniform": [], "auto": []}
    with tempfile.TemporaryDirectory() as tmp:
        cache = os.path.join(tmp, "profiles.json")
        for round_ in range(args.rounds):
            order = ("uniform", "auto") if round_ % 2 == 0 else ("auto", "uniform")
            for balance in order:
                results[balance].append(run_variant(args, balance, cache))
    batch = args.micro_batches * args.micro_batch_size
    print(f"UnbalancedMLP widths {WIDTHS}, 2 stages x 2 processes (gloo, 1 thread each), 1f1b, "
          f"{args.micro_batches} micro-batches x {args.micro_batch_size} = batch {batch}, {args.steps} timed steps per run\n")
    print("| balance | split | samples/s per round | median samples/s |")
    print("|---|---|---|---|")
    medians = {}
    for balance, runs in results.items():
        medians[balance] = statistics.median(r["samples_per_s"] for r in runs)
        rounds = ", ".join(f"{r['samples_per_s']:.0f}" for r in runs)
        print(f"| {balance} | {runs[0]['counts']} | {rounds} | {medians[balance]:.0f} |")
    auto = results["auto"][0]
    ratios = [a["samples_per_s"] / u["samples_per_s"] for a, u in zip(results["auto"], results["uniform"])]
    print(f"\nauto / uniform per round (same round, back to back): {', '.join(f'{r:.2f}' for r in ratios)}; "
          f"median {statistics.median(ratios):.2f}x")
    print(f"ratio of the medians: {medians['auto'] / medians['uniform']:.2f}x")
    print(f"load average (1 min) before / after: {load_before:.2f} / {os.getloadavg()[0]:.2f} "
          "(this benchmark alone keeps about 2 busy; more means other processes shared the 2 cores)")
    print(f"auto's predicted stage times (ms per micro-batch): {[round(t, 3) for t in auto['predicted_stage_ms']]}")


if __name__ == "__main__":
    main()
