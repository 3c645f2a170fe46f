"""Run tests/harness/lightning_run.py as a multi-process Lightning job with a hard timeout.

By default the job runs on this session's worker pool (tests/harness/pool.py): the same ``train(config)`` in
long-lived processes that imported Lightning once. ``fresh=True`` runs it as before, as a script
whose Lightning launcher starts the other ranks: for jobs whose point is how a real job ends (a
killed or stopped rank, a signal, a failure at start-up), and for what no pool serves (other world
sizes, other accelerators). A job that merely fails can run on the pool: the restart after it is a fork.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from typing import Any

import torch

from tests.harness.distributed import job_environment

HERE = os.path.dirname(os.path.abspath(__file__))


def launch(
    config: dict[str, Any], timeout: float = 180.0, *, fresh: bool = False
) -> tuple[int, str, list[dict[str, Any]]]:
    """Run the job; return ``(exit_code, output, records of every rank that finished)``.

    ``exit_code`` is 0 when every rank finished, -9 when the job was killed at ``timeout``, else
    nonzero. ``output`` is the ranks' stdout and stderr.
    """
    world_size = pool_world_size(config)
    if fresh or world_size is None:
        return launch_fresh(config, timeout)
    return launch_on_pool(config, world_size, timeout)


def pool_world_size(config: dict[str, Any]) -> int | None:
    """The world size of a pool that can run ``config``, or ``None``: it needs fresh processes."""
    from tests.harness.pool import POOL_WORLD_SIZES

    trainer = config.get("trainer", {})
    if any(key in trainer for key in ("devices", "accelerator", "num_nodes", "strategy")):
        return None
    devices = config.get("devices", 1)
    if config.get("accelerator", "cpu") != "cpu" or type(devices) is not int or devices not in POOL_WORLD_SIZES:
        return None
    return devices


def launch_on_pool(config: dict[str, Any], world_size: int, timeout: float) -> tuple[int, str, list[dict[str, Any]]]:
    from tests.harness.pool import get_pool

    with tempfile.TemporaryDirectory() as out:
        replies = get_pool(world_size).request("train", config, out, timeout=timeout)
        output = "".join(r.output for r in replies)
        if any(r.status == "timeout" for r in replies):
            code = -9
        elif all(r.status == "ok" for r in replies):
            code = 0
        else:
            code = 1
        if code != 0:
            output += "".join(f"[tests.harness.pool] rank {rank}: {r.status}" + (f" (exit code {r.value})" if r.status == "crashed" else "")
                              + "\n" for rank, r in enumerate(replies) if r.status != "ok")
        if code == -9:
            return code, output, []  # as a fresh job killed at its timeout
        records = [torch.load(os.path.join(out, f), weights_only=False) for f in sorted(os.listdir(out))]
        return code, output, sorted(records, key=lambda r: r["rank"])


def launch_fresh(config: dict[str, Any], timeout: float = 180.0) -> tuple[int, str, list[dict[str, Any]]]:
    """Run the script; return ``(exit_code, output, records of every rank that finished)``.

    The job runs in its own session so that on timeout the whole process group (Lightning's
    children included) is killed with SIGKILL: hung gloo ranks ignore SIGTERM.
    """
    with tempfile.TemporaryDirectory() as out:
        env = job_environment()
        proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "lightning_run.py"), json.dumps(config), out],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
        )
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            return -9, output, []
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # stray children
            except ProcessLookupError:
                pass
        records = [torch.load(os.path.join(out, f), weights_only=False) for f in sorted(os.listdir(out))]
        return proc.returncode, output, sorted(records, key=lambda r: r["rank"])
