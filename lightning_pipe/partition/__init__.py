"""Partitioning: finding the trunk, how many of its layers each stage gets, and cutting it in place."""

from lightning_pipe.partition.balance import min_max_split, resolve_balance, stage_bounds
from lightning_pipe.partition.trunk import find_trunk

__all__ = ["find_trunk", "min_max_split", "resolve_balance", "stage_bounds"]
