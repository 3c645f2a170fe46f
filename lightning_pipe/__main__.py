"""``python -m lightning_pipe``: the same as the ``lightning-pipe`` command (``plan``, ``simulate``)."""

from lightning_pipe.cli import main

main()
