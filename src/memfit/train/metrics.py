"""What each optimizer step reports (metrics.jsonl): loss, tokens, throughput, memory, MFU."""

from __future__ import annotations

import json
import os
import resource
from dataclasses import dataclass

import torch


def device_peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of the present GPU from the planner's hardware catalog (for MFU)."""
    if device.type != "cuda":
        return None
    from memfit.planner.hardware import detect_gpu

    gpu = detect_gpu()
    return gpu.bf16_flops if gpu is not None else None


def memory_stats(device: torch.device) -> tuple[int, int]:
    """(allocated, peak) bytes: torch.cuda's allocator statistics on CUDA; on CPU the process's
    resident set size now and at its maximum."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    try:
        with open("/proc/self/statm") as f:
            current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        current = peak
    return current, peak


@dataclass
class StepMetrics:
    step: int
    loss: float
    tokens: int
    tokens_per_s: float
    step_time_s: float
    lr: float
    grad_norm: float
    mem_allocated_bytes: int
    mem_peak_bytes: int
    loss_scale: float | None = None
    skipped: bool = False
    mfu: float | None = None

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in self.__dict__.items() if v is not None})
