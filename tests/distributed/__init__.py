"""Tests that start processes (gloo on CPU): each is marked ``multiprocess`` by tests/conftest.py."""
