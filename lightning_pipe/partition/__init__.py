"""Partitioning: which trunk layers each stage runs."""

from lightning_pipe.partition.balance import BalanceError, min_max_split, resolve_balance, stage_bounds
from lightning_pipe.partition.trunk import TrunkError, find_trunk

__all__ = ["BalanceError", "TrunkError", "find_trunk", "min_max_split", "resolve_balance", "stage_bounds"]
