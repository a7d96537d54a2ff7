"""Know before you run: the hardware catalog, the memory model, the time model and the strategy
search."""

from memfit.planner.hardware import GPU, GPUS, detect_gpu, get_gpu
from memfit.planner.memory import (
    CATEGORIES,
    MemoryPlan,
    Strategy,
    fine_tuning_fields,
    plan,
    what_would_fit,
)
from memfit.planner.search import Recommendation, rank_goals, rank_strategies, recommend
from memfit.planner.time import StepTime, step_time

__all__ = [
    "CATEGORIES",
    "GPU",
    "GPUS",
    "MemoryPlan",
    "Recommendation",
    "StepTime",
    "Strategy",
    "detect_gpu",
    "fine_tuning_fields",
    "get_gpu",
    "plan",
    "rank_goals",
    "rank_strategies",
    "recommend",
    "step_time",
    "what_would_fit",
]
