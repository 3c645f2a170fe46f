"""Building blocks for running a plain ``nn.Sequential`` as pipeline stages without Lightning."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


def run_layers(layers: nn.Module, value: Any, recompute: bool = False, *args: Any, **kwargs: Any) -> Any:
    """Run ``layers(value, *args, **kwargs)``; with ``recompute`` keep only the inputs for backward.

    Activation recomputation (``torch.utils.checkpoint``, non-reentrant) trades one extra forward
    for not storing the stage's intermediate activations.
    """
    if recompute and torch.is_grad_enabled():
        return checkpoint(layers, value, *args, use_reentrant=False, **kwargs)
    return layers(value, *args, **kwargs)


class SequentialStage:
    """A chunk callable for :class:`~lightning_pipe.engine.executor.Executor`.

    Args:
        layers: the layers this chunk runs.
        input_fn: first stage only: turns a micro-batch into the layers' input.
        loss_fn: last stage only: ``loss_fn(output, micro_batch)`` returns the scalar loss.
        recompute: recompute activations in backward instead of storing them.
    """

    def __init__(
        self,
        layers: nn.Module,
        input_fn: Callable[[Any], Any] | None = None,
        loss_fn: Callable[[Any, Any], Tensor] | None = None,
        recompute: bool = False,
    ) -> None:
        self.layers = layers
        self.input_fn = input_fn
        self.loss_fn = loss_fn
        self.recompute = recompute

    def __call__(self, inputs: Any, micro_batch: Any) -> Any:
        if inputs is None:
            if self.input_fn is None:
                raise ValueError("the first stage needs an input_fn that reads the micro-batch.")
            inputs = self.input_fn(micro_batch)
        output = run_layers(self.layers, inputs, self.recompute)
        return output if self.loss_fn is None else self.loss_fn(output, micro_batch)


def split_micro_batches(batch: Any, micro_batches: int) -> list[Any]:
    """Split every tensor of a (nested) batch with one row per sample (dim 0 as long as the first tensor's) into
    ``micro_batches`` parts along dim 0, and every list of one plain value per sample (texts, ids: as many entries
    as the batch has samples, none a tensor) into the same parts.

    Other leaves are shared by all parts: plain values, 0-d tensors and tensors of another length (a collate's
    class-weight vector). Parts differ in size by at most one sample, like ``torch.tensor_split``. A tensor longer
    than the first is shared too, with a warning: it may be the one with a row per sample, out of place.
    """
    try:
        samples = batch_size(batch)
    except ValueError:
        samples = -1
    longer = sorted({leaf.shape[0] for leaf in batch_leaves(batch) if isinstance(leaf, Tensor) and leaf.dim() and leaf.shape[0] > samples})
    if samples >= 0 and longer:
        warnings.warn(
            f"lightning_pipe: the batch's first tensor has {samples} row(s), so the batch is split as {samples} sample(s); "
            f"it also holds tensors of {', '.join(map(str, longer))} rows, which every micro-batch receives whole. If one "
            "of those holds a row per sample, put it first in the batch: the first tensor sets the batch size.",
            stacklevel=2,
        )
    sizes = [samples // micro_batches + (i < samples % micro_batches) for i in range(micro_batches)] if samples >= 0 else []
    starts = list(itertools.accumulate([0, *sizes]))

    def part(value: Any, index: int) -> Any:
        if isinstance(value, Tensor):
            return value.tensor_split(micro_batches)[index] if value.dim() and value.shape[0] == samples else value
        if isinstance(value, Mapping):
            return type(value)({k: part(v, index) for k, v in value.items()})
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
            return type(value)(*(part(v, index) for v in value))
        if isinstance(value, list) and _per_sample_values(value, samples):
            return value[starts[index]:starts[index + 1]]
        if isinstance(value, (list, tuple)):
            return type(value)(part(v, index) for v in value)
        if _is_dataclass_instance(value):
            split = copy.copy(value)
            for field in dataclasses.fields(value):  # object.__setattr__: frozen dataclasses too
                object.__setattr__(split, field.name, part(getattr(value, field.name), index))
            return split
        return value

    return [part(batch, i) for i in range(micro_batches)]


def _is_dataclass_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def batch_leaves(batch: Any) -> Iterator[Any]:
    """Every leaf of a (nested) batch, depth first: what mappings (dicts, Hugging Face's ``BatchEncoding``), lists,
    tuples and dataclasses hold (torch's pytree sees a ``BatchEncoding`` or a dataclass as one leaf)."""
    if isinstance(batch, Mapping):
        children: Iterable[Any] = batch.values()
    elif isinstance(batch, (list, tuple)):
        children = batch
    elif _is_dataclass_instance(batch):
        children = [getattr(batch, field.name) for field in dataclasses.fields(batch)]
    else:
        yield batch
        return
    for child in children:
        yield from batch_leaves(child)


def _per_sample_values(value: list[Any], samples: int) -> bool:
    """A list of one plain (non-tensor, non-container) value per sample."""
    return len(value) == samples > 1 and not any(isinstance(v, (Tensor, Mapping, list, tuple)) for v in value)


#: Entries of a tensor :func:`batch_fingerprint` reads at most.
FINGERPRINT_SAMPLES = 1024


def batch_fingerprint(batch: Any) -> int | None:
    """A checksum of what the stages of a pipeline must agree on in a batch they each load: its integer and boolean
    CPU tensors (labels, token ids, masks) and plain values; ``None`` if it holds none. Floating-point tensors are
    left out: a random augmentation of the inputs may differ between stages without harm (the first stage alone
    uses them), a label may not. A large tensor is sampled (:data:`FINGERPRINT_SAMPLES` evenly spaced entries): two
    different batches differ almost everywhere, and the step's host time stays in microseconds."""
    parts: list[int] = []
    for leaf in batch_leaves(batch):
        if isinstance(leaf, Tensor):
            if leaf.is_floating_point() or leaf.is_complex() or leaf.device.type != "cpu":
                continue
            flat = leaf.reshape(-1)
            sample = flat[:: max(1, -(-flat.numel() // FINGERPRINT_SAMPLES))].to(torch.int64)
            weights = torch.arange(1, sample.numel() + 1, dtype=torch.int64)  # positions count, not only values
            parts += [int((sample * weights).sum()), flat.numel()]
        elif isinstance(leaf, str):
            parts.append(zlib.crc32(leaf.encode()))  # str hashes differ between processes
        elif isinstance(leaf, (bool, int)):
            parts.append(int(leaf))
    return hash(tuple(parts)) if parts else None


def batch_size(batch: Any) -> int:
    """Size of dim 0 of the first tensor found in a (nested) batch (:func:`batch_leaves`)."""
    first = next((leaf for leaf in batch_leaves(batch) if isinstance(leaf, Tensor)), None)
    if first is None:
        raise ValueError("the batch holds no tensor, so it cannot be split into micro-batches.")
    return first.shape[0] if first.dim() else 1
