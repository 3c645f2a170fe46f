"""Cut the trunk of a module in place: keep this rank's layers, stub the rest, swap its forward.

Layers owned by other ranks become ``nn.Identity`` so ``state_dict`` keys keep their indices.
The trunk's ``forward`` is replaced on the instance by a dispatcher whose behaviour the pipeline
sets around each call of the user's step: run this chunk's layers and stop the step (first
stage), run this chunk's layers on the received activation (last stage), or run everything
(one-stage pipeline). Called anywhere else, it raises a clear error instead of silently running
a model with holes in it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import nn

from lightning_pipe.engine.stage import run_layers
from lightning_pipe.errors import TrunkUsageError


class StageStop(BaseException):
    """Ends the user's step on a non-last stage once the trunk produced this stage's output.

    A ``BaseException`` so that a user's ``except Exception`` cannot swallow it.
    """

    def __init__(self, output: Any) -> None:
        super().__init__("pipeline stage finished")
        self.output = output


class PartitionedTrunk:
    """This rank's share of the trunk.

    Args:
        trunk: the module's ``nn.Sequential`` (modified in place).
        name: its attribute path, for messages.
        bounds: ``(start, end)`` layer range of every virtual stage.
        local: the virtual stages this rank holds, in chunk order.
        recompute: recompute activations in backward (``checkpoint_activations``).
    """

    def __init__(
        self,
        trunk: nn.Sequential,
        name: str,
        bounds: Sequence[tuple[int, int]],
        local: Sequence[int],
        recompute: bool = False,
    ) -> None:
        self.trunk = trunk
        self.name = name
        self.bounds = list(bounds)
        self.local = list(local)
        self.recompute = recompute
        owned = {i for vs in self.local for i in range(*self.bounds[vs])}
        for index in range(len(trunk)):
            if index not in owned:
                trunk._modules[str(index)] = nn.Identity()
        self.chunks = [nn.Sequential(*(trunk[i] for i in range(*self.bounds[vs]))) for vs in self.local]
        self._active: Callable[[Any], Any] | None = None
        trunk.forward = self._forward  # instance attribute: shadows nn.Sequential.forward

    def describe_chunk(self, chunk: int) -> str:
        start, end = self.bounds[self.local[chunk]]
        return f"virtual stage {self.local[chunk]} ({self.name}[{start}:{end}])"

    def run_chunk(self, chunk: int, value: Any) -> Any:
        return run_layers(self.chunks[chunk], value, self.recompute)

    def _forward(self, value: Any) -> Any:
        if self._active is None:
            held = ", ".join(f"{self.name}[{self.bounds[vs][0]}:{self.bounds[vs][1]}]" for vs in self.local)
            raise TrunkUsageError(
                f"{self.name} is split across pipeline stages and this process only holds {held}, so it runs only "
                "inside a pipelined step. Outside one (after fit, or a logger drawing the graph from "
                "example_input_array) load the checkpoint into a fresh module with MyModule.load_from_checkpoint(path), "
                "or turn the graph off (e.g. TensorBoardLogger(log_graph=False))."
            )
        return self._active(value)

    @contextmanager
    def acting(self, behaviour: Callable[[Any], Any]) -> Iterator[None]:
        """Within the block, a call of the trunk runs ``behaviour(input)``."""
        self._active = behaviour
        try:
            yield
        finally:
            self._active = None
