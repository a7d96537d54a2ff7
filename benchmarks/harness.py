"""Shared benchmark harness: environment record, timing, results files.

Every results file under benchmarks/results/ is a JSON list of runs; a run records the GPU,
library versions, git commit and date next to its measurements, so BENCHMARKS.md tables can be
regenerated from the files alone (benchmarks/report.py)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
# NVLink multicast stays off in every process the multi-GPU benchmarks start (the GPU machines
# need it off)
SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def git_commit() -> str:
    """The checkout's commit; MEMFIT_COMMIT overrides it (a copy without .git, e.g. on a GPU box)."""
    if os.environ.get("MEMFIT_COMMIT"):
        return os.environ["MEMFIT_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment() -> dict:
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": git_commit(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    return env


def percentiles(values: list[float]) -> dict[str, float]:
    """p20 / p50 / p80 of `values` (Liger-Kernel's reporting)."""
    q = (
        statistics.quantiles(values, n=10, method="inclusive")
        if len(values) > 1
        else [values[0]] * 9
    )
    return {"p20": q[1], "p50": statistics.median(values), "p80": q[7]}


def time_steps(step: Callable[[], None], *, warmup: int, repeat: int) -> list[float]:
    """Wall time in seconds of each of `repeat` calls of `step` after `warmup` calls, with the
    device synchronized around each call."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    import time

    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return times


def append_results(name: str, run: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    runs = json.loads(path.read_text()) if path.exists() else []
    runs.append(run)
    path.write_text(json.dumps(runs, indent=2) + "\n")
    return path
