"""Sharded checkpoints (``PipeStrategy(save_distributed_checkpoint=True)``): each rank writes and reads
only its own stage, through ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a directory. Its tensors are keyed by name, not by stage, so a checkpoint resumes
under another split, another stage count or the one-device emulation:

* ``model.<state_dict key>``: each rank's trunk entries, and the entries outside the trunk of which
  its stage holds the authoritative copy (:meth:`OutsideParameters.owner`; buffers: stage 0);
* ``optim.<i>.<parameter name>.<field>``: optimizer ``i``'s per-parameter state, for the same parameters;
* ``meta.pt`` (rank 0): everything else Lightning's checkpoint holds (epoch, loops, callbacks,
  schedulers), the optimizers' param groups without their parameters, and the names needed to
  consolidate it into one ordinary checkpoint (:func:`consolidate_checkpoint`).

The directory is written as ``<path>.partial`` and renamed into place once every rank wrote its part,
so a save killed half-way leaves the previous checkpoint as it was.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor

from lightning_pipe.errors import CheckpointMismatchError
from lightning_pipe.lightning.checkpointing import NAMES_KEY, local_param_names

if TYPE_CHECKING:
    from lightning_pipe.lightning.pipeline import StagePipeline
    from lightning_pipe.lightning.runtimes import Runtime

SHARDED_KEY = "pipe_sharded"  #: in meta.pt: the names consolidation needs
META = "meta.pt"


def is_sharded(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a sharded checkpoint directory."""
    return os.path.isfile(os.path.join(path, META))


# ------------------------------------------------------------------ this rank's part
def owned_keys(pipeline: StagePipeline) -> list[str]:
    """The state_dict keys whose authoritative copy this rank holds."""
    module, outside = pipeline.strategy.lightning_module, pipeline.outside
    owner, stage = outside.owner(), pipeline.topology.stage
    return [k for k in module.state_dict() if outside.in_trunk(k) or owner.get(k, 0) == stage]


def model_part(pipeline: StagePipeline) -> dict[str, Tensor]:
    """This rank's model entries (its own tensors, not copies)."""
    state = pipeline.strategy.lightning_module.state_dict()
    return {k: state[k] for k in owned_keys(pipeline)}


def optimizer_part(pipeline: StagePipeline, runtime: Runtime | None, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's optimizer state by parameter name, and its param groups without their parameters."""
    names = local_param_names(pipeline.strategy.lightning_module, runtime, optimizer)
    owned = set(owned_keys(pipeline))
    state = optimizer.state_dict()
    by_name, groups = {}, []
    for group, group_names in zip(state["param_groups"], names):
        for index, name in zip(group["params"], group_names):
            if name in owned and index in state["state"]:
                by_name[name] = state["state"][index]
        groups.append({k: v for k, v in group.items() if k != "params"})
    return {"state": by_name, "param_groups": groups, "names": names}


# ------------------------------------------------------------------ save
def save(pipeline: StagePipeline, checkpoint: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Collective: write ``checkpoint`` (its ``state_dict`` and ``optimizer_states`` being this rank's
    parts, see the strategy's hooks) as a sharded directory at ``path``."""
    strategy = pipeline.strategy
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    if strategy.is_global_zero:
        shutil.rmtree(partial, ignore_errors=True)  # what a killed save left
    strategy.barrier("sharded checkpoint: start")
    optimizers = checkpoint.pop("optimizer_states", [])
    tensors = {"model": checkpoint.pop("state_dict"), "optim": {str(i): o["state"] for i, o in enumerate(optimizers)}}
    dcp.save(tensors, checkpoint_id=partial)
    names = pipeline.gather_in_first_pipeline([o["names"] for o in optimizers])
    if strategy.is_global_zero:
        assert names is not None
        groups = [[[n for stage in names for n in stage[i][g]] for g in range(len(o["param_groups"]))]
                  for i, o in enumerate(optimizers)]
        checkpoint["optimizer_groups"] = [o["param_groups"] for o in optimizers]
        checkpoint[SHARDED_KEY] = {"key_order": pipeline.key_order, "param_order": pipeline.param_order, "groups": groups}
        torch.save(checkpoint, partial / META)
    strategy.barrier("sharded checkpoint: written")
    if strategy.is_global_zero:  # the previous checkpoint stays whole until the new one is
        old = path.with_name(path.name + ".old")
        if path.exists():
            os.replace(path, old)
        os.replace(partial, path)
        shutil.rmtree(old, ignore_errors=True)
    strategy.barrier("sharded checkpoint: in place")


# ------------------------------------------------------------------ load
def load(pipeline: StagePipeline, path: str | os.PathLike[str]) -> dict[str, Any]:
    """This rank's part of the sharded checkpoint at ``path``: its model entries are loaded into the
    module in place; the returned checkpoint holds Lightning's entries and this rank's optimizer states."""
    checkpoint = torch.load(Path(path) / META, map_location="cpu", weights_only=False)
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    model = pipeline.strategy.lightning_module.state_dict()  # every local entry: replicas outside the trunk too
    missing = [k for k in model if f"model.{k}" not in stored]
    if missing:
        shown = ", ".join(missing[:8]) + (", ..." if len(missing) > 8 else "")
        raise CheckpointMismatchError(f"the sharded checkpoint {path} lacks {len(missing)} tensors this stage holds: {shown}; "
                                      "resume from a checkpoint of the same LightningModule.")
    optim: dict[str, dict[str, dict[str, Tensor]]] = {}
    for i in range(len(checkpoint.get("optimizer_groups", []))):
        optim[str(i)] = {}
        for name in model:
            prefix = f"optim.{i}.{name}."
            fields = {key[len(prefix):]: meta for key, meta in stored.items() if key.startswith(prefix)}
            if fields:
                optim[str(i)][name] = {f: torch.empty(m.size, dtype=m.properties.dtype) for f, m in fields.items()}
    try:
        dcp.load({"model": model, "optim": optim}, checkpoint_id=str(path))
    except dcp.api.CheckpointException as error:  # a shard cut short or overwritten: DCP's own words are a traceback per rank
        files = sorted({info.relative_path for info in dcp.FileSystemReader(str(path)).read_metadata().storage_data.values()})
        raise CheckpointMismatchError(
            f"the sharded checkpoint {path} could not be read ({_last_line(error)}): one of its files ({', '.join(files)}) "
            "is damaged or was cut short; resume from an earlier checkpoint."
        ) from error
    checkpoint["optimizer_states"] = [{"state": optim[str(i)], "param_groups": groups}
                                      for i, groups in enumerate(checkpoint.pop("optimizer_groups", []))]
    checkpoint["state_dict"] = model
    return checkpoint


def _last_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def load_optimizer(pipeline: StagePipeline, runtime: Runtime | None, optimizer: torch.optim.Optimizer,
                   part: Mapping[str, Any]) -> None:
    """Load a sharded checkpoint's name-keyed optimizer state into this rank's ``optimizer``."""
    names = local_param_names(pipeline.strategy.lightning_module, runtime, optimizer)
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
    rank = {name: i for i, name in enumerate(names["param_order"])}
    states = []
    for i, groups in enumerate(checkpoint.pop("optimizer_groups", [])):
        stored = tensors["optim"].get(str(i), {})
        state, out_groups, all_names = {}, [], []
        for group, members in zip(groups, names["groups"][i]):
            indices = []
            for name in sorted(set(members), key=lambda n: rank.get(n, len(rank))):
                if name in stored:
                    state[len(all_names)] = stored[name]
                indices.append(len(all_names))
                all_names.append(name)
            out_groups.append({**group, "params": indices})
        states.append({"state": state, "param_groups": out_groups, NAMES_KEY: all_names})
    checkpoint["optimizer_states"] = states
    torch.save(checkpoint, output)
