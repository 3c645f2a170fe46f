"""How many trunk layers each (virtual) stage gets."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

from torch import nn


class BalanceError(ValueError):
    """The requested split does not fit the trunk."""


def resolve_balance(balance: str | Sequence[int], layers: nn.Sequential, parts: int) -> list[int]:
    """Layer counts per stage (in pipeline order) for ``parts`` stages.

    Args:
        balance: a list of layer counts, ``"uniform"`` (equal counts, earlier stages take the
            remainder) or ``"parameters"`` (contiguous split minimising the largest stage's
            parameter count).
        layers: the trunk.
        parts: number of (virtual) stages.
    """
    n = len(layers)
    if parts > n:
        raise BalanceError(
            f"the trunk has {n} layers but the pipeline needs {parts} stages; use at most {n} stages "
            "(or fewer virtual stages), or split the trunk into more nn.Sequential entries."
        )
    if isinstance(balance, str):
        if balance == "uniform":
            base, extra = divmod(n, parts)
            return [base + (i < extra) for i in range(parts)]
        if balance == "parameters":
            return min_max_split([sum(p.numel() for p in layer.parameters()) for layer in layers], parts)
        raise BalanceError(f"balance={balance!r} is not known; use 'uniform', 'parameters' or a list of layer counts.")
    counts = [int(c) for c in balance]
    if len(counts) != parts:
        raise BalanceError(f"balance has {len(counts)} entries but the pipeline has {parts} stages; give one count per stage.")
    if any(c < 1 for c in counts):
        raise BalanceError(f"balance {counts} gives a stage no layers; every stage needs at least one layer.")
    if sum(counts) != n:
        raise BalanceError(f"balance {counts} sums to {sum(counts)} but the trunk has {n} layers; make it sum to {n}.")
    return counts


def min_max_split(costs: Sequence[float], parts: int) -> list[int]:
    """Exact contiguous split of ``costs`` into ``parts`` non-empty runs minimising the largest sum.

    Dynamic program over prefix sums, ``O(parts * n^2)``; ties prefer earlier boundaries.
    """
    n = len(costs)
    prefix = [0.0, *accumulate(costs)]
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for j in range(k, n - (parts - k) + 1):
            for i in range(k - 1, j):
                cost = max(best[k - 1][i], prefix[j] - prefix[i])
                if cost < best[k][j]:
                    best[k][j], cut[k][j] = cost, i
    counts, j = [], n
    for k in range(parts, 0, -1):
        i = cut[k][j]
        counts.append(j - i)
        j = i
    return counts[::-1]


def stage_bounds(counts: Sequence[int]) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` layer index ranges of each stage."""
    ends = list(accumulate(counts))
    return [(end - c, end) for c, end in zip(counts, ends)]
