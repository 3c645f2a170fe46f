"""A rank that ends on a failure skips Python's final garbage collections (engine/ending.py): the
launching process exits within its peers' reaper grace instead of being SIGKILLed as hung (issue 27)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# An object kept alive by a reference cycle is finalized only by the garbage collector; at exit, the
# final collection finds it once the module's globals are cleared.
SCRIPT = """
import sys
from lightning_pipe.engine import ending

class Cycle:
    def __init__(self):
        self.me = self
    def __del__(self):
        print("collected at exit", flush=True)

kept = Cycle()
if sys.argv[1] == "skip":
    ending.skip_final_collection()
    ending.skip_final_collection()  # idempotent
    assert ending.armed()
print("exiting", flush=True)
"""


def run(mode: str) -> str:
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, env=env, timeout=60,
                          check=True).stdout


def test_python_collects_at_exit_by_default():
    assert run("default") == "exiting\ncollected at exit\n"


def test_a_failing_process_skips_the_final_collection():
    assert run("skip") == "exiting\n"
