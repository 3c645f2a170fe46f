"""Tests that run in this process: schedules, planner, simulator, oracles, one-device Lightning runs."""
