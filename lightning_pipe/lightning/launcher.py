"""``PipeLauncher``: Lightning's script launcher, with the checks before launching and an observer
that never ends the job without saying why.

* Before the other ranks start, the model and the training DataLoader are checked in the launching
  process (:mod:`.checks`): a bad configuration fails once, at once.
* Lightning's own child-process observer kills the launching rank (rank 0) with SIGKILL as soon as
  another rank exits with an error, often before rank 0 could print the error it was about to raise
  (:class:`~lightning_pipe.errors.PeerFailure` naming that rank). This observer gives rank 0 a grace
  period to end on its own first, and says which rank ended with which code before it ends the job.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from lightning.pytorch import LightningModule
from typing_extensions import override

from lightning_pipe.engine import shm
from lightning_pipe.engine.watchdog import FAILURE_GRACE, process_alive
from lightning_pipe.lightning import _compat
from lightning_pipe.lightning.checks import check_loader, check_model

if TYPE_CHECKING:
    from lightning_pipe.lightning.strategy import PipeStrategy

log = logging.getLogger(__name__)
#: The environment variable through which a launched rank knows its launcher's process id.
LAUNCHER_ENV = "LIGHTNING_PIPE_LAUNCHER_PID"


class PipeLauncher(_compat.ScriptLauncher):
    """Starts the other ranks of this node like Lightning's script launcher does (re-running the
    script), after the strategy's checks, and watches them with :class:`ChildObserver`.

    Args:
        strategy: the strategy whose checks run and whose grace period the observer gives.
    """

    def __init__(self, strategy: PipeStrategy) -> None:
        super().__init__(strategy.cluster_environment, strategy.num_processes, strategy.num_nodes)
        self.strategy = strategy
        self._observer: ChildObserver | None = None
        self._watch: LauncherWatch | None = None

    @override
    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        strategy = self.strategy
        if not self.cluster_environment.creates_processes_externally and args and isinstance(args[0], LightningModule):
            strategy.checked = (args[0], check_model(strategy.options, strategy.num_stages, strategy.num_pipelines, args[0]))
            if trainer is not None and trainer.state.fn == "fit" and len(args) > 1:
                check_loader(strategy.options, strategy.num_pipelines, args[1])
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            os.environ[LAUNCHER_ENV] = str(os.getpid())  # the ranks started below watch this process
            _compat.start_children(self)
            self._observer = ChildObserver(self.procs, grace=FAILURE_GRACE)
            self._observer.start()
        else:
            self._watch = LauncherWatch.start_if_launched()
        _compat.set_num_threads_if_needed(self.num_processes)
        try:
            return function(*args, **kwargs)
        except BaseException:
            if not strategy.knows_peers:  # failed before the watchdog could end them (store, groups, checks)
                if self._observer is not None:
                    self._observer.stop.set()  # the children's deaths below are this process's doing
                end_children(self.procs)
            raise

    @override
    def kill(self, signum: Any) -> None:
        """Send ``signum`` to the ranks this process started. Any signal but SIGKILL (the preemption handler's
        SIGTERM) goes at once. SIGKILL is Lightning's after Ctrl-C on this rank; the others heard of it (from a
        terminal's Ctrl-C themselves, or from this rank's report) and are ending on their own, removing their
        shared-memory files: they get up to ``FAILURE_GRACE`` seconds, then those still running are killed and the
        files they left removed (so that none outlives the job)."""
        if signum != signal.SIGKILL:
            super().kill(signum)
            return
        if self._observer is not None:
            self._observer.stop.set()  # the children's ends below are this process's doing
        deadline = time.monotonic() + FAILURE_GRACE
        while any(child.poll() is None for child in self.procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        killed = [child for child in self.procs if child.poll() is None]
        super().kill(signum)
        for child in killed:
            child.wait()
        if killed:
            shm.remove_dead_jobs_files()

    def startup_over(self) -> None:
        """The pipeline is built: from now on the watchdog ends the job's ranks on a failure, and a rank
        may legitimately outlive its launcher (its own work after ``fit``)."""
        if self._watch is not None:
            self._watch.stop.set()


def end_children(children: list[subprocess.Popen]) -> None:
    """End the ranks this process started (SIGKILL: during start-up they hold nothing worth saving and
    may be blocked in C++, deaf to SIGTERM), and say so."""
    alive = [child for child in children if child.poll() is None]
    for child in alive:
        child.send_signal(signal.SIGKILL)
    for child in alive:
        child.wait()
    if alive:
        log.error(f"the job failed during start-up; ended the {len(alive)} rank(s) this process started.")


class LauncherWatch(threading.Thread):
    """In a rank started by :class:`PipeLauncher`: when the launching process is gone and this one is
    still alive ``grace`` seconds later (its own failure path did not end it: it is blocked during
    start-up, or in C++), say so and exit, so that no rank outlives its job's launcher (PPID 1).
    A daemon thread.

    Args:
        launcher: the launching process's id.
        grace: seconds this rank gets to end on its own after its launcher is gone.
        period: seconds between looks.
    """

    def __init__(self, launcher: int, grace: float, period: float = 0.5) -> None:
        super().__init__(daemon=True, name="lightning-pipe-launcher-watch")
        self.launcher, self.grace, self.period = launcher, grace, period
        self.stop = threading.Event()  # set when start-up is over

    @classmethod
    def start_if_launched(cls) -> LauncherWatch | None:
        """Start watching when this process was started by a :class:`PipeLauncher`."""
        launcher = os.environ.get(LAUNCHER_ENV)
        # not our parent: either it is gone already (it failed while this rank was importing), or this process
        # is not one of its ranks (the variable was inherited further down)
        if launcher is None or (int(launcher) != os.getppid() and process_alive(int(launcher))):
            return None
        watch = cls(int(launcher), FAILURE_GRACE)
        watch.start()
        return watch

    def run(self) -> None:
        while os.getppid() == self.launcher:
            if self.stop.wait(self.period):
                return
        if self.stop.wait(self.grace):
            return
        # raw stderr: the process ends at once, and a thread blocked in start-up may hold a logging lock
        sys.stderr.write(f"lightning_pipe: the launching process (pid {self.launcher}) is gone and this rank did not end "
                         f"within {self.grace:.0f} s; exiting.\n")
        sys.stderr.flush()
        os._exit(1)


class ChildObserver(threading.Thread):
    """Watches the ranks this process started; when one exits with an error and this process is
    still alive ``grace`` seconds later, says so and ends the job (SIGKILL: a rank hung in gloo
    ignores SIGTERM). A daemon thread: it ends with this process.

    Args:
        children: the other ranks of this node, as started by the launcher.
        grace: seconds this process gets to end on its own (it normally raises the failed rank's
            error within a few seconds).
        period: seconds between looks.
    """

    def __init__(self, children: list[subprocess.Popen], grace: float, period: float = 0.5) -> None:
        super().__init__(daemon=True, name="lightning-pipe-child-observer")
        self.children, self.grace, self.period = children, grace, period
        self.stop = threading.Event()  # set when this process ends the children itself

    def run(self) -> None:
        while True:
            if self.stop.wait(self.period):
                return
            codes = [child.poll() for child in self.children]
            if all(code == 0 for code in codes):
                return
            failed = [(rank, code) for rank, code in enumerate(codes, start=1) if code not in (None, 0)]
            if failed:
                break
        rank, code = failed[0]
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline:  # this process normally raises that rank's error meanwhile
            if self.stop.wait(self.period):
                return
        log.error(f"local rank {rank} exited with code {code} and this process did not end within "
                  f"{self.grace:.0f} s; ending the job's processes on this node.")
        for child in self.children:
            if child.poll() is None:
                child.send_signal(signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
