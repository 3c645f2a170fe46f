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


def test_after_ctrl_c_the_launcher_lets_the_other_ranks_end_before_it_kills_what_is_left(monkeypatch):
    """Lightning SIGKILLs the other ranks as soon as Ctrl-C reaches the launching rank; a rank killed while it ended
    on its own (it got the Ctrl-C, or rank 0's report) left its shared-memory files behind. The launcher now waits
    for the ranks to end (at most FAILURE_GRACE), kills only those still running, and removes what they left."""
    import signal

    import lightning_pipe.lightning.launcher as launcher

    swept = []
    monkeypatch.setattr(launcher, "FAILURE_GRACE", 1.0)
    monkeypatch.setattr(launcher.shm, "remove_dead_jobs_files", lambda: swept.append(1) or 0)
    ending = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    hung = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    pipe_launcher = launcher.PipeLauncher.__new__(launcher.PipeLauncher)  # no strategy needed for kill
    pipe_launcher.procs, pipe_launcher._observer = [ending, hung], None
    pipe_launcher.kill(signal.SIGKILL)
    assert ending.returncode == 0  # ended on its own, not killed
    assert hung.returncode == -signal.SIGKILL
    assert swept == [1]
    # the preemption handler forwards SIGTERM through kill too: at once, from inside a signal handler
    asleep = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    pipe_launcher.procs = [asleep]
    pipe_launcher.kill(signal.SIGTERM)
    assert asleep.wait(timeout=0.9) == -signal.SIGTERM  # sent before any grace (1 s) could run out
