"""Activation-aware scaling before weight-only quantization (AWQ-style; Lin et al. 2024, "AWQ").

A few input channels of each linear layer carry much larger activations than the rest, and the
weights that multiply them matter more. Scaling those weight columns up by s (and the inputs
down by the same s) before quantizing gives them finer levels relative to their group; the
product is unchanged before quantization. Per layer, s = a^alpha (a: the mean |input| of each
channel on calibration text, normalized so that max(s) * min(s) = 1), with alpha picked from a
grid on [0, 1] to minimize the layer's output error on calibration inputs, quantization
included; alpha = 0 is plain round to nearest, so no layer ends up worse on those inputs.

The inputs' 1/s is folded into what produces them, so nothing runs at inference:
    qkv, gate_up   the RMSNorm weight before them
    down           the up half of gate_up's rows (silu(gate) * up is linear in up)
    out            v's rows of qkv (attention is linear in v); with GQA each kv head's s is
                   shared by the query heads that read it

    report = awq_scale(model, calibration_ids, "int4")   # then quantize_model(model, "int4", ...)

Then, for int4, each group's range is clipped (AWQ's second step): per output row and group the
range [min, max] is shrunk by the ratio r in CLIP_GRID that minimizes the error of that group's
share of the output on the calibration inputs (sum over its features of x * (w - Q(w)), squared),
and the weights are clamped to it in place: round to nearest then spends its 16 levels on the
range that matters instead of on a rare outlier. (Clamping leaves the min and max at the clipped
values, so quantize_int4 finds exactly that range.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from memfit.nn.quant import QuantizedWeight
from memfit.ops.quant import INT4_GROUP, dequantize_int4, int4_group, quantize_int4

GRID = 20  # alpha in 0, 1/GRID, ..., 1
ROWS = 256  # calibration inputs kept per layer for the error search
CLIP_GRID = [1.0 - step / 40 for step in range(21)]  # the range kept: 1, 0.975, ..., 0.5


@dataclass
class LayerScale:
    """One layer's choice: alpha, and its output error on the calibration inputs with plain
    round to nearest (alpha = 0) and with the chosen scales."""

    path: str
    alpha: float
    error_rtn: float
    error: float


@torch.no_grad()
def awq_scale(
    model: torch.nn.Module,
    calibration: Tensor,
    kind: str = "int4",
    *,
    group: int = INT4_GROUP,
    clip: bool = True,
) -> list[LayerScale]:
    """Scale every block's qkv, out, gate_up and down in place for `kind` quantization
    (module docstring), from the inputs they see on `calibration` (batch, tokens) token ids.
    The model computes the same before quantization, up to int4's clipping of each group's
    range (module docstring; `clip=False`: no clipping); quantize it after (quantize_model)."""
    captured: dict[torch.nn.Module, list] = {}

    def keep(module, args):
        x = args[0].detach().float().reshape(-1, args[0].shape[-1])
        entry = captured.setdefault(module, [torch.zeros(x.shape[1], device=x.device), 0, []])
        entry[0] += x.abs().sum(0)
        entry[1] += x.shape[0]
        have = sum(r.shape[0] for r in entry[2])
        if have < ROWS:  # (rows spread over the batch)
            entry[2].append(x[:: max(1, x.shape[0] // ROWS)][: ROWS - have])

    layers = []
    for block in model.layers:
        attention, mlp = block.attention, block.mlp
        layers.append((block, attention.qkv, attention.out, mlp.gate_up, mlp.down))
    hooks = [
        linear.register_forward_pre_hook(keep)
        for _, *linears in layers
        for linear in linears
    ]  # fmt: skip
    try:
        model(calibration)
    finally:
        for hook in hooks:
            hook.remove()

    report = []
    for index, (block, qkv, out, gate_up, down) in enumerate(layers):
        attention = block.attention
        heads, kv_heads, dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
        q_size, kv_size = heads * dim, kv_heads * dim
        ffn = down.weight.shape[1]

        scales = []
        for name, linear in (("attention.qkv", qkv), ("attention.out", out),
                             ("mlp.gate_up", gate_up), ("mlp.down", down)):  # fmt: skip
            gqa = (heads, kv_heads, dim) if linear is out else None
            scale, choice = _layer_scale(captured[linear], linear.weight, kind, group, gqa)
            report.append(LayerScale(f"layers.{index}.{name}", *choice))
            scales.append(scale)
        s_qkv, s_out, s_gate_up, s_down = scales
        _fold(block.attention_norm.weight, qkv.weight, s_qkv)
        _fold(block.mlp_norm.weight, gate_up.weight, s_gate_up)
        s_v = s_out.view(kv_heads, heads // kv_heads, dim)[:, 0].reshape(-1)
        _divide_rows(qkv, slice(q_size + kv_size, q_size + 2 * kv_size), s_v)
        out.weight.mul_(s_out.to(out.weight.dtype)[None, :])
        _divide_rows(gate_up, slice(ffn, 2 * ffn), s_down)
        down.weight.mul_(s_down.to(down.weight.dtype)[None, :])
        if kind == "int4" and clip:
            for linear, scale in zip((qkv, out, gate_up, down), scales, strict=True):
                x = torch.cat(captured[linear][2]) / scale[None, :]  # the inputs, scaled
                _clip(linear.weight, x, int4_group(linear.weight.shape[1], group))
    return report


def _clip(weight: Tensor, x: Tensor, group: int) -> None:
    """Clamp each (row, group) of `weight` in place to its range shrunk by the CLIP_GRID ratio
    whose round to nearest errs least on the group's share of the output for inputs `x`."""
    rows, features = weight.shape
    w = weight.float().reshape(rows, features // group, group)
    xg = x.float().reshape(x.shape[0], features // group, group)
    low, high = w.amin(2, keepdim=True).clamp(max=0.0), w.amax(2, keepdim=True).clamp(min=0.0)
    best_error = torch.full((rows, features // group), float("inf"))
    best_ratio = torch.ones(rows, features // group)
    for ratio in CLIP_GRID:
        clipped = torch.minimum(torch.maximum(w, low * ratio), high * ratio)
        state = quantize_int4(clipped.reshape(rows, features), group)
        diff = (w - dequantize_int4(state, torch.float32).reshape(w.shape)).to(xg.dtype)
        error = torch.einsum("tgk,ngk->tng", xg, diff).pow(2).mean(0)  # (rows, groups)
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_ratio = torch.where(better, torch.tensor(ratio), best_ratio)
    ratio = best_ratio[..., None]
    clipped = torch.minimum(torch.maximum(w, low * ratio), high * ratio)
    weight.copy_(clipped.reshape(rows, features).to(weight.dtype))


def _layer_scale(
    entry: list, weight: Tensor, kind: str, group: int, gqa: tuple[int, int, int] | None
) -> tuple[Tensor, tuple[float, float, float]]:
    """s of one layer from its captured inputs [sum of |x|, rows seen, kept rows]; with GQA
    (heads, kv_heads, head_dim), one mean per kv head's channel, for every head that reads it."""
    total, count, rows = entry
    mean = total / max(count, 1)
    if gqa is not None:
        heads, kv_heads, dim = gqa
        mean = mean.view(kv_heads, heads // kv_heads, dim).mean(1, keepdim=True)
        mean = mean.expand(kv_heads, heads // kv_heads, dim).reshape(-1)
    return _search(weight.float(), torch.cat(rows), mean, kind, group)


def _search(
    weight: Tensor, x: Tensor, mean: Tensor, kind: str, group: int
) -> tuple[Tensor, tuple[float, float, float]]:
    """(s, (alpha, error with alpha = 0, error with s)) of one layer (module docstring)."""
    reference = x @ weight.T
    best = None
    mean = mean.clamp_min(1e-5)
    for step in range(GRID + 1):
        alpha = step / GRID
        s = mean.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        restored = QuantizedWeight(weight * s[None, :], kind, torch.float32, group=group)
        error = (x @ (restored.dequantize() / s[None, :]).T - reference).pow(2).mean().item()
        if step == 0:
            rtn = error
        if best is None or error < best[2]:
            best = (s, alpha, error)
    return best[0], (best[1], rtn, best[2])


def _fold(norm_weight: Tensor, weight: Tensor, s: Tensor) -> None:
    """The norm's output channels / s, the layer's input columns * s."""
    norm_weight.div_(s.to(norm_weight.dtype))
    weight.mul_(s.to(weight.dtype)[None, :])


def _divide_rows(linear: torch.nn.Module, rows: slice, s: Tensor) -> None:
    linear.weight[rows].div_(s.to(linear.weight.dtype)[:, None])
    if linear.bias is not None:
        linear.bias[rows].div_(s.to(linear.bias.dtype))
