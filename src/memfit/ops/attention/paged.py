"""Attention over a paged KV cache in Triton: the decode kernel (one new token per sequence, with
a split-K path) and the chunk kernel (new tokens of each sequence against its cached prefix and
themselves, causal: prefill, chunked prefill and mixed steps).

The cache (memfit.inference.PagedKVCache) keeps one layer's keys and values as pools
(num_blocks, PAGE, heads_kv, head_dim); sequence s finds token j at block block_table[s, j //
PAGE], offset j % PAGE. A tile of BLOCK_N keys is gathered token by token through the table, so
any page size and any block ids (non-contiguous, shared) work, and a tile may span pages.

GQA. A program owns one key/value head and all GROUP query heads that share it: its rows are
(query token, head of the group) pairs, so each key/value tile is read once for the whole group
and multiplied as one matrix product (the group is padded to a power of two; a decode program
pads it to 16 rows, the smallest matrix product, which costs nothing in a memory-bound kernel).

Decode (Dao et al. 2023, "Flash-Decoding"): one program per (sequence, kv head) leaves most SMs
idle when there are few sequences (batch 1 at 32k: 8 programs on 132 SMs). The context is then
cut into `num_splits` ranges, one program each, that write an unnormalized partial output with
its running max and sum (fp32); a second kernel merges them. The split count is fixed per launch
(a captured decode step replays it for every context up to its bound); each sequence's own
length is cut into that many ranges of whole tiles, so a short context spreads over the programs
as a long one does and the splits past its end are empty:

    M = max_i m_i,  w_i = exp2(m_i - M),  out = sum_i w_i acc_i / sum_i w_i l_i

The chunk kernel's programs own BLOCK_Q query tokens of one sequence; program i finds its
sequence by a binary search over `query_start` (each sequence is given query_start[s] // BLOCK_Q
+ s as its first program, an upper bound on the blocks before it, so no host-side map is needed
and the grid depends only on the number of tokens and sequences).

Masks: the query at position p (its sequence's length minus the tokens after it in the step)
sees keys j <= p, and with a sliding window W only j > p - W; a program visits only the keys of
its rows' union of windows, so sliding-window models read only their window's blocks. A strided
pattern (the Sparse Transformer's: memfit.ops.attention.sparse.strided) adds the summary columns
j = S - 1, 2S - 1, ... before the window: a program gathers those keys alone, one per S, so it
reads the window's blocks and one block per summary column, not the context.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from memfit.ops._triton import (
    gdc_launch_dependents,
    gdc_wait,
    interpreter_enabled,
    launch,
    pdl_enabled,
    tl,
    triton,
)
from memfit.ops.attention.tiles import _dot, _load_tile, _to_dtype

LOG2E = 1.4426950408889634
NO_WINDOW = 1 << 30


@triton.jit
def _widen(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """A tile in the compute dtype (a quantized cache's: fp8 or int8 widened); through fp32
    under the interpreter, whose int8 -> bf16 cast gives NaN."""
    if INTERPRET:
        x = x.to(tl.float32)
    return x.to(dtype)


@triton.jit
def _attend_pages(
    acc,
    l_i,
    m_i,
    q,
    K,
    V,
    table_row,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    lo,
    hi,
    row_pos,
    row_first,
    offs_d,
    qk_scale,
    stride,
    KS,
    VS,
    scale_heads,
    first_bias,
    first_v,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    MASKED: tl.constexpr,
    INTERPRET: tl.constexpr,
    STRIDED: tl.constexpr = False,
    TOKEN_SCALED: tl.constexpr = False,
    FIRST: tl.constexpr = False,
):
    """The online softmax of the rows of q over keys [lo, hi) of one sequence, gathered through
    its block-table row; row r sees keys row_first[r] <= j <= row_pos[r]. K and V point at the
    program's kv head. Not MASKED: the caller guarantees that every row sees every key of
    [lo, hi) and that the range is whole tiles, so no mask is built and no load is predicated.
    STRIDED: [lo, hi) counts summary columns, key (i + 1) * stride - 1 for i in the range, and
    row r sees those before its window (j < row_first[r]; the window's own are its run's).
    TOKEN_SCALED (an int8 cache): KS and VS point at the program's kv head in the per-token
    scale pools (blocks, PAGE, scale_heads); each key's scale multiplies its scores, each
    value's its softmax weights. FIRST: key 0 (a quantized cache's first position, stored less
    offsets of its own) has first_bias (rows,) added to its scores and its softmax weight times
    first_v (BLOCK_D,) added to the output (`_first_position`)."""
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d[None, :] < HEAD_DIM
    for start in range(lo, hi, BLOCK_N):
        cols = start + offs_n
        col_ok = cols < hi
        if STRIDED:
            cols = (cols + 1) * stride - 1
        if MASKED:
            page = tl.load(table_row + cols // PAGE, mask=col_ok, other=0).to(tl.int64)
        else:
            page = tl.load(table_row + cols // PAGE).to(tl.int64)
        within = cols % PAGE
        k_ptrs = K + (page * stride_kb + within * stride_kt)[:, None] + offs_d[None, :]
        k = _widen(_load_tile(k_ptrs, col_ok, d_ok, MASKED, HEAD_DIM, BLOCK_D), q.dtype, INTERPRET)
        qk = _dot(q, tl.trans(k), None, INTERPRET)
        if TOKEN_SCALED:
            scale_offsets = page * (PAGE * scale_heads) + within * scale_heads
            if MASKED:
                k_scales = tl.load(KS + scale_offsets, mask=col_ok, other=0.0).to(tl.float32)
                v_scales = tl.load(VS + scale_offsets, mask=col_ok, other=0.0).to(tl.float32)
            else:
                k_scales = tl.load(KS + scale_offsets).to(tl.float32)
                v_scales = tl.load(VS + scale_offsets).to(tl.float32)
            qk = qk * k_scales[None, :]
        if FIRST:
            at0 = cols[None, :] == 0
            qk = tl.where(at0, qk + first_bias[:, None], qk)
        if MASKED:
            if STRIDED:
                keep = (cols[None, :] <= row_pos[:, None]) & (cols[None, :] < row_first[:, None])
            else:
                keep = (cols[None, :] <= row_pos[:, None]) & (cols[None, :] >= row_first[:, None])
            qk = tl.where(keep & col_ok[None, :], qk * qk_scale, float("-inf"))
        else:
            qk = qk * qk_scale
        m_ij = tl.maximum(m_i, tl.max(qk, 1))
        # a row that has seen no key yet keeps m = -inf; subtract 0 instead (no -inf - -inf)
        m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
        p = tl.math.exp2(qk - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = V + (page * stride_vb + within * stride_vt)[:, None] + offs_d[None, :]
        v = _widen(_load_tile(v_ptrs, col_ok, d_ok, MASKED, HEAD_DIM, BLOCK_D), q.dtype, INTERPRET)
        weights = p * v_scales[None, :] if TOKEN_SCALED else p
        acc = _dot(_to_dtype(weights, q.dtype, INTERPRET), v, acc * alpha[:, None], INTERPRET)
        if FIRST:
            acc += tl.sum(tl.where(at0, p, 0.0), 1)[:, None] * first_v[None, :]
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def _first_position(
    q, FirstK, FirstV, kv_head, offs_d, HEAD_DIM: tl.constexpr, FIRST: tl.constexpr
):
    """(first_bias, first_v) of `_attend_pages` for the rows of q: q . FirstK[kv_head] in fp32
    and FirstV[kv_head] (each (heads_kv, HEAD_DIM) fp32, in the kernel's units: the first
    position's key and value offsets less the cache's, memfit.inference.PagedKVCache); zeros
    without FIRST."""
    if FIRST:
        d_ok = offs_d < HEAD_DIM
        first_k = tl.load(FirstK + kv_head * HEAD_DIM + offs_d, mask=d_ok, other=0.0)
        first_v = tl.load(FirstV + kv_head * HEAD_DIM + offs_d, mask=d_ok, other=0.0)
        first_bias = tl.sum(q.to(tl.float32) * first_k[None, :], 1)
    else:
        first_v = tl.zeros(offs_d.shape, dtype=tl.float32)
        first_bias = tl.sum(tl.zeros(q.shape, dtype=tl.float32), 1)
    return first_bias, first_v


# Integers that change from step to step are not specialized on (Triton compiles a variant per
# value class, == 1 or a multiple of 16, by default): a serving engine would compile anew in the
# middle of its run whenever the batch crossed one.
@triton.jit(do_not_specialize=["window", "stride", "num_splits", "stride_table"])
def _decode_kernel(
    Q,
    K,
    V,
    Out,
    PartAcc,
    PartM,
    PartL,
    KScale,
    VScale,
    FirstK,
    FirstV,
    block_table,
    seq_lens,
    query_start,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_table,
    qk_scale,
    window,
    stride,
    num_splits,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    SPLIT: tl.constexpr,
    MIXED: tl.constexpr,
    STRIDED: tl.constexpr,
    SCALED: tl.constexpr,
    FIRST: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # launched early (programmatic dependent launch): wait for the cache write
        gdc_launch_dependents()
        gdc_wait()
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = seq  # the token's row of Q and Out
    if MIXED:  # a step with prefill chunks too: only the sequences of one new token are ours
        row = tl.load(query_start + seq)
        if tl.load(query_start + seq + 1) - row != 1:
            return
    seqlen = tl.load(seq_lens + seq)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    g_ok = offs_g < GROUP
    d_ok = offs_d[None, :] < HEAD_DIM
    q_ptrs = Q + row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_ok[:, None] & d_ok, other=0.0)
    if SCALED == 1:  # an fp8 cache: stored k = (k - offset) / k_scale (see PagedKVCache)
        qk_scale = qk_scale * tl.load(KScale + kv_head)
    # SCALED == 2 (an int8 cache): the per-token scale pools (blocks, PAGE, heads_kv)
    ks_base, vs_base, scale_heads = KScale + kv_head, VScale + kv_head, tl.num_programs(1)
    first_bias, first_v = _first_position(q, FirstK, FirstV, kv_head, offs_d, HEAD_DIM, FIRST)

    pos = seqlen - 1
    first = tl.maximum(pos - window + 1, 0)
    # this sequence's keys [first, seqlen) cut into num_splits ranges of whole tiles: the ranges
    # follow the real length, not the longest one the launch allows (a captured step's split
    # count is fixed for any context); the splits past the last key are empty
    chunk = tl.cdiv(tl.cdiv(seqlen - first, num_splits), BLOCK_N) * BLOCK_N
    lo = first + split * chunk
    hi = tl.minimum(lo + chunk, seqlen)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    row_pos = tl.full([GROUP_PAD], 0, dtype=tl.int32) + pos
    row_first = tl.full([GROUP_PAD], 0, dtype=tl.int32) + first
    k_base, v_base = K + kv_head * stride_kh, V + kv_head * stride_vh
    table_row = block_table + seq * stride_table
    acc, l_i, m_i = _attend_pages(
        acc, l_i, m_i, q, k_base, v_base, table_row, stride_kb, stride_kt, stride_vb, stride_vt, lo,
        hi, row_pos, row_first, offs_d, qk_scale, stride, ks_base, vs_base, scale_heads, first_bias, first_v, HEAD_DIM,
        BLOCK_D, BLOCK_N, PAGE, True, INTERPRET, TOKEN_SCALED=SCALED == 2, FIRST=FIRST,
    )  # fmt: skip
    if STRIDED:  # the summary columns before the window, cut into the splits as the keys are
        columns = first // stride  # (those before the window: (i + 1) * stride - 1 < first)
        share = tl.cdiv(columns, num_splits)
        acc, l_i, m_i = _attend_pages(
            acc, l_i, m_i, q, k_base, v_base, table_row, stride_kb, stride_kt, stride_vb, stride_vt,
            split * share, tl.minimum(split * share + share, columns), row_pos, row_first, offs_d,
            qk_scale, stride, ks_base, vs_base, scale_heads, first_bias, first_v, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE, True,
            INTERPRET, True, TOKEN_SCALED=SCALED == 2, FIRST=FIRST,
        )  # fmt: skip
    if SCALED == 1:  # stored v = v / v_scale, and the output is linear in v
        acc = acc * tl.load(VScale + kv_head)
    if SPLIT:
        # partials of (sequence, head, split), laid out (sequences, heads_q, splits[, BLOCK_D])
        row = (seq * (tl.num_programs(1) * GROUP) + heads) * num_splits + split
        tl.store(PartM + row, m_i, mask=g_ok)
        tl.store(PartL + row, l_i, mask=g_ok)
        tl.store(PartAcc + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=g_ok[:, None])
    else:
        out = _to_dtype(acc / tl.where(g_ok, l_i, 1.0)[:, None], Out.dtype.element_ty, INTERPRET)
        o_ptrs = Out + row.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out, mask=g_ok[:, None] & d_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    Out,
    PartAcc,
    PartM,
    PartL,
    query_start,
    stride_ot,
    stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    MIXED: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (sequence, query head): merge the split partials (empty splits have
    m = -inf, l = 0 and weigh nothing)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    seq = tl.program_id(0)
    head = tl.program_id(1)
    out_row = seq
    if MIXED:  # (as in the decode kernel: only sequences of one new token)
        out_row = tl.load(query_start + seq)
        if tl.load(query_start + seq + 1) - out_row != 1:
            return
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    row = (seq * tl.num_programs(1) + head) * num_splits + offs_s
    m = tl.load(PartM + row, mask=s_ok, other=float("-inf"))
    lse = tl.load(PartL + row, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    weight = tl.where(s_ok & (m > float("-inf")), tl.math.exp2(m - m_max), 0.0)
    acc = tl.load(PartAcc + row[:, None] * BLOCK_D + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(lse * weight, 0)
    o_ptrs = Out + out_row.to(tl.int64) * stride_ot + head * stride_oh + offs_d
    tl.store(o_ptrs, _to_dtype(out, Out.dtype.element_ty, INTERPRET), mask=offs_d < HEAD_DIM)


# Arguments that change from step to step (the table width, lengths, token counts: here and in
# the other kernels of a serving step) are not specialized: Triton compiles a variant for an int
# equal to 1 or divisible by 16, a second-long stall of a server the first time a step has one.
@triton.jit(do_not_specialize=["num_seqs", "window", "stride", "stride_table"])
def _chunk_kernel(
    Q,
    K,
    V,
    Out,
    KScale,
    VScale,
    FirstK,
    FirstV,
    block_table,
    seq_lens,
    query_start,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_table,
    qk_scale,
    window,
    stride,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    DECODES_APART: tl.constexpr,
    STRIDED: tl.constexpr,
    SCALED: tl.constexpr,
    FIRST: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    # the sequence: the last s whose first program query_start[s] // BLOCK_Q + s is <= pid
    low = 0
    high = num_seqs
    while low + 1 < high:
        mid = (low + high) // 2
        if tl.load(query_start + mid) // BLOCK_Q + mid <= pid:
            low = mid
        else:
            high = mid
    seq = low
    q_begin = tl.load(query_start + seq)
    q_len = tl.load(query_start + seq + 1) - q_begin
    local = pid - (q_begin // BLOCK_Q + seq)
    if local * BLOCK_Q >= q_len:
        return
    if DECODES_APART and q_len == 1:
        return  # the decode kernel's (a tile of BLOCK_Q tokens would use one)
    seqlen = tl.load(seq_lens + seq)

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    token = local * BLOCK_Q + offs_m // GROUP_PAD  # within the sequence's new tokens
    g = offs_m % GROUP_PAD
    row_ok = (token < q_len) & (g < GROUP)
    d_ok = offs_d[None, :] < HEAD_DIM
    rows = (q_begin + token).to(tl.int64)
    heads = kv_head * GROUP + g
    q_ptrs = Q + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok, other=0.0)
    if SCALED == 1:  # (as in the decode kernel)
        qk_scale = qk_scale * tl.load(KScale + kv_head)
    ks_base, vs_base, scale_heads = KScale + kv_head, VScale + kv_head, tl.num_programs(1)
    first_bias, first_v = _first_position(q, FirstK, FirstV, kv_head, offs_d, HEAD_DIM, FIRST)

    row_pos = seqlen - q_len + token
    row_first = tl.maximum(row_pos - window + 1, 0)
    # the block's keys: [lo, hi) in three runs, as the FlashAttention forward walks its band:
    # masked tiles at the window's left edge, whole tiles every row sees (keys at or before the
    # first row's position and within the last row's window: no mask), masked tiles at the
    # causal diagonal
    first_pos = seqlen - q_len + local * BLOCK_Q
    last_pos = seqlen - q_len + tl.minimum(local * BLOCK_Q + BLOCK_Q, q_len) - 1
    lo = tl.maximum(first_pos - window + 1, 0)
    hi = last_pos + 1
    every_row_from = tl.maximum(last_pos - window + 1, 0)
    mid_lo = tl.minimum(lo + tl.cdiv(every_row_from - lo, BLOCK_N) * BLOCK_N, hi)
    mid_hi = tl.maximum(mid_lo + (first_pos + 1 - mid_lo) // BLOCK_N * BLOCK_N, mid_lo)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    k_base, v_base = K + kv_head * stride_kh, V + kv_head * stride_vh
    table_row = block_table + seq * stride_table
    if STRIDED:  # the summary columns before the last row's window (each row masks its own)
        acc, l_i, m_i = _attend_pages(
            acc, l_i, m_i, q, k_base, v_base, table_row, stride_kb, stride_kt, stride_vb, stride_vt,
            0, every_row_from // stride, row_pos, row_first, offs_d, qk_scale, stride, ks_base,
            vs_base, scale_heads, first_bias, first_v, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE, True, INTERPRET, True,
            TOKEN_SCALED=SCALED == 2, FIRST=FIRST,
        )  # fmt: skip
    acc, l_i, m_i = _attend_pages(
        acc, l_i, m_i, q, k_base, v_base, table_row, stride_kb, stride_kt, stride_vb, stride_vt, lo,
        mid_lo, row_pos, row_first, offs_d, qk_scale, stride, ks_base, vs_base, scale_heads, first_bias, first_v,
        HEAD_DIM, BLOCK_D, BLOCK_N, PAGE, True, INTERPRET, TOKEN_SCALED=SCALED == 2, FIRST=FIRST,
    )  # fmt: skip
    acc, l_i, m_i = _attend_pages(
        acc, l_i, m_i, q, k_base, v_base, table_row, stride_kb, stride_kt, stride_vb, stride_vt,
        mid_lo, mid_hi, row_pos, row_first, offs_d, qk_scale, stride, ks_base, vs_base, scale_heads, first_bias, first_v,
        HEAD_DIM, BLOCK_D, BLOCK_N, PAGE, False, INTERPRET, TOKEN_SCALED=SCALED == 2, FIRST=FIRST,
    )  # fmt: skip
    acc, l_i, m_i = _attend_pages(
        acc, l_i, m_i, q, k_base, v_base, table_row, stride_kb, stride_kt, stride_vb, stride_vt,
        mid_hi, hi, row_pos, row_first, offs_d, qk_scale, stride, ks_base, vs_base, scale_heads, first_bias, first_v,
        HEAD_DIM, BLOCK_D, BLOCK_N, PAGE, True, INTERPRET, TOKEN_SCALED=SCALED == 2, FIRST=FIRST,
    )  # fmt: skip
    if SCALED == 1:
        acc = acc * tl.load(VScale + kv_head)
    out = _to_dtype(acc / tl.where(row_ok, l_i, 1.0)[:, None], Out.dtype.element_ty, INTERPRET)
    o_ptrs = Out + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out, mask=row_ok[:, None] & d_ok)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------

# Decode, per padded head dim: (BLOCK_N, num_warps, num_stages), from a sweep on an H100 (bf16,
# triton 3.6; `benchmarks/inference.py --sweep`): 97-99% of the copy bandwidth at B=64 L=4096
# (D=128). D=64: `benchmarks/paged_tiles.py` on an H200 (results/paged_tiles.json; us a layer,
# cold KV, 128-key tiles against 64): 64 sequences of 100-640 keys 25.3 -> 20.0, 8 of 4096
# 32.1 -> 26.9, 32 of 1000-3000 54.3 -> 45.5, 128 of 2048 and 256 of 200-700 within 1%, batch
# 1 at 4096 keys 11.1 -> 9.4 and at 512 5.0 -> 5.5 (the one loss).
DECODE_CONFIGS = {64: (128, 4, 2), 128: (64, 4, 3)}
# fp8 pools (half the bytes a key): D=128 takes 128-key tiles, the bytes of bf16's 64; an H100
# sweep (`benchmarks/inference.py --parts kv_fp8 --sweep`), us against bf16 pools with theirs:
# B=64 L=4096 289 vs 357, B=16 L=16384 258 vs 359, B=1 L=32768 44 vs 53, B=256 L=512 133 vs
# 185 (bf16's config on fp8: 321, 266, 51, 144). D=64 keeps bf16's (147 vs 195 at B=128 L=2048).
DECODE_CONFIGS_FP8 = {64: (128, 4, 2), 128: (128, 4, 3)}
# int8 pools (per-token scales): the same H100 sweep over 8 configurations, us against bf16's
# (357, 359, 53, 185 at B=64 L=4096, B=16 L=16384, B=1 L=32768, B=256 L=512): (64, 2, 3) 326,
# 347, 47, 177; fp8's (128, 4, 3) 347, 384, 50, 189. Widening int8 and scaling each key's scores
# and each value's weights cost what the halved bytes save: int8 decodes near bf16's speed,
# fp8 1.2-1.4x faster. D=64 keeps fp8's (not swept).
DECODE_CONFIGS_INT8 = {64: (128, 4, 2), 128: (64, 2, 3)}
# Chunk, per padded head dim: (BLOCK_M rows = BLOCK_Q x group, BLOCK_N, num_warps, num_stages).
# D=128: the best of a sweep of 2048 new tokens over prefixes of 0-30k (H100). D=64: the same
# H200 sweeps, each step also decoding 32 sequences, us a layer against (128, 32, 4, 3): 2048
# new tokens over 0 and 4096 cached 150 -> 113 and 479 -> 387, 512 over 1024 81 -> 55, 128 over
# 2000 109 -> 67; a loaded server's mixed step (64 decodes, two prompts' 32-token chunks) 53.5 ->
# 38.2 together with the decode tiles above.
CHUNK_CONFIGS = {64: (64, 64, 4, 3), 128: (128, 32, 4, 3)}
_INTERPRET_BLOCK_N = 16


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few splits, so tests cover the merge
    return torch.cuda.get_device_properties(device).multi_processor_count


PROGRAMS_PER_SM = 2


def decode_splits(num_seqs: int, heads_kv: int, max_seq_len: int, device: torch.device) -> int:
    """How many ranges to cut each sequence's context into: enough programs for PROGRAMS_PER_SM
    per SM (four when a handful of programs would otherwise run: at batch 1 each range is short
    and the extra programs hide the memory latency; H100 sweep), each range at least 256 keys (a
    shorter one costs more in the merge than it saves)."""
    programs, sms = num_seqs * heads_kv, _num_sms(device)
    wanted = -(-(4 if 8 * programs <= sms else PROGRAMS_PER_SM) * sms // programs)
    return max(1, min(wanted, -(-max_seq_len // 256), 128))


def _next_pow2(x: int) -> int:
    return 1 << (max(x, 1) - 1).bit_length()


def paged_attention(
    q: Tensor,
    key_pool: Tensor,
    value_pool: Tensor,
    *,
    block_table: Tensor,
    seq_lens: Tensor,
    query_start: Tensor,
    max_query_len: int,
    max_seq_len: int,
    window: int | None = None,
    stride: int = 0,
    softmax_scale: float | None = None,
    num_splits: int | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    first_key: Tensor | None = None,
    first_value: Tensor | None = None,
) -> Tensor:
    """Causal attention of a step's new tokens over a paged cache that already holds them.

    q: (tokens, heads_q, head_dim), the step's tokens sequence by sequence; key_pool, value_pool:
    (num_blocks, page, heads_kv, head_dim) of one layer; block_table: (sequences, max_blocks)
    int32; seq_lens: (sequences,) int32, each sequence's length after this step; query_start:
    (sequences + 1,) int32, where each sequence's tokens begin in q; max_query_len and
    max_seq_len: host-side bounds (they pick the kernel and the split count; a CUDA graph
    captures them, so pass the largest a captured step may see). Returns (tokens, heads_q,
    head_dim) in q's dtype. Sequences of one new token run the decode kernel, split
    `num_splits` ways (default: `decode_splits`); those of more the chunk kernel. `stride` S > 0
    (with a `window`): a strided pattern's summary columns S - 1, 2S - 1, ... are seen too.
    A quantized cache (`PagedKVCache(kv_dtype=...)`) passes k_scale and v_scale, its keys and
    values stored divided by them (the keys less a constant offset too, which changes no
    softmax): fp8 e4m3 pools one scale a kv head, (heads_kv,) fp32; int8 pools one a token and
    kv head, pools (num_blocks, block_size, heads_kv) fp16 beside theirs. Tiles are widened
    to q's dtype. Such a cache stores each sequence's first key and value less offsets of their
    own and passes first_key and first_value, (heads_kv, head_dim) fp32 each, in the units of
    the stored keys and values: q . first_key is added to the scores of key 0 and its softmax
    weight times first_value to the output (`PagedKVCache.kv_scales`).
    """
    tokens, heads_q, head_dim = q.shape
    _, page, heads_kv, _ = key_pool.shape
    num_seqs = block_table.shape[0]
    if heads_q % heads_kv:
        raise ValueError(f"heads_q={heads_q} must be a multiple of heads_kv={heads_kv}")
    if key_pool.stride(-1) != 1 or value_pool.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("paged_attention needs the head dim contiguous in q and the pools")
    if page & (page - 1):
        raise ValueError(f"the block size must be a power of two, got {page}")
    if stride < 0 or stride == 1 or (stride and window is None):
        raise ValueError(
            f"stride must be 0 (none) or >= 2 beside a window, got stride {stride}, window {window}"
        )
    scaled = k_scale is not None or v_scale is not None
    one_byte = key_pool.dtype in (torch.float8_e4m3fn, torch.int8)
    if key_pool.dtype != value_pool.dtype or not (key_pool.dtype == q.dtype or one_byte):
        raise ValueError(
            f"the pools ({key_pool.dtype}, {value_pool.dtype}) must both be q's dtype {q.dtype} "
            "or float8_e4m3fn or int8"
        )
    if one_byte and not scaled:
        raise ValueError(f"{key_pool.dtype} pools (a quantized cache's) need k_scale and v_scale")
    per_token = key_pool.dtype == torch.int8
    if scaled:
        want = (key_pool.shape[:3], torch.float16) if per_token else ((heads_kv,), torch.float32)
        for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
            if x is None or x.shape != want[0] or x.dtype != want[1] or not x.is_contiguous():
                got = None if x is None else (tuple(x.shape), x.dtype)
                raise ValueError(
                    f"{name} must be {tuple(want[0])} {want[1]}, contiguous, with the other "
                    f"(for {key_pool.dtype} pools), got {got}"
                )
    first = first_key is not None or first_value is not None
    if first:
        for name, x in (("first_key", first_key), ("first_value", first_value)):
            if (
                not scaled
                or x is None
                or x.shape != (heads_kv, head_dim)
                or x.dtype != torch.float32
                or not x.is_contiguous()
            ):
                got = None if x is None else (tuple(x.shape), x.dtype)
                raise ValueError(
                    f"{name} must be ({heads_kv}, {head_dim}) contiguous float32, with the other "
                    f"and the scales of a quantized cache's pools, got {got}"
                )
    else:
        first_key = first_value = q  # (not read)
    scaled = 2 if per_token else int(scaled)  # the kernels' SCALED
    group = heads_q // heads_kv
    block_d = _next_pow2(head_dim)
    scale = (softmax_scale if softmax_scale is not None else head_dim**-0.5) * LOG2E
    window = NO_WINDOW if window is None else window
    out = torch.empty_like(q)
    if not scaled:
        k_scale = v_scale = out  # (not read)
    interpret = interpreter_enabled()
    pdl = pdl_enabled(q.device)
    common = (q.stride(0), q.stride(1), *key_pool.stride()[:3], *value_pool.stride()[:3])
    common += (out.stride(0), out.stride(1), block_table.stride(0), scale, window, max(stride, 1))
    decodes_only = max_query_len == 1 and tokens == num_seqs
    if not decodes_only:
        if interpret:
            block_m, block_n, warps, stages = 16, _INTERPRET_BLOCK_N, 1, 1
        else:
            block_m, block_n, warps, stages = CHUNK_CONFIGS.get(block_d, CHUNK_CONFIGS[128])
        group_pad = _next_pow2(group)
        block_q = max(block_m // group_pad, 1)
        grid = (-(-tokens // block_q) + num_seqs, heads_kv)
        launch(
            _chunk_kernel, grid, q.device,
            q, key_pool, value_pool, out, k_scale, v_scale, first_key, first_value, block_table,
            seq_lens, query_start, num_seqs, *common,
            GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, HEAD_DIM=head_dim,
            BLOCK_D=block_d, BLOCK_N=block_n, PAGE=page, DECODES_APART=num_seqs > 1,
            STRIDED=stride > 0, SCALED=scaled, FIRST=first, INTERPRET=interpret, PDL=pdl,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
        if num_seqs == 1:
            return out
    # Decodes, alone or beside prefill chunks (a mixed step: the decode kernel then takes the
    # sequences of one new token and the chunk kernel the others). The chunk kernel's tile of
    # BLOCK_Q tokens would use one of its rows for a decode, and its programs are too large for
    # many to share an SM: a mixed step's 200 decodes took 114-136 us a layer there (H100).
    if interpret:
        block_n, warps, stages = _INTERPRET_BLOCK_N, 1, 1
    else:
        configs = {torch.int8: DECODE_CONFIGS_INT8, torch.float8_e4m3fn: DECODE_CONFIGS_FP8}
        configs = configs.get(key_pool.dtype, DECODE_CONFIGS)
        block_n, warps, stages = configs.get(block_d, configs[128])
    splits = num_splits or decode_splits(num_seqs, heads_kv, max_seq_len, q.device)
    part = {}
    if splits > 1:
        rows = num_seqs * heads_q * splits
        part["acc"] = torch.empty(rows, block_d, dtype=torch.float32, device=q.device)
        part["m"] = torch.empty(rows, dtype=torch.float32, device=q.device)
        part["l"] = torch.empty(rows, dtype=torch.float32, device=q.device)
    acc, m, lse = part.get("acc", out), part.get("m", out), part.get("l", out)
    mixed = not decodes_only
    launch(
        _decode_kernel, (num_seqs, heads_kv, splits), q.device,
        q, key_pool, value_pool, out, acc, m, lse, k_scale, v_scale, first_key, first_value,
        block_table, seq_lens, query_start, *common,
        splits, GROUP=group, GROUP_PAD=max(16, _next_pow2(group)), HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_N=block_n, PAGE=page, SPLIT=splits > 1, MIXED=mixed,
        STRIDED=stride > 0, SCALED=scaled, FIRST=first, INTERPRET=interpret, PDL=pdl,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if splits > 1:
        launch(
            _merge_splits_kernel, (num_seqs, heads_q), q.device,
            out, acc, m, lse, query_start, out.stride(0), out.stride(1), splits,
            HEAD_DIM=head_dim, BLOCK_D=block_d, SPLITS_PAD=max(16, _next_pow2(splits)),
            MIXED=mixed, INTERPRET=interpret, PDL=pdl,
        )  # fmt: skip
    return out
