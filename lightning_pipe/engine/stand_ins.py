"""Stand-ins for the parameters outside the trunk on the ranks that never run the code using them.

With an ``nn.Sequential`` trunk, a rank that holds neither the first nor the last (virtual) stage only
runs its layers on the activation it receives: the step's code before the trunk (an embedding) runs
on the first stage, the code after it (a head, the loss) on the last. Such a rank never reads the
parameters and buffers outside the trunk, so it keeps **stand-ins** for them instead of the tensors:
each has the tensor's shape, dtype and device, but one element of memory (a zero expanded with stride
0). They keep ``state_dict()`` keys, shapes and parameter counts as they were, move with the module
between devices at no cost, and fail loudly if anything writes into them. The strategy leaves them
out of the optimizer's state, the weight policies, checkpoints (another stage holds the authoritative
copy) and loads.

A looped trunk (``nn.ModuleList``) runs the step's code before the loop on every stage (its blocks take
arguments that code computes, docs/models.md), so no rank knows before the first step which of those
tensors it needs. After it, :func:`release` turns the parameters a rank holds but did not train (the
head on the first stage, the embedding on the last) into stand-ins in place.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

ABSENT = "_lightning_pipe_absent"  #: attribute set on a stand-in


def is_absent(tensor: Tensor | None) -> bool:
    """Whether ``tensor`` is a stand-in (holds no values)."""
    return tensor is not None and getattr(tensor, ABSENT, False)


def runs_outside_code(local: Sequence[int], virtual_stages: int, looped: bool) -> bool:
    """Whether a rank holding the virtual stages ``local`` runs any of the step's code outside the trunk."""
    return looped or any(vs in (0, virtual_stages - 1) for vs in local)


def _one_zero(tensor: Tensor, device: torch.device) -> Tensor:
    """A stand-in's values: one zero on ``device``, expanded (stride 0) to ``tensor``'s shape and dtype."""
    return torch.zeros((), dtype=tensor.dtype, device=device).expand(tensor.shape)


def stand_in(tensor: Tensor, device: torch.device | None = None) -> Tensor:
    """A tensor of ``tensor``'s shape and dtype with one element of memory, on ``device`` (default:
    ``tensor``'s, CPU for a meta tensor); a parameter stays a parameter with its ``requires_grad``."""
    if device is None:
        device = torch.device("cpu") if tensor.is_meta else tensor.device
    data = _one_zero(tensor, device)
    value: Tensor = nn.Parameter(data, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else data
    setattr(value, ABSENT, True)
    return value


def replace_outside(root: nn.Module, outside: Iterable[str], device: torch.device | None = None) -> list[str]:
    """Replace the parameters and buffers named ``outside`` (``state_dict`` names) by stand-ins, wherever
    ``root`` references them (a tied weight stays tied); return the names replaced."""
    targets = {id(t) for name, t in _named_tensors(root) if name in set(outside)}
    made: dict[int, Tensor] = {}
    for module in root.modules():
        for store in (module._parameters, module._buffers):
            for name, t in store.items():
                if t is not None and id(t) in targets:
                    if id(t) not in made:
                        made[id(t)] = stand_in(t, device)
                    store[name] = made[id(t)]  # type: ignore[assignment]
    return [name for name, t in _named_tensors(root) if is_absent(t)]


def release(root: nn.Module, names: Iterable[str]) -> list[str]:
    """Turn the parameters named ``names`` into stand-ins **in place**: the same ``nn.Parameter`` objects
    (an optimizer, a gradient hook or a tie keeps referring to them) now hold one element, and their
    values' memory is free once nothing else refers to it. Return the names released (aliases of a tied
    parameter included)."""
    wanted = set(names)
    released = {id(p) for name, p in root.named_parameters(remove_duplicate=False) if name in wanted}
    for p in root.parameters():  # each object once
        if id(p) in released and not is_absent(p):
            p.data = _one_zero(p, p.device)
            p.grad = None
            setattr(p, ABSENT, True)
    return [name for name, p in root.named_parameters(remove_duplicate=False) if id(p) in released]


def move_stand_ins(root: nn.Module, device: torch.device) -> None:
    """Put every stand-in of ``root`` on ``device`` at no cost (``module.to`` would allocate a stand-in
    at its full size on another device); parameters stay the same objects, as an optimizer holds them."""
    for module in root.modules():
        for store in (module._parameters, module._buffers):
            for name, t in store.items():
                if is_absent(t) and t.device != device:
                    data = _one_zero(t, device)
                    if isinstance(t, nn.Parameter):
                        t.data = data
                    else:
                        store[name] = stand_in(data)


def _named_tensors(root: nn.Module) -> list[tuple[str, Tensor]]:
    return [*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)]
