"""Know before you run: the hardware catalog, the memory model and (soon) the time model and
strategy search."""

from memfit.planner.hardware import GPU, GPUS, detect_gpu, get_gpu
from memfit.planner.memory import CATEGORIES, MemoryPlan, Strategy, plan, what_would_fit

__all__ = [
    "CATEGORIES",
    "GPU",
    "GPUS",
    "MemoryPlan",
    "Strategy",
    "detect_gpu",
    "get_gpu",
    "plan",
    "what_would_fit",
]
