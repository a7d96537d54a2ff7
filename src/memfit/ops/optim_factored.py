"""Fused Triton kernels of the two optimizers that keep their second-moment statistics per row
and per column of a matrix: Adafactor (`memfit.optim.adafactor`) and SM3 (`memfit.optim.sm3`).
The optimizers hold the algorithms, their options and their plain-PyTorch path (the reference
these kernels are tested against); here are only the passes over the tensors.

Basics. A parameter of shape (..., rows, cols), contiguous, is seen as `batch` matrices of
(rows, cols) (SM3 flattens all leading dims into the rows: batch 1). Every pass over a matrix
runs on the same grid of strips: program (strip, col_tile) owns `rows_per_group` rows of one
matrix and BLOCK_N columns, and walks its rows in (BLOCK_M, BLOCK_N) tiles, so that a program
reads a few tens of KiB and the grid has a few programs per SM (`strip_grid`). A row statistic
is then made of col_tiles partial values and a column statistic of row_groups partial values;
both are written to an fp32 workspace and reduced by a tiny kernel, without atomics, so every
result is deterministic (a rerun is bitwise equal). One launch serves every matrix of one
(rows, cols) and dtype: the kernels read each matrix's addresses from a table (`matrix_table`),
so a step of a model is a few launches per pass, not a Python loop of launches per matrix.

Adafactor, matrices (4 launches, 3 passes over the gradient, 1 over the parameter and 1 more for
`scale_parameter`):
  1. `_adafactor_square_sums_kernel`: row and column partial sums of g**2 (and the partial sums
     of p**2 for the parameter's RMS);
  2. `_adafactor_ema_kernel` (tiny): R and C <- beta2 * (R, C) + (1 - beta2) * (mean g**2 + eps1),
     and partial sums of the new R (for mean(R));
  3. `_adafactor_update_square_sum_kernel`: partial sums of u**2, u = g / sqrt(R_i C_j / mean(R)),
     for the clipping RMS (skipped when clip_threshold is inf);
  4. `_adafactor_apply_kernel`: recomputes u, clips it, momentum, p -= lr * (u + wd * p).
Adafactor, full second moment (vectors; 2 launches): `_adafactor_second_moment_kernel` updates v
and sums u**2 and p**2, then the same apply kernel.
SM3, matrices (2 launches, 1 pass): `_sm3_matrix_kernel` computes nu = min(row_i, col_j) + g**2,
the update and p, and the partial maxima of nu per row and per column;
`_sm3_accumulators_kernel` (tiny) reduces them into the row and column accumulators.
SM3, vector (1 launch): `_sm3_vector_kernel`.

Traffic per element of an fp32 matrix (AdamW fused: 28 bytes): Adafactor 20 bytes (g read three
times, p read and written), 24 with `scale_parameter`, + 8 with momentum; SM3 12 bytes (g read, p
read and written), + 8 with momentum. The workspace adds about 8 / rows_per_group + 8 / BLOCK_N
bytes per element. Tile sizes were chosen for memory-bound passes on an H100, not measured yet.

Numerics: everything in fp32; the parameter and the momentum are read in their dtype and rounded
once (to nearest even) when stored; u is computed by one helper in passes 3 and 4, so that the
clipping uses the u that is applied. The kernels and the PyTorch paths differ in the order of
the fp32 sums and, on GPU, in the last bits of sqrt, rsqrt and division.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from memfit.ops._triton import launch, round_to_bf16, tl, triton

__all__ = [
    "KERNEL_DTYPES",
    "AdafactorStep",
    "StripGrid",
    "adafactor_factored_update",
    "adafactor_full_update",
    "matrix_table",
    "sm3_matrix_update",
    "sm3_vector_update",
    "strip_grid",
]

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# GPU: (16, 256) tiles of 4 warps (32 values a thread), at most about four programs per SM,
# each looping over its strip's tiles; 1-D kernels and the tiny reductions in blocks of 1024.
# Under the interpreter: small tiles and two tiles a program, so that odd test shapes cross
# every tile, strip and block boundary.
BLOCK_M, BLOCK_N, NUM_WARPS, PROGRAMS_PER_SM = 16, 256, 4, 4
BLOCK_1D = 1024
_INTERPRET_BLOCK_M, _INTERPRET_BLOCK_N, _INTERPRET_TILES_PER_PROGRAM = 8, 32, 2
_INTERPRET_BLOCK_1D = 32
_MAX_GRID_Y = 65535  # CUDA's limit on the second grid dimension


@dataclass(frozen=True)
class StripGrid:
    """How `batch` (rows, cols) matrices are split: program (matrix * row_groups + group,
    col_tile) owns rows [group * rows_per_group, ...) of its matrix (tiles_per_program tiles of
    block_m rows) and columns [col_tile * block_n, ...)."""

    batch: int
    rows: int
    cols: int
    block_m: int
    block_n: int
    tiles_per_program: int
    row_groups: int
    col_tiles: int
    num_warps: int

    @property
    def rows_per_group(self) -> int:
        return self.block_m * self.tiles_per_program

    @property
    def grid(self) -> tuple[int, int]:
        return (self.batch * self.row_groups, self.col_tiles)

    @property
    def programs(self) -> int:
        return self.batch * self.row_groups * self.col_tiles


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _block_1d(device: torch.device) -> int:
    return _INTERPRET_BLOCK_1D if device.type == "cpu" else BLOCK_1D


def strip_grid(batch: int, rows: int, cols: int, device: torch.device) -> StripGrid:
    """The strips of `batch` (rows, cols) matrices on `device` (see `StripGrid`)."""
    if device.type == "cpu":  # the interpreter
        block_m, block_n, warps = _INTERPRET_BLOCK_M, _INTERPRET_BLOCK_N, 1
        tiles_per_program = _INTERPRET_TILES_PER_PROGRAM
    else:
        block_m, block_n, warps = BLOCK_M, BLOCK_N, NUM_WARPS
        index = device.index if device.index is not None else torch.cuda.current_device()
        programs = PROGRAMS_PER_SM * _sm_count(index)
        tiles = batch * triton.cdiv(rows, block_m) * triton.cdiv(cols, block_n)
        # at most about `programs` programs, each looping over its tiles: the partial sums
        # that every program of the last pass adds up stay under a few KiB
        tiles_per_program = triton.cdiv(tiles, programs)
    if triton.cdiv(cols, block_n) > _MAX_GRID_Y:
        raise ValueError(
            f"the optimizer kernels take matrices of up to {_MAX_GRID_Y * block_n} columns, "
            f"got {cols}"
        )
    row_tiles = triton.cdiv(rows, block_m)
    tiles_per_program = min(tiles_per_program, row_tiles)
    row_groups = triton.cdiv(row_tiles, tiles_per_program)
    return StripGrid(
        batch=batch,
        rows=rows,
        cols=cols,
        block_m=block_m,
        block_n=block_n,
        tiles_per_program=tiles_per_program,
        row_groups=row_groups,
        col_tiles=triton.cdiv(cols, block_n),
        num_warps=warps,
    )


# ---------------------------------------------------------------------------------------------
# Helpers shared by the kernels.
# ---------------------------------------------------------------------------------------------


@triton.jit
def _round(x, DTYPE: tl.constexpr, ROUND_BF16_BY_HAND: tl.constexpr):
    """x (fp32) rounded to DTYPE (nearest even) and back to fp32."""
    if ROUND_BF16_BY_HAND:  # the interpreter's cast truncates
        return round_to_bf16(x).to(tl.float32)
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _sum_of(ptr, n, BLOCK: tl.constexpr):
    """The fp32 sum of ptr[0:n]."""
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n, BLOCK):
        index = start + tl.arange(0, BLOCK)
        acc += tl.load(ptr + index, mask=index < n, other=0.0)
    return tl.sum(acc, axis=0)


@triton.jit
def _strip(rows, rows_per_group, row_groups, cols, BLOCK_N: tl.constexpr):
    """This program's matrix, first row, end row and (BLOCK_N,) columns."""
    strip = tl.program_id(0)
    matrix = strip // row_groups
    row_start = (strip % row_groups) * rows_per_group
    row_end = tl.minimum(row_start + rows_per_group, rows)
    col_index = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return matrix, row_start, row_end, col_index


@triton.jit
def _tile(matrix, row0, row_end, rows, cols, col_index, BLOCK_M: tl.constexpr):
    """(BLOCK_M,) rows from row0 and their mask, and the (BLOCK_M, BLOCK_N) element offsets
    (int64) and mask of the tile."""
    row_index = row0 + tl.arange(0, BLOCK_M)
    rows_ok = row_index < row_end
    offsets = (matrix * rows + row_index).to(tl.int64)[:, None] * cols + col_index[None, :]
    mask = rows_ok[:, None] & (col_index < cols)[None, :]
    return row_index, rows_ok, offsets, mask


@triton.jit
def _apply_update(
    p_ptr,
    momentum_ptr,
    offsets,
    mask,
    update,
    lr,
    beta1,
    one_minus_beta1,
    weight_decay,
    MOMENTUM: tl.constexpr,
    ROUND_BF16_BY_HAND: tl.constexpr,
):
    """momentum <- beta1 * momentum + (1 - beta1) * update (rounded to its dtype, and that is
    the update then); p <- p - lr * (update + weight_decay * p), rounded to p's dtype."""
    if MOMENTUM:
        momentum = tl.load(momentum_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        momentum = _round(
            beta1 * momentum + one_minus_beta1 * update,
            momentum_ptr.dtype.element_ty,
            ROUND_BF16_BY_HAND,
        )
        tl.store(momentum_ptr + offsets, momentum.to(momentum_ptr.dtype.element_ty), mask=mask)
        update = momentum
    p = tl.load(p_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    p = _round(p - lr * (update + weight_decay * p), p_ptr.dtype.element_ty, ROUND_BF16_BY_HAND)
    tl.store(p_ptr + offsets, p.to(p_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# Adafactor kernels.
# ---------------------------------------------------------------------------------------------


@triton.jit
def _matrix_pointer(table_ptr, num_matrices, column: tl.constexpr, matrix, like):
    """The address in `column` of the matrix table (see `MatrixTable`), as `like`'s type."""
    return tl.load(table_ptr + column * num_matrices + matrix).to(like.dtype)


@triton.jit
def _adafactor_square_sums_kernel(
    table_ptr,
    num_matrices,
    g0_ptr,
    p0_ptr,
    row_partials_ptr,
    col_partials_ptr,
    param_partials_ptr,
    rows,
    cols,
    rows_per_group,
    row_groups,
    tiles_per_program,
    SCALE_PARAMETER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Pass 1. row_partials (col_tiles, matrices * rows): this program's sums of g**2 along its
    columns of each row; col_partials (matrices * row_groups, cols): the sums along its rows of
    each column; param_partials (programs,): its sum of p**2 (SCALE_PARAMETER)."""
    matrix, row_start, row_end, col_index = _strip(rows, rows_per_group, row_groups, cols, BLOCK_N)
    g_ptr = _matrix_pointer(table_ptr, num_matrices, 1, matrix, g0_ptr)
    p_ptr = _matrix_pointer(table_ptr, num_matrices, 0, matrix, p0_ptr)
    total_rows = num_matrices * rows
    col_sums = tl.zeros((BLOCK_N,), dtype=tl.float32)
    param_squares = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for tile in range(0, tiles_per_program):
        row_index, rows_ok, offsets, mask = _tile(
            0, row_start + tile * BLOCK_M, row_end, rows, cols, col_index, BLOCK_M
        )
        g = tl.load(g_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        square = g * g
        row_partials = row_partials_ptr + tl.program_id(1) * total_rows + matrix * rows
        tl.store(row_partials + row_index, tl.sum(square, axis=1), mask=rows_ok)
        col_sums += tl.sum(square, axis=0)
        if SCALE_PARAMETER:
            p = tl.load(p_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            param_squares += p * p
    strip = tl.program_id(0)
    tl.store(
        col_partials_ptr + strip.to(tl.int64) * cols + col_index, col_sums, mask=col_index < cols
    )
    if SCALE_PARAMETER:
        program = strip * tl.num_programs(1) + tl.program_id(1)
        tl.store(param_partials_ptr + program, tl.sum(tl.sum(param_squares, axis=1), axis=0))


@triton.jit
def _adafactor_ema_kernel(
    table_ptr,
    num_matrices,
    stats0_ptr,
    row_partials_ptr,
    col_partials_ptr,
    row_sum_partials_ptr,
    rows,
    cols,
    row_groups,
    col_tiles,
    col_blocks,
    row_blocks,
    beta2,
    one_minus_beta2,
    eps1,
    BLOCK: tl.constexpr,
):
    """Pass 2 (tiny), grid (matrices, col_blocks + row_blocks). The first col_blocks programs
    of a matrix update BLOCK of its column statistics C (cols,), the others BLOCK of its row
    statistics R (rows,) and write their sum of the new R to row_sum_partials
    (matrices, row_blocks). mean(g**2) = sum / count, and eps1 is added to the mean."""
    matrix = tl.program_id(0)
    block = tl.program_id(1)
    row_ptr = _matrix_pointer(table_ptr, num_matrices, 3, matrix, stats0_ptr)
    col_ptr = _matrix_pointer(table_ptr, num_matrices, 4, matrix, stats0_ptr)
    if block < col_blocks:
        col_index = block * BLOCK + tl.arange(0, BLOCK)
        ok = col_index < cols
        sums = tl.zeros((BLOCK,), dtype=tl.float32)
        for group in range(0, row_groups):
            partials = col_partials_ptr + (matrix * row_groups + group).to(tl.int64) * cols
            sums += tl.load(partials + col_index, mask=ok, other=0.0)
        col = tl.load(col_ptr + col_index, mask=ok, other=0.0)
        col = beta2 * col + one_minus_beta2 * (sums / rows + eps1)
        tl.store(col_ptr + col_index, col, mask=ok)
    else:
        row_block = block - col_blocks
        row_index = row_block * BLOCK + tl.arange(0, BLOCK)
        ok = row_index < rows
        total_rows = tl.num_programs(0) * rows
        sums = tl.zeros((BLOCK,), dtype=tl.float32)
        for tile in range(0, col_tiles):
            partials = row_partials_ptr + tile * total_rows + matrix * rows
            sums += tl.load(partials + row_index, mask=ok, other=0.0)
        row = tl.load(row_ptr + row_index, mask=ok, other=0.0)
        row = beta2 * row + one_minus_beta2 * (sums / cols + eps1)
        tl.store(row_ptr + row_index, row, mask=ok)
        row_sum = tl.sum(tl.where(ok, row, 0.0), axis=0)
        tl.store(row_sum_partials_ptr + matrix * row_blocks + row_block, row_sum)


@triton.jit
def _factored_scaled_gradient(g, row_ptr, row_index, rows_ok, row_mean, col_factor):
    """u = g / sqrt(R_i C_j / mean(R)) of a (BLOCK_M, BLOCK_N) tile, as (g * rsqrt(R_i /
    mean(R))) * rsqrt(C_j), the order of the PyTorch path. row_ptr: the matrix's R;
    col_factor: rsqrt(C_j), (BLOCK_N,)."""
    row = tl.load(row_ptr + row_index, mask=rows_ok, other=1.0)
    row_factor = tl.rsqrt(row / row_mean)
    return g * row_factor[:, None] * col_factor[None, :]


@triton.jit
def _adafactor_update_square_sum_kernel(
    table_ptr,
    num_matrices,
    g0_ptr,
    stats0_ptr,
    row_sum_partials_ptr,
    update_partials_ptr,
    rows,
    cols,
    rows_per_group,
    row_groups,
    tiles_per_program,
    row_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_PARTIALS: tl.constexpr,
):
    """Pass 3. update_partials (programs,): this program's sum of u**2 (see
    `_factored_scaled_gradient`); masked elements have g = 0, hence u = 0."""
    matrix, row_start, row_end, col_index = _strip(rows, rows_per_group, row_groups, cols, BLOCK_N)
    g_ptr = _matrix_pointer(table_ptr, num_matrices, 1, matrix, g0_ptr)
    row_ptr = _matrix_pointer(table_ptr, num_matrices, 3, matrix, stats0_ptr)
    col_ptr = _matrix_pointer(table_ptr, num_matrices, 4, matrix, stats0_ptr)
    row_mean = (
        _sum_of(row_sum_partials_ptr + matrix * row_blocks, row_blocks, BLOCK_PARTIALS) / rows
    )
    col = tl.load(col_ptr + col_index, mask=col_index < cols, other=1.0)
    col_factor = tl.rsqrt(col)
    squares = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for tile in range(0, tiles_per_program):
        row_index, rows_ok, offsets, mask = _tile(
            0, row_start + tile * BLOCK_M, row_end, rows, cols, col_index, BLOCK_M
        )
        g = tl.load(g_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        update = _factored_scaled_gradient(g, row_ptr, row_index, rows_ok, row_mean, col_factor)
        squares += update * update
    program = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    tl.store(update_partials_ptr + program, tl.sum(tl.sum(squares, axis=1), axis=0))


@triton.jit
def _adafactor_second_moment_kernel(
    g_ptr,
    p_ptr,
    second_moment_ptr,
    update_partials_ptr,
    param_partials_ptr,
    numel,
    beta2,
    one_minus_beta2,
    eps1,
    SCALE_PARAMETER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Full second moment (vectors), pass 1: v <- beta2 * v + (1 - beta2) * (g**2 + eps1), and
    this program's sums of u**2 (u = g / sqrt(v)) and of p**2 (SCALE_PARAMETER)."""
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = index < numel
    g = tl.load(g_ptr + index, mask=ok, other=0.0).to(tl.float32)
    second_moment = tl.load(second_moment_ptr + index, mask=ok, other=1.0)
    second_moment = beta2 * second_moment + one_minus_beta2 * (g * g + eps1)
    tl.store(second_moment_ptr + index, second_moment, mask=ok)
    update = g * tl.rsqrt(second_moment)
    tl.store(update_partials_ptr + tl.program_id(0), tl.sum(update * update, axis=0))
    if SCALE_PARAMETER:
        p = tl.load(p_ptr + index, mask=ok, other=0.0).to(tl.float32)
        tl.store(param_partials_ptr + tl.program_id(0), tl.sum(p * p, axis=0))


@triton.jit
def _adafactor_apply_kernel(
    table_ptr,
    num_matrices,
    p0_ptr,
    g0_ptr,
    momentum0_ptr,
    stats0_ptr,
    second_moment_ptr,
    row_sum_partials_ptr,
    update_partials_ptr,
    param_partials_ptr,
    rows,
    cols,
    rows_per_group,
    row_groups,
    tiles_per_program,
    row_blocks,
    partials_per_matrix,
    relative_lr,
    eps2,
    clip_threshold,
    beta1,
    one_minus_beta1,
    weight_decay,
    FACTORED: tl.constexpr,
    SCALE_PARAMETER: tl.constexpr,
    CLIP: tl.constexpr,
    MOMENTUM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_PARTIALS: tl.constexpr,
    ROUND_BF16_BY_HAND: tl.constexpr,
):
    """The last pass: u (factored: from R and C; else from v), u / max(1, RMS(u) / d), the
    momentum, and p <- p - lr * (u + wd * p) with lr = relative_lr * max(eps2, RMS(p)) when
    SCALE_PARAMETER. RMS(u) and RMS(p) are over the matrix's whole tensor (its table entry
    says which matrices that is): the sums of its partials_per_matrix partial sums a matrix
    from the earlier passes, which every program adds up (a few KiB from L2)."""
    matrix, row_start, row_end, col_index = _strip(rows, rows_per_group, row_groups, cols, BLOCK_N)
    p_ptr = _matrix_pointer(table_ptr, num_matrices, 0, matrix, p0_ptr)
    g_ptr = _matrix_pointer(table_ptr, num_matrices, 1, matrix, g0_ptr)
    momentum_ptr = _matrix_pointer(table_ptr, num_matrices, 2, matrix, momentum0_ptr)
    first = tl.load(table_ptr + 5 * num_matrices + matrix)
    count = tl.load(table_ptr + 6 * num_matrices + matrix)
    numel = (count * rows * cols).to(tl.float32)
    partials_start, num_partials = first * partials_per_matrix, count * partials_per_matrix
    lr = relative_lr
    if SCALE_PARAMETER:
        param_sum = _sum_of(param_partials_ptr + partials_start, num_partials, BLOCK_PARTIALS)
        lr = relative_lr * tl.maximum(tl.sqrt(param_sum / numel), eps2)
    if CLIP:
        update_sum = _sum_of(update_partials_ptr + partials_start, num_partials, BLOCK_PARTIALS)
        clip_divisor = tl.maximum(tl.sqrt(update_sum / numel) / clip_threshold, 1.0)
    if FACTORED:
        row_ptr = _matrix_pointer(table_ptr, num_matrices, 3, matrix, stats0_ptr)
        col_ptr = _matrix_pointer(table_ptr, num_matrices, 4, matrix, stats0_ptr)
        row_mean = _sum_of(row_sum_partials_ptr + matrix * row_blocks, row_blocks, BLOCK_PARTIALS)
        row_mean = row_mean / rows
        col = tl.load(col_ptr + col_index, mask=col_index < cols, other=1.0)
        col_factor = tl.rsqrt(col)
    for tile in range(0, tiles_per_program):
        row_index, rows_ok, offsets, mask = _tile(
            0, row_start + tile * BLOCK_M, row_end, rows, cols, col_index, BLOCK_M
        )
        g = tl.load(g_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if FACTORED:
            update = _factored_scaled_gradient(g, row_ptr, row_index, rows_ok, row_mean, col_factor)
        else:
            second_moment = tl.load(second_moment_ptr + offsets, mask=mask, other=1.0)
            update = g * tl.rsqrt(second_moment)
        if CLIP:
            update = update / clip_divisor
        _apply_update(
            p_ptr, momentum_ptr, offsets, mask, update, lr, beta1, one_minus_beta1,
            weight_decay, MOMENTUM, ROUND_BF16_BY_HAND,
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# SM3 kernels.
# ---------------------------------------------------------------------------------------------


@triton.jit
def _sm3_scaled_gradient(g, nu, eps):
    """g / sqrt(nu + eps), 0 where nu + eps == 0 (there g == 0: nu >= g**2)."""
    denominator = nu + eps
    return g / tl.sqrt(tl.where(denominator > 0, denominator, 1.0))


@triton.jit
def _sm3_matrix_kernel(
    table_ptr,
    num_matrices,
    p0_ptr,
    g0_ptr,
    momentum0_ptr,
    stats0_ptr,
    row_partials_ptr,
    col_partials_ptr,
    rows,
    cols,
    rows_per_group,
    row_groups,
    tiles_per_program,
    lr,
    eps,
    beta1,
    one_minus_beta1,
    weight_decay,
    MOMENTUM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROUND_BF16_BY_HAND: tl.constexpr,
):
    """The one pass of SM3 over each (rows, cols) matrix of the table (see `matrix_table`; R
    and C are its row and column accumulators): nu = min(row_acc_i, col_acc_j) + g**2, the
    update and p; row_partials (col_tiles, matrices * rows) and col_partials
    (matrices * row_groups, cols): this program's maxima of nu per row and per column (nu >= 0,
    so 0 is neutral for masked ones)."""
    matrix, row_start, row_end, col_index = _strip(rows, rows_per_group, row_groups, cols, BLOCK_N)
    p_ptr = _matrix_pointer(table_ptr, num_matrices, 0, matrix, p0_ptr)
    g_ptr = _matrix_pointer(table_ptr, num_matrices, 1, matrix, g0_ptr)
    momentum_ptr = _matrix_pointer(table_ptr, num_matrices, 2, matrix, momentum0_ptr)
    row_acc_ptr = _matrix_pointer(table_ptr, num_matrices, 3, matrix, stats0_ptr)
    col_acc_ptr = _matrix_pointer(table_ptr, num_matrices, 4, matrix, stats0_ptr)
    cols_ok = col_index < cols
    col_acc = tl.load(col_acc_ptr + col_index, mask=cols_ok, other=0.0)
    col_max = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for tile in range(0, tiles_per_program):
        row_index, rows_ok, offsets, mask = _tile(
            0, row_start + tile * BLOCK_M, row_end, rows, cols, col_index, BLOCK_M
        )
        row_acc = tl.load(row_acc_ptr + row_index, mask=rows_ok, other=0.0)
        g = tl.load(g_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        nu = tl.minimum(row_acc[:, None], col_acc[None, :]) + g * g
        nu = tl.where(mask, nu, 0.0)
        update = _sm3_scaled_gradient(g, nu, eps)
        _apply_update(
            p_ptr, momentum_ptr, offsets, mask, update, lr, beta1, one_minus_beta1,
            weight_decay, MOMENTUM, ROUND_BF16_BY_HAND,
        )  # fmt: skip
        row_partials = row_partials_ptr + tl.program_id(1).to(tl.int64) * num_matrices * rows
        tl.store(row_partials + matrix * rows + row_index, tl.max(nu, axis=1), mask=rows_ok)
        col_max = tl.maximum(col_max, tl.max(nu, axis=0))
    col_partials = col_partials_ptr + tl.program_id(0).to(tl.int64) * cols
    tl.store(col_partials + col_index, col_max, mask=cols_ok)


@triton.jit
def _sm3_accumulators_kernel(
    table_ptr,
    num_matrices,
    stats0_ptr,
    row_partials_ptr,
    col_partials_ptr,
    rows,
    cols,
    row_groups,
    col_tiles,
    col_blocks,
    BLOCK: tl.constexpr,
):
    """Tiny, grid (matrices, col_blocks + row_blocks): the first col_blocks programs of a
    matrix set BLOCK of its column accumulators to the max of their row_groups partial maxima,
    the others BLOCK of its row accumulators to the max of their col_tiles partial maxima."""
    matrix = tl.program_id(0)
    block = tl.program_id(1)
    if block < col_blocks:
        col_acc_ptr = _matrix_pointer(table_ptr, num_matrices, 4, matrix, stats0_ptr)
        col_index = block * BLOCK + tl.arange(0, BLOCK)
        ok = col_index < cols
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for group in range(0, row_groups):
            partials = col_partials_ptr + (matrix * row_groups + group).to(tl.int64) * cols
            acc = tl.maximum(acc, tl.load(partials + col_index, mask=ok, other=0.0))
        tl.store(col_acc_ptr + col_index, acc, mask=ok)
    else:
        row_acc_ptr = _matrix_pointer(table_ptr, num_matrices, 3, matrix, stats0_ptr)
        row_index = (block - col_blocks) * BLOCK + tl.arange(0, BLOCK)
        ok = row_index < rows
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for tile in range(0, col_tiles):
            partials = row_partials_ptr + (tile * num_matrices + matrix).to(tl.int64) * rows
            acc = tl.maximum(acc, tl.load(partials + row_index, mask=ok, other=0.0))
        tl.store(row_acc_ptr + row_index, acc, mask=ok)


@triton.jit
def _sm3_vector_kernel(
    p_ptr,
    g_ptr,
    momentum_ptr,
    acc_ptr,
    numel,
    lr,
    eps,
    beta1,
    one_minus_beta1,
    weight_decay,
    MOMENTUM: tl.constexpr,
    BLOCK: tl.constexpr,
    ROUND_BF16_BY_HAND: tl.constexpr,
):
    """SM3 with one cover per element (diagonal Adagrad): acc <- acc + g**2, u = g / sqrt(acc)."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < numel
    g = tl.load(g_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
    acc = tl.load(acc_ptr + offsets, mask=ok, other=0.0) + g * g
    tl.store(acc_ptr + offsets, acc, mask=ok)
    update = _sm3_scaled_gradient(g, acc, eps)
    _apply_update(
        p_ptr, momentum_ptr, offsets, ok, update, lr, beta1, one_minus_beta1, weight_decay,
        MOMENTUM, ROUND_BF16_BY_HAND,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Launchers: check, allocate the workspace, grid. The optimizers own the states; these update
# them in place. Every tensor must be contiguous and on one device.
# ---------------------------------------------------------------------------------------------


def _check(param: Tensor, grad: Tensor, momentum: Tensor | None, *states: Tensor) -> None:
    if param.dtype not in KERNEL_DTYPES:
        raise ValueError(
            f"the optimizer kernels take {KERNEL_DTYPES} parameters, got {param.dtype}"
        )
    if momentum is not None and momentum.dtype != param.dtype:
        raise ValueError(f"momentum must have the parameter's dtype {param.dtype}")
    tensors = [param, grad, *states] + ([momentum] if momentum is not None else [])
    if not all(t.is_contiguous() and t.device == param.device for t in tensors):
        raise ValueError("the optimizer kernels need contiguous tensors on the parameter's device")
    if grad.shape != param.shape or (momentum is not None and momentum.shape != param.shape):
        raise ValueError(
            f"gradient and momentum must have the parameter's shape {tuple(param.shape)}"
        )
    if any(state.dtype != torch.float32 for state in states):
        raise ValueError("the optimizer kernels keep their statistics in float32")


def _round_by_hand(param: Tensor) -> bool:
    """The interpreter's fp32 -> bf16 cast truncates: round by hand there (the momentum has
    the parameter's dtype)."""
    return param.device.type == "cpu" and param.dtype == torch.bfloat16


@dataclass(frozen=True)
class AdafactorStep:
    """The scalars of one Adafactor step (see `memfit.optim.adafactor`): relative_lr, the step
    size before the parameter scaling (the paper's rho_t, or the given lr); beta2 (beta2_t);
    eps1 added to g**2; eps2 the least parameter scale; clip_threshold d (math.inf: no
    clipping); beta1 the momentum's decay (0 without momentum); weight_decay, decoupled;
    scale_parameter: the step relative to the parameter's RMS."""

    relative_lr: float
    beta2: float
    eps1: float
    eps2: float
    clip_threshold: float
    beta1: float
    weight_decay: float
    scale_parameter: bool


def matrix_table(
    params: list[Tensor],
    grads: list[Tensor],
    momenta: list[Tensor] | None,
    rows: list[Tensor],
    cols: list[Tensor],
) -> tuple[Tensor, int]:
    """The matrices of `params` (each (..., r, c), one (r, c) for all) for one launch: a (7, M)
    int64 device table whose column m holds matrix m's addresses of parameter, gradient,
    momentum (the parameter's when None), R and C (its fp32 statistics; a tensor's `row` is
    (..., r) and `col` (..., c)), then the first matrix of its tensor and its tensor's number of
    matrices (RMS(u) and RMS(p) are per tensor). Returns the table and M."""
    columns: list[list[int]] = [[] for _ in range(7)]
    for i, (param, grad, row, col) in enumerate(zip(params, grads, rows, cols, strict=True)):
        r, c = param.shape[-2:]
        count = param.numel() // (r * c)
        momentum = momenta[i] if momenta is not None else param
        first = len(columns[0])
        for j in range(count):
            element = j * r * c
            columns[0].append(param.data_ptr() + element * param.element_size())
            columns[1].append(grad.data_ptr() + element * grad.element_size())
            columns[2].append(momentum.data_ptr() + element * momentum.element_size())
            columns[3].append(row.data_ptr() + j * r * 4)
            columns[4].append(col.data_ptr() + j * c * 4)
            columns[5].append(first)
            columns[6].append(count)
    table = torch.tensor(columns, dtype=torch.int64).to(params[0].device, non_blocking=True)
    return table, len(columns[0])


def adafactor_factored_update(
    params: list[Tensor],
    grads: list[Tensor],
    rows: list[Tensor],
    cols: list[Tensor],
    momenta: list[Tensor] | None,
    options: AdafactorStep,
) -> None:
    """One Adafactor step of factored parameters, in place, in one launch a pass for all of
    them (see `memfit.optim.adafactor`): their matrices share (rows, cols), dtype and options.

    params[i], grads[i]: (..., rows, cols); rows[i]: (..., rows) and cols[i]: (..., cols),
    fp32; momenta[i]: like params[i], or momenta None."""
    if not params:
        return
    r, c = params[0].shape[-2:]
    for i, (param, grad, row, col) in enumerate(zip(params, grads, rows, cols, strict=True)):
        momentum = momenta[i] if momenta is not None else None
        _check(param, grad, momentum, row, col)
        if param.dim() < 2 or param.shape[-2:] != (r, c) or param.dtype != params[0].dtype:
            raise ValueError(
                f"one launch takes matrices of one shape and dtype: {tuple(param.shape)} "
                f"{param.dtype} beside (..., {r}, {c}) {params[0].dtype}"
            )
        if row.shape != (*param.shape[:-1],) or col.shape != (*param.shape[:-2], c):
            raise ValueError(
                f"Adafactor statistics of shape {tuple(row.shape)} and {tuple(col.shape)} do "
                f"not factor a parameter of shape {tuple(param.shape)}"
            )
    table, matrices = matrix_table(params, grads, momenta, rows, cols)
    device, param, grad = params[0].device, params[0], grads[0]
    momentum = momenta[0] if momenta is not None else param
    strips = strip_grid(matrices, r, c, device)
    block_1d = _block_1d(device)
    col_blocks, row_blocks = triton.cdiv(c, block_1d), triton.cdiv(r, block_1d)
    clip = math.isfinite(options.clip_threshold)
    # fp32 workspace: row partials (col_tiles, matrices * rows), column partials
    # (matrices * row_groups, cols), sums of the new R (matrices, row_blocks), sums of u**2
    # and p**2 (programs,) each
    sizes = (
        strips.col_tiles * matrices * r,
        matrices * strips.row_groups * c,
        matrices * row_blocks,
        strips.programs,
        strips.programs,
    )
    workspace = torch.empty(sum(sizes), dtype=torch.float32, device=device)
    row_partials, col_partials, row_sums, update_partials, param_partials = workspace.split(sizes)
    meta = dict(BLOCK_M=strips.block_m, BLOCK_N=strips.block_n, num_warps=strips.num_warps)
    stats = rows[0]
    launch(
        _adafactor_square_sums_kernel, strips.grid, device,
        table, matrices, grad, param, row_partials, col_partials, param_partials, r, c,
        strips.rows_per_group, strips.row_groups, strips.tiles_per_program,
        SCALE_PARAMETER=options.scale_parameter, **meta,
    )  # fmt: skip
    launch(
        _adafactor_ema_kernel, (matrices, col_blocks + row_blocks), device,
        table, matrices, stats, row_partials, col_partials, row_sums, r, c, strips.row_groups,
        strips.col_tiles, col_blocks, row_blocks, options.beta2, 1.0 - options.beta2,
        options.eps1, BLOCK=block_1d,
    )  # fmt: skip
    if clip:
        launch(
            _adafactor_update_square_sum_kernel, strips.grid, device,
            table, matrices, grad, stats, row_sums, update_partials, r, c,
            strips.rows_per_group, strips.row_groups, strips.tiles_per_program, row_blocks,
            BLOCK_PARTIALS=block_1d, **meta,
        )  # fmt: skip
    launch(
        _adafactor_apply_kernel, strips.grid, device,
        table, matrices, param, grad, momentum, stats, stats, row_sums, update_partials,
        param_partials, r, c, strips.rows_per_group, strips.row_groups,
        strips.tiles_per_program, row_blocks, strips.row_groups * strips.col_tiles,
        options.relative_lr, options.eps2, options.clip_threshold if clip else 1.0,
        options.beta1, 1.0 - options.beta1, options.weight_decay,
        FACTORED=True, SCALE_PARAMETER=options.scale_parameter, CLIP=clip,
        MOMENTUM=momenta is not None, BLOCK_PARTIALS=block_1d,
        ROUND_BF16_BY_HAND=_round_by_hand(param), **meta,
    )  # fmt: skip


def adafactor_full_update(
    param: Tensor,
    grad: Tensor,
    second_moment: Tensor,
    momentum: Tensor | None,
    options: AdafactorStep,
) -> None:
    """One Adafactor step of a parameter with a full second moment (any shape, in practice a
    vector), in place. param, grad, second_moment (fp32), momentum (or None): one shape."""
    _check(param, grad, momentum, second_moment)
    if second_moment.shape != param.shape:
        raise ValueError(f"Adafactor's second moment must have the shape {tuple(param.shape)}")
    device = param.device
    numel = param.numel()
    block = _block_1d(device)
    programs = triton.cdiv(numel, block)
    if programs > _MAX_GRID_Y:
        raise ValueError(
            f"Adafactor's kernels take parameters with a full second moment of up to "
            f"{_MAX_GRID_Y * block} elements, got {numel}"
        )
    workspace = torch.empty(2 * programs, dtype=torch.float32, device=device)
    update_partials, param_partials = workspace.split(programs)
    warps = 1 if device.type == "cpu" else NUM_WARPS
    launch(
        _adafactor_second_moment_kernel, (programs,), device,
        grad, param, second_moment, update_partials, param_partials, numel, options.beta2,
        1.0 - options.beta2, options.eps1, SCALE_PARAMETER=options.scale_parameter, BLOCK=block, num_warps=warps,
    )  # fmt: skip
    clip = math.isfinite(options.clip_threshold)
    # the apply kernel on one (1, numel) matrix in strips of one row
    flat = [t.view(1, numel) for t in (param, grad, second_moment)]
    table, _ = matrix_table(
        flat[:1], flat[1:2], [momentum.view(1, numel)] if momentum is not None else None,
        [flat[2]], [flat[2]],
    )  # fmt: skip
    launch(
        _adafactor_apply_kernel, (1, programs), device,
        table, 1, param, grad, momentum if momentum is not None else param, second_moment,
        second_moment, second_moment, update_partials, param_partials, 1, numel, 1, 1, 1, 1,
        programs, options.relative_lr, options.eps2, options.clip_threshold if clip else 1.0,
        options.beta1, 1.0 - options.beta1, options.weight_decay, FACTORED=False, SCALE_PARAMETER=options.scale_parameter, CLIP=clip,
        MOMENTUM=momentum is not None, BLOCK_M=1, BLOCK_N=block, BLOCK_PARTIALS=block,
        ROUND_BF16_BY_HAND=_round_by_hand(param), num_warps=warps,
    )  # fmt: skip


def sm3_matrix_update(
    params: list[Tensor],
    grads: list[Tensor],
    row_accs: list[Tensor],
    col_accs: list[Tensor],
    momenta: list[Tensor] | None,
    *,
    lr: float,
    eps: float,
    beta1: float,
    weight_decay: float,
) -> None:
    """One SM3-II step of parameters covered by the rows and columns of their (rows, cols)
    views (rows = all leading dims), in place, one launch a pass for all of them (see
    `memfit.optim.sm3`): their views share (rows, cols), and their dtype. params[i], grads[i]:
    (..., cols); row_accs[i] (rows,), col_accs[i] (cols,): fp32; momenta[i]: like params[i],
    or momenta None (no momentum)."""
    if not params:
        return
    cols = params[0].shape[-1]
    rows = params[0].numel() // cols
    for i, (param, grad, row_acc, col_acc) in enumerate(
        zip(params, grads, row_accs, col_accs, strict=True)
    ):
        _check(param, grad, momenta[i] if momenta is not None else None, row_acc, col_acc)
        if param.shape[-1] != cols or param.numel() != rows * cols:
            raise ValueError(
                f"one launch takes matrices of one shape: {tuple(param.shape)} beside "
                f"({rows}, {cols})"
            )
        if param.dtype != params[0].dtype:
            raise ValueError(f"one launch takes one dtype: {param.dtype}, {params[0].dtype}")
        if row_acc.shape != (rows,) or col_acc.shape != (cols,):
            raise ValueError(
                f"SM3 accumulators of shape {tuple(row_acc.shape)} and {tuple(col_acc.shape)} "
                f"do not cover a ({rows}, {cols}) matrix"
            )
    views = [[t.view(rows, cols) for t in ts] for ts in (params, grads, momenta or [])]
    table, matrices = matrix_table(views[0], views[1], views[2] or None, row_accs, col_accs)
    device, param = params[0].device, params[0]
    strips = strip_grid(matrices, rows, cols, device)
    sizes = (strips.col_tiles * matrices * rows, matrices * strips.row_groups * cols)
    workspace = torch.empty(sum(sizes), dtype=torch.float32, device=device)
    row_partials, col_partials = workspace.split(sizes)
    launch(
        _sm3_matrix_kernel, strips.grid, device,
        table, matrices, param, grads[0], momenta[0] if momenta is not None else param,
        row_accs[0], row_partials, col_partials, rows, cols, strips.rows_per_group,
        strips.row_groups, strips.tiles_per_program, lr, eps, beta1, 1.0 - beta1, weight_decay,
        MOMENTUM=momenta is not None, BLOCK_M=strips.block_m, BLOCK_N=strips.block_n,
        ROUND_BF16_BY_HAND=_round_by_hand(param), num_warps=strips.num_warps,
    )  # fmt: skip
    block = _block_1d(device)
    col_blocks = triton.cdiv(cols, block)
    launch(
        _sm3_accumulators_kernel, (matrices, col_blocks + triton.cdiv(rows, block)), device,
        table, matrices, row_accs[0], row_partials, col_partials, rows, cols, strips.row_groups,
        strips.col_tiles, col_blocks, BLOCK=block,
    )  # fmt: skip


def sm3_vector_update(
    param: Tensor,
    grad: Tensor,
    acc: Tensor,
    momentum: Tensor | None,
    *,
    lr: float,
    eps: float,
    beta1: float,
    weight_decay: float,
) -> None:
    """One SM3 step of a parameter with one accumulator per element (vectors), in place.
    param, grad, acc (fp32), momentum (or None): one shape."""
    _check(param, grad, momentum, acc)
    if acc.shape != param.shape:
        raise ValueError(f"SM3's accumulator must have the shape {tuple(param.shape)}")
    device = param.device
    block = _block_1d(device)
    launch(
        _sm3_vector_kernel, (triton.cdiv(param.numel(), block),), device,
        param, grad, momentum if momentum is not None else param, acc, param.numel(), lr, eps,
        beta1, 1.0 - beta1, weight_decay, MOMENTUM=momentum is not None, BLOCK=block,
        ROUND_BF16_BY_HAND=_round_by_hand(param),
        num_warps=1 if device.type == "cpu" else NUM_WARPS,
    )  # fmt: skip
