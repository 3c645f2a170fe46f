"""Lightning's private names this package relies on, in one place.

Each function says what it needs from Lightning 2.6 and why no public API serves; when Lightning
changes one of these, only this module changes.
"""

from __future__ import annotations

from typing import Any


def set_received_sigterm(trainer: Any) -> None:
    """Mark the run as preempted, as Lightning's own SIGTERM handler does (``_SignalConnector.received_sigterm``):
    the loops then stop at their next batch boundary with ``SIGTERMException``, which runs the callbacks'
    ``on_exception`` (``OnExceptionCheckpoint``, ``ModelCheckpoint(save_on_exception=True)``).

    Lightning's handler sets it from inside the signal handler and then calls ``dist.broadcast`` there,
    which deadlocks a distributed job (the ranks are not at the same collective); this package sets it
    on every rank at once, after the ranks agreed at a step boundary (:mod:`.preemption`)."""
    trainer._signal_connector.received_sigterm = True


def module_optimizers(module: Any) -> list[Any]:
    """The optimizers ``module.configure_optimizers()`` returns, in any of its return forms (``_configure_optimizers``:
    Lightning's own reading of them, which it offers no public name for). Raises what the hook raises, e.g. outside
    a Trainer."""
    from lightning.pytorch.core.optimizer import _configure_optimizers

    optimizers, _, _ = _configure_optimizers(module.configure_optimizers())
    return optimizers
