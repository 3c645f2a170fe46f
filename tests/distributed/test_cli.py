"""examples/cli.py (LightningCLI) with the strategy as a registered name, as class_path + init_args,
and as command-line overrides; ``--print_config`` lists every PipeStrategy option.

Every run is ``python examples/cli.py ...`` in its own session with a hard timeout; on timeout the
whole process group (Lightning's child ranks included) is killed, as in tests/harness/launch.py. The
training runs are started together (each one is mostly Python start-up and imports) so the file
stays well under a minute.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from lightning_pipe import PipeStrategy
from tests.harness.distributed import job_environment

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = os.path.join(ROOT, "examples", "cli.py")
CONFIGS = os.path.join(ROOT, "examples", "configs")
LIGHTNING_ARGS = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"}
TIMEOUT = 150.0


class Run:
    """``python examples/cli.py ARGS`` started now in its own session; ``result()`` waits for it."""

    def __init__(self, args: list[str], cwd: Path) -> None:
        env = job_environment()
        self.deadline = time.monotonic() + TIMEOUT
        self.log = cwd / "output.log"  # a file, not a pipe: nobody reads a run's pipe while it runs
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, CLI, *args], cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def result(self) -> tuple[int, str]:
        try:
            code = self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            self.proc.wait()
            code = -9
        finally:
            self.kill()  # stray child ranks
        return code, self.log.read_text()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def strategy_options() -> dict[str, inspect.Parameter]:
    """PipeStrategy's own __init__ options (not the ones the Trainer fills in)."""
    params = inspect.signature(PipeStrategy.__init__).parameters
    return {name: p for name, p in params.items() if name != "self" and name not in LIGHTNING_ARGS}


def test_print_config_shows_every_strategy_option(tmp_path):
    # `--trainer.strategy=lightning_pipe.PipeStrategy` alone stays a plain string (the Trainer's
    # `strategy: Union[str, Strategy]` matches str first), so select the class with `.class_path`
    run = Run(["fit", "--trainer.strategy.class_path=lightning_pipe.PipeStrategy", "--print_config"], tmp_path)
    code, output = run.result()
    assert code == 0, output
    strategy = yaml.safe_load(output)["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_pipe.PipeStrategy"
    options = strategy_options()
    assert {"schedule", "micro_batches", "stages", "pipelines", "balance", "module", "chunks_per_stage",
            "checkpoint_activations", "timeout", "process_group_backend"} <= set(options)
    for name, param in options.items():
        assert name in strategy["init_args"], f"{name} missing from --print_config:\n{output}"
        default = dataclasses.asdict(param.default) if dataclasses.is_dataclass(param.default) else param.default
        assert strategy["init_args"][name] == default, name  # option groups render as nested blocks


# name -> (command-line arguments, description line PipeStrategy prints at setup)
TRAINING_RUNS = {
    "1f1b_name": (["--config", os.path.join(CONFIGS, "1f1b.yaml")],
                  "lightning_pipe: 1f1b, 2 stage(s) × 1 pipeline(s), 4 micro-batches per batch"),
    "gpipe_class_path": (["--config", os.path.join(CONFIGS, "gpipe_class_path.yaml")],
                         "lightning_pipe: gpipe, 2 stage(s) × 1 pipeline(s), 4 micro-batches per batch"),
    "interleaved": (["--config", os.path.join(CONFIGS, "interleaved.yaml")],
                    "lightning_pipe: interleaved_1f1b, 2 stage(s) × 1 pipeline(s), 4 micro-batches per batch, "
                    "2 chunks per stage"),
    "avgpipe_auto": (["--config", os.path.join(CONFIGS, "avgpipe_auto.yaml")],
                     "lightning_pipe: avgpipe, 2 stage(s) × 1 pipeline(s), "),  # M and N are tuned
    "command_line_override": (
        ["--config", os.path.join(CONFIGS, "1f1b.yaml"), "--trainer.strategy=lightning_pipe.PipeStrategy",
         "--trainer.strategy.schedule=gpipe", "--trainer.strategy.micro_batches=2"],
        "lightning_pipe: gpipe, 2 stage(s) × 1 pipeline(s), 2 micro-batches per batch"),
}


@pytest.fixture(scope="module")
def training_runs(tmp_path_factory):
    """Start every training run at once; each test waits for its own."""
    runs = {}
    for name, (args, _) in TRAINING_RUNS.items():
        out = tmp_path_factory.mktemp(name)
        runs[name] = (Run(["fit", *args, f"--trainer.default_root_dir={out}"], out), out)
    yield runs
    for run, _ in runs.values():
        run.kill()


@pytest.mark.parametrize("name", list(TRAINING_RUNS))
def test_cli_trains_on_two_processes(training_runs, name):
    run, out = training_runs[name]
    code, output = run.result()
    assert code == 0, f"exit code {code}:\n{output[-6000:]}"
    assert TRAINING_RUNS[name][1] in output, output[-6000:]
    assert "`Trainer.fit` stopped: `max_epochs=1` reached." in output, output[-6000:]
    # LightningCLI's SaveConfigCallback (rank 0 writes, the strategy broadcasts) saved the parsed config
    strategy = yaml.safe_load((out / "config.yaml").read_text())["trainer"]["strategy"]
    schedule = TRAINING_RUNS[name][1].split()[1].rstrip(",")  # "lightning_pipe: gpipe, ..." -> "gpipe"
    assert (strategy if isinstance(strategy, str) else strategy["init_args"]["schedule"]) == schedule
