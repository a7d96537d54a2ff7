"""What the ops tests share: running a test on the plain-PyTorch path or on the Triton kernels
under the interpreter, and checking which of the two really ran."""

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
