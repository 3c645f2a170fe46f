"""A stage's trunk layers sharded across the data-parallel copies of that stage (FSDP2).

With ``PipeStrategy(pipelines=N, data_parallel="fsdp")`` the N ranks holding the same stage (the
topology's stage group) each keep ``1/N`` of every trunk layer's parameters, gradients and optimizer
state. The units are ``torch.distributed.fsdp.fully_shard`` units on the "dp" dimension of the ("dp", "pp")
``DeviceMesh`` over the world, made from the topology's stage and pipeline groups (:func:`pipeline_mesh`):
with ``unit="layer"`` each trunk layer is its own unit; with ``unit="stage"`` each chunk of the stage is one
(``fully_shard`` on the ``nn.Sequential`` that runs the chunk's layers), so the chunk's parameters are
gathered and reduce-scattered in one message each and FSDP2's hooks run once per chunk call. A unit is
gathered (all-gathered) once per step and, with ``reshard="step"``, kept whole until its last backward of the
step, as ``torch.distributed.pipelining`` and torchtitan do for pipelines (one all-gather per unit per step,
started when the training step starts: :meth:`ShardedLayers.prefetch`); with ``reshard="micro_batch"`` it is
freed after every forward and every backward and gathered again for the next (``2 × micro_batches``
all-gathers, one unit whole at a time).

With ``reshard="step"`` only the forward whose backward is its chunk's last needs FSDP2's hooks (the one whose
backward reduce-scatters); the chunk's other forwards run the gathered units as plain modules
(:meth:`ShardedLayers.early_forward`). A stage built on the meta device (``configure_model``) is sharded a unit
at a time as it is materialized (``deferred``, :meth:`ShardedLayers.shard_initialised`), never whole.

Gradients are reduce-scattered once per step, not once per micro-batch: every unit runs with
``set_requires_gradient_sync(False)`` (FSDP2 sums the micro-batches' gradients unsharded) except
inside :meth:`ShardedLayers.reducing`, which the executor enters around each chunk's last backward
(:class:`~lightning_pipe.engine.executor.RunOptions`' ``chunk_last_backward``). A trunk layer
belongs to exactly one chunk, so every unit's last backward of the step runs inside it, and FSDP2
reduce-scatters the sum into the sharded parameters' ``.grad`` (a ``DTensor``), averaged over the
stage group like the ``"ddp"`` all-reduce.

Parameters outside the trunk (an embedding, a head) are read by the user's own step code. For the first
step they stay replicated on every copy of the stage and are averaged by
:class:`~lightning_pipe.engine.collectives.GradientReducer` as with ``"ddp"``; that step shows which stage
trains each of them and which modules the step called (:func:`calls_recorded`). From the second step on,
every module outside the trunk that the step called and whose own parameters only this stage trains, tied to
no other module, is an FSDP2 unit too (:meth:`ShardedLayers.add`), and its optimizer state moves onto the
shards (:func:`shard_optimizer_state`). A parameter read directly rather than through its module's call (a
tied weight used as ``F.linear(h, self.pre.weight.t())``) stays replicated: FSDP2's module hooks would not
gather it. Middle stages hold these parameters as one-element stand-ins anyway.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor


def _quiet_state() -> Any:
    """FSDP2's training state in which a unit's forward hooks do nothing but make sure it is gathered (the state of
    a forward recomputed by activation checkpointing in backward), or ``None`` where this PyTorch has none."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    except ImportError:
        return None
    return getattr(TrainingState, "PRE_BACKWARD", None) if hasattr(FSDPModule, "_get_fsdp_state") else None


#: see :meth:`ShardedLayers.early_forward`
_QUIET = _quiet_state()


def is_sharded(tensor: Tensor | None) -> bool:
    """Whether ``tensor`` is a sharded parameter (a ``DTensor``; FSDP2 turns a unit's parameters into them)."""
    return isinstance(tensor, DTensor)


def replicated(params: Sequence[Tensor]) -> list[Tensor]:
    """The parameters of ``params`` that every data-parallel copy holds whole (not :func:`is_sharded`)."""
    return [p for p in params if not is_sharded(p)]


def stage_mesh(group: Any, device: torch.device) -> DeviceMesh:
    """A one-dimensional mesh named ``"dp"`` over the ranks of ``group`` (the stage group: the same stage
    of every pipeline), for a stage sharded outside a pipeline's :class:`~lightning_pipe.engine.topology.Topology`
    (the engine used on its own, tests)."""
    return DeviceMesh.from_group(group, device.type, mesh_dim_names=("dp",))


def pipeline_mesh(stage_group: Any, pipeline_group: Any, pipelines: int, stages: int, rank: int,
                  device: torch.device) -> DeviceMesh:
    """The world as the two-dimensional mesh ``init_device_mesh(device.type, (pipelines, stages),
    mesh_dim_names=("dp", "pp"))`` describes (rank ``= pipeline × stages + stage``), made from the topology's
    existing groups instead of new ones: ``"dp"`` is the stage group (what FSDP2 shards over), ``"pp"`` the
    pipeline group. No group is created, so no rank can create groups in another order, the groups keep the
    strategy's timeout, and a second Trainer call takes the same groups back (docs/architecture.md).

    Raises:
        RuntimeError: a group's ranks are not the mesh's row or column holding ``rank`` (the topology numbers
            ranks differently from the mesh).
    """
    layout = torch.arange(pipelines * stages).view(pipelines, stages)
    for name, group, want in (("dp", stage_group, layout[:, rank % stages]), ("pp", pipeline_group, layout[rank // stages])):
        got = dist.get_process_group_ranks(group)
        if got != want.tolist():
            raise RuntimeError(
                f"rank {rank}'s {'stage' if name == 'dp' else 'pipeline'} group holds ranks {got}, but the "
                f"({pipelines}, {stages}) mesh's {name!r} dimension through rank {rank} is {want.tolist()} "
                "(rank = pipeline × stages + stage): the topology and the mesh number ranks differently."
            )
    return DeviceMesh.from_group([stage_group, pipeline_group], device.type, mesh=layout, mesh_dim_names=("dp", "pp"))


class ShardedLayers:
    """This rank's trunk layers as FSDP2 units (each layer, or each chunk) sharded over the stage group.

    Args:
        layers: the trunk layers this rank holds (every chunk's, in any order); layers without
            parameters (an activation) are left as they are.
        group: the stage group (the ranks holding the same stage, one per pipeline), or a mesh with a
            ``"dp"`` dimension (:func:`pipeline_mesh`), whose ``"dp"`` the units are sharded over.
        device: this rank's device (the mesh's device type).
        reshard: when a layer's gathered copy is freed. ``"step"``: at the end of the step, in the
            layer's last backward (one all-gather per layer per step; the stage's parameters are whole
            during the step). ``"micro_batch"``: after every forward and every backward (``2 ×``
            micro-batches all-gathers per layer per step; one layer whole at a time).
        unit: what one FSDP2 unit is. ``"layer"``: each layer of ``layers``. ``"stage"``: each module of
            ``chunks`` (one per chunk of the stage, each calling its layers in one call, as an ``nn.Sequential``
            does); one all-gather and one reduce-scatter per chunk instead of per layer.
        chunks: with ``unit="stage"``, the modules the chunks' forwards call (their layers are ``layers``).
        deferred: the layers are still on the meta device: shard none now, each as it is initialised
            (:meth:`shard_initialised`, then :meth:`shard_pending`).
    """

    def __init__(self, layers: Sequence[nn.Module], group: Any | DeviceMesh, device: torch.device,
                 reshard: Literal["step", "micro_batch"] = "step", unit: Literal["layer", "stage"] = "layer",
                 chunks: Sequence[nn.Module] | None = None, *, deferred: bool = False) -> None:
        if reshard not in ("step", "micro_batch"):
            raise ValueError(f"reshard={reshard!r}: use 'step' or 'micro_batch'.")
        if unit not in ("layer", "stage"):
            raise ValueError(f"unit={unit!r}: use 'layer' or 'stage'.")
        if unit == "stage" and chunks is None:
            raise ValueError("unit='stage' shards the modules that run each chunk's layers as one call: pass chunks.")
        if isinstance(group, DeviceMesh):
            self.mesh = group["dp"] if group.ndim > 1 else group
        else:
            self.mesh = stage_mesh(group, device)
        self.per_step = reshard == "step"
        #: reshard="step": start the units' all-gathers when a training step starts (:meth:`prefetch`)
        self.prefetching = True
        #: reshard="step": run the forwards whose backward is not their chunk's last without FSDP2's hooks (:meth:`early_forward`)
        self.quiet_early_forwards = True
        self.units: list[FSDPModule] = []
        candidates = [m for m in (chunks if unit == "stage" else layers) if any(p.requires_grad for p in m.parameters())]  # type: ignore[union-attr]
        #: ``deferred``: the units still on the meta device, each sharded once it is initialised (:meth:`shard_initialised`)
        self.pending: list[nn.Module] = candidates if deferred else []
        self._chunk_units = unit == "stage"
        if not deferred:
            self.add(candidates)

    def shard_initialised(self, module: nn.Module) -> list[nn.Module]:
        """While the stage is materialized from the meta device (``deferred``), ``module`` was just initialised
        (:func:`~lightning_pipe.partition.materialize.materialize`): shard the waiting unit it completes (the
        layer itself; with chunk units, the chunk whose layer it is) once the unit holds no meta tensor, so that
        the rank holds one unit whole at a time instead of its whole stage. Return the units sharded."""
        ready = [u for u in self.pending
                 if (u is module or (self._chunk_units and any(c is module for c in u.children())))
                 and not any(t.is_meta for t in (*u.parameters(), *u.buffers()))]
        for unit in ready:
            self.pending.remove(unit)
        self.add(ready)
        return ready

    def shard_pending(self) -> None:
        """Shard the units :meth:`shard_initialised` did not (once the stage is materialized)."""
        pending, self.pending = self.pending, []
        self.add(pending)

    def add(self, modules: Iterable[nn.Module]) -> None:
        """Make each of ``modules`` a unit, sharded and gathered like the others (the trunk's layers at
        construction; modules outside the trunk from the second step on)."""
        for module in modules:
            # each unit is its own root, whose gathered parameters FSDP2 keeps after forward by default:
            # say which is meant
            fully_shard(module, mesh=self.mesh, reshard_after_forward=not self.per_step)
            self.units.append(module)  # type: ignore[arg-type]
        self.accumulate()

    def prefetch(self) -> None:
        """At the start of a training step (``reshard="step"``, while :attr:`prefetching`): start every unit's
        all-gather now, without waiting for it, so that it runs while this rank waits for its first
        activation; a unit's first forward waits for its own. The step keeps every unit gathered anyway, so
        this holds nothing longer than the step does."""
        if self.per_step and self.prefetching:
            for unit in self.units:
                unit.unshard(async_op=True)

    def accumulate(self) -> None:
        """From now on a backward adds to the units' unsharded gradients without communicating (and, resharding
        per step, keeps the layer gathered for the step's next micro-batch)."""
        for unit in self.units:
            unit.set_requires_gradient_sync(False)
            if self.per_step:
                unit.set_reshard_after_backward(False)

    @contextmanager
    def early_forward(self) -> Iterator[None]:
        """Around a forward whose backward is not its chunk's last (the executor's ``chunk_early_forward``): with
        ``reshard="step"`` the units stay gathered for the whole step, so this forward runs them as plain modules,
        without FSDP2's hooks (gathering, casting, registering its backward hooks: host work per unit and call
        that only the forward whose backward reduce-scatters needs). Its backward adds to the gathered
        parameters' ``.grad``, where FSDP2 sums the micro-batches anyway, and the chunk's last backward, run with
        the hooks, reduce-scatters that sum. FSDP2's own path for a forward recomputed in backward is what skips
        the hooks (:data:`_QUIET`); with ``reshard="micro_batch"``, or a PyTorch without that path, the hooks run."""
        if not (self.per_step and self.quiet_early_forwards and _QUIET is not None):
            yield
            return
        states = []
        for unit in self.units:
            unit.unshard()  # this step's all-gather (prefetched, or now) and FSDP2's one-time setup; then a no-op
            state = unit._get_fsdp_state()
            states.append((state, state._training_state))
            state._training_state = _QUIET
        try:
            yield
        finally:
            for state, before in states:
                state._training_state = before

    @contextmanager
    def reducing(self) -> Iterator[None]:
        """Within the block, a unit's backward ends by reduce-scattering its gradient (summed over every
        micro-batch of the step) into its parameters' ``.grad`` and freeing its gathered copy."""
        for unit in self.units:
            unit.set_requires_gradient_sync(True)
            unit.set_reshard_after_backward(True)
        try:
            yield
        finally:
            self.accumulate()

    def reshard(self) -> None:
        """Free every gathered copy now (after a forward-only step, which has no backward to free them)."""
        for unit in self.units:
            unit.reshard()

    def parameter_bytes(self) -> int:
        """Bytes of this rank's shards of the units' parameters."""
        return sum(local(p).numel() * p.element_size() for unit in self.units for p in unit.parameters())  # type: ignore[attr-defined]


@contextmanager
def calls_recorded(modules: dict[str, nn.Module]) -> Iterator[set[str]]:
    """Within the block, collect the names of the ``modules`` that are called (through ``nn.Module.__call__``,
    where FSDP2's hooks run), into the set the block receives."""
    called: set[str] = set()
    handles = [module.register_forward_pre_hook(lambda *_, name=name: called.add(name)) for name, module in modules.items()]
    try:
        yield called
    finally:
        for handle in handles:
            handle.remove()


def shard_optimizer_state(optimizers: Iterable[torch.optim.Optimizer], replaced: dict[Tensor, Tensor],
                          mesh: DeviceMesh) -> None:
    """After :meth:`ShardedLayers.add` replaced whole parameters by sharded ones (``replaced``: old -> new), make
    the optimizers step the new ones: each param group holds the new parameter in the old one's place, and
    each state tensor shaped like the parameter keeps only this rank's shard, as FSDP2 splits the parameter
    (``Shard(0)``; every copy of the stage holds the same state, so no message is sent). Scalars such as
    Adam's ``step`` stay as they are. A group that now mixes shards and whole parameters updates them one by
    one (:func:`single_tensor_updates_where_mixed`)."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [replaced.get(p, p) for p in group["params"]]
        single_tensor_updates_where_mixed(optimizer)
        for old, new in replaced.items():
            if old not in optimizer.state:
                continue
            state = optimizer.state.pop(old)
            optimizer.state[new] = {
                key: distribute_tensor(value, mesh, [Shard(0)], src_data_rank=None)
                if isinstance(value, Tensor) and value.shape == old.shape and value.ndim > 0 else value
                for key, value in state.items()
            }


def single_tensor_updates_where_mixed(optimizer: torch.optim.Optimizer) -> int:
    """Set ``foreach=False`` on every param group of ``optimizer`` that holds sharded and whole parameters
    together (the trunk's shards and the parameters outside the trunk); return how many it changed.

    A ``foreach`` update (the default on CUDA) runs one kernel over a list of tensors and refuses a list that
    mixes ``DTensor`` and ``Tensor``; the per-tensor update computes the same values. A ``fused`` group is left
    as it is: its kernel was chosen at construction."""
    changed = 0
    for group in optimizer.param_groups:
        kinds = {is_sharded(p) for p in group["params"]}
        if len(kinds) == 2 and not group.get("fused") and group.get("foreach", False) is not False:
            group["foreach"] = False
            changed += 1
    return changed


def local(tensor: Tensor) -> Tensor:
    """This rank's part of ``tensor`` (``tensor`` itself unless it is sharded)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
