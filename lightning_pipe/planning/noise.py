"""What in a profile is noise: how much timed rounds disagree, when to time more, which layers cost the same.

A profile's timings are only as good as the machine was quiet. Two rules keep the planner from
building confident advice on noise (docs/planning.md, "Noise"):

* :func:`timed_rounds`: timed rounds come in batches of ``repeats``. While the latest batch's
  spread (interquartile range of the per-round totals over their median) exceeds ``max_spread``,
  another batch is timed, up to ``max_repeats`` rounds in all; a profile whose latest batch still
  spreads more is *noisy*, and the planner then claims no speed-up.
* :func:`identical_groups` / :func:`pooled`: layers of the same structure (class, ``repr``, parameter
  and buffer shapes, the shapes of what they are called with) cost the same by construction, so
  whatever their timings disagree by is noise; every member gets the group's median. Identical
  blocks therefore get equal costs and the uniform split, however loaded the machine.

Nothing here times anything itself; the profiler (:mod:`.profile`) passes its round function in.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

#: Default bound on the timed rounds' spread (interquartile range / median) before more rounds are timed.
MAX_SPREAD = 0.25
#: Default most timed rounds, as a multiple of ``repeats``.
MAX_REPEATS_FACTOR = 4
#: Default least predicted gain (relative) for which the planner leaves the uniform split.
MIN_GAIN = 0.05

#: ``progress(phase, done, total)``: ``phase`` is e.g. ``"warm-up"`` or ``"timed"``, ``total`` ``None``
#: while open-ended (a warm-up lasts until the timings settle).
Progress = Callable[[str, int, "int | None"], None]

Round = list[tuple[float, float]]  # (forward, backward) seconds per layer in one round


@dataclass(frozen=True)
class TimedRounds:
    """The timed rounds of a profile and how much they disagreed.

    Args:
        rounds: every timed round, each ``(forward, backward)`` seconds per layer.
        spread: the latest ``repeats`` rounds' interquartile range of per-round totals over their median.
        noisy: ``spread`` still exceeded the bound after the most rounds allowed.
    """

    rounds: list[Round]
    spread: float
    noisy: bool


def relative_spread(values: Sequence[float]) -> float:
    """Interquartile range over median (0 for fewer than two values)."""
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4)
    middle = statistics.median(values)
    return (q3 - q1) / middle if middle > 0 else 0.0


def timed_rounds(
    one_round: Callable[[], Round],
    repeats: int,
    max_spread: float | None = MAX_SPREAD,
    max_repeats: int | None = None,
    progress: Progress | None = None,
    phase: str = "timed",
) -> TimedRounds:
    """Time ``repeats`` rounds, then further batches of ``repeats`` while the latest batch spreads
    more than ``max_spread``, at most ``max_repeats`` rounds (default ``4 * repeats``).

    Judging the latest batch, not all rounds, lets a burst of load early on be outlived: once the
    machine quietens, a batch within the bound ends the measuring (the layer costs are the fastest
    runs over all rounds, which only gain from more). ``max_spread=None`` times ``repeats`` rounds
    and never calls a profile noisy. ``progress(phase, done, total)`` hears of every round.
    """
    repeats = max(1, repeats)
    most = max(repeats, MAX_REPEATS_FACTOR * repeats if max_repeats is None else max_repeats)
    rounds: list[Round] = []
    target = repeats
    while True:
        while len(rounds) < target:
            rounds.append(one_round())
            if progress is not None:
                progress(phase, len(rounds), target)
        spread = relative_spread([sum(f + b for f, b in r) for r in rounds[-repeats:]])
        if max_spread is None or spread <= max_spread or len(rounds) >= most:
            return TimedRounds(rounds, spread, max_spread is not None and spread > max_spread)
        target = min(most, len(rounds) + repeats)


# ---------------------------------------------------------------------------------- identical layers
def layer_signature(layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """What a layer's cost depends on: its class, ``repr`` (hyper-parameters such as a stride or a
    dropout rate), parameter and buffer shapes and dtypes, and the shapes and dtypes of the call
    (``args``, ``kwargs``; non-tensor arguments by ``repr``). Equal signatures, equal cost."""
    leaves, _ = tree_flatten((args, kwargs))
    parts = [
        f"{type(layer).__module__}.{type(layer).__qualname__}",
        repr(layer),
        repr([(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in layer.named_parameters()]),
        repr([(n, tuple(b.shape), str(b.dtype)) for n, b in layer.named_buffers()]),
        repr([(tuple(t.shape), str(t.dtype)) if isinstance(t, Tensor) else repr(t) for t in leaves]),
    ]
    return "\n".join(parts)


def identical_groups(signatures: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """Indices of layers with equal signatures, groups of two or more, ordered by their first member."""
    members: dict[str, list[int]] = {}
    for index, signature in enumerate(signatures):
        members.setdefault(signature, []).append(index)
    return tuple(tuple(group) for group in members.values() if len(group) > 1)


def pooled(values: Sequence[float], groups: Sequence[Sequence[int]]) -> list[float]:
    """``values`` with every group's members replaced by the group's median (the others as they are).

    The median, not the minimum: each member's value is already the fastest of its own runs, so the
    median keeps a pooled cost comparable to a lone layer's, and one member's lucky run does not
    make the whole group look cheap.
    """
    result = list(values)
    for group in groups:
        common = statistics.median(values[i] for i in group)
        for i in group:
            result[i] = common
    return result


__all__ = [
    "MAX_REPEATS_FACTOR", "MAX_SPREAD", "MIN_GAIN", "Progress", "TimedRounds", "identical_groups", "layer_signature", "pooled",
    "relative_spread", "timed_rounds",
]
