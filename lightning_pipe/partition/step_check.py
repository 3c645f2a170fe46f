"""What a pipelined step may not do with the trunk, found in autograd's graph of its first training step.

A stage runs the user's step with its own share of the trunk; every other block is a stand-in
(:mod:`.split`). Two uses of the trunk then compute something else than one device, silently unless
checked:

* **reading an earlier block's output again.** A looped trunk's stage receives only the output of the
  block before its first one, and every earlier block stands in with that same value. A step that reads
  the outputs of those earlier blocks again (a residual around the blocks, ``x = x + block(x)``; a list
  of every block's output) reads the wrong values. While a step is checked, the stand-ins of the blocks
  before the last one return marked views of what they return, and the step's output must not depend on
  them. Code that hands on only the block's output (``x = norm(block(x))``, ``x = block(x) + x0`` with
  ``x0`` from before the loop) reads none.
* **using the trunk's parameters outside its call** (an L2 penalty over ``self.parameters()``): a stage
  holds only its own layers, so the term would cover this stage's alone (and, emulated on one device,
  every stage's, unlike the real pipeline). The step's output must reach this stage's trunk parameters
  only through what its layers returned.

Each chunk is checked once, on the first step that records a graph (evaluation alone is not checked): two
walks of the stage's graph in Python, about 60 us for two transformer blocks on a CPU core, once per run.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Iterator, Mapping
from typing import Any

import torch

from lightning_pipe.errors import TrunkUsageError


class StepCheck:
    """Notes, during one step, what :meth:`verify` needs: the marked stand-in outputs and what the chunk's
    layers returned."""

    def __init__(self) -> None:
        self._marked: dict[Any, int] = {}  # grad_fn of a marked stand-in output -> its block
        self._chunk_outputs: set[Any] = set()  # grad_fns of what this chunk's layers returned

    def mark(self, value: Any, index: int) -> Any:
        """``value`` (what stands in for block ``index``), marked: a view of each tensor that records a graph."""
        if isinstance(value, tuple):
            return tuple(self.mark(v, index) for v in value)
        if not isinstance(value, torch.Tensor) or not value.requires_grad:
            return value
        view = value.view_as(value)
        self._marked[view.grad_fn] = index
        return view

    def note_chunk_output(self, output: Any) -> None:
        """What one of this chunk's layers (or blocks) returned: the step reaches the trunk's parameters through it."""
        self._chunk_outputs.update(t.grad_fn for t in tensors_in(output) if t.grad_fn is not None)

    def verify(self, output: Any, trunk: str, parameters: Mapping[int, str]) -> None:
        """Raise :class:`TrunkUsageError` if ``output`` (the step's loss, or what the chunk sends) depends on a marked
        stand-in output, or on one of ``parameters`` (``id`` -> name: this stage's trunk parameters) other than
        through what the chunk's layers returned."""
        roots = [t.grad_fn for t in tensors_in(output) if t.grad_fn is not None]
        read = sorted({self._marked[node] for node in _walk(roots) if node in self._marked})
        if read:
            blocks = ", ".join(f"{trunk}[{i}]" for i in read)
            raise TrunkUsageError(
                f"the step reads the output of {blocks} again after the loop went past it (a residual around the "
                "blocks: x = x + block(x), a list of the blocks' outputs, or an auxiliary loss summed over them); "
                "those blocks run on another stage, and only the output of the block before a stage's first block "
                "reaches that stage, so the pipeline would compute something else. Move that code into the blocks (a "
                "block whose forward returns x + layer(x); one that carries the running auxiliary loss: x, aux = "
                "block(x, aux)), or name another trunk with PipeStrategy(module=...)."
            )
        used = sorted(parameters[i] for i in _reached(roots, parameters, stop=self._chunk_outputs))
        if used:
            names = ", ".join(f"{trunk}.{name}" for name in used[:3]) + (f" and {len(used) - 3} more" if len(used) > 3 else "")
            raise TrunkUsageError(
                f"the step uses parameters of {trunk} outside its call ({names}), e.g. an L2 penalty over "
                f"self.parameters(); each stage holds only its own layers of {trunk}, so the pipeline would compute "
                "that term for one stage's layers. Use the optimizer's weight_decay, or keep such terms inside the "
                "layers' forward."
            )


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``value``, a tensor or a (nested) tuple or list of them."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors_in(item)


def reached_parameters(outputs: Iterable[torch.Tensor], wanted: Container[int]) -> set[int]:
    """The ids among ``wanted`` (parameter ids) of the parameters whose gradient the graph of ``outputs`` reaches:
    those for which ``torch.autograd.grad(outputs, parameters, allow_unused=True)`` would not return ``None``. Found
    by walking the graph, which, unlike ``autograd.grad``, also works through a reentrant ``torch.utils.checkpoint``
    (Hugging Face's ``gradient_checkpointing_enable()``)."""
    outputs = list(outputs)
    reached = {id(t) for t in outputs if id(t) in wanted}  # an output that is itself a parameter
    return reached | _reached([t.grad_fn for t in outputs if t.grad_fn is not None], wanted)


def _reached(roots: list[Any], wanted: Container[int], stop: Container[Any] = ()) -> set[int]:
    """The ids among ``wanted`` of the parameters (leaf nodes) reachable from the autograd nodes ``roots``, not going
    below the nodes in ``stop``."""
    return {id(node.variable) for node in _walk(roots, stop) if id(getattr(node, "variable", None)) in wanted}


def _walk(roots: list[Any], stop: Container[Any] = ()) -> Iterator[Any]:
    """Every autograd node reachable from ``roots``, each once, not going below the nodes in ``stop``."""
    seen, queue = set(roots), list(roots)
    while queue:
        node = queue.pop()
        yield node
        if node in stop:
            continue
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                queue.append(child)
