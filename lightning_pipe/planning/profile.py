"""Per-layer profiles of a trunk: time, parameter bytes, bytes kept for backward, output bytes.

The profiler walks the trunk layer by layer from a sample trunk input: each layer's output is the
next layer's input, exactly as the pipeline runs it. Per layer it measures, at one micro-batch size
on one device:

* forward and backward time: the fastest of its timed runs (a busy machine only adds time) after
  a warm-up that lasts until the timings settle, with more timed rounds while they spread too much,
  and one common cost for structurally identical layers (see :func:`profile_trunk` and
  :mod:`.noise`); backward is
  ``torch.autograd.grad`` of the output with respect to the input and the layer's trainable
  parameters (what a pipeline stage computes), so no ``.grad`` of the model is touched;
* parameter bytes;
* bytes kept for backward: every tensor autograd saves during the forward
  (``torch.autograd.graph.saved_tensors_hooks``), each storage counted once, parameters excluded;
* output bytes: what a stage boundary after this layer would send.

The sample trunk input comes from the module's own code (:func:`capture_trunk_input`): a forward
pre-hook on the trunk stops the user's step (or ``forward``) at the trunk call, the same stop-early
pattern as :class:`~lightning_pipe.partition.split.StageStop`, so code before the trunk (embeddings,
reshapes) runs as in training and the profile sees the real trunk input. An ``nn.ModuleList``
trunk is never called as a whole, so its capture records every block's own call instead
(:class:`BlockInputs`: the hidden state and the extra arguments the user's loop passes, masks and
position tables included) and each block is profiled on its own recorded call.

Profiles are cached in a JSON file keyed by the module class, the trunk's layer structure and
parameter shapes, the input's shapes and dtypes and the device; a cache hit returns without
running any layer.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

from lightning_pipe.partition.split import StageStop
from lightning_pipe.partition.trunk import container_name
from lightning_pipe.planning.noise import MAX_SPREAD, Progress, identical_groups, layer_signature, pooled, timed_rounds
from lightning_pipe.planning.trials import on_device


@dataclass(frozen=True)
class LayerProfile:
    """Costs of one trunk layer at one micro-batch size.

    Args:
        name: the layer's class name.
        forward: forward time in seconds.
        backward: backward time in seconds.
        params: parameter bytes.
        saved: bytes autograd keeps for backward (activations, parameters excluded).
        output: bytes of the layer's output.
    """

    name: str
    forward: float
    backward: float
    params: int
    saved: int
    output: int


@dataclass(frozen=True)
class Profile:
    """Costs of every trunk layer at micro-batch size ``micro_batch`` on ``device``.

    Args:
        micro_batch: samples per micro-batch the profile was measured at.
        device: the device type it was measured on (``"cpu"``, ``"cuda"``...).
        layers: one entry per trunk layer, in order.
        input_bytes: bytes of the trunk input (what the first stage boundary may carry).
        key: the cache key it was stored under.
        spread: how much the timed rounds disagreed: the interquartile range of the per-round time of
            the whole trunk (forward and backward of every layer) over the latest ``repeats`` rounds,
            relative to its median (per layer, the largest, when layers were timed one at a time).
        warmup_rounds: untimed rounds run before the timings settled.
        timed_rounds: timed rounds run (more than ``repeats`` when the first ones spread too much).
        noisy: the spread stayed above the bound: the timings cannot tell the layers' costs apart and
            predictions built on them are not to be trusted.
        groups: indices of structurally identical layers (two or more each), which share one cost.
    """

    micro_batch: int
    device: str
    layers: tuple[LayerProfile, ...]
    input_bytes: int = 0
    key: str = field(default="", compare=False)
    spread: float = field(default=0.0, compare=False)
    warmup_rounds: int = field(default=0, compare=False)
    timed_rounds: int = field(default=0, compare=False)
    noisy: bool = field(default=False, compare=False)
    groups: tuple[tuple[int, ...], ...] = field(default=(), compare=False)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["layers"] = [asdict(layer) for layer in self.layers]
        data["groups"] = [list(group) for group in self.groups]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Profile:
        layers = tuple(LayerProfile(**layer) for layer in data["layers"])
        return cls(data["micro_batch"], data["device"], layers, data.get("input_bytes", 0), data.get("key", ""),
                   data.get("spread", 0.0), data.get("warmup_rounds", 0), data.get("timed_rounds", 0),
                   data.get("noisy", False), tuple(tuple(g) for g in data.get("groups", ())))


def interpolate(profiles: Sequence[Profile], micro_batch: float) -> Profile:
    """Costs at ``micro_batch`` samples, linear in the micro-batch size through the two profiles
    measured at the smallest and largest sizes (extrapolated beyond them, never below zero).

    Parameter bytes do not depend on the size. With one profile, times and activation bytes are
    scaled proportionally to the size.
    """
    ordered = sorted(profiles, key=lambda p: p.micro_batch)
    lo, hi = ordered[0], ordered[-1]
    if hi.micro_batch == lo.micro_batch:
        def line(a: float, _b: float) -> float:
            return a * micro_batch / lo.micro_batch
    else:
        w = (micro_batch - lo.micro_batch) / (hi.micro_batch - lo.micro_batch)

        def line(a: float, b: float) -> float:
            return max(0.0, a + w * (b - a))

    layers = tuple(
        LayerProfile(
            a.name,
            line(a.forward, b.forward),
            line(a.backward, b.backward),
            a.params,
            round(line(a.saved, b.saved)),
            round(line(a.output, b.output)),
        )
        for a, b in zip(lo.layers, hi.layers)
    )
    measured = [p.timed_rounds for p in (lo, hi) if p.timed_rounds]  # the noise of the two, the worse of each
    return Profile(round(micro_batch) or 1, lo.device, layers, round(line(lo.input_bytes, hi.input_bytes)),
                   spread=max(lo.spread, hi.spread), timed_rounds=min(measured, default=0), noisy=lo.noisy or hi.noisy,
                   groups=lo.groups)


@dataclass(frozen=True)
class RecordedCall:
    """One recorded call of a block: ``block(*args, **kwargs)`` (``args[0]`` is the hidden state)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class BlockInputs:
    """What every block of a looped ``nn.ModuleList`` trunk was called with in one step."""

    calls: tuple[RecordedCall, ...]


def capture_trunk_input(
    module: nn.Module, trunk: nn.Module, run: Callable[[], Any], what: str = "the step"
) -> Any:
    """The value ``trunk`` is called with when ``run()`` executes the module's own code
    (:class:`BlockInputs` for an ``nn.ModuleList`` trunk).

    A forward pre-hook on the trunk raises :class:`StageStop` with the trunk's input, so nothing
    after the trunk call runs. ``run`` is e.g. ``lambda: module.training_step(micro_batch, 0)`` or
    ``lambda: module(x)``; it runs under ``torch.no_grad``. The captured input is detached.
    """
    if isinstance(trunk, nn.ModuleList):
        return _capture_block_calls(module, trunk, run, what)

    def stop(_module: nn.Module, args: tuple[Any, ...]) -> None:
        raise StageStop(args[0] if len(args) == 1 else args)

    handle = trunk.register_forward_pre_hook(stop)
    try:
        with torch.no_grad():
            run()
    except StageStop as done:
        return _detached(done.output)
    finally:
        handle.remove()
    raise RuntimeError(
        f"{what} of {type(module).__name__} finished without calling its trunk; profiling needs the step (or "
        f"forward) to call the {container_name(trunk)} trunk once."
    )


def _capture_block_calls(module: nn.Module, trunk: nn.ModuleList, run: Callable[[], Any], what: str) -> BlockInputs:
    calls: dict[int, RecordedCall] = {}

    def hook(index: int) -> Callable[..., None]:
        def record(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if index in calls:
                raise StageStop(None)  # the trunk's second use (e.g. generation): one pass is all we need
            calls[index] = RecordedCall(*_detached((args, kwargs)))
        return record

    handles = [block.register_forward_pre_hook(hook(i), with_kwargs=True) for i, block in enumerate(trunk)]
    try:
        with torch.no_grad():
            run()
    except StageStop:
        pass
    finally:
        for handle in handles:
            handle.remove()
    if len(calls) != len(trunk):
        raise RuntimeError(
            f"{what} of {type(module).__name__} ran {len(calls)} of the {len(trunk)} blocks of its {container_name(trunk)} trunk; "
            "profiling needs the step (or forward) to run every block once, in one loop."
        )
    return BlockInputs(tuple(calls[i] for i in range(len(trunk))))


def _detached(value: Any) -> Any:
    return tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, value)


def profile_key(module: nn.Module, trunk: nn.Module, sample: Any, device: torch.device | str) -> str:
    """Cache key: module class, each layer's repr and parameter shapes/dtypes, input shapes/dtypes, device."""
    leaves, _ = tree_flatten(_as_tree(sample))
    parts = [
        f"{type(module).__module__}.{type(module).__qualname__}",
        *(f"{layer!r}|{[(tuple(p.shape), str(p.dtype), p.requires_grad) for p in layer.parameters()]}" for layer in trunk),
        repr([(tuple(t.shape), str(t.dtype)) if isinstance(t, Tensor) else repr(t) for t in leaves]),
        torch.device(device).type,
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def load_cached(path: str | os.PathLike | None, key: str) -> Profile | None:
    if path is None or not os.path.exists(path):
        return None
    with open(path) as handle:
        entry = json.load(handle).get(key)
    return Profile.from_json(entry) if entry is not None else None


def store_cached(path: str | os.PathLike | None, profile: Profile) -> None:
    if path is None:
        return
    path = Path(path)
    data = json.loads(path.read_text()) if path.exists() else {}
    data[profile.key] = profile.to_json()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
    partial.write_text(json.dumps(data, indent=1))
    os.replace(partial, path)  # a concurrent reader never sees half a file


def profile_trunk(
    trunk: nn.Sequential | nn.ModuleList,
    sample: Any,
    device: torch.device | str = "cpu",
    repeats: int = 9,
    warmup: int = 3,
    cache: str | os.PathLike | None = None,
    module: nn.Module | None = None,
    settle: float = 0.05,
    max_warmup: int = 60,
    max_spread: float | None = MAX_SPREAD,
    max_repeats: int | None = None,
    progress: Progress | None = None,
) -> Profile:
    """Measure every layer of ``trunk`` on ``device``, starting from the trunk input ``sample``.

    Warm-up runs until the timings settle: at least ``warmup`` rounds, then until the last three
    rounds' times agree within ``settle`` (relative to their median), at most ``max_warmup`` rounds.
    The first runs of a process pay one-time costs (kernel selection, allocator growth, thread pools)
    that can make a cold profile 100× slower than the run it predicts. When every layer already lives
    on ``device`` a round runs every layer once, and the timed rounds go round-robin the same way, so
    a slow phase of a shared machine hits all layers alike instead of inflating one; otherwise each
    layer is copied to ``device`` in turn and warmed and timed there before the next (only one
    layer's copy exists at a time).

    Noise (:mod:`.noise`): while the latest ``repeats`` timed rounds spread more than ``max_spread``,
    ``repeats`` more are timed, at most ``max_repeats``; a profile still above the bound is marked
    ``noisy`` (and not cached). Structurally identical layers get one common cost, the median of
    their fastest runs, so noise cannot tell identical blocks apart.

    Args:
        trunk: the ``nn.Sequential`` or ``nn.ModuleList`` to profile (unchanged: layers that are not
            already on ``device`` are profiled as copies moved there one at a time).
        sample: a trunk input for one micro-batch (its dim 0 is the micro-batch size), or the
            :class:`BlockInputs` of a looped ``nn.ModuleList`` (each block runs on its own call).
        device: where to measure (the device the stage will run on).
        repeats: timed rounds in a batch; each layer's cost is the fastest of all its timed runs.
        warmup: untimed rounds at least.
        cache: JSON file of profiles; a profile with the same key is returned without measuring,
            a new one that is not noisy is added.
        module: the owning module (its class goes into the cache key).
        settle: relative agreement of the last three warm-up rounds that ends the warm-up.
        max_warmup: most warm-up rounds (a machine that never settles is measured anyway; ``spread``
            then shows it).
        max_spread: bound on the spread (interquartile range / median of the per-round totals) of
            the latest ``repeats`` timed rounds; above it more rounds are timed. ``None``: time
            ``repeats`` rounds and never call the profile noisy.
        max_repeats: most timed rounds (default ``4 * repeats``).
        progress: ``progress(phase, done, total)`` after every warm-up and timed round (``total`` is
            ``None`` while the warm-up is open-ended).
    """
    device = torch.device(device)
    key = profile_key(module if module is not None else trunk, trunk, sample, device)
    cached = load_cached(cache, key)
    if cached is not None:
        return cached
    looped = isinstance(sample, BlockInputs)
    calls = [RecordedCall(*on_device((c.args, c.kwargs), device)) for c in sample.calls] if looped else []
    value = calls[0].args[0] if looped else on_device(sample, device)
    leaves, _ = tree_flatten(value)
    micro_batch = next((t.shape[0] for t in leaves if isinstance(t, Tensor) and t.dim()), 1)
    input_bytes = _bytes(value)
    round_robin = all(_on(layer, device) for layer in trunk)
    noise = dict(max_spread=max_spread, max_repeats=max_repeats, progress=progress)
    runners, timings, static, signatures, warmups, measured = [], [], [], [], [], []
    for index, layer in enumerate(trunk):
        call = calls[index] if looped else RecordedCall((value,), {})
        signatures.append(layer_signature(layer, call.args, call.kwargs))
        runner = _LayerRunner(layer if _on(layer, device) else copy.deepcopy(layer).to(device), call, device)
        _, _, saved, output = runner.run(measure_saved=True)
        static.append((type(layer).__name__, sum(p.numel() * p.element_size() for p in layer.parameters()), saved, _bytes(output)))
        value = _detached(output)
        if round_robin:
            runners.append(runner)
        else:  # warm and time this copy before the next layer's copy exists
            where = f"layer {index + 1}/{len(trunk)} "
            warmups.append(_settle(lambda: sum(runner.run()[:2]), warmup, settle, max_warmup, progress, where + "warm-up"))
            measured.append(timed_rounds(lambda: [runner.run()[:2]], repeats, **noise, phase=where + "timed"))
            timings.append([r[0] for r in measured[-1].rounds])
            del runner
    if round_robin:
        warmups.append(_settle(lambda: sum(sum(r.run()[:2]) for r in runners), warmup, settle, max_warmup, progress, "warm-up"))
        measured.append(timed_rounds(lambda: [runner.run()[:2] for runner in runners], repeats, **noise))
        timings = [list(per_layer) for per_layer in zip(*measured[-1].rounds)]
    # the fastest of the timed runs: interference from a busy machine only ever adds time, so the
    # minimum is what the layer costs and is far more repeatable than a median under load
    groups = identical_groups(signatures)
    forward = pooled([min(f for f, _ in runs) for runs in timings], groups)
    backward = pooled([min(b for _, b in runs) for runs in timings], groups)
    layers = tuple(
        LayerProfile(name, f, b, params, saved, out) for (name, params, saved, out), f, b in zip(static, forward, backward)
    )
    profile = Profile(
        micro_batch, device.type, layers, input_bytes, key, max((m.spread for m in measured), default=0.0),
        max(warmups, default=0), max((len(m.rounds) for m in measured), default=0), any(m.noisy for m in measured), groups,
    )
    if not profile.noisy:  # a noisy profile is not worth keeping: the next start measures again
        store_cached(cache, profile)
    return profile


def _settle(
    one_round: Callable[[], float], at_least: int, tolerance: float, at_most: int, progress: Progress | None = None,
    phase: str = "warm-up",
) -> int:
    """Run ``one_round`` until its last three times agree within ``tolerance`` of their median (at
    least ``at_least``, at most ``at_most`` rounds); return how many ran."""
    times: list[float] = []
    while len(times) < max(at_least, 3) or (
        len(times) < at_most and max(times[-3:]) - min(times[-3:]) > tolerance * statistics.median(times[-3:])
    ):
        times.append(one_round())
        if progress is not None:
            progress(phase, len(times), None)
    return len(times)


def _as_tree(sample: Any) -> Any:
    """A pytree of a sample (a looped trunk's calls as tuples and dicts)."""
    if isinstance(sample, BlockInputs):
        return [(c.args, c.kwargs) for c in sample.calls]
    return sample


def _on(layer: nn.Module, device: torch.device) -> bool:
    tensors = [*layer.parameters(), *layer.buffers()]
    return all(t.device.type == device.type and (device.index is None or t.device == device) for t in tensors)


def _bytes(value: Any) -> int:
    leaves, _ = tree_flatten(value)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, Tensor))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _LayerRunner:
    """Runs one layer's forward and backward on a fixed call, timing both (gradients flow to the
    call's first argument, the activation; the others are constants of the step, e.g. masks)."""

    def __init__(self, layer: nn.Module, call: RecordedCall, device: torch.device) -> None:
        self.layer, self.call, self.device = layer, call, device
        self.params = [p for p in layer.parameters() if p.requires_grad]
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in layer.parameters()}

    def run(self, measure_saved: bool = False) -> tuple[float, float, int, Any]:
        """``(forward seconds, backward seconds, bytes saved for backward, output)``."""
        inputs = tree_map(
            lambda t: t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, Tensor) else t, self.call.args[0]
        )
        grad_inputs = [t for t in tree_flatten(inputs)[0] if isinstance(t, Tensor) and t.requires_grad]
        saved: dict[int, int] = {}

        def pack(t: Tensor) -> Tensor:
            if measure_saved:
                storage = t.untyped_storage()
                if storage.data_ptr() not in self.param_ptrs:
                    saved[storage.data_ptr()] = storage.nbytes()
            return t

        device = self.device
        _sync(device)
        start = time.perf_counter()
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            output = self.layer(inputs, *self.call.args[1:], **self.call.kwargs)
        _sync(device)
        forward = time.perf_counter() - start
        outs = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.requires_grad]
        backward = 0.0
        if outs and (grad_inputs or self.params):
            grads = [torch.ones_like(t) for t in outs]
            _sync(device)
            start = time.perf_counter()
            torch.autograd.grad(outs, [*grad_inputs, *self.params], grads, allow_unused=True)
            _sync(device)
            backward = time.perf_counter() - start
        return forward, backward, sum(saved.values()), output
