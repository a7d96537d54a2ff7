"""What the ops tests share: running a test on the plain-PyTorch path or on the Triton kernels
under the interpreter, and checking which of the two really ran."""

import importlib.util
import sys

import pytest
import torch

import memfit.ops._triton
from memfit.ops._triton import interpreter_enabled


def kernels_on_cpu(monkeypatch, enabled: bool = True) -> None:
    """Route CPU calls to the Triton kernels (Triton's interpreter) for the rest of the test."""
    if enabled and not interpreter_enabled():
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 at startup (tests/conftest.py)")
    monkeypatch.setattr(memfit.ops._triton, "_cpu_requested", enabled)


def on_path(request, monkeypatch, module, launcher: str):
    """Body of a `path` fixture: request.param "triton" runs the op module's kernels on CPU, any
    other value its plain-PyTorch path; afterwards, `module.<launcher>` must have been called on
    the Triton path and only there."""
    if request.param == "triton":
        pytest.importorskip("triton")
        kernels_on_cpu(monkeypatch)
    launches = []
    launch = getattr(module, launcher)
    monkeypatch.setattr(
        module, launcher, lambda *args, **kwargs: launches.append(1) or launch(*args, **kwargs)
    )
    yield request.param
    assert bool(launches) == (request.param == "triton"), "the wrong path ran"


def floor_for(path: str, dtype: torch.dtype) -> float:
    """assert_error_within's floor: its default, plus half a bf16 ulp (2**-8 relative to the
    largest value) for bf16 under the interpreter, which truncates where the GPU rounds."""
    return 2.0**-8 if path == "triton" and dtype == torch.bfloat16 else 1e-6


def import_without_triton(monkeypatch, module, name: str):
    """A fresh copy of op `module` (and of the ops' shared `_triton`) imported as if triton were
    not installed: `import triton` raises ImportError for the rest of the test."""
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
    fresh = []
    for module_name, path in (
        ("memfit.ops._triton", memfit.ops._triton.__file__),
        (name, module.__file__),
    ):
        spec = importlib.util.spec_from_file_location(module_name, path)
        loaded = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, module_name, loaded)
        spec.loader.exec_module(loaded)
        fresh.append(loaded)
    return fresh[-1]
