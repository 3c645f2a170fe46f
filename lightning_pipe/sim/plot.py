"""Pictures of a pipeline timeline, simulated (:func:`lightning_pipe.sim.simulate.simulate`) or measured
(``PipeStrategy(trace_dir=...)``): a PNG like the papers' figures and a Chrome-trace JSON.

Both take a list of :class:`~lightning_pipe.schedules.ir.TimedAction`. The PNG has one row per device:
forwards blue, backwards green (a split backward: its input gradient ``I`` green, its weight
gradient ``W`` purple), optimizer STEPs dark grey, time spent waiting for a receive (measured
runs) hatched red, idle time light grey; the micro-batch number is written in each box. Chunks of
interleaved schedules are shades of the same colour (later chunks lighter) and parallel pipelines
(avgpipe replicas) get distinct hatchings.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from lightning_pipe.schedules.ir import Kind, TimedAction

_FORWARD = ("#3b6fb6", "#7fa6dc", "#b4cbec", "#d7e3f5")  # shades per chunk, darkest first
_BACKWARD = ("#3a9a5b", "#7cc495", "#b0dcbf", "#d6eedf")
_WEIGHT = ("#7d4e9e", "#a988c2", "#cbb6dc", "#e5daee")
_STEP = "#4d4d4d"
_WAIT = "#e8a0a0"
_IDLE = "#eeeeee"
_HATCHES = ("", "//", "\\\\", "xx", "..", "++")


def _matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError as error:  # pragma: no cover - exercised only without matplotlib
        raise ImportError("timeline pictures need matplotlib; pip install matplotlib (or lightning-pipe[plot]).") from error
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _shade(palette: Sequence[str], chunk: int) -> str:
    return palette[min(chunk, len(palette) - 1)]


def _style(event: TimedAction, show_waits: bool) -> tuple[str, str, str] | None:
    """``(face colour, hatch, label)`` of a drawn event; ``None`` for events not drawn."""
    action = event.action
    if event.end <= event.start:
        return None  # nothing to see (sends, a STEP of zero cost)
    hatch = _HATCHES[action.replica % len(_HATCHES)]
    if action.kind is Kind.FORWARD:
        return _shade(_FORWARD, action.chunk), hatch, str(action.micro_batch)
    if action.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT):
        return _shade(_BACKWARD, action.chunk), hatch, str(action.micro_batch)
    if action.kind is Kind.BACKWARD_WEIGHT:
        return _shade(_WEIGHT, action.chunk), hatch, str(action.micro_batch)
    if action.kind is Kind.STEP:
        return _STEP, hatch, "S"
    if action.kind.is_recv and show_waits:
        return _WAIT, "////", ""
    return None


def timeline_png(
    events: Sequence[TimedAction],
    path: str | os.PathLike[str],
    title: str | None = None,
    device_label: str = "stage",
    show_waits: bool = False,
    dpi: int = 150,
) -> str:
    """Draw ``events`` as a timeline, one row per device, and save a PNG at ``path``.

    Args:
        events: simulated or measured timed actions (sends are not drawn; receives only where
            they waited).
        path: the PNG file to write (parent directories are created).
        title: figure title.
        device_label: row label prefix (``"stage"``; ``"rank"`` for several pipelines).
        show_waits: draw time spent in receives (hatched red) instead of as idle time; useful for
            measured runs, where a receive can also wait for a slow transfer.
        dpi: resolution.

    Returns:
        ``path`` as a string.
    """
    plt = _matplotlib()
    from matplotlib.patches import Patch, Rectangle

    drawn = [(e, style) for e in events if (style := _style(e, show_waits)) is not None]
    if not drawn:
        raise ValueError("no forward, backward or STEP event with a duration to draw; pass the events of a run.")
    devices = sorted({e.device for e in events})
    row = {d: i for i, d in enumerate(devices)}
    begin = min(e.start for e, _ in drawn)
    span = max(e.end for e, _ in drawn) - begin or 1.0
    unit, scale = ("s", 1.0) if span >= 2.0 else ("ms", 1e3)
    per_device = max(sum(1 for e, _ in drawn if e.device == d) for d in devices)
    width = min(max(6.0, 0.3 * per_device + 1.5), 24.0)
    fig, ax = plt.subplots(figsize=(width, 0.55 * len(devices) + 1.3))
    axes_points = width * 72 * 0.85  # drawing width in points (the axes use about 85% of the figure)
    for d in devices:
        ax.add_patch(Rectangle((0, row[d] - 0.4), span * scale, 0.8, facecolor=_IDLE, edgecolor="none", zorder=0))
    for event, (colour, hatch, label) in drawn:
        x, w = (event.start - begin) * scale, event.duration * scale
        y = row[event.device] - 0.4
        ax.add_patch(Rectangle((x, y), w, 0.8, facecolor=colour, edgecolor="white", linewidth=0.5, hatch=hatch, zorder=1))
        box_points = axes_points * event.duration / span
        size = min(9.0, box_points / (0.7 * max(len(label), 1)))
        if label and size >= 3.5:
            text_colour = "white" if colour in (_FORWARD[0], _BACKWARD[0], _WEIGHT[0], _STEP) else "black"
            ax.text(x + w / 2, row[event.device], label, ha="center", va="center", fontsize=size, color=text_colour, zorder=2)
    ax.set_xlim(0, span * scale)
    ax.set_ylim(len(devices) - 0.5, -0.5)  # first device on top, as in the papers
    ax.set_yticks(range(len(devices)), [f"{device_label} {d}" for d in devices])
    ax.set_xlabel(f"time ({unit})")
    kinds = {(e.action.kind, e.action.chunk) for e, _ in drawn}
    chunks = sorted({c for k, c in kinds if k.is_compute})
    handles = []
    for chunk in chunks:
        suffix = f" (chunk {chunk})" if len(chunks) > 1 else ""
        handles.append(Patch(facecolor=_shade(_FORWARD, chunk), label=f"forward{suffix}"))
        if (Kind.BACKWARD, chunk) in kinds:
            handles.append(Patch(facecolor=_shade(_BACKWARD, chunk), label=f"backward{suffix}"))
        if (Kind.BACKWARD_INPUT, chunk) in kinds:
            handles.append(Patch(facecolor=_shade(_BACKWARD, chunk), label=f"input gradient I{suffix}"))
        if (Kind.BACKWARD_WEIGHT, chunk) in kinds:
            handles.append(Patch(facecolor=_shade(_WEIGHT, chunk), label=f"weight gradient W{suffix}"))
    if any(k is Kind.STEP for k, _ in kinds):
        handles.append(Patch(facecolor=_STEP, label="optimizer step"))
    if any(k.is_recv for k, _ in kinds):
        handles.append(Patch(facecolor=_WAIT, hatch="////", label="waiting for a receive"))
    handles.append(Patch(facecolor=_IDLE, label="idle"))
    if title:
        ax.set_title(title, fontsize=10)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    # the legend goes 0.5 inch below the axes, under the tick labels and the x label
    axes_inches = ax.get_position().height * fig.get_figheight()
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.5 / axes_inches),
              ncol=min(len(handles), max(2, int(width / 1.6))), fontsize=7, frameon=False)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return str(path)


def chrome_trace(
    events: Sequence[TimedAction],
    path: str | os.PathLike[str],
    device_label: str = "stage",
    args: Sequence[dict[str, Any]] | None = None,
) -> str:
    """Write ``events`` as Chrome-trace JSON (open in chrome://tracing or https://ui.perfetto.dev).

    One complete (``"ph": "X"``) event per timed action, one thread per device, times in
    microseconds from the earliest event. ``args``, if given, adds fields to each event's ``args``
    (same order as ``events``; e.g. the training step of a measured action).

    Returns:
        ``path`` as a string.
    """
    begin = min((e.start for e in events), default=0.0)
    trace: list[dict[str, Any]] = [
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": d, "args": {"name": f"{device_label} {d}"}}
        for d in sorted({e.device for e in events})
    ]
    for i, event in enumerate(events):
        action = event.action
        fields: dict[str, Any] = {"micro_batch": action.micro_batch, "chunk": action.chunk}
        if action.replica:  # avgpipe's replicas; every other schedule has only replica 0
            fields["replica"] = action.replica
        if args is not None:
            fields.update(args[i])
        trace.append({
            "ph": "X", "name": str(action), "cat": action.kind.value, "pid": 0, "tid": event.device,
            "ts": (event.start - begin) * 1e6, "dur": event.duration * 1e6, "args": fields,
        })
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)
    return str(path)
