"""Frozen linear layers over quantized weights (QLoRA's base; weight-only quantized inference):
NF4 with double-quantized scales, int8 per row, or int4 in groups of 128 input features,
asymmetric (memfit.ops.quant), dequantized to the compute dtype for each product.

    quantize_model(model, "nf4", dtype=torch.bfloat16)   # every linear layer of the blocks

`QuantizedWeight` holds a weight's quantized state as buffers (saved with the model);
`quantized_linear` is y = x W^T (+ b) with W dequantized in the forward, and again in the
backward for the input's gradient: autograd keeps no dequantized copy of W between the two,
only x's gradient flows (W is frozen), and nothing of x is saved. A `LoRALinear` whose base is
quantized (`LoRALinear.quantize`) adds its adapters' update to this product.

Where the Triton kernels run (CUDA; bf16 or fp16 compute), a product of at most
FUSED_MAX_ROWS[kind] rows dequantizes W inside the matmul kernel (memfit.ops.quant.matmul): no
copy of W in the compute dtype is made. Larger products dequantize W with the same tile code into
a transient buffer of one layer's weight and multiply with cuBLAS: on an H200 (Triton 3.6,
benchmarks/results/quant_matmul.json) that is faster for NF4 at every row count measured
(llama-3-8b's gate_up, 2048 rows: 0.7 ms against 10 ms fused; the kernel's per-element code
lookup is a gather, which Triton pipelines through shared memory) and for int8 above 16 rows (at
8192 rows cuBLAS runs at 700-800 TFLOP/s, the fused int8 kernel at 410-440). Elsewhere (CPU,
fp32) W is dequantized in PyTorch for each product.

A decode step's one row (inference: no gradient) over int8 or int4 weights takes the quantized
matrix-vector kernel (memfit.ops.quant.gemv), with `QuantLinear`'s swiglu / residual folded in as
`memfit.nn.Linear` folds them into the bf16 one.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from memfit import functional as MF
from memfit.nn.linear import Linear, replace_module
from memfit.ops._triton import rows_view, use_triton
from memfit.ops.quant import (
    INT4_GROUP,
    dequantize_int4,
    dequantize_int8,
    dequantize_nf4,
    int4_group,
    quantize_int4,
    quantize_int8,
    quantize_nf4,
)
from memfit.ops.quant import matmul as kernels
from memfit.ops.quant.gemv import gemv_supported, quant_gemv

Kind = Literal["nf4", "int8", "int4"]
KINDS = ("nf4", "int8", "int4")

# Products of more rows than this dequantize W whole and call cuBLAS (measured: module docstring;
# int4's tile kernel loses to dequantize + cuBLAS at 2-64 rows on llama-3-8b's qkv, out and down,
# H100: results/quant_matmul.json, where int4's dequantize takes 0.12 ms for gate_up).
FUSED_MAX_ROWS = {"nf4": 0, "int8": 16, "int4": 0}


class QuantizedWeight(nn.Module):
    """An (out, in) weight, quantized; `dequantize()` gives it back in the compute dtype."""

    def __init__(
        self, weight: Tensor, kind: Kind, dtype: torch.dtype, *, group: int = INT4_GROUP,
        state: dict[str, Tensor] | None = None,
    ) -> None:  # fmt: skip
        """group: int4's group of input features (`int4_group` picks a smaller one where it
        does not divide them: `self.group`); state: `weight` already quantized to `kind` (as
        memfit.nn.gptq does), in the format of memfit.ops.quant's quantize_<kind>."""
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"quantize to one of {', '.join(KINDS)}, got {kind!r}")
        self.kind, self.dtype = kind, dtype
        self.shape = tuple(weight.shape)
        self.group = int4_group(weight.shape[1], group) if kind == "int4" else None
        if state is not None:
            _check_state(state, kind, self.shape, self.group)
            state = {name: tensor.to(weight.device) for name, tensor in state.items()}
        elif kind == "nf4":
            state = quantize_nf4(weight)
        elif kind == "int8":
            state = quantize_int8(weight)
        else:
            state = quantize_int4(weight, self.group)
        for name, tensor in state.items():
            self.register_buffer(name, tensor)
        # products of more rows dequantize W whole (a transient copy) and call cuBLAS
        self.fused_max_rows = FUSED_MAX_ROWS[kind]

    def state(self) -> dict[str, Tensor]:
        return dict(self.named_buffers(recurse=False))

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        dtype = dtype or self.dtype
        state = self.state()
        if use_triton(state["scale" if self.kind != "nf4" else "packed"]):
            return kernels.dequantize(state, self.kind, self.shape, dtype)
        if self.kind == "nf4":
            return dequantize_nf4(state, self.shape, dtype)
        if self.kind == "int4":
            return dequantize_int4(state, dtype)
        return dequantize_int8(state, dtype)

    def fused(self, tensor: Tensor) -> bool:
        """Whether products with `tensor` (an input or gradient) run the dequantizing kernels."""
        return use_triton(tensor) and tensor.dtype in (torch.bfloat16, torch.float16)

    def gemv(self, x: Tensor) -> bool:
        """Whether the product with `x` is a decode step's one row that the quantized
        matrix-vector kernel (memfit.ops.quant.gemv) takes: int8 or int4, no gradient asked."""
        return (
            x.numel() == x.shape[-1]
            and gemv_supported(self.kind, self.shape)
            and self.fused(x)
            and not (torch.is_grad_enabled() and x.requires_grad)
            and not torch.is_autocast_enabled(x.device.type)
        )

    def matmul(self, x: Tensor, bias: Tensor | None = None, *, transpose: bool = False) -> Tensor:
        """x W^T (+ bias), or x W with transpose (the input's gradient), in x's dtype."""
        rows = x.numel() // max(x.shape[-1], 1)
        if not self.fused(x) or rows > self.fused_max_rows:
            weight = self.dequantize(x.dtype)
            return x @ weight if transpose else F.linear(x, weight, bias)
        x2d, state = rows_view(x), self.state()
        if transpose:
            y = kernels.quant_matmul_dx(x2d, state, self.kind, self.shape)
        else:
            y = kernels.quant_matmul(x2d, state, self.kind, self.shape, bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state().values())

    def extra_repr(self) -> str:
        group = f", group={self.group}" if self.group else ""
        return f"{self.kind}{group}, shape={self.shape}, {self.nbytes() / 2**20:.2f} MiB"


class _QuantizedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, quantized: QuantizedWeight, bias: Tensor | None) -> Tensor:
        ctx.quantized = quantized
        return quantized.matmul(x, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.quantized.matmul(grad, transpose=True), None, None


def quantized_linear(x: Tensor, quantized: QuantizedWeight, bias: Tensor | None = None) -> Tensor:
    """x W^T (+ b) for a frozen quantized W, in the compute dtype (autocast's, else x's)."""
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        with torch.autocast(x.device.type, enabled=False):
            x = x.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
            return _QuantizedLinear.apply(x, quantized, bias)
    bias = bias.to(x.dtype) if bias is not None else None
    return _QuantizedLinear.apply(x, quantized, bias)


class QuantLinear(nn.Module):
    """A frozen linear layer over a quantized weight; its bias (if any) frozen in `dtype`."""

    def __init__(
        self, base: Linear, kind: Kind, dtype: torch.dtype, device: torch.device | None = None,
        *, group: int = INT4_GROUP, state: dict[str, Tensor] | None = None,
    ) -> None:  # fmt: skip
        """device: where the quantized weight lives (default: the base's); group: int4's;
        state: the weight already quantized (QuantizedWeight)."""
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        weight = base.weight.detach().to(device)
        self.quant = QuantizedWeight(weight, kind, dtype, group=group, state=state)
        self.bias = None
        if base.bias is not None:
            bias = base.bias.detach().to(device=device, dtype=dtype)
            self.bias = nn.Parameter(bias, requires_grad=False)

    def forward(self, x: Tensor, *, swiglu: bool = False, residual: Tensor | None = None) -> Tensor:
        """swiglu / residual as memfit.nn.Linear's: folded into the one-row kernel of a decode
        step, separate ops otherwise."""
        if self.quant.gemv(x) and (residual is None or residual.dtype == x.dtype):
            bias = self.bias.to(x.dtype) if self.bias is not None else None
            state = self.quant.state()
            return quant_gemv(
                x, state, self.quant.kind, self.quant.shape, bias, swiglu=swiglu, residual=residual
            )
        y = quantized_linear(x, self.quant, self.bias)
        if swiglu:
            y = MF.swiglu(y)
        return y if residual is None else residual + y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


@torch.no_grad()
def quantize_model(
    model: nn.Module, kind: Kind, *, dtype: torch.dtype, device: torch.device | None = None,
    blocks: list[int] | None = None, group: int = INT4_GROUP,
    states: dict[str, dict[str, Tensor]] | None = None,
) -> int:  # fmt: skip
    """Quantize the weight of every linear layer inside the blocks (`model.layers`, or those of
    `blocks`; the embedding and the output head stay as they are): a plain `Linear` becomes a
    `QuantLinear`, a `LoRALinear` keeps its adapters over a quantized base. Each weight goes to
    `device` (default: where it is), is quantized there and its full-precision copy freed before
    the next: a model held in CPU memory reaches the GPU quantized, never whole. Returns the
    bytes the quantized weights take. `group`: int4's group of input features (a layer it does
    not divide takes a smaller one, and a warning says which). `states`: layers already
    quantized (memfit.nn.gptq), by path from the model ("layers.3.mlp.down")."""
    from memfit.nn.lora import LoRALinear

    total = 0
    for index in range(len(model.layers)) if blocks is None else blocks:
        block = model.layers[index]
        for path, module in list(block.named_modules()):
            if isinstance(module, LoRALinear):
                module.quantize(kind, dtype, device)
                total += module.quant.nbytes()
            elif type(module) is Linear:
                state = (states or {}).get(f"layers.{index}.{path}")
                layer = QuantLinear(module, kind, dtype, device, group=group, state=state)
                replace_module(block, path, layer)
                total += layer.quant.nbytes()
                _say_group(layer.quant, path, group)
    return total


def _check_state(state: dict[str, Tensor], kind: str, shape: tuple, group: int | None) -> None:
    """Refuse a precomputed state whose tensors are not quantize_<kind>'s for this shape."""
    rows, features = shape
    expected = {
        "int8": {"q": (rows, features), "scale": (rows,)},
        "int4": {"packed": (rows, features // 8), "scale": (rows, features // (group or 1)),
                 "zero": (rows, features // (group or 1))},
    }.get(kind)  # fmt: skip
    if expected is None:
        raise ValueError(f"a precomputed state is taken for int8 and int4 only, not {kind}")
    got = {name: tuple(tensor.shape) for name, tensor in state.items()}
    if got != expected:
        raise ValueError(
            f"a {kind} state for a {rows}x{features} weight (group {group}) has tensors "
            f"{expected}, got {got}"
        )


_said: set[tuple[int, int]] = set()


def _say_group(quant: QuantizedWeight, path: str, group: int) -> None:
    """Say (once per shape) where int4 took a smaller group than the one asked for."""
    if quant.kind != "int4" or quant.group == group:
        return
    key = (quant.shape[1], quant.group, group)
    if key not in _said:
        _said.add(key)
        logging.getLogger(__name__).warning(
            "int4: layers of %d input features (%s, ...) use groups of %d: %d does not divide "
            "them", quant.shape[1], path, quant.group, group,
        )  # fmt: skip


@torch.no_grad()
def quantize_head(model: nn.Module, *, dtype: torch.dtype) -> int:
    """Quantize the output head of an inference model to int8 per vocabulary row, whatever the
    blocks took (int4 blocks too: an int8 head is what keeps the logits close, as int4 one would
    not). The head is a decode step's largest single read (llama-3-8b: 1.05 GB of its 4.8 at
    int4); int8 halves it. A tied model (its head the embedding) gets a quantized copy: the
    embedding stays for the lookups. The head's products never dequantize it whole: any number
    of rows takes int8's tile kernel (no transient copy of the vocabulary's size). Returns the
    head's bytes."""
    head = model.lm_head if model.lm_head is not None else Linear.holding(model.embed.weight)
    if isinstance(head, QuantLinear):
        return head.quant.nbytes()
    model.lm_head = QuantLinear(head, "int8", dtype)
    model.lm_head.quant.fused_max_rows = float("inf")
    return model.lm_head.quant.nbytes()


@torch.no_grad()
def dequantize_model(model: nn.Module) -> nn.Module:
    """Every `QuantLinear` back to a plain `Linear` with its weight dequantized (in the dtype it
    was quantized for): a model for inference or export. (A `LoRALinear` over a quantized base
    is merged by memfit.nn.lora.merge_lora, which dequantizes too.)"""
    for path, module in list(model.named_modules()):
        if isinstance(module, QuantLinear):
            replace_module(model, path, Linear.holding(module.quant.dequantize(), module.bias))
    return model
