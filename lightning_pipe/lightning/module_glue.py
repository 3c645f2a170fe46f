"""What runs a user's LightningModule step as pipeline stages, and what gathers its results.

* :class:`ModuleStages` builds the executor's chunk callables. The first virtual stage runs the
  user's step until the trunk call (code before the trunk, e.g. an embedding, runs there) and ships
  the trunk output of its layers; middle stages only run their layers (the stages of a looped
  ModuleList trunk run the step too, so that its blocks get the arguments the step computes); the last virtual stage
  runs the user's step again with the trunk answered by its layers applied to the received
  activation, so the code after the trunk and the loss run there.
* :func:`merge_outputs` combines what a step returned per micro-batch into what it would return
  for the batch; :func:`stage_parameter_names` finds which stage uses each parameter outside the
  trunk (one-device emulation).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor, nn
from torchmetrics import Metric

from lightning_pipe.engine.outside import buffer_slots, reject_shared
from lightning_pipe.engine.p2p import flatten_activation, rebuild_activation
from lightning_pipe.engine.random_state import StepSeeds, layers_seed, reseed
from lightning_pipe.engine.stage import batch_size
from lightning_pipe.errors import SharedParameterError, TrunkUsageError
from lightning_pipe.lightning import _compat
from lightning_pipe.lightning.log_replay import LogCapture
from lightning_pipe.lightning.logger_calls import LoggerCalls
from lightning_pipe.partition.split import PartitionedTrunk, StagePass, StageStop
from lightning_pipe.partition.step_check import reached_parameters


def step_loss(output: Any, hook: str) -> Tensor:
    """The loss tensor of a training-step output (a tensor or a dict with ``"loss"``)."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), Tensor):
        return output["loss"]
    skip = (" Skipping a batch by returning None is not supported across devices, as under DDP: the other stages "
            "ran its forward already. Leave such batches out of the data.") if output is None else ""
    raise TypeError(
        f"{hook} returned {type(output).__name__}; under a pipeline strategy it must return the loss tensor "
        f"(or a dict with a 'loss' tensor) for every batch.{skip}"
    )


class ModuleStages:
    """Builds the executor's chunk callables for one rank.

    Args:
        step: the user's step bound to its extra arguments, ``step(micro_batch) -> output``.
        partition: this rank's trunk share.
        virtual_stages: total virtual stages of the pipeline.
        capture: records ``self.log`` calls of the step.
        output_to_loss: extracts the loss from the step's output (``None`` for forward-only use).
        logger_calls: records the step's calls to the loggers, if given.
        seeds: the random state each micro-batch's step and layers start from, alike on every stage
            (:mod:`~lightning_pipe.engine.random_state`); ``None`` leaves the generators alone.
        outside_buffers: ``(module, name)`` of the buffers outside the trunk. A later virtual stage's pass runs the
            step's code before the trunk again on the same micro-batch, so what that code updates there (BatchNorm's
            running statistics, a counter) is put back when the trunk is reached: the first virtual stage's pass
            updated them already (on its rank), once per micro-batch as on one device.
    """

    def __init__(
        self,
        step: Callable[[Any], Any],
        partition: PartitionedTrunk,
        virtual_stages: int,
        capture: LogCapture,
        output_to_loss: Callable[[Any], Any],
        logger_calls: LoggerCalls | None = None,
        seeds: StepSeeds | None = None,
        outside_buffers: Sequence[tuple[nn.Module, str]] = (),
    ) -> None:
        self.step = step
        self.partition = partition
        self.virtual_stages = virtual_stages
        self.capture = capture
        self.output_to_loss = output_to_loss
        self.logger_calls = logger_calls
        self.seeds = seeds
        self.outside_buffers = outside_buffers

    def chunk_callables(self) -> list[Callable[[Any, Any], Any]]:
        return [self._callable(chunk, vs) for chunk, vs in enumerate(self.partition.local)]

    def _callable(self, chunk: int, vs: int) -> Callable[[Any, Any], Any]:
        first, last = vs == 0, vs == self.virtual_stages - 1
        partition, seeds = self.partition, self.seeds
        if not (first or last or partition.middle_runs_step):  # a Sequential's middle stage: its layers only

            def run_layers(inputs: Any, micro_batch: Any) -> Any:
                with seeds.running(layers_seed(seeds.of(micro_batch), vs)) if seeds else nullcontext():
                    return partition.run_chunk(chunk, inputs)

            return run_layers

        def run(inputs: Any, micro_batch: Any) -> Any:
            step_seed = seeds.of(micro_batch) if seeds else None
            layer_seed = layers_seed(step_seed, vs)
            put_back = None if first else buffers_as_now(self.outside_buffers)

            def entering_layers() -> None:
                if put_back is not None:  # the code before the trunk updated them again
                    put_back()
                if layer_seed is not None:
                    reseed(layer_seed)

            stage_pass = StagePass(chunk, first, inputs, stop=not last, entering_layers=entering_layers)
            try:
                with seeds.running(step_seed) if seeds else nullcontext():
                    output = self._run_step(micro_batch, stage_pass)
            except StageStop as done:
                return done.output
            if last:
                return output
            raise RuntimeError(
                f"the step finished without running {partition.name}; every pipeline stage but the last needs the step "
                f"to {'loop over' if partition.looped else 'call'} self.{partition.name} exactly once."
            )

        return run

    def _run_step(self, micro_batch: Any, stage_pass: StagePass) -> Any:
        self.capture.batch_size = batch_size(micro_batch)
        if self.logger_calls is not None:
            self.logger_calls.begin_micro_batch(micro_batch)
        with self.partition.acting(stage_pass):
            try:
                output = self.output_to_loss(self.step(micro_batch))
            except StageStop as done:
                self.partition.check_step_output(stage_pass, done.output)
                raise
            except RuntimeError as error:
                if _UNUSED_IN_GRAPH in str(error):  # torch.autograd.grad through the trunk, from inside the step
                    raise TrunkUsageError(
                        f"the step differentiates with respect to a tensor from before {self.partition.name} (torch: "
                        f"{error}). Each stage's step sees only its own part of the graph: a gradient with respect to the "
                        "inputs (adversarial examples, an input-gradient penalty) cannot be taken inside a pipelined step."
                    ) from error
                raise
            self.partition.check_step_output(stage_pass, output)
            return output


def buffers_as_now(buffers: Sequence[tuple[nn.Module, str]]) -> Callable[[], None]:
    """What puts the ``(module, name)`` buffers back to their values now. It writes through ``.data``, as BatchNorm
    updates its statistics: a forward that saved one for backward (BatchNorm saves them) does not see it changed."""
    kept = [(module, name, getattr(module, name).clone()) for module, name in buffers]

    def put_back() -> None:
        for module, name, value in kept:
            getattr(module, name).data.copy_(value)

    return put_back


#: How torch says that ``torch.autograd.grad`` found no path to one of its inputs.
_UNUSED_IN_GRAPH = "appears to not have been used in the graph"


def merge_outputs(outputs: Sequence[Any], sizes: Sequence[int]) -> Any:
    """What the step would have returned for the whole batch, from what it returned for each micro-batch of
    ``sizes`` samples: tensors by :func:`_merge_tensors`; dicts, lists and tuples entry by entry; lists of one entry
    per sample (ids, texts: :func:`_per_sample`) joined; anything else comes back as the list of per-micro-batch
    values."""
    if len(outputs) == 1:
        return outputs[0]
    first = outputs[0]
    if first is None:
        return None
    if isinstance(first, Tensor):
        return _merge_tensors(outputs, sizes)
    if isinstance(first, Mapping):
        return type(first)({k: merge_outputs([o[k] for o in outputs], sizes) for k in first})
    if isinstance(first, list) and _per_sample(outputs, sizes):
        return [item for output in outputs for item in output]
    if isinstance(first, (list, tuple)) and not hasattr(first, "_fields"):
        return type(first)(merge_outputs(parts, sizes) for parts in zip(*outputs))
    return list(outputs)


def _merge_tensors(outputs: Sequence[Tensor], sizes: Sequence[int]) -> Tensor:
    """Rows per sample (each micro-batch's leading dimension a whole multiple ``k >= 1`` of its samples, the same
    ``k`` for all: predictions, or tokens flattened) are concatenated. Any other tensor of one shape for every
    micro-batch is a value of the batch, combined as one device computes it over the batch: a floating-point one
    (a loss, an accuracy, a class-mean vector) as the size-weighted mean, an integer one (a count of correct
    predictions) as the sum, a boolean one (``isnan().any()``) as the any. Tensors of other shapes are concatenated."""
    first = outputs[0]
    if first.dim() > 0:
        multiples = {o.shape[0] // n if n > 0 and o.shape[0] % n == 0 else 0 for o, n in zip(outputs, sizes)}
        rows_per_sample = len(multiples) == 1 and 0 not in multiples
        if rows_per_sample or any(o.shape != first.shape for o in outputs):
            return torch.cat(list(outputs))
    stacked = torch.stack(list(outputs))
    if first.dtype == torch.bool:
        return stacked.any(0)
    if not (first.is_floating_point() or first.is_complex()):
        return stacked.sum(0)
    weights = torch.tensor(sizes, dtype=torch.float64) / sum(sizes)
    total = torch.promote_types(first.dtype, torch.float32)  # bf16/fp16 summed in float32, float64 kept
    weights = weights.to(total).view(-1, *([1] * first.dim()))
    return (stacked.to(total) * weights.to(stacked.device)).sum(0).to(first.dtype)


def _per_sample(outputs: Sequence[Any], sizes: Sequence[int]) -> bool:
    """Whether every micro-batch's list holds one entry per sample (as many as its samples, and not the batched
    tensors of a fixed structure such as ``[logits, hidden]``), so the batch's list is their concatenation."""
    if not all(isinstance(o, list) and len(o) == n for o, n in zip(outputs, sizes)):
        return False
    return not all(isinstance(item, Tensor) and item.dim() > 0 and item.shape[0] == n
                   for o, n in zip(outputs, sizes) for item in o)


def detach_to_cpu(value: Any) -> Any:
    """A copy of ``value`` safe to broadcast: tensors detached and on the CPU."""
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if isinstance(value, Mapping):
        return type(value)({k: detach_to_cpu(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(detach_to_cpu(v) for v in value)
    return value


def _differentiable(value: Any) -> list[Tensor]:
    flat = flatten_activation(value)
    return [t for t in flat[0] if t.requires_grad] if flat is not None else []


def _detached(value: Any) -> Any:
    """``value`` as the next virtual stage receives it, in :func:`flatten_activation`'s structure (a list as a tuple, a
    ``PackedSequence`` as one): every tensor a new leaf, the floating ones tracking gradients where the sent ones did."""
    flat = flatten_activation(value)
    if flat is None:  # cannot cross a boundary (the executor says why at the first step): detach what can
        return tuple(_detached(v) for v in value) if isinstance(value, (tuple, list)) else value
    return rebuild_activation([_new_leaf(t) for t in flat[0]], flat[1])


def _new_leaf(tensor: Tensor) -> Tensor:
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        return tensor.detach().requires_grad_(tensor.requires_grad)
    return tensor.detach()


def stage_parameter_names(
    module: nn.Module, bounds: Sequence[tuple[int, int]], trunk: nn.Sequential,
    chunks: Sequence[Callable[[Any, Any], Any]], micro_batch: Any,
) -> list[set[str]]:
    """The parameter names each stage owns.

    Trunk layers belong to the stage holding them. A parameter outside the trunk belongs to the
    stage whose part of the step gives it a gradient, found by running every stage once on
    ``micro_batch`` (with the random number generators, the module's buffers and torchmetrics
    states restored afterwards); unused and frozen ones go to stage 0, as in the distributed run's checkpoints.

    Raises:
        SharedParameterError: a parameter outside the trunk is used on several stages.
    """
    stage_of: dict[int, int] = {}
    for vs, (start, end) in enumerate(bounds):
        for index in range(start, end):
            for p in trunk[index].parameters():
                stage_of[id(p)] = vs
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    outside = [(n, p) for n, p in named if id(p) not in stage_of]
    users: dict[str, list[int]] = {}
    if outside:
        put_back = buffers_as_now([(holder, leaf) for _, holder, leaf in buffer_slots(module)])
        metrics = _metric_states(module)
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            value: Any = None
            for vs, chunk in enumerate(chunks):
                value = chunk(None if vs == 0 else _detached(value), micro_batch)
                outputs = _differentiable(value)
                if not outputs:
                    continue
                reached = reached_parameters(outputs, {id(p) for _, p in outside})
                for name, p in outside:
                    if id(p) in reached:
                        users.setdefault(name, []).append(vs)
        put_back()
        _restore_metric_states(metrics)
    reject_shared(users, "which step at different times under an asynchronous schedule", SharedParameterError)
    names: list[set[str]] = [set() for _ in bounds]
    for name, p in module.named_parameters():  # frozen ones too: a stage's optimizer share keeps them, as one device's does
        names[stage_of.get(id(p), users.get(name, [0])[0])].add(name)
    return names


def _metric_states(module: nn.Module) -> list[tuple[Any, dict[str, Any]]]:
    saved = []
    for metric in module.modules():
        if isinstance(metric, Metric):
            state = {attr: copy.deepcopy(value) for attr, value in metric.metric_state.items()}
            state.update(_compat.metric_bookkeeping(metric))
            saved.append((metric, state))
    return saved


def _restore_metric_states(saved: list[tuple[Any, dict[str, Any]]]) -> None:
    for metric, state in saved:
        for attr, value in state.items():
            setattr(metric, attr, value)
