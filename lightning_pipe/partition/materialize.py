"""Build on the meta device, then give this rank real tensors for only what it holds.

:class:`MetaConstruction` is the context ``PipeStrategy`` runs ``LightningModule.configure_model`` in
(and ``trainer.init_module()``): every parameter and buffer created there lives on the meta device,
which costs no memory, and the order in which modules finish their construction is recorded, with
what each module held at that moment (a weight tied later still has its own initial tensor) and the
CPU random state the construction started from.

After the trunk is cut, :func:`materialize` replays the construction's initialisation on CPU: it
walks the recorded modules in order, gives each its tensors, and runs its initialiser
(``module.reset_parameters()``, or the LightningModule's ``reset_module_parameters(module)`` hook).
Tensors this rank keeps stay; the others (another stage's layers) are allocated one module at a time
and freed at once, only so that the random generator advances exactly as it did on one device. The
kept weights therefore equal those of building the module on one CPU with the same seed, at the
price of running every module's initialiser on every rank and a transient of the largest module's
own tensors (docs/large-models.md says when equality cannot hold).
"""

from __future__ import annotations

import ctypes
import gc
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.module import register_module_module_registration_hook

from lightning_pipe.engine.stand_ins import is_absent
from lightning_pipe.errors import PipeConfigError

#: the LightningModule method that replaces ``module.reset_parameters()`` when defined
INIT_HOOK = "reset_module_parameters"

Initialiser = Callable[[nn.Module], None]


@dataclass
class Constructed:
    """A module as it stood when its construction finished."""

    module: nn.Module
    parameters: dict[str, Tensor | None]
    buffers: dict[str, Tensor | None]


class MetaConstruction:
    """Context: new tensors on the meta device; records the modules in the order they are finished.

    A module is finished when it is assigned to its parent (its ``__init__``, and so its own
    ``reset_parameters()``, ran before that). Modules never assigned anywhere (the root, or a module
    that only a local variable held) come last, in ``root.modules()`` order.
    """

    def __init__(self) -> None:
        self.finished: list[Constructed] = []
        self.rng_state: Tensor | None = None  # the CPU generator's state the construction drew from
        self._entry_state: Tensor | None = None
        self._exits: list[Any] = []

    def __enter__(self) -> MetaConstruction:
        self._entry_state = torch.get_rng_state()
        meta = torch.device("meta")
        meta.__enter__()
        hook = register_module_module_registration_hook(self._finished)
        self._exits = [lambda: meta.__exit__(None, None, None), hook.remove]
        return self

    def __exit__(self, *exc: Any) -> None:
        for leave in reversed(self._exits):
            leave()
        self._exits = []
        self.rng_state = self._start_state()

    def _finished(self, parent: nn.Module, name: str, child: nn.Module | None) -> None:
        if child is not None and _has_meta(child):
            self.finished.append(Constructed(child, dict(child._parameters), dict(child._buffers)))

    def _start_state(self) -> Tensor:
        """Meta tensors draw no random numbers, so the generator is where the construction left it
        only if the hook re-seeded it (``torch.manual_seed`` as its first line): replay from there."""
        assert self._entry_state is not None
        now = torch.get_rng_state()
        if torch.equal(now, self._entry_state):
            return self._entry_state
        reseeded = torch.Generator().manual_seed(torch.initial_seed()).get_state()
        if not torch.equal(now, reseeded):
            warnings.warn(
                "lightning_pipe: configure_model drew random numbers on real tensors while building on the meta device; "
                "the replayed initial weights may differ from one device's (docs/large-models.md).", stacklevel=2,
            )
        return now

    def order(self, root: nn.Module) -> list[Constructed]:
        """Every module to initialise, in the order of their construction (each once)."""
        seen: set[int] = set()
        ordered = []
        for entry in self.finished:
            if id(entry.module) not in seen:
                seen.add(id(entry.module))
                ordered.append(entry)
        for module in root.modules():
            if id(module) not in seen and _has_meta(module):
                seen.add(id(module))
                ordered.append(Constructed(module, dict(module._parameters), dict(module._buffers)))
        return ordered


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` (at any depth) is on the meta device."""
    return any(t.is_meta for t in _tensors(module, recurse=True))


def materialize(root: nn.Module, construction: MetaConstruction, initialiser: Initialiser | None = None,
                initialised: Callable[[nn.Module], Iterable[nn.Module]] | None = None) -> None:
    """Give every meta tensor still reachable from ``root`` (the cut module) real CPU memory, with
    the values building the whole module on one CPU would have given it; restore the CPU random
    state one-device construction would leave.

    Args:
        root: the module after the cut: its meta tensors are the ones this rank keeps.
        construction: the record of how the module was built.
        initialiser: called with each module in place of ``module.reset_parameters()``.
        initialised: called with each module of the construction once it is done (its initialiser ran, after
            every module built inside it); returns the modules it replaced the tensors of, whose whole
            tensors are dropped at once (``data_parallel="fsdp"`` shards each trunk layer as soon as it is
            initialised: :meth:`~lightning_pipe.engine.sharding.ShardedLayers.shard_initialised`).
    """
    kept = {id(t) for t in _tensors(root, recurse=True) if t.is_meta}
    real: dict[int, Tensor] = {}  # id of a kept meta tensor -> its real tensor
    uninitialised = []
    if construction.rng_state is not None:
        torch.set_rng_state(construction.rng_state)
    order = construction.order(root)
    entries = {id(entry.module): entry for entry in order}
    for entry in order:
        module = entry.module
        initialise = _initialiser(module, initialiser)
        if initialise is None:  # a stand-in's module counts too: every rank must stop, not only the users
            if any(id(t) in kept for t in _entry_tensors(entry)) or any(is_absent(t) for t in _tensors(module, recurse=False)):
                uninitialised.append(module)
        else:
            current = (dict(module._parameters), dict(module._buffers))
            module._parameters.update({n: _real(t, real, kept) for n, t in entry.parameters.items()})  # type: ignore[misc]
            module._buffers.update({n: _real(t, real, kept) for n, t in entry.buffers.items()})  # type: ignore[misc]
            with torch.no_grad():
                initialise(module)
            # back to what the module holds now (a tied weight stays tied), kept tensors already real so
            # that a parent's initialiser (nn.MultiheadAttention's) reaches its children's values
            for store, now in ((module._parameters, current[0]), (module._buffers, current[1])):
                store.clear()
                store.update({n: real.get(id(t), t) if t is not None else t for n, t in now.items()})
        if initialised is not None and not uninitialised:
            for replaced in initialised(module):
                for inner in replaced.modules():  # the whole tensors it no longer holds
                    done = entries.get(id(inner))
                    for t in _entry_tensors(done) if done is not None else ():
                        real.pop(id(t), None)
    if uninitialised:
        names = {id(m): n or "the LightningModule itself" for n, m in root.named_modules()}
        listing = ", ".join(f"{names.get(id(m), '?')} ({type(m).__name__})" for m in uninitialised[:8])
        itself = any(m is root for m in uninitialised)
        raise PipeConfigError(
            f"the module was built on the meta device (in configure_model or under trainer.init_module()), and these of "
            f"its modules hold tensors but have no reset_parameters(), so this stage cannot create their values: {listing}. "
            f"Give them a reset_parameters() method, or define {INIT_HOOK}(self, module) on your LightningModule (for a "
            "Hugging Face model: self.model._init_weights(module))"
            + (f"; the LightningModule's own tensors (registered in its __init__) reach {INIT_HOOK} as module=self"
               if itself else "") + "; docs/large-models.md."
        )
    for module in root.modules():  # every kept meta tensor, wherever it is referenced (tied weights too)
        for store in (module._parameters, module._buffers):
            for name, t in store.items():
                if t is not None and t.is_meta:
                    store[name] = _real(t, real, kept)
    release_memory()


def release_memory() -> None:
    """Collect garbage and hand freed heap memory back to the system (glibc only): after dropping
    another stage's layers, the process's resident memory shrinks to its share."""
    gc.collect()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass


def _real(t: Tensor | None, real: dict[int, Tensor], kept: set[int]) -> Any:
    """The real tensor for meta tensor ``t`` (one per kept tensor; a fresh one otherwise)."""
    if t is None or not t.is_meta:
        return t
    if id(t) in real:
        return real[id(t)]
    data = torch.empty_like(t, device="cpu")
    value: Tensor = nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else data
    if id(t) in kept:
        real[id(t)] = value
    return value


def _initialiser(module: nn.Module, hook: Initialiser | None) -> Initialiser | None:
    if hook is not None:
        return hook
    reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)  # nn.MultiheadAttention
    return (lambda m: reset()) if callable(reset) else None


def _has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in _tensors(module, recurse=False))


def _entry_tensors(entry: Constructed) -> Iterator[Tensor]:
    yield from (t for t in entry.parameters.values() if t is not None)
    yield from (t for t in entry.buffers.values() if t is not None)


def _tensors(module: nn.Module, recurse: bool) -> Iterator[Tensor]:
    yield from module.parameters(recurse=recurse)
    yield from module.buffers(recurse=recurse)
