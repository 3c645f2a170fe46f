"""One ordinary checkpoint from many stages, and back.

Each stage holds its trunk layers plus a replica of every parameter outside the trunk (only the
stages that use such a parameter train it). Saving merges the stages' pieces into the state_dict
and the torch optimizer state of the unpartitioned module, so ``MyModule.load_from_checkpoint``
and a plain one-device Trainer read the file as if it had been written without a pipeline. Loading
slices the same structures by parameter name.

Optimizer states are matched by parameter *name*. The merged state lists each param group's parameters in
the order ``configure_optimizers`` gave them for the whole module (:func:`configured_order`, asked once before
the cut), which is the order a one-device optimizer's state has, so plain Lightning resumes it position by
position; where that order is unknown, in the module's ``named_parameters()`` order (an optimizer built from
``self.parameters()``). The names are stored under ``"pipe_param_names"`` (torch ignores it).
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor, nn

from lightning_pipe.engine.stage_optimizers import group_names
from lightning_pipe.errors import CheckpointFileError, CheckpointMismatchError
from lightning_pipe.lightning import _compat

if TYPE_CHECKING:
    from lightning_pipe.lightning.pipeline import StagePipeline
    from lightning_pipe.lightning.runtimes import Runtime

NAMES_KEY = "pipe_param_names"
BALANCE_KEY = "pipe_balance"  #: layer counts per (virtual) stage: a resumed balance="auto" run adopts them


def check_keys(checkpoint_keys: Sequence[str], model_keys: Sequence[str], strict: bool = True,
               mismatched: Sequence[str] = ()) -> None:
    """Raise :class:`CheckpointMismatchError` naming missing and unexpected keys (when ``strict``) and
    the ``mismatched`` ones (keys whose shapes differ, always: no load can take them)."""
    missing = [k for k in model_keys if k not in set(checkpoint_keys)] if strict else []
    unexpected = [k for k in checkpoint_keys if k not in set(model_keys)] if strict else []
    problems = ([f"missing keys {_short(missing)}"] if missing else []) + (
        [f"unexpected keys {_short(unexpected)}"] if unexpected else []) + (
        [f"mismatched shapes {_short(mismatched)}"] if mismatched else [])
    if problems:
        raise CheckpointMismatchError(
            "the checkpoint does not match the model: " + "; ".join(problems)
            + ". Load a checkpoint of the same LightningModule" + (", or pass strict=False." if not mismatched else
                                                                    " with the same layer sizes.")
        )


def mismatched_shapes(state: Mapping[str, Any], model_state: Mapping[str, Any]) -> list[str]:
    """``"key: checkpoint (a, b), model (c, d)"`` for every key both hold with different shapes."""
    return [f"{k}: checkpoint {tuple(v.shape)}, model {tuple(model_state[k].shape)}" for k, v in state.items()
            if k in model_state and isinstance(v, Tensor) and isinstance(model_state[k], Tensor)
            and v.shape != model_state[k].shape]


def _short(keys: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return f"[{shown}{', ...' if len(keys) > limit else ''}] ({len(keys)})"


def merge_state_dicts(
    parts: Sequence[Mapping[str, Any]], key_order: Sequence[str], owner: Mapping[str, int]
) -> dict[str, Any]:
    """The whole module's state_dict from the stages' ``parts`` (indexed by stage).

    Args:
        parts: every stage's entries (trunk entries only appear on the stage that holds them).
        key_order: keys of the unpartitioned module, in order.
        owner: for keys present on several stages (outside the trunk), the stage whose copy is
            authoritative; other such keys come from stage 0.
    """
    merged = {}
    for key in key_order:
        holders = [s for s, part in enumerate(parts) if key in part]
        if not holders:
            raise CheckpointMismatchError(f"no stage holds {key!r}; the pipeline lost part of the model.")
        stage = owner.get(key, holders[0]) if len(holders) > 1 else holders[0]
        merged[key] = parts[stage][key]
    return merged


def configured_order(module: nn.Module) -> list[list[str]] | None:
    """The parameter names of each param group of the optimizer ``configure_optimizers`` builds for the whole
    module, in the order it lists them: the positions of a one-device checkpoint's optimizer state. Asked while
    every stage's layers are still in the module (parameters on the meta device are fine: nothing is allocated);
    ``None`` where the hook cannot run then or builds several optimizers (the Trainer's own call reports those)."""
    try:
        with warnings.catch_warnings():  # what Lightning says of the hook's result, it says at its own call
            warnings.simplefilter("ignore")
            optimizers = _compat.module_optimizers(module)
        return group_names(optimizers[0], module) if len(optimizers) == 1 else None
    except Exception:  # e.g. a hook that reads self.trainer.estimated_stepping_batches outside fit
        return None


def group_order_key(order: Sequence[Sequence[str]] | None, name_order: Sequence[str], groups: int) -> Any:
    """``key(g, name)``: where ``name`` stands in param group ``g`` of the whole module's optimizer: its place in
    ``order`` (:func:`configured_order`) when that has ``groups`` groups, then the module's parameter order."""
    rank = {name: i for i, name in enumerate(name_order)}
    places = [{n: i for i, n in enumerate(names)} for names in order] if order is not None and len(order) == groups else None

    def key(g: int, name: str) -> tuple[int, int]:
        place = places[g].get(name, len(places[g])) if places is not None else 0
        return place, rank.get(name, len(rank))

    return key


def merge_optimizer_states(
    parts: Sequence[tuple[Mapping[str, Any], list[list[str]]]], name_order: Sequence[str], owner: Mapping[str, int],
    order: Sequence[Sequence[str]] | None = None,
) -> dict[str, Any]:
    """One torch optimizer state_dict for the whole module from each stage's
    ``(optimizer.state_dict(), parameter names per param group)``, each group's parameters in ``order``
    (:func:`configured_order`; ``None``: ``name_order``, the module's)."""
    first_state, first_names = parts[0]
    key = group_order_key(order, name_order, len(first_state["param_groups"]))
    groups, state, all_names = [], {}, []
    for g, group in enumerate(first_state["param_groups"]):
        names = sorted({n for _, names in parts for n in names[g]}, key=lambda n: key(g, n))
        indices = []
        for name in names:
            holders = [s for s, (_, per_group) in enumerate(parts) if name in per_group[g]]
            stage = owner.get(name, holders[0]) if owner.get(name) in holders else holders[0]
            stage_state, stage_names = parts[stage]
            local_index = stage_state["param_groups"][g]["params"][stage_names[g].index(name)]
            index = len(all_names)
            if local_index in stage_state["state"]:
                state[index] = stage_state["state"][local_index]
            indices.append(index)
            all_names.append(name)
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": indices})
    return {"state": state, "param_groups": groups, NAMES_KEY: all_names}


def slice_optimizer_state(
    merged: Mapping[str, Any], local_names: list[list[str]], full_order: Sequence[str],
    order: Sequence[Sequence[str]] | None = None,
) -> dict[str, Any]:
    """This stage's optimizer state_dict out of a merged (or one-device) one.

    Args:
        merged: the checkpoint's optimizer state.
        local_names: parameter names of each param group of this stage's optimizer.
        full_order: the module's parameter names, used when the checkpoint has no names (it was
            written by a one-device run) and ``order`` does not fit it.
        order: the whole module's optimizer's names per param group (:func:`configured_order`): a one-device
            checkpoint's positions, when its groups have as many parameters.
    """
    names = merged.get(NAMES_KEY)
    if names is None:
        names = _one_device_names(merged, local_names, full_order, order)
    index_of = {name: i for i, name in enumerate(names)}
    flat = [i for g in merged["param_groups"] for i in g["params"]]
    groups, state, next_index = [], {}, 0
    for g, group in enumerate(merged["param_groups"]):
        indices = []
        for name in local_names[g]:
            if name not in index_of:
                raise CheckpointMismatchError(f"the checkpoint's optimizer has no state for parameter {name!r}.")
            source = flat[index_of[name]]
            if source in merged["state"]:
                state[next_index] = merged["state"][source]
            indices.append(next_index)
            next_index += 1
        groups.append({**{k: v for k, v in group.items() if k not in ("params", NAMES_KEY)}, "params": indices})
    return {"state": state, "param_groups": groups}


def _one_device_names(merged: Mapping[str, Any], local_names: list[list[str]], full_order: Sequence[str],
                      order: Sequence[Sequence[str]] | None = None) -> list[str]:
    """The parameter names of a one-device optimizer state, which has none: where this optimizer holds as many
    parameters in each param group (one process holding every stage: the same ``configure_optimizers`` built both),
    its own names position by position, whatever order its groups list them in; likewise the whole module's
    optimizer (``order``); otherwise ``self.parameters()``'s order, which :func:`check_state_shapes` then verifies."""
    sizes = [len(g["params"]) for g in merged["param_groups"]]
    for names in (local_names, order or []):
        if sizes == [len(group) for group in names]:
            return [name for group in names for name in group]
    if sum(sizes) != len(full_order):
        raise CheckpointMismatchError(
            f"the checkpoint's optimizer has {sum(sizes)} parameters but the module has {len(full_order)}; "
            "pipelines can only resume optimizers built from self.parameters()."
        )
    return list(full_order)


def check_state_shapes(local: Mapping[str, Any], optimizer: torch.optim.Optimizer, names: list[list[str]]) -> None:
    """Refuse per-parameter optimizer state whose tensors do not have their parameter's shape: a one-device
    checkpoint whose param groups list the parameters in another order than the one assumed (:func:`configured_order`
    could not ask ``configure_optimizers``, so ``self.parameters()``'s) was matched to the wrong parameters, which the
    optimizer's step would fail on, or silently use."""
    state, index = local["state"], 0
    for group, names_in_group in zip(optimizer.param_groups, names):
        for p, name in zip(group["params"], names_in_group):
            for field, value in state.get(index, {}).items():
                if isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape != p.shape:
                    raise CheckpointMismatchError(
                        f"the checkpoint's optimizer state {field!r} for {name} has shape {tuple(value.shape)}, not the "
                        f"parameter's {tuple(p.shape)}: the file's param groups list the parameters in another order than "
                        "this run's optimizer (configure_optimizers as asked at setup, or self.parameters() where it could "
                        "not be asked); resume with the configure_optimizers that wrote the file, runnable before fit "
                        "starts, or load only its weights (model.load_state_dict(torch.load(path)['state_dict']))."
                    )
            index += 1


_PARTIAL = re.compile(r"\.partial-(\d+)$")  # the temporary files of atomic_save, named after their writer


def remove_stale_partials(directory: str | os.PathLike[str]) -> list[str]:
    """Remove the temporary files a save killed half-way left in ``directory`` (only this library's
    ``<name>.partial-<pid>`` files, and only when process ``pid`` no longer runs); return their names."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:  # no such directory yet, or not a local one
        return removed
    for name in names:
        match = _PARTIAL.search(name)
        if match is None or _running(int(match.group(1))):
            continue
        try:
            os.remove(os.path.join(directory, name))
            removed.append(name)
        except OSError:
            pass
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: running
        return True
    return True


def atomic_save(io: CheckpointIO, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
    """Write to a temporary file in the target directory, then rename it into place, so a save killed
    half-way never leaves a truncated file under the final name (remote paths: ``io`` as is). What an
    earlier killed save left in that directory is removed first."""
    path = str(filepath)
    if "://" in path:  # remote filesystems: their own transaction semantics apply
        io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        return
    remove_stale_partials(os.path.dirname(os.path.abspath(path)))
    partial = f"{path}.partial-{os.getpid()}"
    try:
        io.save_checkpoint(checkpoint, partial, storage_options=storage_options)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


# ------------------------------------------------------------------ the strategy's checkpoint hooks
def _cpu(value: Any) -> Any:
    return apply_to_collection(value, Tensor, lambda t: t.detach().cpu())


def module_state(pipeline: StagePipeline) -> dict[str, Any]:
    """The unpartitioned module's state_dict, gathered on rank 0 (``{}`` elsewhere; collective). A rank's
    stand-ins (:attr:`StagePipeline.absent`) are left out: another stage holds those tensors."""
    state = pipeline.module.state_dict()
    parts = pipeline.gather_in_first_pipeline(_cpu({k: v for k, v in state.items() if k not in pipeline.absent}))
    return merge_state_dicts(parts, pipeline.key_order, pipeline.outside.owner()) if parts else {}


def local_param_names(module: nn.Module, runtime: Runtime | None, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The parameter names of each of ``optimizer``'s param groups (master copies named like their parameter)."""
    return group_names(optimizer, module, runtime.parameter_names() if runtime is not None else None)


def optimizer_state(pipeline: StagePipeline, runtime: Runtime | None, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """One torch-format optimizer state for the whole module, on rank 0 (``{}`` elsewhere; collective)."""
    own = runtime.optimizer_parts() if runtime is not None else None
    if own is not None:  # an emulated pipeline holds every stage's optimizer share
        return merge_optimizer_states(_cpu(own), pipeline.param_order, {}, pipeline.optimizer_order)
    names = local_param_names(pipeline.module, runtime, optimizer)
    parts = pipeline.gather_in_first_pipeline((_cpu(optimizer.state_dict()), names))
    if not parts:
        return {}
    return merge_optimizer_states(parts, pipeline.param_order, pipeline.outside.owner(), pipeline.optimizer_order)


def read(io: CheckpointIO, path: Any, weights_only: bool | None = None) -> dict[str, Any]:
    """``io.load_checkpoint(path)``, with a failure to read the file (truncated, corrupted, not a
    checkpoint) as :class:`CheckpointFileError` naming the file and the cause."""
    try:
        return io.load_checkpoint(path, weights_only=weights_only)
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise  # their messages name the path already
    except Exception as error:  # torch's zip reader, pickle, fsspec: each words it differently, none names the file
        size = _size(path)
        lines = [line for line in str(error).splitlines() if line.strip()]
        cause = f"{type(error).__name__}: {lines[0] if lines else ''}"
        raise CheckpointFileError(
            f"cannot read the checkpoint {os.fspath(path)}{f' ({size} bytes)' if size is not None else ''}: {cause}. "
            "The file is truncated or corrupted (a copy cut short, a full disk), or not a checkpoint written by "
            "torch.save/Trainer.save_checkpoint; load an intact copy (lightning_pipe writes each save to a temporary "
            "file and renames it, so the previous checkpoint of a run stays intact)."
        ) from error


def _size(path: Any) -> int | None:
    try:
        return os.path.getsize(path)
    except (OSError, TypeError):
        return None


def load_module_state(module: nn.Module, state: Mapping[str, Any], pipeline: StagePipeline | None, strict: bool) -> None:
    """Load a whole-module state_dict: all of it before the cut, this rank's part after."""
    own = module.state_dict()
    if pipeline is None:
        check_keys(list(state), list(own), strict, mismatched_shapes(state, own))
        module.load_state_dict(state, strict=strict)
        return
    check_keys(list(state), pipeline.key_order, strict, mismatched_shapes(state, own))  # this stage's keys' shapes
    if pipeline.absent:  # stand-ins take no values; check_keys above was the strict check
        module.load_state_dict({k: v for k, v in state.items() if k in own and k not in pipeline.absent}, strict=False)
        return
    module.load_state_dict({k: v for k, v in state.items() if k in own}, strict=strict)


def load_optimizer_state(
    pipeline: StagePipeline, runtime: Runtime | None, optimizer: torch.optim.Optimizer, state: Mapping[str, Any],
) -> None:
    """Load this rank's slice of a merged (or one-device) optimizer state into ``optimizer``."""
    names = local_param_names(pipeline.module, runtime, optimizer)
    local = slice_optimizer_state(state, names, pipeline.param_order, pipeline.optimizer_order)
    check_state_shapes(local, optimizer, names)
    if pipeline.absent:  # a stand-in is never stepped: no state (it would be allocated at its full size)
        flat = [name for group in names for name in group]
        local["state"] = {i: s for i, s in local["state"].items() if flat[i] not in pipeline.absent}
    optimizer.load_state_dict(local)
