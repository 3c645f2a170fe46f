"""Every method of the package's Lightning subclasses that overrides a base method carries ``@override``, and
every ``@override`` still overrides something (a hook Lightning renamed or removed would otherwise be dead code)."""

from __future__ import annotations

import inspect

import pytest

from lightning_pipe.lightning.launcher import PipeLauncher
from lightning_pipe.lightning.strategy import PipeStrategy


def _function(member: object) -> object:
    """The function under a property, classmethod or contextmanager."""
    if isinstance(member, property):
        member = member.fget
    if isinstance(member, (classmethod, staticmethod)):
        member = member.__func__
    return inspect.unwrap(member)  # type: ignore[arg-type]


@pytest.mark.parametrize("cls", [PipeStrategy, PipeLauncher])
def test_overriding_methods_say_so(cls: type) -> None:
    bases = cls.__mro__[1:]
    missing, stale = [], []
    for name, member in vars(cls).items():
        function = _function(member)
        if not inspect.isfunction(function) or name.startswith("__"):
            continue
        overrides = any(name in vars(base) for base in bases)
        marked = getattr(function, "__override__", False)
        if overrides and not marked:
            missing.append(name)
        elif marked and not overrides:
            stale.append(name)
    assert not missing, f"{cls.__name__} overrides {missing} without @override"
    assert not stale, f"{cls.__name__}.{stale} carry @override but no base class of Lightning defines them any more"
