"""Parameters outside the trunk: every stage holds a copy, only the stages that use one train it.

After the first step each stage reports which of them received a gradient. A parameter used on
several stages (an embedding tied to an LM head) gets its gradients summed across those stages, so
all copies stay identical; every other one is owned by the stage that trains it, which is the copy
checkpoints save and the one global-norm clipping counts.

Buffers outside the trunk (BatchNorm's running statistics, a counter the step updates) have no gradient to tell who
computes them: the stage whose step changed one in the first step owns it (the first stage for code before the trunk,
the last for code after it); a buffer no step changed comes from stage 0, where every copy is alike.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.engine.collectives import all_reduce_flat
from lightning_pipe.engine.sharding import is_sharded, local
from lightning_pipe.engine.stand_ins import is_absent
from lightning_pipe.engine.topology import Topology


def buffer_slots(module: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """Every buffer of ``module``: its name in the state dict, the module that holds it and its attribute there (what
    reads and writes it in place, whatever tensor the attribute holds by then)."""
    return [(f"{path}.{leaf}" if path else leaf, holder, leaf)
            for path, holder in module.named_modules() for leaf, _ in holder.named_buffers(recurse=False)]


def reject_shared(users: dict[str, list[int]], why: str, error: type[Exception]) -> None:
    """Raise ``error`` naming every parameter used on several stages (``users``: name -> stages),
    for schedules that step each stage's parameters on their own; ``why`` says what goes wrong."""
    shared = sorted(name for name, stages in users.items() if len(stages) > 1)
    if shared:
        raise error(
            f"parameters {', '.join(shared)} are used on several stages, {why}; untie them or use a "
            "synchronous schedule such as '1f1b'."
        )


class OutsideParameters:
    """Usage, ownership and cross-stage gradient handling of the parameters outside the trunk.

    Args:
        module: the (partitioned) LightningModule.
        trunk_name: attribute path of the trunk.
        topology: this rank's place in the pipelines.
    """

    def __init__(self, module: nn.Module, trunk_name: str, topology: Topology) -> None:
        self.module = module
        self.prefix = trunk_name + "."
        self.topology = topology
        self.users: dict[str, list[int]] | None = None  # parameter -> stages that use it
        self.buffer_users: dict[str, list[int]] = {}  # buffer -> stages whose first step changed it
        self._buffers_before: dict[str, torch.Tensor] | None = None  # until learn(): the buffers before the first step

    @property
    def known(self) -> bool:
        return self.users is not None

    def in_trunk(self, name: str) -> bool:
        return name.startswith(self.prefix)

    def learn(self, used: Iterable[str] | None = None) -> None:
        """Collective over the pipeline: gather which parameters each stage used (default: those
        with a gradient now)."""
        if used is None:
            used = [n for n, p in self.module.named_parameters() if p.grad is not None]
        mine = sorted(n for n in used if not self.in_trunk(n))
        changed = self._changed_buffers()
        per_stage: list[Any] = [(mine, changed)]
        if self.topology.stages > 1:
            per_stage = [None] * self.topology.stages
            dist.all_gather_object(per_stage, (mine, changed), group=self.topology.pipeline_group)
        self.users, self.buffer_users = {}, {}
        for stage, (names, buffers) in enumerate(per_stage):
            for name in names:
                self.users.setdefault(name, []).append(stage)
            for name in buffers:
                self.buffer_users.setdefault(name, []).append(stage)

    def note_buffers(self) -> None:
        """Before the first training step: copy the buffers outside the trunk, for :meth:`learn` to find which
        stages' steps change them."""
        if self.users is None and self._buffers_before is None:
            self._buffers_before = {name: buffer.detach().to("cpu", copy=True) for name, buffer in self._buffers()}

    def buffers(self) -> list[tuple[str, nn.Module, str]]:
        """The buffers outside the trunk, as :func:`buffer_slots` lists them."""
        return [slot for slot in buffer_slots(self.module) if not self.in_trunk(slot[0])]

    def _buffers(self) -> list[tuple[str, torch.Tensor]]:
        present = [(name, getattr(holder, leaf)) for name, holder, leaf in self.buffers()]
        return [(name, buffer) for name, buffer in present if not is_absent(buffer)]

    def _changed_buffers(self) -> list[str]:
        before, self._buffers_before = self._buffers_before or {}, None
        return sorted(name for name, buffer in self._buffers()
                      if name in before and not torch.equal(buffer.detach().cpu(), before[name]))

    def modules(self) -> dict[str, nn.Module]:
        """The modules outside the trunk that hold parameters (the LightningModule itself and the trunk excluded),
        by name."""
        trunk = self.prefix[:-1]
        return {name: m for name, m in self.module.named_modules()
                if name and name != trunk and not self.in_trunk(name + ".") and any(True for _ in m.parameters())}

    def only_this_stage_trains(self, called: set[str]) -> list[str]:
        """The modules outside the trunk that ``data_parallel="fsdp"`` shards from the second step on, outermost
        first and none inside another: each one the first step called (so FSDP2's hooks gather it), every parameter
        under it trained by this stage alone, tied to no other module, and not a scalar. ``called``: the names of
        the modules the first step called (:func:`~lightning_pipe.engine.sharding.calls_recorded`)."""
        users, stage = self.users or {}, self.topology.stage
        appearances: dict[int, int] = {}
        for _, p in self.module.named_parameters(remove_duplicate=False):
            appearances[id(p)] = appearances.get(id(p), 0) + 1

        def shardable(name: str, module: nn.Module) -> bool:
            return name in called and all(
                users.get(f"{name}.{n}") == [stage] and appearances[id(p)] == 1 and p.ndim > 0
                for n, p in module.named_parameters()
            )

        picked: list[str] = []
        for name, module in sorted(self.modules().items(), key=lambda item: item[0].count(".")):
            if not any(name.startswith(outer + ".") for outer in picked) and shardable(name, module):
                picked.append(name)
        return picked

    def owner(self) -> dict[str, int]:
        """The stage whose copy of each used parameter, and of each buffer a step changed, is authoritative (others:
        stage 0)."""
        owners = {name: stages[0] for name, stages in self.buffer_users.items()}
        owners.update({name: stages[0] for name, stages in (self.users or {}).items()})
        return owners

    def sum_shared_gradients(self) -> None:
        """Sum the gradients of parameters used on several stages, across the pipeline."""
        users = self.users or {}
        shared = [p for n, p in self.module.named_parameters() if len(users.get(n, ())) > 1]
        if not shared or self.topology.stages == 1:
            return
        grads = []
        for p in shared:
            if is_absent(p):  # a stand-in: this rank takes part in the sum with zeros, and keeps none of it
                grads.append(torch.zeros(p.shape, dtype=p.dtype, device=p.device))
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        all_reduce_flat(grads, self.topology.pipeline_group)

    def clip_by_global_norm(self, optimizer: Any, clip_val: float, device: torch.device) -> None:
        """Norm clipping over the whole model: every parameter counted once, on the stage owning it."""
        owner, stage = self.owner(), self.topology.stage
        squares = torch.zeros((), device=device)
        shards = torch.zeros((), device=device)  # data_parallel="fsdp": this rank's part of the sharded gradients
        sharded = False
        for name, p in self.module.named_parameters():
            counted = self.in_trunk(name) or owner.get(name, 0) == stage
            if p.grad is not None and counted:
                if is_sharded(p.grad):
                    sharded = True
                    shards = shards + local(p.grad).detach().float().pow(2).sum()
                else:
                    squares = squares + p.grad.detach().float().pow(2).sum()
        if sharded:  # every copy of the stage holds the same units: all take part
            dist.all_reduce(shards, group=self.topology.stage_group)
            squares = squares + shards
        if self.topology.stages > 1:
            dist.all_reduce(squares, group=self.topology.pipeline_group)
        coef = (float(clip_val) / (squares.sqrt() + 1e-6)).clamp(max=1.0)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    local(p.grad).detach().mul_(coef.to(p.grad.dtype))
