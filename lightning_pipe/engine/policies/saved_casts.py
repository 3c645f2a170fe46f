"""Live weights under autocast: a backward reads the weights the storage holds when it runs.

pipemare's and xpipe's backwards read whatever their parameters' storage holds when they run
(docs/async-semantics.md, implementation notes). Under autocast a forward does not save a Linear's weight
for the backward but the low-precision cast it made of it: a tensor of its own, which no exchange or copy
into the storage reaches, so the backward would read the forward's weights. :class:`BackwardCasts` saves
such a cast as the parameter it came from and, when the backward unpacks it, casts what the storage then
holds. The cast is kept while the storage holds the same values (a backward per micro-batch reads the same
weights between two STEPs), so a stage casts its weights for its backwards about once per STEP, and the
micro-batches in flight no longer keep a copy each.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Hashable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, ContextManager

import torch
from torch import Tensor


@functools.cache
def _cast_node_type() -> type:
    """The autograd node of a cast (``ToCopyBackward0``), found once by making one (with autograd recording,
    wherever it is called from)."""
    with torch.enable_grad():
        return type(torch.zeros((), requires_grad=True).to(torch.float64).grad_fn)


@dataclass(frozen=True, eq=False)
class _CastOfParameter:
    """What the forward saved in place of a cast of ``parameter`` (or a view of one)."""

    parameter: Tensor
    dtype: torch.dtype
    device: torch.device
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class BackwardCasts:
    """Saved-tensor hooks that make a stage's backward read its parameters' current values under autocast.

    Args:
        params: the stage's parameters by name (the live storage).
        stage: for messages.
        held: a token of the values the parameters hold now; it must change whenever they change (a cast
            made for one token is reused while the token stays the same).
    """

    def __init__(self, params: Mapping[str, Tensor], stage: int, held: Callable[[], Hashable]) -> None:
        self._name_of = {id(p): n for n, p in params.items()}
        self._device_type = next(iter(params.values())).device.type if params else "cpu"
        self._stage = stage
        self._held = held
        self._casts: dict[tuple[int, torch.dtype, torch.device], Tensor] = {}
        self._casts_hold: Hashable = None  # the token the kept casts were made at
        self._warned: set[str] = set()  # parameters cast after another operation, said once
        self._cast_type = _cast_node_type()  # read at every tensor a forward saves: no call there

    def hooks(self) -> ContextManager[Any]:
        """The context a forward runs in: the hooks under autocast, else nothing."""
        if not torch.is_autocast_enabled(self._device_type):
            return nullcontext()
        if torch.is_autocast_cache_enabled():  # (Lightning turns it off) a cast cached by an earlier forward holds other values
            torch.clear_autocast_cache()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def forget(self) -> None:
        """Drop the kept casts (the values may change without the token saying so: a checkpoint, a new segment)."""
        self._casts, self._casts_hold = {}, None

    def _pack(self, saved: Tensor) -> Tensor | _CastOfParameter:
        """``saved`` as the parameter it is a cast of (autocast's, or any ``.to`` in the forward); else ``saved``."""
        base = saved._base
        cast = saved if base is None else base
        node = cast.grad_fn
        if type(node) is not self._cast_type:
            return saved
        source = node.next_functions[0][0]
        parameter = getattr(source, "variable", None)  # the AccumulateGrad of a leaf
        if parameter is not None and id(parameter) in self._name_of and cast.stride() == parameter.stride():
            return _CastOfParameter(parameter, cast.dtype, cast.device, saved.size(), saved.stride(), saved.storage_offset())
        self._warn_if_cast_after_another_operation(source)
        return saved

    def _unpack(self, packed: Tensor | _CastOfParameter) -> Tensor:
        """What the backward reads: ``packed``, or the parameter's values now, cast and viewed as the forward's were."""
        if not isinstance(packed, _CastOfParameter):
            return packed
        held = self._held()
        if held != self._casts_hold:
            self.forget()
            self._casts_hold = held
        key = (id(packed.parameter), packed.dtype, packed.device)
        cast = self._casts.get(key)
        if cast is None:
            cast = self._casts[key] = packed.parameter.detach().to(device=packed.device, dtype=packed.dtype)
        return cast.as_strided(packed.size, packed.stride, packed.offset)

    def _warn_if_cast_after_another_operation(self, node: Any) -> None:
        """Say once per parameter when a cast the forward saved comes from a parameter through other operations (a
        transposed tied weight, ``1 + weight``): it keeps the forward's values, which the backward then reads."""
        for _ in range(5):  # a short chain of one-input operations: the transposes and reshapes of a weight
            if node is None:
                return
            name = self._name_of.get(id(getattr(node, "variable", None)))
            if name is not None:
                if name not in self._warned:
                    self._warned.add(name)
                    warnings.warn(f"lightning_pipe: under autocast, stage {self._stage}'s forward casts parameter {name!r} "
                                  "after another operation (a transpose or a computation), so its backward reads that "
                                  "cast as the forward made it, not the weights the schedule gives the backward; cast "
                                  "the parameter itself (e.g. F.linear(x, weight) rather than weight.t()).",
                                  stacklevel=3)
                return
            if len(node.next_functions) != 1:
                return
            node = node.next_functions[0][0]
