"""Preemption: SIGTERM ends every rank within the timeouts, after the checkpoints it asks for.

Lightning's SIGTERM handler calls ``dist.broadcast`` inside the signal handler. The ranks are then
not at the same collective (one is in a pipeline wait, another in Lightning's per-batch broadcast),
so a job with ``OnExceptionCheckpoint`` hung until killed, its checkpoint unwritten (issue 29). For
``PipeStrategy`` this module replaces that handler:

* the handler only notes the signal, and forwards it once to the ranks this process launched (as
  Lightning's does), so the rest of the process is never entered from a signal;
* at the start of every step (training and evaluation) the ranks agree, with one all-reduce, whether
  any of them received it; if so, every rank marks the run preempted at once
  (:func:`._compat.set_received_sigterm`) and Lightning stops them all after that same batch with
  ``SIGTERMException``, whose ``on_exception`` hooks write the configured checkpoints with every rank
  in step;
* before the first step boundary (start-up: the rendezvous, the model's checks and materialisation,
  ``balance="auto"``) there is no progress to save, so a SIGTERM ends the rank at once (exit 143) with
  one sentence, after forwarding it to the ranks this process launched;
* a rank that does not reach a step boundary within ``timeout`` + :data:`FAILURE_GRACE` of the signal
  (its peers are hung, or it is blocked itself), or does not end within ``checkpoint_timeout`` +
  :data:`FAILURE_GRACE` of the agreement, says so and exits (status 143). A thread woken by the signal
  itself (``signal.set_wakeup_fd``) watches for that: the Python-level handler cannot run while the
  main thread is blocked in C++.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

from lightning_pipe.engine.watchdog import FAILURE_GRACE

log = logging.getLogger(__name__)


class Preemption:
    """This process's SIGTERM handling for one strategy.

    Args:
        rank: this process's global rank (for messages).
        timeout: seconds a rank may take to reach the next step boundary (the pipeline's ``timeout``).
        checkpoint_timeout: seconds the agreed stop may take (the checkpoints are written meanwhile).
        forward: called once with the signal number on the first SIGTERM (the launcher passes it on
            to the ranks it started).
    """

    def __init__(self, rank: int, timeout: float, checkpoint_timeout: float,
                 forward: Callable[[int], None] | None = None) -> None:
        self.rank, self.timeout, self.checkpoint_timeout, self.forward = rank, timeout, checkpoint_timeout, forward
        self.received: float | None = None  # time.monotonic() of the first SIGTERM
        self.agreed: float | None = None  # when the ranks agreed to stop
        self.active = False
        self.starting = False  # in start-up (see install): a SIGTERM ends this rank at once
        self._previous: Any = None  # the handler before the first install, in charge again after the run

    def install(self, starting: bool = False) -> None:
        """Handle SIGTERM here instead of Lightning (from the main thread; again after Lightning
        registered its own at the start of a run). ``starting``: a (new) start-up begins, before
        which a SIGTERM ends this rank at once."""
        if threading.current_thread() is not threading.main_thread():
            return
        global _current
        self.active, _current = True, self
        if starting:
            self.starting = True
        current = signal.getsignal(signal.SIGTERM)
        if current != self._handler:
            if self._previous is None:
                self._previous = current
            signal.signal(signal.SIGTERM, self._handler)
        _start_watcher()

    def steps_begin(self) -> None:
        """A step boundary was reached on every rank: from now on a SIGTERM stops the job after a batch,
        with its checkpoints."""
        self.starting = False

    def uninstall(self) -> None:
        """The run is over: the watcher no longer ends this process, and a SIGTERM gets the handling it
        had before the run (Lightning's teardown re-registers this handler, which it found installed)."""
        self.active = False

    def _handler(self, signum: int, frame: Any) -> None:
        if not self.active:
            _default_handling(self._previous, signum, frame)
            return
        if self.starting:
            self.end_during_startup(signum)
        if self.received is not None:
            return
        self.received = time.monotonic()
        # raw stderr, not the logger: inside a signal handler, a logging lock held by the interrupted code deadlocks
        sys.stderr.write(f"lightning_pipe: rank {self.rank} received SIGTERM; every rank stops after the current batch "
                         "and writes the checkpoints configured for an exception.\n")
        if self.forward is not None:
            self.forward(signum)

    def end_during_startup(self, signum: int) -> None:
        """End this rank now, with one sentence: SIGTERM came before the first step, when there is nothing
        to save (from the handler, or from the watcher while the main thread is blocked in C++)."""
        with _ending:
            sys.stderr.write(f"lightning_pipe: rank {self.rank} received SIGTERM during start-up, before the first "
                             "step; it ends now (exit 143), as there is no progress to checkpoint yet.\n")
            sys.stderr.flush()
            if self.forward is not None:
                self.forward(signum)
            os._exit(128 + signal.SIGTERM)

    def stop_now(self, any_rank_received: bool) -> bool:
        """Record the ranks' agreement (``any_rank_received``: the all-reduce of :attr:`pending`); whether to stop."""
        if any_rank_received and self.agreed is None:
            self.agreed = time.monotonic()
        return any_rank_received

    @property
    def pending(self) -> bool:
        """Whether this rank received SIGTERM."""
        return self.received is not None

    def overdue(self, signalled: float) -> str | None:
        """Why this rank must end now, ``signalled`` (monotonic) after SIGTERM arrived; ``None``: not yet."""
        now = time.monotonic()
        if self.agreed is None and now - signalled > self.timeout + FAILURE_GRACE:
            return (f"did not reach a step boundary within {self.timeout + FAILURE_GRACE:.0f} s of SIGTERM (it or a peer "
                    "is blocked)")
        if self.agreed is not None and now - self.agreed > self.checkpoint_timeout + FAILURE_GRACE:
            return f"did not end within {self.checkpoint_timeout + FAILURE_GRACE:.0f} s of stopping on SIGTERM"
        return None


def _default_handling(previous: Any, signum: int, frame: Any) -> None:
    """What SIGTERM did before the first :meth:`Preemption.install`: call that handler, ignore the signal,
    or end the process as the default action does."""
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


# ---------------------------------------------------------------------- the bound: one watcher per process
_current: Preemption | None = None  # the run being watched (a process may run several fits)
_watching = False
_ending = threading.Lock()  # one ending per process: the handler's or the watcher's


def _start_watcher() -> None:
    """Once per process: a thread woken through ``signal.set_wakeup_fd`` by every signal, which bounds the
    current run's stop after a SIGTERM."""
    global _watching
    if _watching:
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    if previous != -1:  # someone else (asyncio) uses the wakeup fd: leave it to them, no bound here
        signal.set_wakeup_fd(previous)
        os.close(read), os.close(write)
        return
    _watching = True
    threading.Thread(target=_watch, args=(read,), daemon=True, name="lightning-pipe-sigterm").start()


def _watch(read: int) -> None:
    while True:
        while signal.SIGTERM not in os.read(read, 64):
            pass
        signalled = time.monotonic()
        if (run := _current) is not None and run.active and run.starting:  # the main thread may be blocked in C++
            run.end_during_startup(signal.SIGTERM)
        while (run := _current) is not None and run.active:
            why = run.overdue(signalled)
            if why is not None:  # raw stderr: the process ends at once, and a blocked thread may hold a logging lock
                sys.stderr.write(f"lightning_pipe: rank {run.rank} {why}; exiting without a checkpoint.\n")
                sys.stderr.flush()
                os._exit(128 + signal.SIGTERM)
            time.sleep(0.2)


def outcome(trainer: Any) -> str:
    """One sentence after a stop on SIGTERM: which checkpoints were written, or why none was."""
    written = [c.ckpt_path for c in trainer.callbacks if isinstance(c, OnExceptionCheckpoint) and os.path.exists(c.ckpt_path)]
    on_exception = [c for c in trainer.callbacks if isinstance(c, ModelCheckpoint) and getattr(c, "save_on_exception", False)]
    written += [str(c.dirpath) for c in on_exception]
    step = f"at step {trainer.global_step}"
    if written:
        return f"the job stopped on SIGTERM {step}; checkpoint written: {', '.join(written)}."
    return (f"the job stopped on SIGTERM {step}; no checkpoint was written, as no callback saves on an "
            "exception (add OnExceptionCheckpoint(dirpath) or ModelCheckpoint(save_on_exception=True) to keep the progress).")
