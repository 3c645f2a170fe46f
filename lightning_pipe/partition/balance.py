"""How many trunk layers each (virtual) stage gets."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Literal

from torch import nn

from lightning_pipe.errors import BalanceError
from lightning_pipe.partition.trunk import container_name


def resolve_balance(balance: str | Sequence[int], layers: nn.Sequential | nn.ModuleList, parts: int) -> list[int]:
    """Layer counts per stage (in pipeline order) for ``parts`` stages.

    Args:
        balance: a list of layer counts, ``"uniform"`` (equal counts, earlier stages take the
            remainder) or ``"parameters"`` (contiguous split minimising the largest stage's
            parameter count).
        layers: the trunk (``nn.Sequential`` or ``nn.ModuleList``).
        parts: number of (virtual) stages.
    """
    n = len(layers)
    if parts > n:
        raise BalanceError(
            f"the trunk has {n} layers but the pipeline needs {parts} stages; use at most {n} stages "
            f"(or fewer virtual stages), or split the trunk into more {container_name(layers)} entries."
        )
    if isinstance(balance, str):
        if balance == "uniform":
            base, extra = divmod(n, parts)
            return [base + (i < extra) for i in range(parts)]
        if balance == "parameters":
            prefix = [0, *accumulate(sum(p.numel() for p in layer.parameters()) for layer in layers)]
            found = min_max_split(n, parts, lambda i, j, d: prefix[j] - prefix[i], ties="earlier")
            assert found is not None  # every split is feasible
            return found[1]
        raise BalanceError(f"balance={balance!r} is not known; use 'uniform', 'parameters', 'auto' (profile and plan at "
                           "setup) or a list of layer counts.")
    counts = [int(c) for c in balance]
    if len(counts) != parts:
        raise BalanceError(f"balance has {len(counts)} entries but the pipeline has {parts} stages; give one count per stage.")
    if any(c < 1 for c in counts):
        raise BalanceError(f"balance {counts} gives a stage no layers; every stage needs at least one layer.")
    if sum(counts) != n:
        raise BalanceError(f"balance {counts} sums to {sum(counts)} but the trunk has {n} layers; make it sum to {n}.")
    return counts


def min_max_split(
    layers: int,
    stages: int,
    cost: Callable[[int, int, int], float],
    feasible: Callable[[int, int, int], bool] = lambda i, j, d: True,
    ties: Literal["earlier", "later"] = "later",
) -> tuple[float, list[int]] | None:
    """Exact min-max contiguous split of ``layers`` layers into ``stages`` non-empty stages
    (docs/algorithms.md §12 step 1).

    ``cost(i, j, d)`` and ``feasible(i, j, d)`` describe stage ``d`` holding layers ``i..j-1``.
    Returns ``(bottleneck, counts)`` or ``None`` when no feasible split exists. ``O(P L^2)``
    evaluations. Among equal bottlenecks, ``ties="later"`` puts each boundary as late as possible
    (earlier stages take more layers), ``"earlier"`` as early as possible.
    """
    inf = math.inf
    best = [[inf] * (layers + 1) for _ in range(stages + 1)]
    cut = [[-1] * (layers + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for d in range(1, stages + 1):
        for j in range(d, layers - (stages - d) + 1):
            for i in range(d - 1, j):
                if best[d - 1][i] == inf or not feasible(i, j, d - 1):
                    continue
                value = max(best[d - 1][i], cost(i, j, d - 1))
                if value < best[d][j] or (ties == "later" and value == best[d][j]):
                    best[d][j], cut[d][j] = value, i
    if best[stages][layers] == inf:
        return None
    counts, j = [], layers
    for d in range(stages, 0, -1):
        i = cut[d][j]
        counts.append(j - i)
        j = i
    return best[stages][layers], counts[::-1]


def stage_bounds(counts: Sequence[int]) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` layer index ranges of each stage."""
    ends = list(accumulate(counts))
    return [(end - c, end) for c, end in zip(counts, ends)]
