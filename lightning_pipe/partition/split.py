"""Cut the trunk of a module in place: keep this rank's layers, stub the rest, take over its calls.

Layers owned by other ranks become ``nn.Identity`` so ``state_dict`` keys keep their indices. What
the trunk does when the user's step reaches it is set by the pipeline around each call of the step
(:meth:`PartitionedTrunk.acting` with a :class:`StagePass`): run this chunk's layers and stop the
step (a stage that is not the last), run them on the received activation, or run everything
(a one-stage pipeline). Outside a pipelined step it raises a clear error instead of silently
running a model with holes in it.

* An ``nn.Sequential`` trunk is called once (``self.model(x)``): its ``forward`` is replaced on the
  instance.
* An ``nn.ModuleList`` trunk is iterated in the user's own loop (``for block in self.blocks:
  x = block(x, mask, ...)``): the instance becomes a subclass whose iteration yields
  :class:`BlockCall` stand-ins. Blocks of earlier stages return the received activation (so the
  code between blocks turns it into the next block's input exactly as it would have), this
  chunk's blocks run with the arguments the loop passes them, and the last one ends the step.
  The code before the loop (embeddings, masks, rotary tables) therefore runs on every stage, so
  extra arguments of the blocks never travel between stages (docs/models.md). Only a block's output
  travels, so a step that reads an earlier block's output again (``x = x + block(x)``) cannot be split:
  the first training step checks it, and that the step uses no trunk parameter outside the trunk's call
  (:mod:`.step_check`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_pipe.engine.stage import run_layers
from lightning_pipe.errors import SharedParameterError, TrunkUsageError
from lightning_pipe.partition.step_check import StepCheck


class StageStop(BaseException):
    """Ends the user's step on a non-last stage once the trunk produced this stage's output.

    A ``BaseException`` so that a user's ``except Exception`` cannot swallow it.
    """

    def __init__(self, output: Any) -> None:
        super().__init__("pipeline stage finished")
        self.output = output


@dataclass(frozen=True)
class StagePass:
    """What the trunk does during one call of the user's step.

    Attributes:
        chunk: the local chunk whose layers run.
        first: the chunk is the pipeline's first virtual stage (its input comes from the step).
        received: the activation from the previous virtual stage (unused when ``first``).
        stop: end the step with this chunk's output (every virtual stage but the last).
        entering_layers: called once, when the chunk's own layers start (after the step's code before them).
    """

    chunk: int
    first: bool
    received: Any = None
    stop: bool = False
    entering_layers: Callable[[], None] | None = None

    def begin_layers(self) -> None:
        if self.entering_layers is not None:
            self.entering_layers()


class PartitionedTrunk:
    """This rank's share of the trunk.

    Args:
        trunk: the module's ``nn.Sequential`` or ``nn.ModuleList`` (modified in place).
        name: its attribute path, for messages.
        bounds: ``(start, end)`` layer range of every virtual stage.
        local: the virtual stages this rank holds, in chunk order.
        recompute: recompute activations in backward (``checkpoint_activations``).
    """

    def __init__(
        self,
        trunk: nn.Sequential | nn.ModuleList,
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
        self.looped = isinstance(trunk, nn.ModuleList)
        self.owned = owned = {i for vs in self.local for i in range(*self.bounds[vs])}
        check_shared_layers(trunk, name, self.bounds)
        # plain attributes of every block (e.g. a Hugging Face layer's ``attention_type``), so that a loop
        # reading them works on the ranks that hold only a stub of that block
        self.attributes = [_plain_attributes(block) for block in trunk]
        for index in range(len(trunk)):
            if index not in owned:
                trunk._modules[str(index)] = nn.Identity()
        self.chunks = [nn.Sequential(*(trunk[i] for i in range(*self.bounds[vs]))) for vs in self.local]
        self._active: StagePass | None = None
        self._ran = False  # the trunk was called (iterated, for a ModuleList) in the current step
        self._next_index = 0  # the block a call by index (self.blocks[i](x)) must run next in the current step
        self._first_input: Any = None  # what the step's first call of a Sequential trunk passed
        self._checked: set[int] = set()  # the chunks whose step passed check_step_output
        self._check: StepCheck | None = None  # while a chunk's first step that records a graph runs
        if self.looped:
            trunk.__class__ = _looped_class(type(trunk))
            trunk._lightning_pipe = self  # type: ignore[union-attr]
        else:
            trunk.forward = self._forward  # instance attribute: shadows nn.Sequential.forward

    def describe_chunk(self, chunk: int) -> str:
        start, end = self.bounds[self.local[chunk]]
        return f"virtual stage {self.local[chunk]} ({self.name}[{start}:{end}])"

    def run_chunk(self, chunk: int, value: Any) -> Any:
        """Run an ``nn.Sequential`` chunk's layers on ``value`` (a middle stage needs no step)."""
        return run_layers(self.chunks[chunk], value, self.recompute)

    @property
    def middle_runs_step(self) -> bool:
        """Whether a middle stage runs the user's step too: a looped trunk's blocks take the
        arguments the step computes (masks, position tables), a Sequential's layers only the activation."""
        return self.looped

    @contextmanager
    def acting(self, stage_pass: StagePass) -> Iterator[None]:
        """Within the block, a call (or iteration) of the trunk does ``stage_pass``."""
        self._active, self._ran, self._first_input, self._next_index = stage_pass, False, None, 0
        self._check = StepCheck() if torch.is_grad_enabled() and stage_pass.chunk not in self._checked else None
        try:
            yield
        finally:
            self._active = self._check = self._first_input = None

    # ------------------------------------------------------------------ nn.Sequential
    def _forward(self, value: Any) -> Any:
        stage_pass = self._require_active()
        if self._ran and not _same_values(value, self._first_input):
            # only the first call's activation travels between the stages: a later one would reuse it
            raise TrunkUsageError(
                f"{self.name} was called twice in one step on different inputs; a pipelined trunk runs once per step, and "
                "only that call's activation travels between the stages. Call it once (two inputs of a siamese step: "
                "on torch.cat([x1, x2]), then split its output), or keep the second use out of the trunk."
            )
        self._ran, self._first_input = True, value
        stage_pass.begin_layers()
        output = self.run_chunk(stage_pass.chunk, value if stage_pass.first else stage_pass.received)
        if self._check is not None:
            self._check.note_chunk_output(output)
        if stage_pass.stop:
            raise StageStop(output)
        return output

    # ------------------------------------------------------------------ nn.ModuleList
    def iterate(self) -> Iterator[Any]:
        """The loop over a ModuleList trunk: one :class:`BlockCall` per block inside a step; outside
        one, the blocks this process holds and, for the others, stand-ins that raise when called
        (so ``print(model)`` and attribute reads work, running a model with holes does not)."""
        if self._active is None:
            return (self.trunk._modules[str(i)] if i in self.owned else _MissingBlock(self, i) for i in range(len(self.trunk)))
        stage_pass = self._active
        if self._ran or self._next_index:
            raise TrunkUsageError(
                f"{self.name} was iterated twice in one step; a pipelined nn.ModuleList trunk runs its blocks once per "
                "step, in one loop. Loop over it once, or keep the second use out of the list."
            )
        self._ran = True
        start, end = self.bounds[self.local[stage_pass.chunk]]
        return (BlockCall(self, index, start, end, stage_pass) for index in range(len(self.trunk)))

    @property
    def step_check(self) -> StepCheck | None:
        """What the step notes while it is checked (its chunk's first step that records a graph), else ``None``."""
        return self._check

    def check_step_output(self, stage_pass: StagePass, output: Any) -> None:
        """On the first step of ``stage_pass``'s chunk that records a graph: refuse a step that reads blocks another
        stage ran or this stage's trunk parameters outside their call (:mod:`.step_check`)."""
        check, self._check = self._check, None
        if check is None:
            return
        self._checked.add(stage_pass.chunk)
        owned = {id(p): name for name, p in self.trunk.named_parameters()}
        check.verify(output, self.name, owned)

    def item(self, index: Any) -> Any:
        """``trunk[index]`` inside a step: the whole-list slice (``self.layers[:n]``) loops as the
        list does; one block can be read (``nn.TransformerEncoder`` reads ``self.layers[0].self_attn.batch_first``)
        but not called; a partial slice cannot be split into stages."""
        if self._active is None:
            return None
        count = len(self.trunk)
        if isinstance(index, slice) and range(count)[index] == range(count):
            return _WholeList(self)
        if isinstance(index, int) and -count <= index < count:
            return _IndexedBlock(self, index % count)
        raise self.indexed_call_error(index)

    def call_by_index(self, index: int, *args: Any, **kwargs: Any) -> Any:
        """``trunk[index](...)`` inside a step: a loop by index (``for i in range(len(self.blocks)): x =
        self.blocks[i](x)``) runs as the loop over the list does, provided it calls every block once, in order."""
        stage_pass = self._require_active()
        if self._ran or index != self._next_index:
            raise self.indexed_call_error(index)
        self._next_index += 1
        start, end = self.bounds[self.local[stage_pass.chunk]]
        return BlockCall(self, index, start, end, stage_pass)(*args, **kwargs)

    def indexed_call_error(self, index: Any) -> TrunkUsageError:
        expected = (f"{self.name}[{self._next_index}] is the block to call next" if isinstance(index, int) and not self._ran
                    else f"the step already looped over {self.name}")
        return TrunkUsageError(
            f"{self.name}[{index!r}] inside a pipelined step ({expected}): the stages split {self.name} by position, so "
            f"its blocks must run once each, in order, in one pass: for block in self.{self.name.split('.')[-1]}: ... "
            f"(or by index, {self.name.split('.')[-1]}[0], [1], ...). Move blocks that run on their own out of the list, "
            "or name another trunk with PipeStrategy(module=...)."
        )

    def block_attribute(self, index: int, name: str) -> Any:
        """Attribute ``name`` of block ``index``: the block's own where this process holds it, else the
        plain attribute saved at the cut (a stub has no other; its submodules' plain attributes too), and the
        train/eval mode the module is in now."""
        if index in self.owned:
            return getattr(self.trunk._modules[str(index)], name)
        if name == "training":  # the stub follows module.train() / eval() as the block would
            return self.trunk._modules[str(index)].training
        try:
            return self.attributes[index][name]
        except KeyError:
            raise AttributeError(
                f"{self.name}[{index}].{name}: this process holds only a stub of that block, and {name!r} is not one "
                "of its plain attributes"
            ) from None

    def _require_active(self) -> StagePass:
        if self._active is None:
            held = ", ".join(f"{self.name}[{self.bounds[vs][0]}:{self.bounds[vs][1]}]" for vs in self.local)
            raise TrunkUsageError(
                f"{self.name} is split across pipeline stages and this process only holds {held}, so it runs only "
                "inside a pipelined step. Outside one (after fit, or a logger drawing the graph from "
                "example_input_array) load the checkpoint into a fresh module with MyModule.load_from_checkpoint(path), "
                "or turn the graph off (e.g. TensorBoardLogger(log_graph=False))."
            )
        return self._active


def check_shared_layers(trunk: nn.Sequential | nn.ModuleList, name: str, bounds: Sequence[tuple[int, int]]) -> None:
    """Refuse a split that puts layers sharing a parameter (the same module at two positions, as ALBERT repeats its
    block, or tied weights) on different virtual stages: each stage would train its own copy, apart from the other.

    Raises:
        SharedParameterError: naming the two layers, their stages and a ``balance`` that keeps them together.
    """
    first: dict[int, tuple[int, int]] = {}  # parameter -> (the first layer using it, its virtual stage)
    for vs, (start, end) in enumerate(bounds):
        for index in range(start, end):
            for p in trunk[index].parameters():
                seen = first.setdefault(id(p), (index, vs))
                if seen[1] != vs:
                    raise SharedParameterError(
                        f"{name}[{seen[0]}] and {name}[{index}] share parameters (the same module, or tied weights), but "
                        f"the split puts them on virtual stages {seen[1]} and {vs}, which would train their own copies "
                        f"apart; choose a balance that keeps {name}[{seen[0]}:{index + 1}] on one stage, or untie them."
                    )


def check_tied_outside(module: nn.Module, trunk_name: str) -> None:
    """Refuse a trunk parameter that a module outside the trunk holds too (a weight tied across the trunk's edge): the
    trunk's layer trains on its stage and the code outside the trunk on the first or the last, each its own copy.

    Raises:
        SharedParameterError: naming both places.
    """
    prefix = trunk_name + "."
    in_trunk: dict[int, str] = {}
    outside: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        (in_trunk if name.startswith(prefix) else outside).setdefault(id(p), name)
    tied = [(outside[i], name) for i, name in in_trunk.items() if i in outside]
    if tied:
        raise SharedParameterError(
            f"{tied[0][0]} is tied to {tied[0][1]}, a parameter of the trunk {trunk_name}: the trunk's layer trains on its "
            "stage and the code outside the trunk on the first or last stage, each its own copy, apart; untie them, or "
            f"move that layer out of {trunk_name}."
        )


class BlockCall:
    """Stands in for block ``index`` of a looped trunk during one step.

    Called like the block, it returns the received activation (a block of an earlier stage, so the
    loop derives the chunk's first input from it as it would from that block's output), runs the
    block (this chunk's blocks) or is never reached
    (blocks of later stages: the chunk's last block ended the step). Other attribute reads go to the
    block, or to its saved plain attributes where this rank holds only a stub.
    """

    def __init__(self, partition: PartitionedTrunk, index: int, start: int, end: int, stage_pass: StagePass) -> None:
        self._partition, self._index, self._start, self._end, self._pass = partition, index, start, end, stage_pass

    def __call__(self, hidden: Any, *args: Any, **kwargs: Any) -> Any:
        index, stage_pass = self._index, self._pass
        partition = self._partition
        check = partition.step_check
        if index < self._start:  # the loop turns what the previous stage's last block returned into our input
            if check is None or index == self._start - 1:
                return stage_pass.received
            return check.mark(stage_pass.received, index)  # any use of it after the loop is a wrong value
        if index == self._start:
            stage_pass.begin_layers()
        output = run_layers(partition.trunk._modules[str(index)], hidden, partition.recompute, *args, **kwargs)
        if check is not None:
            check.note_chunk_output(output)
        if index == self._end - 1 and stage_pass.stop:
            raise StageStop(output)
        return output

    def __getattr__(self, name: str) -> Any:
        return self._partition.block_attribute(self._index, name)


class _BlockView:
    """Block ``index`` where it must not run: its attributes read as the block's (or a stub's saved ones)."""

    def __init__(self, partition: PartitionedTrunk, index: int) -> None:
        self._partition, self._index = partition, index

    def __getattr__(self, name: str) -> Any:
        return self._partition.block_attribute(self._index, name)


class _MissingBlock(_BlockView):
    """Outside a step, a block another process holds: its plain attributes read, a call raises."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._partition._require_active()

    def __repr__(self) -> str:
        return f"{self._partition.name}[{self._index}] (held by another process)"


class _IndexedBlock(_BlockView):
    """``trunk[index]`` inside a step: its attributes read; a call runs it as the loop over the list would, if it is the
    next block in order (:meth:`PartitionedTrunk.call_by_index`)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._partition.call_by_index(self._index, *args, **kwargs)


class _SavedAttributes:
    """A stub's submodule as the cut saw it: its plain attributes (``self_attn.batch_first``) and its submodules'."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)


class _WholeList:
    """``trunk[:]`` inside a step: loops like the trunk."""

    def __init__(self, partition: PartitionedTrunk) -> None:
        self._partition = partition

    def __iter__(self) -> Iterator[Any]:
        return self._partition.iterate()

    def __len__(self) -> int:
        return len(self._partition.trunk)


class _LoopedList:
    """Mixed into a pipelined ModuleList's class: iteration and indexing go to its
    :class:`PartitionedTrunk` inside a step; outside one, indexing reads the list and iteration
    yields what :meth:`PartitionedTrunk.iterate` says."""

    _lightning_pipe: PartitionedTrunk

    def __iter__(self) -> Iterator[Any]:
        return self._lightning_pipe.iterate()

    def __repr__(self) -> str:
        return nn.Module.__repr__(self)  # type: ignore[arg-type]  # ModuleList's own repr iterates

    def __getitem__(self, index: Any) -> Any:
        inside = self._lightning_pipe.item(index)
        if inside is not None:
            return inside
        if isinstance(index, slice):  # a plain list of the entries (ModuleList would build this class again)
            return nn.ModuleList(list(self._modules.values())[index])  # type: ignore[attr-defined]
        return super().__getitem__(index)  # type: ignore[misc]


_LOOPED_CLASSES: dict[type, type] = {}


def _looped_class(cls: type) -> type:
    if cls not in _LOOPED_CLASSES:
        _LOOPED_CLASSES[cls] = type(f"Pipelined{cls.__name__}", (_LoopedList, cls), {"__module__": __name__})
    return _LOOPED_CLASSES[cls]


def _plain_attributes(block: nn.Module) -> dict[str, Any]:
    hidden = {"_parameters", "_buffers", "_modules", "training"}
    plain = {k: v for k, v in vars(block).items() if k not in hidden and not k.startswith("_")
             and not isinstance(v, (torch.Tensor, nn.Module))}
    return {**plain, **{name: _SavedAttributes(_plain_attributes(child)) for name, child in block.named_children()}}


def _same_values(a: Any, b: Any) -> bool:
    """Whether two trunk inputs (tensors, or tuples of them) hold the same values: a step that calls the trunk again on
    its input computes the same thing (one comparison, on that second call only)."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same_values(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a is b or (a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b))
    return a is b or (not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and a == b)
