"""Error-compensating weight quantization (GPTQ; Frantar et al. 2023, "GPTQ").

Round to nearest quantizes each weight alone. GPTQ quantizes a layer's input columns one at a
time and, after each, moves the rounding error it made onto the columns not yet quantized, in
the proportions that keep the layer's output on calibration inputs closest (least squares under
H = X^T X, the inputs' second moment; H^-1's Cholesky factor gives each step's update). The
grids are the ones round to nearest would use (`quantize_int4`'s group grids, `quantize_int8`'s
row scales, taken from the weight before any update), so the state is the same format and the
kernels read it unchanged; which level each weight takes differs, and the scales are refit to
those levels at the end (below).

Blocks are quantized in order, each on the hidden states the blocks before it produce once
quantized, so a later layer's compensation sees the earlier layers' errors. Columns go in order of
decreasing H diagonal (act order: the inputs that carry most go first, while most columns are
left to absorb their error); the grids are fixed beforehand, so the order changes nothing of the
format. Run it after the scaling pass (memfit.nn.awq.awq_scale) for both.

Once each weight has its level, the scales are refit to them (`refit_scales`): the grids were
set from the weight's range before any update, but with the levels fixed the layer's output
error on the calibration inputs is quadratic in a row's group scales, so their least-squares
values under H follow from one small solve a row (zero points stay the integers they were, so
the format and the kernels are unchanged). SmolLM2-135M, int4: perplexity +7.0% of bf16's
against +9.0% without (benchmarks/results/quant_quality.json).

    states = gptq(model, calibration_ids, "int4")          # the model's weights now dequantized
    quantize_model(model, "int4", dtype=..., states=states)

`calibrate` runs either pass or both (`memfit export --quantize int4 --calibrate gptq`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from memfit.nn.linear import Linear
from memfit.ops.quant import INT4_GROUP, int4_grid, int4_group, pack_int4

DAMP = 0.01  # added to H's diagonal, as a share of its mean: keeps H^-1 well conditioned
BLOCK = 128  # columns whose updates are applied lazily, in one product


class _Reached(Exception):
    """Raised by the hook on the first block: what the model feeds it is all gptq needs."""


@torch.no_grad()
def gptq(
    model: torch.nn.Module, calibration: Tensor, kind: str = "int4", *, group: int = INT4_GROUP
) -> dict[str, dict[str, Tensor]]:
    """Quantize every block's plain linear layers (those `quantize_model` quantizes) from the
    inputs they see on `calibration` (batch, tokens) token ids; returns each layer's state by
    path ("layers.3.mlp.down") for quantize_model(states=), and leaves each weight in the model
    at its dequantized value. The model runs once up to its first block; then each block runs
    twice on the hidden states the blocks before it (quantized) produced: once to take its
    layers' inputs, once more, quantized, to give the next block its inputs."""
    if kind not in ("int4", "int8"):
        raise ValueError(f"GPTQ quantizes to int4 or int8, got {kind!r}")
    taken: dict[str, tuple] = {}

    def first(module, args):
        taken["args"] = args
        raise _Reached

    hook = model.layers[0].register_forward_pre_hook(first)
    try:
        model(calibration)
    except _Reached:
        pass
    finally:
        hook.remove()
    x, *rest = taken["args"]  # (every block takes the same rest: the rotary tables, metadata)
    states: dict[str, dict[str, Tensor]] = {}
    for index, block in enumerate(model.layers):
        linears = {path: m for path, m in block.named_modules() if type(m) is Linear}
        moments: dict[torch.nn.Module, list] = {}

        def keep(module, args, moments=moments):
            inputs = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            entry = moments.setdefault(module, [0.0, 0])
            entry[0] = entry[0] + inputs.T @ inputs
            entry[1] += inputs.shape[0]

        hooks = [linear.register_forward_pre_hook(keep) for linear in linears.values()]
        try:
            block(x, *rest)
        finally:
            for hook in hooks:
                hook.remove()
        for path, linear in linears.items():
            moment, rows = moments[linear]
            size = int4_group(linear.weight.shape[1], group) if kind == "int4" else None
            state, weight = quantize_gptq(linear.weight, moment / rows, kind, size)
            linear.weight.copy_(weight.to(linear.weight.dtype))
            states[f"layers.{index}.{path}"] = state
        x = block(x, *rest)
    return states


def quantize_gptq(
    weight: Tensor, hessian: Tensor, kind: str, group: int | None = None,
    grid_weight: Tensor | None = None,
) -> tuple[dict[str, Tensor], Tensor]:  # fmt: skip
    """(state, dequantized weight) of one (out, in) `weight` whose inputs have second moment
    `hessian` (in, in) (module docstring); `group`: int4's; `grid_weight`: the weight whose
    ranges set the grids (default `weight`; e.g. its ranges clipped)."""
    w = weight.float().clone()
    rows, columns = w.shape
    h = hessian.float().clone()
    dead = h.diagonal() == 0  # an input that is always 0: its weights do not matter
    h[dead, dead] = 1.0
    w[:, dead] = 0.0

    if kind == "int4":
        scale, safe, zero = int4_grid(w if grid_weight is None else grid_weight, group)
        column_scale = safe.repeat_interleave(group, 1)
        column_zero = zero.repeat_interleave(group, 1)
        lowest, highest = 0.0, 15.0
    else:
        scale = (w if grid_weight is None else grid_weight.float()).abs().amax(dim=1) / 127
        column_scale = scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None].expand(-1, columns)
        column_zero = torch.zeros_like(column_scale)
        lowest, highest = -127.0, 127.0

    order = torch.argsort(h.diagonal(), descending=True)
    w, h = w[:, order], h[order][:, order]
    column_scale, column_zero = column_scale[:, order], column_zero[:, order]
    h.diagonal().add_(DAMP * h.diagonal().mean())
    inverse = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)

    levels = torch.empty_like(w)
    for start in range(0, columns, BLOCK):
        end = min(start + BLOCK, columns)
        part, errors = w[:, start:end].clone(), torch.empty(rows, end - start, device=w.device)
        local = inverse[start:end, start:end]
        for i in range(end - start):
            s, z = column_scale[:, start + i], column_zero[:, start + i]
            level = (torch.round(part[:, i] / s) + z).clamp(lowest, highest)
            levels[:, start + i] = level
            error = (part[:, i] - (level - z) * s) / local[i, i]
            part[:, i:] -= error[:, None] * local[i, i:][None, :]
            errors[:, i] = error
        w[:, end:] -= errors @ inverse[start:end, end:]

    restore = torch.argsort(order)
    levels = levels[:, restore]
    target = weight.float() * ~dead
    if kind == "int4":
        steps = levels - zero.repeat_interleave(group, 1)
        scale = refit_scales(target, hessian.float(), steps, scale)
        dequantized = steps * scale.repeat_interleave(group, 1)
        state = {"packed": pack_int4(levels, group), "scale": scale,
                 "zero": zero.to(torch.uint8)}  # fmt: skip
    else:
        scale = refit_scales(target, hessian.float(), levels, scale[:, None])[:, 0]
        dequantized = levels * scale[:, None]
        state = {"q": levels.to(torch.int8), "scale": scale}
    return state, dequantized


def refit_scales(weight: Tensor, hessian: Tensor, steps: Tensor, scale: Tensor) -> Tensor:
    """The (out, groups) scales s minimizing (w - w_q) H (w - w_q)^T for each row of `weight`
    (out, in), where w_q = s_g * steps over group g's features and `steps` (out, in) is each
    weight's level less its zero point: per row a (groups, groups) system, M s = v with
    M[g, h] = steps_g H_gh steps_h^T and v[g] = steps_g (H w^T)_g. A scale the solve would make
    0 or negative, or whose group has no step (every weight at its zero point), keeps its value
    in `scale`."""
    rows, columns = weight.shape
    groups = scale.shape[1]
    size = columns // groups
    steps_g = steps.reshape(rows, groups, size)
    system = torch.empty(rows, groups, groups, device=weight.device, dtype=weight.dtype)
    for h in range(groups):
        part = steps[:, h * size : (h + 1) * size] @ hessian[h * size : (h + 1) * size]
        system[:, :, h] = (steps_g * part.reshape(rows, groups, size)).sum(-1)
    target = (steps_g * (weight @ hessian).reshape(rows, groups, size)).sum(-1)
    diagonal = system.diagonal(dim1=1, dim2=2).clone()
    # a ridge of 1e-6 of the mean diagonal, pulling toward the old scale: keeps M invertible
    ridge = (1e-6 * diagonal.clamp_min(0).mean(-1, keepdim=True)).clamp_min(1e-30)
    system.diagonal(dim1=1, dim2=2).add_(ridge)
    fitted = torch.linalg.solve(system, (target + ridge * scale.float())[..., None])[..., 0]
    keep = (diagonal <= 0) | ~(fitted > 0)
    return torch.where(keep, scale.float(), fitted).to(scale.dtype)


CALIBRATIONS = ("awq", "gptq", "awq+gptq")


@torch.no_grad()
def calibrate(
    model: torch.nn.Module, calibration: Tensor, kind: str, method: str, *,
    group: int = INT4_GROUP,
) -> dict[str, dict[str, Tensor]] | None:  # fmt: skip
    """The calibrated pass `method` of CALIBRATIONS on `calibration` (batch, tokens) token ids
    before quantizing `model` to `kind`: awq scales the weights in place (memfit.nn.awq), gptq
    returns the states for quantize_model(states=); awq+gptq does both, in that order."""
    from memfit.nn.awq import awq_scale

    if method not in CALIBRATIONS:
        raise ValueError(f"calibrate with one of {', '.join(CALIBRATIONS)}, got {method!r}")
    if "awq" in method:
        awq_scale(model, calibration, kind, group=group)
    return gptq(model, calibration, kind, group=group) if "gptq" in method else None
