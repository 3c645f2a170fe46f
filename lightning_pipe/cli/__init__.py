"""The ``lightning-pipe`` command (also ``python -m lightning_pipe``).

    lightning-pipe plan --model my_module.MyModel --batch_shape [256,784] --stages 2 ...
    lightning-pipe simulate --schedule 1f1b --stages 4 --micro_batches 8 --png 1f1b.png

``plan`` profiles a LightningModule and predicts every schedule (:mod:`.plan`); ``simulate`` runs the
simulator on uniform or measured costs (:mod:`.simulate`). ``--help`` on either lists its options.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``lightning-pipe`` console script.

    Exits with status 1 when ``plan`` finds no schedule that fits (after printing what was tried and
    the smallest need) and when a command refuses its options (the message on stderr, no traceback).
    """
    from jsonargparse import CLI

    from lightning_pipe.cli.plan import PlanReport, plan
    from lightning_pipe.cli.simulate import simulate_schedule
    from lightning_pipe.errors import LightningPipeError

    if os.getcwd() not in sys.path:  # class paths of the user's own modules, like ``python -m``
        sys.path.insert(0, os.getcwd())
    try:
        result = CLI({"plan": plan, "simulate": simulate_schedule}, args=list(argv) if argv is not None else None,
                     as_positional=False)
    except LightningPipeError as error:  # messages say what to change; a traceback would bury them
        print(f"lightning-pipe: error: {error}", file=sys.stderr)
        sys.exit(1)
    text = getattr(result, "text", None)  # plan returns a report; simulate prints as it goes
    if text is not None:
        print(text)
    if isinstance(result, PlanReport) and result.best is None:
        sys.exit(1)  # a script must not mistake "nothing fits" for a plan
