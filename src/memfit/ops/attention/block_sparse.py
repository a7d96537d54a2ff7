"""Block-sparse FlashAttention: exact attention over a sparse pattern (memfit.ops.attention.sparse)
whose work is proportional to the tiles the pattern's layout lists.

The kernels are FlashAttention's (the package docstring: online softmax forward, then delta,
dk/dv and dq programs without atomics, so reruns are bitwise equal), walking a layout instead of
a band: a forward or dq program owns a query tile and visits the key tiles of its CSR row; a
dk/dv program owns a key tile and visits the query tiles of its CSR column, for every query head
of its GQA group (with a layout per head, each head's own column). Programs take their tiles
longest first (the layout's `order`), so a global token's long row starts in the first wave.
The forward's tiles are square (64 on GPUs); the backward's dq and dk/dv programs take 128 x 64
and 64 x 128 tiles where that adds little work (BACKWARD_WIDEN, WIDE_WORK), their layouts built
when a backward first runs. A tile's kind (FULL, RULE,
CAUSAL) says how its pairs are masked; the token
rule (band, strided columns, global tokens, causality) is computed in registers from positions
and a per-token flag of global tokens. Tiles past a sequence's end are skipped and rows past it
never stored, so any length runs; packed variable-length batches take cu_seqlens, every sequence
walking the same layout from its own start (positions, global tokens, random blocks are per
sequence).

A query row that sees no key (only possible with a user layout) gets a zero output and
lse = -inf, and no gradient.

Dilated patterns run as `dilation` interleaved subsequences (the tensors are regrouped so that
each subsequence is contiguous, attended with the subsequence's layout, and put back): work
1/dilation of the undilated pattern's. Without a window each subsequence attends densely, and
from DENSE_TO_FLASH tokens memfit's dense FlashAttention runs them.

A band and nothing else (local attention, causal or not; a dilated pattern with a window, on its
subsequences) is memfit's FlashAttention's own sliding window: in fp16/bf16, at the head dims
and softmax scales that kernel takes, it runs it (BAND_TO_FLASH), walking the band by arithmetic
instead of a layout, dq and dk/dv programs in one launch (on an H100, local-512 at 16k: 0.86x
the layout-walking kernels' kernel time and Flex's, benchmarks/results/
sparse_attention_kernels.json).

On CPU tensors outside `memfit.ops._triton.triton_on_cpu()` a plain-PyTorch path runs the dense
masked product (O(seqlen^2) memory: for tests and small shapes).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from memfit.ops._triton import interpreter_enabled, kernels_requested, launch, tl, triton
from memfit.ops.attention.interface import (
    flash_attention,
    flash_attention_varlen,
    head_dim_supported,
    scale_supported,
)
from memfit.ops.attention.launch import LOG2E, _layout, delta_and_lse2
from memfit.ops.attention.sparse import (
    NO_LIMIT,
    BlockLayout,
    Pattern,
    block_layout,
    dense_mask,
    tile_for,
)
from memfit.ops.attention.tiles import _dot, _sequence, _to_dtype

__all__ = ["sparse_attention", "sparse_attention_varlen"]

# the forward's square tile on GPUs and under the interpreter (the backward's may be wider:
# BACKWARD_WIDEN)
GPU_BLOCK = 64
INTERPRET_BLOCK = 16


@triton.jit
def _keep(
    rows,
    cols,
    kind,
    seqlen,
    global_ptr,
    left,
    right,
    STRIDE: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_GLOBAL: tl.constexpr,
):
    """Which (row, col) pairs of a tile are attended (positions within the sequence): by the
    tile's kind, FULL everything, CAUSAL col <= row, else the token rule; never past the end.
    (A branch on the kind: a FULL tile computes no rule and reads no global flags.)"""
    keep = (cols < seqlen) & (rows < seqlen)
    if kind == 2:
        keep = keep & (cols <= rows)
    elif kind == 1:
        rule = (cols >= rows - left) & (cols <= rows + right)
        if STRIDE > 0:
            rule = rule | ((cols + 1) % STRIDE == 0)
        if HAS_GLOBAL:
            row_global = tl.load(global_ptr + rows, mask=rows < seqlen, other=0) != 0
            col_global = tl.load(global_ptr + cols, mask=cols < seqlen, other=0) != 0
            rule = rule | row_global | col_global
        if IS_CAUSAL:
            rule = rule & (cols <= rows)
        keep = keep & rule
    return keep


@triton.jit
def _layout_row(
    INDPTR, INDICES, KINDS, tile, off_h, stride_indptr, stride_list, PER_HEAD: tl.constexpr
):
    """A query tile's row of its head's layout (PER_HEAD) or the shared one: the head's
    INDICES and KINDS and the row's [lo, hi) in them."""
    if PER_HEAD:
        INDPTR += off_h * stride_indptr
        INDICES += off_h * stride_list
        KINDS += off_h * stride_list
    return INDICES, KINDS, tl.load(INDPTR + tile), tl.load(INDPTR + tile + 1)


@triton.jit
def _key_tile(
    INDICES, KINDS, i, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, d_ok, seqlen,
    GLOBAL, left, right, BLOCK_N: tl.constexpr, STRIDE: tl.constexpr, IS_CAUSAL: tl.constexpr,
    HAS_GLOBAL: tl.constexpr,
):  # fmt: skip
    """Entry i of a query tile's layout row: its key tile's k and v (zeros past the end) and
    which (query, key) pairs of it are attended."""
    cols = tl.load(INDICES + i) * BLOCK_N + tl.arange(0, BLOCK_N)
    kv_mask = (cols[:, None] < seqlen) & d_ok
    k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
    keep = _keep(
        offs_m[:, None], cols[None, :], tl.load(KINDS + i), seqlen, GLOBAL, left, right, STRIDE,
        IS_CAUSAL, HAS_GLOBAL,
    )  # fmt: skip
    return k, v, keep


@triton.jit
def _sparse_fwd_kernel(
    Q, K, V, Out, LSE, CU, ORDER, INDPTR, INDICES, KINDS, GLOBAL,
    stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh, stride_ob, stride_on, stride_oh, stride_lb, stride_lh,
    stride_indptr, stride_list,
    seqlen, left, right, qk_scale, num_heads,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, STRIDE: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_GLOBAL: tl.constexpr,
    PER_HEAD: tl.constexpr, IS_VARLEN: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """One query tile of one (sequence, head): the online softmax over its layout row (the
    head's own layout with PER_HEAD)."""
    off_bh = tl.program_id(0)
    tile = tl.load(ORDER + tl.program_id(1))  # (longest first)
    off_b = off_bh // num_heads
    off_h = off_bh % num_heads
    start, seqlen = _sequence(CU, off_b, seqlen, IS_VARLEN)
    start_m = tile * BLOCK_M
    if start_m >= seqlen:
        return
    off_b64 = off_b.to(tl.int64)
    start64 = start.to(tl.int64)
    q_base = Q + off_b64 * stride_qb + start64 * stride_qn + off_h * stride_qh
    k_base = K + off_b64 * stride_kb + start64 * stride_kn + (off_h // GROUP) * stride_kh
    v_base = V + off_b64 * stride_vb + start64 * stride_vn + (off_h // GROUP) * stride_vh
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < HEAD_DIM
    io_mask = (offs_m[:, None] < seqlen) & d_ok
    q = tl.load(q_base + offs_m[:, None] * stride_qn + offs_d[None, :], mask=io_mask, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    INDICES, KINDS, lo, hi = _layout_row(
        INDPTR, INDICES, KINDS, tile, off_h, stride_indptr, stride_list, PER_HEAD
    )
    for i in range(lo, hi):
        k, v, keep = _key_tile(
            INDICES, KINDS, i, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, d_ok,
            seqlen, GLOBAL, left, right, BLOCK_N, STRIDE, IS_CAUSAL, HAS_GLOBAL,
        )  # fmt: skip
        qk = _dot(q, tl.trans(k), None, INTERPRET)
        qk = tl.where(keep, qk * qk_scale, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(qk, 1))
        m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)  # (a row that has seen no key yet)
        p = tl.math.exp2(qk - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = _dot(_to_dtype(p, v.dtype, INTERPRET), v, acc * alpha[:, None], INTERPRET)
        m_i = m_ij
    seen = l_i > 0.0
    acc = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(
        seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) / 1.4426950408889634, float("-inf")
    )
    o_base = Out + off_b64 * stride_ob + start64 * stride_on + off_h * stride_oh
    tl.store(
        o_base + offs_m[:, None] * stride_on + offs_d[None, :],
        _to_dtype(acc, Out.dtype.element_ty, INTERPRET),
        mask=io_mask,
    )
    tl.store(
        LSE + off_b64 * stride_lb + off_h * stride_lh + start + offs_m, lse, mask=offs_m < seqlen
    )


@triton.jit
def _dkdv_tile(
    dk, dv, k, v, Q, DO, LSE2, DELTA, T_INDICES, T_KINDS, GLOBAL, i, off_h, off_b64, start,
    start64, offs_n, offs_d, d_ok, stride_qb, stride_qn, stride_qh, stride_dob, stride_don,
    stride_doh, stride_lb, stride_lh, seqlen, left, right, qk_scale,
    BLOCK_M: tl.constexpr, STRIDE: tl.constexpr, IS_CAUSAL: tl.constexpr,
    HAS_GLOBAL: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Add query tile T_INDICES[i] of head off_h to a key tile's dk and dv (transposed:
    keys x queries)."""
    start_m = tl.load(T_INDICES + i) * BLOCK_M
    kind = tl.load(T_KINDS + i)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    row_ok = offs_m < seqlen
    io_mask = row_ok[:, None] & d_ok
    q_rows = start64 * stride_qn + offs_m[:, None] * stride_qn + offs_d[None, :]
    q = tl.load(Q + off_b64 * stride_qb + off_h * stride_qh + q_rows, mask=io_mask, other=0.0)
    do_rows = start64 * stride_don + offs_m[:, None] * stride_don + offs_d[None, :]
    do = tl.load(DO + off_b64 * stride_dob + off_h * stride_doh + do_rows, mask=io_mask, other=0.0)
    row = off_b64 * stride_lb + off_h * stride_lh + start + offs_m
    lse2 = tl.load(LSE2 + row, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + row, mask=row_ok, other=0.0)
    qkT = _dot(k, tl.trans(q), None, INTERPRET)
    dpT = _dot(v, tl.trans(do), None, INTERPRET)
    keepT = _keep(
        offs_m[None, :], offs_n[:, None], kind, seqlen, GLOBAL, left, right, STRIDE, IS_CAUSAL,
        HAS_GLOBAL,
    )  # fmt: skip
    pT = tl.where(keepT, tl.math.exp2(qkT * qk_scale - lse2[None, :]), 0.0)
    dv = _dot(_to_dtype(pT, do.dtype, INTERPRET), do, dv, INTERPRET)
    dsT = pT * (dpT - delta[None, :])
    dk = _dot(_to_dtype(dsT, q.dtype, INTERPRET), q, dk, INTERPRET)
    return dk, dv


@triton.jit
def _sparse_dkdv_kernel(
    Q, K, V, DO, LSE2, DELTA, DK, DV, CU, T_ORDER, T_INDPTR, T_INDICES, T_KINDS, GLOBAL,
    stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh, stride_dob, stride_don, stride_doh,
    stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh, stride_lb, stride_lh,
    stride_indptr, stride_list,
    seqlen, left, right, qk_scale, softmax_scale, num_heads_kv,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, STRIDE: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_GLOBAL: tl.constexpr,
    PER_HEAD: tl.constexpr, IS_VARLEN: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """dk, dv of one key tile of one (sequence, kv head): over the query tiles of its layout
    column, for each query head of the group (computed transposed: keys x queries)."""
    off_bh = tl.program_id(0)
    tile = tl.load(T_ORDER + tl.program_id(1))  # (longest first)
    off_b = off_bh // num_heads_kv
    off_hk = off_bh % num_heads_kv
    start, seqlen = _sequence(CU, off_b, seqlen, IS_VARLEN)
    start_n = tile * BLOCK_N
    if start_n >= seqlen:
        return
    off_b64 = off_b.to(tl.int64)
    start64 = start.to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < HEAD_DIM
    kv_mask = (offs_n[:, None] < seqlen) & d_ok
    k_base = K + off_b64 * stride_kb + start64 * stride_kn + off_hk * stride_kh
    v_base = V + off_b64 * stride_vb + start64 * stride_vn + off_hk * stride_vh
    k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    if PER_HEAD:  # each query head of the group walks its own layout's column
        for g in range(0, GROUP):
            off_h = off_hk * GROUP + g
            lo = tl.load(T_INDPTR + off_h * stride_indptr + tile)
            hi = tl.load(T_INDPTR + off_h * stride_indptr + tile + 1)
            for i in range(lo, hi):
                dk, dv = _dkdv_tile(
                    dk, dv, k, v, Q, DO, LSE2, DELTA, T_INDICES + off_h * stride_list,
                    T_KINDS + off_h * stride_list, GLOBAL, i, off_h, off_b64, start,
                    start64, offs_n, offs_d, d_ok, stride_qb, stride_qn, stride_qh,
                    stride_dob, stride_don, stride_doh, stride_lb, stride_lh, seqlen, left,
                    right, qk_scale, BLOCK_M, STRIDE, IS_CAUSAL, HAS_GLOBAL, INTERPRET,
                )  # fmt: skip
    else:  # one counted loop over (head, query tile): the column is the same for every head
        lo = tl.load(T_INDPTR + tile)
        count = tl.load(T_INDPTR + tile + 1) - lo
        for step in range(0, GROUP * count):
            g = step // count
            dk, dv = _dkdv_tile(
                dk, dv, k, v, Q, DO, LSE2, DELTA, T_INDICES, T_KINDS, GLOBAL,
                lo + step - g * count, off_hk * GROUP + g, off_b64, start, start64, offs_n,
                offs_d, d_ok, stride_qb, stride_qn, stride_qh, stride_dob, stride_don,
                stride_doh, stride_lb, stride_lh, seqlen, left, right, qk_scale, BLOCK_M, STRIDE,
                IS_CAUSAL, HAS_GLOBAL, INTERPRET,
            )  # fmt: skip
    dk = dk * softmax_scale
    dk_base = DK + off_b64 * stride_dkb + start64 * stride_dkn + off_hk * stride_dkh
    dv_base = DV + off_b64 * stride_dvb + start64 * stride_dvn + off_hk * stride_dvh
    tl.store(
        dk_base + offs_n[:, None] * stride_dkn + offs_d[None, :],
        _to_dtype(dk, DK.dtype.element_ty, INTERPRET),
        mask=kv_mask,
    )
    tl.store(
        dv_base + offs_n[:, None] * stride_dvn + offs_d[None, :],
        _to_dtype(dv, DV.dtype.element_ty, INTERPRET),
        mask=kv_mask,
    )


@triton.jit
def _sparse_dq_kernel(
    Q, K, V, DO, LSE2, DELTA, DQ, CU, ORDER, INDPTR, INDICES, KINDS, GLOBAL,
    stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh, stride_dob, stride_don, stride_doh,
    stride_dqb, stride_dqn, stride_dqh, stride_lb, stride_lh, stride_indptr, stride_list,
    seqlen, left, right, qk_scale, softmax_scale, num_heads,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, STRIDE: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_GLOBAL: tl.constexpr,
    PER_HEAD: tl.constexpr, IS_VARLEN: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """dq of one query tile of one (sequence, head): over the key tiles of its layout row."""
    off_bh = tl.program_id(0)
    tile = tl.load(ORDER + tl.program_id(1))  # (longest first)
    off_b = off_bh // num_heads
    off_h = off_bh % num_heads
    start, seqlen = _sequence(CU, off_b, seqlen, IS_VARLEN)
    start_m = tile * BLOCK_M
    if start_m >= seqlen:
        return
    off_b64 = off_b.to(tl.int64)
    start64 = start.to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < HEAD_DIM
    row_ok = offs_m < seqlen
    io_mask = row_ok[:, None] & d_ok
    q_base = Q + off_b64 * stride_qb + start64 * stride_qn + off_h * stride_qh
    do_base = DO + off_b64 * stride_dob + start64 * stride_don + off_h * stride_doh
    q = tl.load(q_base + offs_m[:, None] * stride_qn + offs_d[None, :], mask=io_mask, other=0.0)
    do = tl.load(do_base + offs_m[:, None] * stride_don + offs_d[None, :], mask=io_mask, other=0.0)
    row = off_b64 * stride_lb + off_h * stride_lh + start + offs_m
    lse2 = tl.load(LSE2 + row, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + row, mask=row_ok, other=0.0)
    k_base = K + off_b64 * stride_kb + start64 * stride_kn + (off_h // GROUP) * stride_kh
    v_base = V + off_b64 * stride_vb + start64 * stride_vn + (off_h // GROUP) * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    INDICES, KINDS, lo, hi = _layout_row(
        INDPTR, INDICES, KINDS, tile, off_h, stride_indptr, stride_list, PER_HEAD
    )
    for i in range(lo, hi):
        k, v, keep = _key_tile(
            INDICES, KINDS, i, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, d_ok,
            seqlen, GLOBAL, left, right, BLOCK_N, STRIDE, IS_CAUSAL, HAS_GLOBAL,
        )  # fmt: skip
        qk = _dot(q, tl.trans(k), None, INTERPRET)
        dp = _dot(do, tl.trans(v), None, INTERPRET)
        p = tl.where(keep, tl.math.exp2(qk * qk_scale - lse2[:, None]), 0.0)
        ds = p * (dp - delta[:, None])
        dq = _dot(_to_dtype(ds, k.dtype, INTERPRET), k, dq, INTERPRET)
    dq = dq * softmax_scale
    dq_base = DQ + off_b64 * stride_dqb + start64 * stride_dqn + off_h * stride_dqh
    tl.store(
        dq_base + offs_m[:, None] * stride_dqn + offs_d[None, :],
        _to_dtype(dq, DQ.dtype.element_ty, INTERPRET),
        mask=io_mask,
    )


def _rule_args(pattern: Pattern, layout: BlockLayout) -> tuple:
    """(left, right, STRIDE, IS_CAUSAL, global flags) of the kernels' token rule; the flags
    pointer is any int tensor (never read) without global tokens."""
    left, right = pattern.window if pattern.window is not None else (-NO_LIMIT, -NO_LIMIT)
    flags = layout.global_flags if layout.global_flags is not None else layout.kinds
    return left, right, pattern.stride, pattern.causal, flags


# A dilated pattern without a window is dense attention on each interleaved subsequence: in
# fp16/bf16, subsequences of DENSE_TO_FLASH tokens or more run memfit.flash_attention (on an
# H100, dilation 4: at 64k it took 0.81x the block-sparse kernels' time, at 16k 1.11x; the
# crossover lies between subsequences of 4k and 16k tokens); None: always the block-sparse
# kernels (benchmarks compare the two).
DENSE_TO_FLASH: int | None = 8192


# A band alone runs memfit's FlashAttention with that window (module docstring); False: the
# layout-walking kernels (benchmarks compare the two).
BAND_TO_FLASH = True


def _band_only(pattern: Pattern) -> bool:
    """Whether the pattern is a window and nothing else (no strided columns, global tokens,
    random or user blocks, per-head layouts)."""
    return (
        pattern.window is not None
        and pattern.heads == 1
        and not (pattern.stride or pattern.global_tokens or pattern.random_blocks
                 or pattern.blocks is not None)
    )  # fmt: skip


def _dense_subsequences(pattern: Pattern) -> bool:
    """Whether each (sub)sequence attends densely (causal or not): an unbounded window only."""
    sides = () if pattern.window is None else pattern.window[: 1 + (not pattern.causal)]
    return _band_only(pattern) and all(side >= NO_LIMIT for side in sides)


def _flash_window(pattern: Pattern, seqlen: int, q: Tensor, scale: float) -> tuple | None:
    """The (left, right) window memfit's FlashAttention runs this pattern with on sequences of
    `seqlen` tokens (its subsequences' for a dilated one), or None where the block-sparse
    kernels run it (BAND_TO_FLASH, DENSE_TO_FLASH; fp16/bf16 q at a head dim and softmax scale
    FlashAttention takes)."""
    if (
        q.dtype not in (torch.float16, torch.bfloat16)
        or not head_dim_supported(q.shape[-1])
        or not scale_supported(scale)
        or not _band_only(pattern)
    ):
        return None
    if _dense_subsequences(pattern):
        if DENSE_TO_FLASH is None or seqlen < DENSE_TO_FLASH:
            return None
    elif not BAND_TO_FLASH:
        return None
    return tuple(None if side >= NO_LIMIT else side for side in pattern.window)


# The backward's tiles: dq programs take (WIDE x block) query x key tiles, dk/dv programs
# (block x WIDE), with WIDE = BACKWARD_WIDEN x block up to 128 (as memfit's FlashAttention
# backward does:
# wider tiles keep its products on the tensor cores longer; on an H100 they ran BigBird's
# backward 1.5x faster) where the pattern's blocks allow and the wider tiles add at most
# WIDE_WORK - 1 to the pairs the kernel multiplies (a strided column costs a 128-key tile where
# it cost 64: +89% for dk/dv at stride 256); else square tiles like the forward's.
BACKWARD_WIDEN = 2
WIDE_WORK = 1.15
# (num_warps, num_stages) of a kernel by its tile (query rows, key rows), from
# benchmarks/sparse_configs.py on an H100 (head dim 128); others: 4 warps, 2 stages up to 64,
# else 8 warps and 1 stage (a 128 x 128 dk/dv tile needs more shared memory than an H100 has at
# 3 stages with head dim 128)
LAUNCH_OPTIONS = {
    ("forward", 64, 64): (4, 3),
    ("dkdv", 64, 64): (4, 2),
    ("dq", 64, 64): (4, 2),
    ("dkdv", 64, 128): (8, 3),
    ("dq", 128, 64): (8, 3),
}


def _launch_options(kernel: str, layout: BlockLayout) -> dict:
    tile = (layout.block_m, layout.block_n)
    default = (4, 2) if max(tile) <= 64 else (8, 1)
    warps, stages = LAUNCH_OPTIONS.get((kernel, *tile), default)
    return {"num_warps": warps, "num_stages": stages}


def _backward_layouts(
    pattern: Pattern, seqlen: int, block: int, device: torch.device
) -> tuple[BlockLayout, BlockLayout]:
    """The (dq, dk/dv) layouts of a call's backward (BACKWARD_WIDEN), each built once per
    shape, when a backward first runs."""
    dq, dkdv = _backward_tiles(pattern, seqlen, block, BACKWARD_WIDEN, WIDE_WORK)
    return (
        block_layout(pattern, seqlen, dq[0], device, block_n=dq[1]),
        block_layout(pattern, seqlen, dkdv[0], device, block_n=dkdv[1]),
    )


@functools.lru_cache(maxsize=64)
def _backward_tiles(
    pattern: Pattern, seqlen: int, block: int, widen: int, most_work: float
) -> tuple[tuple[int, int], tuple[int, int]]:
    """(dq tile, dk/dv tile) as (query rows, key rows), decided on the host's layouts."""
    wide = widen * block
    if wide == block or wide > 128 or (pattern.block is not None and pattern.block % wide):
        return (block, block), (block, block)
    work = block_layout(pattern, seqlen, block).nnz * block * block
    tiles = []
    for bm, bn in ((wide, block), (block, wide)):
        wider = block_layout(pattern, seqlen, bm, block_n=bn).nnz * bm * bn
        tiles.append((bm, bn) if wider <= most_work * work else (block, block))
    return tiles[0], tiles[1]


def _geometry(q: Tensor, k: Tensor, cu_seqlens: Tensor | None) -> tuple[int, int, int, int]:
    """(batch, heads, heads_kv, head_dim)."""
    batch = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    return batch, q.shape[-2], k.shape[-2], q.shape[-1]


def _kernels_on(device: torch.device) -> bool:
    """Whether the kernels run for tensors on `device`: CUDA (also while torch.compile traces:
    the call is then left out of the graph, `_run`), CPU under `triton_on_cpu()`."""
    return kernels_requested(device)


def _forward(q, k, v, pattern, layout, cu_seqlens, seqlen, scale):
    batch, heads, heads_kv, head_dim = _geometry(q, k, cu_seqlens)
    varlen = cu_seqlens is not None
    out = torch.empty_like(q)  # (every row is stored)
    lse_shape = (heads, q.shape[0]) if varlen else (batch, heads, q.shape[1])
    lse = torch.full(lse_shape, float("-inf"), dtype=torch.float32, device=q.device)
    if q.numel() == 0:
        return out, lse
    left, right, stride, causal, flags = _rule_args(pattern, layout)
    block_d = max(16, triton.next_power_of_2(head_dim))
    stride_lse = (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))
    launch(
        _sparse_fwd_kernel, (batch * heads, layout.tiles_m), q.device,
        q, k, v, out, lse, cu_seqlens, layout.order, layout.indptr, layout.indices,
        layout.kinds, flags,
        *_layout(q), *_layout(k), *_layout(v), *_layout(out), *stride_lse,
        layout.indptr.stride(0), layout.indices.stride(0), seqlen, left, right, scale * LOG2E,
        heads,
        GROUP=heads // heads_kv, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=layout.block_m,
        BLOCK_N=layout.block_n, STRIDE=stride, IS_CAUSAL=causal,
        HAS_GLOBAL=layout.global_flags is not None, PER_HEAD=layout.heads > 1,
        IS_VARLEN=varlen, INTERPRET=interpreter_enabled(), **_launch_options("forward", layout),
    )  # fmt: skip
    return out, lse


def _backward(dout, q, k, v, out, lse, pattern, layouts, cu_seqlens, seqlen, scale):
    """dq over the dq layout's rows, dk and dv over the dk/dv layout's columns
    (`_backward_layouts`)."""
    batch, heads, heads_kv, head_dim = _geometry(q, k, cu_seqlens)
    varlen = cu_seqlens is not None
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # (all stored)
    if q.numel() == 0:
        return dq, dk, dv
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    block_d = max(16, triton.next_power_of_2(head_dim))
    interpret = interpreter_enabled()
    delta, lse2 = delta_and_lse2(out, dout, lse, cu_seqlens, seqlen, batch, heads)
    stride_lse = (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))
    rows, cols = layouts
    left, right, stride, causal, flags = _rule_args(pattern, rows)
    meta = dict(
        GROUP=heads // heads_kv, HEAD_DIM=head_dim, BLOCK_D=block_d, STRIDE=stride,
        IS_CAUSAL=causal, HAS_GLOBAL=rows.global_flags is not None, PER_HEAD=rows.heads > 1,
        IS_VARLEN=varlen, INTERPRET=interpret,
    )  # fmt: skip
    launch(
        _sparse_dkdv_kernel, (batch * heads_kv, cols.tiles_n), q.device,
        q, k, v, dout, lse2, delta, dk, dv, cu_seqlens, cols.t_order, cols.t_indptr,
        cols.t_indices, cols.t_kinds, flags,
        *_layout(q), *_layout(k), *_layout(v), *_layout(dout), *_layout(dk), *_layout(dv),
        *stride_lse, cols.t_indptr.stride(0), cols.t_indices.stride(0), seqlen, left,
        right, scale * LOG2E, scale, heads_kv, **meta, BLOCK_M=cols.block_m,
        BLOCK_N=cols.block_n, **_launch_options("dkdv", cols),
    )  # fmt: skip
    launch(
        _sparse_dq_kernel, (batch * heads, rows.tiles_m), q.device,
        q, k, v, dout, lse2, delta, dq, cu_seqlens, rows.order, rows.indptr,
        rows.indices, rows.kinds, flags,
        *_layout(q), *_layout(k), *_layout(v), *_layout(dout), *_layout(dq), *stride_lse,
        rows.indptr.stride(0), rows.indices.stride(0), seqlen, left, right, scale * LOG2E,
        scale, heads, **meta, BLOCK_M=rows.block_m, BLOCK_N=rows.block_n,
        **_launch_options("dq", rows),
    )  # fmt: skip
    return dq, dk, dv


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, pattern, layout, backward_layouts, cu_seqlens, seqlen, scale):
        """backward_layouts: () -> (dq layout, dk/dv layout), built when a backward runs."""
        out, lse = _forward(q, k, v, pattern, layout, cu_seqlens, seqlen, scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
        ctx.args = (pattern, backward_layouts, seqlen, scale)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        pattern, backward_layouts, seqlen, scale = ctx.args
        dq, dk, dv = _backward(
            dout, q, k, v, out, lse, pattern, backward_layouts(), cu_seqlens, seqlen, scale
        )
        return dq, dk, dv, None, None, None, None, None, None


def _dense(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """The plain path: (batch, seqlen, heads, dim) attention under a (seqlen, seqlen) mask; a
    row that sees no key gives zeros."""
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    wide = torch.promote_types(q.dtype, torch.float32)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.to(wide), k.to(wide)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", weights, v.to(wide)).to(q.dtype)


def _settle(
    pattern: Pattern, seqlen: int, q: Tensor, block: int | None, softmax_scale: float | None
) -> tuple[int, float]:
    """(tile size, softmax scale) of a call, the pattern checked against the sequence and q's
    heads (q: (..., heads, dim))."""
    heads, dim = q.shape[-2], q.shape[-1]
    if pattern.heads not in (1, heads):
        raise ValueError(
            f"the pattern has a layout for each of {pattern.heads} heads, q has {heads} heads"
        )
    block = block or tile_for(pattern, INTERPRET_BLOCK if interpreter_enabled() else GPU_BLOCK)
    if block < 16 or block & (block - 1):
        raise ValueError(
            f"the tile size must be a power of two >= 16, got {block}"
            + (f" (the pattern's blocks are {pattern.block} tokens)" if pattern.block else "")
        )
    pattern.check(seqlen, block)
    return block, 1.0 / math.sqrt(dim) if softmax_scale is None else softmax_scale


def sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: Pattern,
    *,
    softmax_scale: float | None = None,
    block: int | None = None,
) -> Tensor:
    """softmax(q k^T * scale, masked by `pattern`) v, exact, for q (batch, seqlen, heads, dim)
    and k, v (batch, seqlen, heads_kv, dim) with heads % heads_kv == 0 (GQA). Self-attention:
    q, k and v have one length. `block`: the kernels' tile size (default 64 on GPUs, 16 under
    the interpreter; a pattern's random or user blocks must be a multiple of it, and are split
    into its tiles); the pattern's layout is built once per shape and cached. A band alone in
    fp16/bf16 runs memfit's FlashAttention with that window instead (module docstring), which
    takes no layout and no `block`. Differentiable."""
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
        raise ValueError(
            f"q (batch, seqlen, heads, dim) and k, v (batch, seqlen, heads_kv, dim) expected, "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    batch, seqlen, heads, dim = q.shape
    if k.shape[:2] != (batch, seqlen) or k.shape[3] != dim or heads % k.shape[2]:
        raise ValueError(
            f"k and v must have q's batch, length and head dim, and heads_kv dividing its "
            f"{heads} heads: got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    block, scale = _settle(pattern, seqlen, q, block, softmax_scale)
    if not _kernels_on(q.device):
        return _dense(q, k, v, dense_mask(pattern, seqlen, block).to(q.device), scale)
    return _run(q, k, v, pattern, block, scale)


@torch.compiler.disable
def _run(q: Tensor, k: Tensor, v: Tensor, pattern: Pattern, block: int, scale: float) -> Tensor:
    """The kernels on batched sequences, outside torch.compile's graphs (a graph break around
    them, as memfit's other Triton ops have: a compiled block runs the kernels instead of
    tracing the dense fallback). A dilated pattern regroups the tokens into its interleaved
    subsequences, one after another in the batch, and back. In fp16/bf16 memfit's
    FlashAttention runs a band alone and long dense subsequences (`_flash_window`)."""
    batch, seqlen = q.shape[:2]
    dilation = pattern.dilation
    if dilation > 1:

        def split(t):
            return t.unflatten(1, (seqlen // dilation, dilation)).transpose(1, 2).flatten(0, 1)

        q, k, v = split(q), split(k), split(v)
    window = _flash_window(pattern, seqlen // dilation, q, scale)
    if window is not None:
        out = flash_attention(
            q, k, v, causal=pattern.causal, window=window, softmax_scale=float(scale)
        )
    else:
        layout = block_layout(pattern, seqlen, block, q.device)
        backward = functools.partial(_backward_layouts, pattern, seqlen, block, q.device)
        out = _SparseAttention.apply(q, k, v, pattern, layout, backward, None, layout.seqlen, scale)
    if dilation > 1:
        out = out.unflatten(0, (batch, dilation)).transpose(1, 2).flatten(1, 2)
    return out


def sparse_attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    pattern: Pattern,
    max_seqlen: int | None = None,
    *,
    softmax_scale: float | None = None,
    block: int | None = None,
) -> Tensor:
    """`sparse_attention` over packed sequences of different lengths (no token sees another
    sequence's): q (total, heads, dim), k, v (total, heads_kv, dim); sequence b is rows
    cu_seqlens[b]:cu_seqlens[b + 1] (int32, batch + 1 entries from 0). Every sequence walks the
    layout of the longest from its own start (`max_seqlen`: at least the longest length; from
    cu_seqlens, with one host sync, when not given; given, it is trusted):
    positions, global tokens and random blocks are per sequence. Dilated patterns take batched
    sequences (`sparse_attention`)."""
    if q.ndim != 3 or k.ndim != 3 or k.shape != v.shape:
        raise ValueError(
            f"packed q (total, heads, dim) and k, v (total, heads_kv, dim) expected, got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2] or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"k and v must have q's rows and head dim, and heads_kv dividing its {q.shape[1]} "
            f"heads: got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    if cu_seqlens.ndim != 1 or cu_seqlens.dtype != torch.int32 or cu_seqlens.numel() < 2:
        raise ValueError(
            "cu_seqlens must be a 1-D int32 tensor of cumulative lengths with batch + 1 >= 2 "
            f"entries, got {tuple(cu_seqlens.shape)} {cu_seqlens.dtype}"
        )
    if pattern.dilation > 1:
        raise ValueError(
            "a dilated pattern takes batched sequences (sparse_attention), each a multiple of "
            f"the dilation {pattern.dilation} long"
        )
    if max_seqlen is None:  # (checked on the host once: one sync; a caller passing it, none)
        offsets = cu_seqlens.tolist()
        lengths = [b - a for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
        if offsets[0] != 0 or min(lengths) < 0 or offsets[-1] != q.shape[0]:
            raise ValueError(
                f"cu_seqlens must start at 0, grow, and end at the {q.shape[0]} packed rows"
            )
        max_seqlen = max(lengths)
    block, scale = _settle(pattern, max_seqlen, q, block, softmax_scale)
    if not _kernels_on(q.device):
        offsets = cu_seqlens.tolist()
        if max(b - a for a, b in zip(offsets[:-1], offsets[1:], strict=True)) > max_seqlen:
            raise ValueError(f"a sequence is longer than max_seqlen = {max_seqlen}")
        mask = dense_mask(pattern, max_seqlen, block).to(q.device)
        pieces = [
            _dense(q[None, a:b], k[None, a:b], v[None, a:b], mask[..., : b - a, : b - a], scale)[0]
            for a, b in zip(offsets[:-1], offsets[1:], strict=True)
        ]
        return torch.cat(pieces)
    return _run_varlen(q, k, v, cu_seqlens, pattern, max_seqlen, block, scale)


@torch.compiler.disable
def _run_varlen(q, k, v, cu_seqlens, pattern, max_seqlen, block, scale) -> Tensor:
    """`_run` for packed sequences."""
    window = _flash_window(pattern, max_seqlen, q, scale)
    if window is not None:
        return flash_attention_varlen(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=pattern.causal,
            window=window, softmax_scale=float(scale),
        )  # fmt: skip
    layout = block_layout(pattern, max_seqlen, block, q.device)
    backward = functools.partial(_backward_layouts, pattern, max_seqlen, block, q.device)
    return _SparseAttention.apply(q, k, v, pattern, layout, backward, cu_seqlens, max_seqlen, scale)
