"""Choosing before training: per-layer profiles, the balanced split and plan search, short trials on
the devices, and avgpipe's tuner. Imports no Lightning (the strategy's side is
:mod:`lightning_pipe.lightning.auto`)."""

from lightning_pipe.planning.planner import Machine, Plan, explore, fixed_plan, plan
from lightning_pipe.planning.profile import LayerProfile, Profile, profile_trunk

__all__ = ["LayerProfile", "Machine", "Plan", "Profile", "explore", "fixed_plan", "plan", "profile_trunk"]
