"""What memfit's ops share: when they run their Triton kernels (and when their plain-PyTorch
path), how they launch, and small layout and dtype helpers.

- CUDA tensors: the Triton kernels, except while torch.compile traces (Inductor then fuses the
  plain-PyTorch path itself) or where triton is not installed.
- CPU tensors: the plain-PyTorch path, except inside `triton_on_cpu()`, which tests use to run
  the kernels under Triton's interpreter. Triton decides whether a kernel is interpreted when the
  kernel is defined, so the interpreter needs TRITON_INTERPRET=1 in the environment before triton
  and memfit.ops are imported (tests/conftest.py sets it on machines without CUDA).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import types
from collections.abc import Iterator

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # no triton on this platform (macOS): kernels are defined, never launched
    HAS_TRITON = False
    triton = types.SimpleNamespace(jit=lambda fn: fn, autotune=None, Config=None)
    tl = types.SimpleNamespace(constexpr=None)
_cpu_requested = False


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


@contextlib.contextmanager
def triton_on_cpu() -> Iterator[None]:
    """Run the ops' Triton kernels on CPU tensors, under the interpreter (for tests)."""
    global _cpu_requested
    if importlib.util.find_spec("triton") is None or not interpreter_enabled():
        raise RuntimeError(
            "triton_on_cpu() needs triton and TRITON_INTERPRET=1 set before triton is imported"
        )
    previous, _cpu_requested = _cpu_requested, True
    try:
        yield
    finally:
        _cpu_requested = previous


def use_triton_on(device: torch.device) -> bool:
    if not HAS_TRITON or torch.compiler.is_compiling():
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and _cpu_requested


def use_triton(tensor: torch.Tensor) -> bool:
    return use_triton_on(tensor.device)


def launch(kernel, grid: tuple[int, ...], device: torch.device, *args, **meta) -> None:
    """kernel[grid](*args, **meta) on `device`: Triton launches on the current CUDA device, so
    switch to the tensors' device if it is another one. On CPU (interpreter) just call it."""
    if (
        device.type == "cuda"
        and device.index is not None
        and device.index != torch.cuda.current_device()
    ):
        with torch.cuda.device(device):
            kernel[grid](*args, **meta)
    else:
        kernel[grid](*args, **meta)


def rows_view(tensor: torch.Tensor) -> torch.Tensor:
    """(..., width) -> (rows, width) with stride(1) == 1: a view when possible, else a copy."""
    tensor2d = tensor.reshape(-1, tensor.shape[-1])
    return tensor2d if tensor2d.stride(1) == 1 else tensor2d.contiguous()


def promoted_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16-bit inputs, fp64 for fp64 inputs (so that gradcheck works)."""
    return torch.promote_types(dtype, torch.float32)


if HAS_TRITON:

    @triton.jit
    def round_to_bf16(x):
        """fp32 -> bf16, rounded to nearest even by integer arithmetic. Used only under the
        interpreter, whose fp32 -> bf16 cast truncates; compiled kernels use .to(tl.bfloat16)."""
        bits = x.to(tl.uint32, bitcast=True)
        bits += 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)

else:  # the kernels that call it are never launched without triton

    def round_to_bf16(x):
        raise RuntimeError("round_to_bf16 needs triton")
