"""A rank started by PipeLauncher exits when its launcher is gone during start-up (issue 29: a rank
whose launcher failed at the store's bind was left waiting, PPID 1, until the store's one-hour timeout)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The launcher starts a rank that blocks for ever (as on a store that never answers), prints its pid, exits.
LAUNCHER = """
import os, subprocess, sys
os.environ["LIGHTNING_PIPE_LAUNCHER_PID"] = str(os.getpid())
rank = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stderr=open(sys.argv[2], "w"))
print(rank.pid, flush=True)
"""
RANK = """
import os, sys, time
import lightning_pipe.lightning.launcher as launcher
launcher.FAILURE_GRACE = 0.5
assert launcher.LauncherWatch.start_if_launched() is not None
os.read(os.pipe()[0], 1)
"""


def test_a_rank_whose_launcher_is_gone_exits(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT}
    log = str(tmp_path / "rank.err")
    done = subprocess.run([sys.executable, "-c", LAUNCHER, RANK, log], capture_output=True, text=True, env=env, timeout=60)
    pid = int(done.stdout)
    deadline_polls = 0
    while os.path.exists(f"/proc/{pid}") and deadline_polls < 600:  # bounded: 60 s
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        subprocess.run(["sleep", "0.1"])
        deadline_polls += 1
    alive = os.path.exists(f"/proc/{pid}")
    if alive:
        with open(f"/proc/{pid}/stat") as stat:
            alive = stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    if alive:
        os.kill(pid, 9)
    assert not alive, "the orphaned rank is still running"
    with open(log) as f:
        assert "the launching process (pid" in f.read()
