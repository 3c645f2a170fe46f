"""SIGTERM handling of PipeStrategy (lightning/preemption.py): the handler only notes the signal (no
collective inside it: Lightning's own calls ``dist.broadcast`` there, and a distributed job hung), and a
rank that never reaches a step boundary after it still ends, with a message (issue 29)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from lightning_pipe.lightning.preemption import Preemption

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_handler_notes_the_signal_and_forwards_it_once():
    forwarded: list[int] = []
    previous = signal.getsignal(signal.SIGTERM)
    preemption = Preemption(rank=3, timeout=60.0, checkpoint_timeout=60.0, forward=forwarded.append)
    try:
        preemption.install()
        assert not preemption.pending and not preemption.stop_now(False)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.pending and forwarded == [signal.SIGTERM]
        assert preemption.stop_now(True) and preemption.agreed is not None
    finally:
        preemption.uninstall()
        signal.signal(signal.SIGTERM, previous)
        signal.set_wakeup_fd(-1)


BLOCKED = """
import os, signal
from lightning_pipe.lightning.preemption import Preemption
Preemption(rank=1, timeout=0.5, checkpoint_timeout=60.0).install()
read, write = os.pipe()
os.kill(os.getpid(), signal.SIGTERM)
os.read(read, 1)  # blocked for ever: never at a step boundary
"""


def test_a_rank_that_never_reaches_a_step_boundary_still_ends():
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "-c", BLOCKED], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert "lightning_pipe: rank 1 received SIGTERM" in done.stderr
    assert "rank 1 did not reach a step boundary within 6 s of SIGTERM (it or a peer is blocked); exiting without a checkpoint." \
        in done.stderr


STARTING = """
import os, signal
from lightning_pipe.lightning.preemption import Preemption
Preemption(rank=2, timeout=60.0, checkpoint_timeout=60.0).install(starting=True)
read, write = os.pipe()
os.kill(os.getpid(), signal.SIGTERM)
os.read(read, 1)  # blocked: start-up never ends
"""


def test_a_sigterm_during_startup_ends_the_rank_at_once():
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "-c", STARTING], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert done.stderr.count("rank 2 received SIGTERM during start-up, before the first step") == 1, done.stderr


def test_after_the_run_a_sigterm_gets_the_handling_it_had_before():
    seen: list[int] = []
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    preemption = Preemption(rank=0, timeout=60.0, checkpoint_timeout=60.0)
    try:
        preemption.install(starting=True)
        preemption.steps_begin()
        preemption.uninstall()
        os.kill(os.getpid(), signal.SIGTERM)  # Lightning's teardown leaves this handler installed: it must pass it on
        assert seen == [signal.SIGTERM] and not preemption.pending
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.set_wakeup_fd(-1)
