"""Finding the trunk: the ``nn.Sequential`` or ``nn.ModuleList`` of a LightningModule that the pipeline splits.

Without ``module=...`` every ``nn.Sequential`` and ``nn.ModuleList`` at any depth with at least two
entries and some parameters is a candidate, and the one holding the most parameters wins. A choice
that could be wrong is refused with the candidates and their parameter counts instead of trained
silently (docs/models.md): when the winner holds less than :data:`MIN_SHARE` of the module's
parameters (the blocks probably live elsewhere), or when another candidate that is neither inside
nor around it holds at least :data:`CLOSE` times as many (an encoder next to a decoder).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lightning_pipe.errors import TrunkError

Trunk = nn.Sequential | nn.ModuleList

#: The winner must hold at least this share of the module's parameters.
MIN_SHARE = 0.3
#: A candidate outside the winner with at least this fraction of its parameters makes the choice ambiguous.
CLOSE = 0.5


@dataclass(frozen=True)
class Candidate:
    """A container that could be the trunk."""

    path: str  #: dotted attribute path from the module
    container: Trunk
    parameters: int  #: trainable parameters inside it (shared ones once); every parameter when all are frozen

    def contains(self, other: Candidate) -> bool:
        return other.path.startswith(self.path + ".")

    def describe(self) -> str:
        return f"{self.path} ({type(self.container).__name__} of {len(self.container)}, {self.parameters:,} parameters)"


def find_trunk(module: nn.Module, name: str | None = None) -> tuple[str, Trunk]:
    """Return ``(attribute_path, container)`` of the trunk.

    Args:
        module: the (Lightning) module.
        name: dotted attribute path of the trunk; ``None`` picks the ``nn.Sequential`` or
            ``nn.ModuleList`` holding most of the module's parameters (see the module docstring).

    Raises:
        TrunkError: no candidate, an ambiguous or doubtful choice, or ``name`` is not a container.
    """
    if name is not None:
        return name, _named(module, name)
    trainable = True
    found = candidates_of(module)
    if not found:  # everything frozen for now (BackboneFinetuning unfreezes it later): count every parameter
        trainable, found = False, candidates_of(module, trainable=False)
    candidates = sorted(found, key=lambda c: (-c.parameters, c.path.count("."), c.path))
    owner = type(module).__name__
    if not candidates:
        raise TrunkError(
            f"{owner} has no nn.Sequential or nn.ModuleList with parameters to split into pipeline stages; put the "
            "layers to pipeline in one (e.g. self.blocks = nn.ModuleList(...) or self.model = nn.Sequential(...))."
        )
    chosen = candidates[0]
    rivals = [c for c in candidates[1:] if not chosen.contains(c) and c.parameters >= CLOSE * chosen.parameters]
    total = _count(module, trainable)
    _refuse_a_dict_of_blocks(module, chosen, trainable)
    if rivals:
        listing = "; ".join(c.describe() for c in [chosen, *rivals])
        raise TrunkError(
            f"{owner} has several containers that could be the pipeline's trunk ({listing}); name the one to split "
            f"with PipeStrategy(module={chosen.path!r}) or module={rivals[0].path!r}."
        )
    if total and chosen.parameters < MIN_SHARE * total:
        listing = "; ".join(c.describe() for c in _outermost(candidates)[:6])
        raise TrunkError(
            f"{owner}'s largest container {chosen.describe()} holds only {chosen.parameters / total:.0%} of its "
            f"{total:,} parameters, so it is probably not the blocks to pipeline (candidates: {listing}); name the "
            "trunk with PipeStrategy(module='...') or put the blocks in one nn.ModuleList or nn.Sequential."
        )
    return chosen.path, chosen.container


def container_name(trunk: nn.Module) -> str:
    """How an error names the trunk's container: ``nn.Sequential``, ``nn.ModuleList``, or a subclass's
    own name with the base it extends (``Blocks (an nn.ModuleList)``), so advice fits the user's code."""
    for base in (nn.Sequential, nn.ModuleList):
        if type(trunk) is base:
            return f"nn.{base.__name__}"
        if isinstance(trunk, base):
            return f"{type(trunk).__name__} (an nn.{base.__name__})"
    return type(trunk).__name__


def candidates_of(module: nn.Module, trainable: bool = True) -> list[Candidate]:
    """Every ``nn.Sequential`` and ``nn.ModuleList`` below ``module`` with two or more entries and
    parameters (``trainable``: trainable ones; a frozen teacher beside the student is no candidate)."""
    found = []
    for path, child in module.named_modules():
        if path and isinstance(child, (nn.Sequential, nn.ModuleList)) and len(child) >= 2:
            count = _count(child, trainable)
            if count:
                found.append(Candidate(path, child, count))
    return found


def _refuse_a_dict_of_blocks(module: nn.Module, chosen: Candidate, trainable: bool) -> None:
    """The blocks kept in an ``nn.ModuleDict`` (``for name, block in self.blocks.items()``), none holding half of
    them, around the chosen container: say to make it a list, rather than offer a container inside one block."""
    for path, child in module.named_modules():
        if not (isinstance(child, nn.ModuleDict) and len(child) >= 3 and chosen.path.startswith(f"{path}.")):
            continue
        if max(_count(block, trainable) for block in child.values()) < CLOSE * _count(child, trainable):
            raise TrunkError(
                f"{type(module).__name__}.{path} is an nn.ModuleDict of {len(child)} blocks; the pipeline cuts an "
                "nn.ModuleList or nn.Sequential by position, and a dict's blocks cannot be split that way. Make it "
                f"nn.ModuleList([...]) (keep the names beside it if the step needs them: for name, block in "
                f"zip(self.block_names, self.{path.split('.')[-1]})), or name another trunk with PipeStrategy(module=...)."
            )


def _outermost(candidates: list[Candidate]) -> list[Candidate]:
    """The candidates not inside another one (what an error lists)."""
    return [c for c in candidates if not any(o.contains(c) for o in candidates)]


def _count(module: nn.Module, trainable: bool = True) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable)


def _named(module: nn.Module, name: str) -> Trunk:
    target: object = module
    for part in name.split("."):
        if not hasattr(target, part):
            listing = "; ".join(c.describe() for c in _outermost(candidates_of(module))) or "none"
            raise TrunkError(
                f"{type(module).__name__} has no attribute {name!r}; set PipeStrategy(module=...) to the path of its "
                f"nn.Sequential or nn.ModuleList trunk (candidates: {listing})."
            )
        target = getattr(target, part)
    if not isinstance(target, (nn.Sequential, nn.ModuleList)):
        raise TrunkError(
            f"{type(module).__name__}.{name} is a {type(target).__name__}, not an nn.Sequential or nn.ModuleList; "
            "name the container of the blocks to pipeline, or wrap them in one."
        )
    return target
