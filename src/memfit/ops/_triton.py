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
import functools
import importlib.util
import os
import threading
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
try:  # grid dependency control (Hopper and later): programmatic dependent launch
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_GDC = True
except ImportError:  # an older triton, or none: kernels are never launched with PDL
    HAS_GDC = False
    gdc_launch_dependents = gdc_wait = None
_cpu_requested = False
_pdl_scope = threading.local()


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


def kernels_requested(device: torch.device) -> bool:
    """`use_triton_on` without its torch.compile exception: for an op that keeps its kernels
    under torch.compile (outside the graph, torch.compiler.disable) because no plain path
    Inductor could fuse replaces them (block-sparse attention)."""
    return HAS_TRITON and (device.type == "cuda" or (device.type == "cpu" and _cpu_requested))


def use_triton(tensor: torch.Tensor) -> bool:
    return use_triton_on(tensor.device)


@contextlib.contextmanager
def programmatic_launch() -> Iterator[None]:
    """Launch the decode-step kernels with programmatic dependent launch (PDL) where the GPU
    has it (compute capability 9.0 and later; MEMFIT_PDL=0 turns it off), in this thread.

    A decode step of a small model is a chain of ~150 short kernels, and between two of them the
    GPU idles while the last programs of one drain and the next one starts. Launched with PDL, a
    kernel starts while the one before it still runs: its programs read what no kernel of the
    step writes (a matrix-vector product's first weight tile) and then wait (`gdc_wait`) until
    the kernel before has finished and its writes are visible. Every kernel that takes part
    writes nothing and reads no activation before its wait, so the results are those of plain
    launches. Only the inference engine asks for it: it knows that the weights stay constant
    during a step (an all-gather or an optimizer step writes them in training)."""
    previous = getattr(_pdl_scope, "on", False)
    _pdl_scope.on = True
    try:
        yield
    finally:
        _pdl_scope.on = previous


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels launched now on `device` use programmatic dependent launch."""
    return (
        getattr(_pdl_scope, "on", False)
        and device.type == "cuda"
        and _pdl_supported(device.index if device.index is not None else -1)
    )


@functools.cache
def _pdl_supported(index: int) -> bool:
    if not (HAS_GDC and torch.cuda.is_available()) or interpreter_enabled():
        return False
    if os.environ.get("MEMFIT_PDL", "1").lower() in ("0", "false", "no", "off"):
        return False
    index = torch.cuda.current_device() if index < 0 else index
    return torch.cuda.get_device_capability(index)[0] >= 9


def launch(kernel, grid: tuple[int, ...], device: torch.device, *args, **meta) -> None:
    """kernel[grid](*args, **meta) on `device`: Triton launches on the current CUDA device, so
    switch to the tensors' device if it is another one. On CPU (interpreter) just call it. A
    kernel given PDL=True (its constexpr that guards gdc_wait and gdc_launch_dependents) is
    launched with programmatic dependent launch (`programmatic_launch`)."""
    if meta.get("PDL"):
        meta["launch_pdl"] = True
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

    @triton.jit
    def round_to_e4m3(x):
        """fp32 (within +-448) rounded to nearest even on fp8 e4m3's grid, still fp32: 3
        mantissa bits, steps of 2^-9 below 2^-6. Used only under the interpreter, whose fp32 ->
        fp8 cast drops the carry of a mantissa rounded up into the next binade (31.6 -> 16);
        the cast of the rounded value is exact."""
        exponent = (x.to(tl.uint32, bitcast=True) >> 23) & 0xFF
        exponent = tl.maximum(exponent, 127 - 6)  # the subnormals' fixed step
        step = ((exponent - 3) << 23).to(tl.float32, bitcast=True)
        magic = 12582912.0  # 1.5 * 2^23: adding it rounds |y| < 2^22 to an integer, ties even
        rounded = ((tl.abs(x) / step + magic) - magic) * step
        return tl.where(x < 0, -rounded, rounded)  # (a value rounded to 0 keeps its sign)

else:  # the kernels that call them are never launched without triton

    def round_to_bf16(x):
        raise RuntimeError("round_to_bf16 needs triton")

    def round_to_e4m3(x):
        raise RuntimeError("round_to_e4m3 needs triton")
