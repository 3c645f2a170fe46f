"""Pretrained weights for one pipeline stage: each rank reads only the tensors it holds.

After the cut, a rank's ``module.state_dict()`` holds only its own trunk layers and the parameters
outside the trunk, so the keys to read are exactly those. :func:`load_stage_weights` reads them, one
tensor at a time, from

* Hugging Face safetensors: a directory with ``model.safetensors.index.json`` and its shards
  (``model-0000k-of-0000n.safetensors``), a directory with one ``model.safetensors``, the index json
  itself, or one ``.safetensors`` file (``safetensors.safe_open``: only the named tensors are read);
* an ordinary checkpoint (a Lightning ``.ckpt`` with its ``"state_dict"``, or a bare state_dict),
  memory-mapped so that only the pages of this rank's tensors are read.

It copies each tensor into the existing parameter or buffer, so the optimizer and every tie keep
theirs. docs/large-models.md shows where to call it (``on_fit_start``).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipe.engine.stand_ins import is_absent
from lightning_pipe.errors import CheckpointMismatchError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def load_stage_weights(module: nn.Module, source: str | os.PathLike[str], prefix: str = "", strict: bool = True) -> list[str]:
    """Copy this rank's tensors from ``source`` into ``module``; return the keys loaded.

    Args:
        module: the LightningModule (or any module) after the pipeline's cut: only the keys its
            ``state_dict()`` still has are read, not those of the stand-ins a stage keeps for parameters
            outside the trunk that it never uses (docs/large-models.md).
        source: a safetensors directory, index json or file, or a torch / Lightning checkpoint file.
        prefix: what the module's keys have in front of the source's (``"model."`` when the
            LightningModule holds the Hugging Face model as ``self.model``); keys without it are not
            the source's and are left alone.
        strict: raise :class:`~lightning_pipe.CheckpointMismatchError` naming every key of this stage
            that ``source`` lacks (a tensor tied to one that it has counts as present).
    """
    wanted = _wanted(module, prefix)
    reader = _reader(Path(source))
    available = reader.keys()
    missing = [key for key, (name, _) in wanted.items() if name not in available]
    tied = {id(t) for key, (name, t) in wanted.items() if name in available}
    missing = [key for key in missing if id(wanted[key][1]) not in tied]
    if strict and missing:
        shown = ", ".join(missing[:8]) + (", ..." if len(missing) > 8 else "")
        raise CheckpointMismatchError(
            f"{source} lacks {len(missing)} tensors this stage holds: {shown}; load weights of the same model, or check "
            f"prefix={prefix!r} (the module's keys are the source's with that prefix in front)."
        )
    loaded = []
    with torch.no_grad():
        for key, name, value in reader.read({key: name for key, (name, _) in wanted.items() if name in available}):
            target = wanted[key][1]
            if target.shape != value.shape:
                raise CheckpointMismatchError(
                    f"{key}: {source} holds {name} with shape {tuple(value.shape)}, the module {tuple(target.shape)}; "
                    "load weights of the same model configuration."
                )
            target.copy_(value)
            loaded.append(key)
    return loaded


def _wanted(module: nn.Module, prefix: str) -> dict[str, tuple[str, Tensor]]:
    """The module's keys this source can fill: key -> (the source's name, the tensor to fill)."""
    state = module.state_dict(keep_vars=True)
    return {key: (key[len(prefix):], t) for key, t in state.items()
            if key.startswith(prefix) and isinstance(t, Tensor) and not is_absent(t)}


class _Safetensors:
    """Named tensors spread over safetensors files; reads one tensor at a time."""

    def __init__(self, files: Mapping[str, Path]) -> None:
        self.files = files  # tensor name -> file

    def keys(self) -> set[str]:
        return set(self.files)

    def read(self, names: Mapping[str, str]) -> Any:
        from safetensors import safe_open

        by_file: dict[Path, list[tuple[str, str]]] = defaultdict(list)
        for key, name in names.items():
            by_file[self.files[name]].append((key, name))
        for path, entries in by_file.items():
            for key, name in entries:
                # a handle per tensor: the file is memory-mapped while open, and its pages read so far count
                # in the process's resident memory until it closes (a whole shard, for a shared handle)
                with safe_open(str(path), framework="pt", device="cpu") as handle:
                    value = handle.get_tensor(name)
                yield key, name, value


class _Checkpoint:
    """A torch checkpoint, memory-mapped: only the storages read are paged in."""

    def __init__(self, path: Path) -> None:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
        self.state: Mapping[str, Tensor] = checkpoint.get("state_dict", checkpoint)

    def keys(self) -> set[str]:
        return set(self.state)

    def read(self, names: Mapping[str, str]) -> Any:
        for key, name in names.items():
            yield key, name, self.state[name]


def _reader(source: Path) -> _Safetensors | _Checkpoint:
    if source.is_dir():
        if (source / INDEX).exists():
            return _from_index(source / INDEX)
        if (source / SINGLE).exists():
            return _single(source / SINGLE)
        raise CheckpointMismatchError(f"{source} has neither {INDEX} nor {SINGLE}; point at a safetensors file or a checkpoint.")
    if not source.exists():
        raise FileNotFoundError(f"no pretrained weights at {source}")
    if source.name.endswith(".json"):
        return _from_index(source)
    if source.suffix == ".safetensors":
        return _single(source)
    return _Checkpoint(source)


def _from_index(index: Path) -> _Safetensors:
    weight_map = json.loads(index.read_text())["weight_map"]
    return _Safetensors({name: index.parent / file for name, file in weight_map.items()})


def _single(path: Path) -> _Safetensors:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as handle:
        return _Safetensors({name: path for name in handle.keys()})
