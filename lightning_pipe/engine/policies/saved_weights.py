"""Live weights in a backward: what the backward reads of its stage's parameters, chosen when it runs.

pipemare's and xpipe's backwards read the weights the policy gives them when they run, not the ones their
forward ran on (docs/async-semantics.md, implementation notes). A forward's graph keeps, for the backward,
the parameters it used (or views of them) and, under autocast, the low-precision cast it made of each: a
tensor of its own, which no exchange or copy into the parameters' storage reaches, so the backward would read
the forward's weights. :class:`BackwardWeights` holds saved-tensor hooks that keep such a cast as a reference
to the parameter it came from, and, when the policy *redirects* (xpipe always, pipemare where storages cannot be
exchanged in place: ``live.how_values_move``), the parameters and their views too; when the backward unpacks one, it gets the
values the policy names at that moment (:attr:`BackwardWeights.values`), viewed and cast as the forward's were.
A cast is kept while those values stay the same (a backward per micro-batch reads the same weights between two
STEPs), so a stage casts its weights for its backwards about once per STEP, and the micro-batches in flight no
longer keep a copy each.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Hashable, Mapping
from contextlib import nullcontext
from typing import Any, ContextManager, NamedTuple

import torch
from torch import Tensor


@functools.cache
def _cast_node_type() -> type:
    """The autograd node of a cast (``ToCopyBackward0``), found once by making one (with autograd recording,
    wherever it is called from)."""
    with torch.enable_grad():
        return type(torch.zeros((), requires_grad=True).to(torch.float64).grad_fn)


class _View(NamedTuple):
    """A view of parameter ``name`` the forward saved (when redirecting): its geometry, ``offset`` counted from
    the parameter's first element. (The parameter itself is saved as its name alone.)"""

    name: str
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class _Cast(NamedTuple):
    """A cast of parameter ``name`` the forward saved (or a view of that cast): the cast's type and the view's
    geometry in it."""

    name: str
    dtype: torch.dtype
    device: torch.device
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class BackwardWeights:
    """Saved-tensor hooks that make a stage's backward read the weights its policy names when it runs.

    Args:
        params: the stage's parameters by name (the live storage).
        stage: for messages.
        held: a token of the values :attr:`values` holds now; it must change whenever they change (the views and
            casts made for one token are reused while it stays the same).
        redirect: also keep the parameters and their views as references (the policy gives a backward
            values outside the parameters' storage); else only casts are, under autocast.
    """

    def __init__(self, params: Mapping[str, Tensor], stage: int, held: Callable[[], Hashable],
                 redirect: bool = False) -> None:
        self._name_of = {id(p): n for n, p in params.items()}
        self._device_type = next(iter(params.values())).device.type if params else "cpu"
        self._stage = stage
        self._held = held
        self.redirect = redirect
        #: the tensors a backward unpacking now reads, by parameter name, laid out as the parameters (the
        #: parameters themselves unless the policy points the backward elsewhere for its duration)
        self.values: Mapping[str, Tensor] = params
        self._params = params
        # what unpacking made for the token ``_kept_for``: a backward per micro-batch reads the same weights
        # between two STEPs, so a stage casts (and views) its weights for its backwards about once per STEP
        self._casts: dict[tuple[str, torch.dtype, torch.device], Tensor] = {}
        self._views: dict[_View | _Cast, Tensor] = {}
        self._kept_for: Hashable = None
        self._warned: set[str] = set()  # parameters cast after another operation, said once
        self._cast_type = _cast_node_type()  # read at every tensor a forward saves: no call there

    def hooks(self) -> ContextManager[Any]:
        """The context a forward runs in: the hooks where the policy redirects or under autocast, else nothing."""
        autocast = torch.is_autocast_enabled(self._device_type)
        if autocast and torch.is_autocast_cache_enabled():  # (Lightning turns it off) an earlier forward's cast: other values
            torch.clear_autocast_cache()
        if autocast:
            return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        if self.redirect:  # no casts to find: a check of the tensor's identity only (a call per saved tensor)
            return torch.autograd.graph.saved_tensors_hooks(self._pack_parameter, self._unpack)
        return nullcontext()

    def forget(self) -> None:
        """Drop the kept casts and views (the values may change without the token saying so: a checkpoint, a new
        segment)."""
        self._casts, self._views, self._kept_for = {}, {}, None

    def _pack_parameter(self, saved: Tensor) -> Tensor | str | _View:
        """``saved`` as the name of the parameter it is, or as a :class:`_View` of one; else ``saved`` itself."""
        base = saved._base
        if base is None:
            return self._name_of.get(id(saved), saved)
        name = self._name_of.get(id(base))
        if name is None:
            return saved
        return _View(name, saved.size(), saved.stride(), saved.storage_offset() - base.storage_offset())

    def _pack(self, saved: Tensor) -> Tensor | str | _View | _Cast:
        """``saved`` as a reference to the parameter it is or is a view of (when redirecting), or is a cast of
        (autocast's, or any ``.to`` in the forward); else ``saved`` itself."""
        base = saved._base
        root = saved if base is None else base
        if self.redirect and id(root) in self._name_of:
            return self._pack_parameter(saved)
        node = root.grad_fn
        if type(node) is not self._cast_type:
            return saved
        source = node.next_functions[0][0]
        name = self._name_of.get(id(getattr(source, "variable", None)))  # the AccumulateGrad of a leaf
        if name is not None and root.stride() == self._params[name].stride():
            return _Cast(name, root.dtype, root.device, saved.size(), saved.stride(), saved.storage_offset())
        self._warn_if_cast_after_another_operation(source)
        return saved

    def _unpack(self, packed: Tensor | str | _View | _Cast) -> Tensor:
        """What the backward reads: ``packed``, or the values :attr:`values` holds now for its parameter,
        viewed and cast as the forward's were."""
        kind = type(packed)
        if kind is str:
            return self.values[packed]
        if kind is not _View and kind is not _Cast:
            return packed
        held = self._held()
        if held != self._kept_for:
            self.forget()
            self._kept_for = held
        view = self._views.get(packed)
        if view is None:
            view = self._views[packed] = self._view(packed)
        return view

    def _view(self, packed: _View | _Cast) -> Tensor:
        """``packed`` made from the values :attr:`values` holds now."""
        values = self.values[packed.name].detach()
        if type(packed) is _View:
            return values.as_strided(packed.size, packed.stride, values.storage_offset() + packed.offset)
        key = (packed.name, packed.dtype, packed.device)
        cast = self._casts.get(key)
        if cast is None:
            cast = self._casts[key] = values.to(device=packed.device, dtype=packed.dtype)
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
