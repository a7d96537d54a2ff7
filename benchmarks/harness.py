"""Shared benchmark harness: environment record, the one timer, results files.

Every results file under benchmarks/results/ is a JSON list of runs; a run records the GPU,
library versions, git commit and date next to its measurements, so BENCHMARKS.md tables can be
regenerated from the files alone (benchmarks/report.py).

Timing (`time_calls`, every script's): untimed warm-up calls first (compilation, autotuning,
allocator growth, lazily created optimizer states), then one time per call, reported as
p20 / p50 / p80 (`percentiles`) or the median. Two clocks:
- "cuda": CUDA events recorded on the current stream around each call: the device's time of
  what the call enqueued, without the host's launch latency in between when the calls are
  launched back to back. For kernels, collectives and copies. On a CPU device, perf_counter
  around each call (a smoke test of the script, not a measurement).
- "wall": perf_counter around each call, the device synchronized before the first call and
  after each one: the host's work between kernels counts. For whole training steps, whose
  optimizer, data and host syncs are part of what is measured.
`cuda_span` is the event pair itself, for measurements that time work on two streams at once.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

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


@contextlib.contextmanager
def cuda_span(stream: torch.cuda.Stream | None = None) -> Iterator[Callable[[], float]]:
    """CUDA events recorded on `stream` (the current stream by default) before and after the
    body. Yields a function that returns the seconds between them; call it once the work has
    completed (after a synchronize)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    yield lambda: start.elapsed_time(end) / 1e3
    end.record(stream)


def time_calls(
    fn: Callable[[], object],
    *,
    warmup: int,
    repeat: int,
    clock: Literal["cuda", "wall"] = "cuda",
    sync_each: bool = False,
    device: torch.device | str | None = None,
) -> list[float]:
    """Seconds of each of `repeat` calls of `fn` after `warmup` untimed calls (module docstring:
    the two clocks). With clock="cuda" the calls are launched back to back and the host waits once
    at the end; `sync_each` makes it wait after every call instead (collectives and copies that
    must not queue behind each other). `device`: where the work runs (default: CUDA when present);
    on a CPU device both clocks are perf_counter around each call."""
    cuda = torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    if cuda and clock == "cuda":
        spans = []
        for _ in range(repeat):
            with cuda_span() as seconds:
                fn()
            spans.append(seconds)
            if sync_each:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        return [seconds() for seconds in spans]
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def median(values: list[float]) -> float:
    return statistics.median(values)


def graph_seconds(fn, calls: int = 20, repeat: int = 20) -> float:
    """GPU seconds of one call of `fn`, replayed from a CUDA graph of `calls` calls: the device's
    time with Python's launch overhead taken out (a 45 us kernel is shorter than its launch from
    Python, so back-to-back eager calls would time the host)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return median(time_calls(graph.replay, warmup=3, repeat=repeat)) / calls


def append_results(name: str, run: dict, out: str | Path | None = None) -> Path:
    """Append `run` to RESULTS/name.json, or to out/name.json (a GPU machine's $OUT)."""
    folder = Path(out) if out is not None else RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    runs = json.loads(path.read_text()) if path.exists() else []
    runs.append(run)
    path.write_text(json.dumps(runs, indent=2) + "\n")
    return path
