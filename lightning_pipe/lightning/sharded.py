"""Sharded checkpoints (``PipeStrategy(save_distributed_checkpoint=True)``): each rank writes and reads
only its own stage, through ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a directory. Its tensors are keyed by name, not by stage, so a checkpoint resumes
under another split, another stage count or the one-device emulation:

* ``model.<state_dict key>``: each rank's trunk entries, and the entries outside the trunk of which
  its stage holds the authoritative copy (:meth:`OutsideParameters.owner`; buffers: stage 0);
* ``optim.<i>.<parameter name>.<field>``: optimizer ``i``'s per-parameter state, for the same parameters;
* ``policy.<location>/<parameter>[/<field>]``: an asynchronous schedule's or avgpipe's weight-policy
  state for the same parameters (:mod:`.sharded_policy`);
* ``meta.pt`` (rank 0): everything else Lightning's checkpoint holds (epoch, loops, callbacks,
  schedulers), the optimizers' param groups without their parameters, and the names needed to
  consolidate it into one ordinary checkpoint (:func:`consolidate_checkpoint`).

The directory is written as ``<path>.partial`` and renamed into place once every rank wrote its part,
so a save killed half-way leaves the previous checkpoint as it was.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_pipe.engine import sharding
from lightning_pipe.errors import CheckpointMismatchError
from lightning_pipe.lightning import sharded_policy
from lightning_pipe.lightning.checkpointing import NAMES_KEY, group_order_key, local_param_names

if TYPE_CHECKING:
    from lightning_pipe.lightning.pipeline import StagePipeline
    from lightning_pipe.lightning.runtimes import Runtime

SHARDED_KEY = "pipe_sharded"  #: in meta.pt: the names consolidation needs
META = "meta.pt"


def is_sharded(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a sharded checkpoint directory."""
    return os.path.isfile(os.path.join(path, META))


# ------------------------------------------------------------------ this rank's part
def owns(pipeline: StagePipeline) -> Callable[[str], bool]:
    """Whether this rank writes a name's entries: its trunk's, and those outside the trunk whose
    authoritative copy its stage holds (:meth:`OutsideParameters.owner`; unused ones and buffers: stage
    0). An emulated pipeline runs every stage, so it writes every name."""
    if pipeline.context.emulating:
        return lambda name: True
    outside, stage, absent = pipeline.outside, pipeline.topology.stage, pipeline.absent
    owner = outside.owner()
    return lambda name: name not in absent and (outside.in_trunk(name) or owner.get(name, 0) == stage)


def owned_keys(pipeline: StagePipeline) -> list[str]:
    """The state_dict keys whose authoritative copy this rank holds."""
    mine = owns(pipeline)
    return [k for k in pipeline.module.state_dict() if mine(k)]


def model_part(pipeline: StagePipeline) -> dict[str, Tensor]:
    """This rank's model entries (its own tensors, not copies)."""
    state = pipeline.module.state_dict()
    return {k: state[k] for k in owned_keys(pipeline)}


def optimizer_part(pipeline: StagePipeline, runtime: Runtime | None, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's optimizer state by parameter name, and its param groups without their parameters.

    An emulated asynchronous pipeline steps one optimizer share per stage (:meth:`Runtime.optimizer_parts`):
    their states are united by name."""
    parts = runtime.optimizer_parts() if runtime is not None else None
    if parts is None:
        parts = [(optimizer.state_dict(), local_param_names(pipeline.module, runtime, optimizer))]
    mine = owns(pipeline)
    by_name: dict[str, Any] = {}
    names: list[dict[str, None]] = [{} for _ in parts[0][0]["param_groups"]]  # ordered sets: each name once
    for state, part_names in parts:
        for g, (group, group_names) in enumerate(zip(state["param_groups"], part_names)):
            for index, name in zip(group["params"], group_names):
                if mine(name) and index in state["state"]:
                    by_name[name] = state["state"][index]
            names[g].update(dict.fromkeys(group_names))
    groups = [{k: v for k, v in group.items() if k != "params"} for group in parts[0][0]["param_groups"]]
    return {"state": by_name, "param_groups": groups, "names": [list(group) for group in names]}


def policy_part(pipeline: StagePipeline, runtime: Runtime | None) -> tuple[str, Any, dict[str, Any]] | None:
    """``(checkpoint key, skeleton, this rank's entries)`` of the weight policy's state (``None``: no policy)."""
    state = runtime.policy_state() if runtime is not None else None
    if state is None:
        return None
    key, value = state
    names = {n for n, _ in pipeline.module.named_parameters()}
    skeleton, entries = sharded_policy.split(value, names, owns(pipeline))
    return key, skeleton, entries


# ------------------------------------------------------------------ save
def save(pipeline: StagePipeline, checkpoint: dict[str, Any], path: str | os.PathLike[str],
         policy: tuple[str, Any, dict[str, Any]] | None, barrier: Callable[[str], None]) -> None:
    """Collective: write ``checkpoint`` (its ``state_dict`` and ``optimizer_states`` being this rank's
    parts, see the strategy's hooks) and this rank's part of the weight ``policy`` (:func:`policy_part`)
    as a sharded directory at ``path``. ``barrier(name)``: every rank waits for the others (the strategy's,
    which the watchdog bounds)."""
    is_global_zero = pipeline.context.is_global_zero
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    if is_global_zero:
        shutil.rmtree(partial, ignore_errors=True)  # what a killed save left
    barrier("sharded checkpoint: start")
    optimizers = checkpoint.pop("optimizer_states", [])
    tensors = {"model": checkpoint.pop("state_dict"), "optim": {str(i): o["state"] for i, o in enumerate(optimizers)}}
    if policy is not None:
        tensors[sharded_policy.PREFIX] = policy[2]
    dcp.save(tensors, checkpoint_id=partial)
    # the names and the policy's skeleton hold no tensors: gathering them costs nothing
    gathered = pipeline.gather_in_first_pipeline(([o["names"] for o in optimizers], None if policy is None else policy[1]))
    if is_global_zero:
        assert gathered is not None
        names = [stage_names for stage_names, _ in gathered]
        groups = [[[n for stage in names for n in stage[i][g]] for g in range(len(o["param_groups"]))]
                  for i, o in enumerate(optimizers)]
        checkpoint["optimizer_groups"] = [o["param_groups"] for o in optimizers]
        checkpoint[SHARDED_KEY] = {"key_order": pipeline.key_order, "param_order": pipeline.param_order, "groups": groups,
                                   "optimizer_order": pipeline.optimizer_order}
        if policy is not None:
            checkpoint[SHARDED_KEY]["policy"] = (policy[0], sharded_policy.merge_skeletons([s for _, s in gathered]))
        torch.save(checkpoint, partial / META)
    barrier("sharded checkpoint: written")
    if is_global_zero:  # the previous checkpoint stays whole until the new one is
        old = path.with_name(path.name + ".old")
        if path.exists():
            os.replace(path, old)
        os.replace(partial, path)
        shutil.rmtree(old, ignore_errors=True)
    barrier("sharded checkpoint: in place")


# ------------------------------------------------------------------ load
def load(pipeline: StagePipeline, path: str | os.PathLike[str]) -> dict[str, Any]:
    """This rank's part of the sharded checkpoint at ``path``: its model entries are loaded into the
    module in place; the returned checkpoint holds Lightning's entries and this rank's optimizer states."""
    checkpoint = torch.load(Path(path) / META, map_location="cpu", weights_only=False)
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    model = {k: v for k, v in pipeline.module.state_dict().items()  # replicas outside the trunk too,
             if k not in pipeline.absent}  # but not the stand-ins of a stage that never uses them
    missing = [k for k in model if f"model.{k}" not in stored]
    if missing:
        shown = ", ".join(missing[:8]) + (", ..." if len(missing) > 8 else "")
        raise CheckpointMismatchError(f"the sharded checkpoint {path} lacks {len(missing)} tensors this stage holds: {shown}; "
                                      "resume from a checkpoint of the same LightningModule.")
    optim: dict[str, dict[str, dict[str, Tensor]]] = {}
    params = dict(pipeline.module.named_parameters())
    for i in range(len(checkpoint.get("optimizer_groups", []))):
        optim[str(i)] = {}
        for name in model:
            prefix = f"optim.{i}.{name}."
            fields = {key[len(prefix):]: meta for key, meta in stored.items() if key.startswith(prefix)}
            if fields:
                optim[str(i)][name] = {f: _optimizer_placeholder(m, params.get(name)) for f, m in fields.items()}
    request: dict[str, Any] = {"model": model, "optim": optim}
    policy = checkpoint[SHARDED_KEY].get("policy")
    if policy is not None:  # the weight policy's entries of the parameters this rank holds
        prefix = sharded_policy.PREFIX + "."
        names = {n for n, _ in pipeline.module.named_parameters()}
        request[sharded_policy.PREFIX] = sharded_policy.request(
            policy[1], {k[len(prefix):]: m for k, m in stored.items() if k.startswith(prefix)}, names, _placeholder)
    try:
        dcp.load(request, checkpoint_id=str(path))
    except dcp.api.CheckpointException as error:  # a shard cut short or overwritten: DCP's own words are a traceback per rank
        files = sorted({info.relative_path for info in dcp.FileSystemReader(str(path)).read_metadata().storage_data.values()})
        raise CheckpointMismatchError(
            f"the sharded checkpoint {path} could not be read ({_last_line(error)}): one of its files ({', '.join(files)}) "
            "is damaged or was cut short; resume from an earlier checkpoint."
        ) from error
    checkpoint["optimizer_states"] = [{"state": optim[str(i)], "param_groups": groups}
                                      for i, groups in enumerate(checkpoint.pop("optimizer_groups", []))]
    checkpoint["state_dict"] = model
    if policy is not None:  # as the single-file format's merged state, restricted to this rank's parameters
        checkpoint[policy[0]] = sharded_policy.join(policy[1], request[sharded_policy.PREFIX])
    return checkpoint


def _optimizer_placeholder(metadata: TensorStorageMetadata, param: Tensor | None) -> Tensor:
    """What DCP reads an optimizer state tensor into: for a sharded parameter (``data_parallel="fsdp"``) a
    parameter-shaped state is read as this rank's shard of it, as the optimizer holds it; else the whole tensor."""
    if sharding.is_sharded(param) and tuple(metadata.size) == tuple(param.shape):  # type: ignore[union-attr]
        return torch.empty_like(param, dtype=metadata.properties.dtype)  # type: ignore[arg-type]
    return torch.empty(metadata.size, dtype=metadata.properties.dtype)


def _placeholder(metadata: Any) -> Any:
    """What DCP reads an entry into: a tensor of its size and dtype, or ``None`` for a pickled value."""
    if isinstance(metadata, TensorStorageMetadata):
        return torch.empty(metadata.size, dtype=metadata.properties.dtype)
    return None


def _last_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def load_optimizer(pipeline: StagePipeline, runtime: Runtime | None, optimizer: torch.optim.Optimizer,
                   part: Mapping[str, Any]) -> None:
    """Load a sharded checkpoint's name-keyed optimizer state into this rank's ``optimizer``."""
    names = local_param_names(pipeline.module, runtime, optimizer)
    state, groups, index = {}, [], 0
    for group, group_names in zip(part["param_groups"], names):
        indices = []
        for name in group_names:
            if name in part["state"]:
                state[index] = part["state"][name]
            indices.append(index)
            index += 1
        groups.append({**group, "params": indices})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# ------------------------------------------------------------------ one ordinary checkpoint
def consolidate_checkpoint(directory: str | os.PathLike[str], output: str | os.PathLike[str]) -> None:
    """Write the sharded checkpoint ``directory`` as one ordinary Lightning checkpoint at ``output``
    (what ``save_distributed_checkpoint=False`` writes): it loads with ``MyModule.load_from_checkpoint``
    and resumes on one device or any pipeline. Runs in one process and holds the whole model."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    checkpoint = torch.load(Path(directory) / META, map_location="cpu", weights_only=False)
    names = checkpoint.pop(SHARDED_KEY)
    flat = Path(str(output) + ".tensors")
    dcp_to_torch_save(directory, flat)
    try:
        tensors = torch.load(flat, map_location="cpu", weights_only=False)
    finally:
        flat.unlink(missing_ok=True)
    checkpoint["state_dict"] = {k: tensors["model"][k] for k in names["key_order"]}
    if names.get("policy") is not None:  # the weight policy's state, merged as the single-file format has it
        key, skeleton = names["policy"]
        checkpoint[key] = sharded_policy.join(skeleton, tensors.get(sharded_policy.PREFIX, {}))
    states = []
    for i, groups in enumerate(checkpoint.pop("optimizer_groups", [])):
        stored = tensors["optim"].get(str(i), {})
        # each group as configure_optimizers listed it for the whole module: a one-device optimizer's positions
        key = group_order_key(names.get("optimizer_order") if i == 0 else None, names["param_order"], len(groups))
        state, out_groups, all_names = {}, [], []
        for g, (group, members) in enumerate(zip(groups, names["groups"][i])):
            indices = []
            for name in sorted(set(members), key=lambda n: key(g, n)):
                if name in stored:
                    state[len(all_names)] = stored[name]
                indices.append(len(all_names))
                all_names.append(name)
            out_groups.append({**group, "params": indices})
        states.append({"state": state, "param_groups": out_groups, NAMES_KEY: all_names})
    checkpoint["optimizer_states"] = states
    torch.save(checkpoint, output)
