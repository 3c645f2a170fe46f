"""Run tests/lightning_run.py as a multi-process Lightning job with a hard timeout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from typing import Any

import torch

from tests.distributed import job_environment

HERE = os.path.dirname(os.path.abspath(__file__))


def launch(config: dict[str, Any], timeout: float = 180.0) -> tuple[int, str, list[dict[str, Any]]]:
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
