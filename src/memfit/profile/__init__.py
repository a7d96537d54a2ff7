"""Measure what ran: the memory of real training steps by the planner's categories, and the
memory timeline of a step (see `measure.py` for how each category is measured)."""

from memfit.profile.measure import CATEGORIES, PHASES, MemoryMeasurement, measure_memory
from memfit.profile.timeline import (
    CudaTimelineRecorder,
    MatplotlibMissing,
    MemoryTimeline,
    plot_timeline,
    timeline_from_trace,
)

__all__ = [
    "CATEGORIES",
    "PHASES",
    "CudaTimelineRecorder",
    "MatplotlibMissing",
    "MemoryMeasurement",
    "MemoryTimeline",
    "measure_memory",
    "plot_timeline",
    "timeline_from_trace",
]
