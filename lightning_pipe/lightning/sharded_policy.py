"""The weight policy's state in a sharded checkpoint: each rank writes its own parameters' entries.

An asynchronous schedule's policy (2BW's previous version and last update, PipeMare's velocity,
XPipe's last gradient) and avgpipe's (the center, every replica's weights and optimizer state) keep
values *per parameter name*, next to a few numbers that every stage shares after a drain (step and
round counts, the policy's kind). A sharded checkpoint stores them split along that line:

* the **skeleton** (``meta.pt``, rank 0): the state with every name-keyed map replaced by a marker;
* the **entries** (the DCP directory): ``policy.<location>/<parameter>[/<field>]``, written by the
  rank that owns the parameter, e.g. ``policy.previous/model.0.weight`` or
  ``policy.states/1/model.0.weight/exp_avg`` (avgpipe replica 1's optimizer state).

Loading rebuilds, on each rank, the state restricted to the parameters it holds: the same value the
single-file format's merged state would give its policy, which takes its own entries by name. So the
state maps onto any split, stage count or the one-device emulation. Checkpoints are taken at drain
points only, so no entry belongs to a micro-batch in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

BY_NAME = "__pipe_by_name__"  #: a skeleton's marker: a name-keyed map; value: 1 (name -> leaf) or 2 (name -> field -> leaf)
PREFIX = "policy"  #: the entries' top-level key in the DCP directory


def split(state: Any, names: Collection[str], owns: Callable[[str], bool]) -> tuple[Any, dict[str, Any]]:
    """``(skeleton, entries)`` of one rank's policy ``state``.

    Args:
        state: the policy state of this process (a nested structure of dicts, lists and leaves).
        names: the parameter names this process holds; a non-empty dict whose keys all are such
            names is a name-keyed map.
        owns: whether this rank writes a parameter's entries (a parameter outside the trunk held by
            several stages is written by its owner, as the module's state is).
    """
    entries: dict[str, Any] = {}

    def walk(value: Any, location: str) -> Any:
        if isinstance(value, dict) and value and all(isinstance(k, str) and k in names for k in value):
            depth = 2 if all(isinstance(v, dict) for v in value.values()) else 1
            for name, entry in value.items():
                if not owns(name):
                    continue
                if depth == 2:
                    entries.update({f"{location}/{name}/{field}": leaf for field, leaf in entry.items()})
                else:
                    entries[f"{location}/{name}"] = entry
            return {BY_NAME: depth}
        if isinstance(value, dict):
            return {k: walk(v, _join(location, str(k))) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v, _join(location, str(i))) for i, v in enumerate(value)]
        return value

    return walk(state, ""), entries


def merge_skeletons(skeletons: list[Any]) -> Any:
    """One skeleton from every stage's: a location that is a name-keyed map on any stage is one (a map
    can be empty on a stage whose parameters got no gradient)."""
    first = skeletons[0]
    if any(_is_marker(s) for s in skeletons):
        return next(s for s in skeletons if _is_marker(s))
    if isinstance(first, dict) and all(isinstance(s, dict) for s in skeletons):
        return {k: merge_skeletons([s[k] for s in skeletons if k in s]) for k in first}
    if isinstance(first, list) and all(isinstance(s, list) and len(s) == len(first) for s in skeletons):
        return [merge_skeletons([s[i] for s in skeletons]) for i in range(len(first))]
    return first


def request(skeleton: Any, stored: Mapping[str, Any], names: Collection[str],
            placeholder: Callable[[Any], Any]) -> dict[str, Any]:
    """What this rank reads: every stored entry of the parameters ``names`` under the skeleton's
    name-keyed maps, each as ``placeholder(metadata)`` (DCP fills it in place).

    ``stored``: the directory's metadata by key, without the ``policy.`` prefix."""
    wanted: dict[str, Any] = {}
    for location, _ in _markers(skeleton, ""):
        for key, metadata in stored.items():
            if key.startswith(location + "/") and key[len(location) + 1:].split("/", 1)[0] in names:
                wanted[key] = placeholder(metadata)
    return wanted


def join(skeleton: Any, entries: Mapping[str, Any]) -> Any:
    """The policy state the skeleton describes, its name-keyed maps filled with ``entries`` (those read)."""

    def walk(value: Any, location: str) -> Any:
        if _is_marker(value):
            filled: dict[str, Any] = {}
            for key, leaf in entries.items():
                if not key.startswith(location + "/"):
                    continue
                name, _, field = key[len(location) + 1:].partition("/")
                if value[BY_NAME] == 2:
                    filled.setdefault(name, {})[field] = leaf
                else:
                    filled[name] = leaf
            return filled
        if isinstance(value, dict):
            return {k: walk(v, _join(location, str(k))) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v, _join(location, str(i))) for i, v in enumerate(value)]
        return value

    return walk(skeleton, "")


def _join(location: str, key: str) -> str:
    return f"{location}/{key}" if location else key


def _is_marker(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {BY_NAME}


def _markers(value: Any, location: str) -> list[tuple[str, int]]:
    if _is_marker(value):
        return [(location, value[BY_NAME])]
    if isinstance(value, dict):
        return [m for k, v in value.items() for m in _markers(v, _join(location, str(k)))]
    if isinstance(value, list):
        return [m for i, v in enumerate(value) for m in _markers(v, _join(location, str(i)))]
    return []
