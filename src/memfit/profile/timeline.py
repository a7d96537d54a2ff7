"""The memory timeline of one training step: allocated bytes after every allocator event, with the
forward / backward / optimizer spans marked, and its plot.

Recording (CUDA only): `CudaTimelineRecorder` switches on the caching allocator's history
(`torch.cuda.memory._record_memory_history(enabled="all", context=None, max_entries=...)`, no
stack traces: cheap, and it allocates nothing on the device) for one step and reads it back with
`torch.cuda.memory._snapshot()`. Both are private but stable APIs: the same signature
(`enabled`, `context`, `stacks`, `max_entries`) and the same trace format (`device_traces`, one
list of events per device, each a dict with `action` and `size`) from PyTorch 2.1 to 2.13. The
events that change what is allocated are `alloc` (+size) and `free_completed` (-size; a free
becomes "completed" once no other stream still uses the block); `segment_alloc` and
`segment_free` change what is reserved (cudaMalloc'd). Sizes are the allocator's block sizes
(requests rounded up to 512 bytes), the unit of `torch.cuda.memory_allocated()`, so the curve
starts at `memory_allocated()` and its maximum is the step's `max_memory_allocated()`.
A phase boundary is marked by taking a snapshot and noting how many events the history then
holds. Switching the history off clears it; an earlier recording of the user's is lost.

On CPU there is no allocator history: no timeline is recorded and nothing is plotted (the
breakdown is still measured, see `measure.py`). Sampling live bytes at module hooks would show
the forward only, and a CPU profile is a test of the method, not of a memory budget.

The plot (`plot_timeline`) needs matplotlib, imported lazily and drawn on a bare `Figure` (the
Agg canvas: no display, no global pyplot state); without it `MatplotlibMissing` says how to get it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

_ALLOCATED_DELTA = {"alloc": 1, "free_completed": -1}
# segment_map / segment_unmap: the same with expandable segments (PYTORCH_CUDA_ALLOC_CONF)
_RESERVED_DELTA = {"segment_alloc": 1, "segment_free": -1, "segment_map": 1, "segment_unmap": -1}
# Colors of the phase spans in the plot.
_PHASE_COLORS = {"forward": "tab:blue", "backward": "tab:orange", "optimizer": "tab:green"}


class MatplotlibMissing(ImportError):
    """matplotlib is not installed; the timeline plot cannot be drawn."""


@dataclass
class MemoryTimeline:
    """Memory of one step after each allocator event.

    points: (event index, allocated bytes) after each alloc / free, event 0 being the state when
        recording started; reserved: (event index, reserved bytes) at each segment change (and at
        both ends); phases: (name, first event index, last event index) of each forward, backward
        and optimizer span, in order (with gradient accumulation, one forward and one backward per
        micro-batch); truncated: the history overflowed `max_entries` and lost its oldest events.
    """

    points: list[tuple[int, int]]
    reserved: list[tuple[int, int]] = field(default_factory=list)
    phases: list[tuple[str, int, int]] = field(default_factory=list)
    truncated: bool = False

    @property
    def peak_bytes(self) -> int:
        return max((allocated for _, allocated in self.points), default=0)


def timeline_from_trace(
    trace: Sequence[dict[str, Any]],
    *,
    start_allocated: int,
    start_reserved: int,
    marks: Sequence[tuple[str, int]] = (),
    truncated: bool = False,
) -> MemoryTimeline:
    """Turn one device's allocator trace into a `MemoryTimeline`.

    trace: the events of `torch.cuda.memory._snapshot()["device_traces"][device]`, oldest first.
    start_allocated / start_reserved: `memory_allocated()` / `memory_reserved()` when recording
    started. marks: (label, number of trace entries at that moment); labels "<phase>:begin" and
    "<phase>:end" delimit the spans.
    """
    allocated, reserved = start_allocated, start_reserved
    points = [(0, allocated)]
    reserved_points = [(0, reserved)]
    # event index (x) of the state after trace entry i, for turning marks into x positions
    x_after_entry = []
    x = 0
    for entry in trace:
        action = entry.get("action")
        if action in _ALLOCATED_DELTA:
            x += 1
            allocated += _ALLOCATED_DELTA[action] * int(entry["size"])
            points.append((x, allocated))
        elif action in _RESERVED_DELTA:
            reserved += _RESERVED_DELTA[action] * int(entry["size"])
            reserved_points.append((x, reserved))
        x_after_entry.append(x)
    reserved_points.append((x, reserved))

    def position(entries: int) -> int:
        return x_after_entry[entries - 1] if entries > 0 else 0

    phases = []
    open_spans: dict[str, int] = {}
    for label, entries in marks:
        name, _, edge = label.partition(":")
        if edge == "begin":
            open_spans[name] = position(min(entries, len(x_after_entry)))
        elif edge == "end" and name in open_spans:
            end = position(min(entries, len(x_after_entry)))
            phases.append((name, open_spans.pop(name), end))
    return MemoryTimeline(
        points=points, reserved=reserved_points, phases=phases, truncated=truncated
    )


class CudaTimelineRecorder:
    """Record the caching allocator's events between `start()` and `stop()` on one CUDA device;
    `mark(label)` notes a phase boundary. Use: start(); mark("forward:begin"); ...; stop()."""

    def __init__(self, device: torch.device, *, max_entries: int = 2_000_000) -> None:
        if device.type != "cuda":
            raise ValueError(
                f"the memory timeline is recorded from CUDA's caching allocator; got device {device}"
            )
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.max_entries = max_entries
        self.marks: list[tuple[str, int]] = []
        self._start_allocated = 0
        self._start_reserved = 0

    def _trace(self) -> list[dict[str, Any]]:
        traces = torch.cuda.memory._snapshot(self.device)["device_traces"]
        return traces[self.index] if self.index < len(traces) else []

    def start(self) -> None:
        torch.cuda.memory._record_memory_history(enabled=None)  # off: also clears any history
        self.marks = []
        self._start_allocated = torch.cuda.memory_allocated(self.device)
        self._start_reserved = torch.cuda.memory_reserved(self.device)
        torch.cuda.memory._record_memory_history(
            enabled="all", context=None, stacks="python", max_entries=self.max_entries
        )

    def mark(self, label: str) -> None:
        self.marks.append((label, len(self._trace())))

    def stop(self) -> MemoryTimeline:
        try:
            trace = self._trace()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        return timeline_from_trace(
            trace,
            start_allocated=self._start_allocated,
            start_reserved=self._start_reserved,
            marks=self.marks,
            truncated=len(trace) >= self.max_entries,
        )


def plot_timeline(
    points: Sequence[tuple[int, int]],
    phases: Sequence[tuple[str, int, int]],
    path: Path,
    title: str,
    *,
    reserved: Sequence[tuple[int, int]] = (),
) -> Path:
    """Write a PNG of allocated (and, if given, reserved) GiB against allocator events, with the
    forward / backward / optimizer spans shaded. Raises `MatplotlibMissing` without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise MatplotlibMissing(
            "the memory timeline plot needs matplotlib: pip install matplotlib to get the plot"
        ) from error

    gib = 2**30
    figure = Figure(figsize=(10, 4.5), layout="constrained")
    axes = figure.add_subplot()
    labelled: set[str] = set()
    for name, start, end in phases:
        axes.axvspan(
            start,
            max(end, start + 0.5),
            color=_PHASE_COLORS.get(name, "tab:gray"),
            alpha=0.15,
            linewidth=0,
            label=None if name in labelled else name,
        )
        labelled.add(name)
    if reserved:
        xs, ys = zip(*reserved, strict=True)
        axes.step(
            xs,
            [y / gib for y in ys],
            where="post",
            color="tab:gray",
            linestyle="--",
            label="reserved",
        )
    if points:
        xs, ys = zip(*points, strict=True)
        axes.step(xs, [y / gib for y in ys], where="post", color="black", label="allocated")
        peak_x, peak_y = max(points, key=lambda point: point[1])
        axes.annotate(
            f"peak {peak_y / gib:.2f} GiB",
            (peak_x, peak_y / gib),
            textcoords="offset points",
            xytext=(5, 5),
        )
    axes.set_xlabel("allocator event (alloc or free) in the step")
    axes.set_ylabel("GiB")
    axes.set_ylim(bottom=0)
    axes.set_title(title)
    axes.legend(loc="upper left")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    return path
